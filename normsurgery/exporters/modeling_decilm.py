"""DeciLM ("nemotron-nas") in transformers: Llama's model with each layer at its block config's
widths (key/value heads, MLP units) and its no-op sublayers computing zero, built by normsurgery's
runtime (``modeling_normsurgery.py``, a copy of ``core/runtime.py``: :func:`block_records`).

Copied verbatim beside the weights by ``export --to nemotron-nas``, with
``configuration_decilm.py`` and ``modeling_normsurgery.py``, and named by config.json's
``auto_map`` (``AutoModelForCausalLM``), so ``AutoModelForCausalLM.from_pretrained(folder,
trust_remote_code=True)`` loads the folder with only transformers installed. It is never
imported inside normsurgery (its relative imports name the files beside the weights): the
export loads the folder as a user would.
"""

import copy

from transformers import LlamaForCausalLM

from .configuration_decilm import DeciLMConfig, ffn_width
from .modeling_normsurgery import apply_structure, block_records


class DeciLMForCausalLM(LlamaForCausalLM):
    config_class = DeciLMConfig

    def __init__(self, config):
        """Llama's modules built from a copy of ``config`` that holds the keys Llama reads (every
        layer at full width: ``num_key_value_heads`` = heads, one MLP multiple), then resized and
        replaced layer by layer; the model keeps ``config`` itself."""
        llama = copy.copy(config)
        llama.num_key_value_heads = config.num_attention_heads
        llama.intermediate_size = 256
        for key, default in (("initializer_range", 0.02), ("pad_token_id", None)):
            setattr(llama, key, getattr(config, key, default))
        super().__init__(llama)
        apply_structure(self, block_records(config, lambda mult: ffn_width(mult, config.hidden_size)))
        self.config = self.model.config = config
