"""Tiny models of every supported family, with weights of realistic scale.

Random init (std 0.02) gives near-Gaussian activations of tiny norm; trained checkpoints have
outlier channels and gains far from 1. ``realistic`` rescales the weights, gives norms random
gains and biases and a few residual channels large writes, so a wrong fold shows up.
"""

from __future__ import annotations

import torch
import transformers as T

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
    "phi": lambda: T.PhiConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64),
    "bert": lambda: T.BertConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                                 intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64),
}

CAUSAL = [f for f in CONFIGS if f != "bert"]
LAYERNORM = ["gpt2", "gpt_neox", "opt", "phi"]


def tiny_model(family: str, dtype=torch.float64, seed: int = 0, realistic: bool = True):
    torch.manual_seed(seed)
    cfg = CONFIGS[family]()
    auto = T.AutoModelForMaskedLM if family == "bert" else T.AutoModelForCausalLM
    model = auto.from_config(cfg).to(dtype).eval()
    if realistic:
        make_realistic(model, seed)
    return model


@torch.no_grad()
def make_realistic(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    outliers = torch.randperm(model.config.hidden_size, generator=g)[:3]
    for name, p in model.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
        if p.ndim == 1 and ("norm" in name.lower() or "ln" in name):
            # gains around 1 with spread (Gemma-style zero-init gains too), biases of size 0.3
            p.copy_((1.0 if name.endswith("weight") and p.abs().max() > 0.5 else 0.0) + 0.3 * r)
        elif p.ndim == 1:
            p.copy_(0.1 * r)
        else:
            p.copy_(r * (2.0 / p.shape[-1] ** 0.5))
            if "emb" in name or "wte" in name or "wpe" in name:
                p[..., outliers] *= 8.0


def token_ids(n: int = 2, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))
