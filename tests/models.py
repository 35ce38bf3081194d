"""Tiny models of every supported family, with weights of realistic scale (``synthetic``)."""

from __future__ import annotations

import torch
import transformers as T

from normsurgery.core.synthetic import make_realistic
from normsurgery.core.parity import compare, outputs
from normsurgery.engine.training import train

VOCAB = 96

CONFIGS = {
    "gpt2": lambda: T.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64,
                                 tie_word_embeddings=True),
    "gpt_neox": lambda: T.GPTNeoXConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64),
    "opt": lambda: T.OPTConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64,
                               vocab_size=VOCAB, word_embed_proj_dim=32, max_position_embeddings=64),
    "llama": lambda: T.LlamaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                   max_position_embeddings=64),
    "mistral": lambda: T.MistralConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                       max_position_embeddings=64, sliding_window=None),
    "qwen2": lambda: T.Qwen2Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                   max_position_embeddings=64, tie_word_embeddings=True),
    "qwen3": lambda: T.Qwen3Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                   vocab_size=VOCAB, max_position_embeddings=64),
    "gemma": lambda: T.GemmaConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                   vocab_size=VOCAB, max_position_embeddings=64),
    "gemma2": lambda: T.Gemma2Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=VOCAB,
                                     max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=12,
                                     attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": lambda: T.Gemma3TextConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=8, intermediate_size=64,
                                              vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4,
                                              query_pre_attn_scalar=12, final_logit_softcapping=3.0,
                                              layer_types=["sliding_attention", "full_attention",
                                                           "sliding_attention"]),
    "phi3": lambda: T.Phi3Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                                 partial_rotary_factor=0.5, pad_token_id=0),
    "mixtral": lambda: T.MixtralConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=48, vocab_size=VOCAB,
                                       max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
                                       experts_implementation="eager"),  # grouped_mm takes no float64
    "qwen2_moe": lambda: T.Qwen2MoeConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=48, moe_intermediate_size=16,
                                          shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                          mlp_only_layers=[2], vocab_size=VOCAB, max_position_embeddings=64,
                                          experts_implementation="eager"),
    "granite": lambda: T.GraniteConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                       max_position_embeddings=64, embedding_multiplier=6.0, residual_multiplier=0.3,
                                       attention_multiplier=0.05, logits_scaling=4.0, attention_bias=True),
    "smollm3": lambda: T.SmolLM3Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                       max_position_embeddings=64, no_rope_layers=[1, 0, 1], pad_token_id=0),
    "olmo2": lambda: T.Olmo2Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0),
    "starcoder2": lambda: T.Starcoder2Config(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                             max_position_embeddings=64, use_bias=True, pad_token_id=0),
    "stablelm": lambda: T.StableLmConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                         max_position_embeddings=64, partial_rotary_factor=0.5, use_qkv_bias=True,
                                         use_parallel_residual=True, pad_token_id=0),
    "gptj": lambda: T.GPTJConfig(n_embd=32, n_layer=3, n_head=4, rotary_dim=4, n_inner=64, vocab_size=VOCAB,
                                 n_positions=64),
    "cohere": lambda: T.CohereConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                                     logit_scale=0.3, attention_bias=True, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=2),
    "falcon": lambda: T.FalconConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_kv_heads=2,
                                     new_decoder_architecture=True, bias=True, vocab_size=VOCAB,
                                     max_position_embeddings=64, tie_word_embeddings=False),
    "phi": lambda: T.PhiConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64),
    "bert": lambda: T.BertConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                 intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64),
    "mpnet": lambda: T.MPNetConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                   intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=66),
}

MASKED = ["bert", "mpnet"]  # masked LMs (Post-LN encoders)
CAUSAL = [f for f in CONFIGS if f not in MASKED]
MOE = ["mixtral", "qwen2_moe"]  # mixtures of experts: checkpoints store one tensor per expert
OUTPUT_NORMS = ["gemma2", "gemma3_text", "olmo2"]  # sub-block output norms: passes rewriting the stream refuse
ROTATABLE = [f for f in CAUSAL if f not in OUTPUT_NORMS + MOE]
MINIMIZABLE = ROTATABLE
LAYERNORM = ["gpt2", "gpt_neox", "opt", "phi", "starcoder2", "stablelm", "gptj", "cohere", "falcon"]


def tiny_model(family: str, dtype=torch.float64, seed: int = 0, realistic: bool = True, **config):
    """``config``: entries set on the family's tiny config (a variant: flags, ...)."""
    torch.manual_seed(seed)
    cfg = CONFIGS[family]()
    for k, v in config.items():
        setattr(cfg, k, v)
    auto = T.AutoModelForMaskedLM if family in MASKED else T.AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=dtype).eval()  # buffers computed in dtype, as a loader does
    if realistic:
        make_realistic(model, seed)
    return model


def token_ids(n: int = 2, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


_REMOTE_LOGITS = """import sys, torch, transformers as T
ids = torch.load(sys.argv[1])
for path in sys.argv[2:]:
    m = T.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float64).eval()
    torch.save((type(m.get_output_embeddings()).__name__, m(input_ids=ids).logits), path + '/logits.pt')
"""


def remote_logits(folders, ids, tmp_path) -> dict:
    """folder -> (head class name, logits) from a clean interpreter that cannot import
    normsurgery (only torch and transformers, ``trust_remote_code``)."""
    import subprocess
    import sys

    torch.save(ids, tmp_path / "ids.pt")
    r = subprocess.run([sys.executable, "-I", "-c", _REMOTE_LOGITS, str(tmp_path / "ids.pt")] + [str(f) for f in folders],
                       capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    return {f: torch.load(f"{f}/logits.pt") for f in folders}


def rel(a, b, ids=None) -> float:
    """max |logits_a - logits_b| / max |logits_a| on ``ids`` (default: ``token_ids()``)."""
    ids = token_ids() if ids is None else ids
    return compare(outputs(a, ids), outputs(b, ids)).relative


def torchrun(*args, processes: int = 2, timeout: int = 300, env: dict | None = None):
    """``ARGS`` (a script and its arguments, or ``-m MODULE ...``) under torchrun with ``processes``
    CPU processes on a free port (other runs may hold the default one), one torch thread each,
    from the repository root, with ``env`` added to the environment."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", port,
           *map(str, args)]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun_cli(*args: str, processes: int = 2, timeout: int = 300, env: dict | None = None):
    """``normsurgery ARGS`` under :func:`torchrun`."""
    return torchrun("-m", "normsurgery", *args, processes=processes, timeout=timeout, env=env)


def wrong_weight(folder, dest, key: str = "model.layers.3.mlp.up_proj.weight"):
    """A copy of the checkpoint ``folder`` at ``dest`` with one entry of one matrix (``key``, in
    model.safetensors) moved by 5% of its largest magnitude: a wrong export a check must refuse."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, dest)
    weights = load_file(dest / "model.safetensors")
    w = weights[key]
    w[7, 11] += 0.05 * w.abs().max()
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def distillation_spy(seen: list):
    """``train``, each call's ``distillation=`` appended to ``seen`` (what a trained pass hands its loop)."""
    def spy(model, *args, distillation=None, **kwargs):
        seen.append(distillation)
        return train(model, *args, distillation=distillation, **kwargs)
    return spy
