"""Property tests: random small configs of every supported family (widths, heads, KV heads, tied
or untied, biases, parallel or sequential, partial rotary, eps, OPT's project_in/out, Post-LN),
weights of realistic scale. Every exact pass that says it applies is exact in float64 against the
unmodified model; every other one refuses through ``applies()`` with a reason, never a crash.

``make test`` runs a few derandomized examples of each family (profile ``ci``: every family is
drawn every run); ``make fuzz`` many more (``HYPOTHESIS_PROFILE=fuzz``)."""

import copy
import os

import pytest
import torch
import transformers as T

pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e '.[test]')")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import normsurgery as ns
from normsurgery import passes as _passes  # noqa: F401  (the built-in passes, for EXACT)
from normsurgery.core import registry
from normsurgery.core.families import layout
from normsurgery.core.norms import faithful_norms
from normsurgery.core.synthetic import make_realistic

from models import rel

settings.register_profile("ci", max_examples=2, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("fuzz", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

VOCAB = 64
FAMILIES = ["gpt2", "gpt_neox", "opt", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi", "bert",
            "gemma2", "gemma3_text", "phi3", "mixtral", "qwen2_moe", "granite", "smollm3", "olmo2", "starcoder2",
            "stablelm", "gptj", "cohere", "falcon"]
MOE = {"mixtral": (T.MixtralConfig, "num_local_experts"), "qwen2_moe": (T.Qwen2MoeConfig, "num_experts")}
SIMPLE = {"gemma2": T.Gemma2Config, "gemma3_text": T.Gemma3TextConfig, "phi3": T.Phi3Config,
          "smollm3": T.SmolLM3Config, "olmo2": T.Olmo2Config}


@st.composite
def configs(draw, family: str):
    heads = draw(st.sampled_from([2, 4]))
    head_dim = 8
    d = heads * head_dim
    kv = draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    common = dict(vocab_size=VOCAB, max_position_embeddings=32, num_hidden_layers=draw(st.integers(1, 2)),
                  num_attention_heads=heads, hidden_size=d, intermediate_size=draw(st.sampled_from([16, 48])),
                  tie_word_embeddings=draw(st.booleans()))
    eps = draw(st.sampled_from([1e-5, 1e-6, 1e-3]))
    bias = draw(st.booleans())
    if family == "gpt2":
        return T.GPT2Config(n_embd=d, n_layer=common["num_hidden_layers"], n_head=heads, vocab_size=VOCAB,
                            n_positions=32, n_inner=common["intermediate_size"], layer_norm_epsilon=eps,
                            tie_word_embeddings=common["tie_word_embeddings"])
    if family == "gpt_neox":
        return T.GPTNeoXConfig(**common, use_parallel_residual=draw(st.booleans()), layer_norm_eps=eps,
                               rotary_pct=draw(st.sampled_from([0.5, 1.0])), attention_bias=bias)
    if family == "opt":
        common.pop("intermediate_size")
        return T.OPTConfig(**common, ffn_dim=48, word_embed_proj_dim=draw(st.sampled_from([d, d // 2])),
                           enable_bias=bias, do_layer_norm_before=draw(st.booleans()))
    if family in ("llama", "mistral", "qwen2"):
        cls = {"llama": T.LlamaConfig, "mistral": T.MistralConfig, "qwen2": T.Qwen2Config}[family]
        extra = {"attention_bias": bias, "mlp_bias": draw(st.booleans())} if family == "llama" else {}
        extra |= {"sliding_window": None} if family == "mistral" else {}
        return cls(**common, num_key_value_heads=kv, rms_norm_eps=eps, **extra)
    if family in SIMPLE:
        return SIMPLE[family](**common, num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=eps, pad_token_id=0)
    if family in MOE:
        cls, experts = MOE[family]
        return cls(**common, num_key_value_heads=kv, rms_norm_eps=eps, experts_implementation="eager",
                   num_experts_per_tok=2, **{experts: draw(st.sampled_from([2, 4]))})
    if family == "granite":
        return T.GraniteConfig(**common, num_key_value_heads=kv, rms_norm_eps=eps, attention_bias=bias,
                               embedding_multiplier=draw(st.sampled_from([1.0, 12.0])),
                               residual_multiplier=draw(st.sampled_from([1.0, 0.22])),
                               attention_multiplier=draw(st.sampled_from([0.0078125, 0.3])),
                               logits_scaling=draw(st.sampled_from([1.0, 8.0])))
    if family == "gptj":
        return T.GPTJConfig(n_embd=d, n_layer=common["num_hidden_layers"], n_head=heads, vocab_size=VOCAB,
                            n_positions=32, n_inner=common["intermediate_size"], layer_norm_epsilon=eps,
                            rotary_dim=draw(st.sampled_from([4, head_dim])),
                            tie_word_embeddings=common["tie_word_embeddings"])
    if family == "starcoder2":
        return T.Starcoder2Config(**common, num_key_value_heads=kv, norm_epsilon=eps, use_bias=bias, pad_token_id=0)
    if family == "stablelm":
        return T.StableLmConfig(**common, num_key_value_heads=kv, layer_norm_eps=eps, use_qkv_bias=bias,
                                use_parallel_residual=draw(st.booleans()), qk_layernorm=draw(st.booleans()),
                                partial_rotary_factor=draw(st.sampled_from([0.25, 1.0])), pad_token_id=0)
    if family == "cohere":  # per-head QK norms (use_qk_norm) compute in float32: no float64 twin
        return T.CohereConfig(**common, num_key_value_heads=kv, layer_norm_eps=eps, attention_bias=bias,
                              logit_scale=draw(st.sampled_from([0.0625, 1.0, 3.0])), pad_token_id=0,
                              bos_token_id=1, eos_token_id=2)
    if family == "falcon":  # new decoder architecture (one or two norms, parallel) or the old one (parallel or not)
        new = draw(st.booleans())
        common.pop("intermediate_size")
        return T.FalconConfig(**common, num_kv_heads=kv, layer_norm_epsilon=eps, bias=bias,
                              new_decoder_architecture=new,
                              parallel_attn=new or draw(st.booleans()), alibi=not new and draw(st.booleans()),
                              num_ln_in_parallel_attn=draw(st.sampled_from([1, 2])) if new else None)
    if family in ("qwen3", "gemma"):
        cls = T.Qwen3Config if family == "qwen3" else T.GemmaConfig
        return cls(**common, num_key_value_heads=kv, head_dim=head_dim, rms_norm_eps=eps)
    if family == "phi":
        return T.PhiConfig(**common, num_key_value_heads=kv, layer_norm_eps=eps, qk_layernorm=draw(st.booleans()),
                           partial_rotary_factor=draw(st.sampled_from([0.5, 1.0])))
    common.pop("tie_word_embeddings")
    return T.BertConfig(**common, layer_norm_eps=eps)


def build(config, seed: int):
    torch.manual_seed(seed)
    auto = T.AutoModelForMaskedLM if config.model_type == "bert" else T.AutoModelForCausalLM
    model = auto.from_config(config).to(torch.float64).eval()
    make_realistic(model, seed)
    faithful_norms(model)
    return model


EXACT = [p.name for p in registry.all_passes() if p.kind == "exact"]


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=settings.default.max_examples)
@given(data=st.data(), seed=st.integers(0, 2**16))
def test_exact_passes_are_exact_or_refused_with_a_reason(family, data, seed):
    config = data.draw(configs(family))
    model = build(config, seed)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    for name in EXACT:
        reason = registry.get(name).applies(model, layout(model))
        if reason is not None:
            assert isinstance(reason, str) and reason.strip(), (name, reason)
            continue
        new = copy.deepcopy(model)
        ns.apply_passes(new, [(name, {})])
        assert rel(model, new, ids) <= 1e-10, (name, config.model_type, config.to_diff_dict())


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=settings.default.max_examples)
@given(data=st.data(), seed=st.integers(0, 2**16), kind=st.sampled_from(["hadamard", "random"]))
def test_rotate_after_its_folding_pass_is_exact(family, data, seed, kind):
    """The recipe that makes a model rotation-ready, then rotate: exact, or refused with a reason."""
    config = data.draw(configs(family))
    model = build(config, seed)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    fold = next(((n, o) for n, o in (("pre-rmsnorm", {"fold": True}), ("flashnorm", {}))
                 if registry.get(n).applies(model, layout(model)) is None), None)
    if fold is None:
        assert registry.get("rotate").applies(model, layout(model))
        return
    new = copy.deepcopy(model)
    ns.apply_passes(new, [fold])
    reason = registry.get("rotate").applies(new, layout(new))
    if reason is not None:  # sandwich norms, experts: refused with the reason
        assert isinstance(reason, str) and reason.strip()
        return
    ns.apply_passes(new, [("rotate", {"kind": kind, "seed": seed})])
    assert rel(model, new, ids) <= 1e-10, (kind, config.model_type, config.to_diff_dict())
