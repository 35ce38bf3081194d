"""The config of a DeciLM ("nemotron-nas") checkpoint: Llama's, with one block config per layer.

Copied verbatim beside the weights by ``export --to nemotron-nas`` (``normsurgery.exporters.nemotron``) as
``configuration_decilm.py`` and named by config.json's ``auto_map``, so
``AutoConfig.from_pretrained(folder, trust_remote_code=True)`` (how vLLM and TensorRT-LLM read
the folder) works with only transformers installed: it imports nothing else.

Each layer's block config holds its attention (``no_op``: no attention and no input norm;
``n_heads_in_group``: query heads per key/value head) and its MLP (``no_op``: no MLP and no
post-attention norm; ``ffn_mult``: the width is ``int(2 * ffn_mult * hidden_size / 3)`` rounded
up to a multiple of 256, :func:`ffn_width`). The runtimes read them as attributes
(``block.attention.no_op``): held as dataclasses, written back to config.json as dicts.
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from transformers import PretrainedConfig

#: MLP widths are multiples of this (the runtimes' ``_find_multiple(..., 256)``)
FFN_MULTIPLE = 256


def ffn_width(ffn_mult: float, hidden_size: int) -> int:
    """The MLP width the runtimes build from ``ffn_mult`` (vLLM, SGLang, TensorRT-LLM, MLX-LM)."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return width if width % FFN_MULTIPLE == 0 else width + FFN_MULTIPLE - width % FFN_MULTIPLE


@dataclass
class AttentionConfig:
    no_op: bool = False
    replace_with_linear: bool = False
    n_heads_in_group: Optional[int] = None


@dataclass
class FFNConfig:
    no_op: bool = False
    replace_with_linear: bool = False
    ffn_mult: Optional[float] = None


@dataclass
class BlockConfig:
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)

    @classmethod
    def from_dict(cls, data):
        if isinstance(data, cls):
            return data
        return cls(AttentionConfig(**data.get("attention", {})), FFNConfig(**data.get("ffn", {})))

    def to_dict(self):
        return dataclasses.asdict(self)


#: what a DeciLM config holds beside transformers' own fields and the RoPE and block configs, with
#: the defaults of the nemotron-nas config it mirrors (Llama-2-7B's shapes)
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0}


class DeciLMConfig(PretrainedConfig):
    model_type = "nemotron-nas"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, rope_scaling=None, rope_parameters=None, tie_word_embeddings=False, block_configs=None,
                 **kwargs):
        """The fields of :data:`DEFAULTS` (given by name, else their defaults), the RoPE parameters and
        the layers' block configs; the rest is transformers' (``PretrainedConfig``)."""
        for key, default in DEFAULTS.items():
            setattr(self, key, kwargs.pop(key, default))
        # transformers 5 reads rope_parameters, the runtimes rope_theta and (scaled RoPE) rope_scaling
        self.rope_parameters = rope_parameters or rope_scaling or {"rope_type": "default",
                                                                   "rope_theta": self.rope_theta}
        if rope_scaling is not None:
            self.rope_scaling = rope_scaling
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.block_configs = [BlockConfig.from_dict(b) for b in block_configs or []]
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def to_dict(self):
        out = super().to_dict()
        out["block_configs"] = [b.to_dict() for b in self.block_configs]
        return out
