"""minimize / compensated-ln: the minimized model equals the masked one, and is smaller."""

import copy

import pytest
import torch
import transformers as T
from torch import nn
from transformers.models.gptj.modeling_gptj import create_sinusoidal_positions

import normsurgery as ns
from normsurgery.core import algebra
from normsurgery.core import masks
from normsurgery.core.families import layout
from normsurgery.core.analysis import dead_units
from normsurgery.core.runtime import CompensatedLayerNorm, RMSNorm
from normsurgery.core.norms import faithful_norms
from normsurgery.core.parity import outputs

from conftest import apart_runner
from models import MINIMIZABLE, rel, remote_logits, tiny_model, token_ids

GQA = ["llama", "qwen2", "gemma", "granite", "smollm3", "starcoder2", "stablelm", "cohere"]


@torch.no_grad()
def zero(model, path, rows=None, cols=None, bias=True):
    """Zero rows (outputs) or columns (inputs) of a linear's W [out, in], and (``bias``) c's rows."""
    mod = model.get_submodule(path)
    w = algebra.weight(mod)
    if rows is not None:
        w[rows] = 0
        if bias and algebra.has_bias(mod):
            mod.bias[rows] = 0
    if cols is not None:
        w[:, cols] = 0
    algebra.set_weight(mod, w)


def head_cols(site, heads):
    return torch.cat([torch.arange(h * site.head_dim, (h + 1) * site.head_dim) for h in heads])


def masked(family, dtype=torch.float64, units=True, heads=True, channels=(3, 7, 20), **config):
    """A tiny model with dead MLP units (down columns), dead heads (o columns) and dead channels
    (``config``: a variant of the family's tiny config)."""
    model = tiny_model(family, dtype, **config)
    if dtype == torch.float64:
        faithful_norms(model)
    lay = layout(model)
    for i, (attn, mlp) in enumerate(zip(lay.attention, lay.mlps)):
        if units:
            zero(model, mlp.down, cols=torch.arange(i, 64, 5))
        if heads:
            zero(model, attn.o, cols=head_cols(attn, [0, 1] if i == 0 else [1]))
    if channels:
        keep = torch.ones(lay.hidden_size, dtype=torch.bool)
        keep[list(channels)] = False
        masks.apply(model, lay, channels=keep)
    return model


def minimized(model, name="minimize", **options):
    new = copy.deepcopy(model)
    steps = ns.apply_passes(new, [(name, options)])
    return new, steps[-1]


@pytest.mark.parametrize("family", MINIMIZABLE)
def test_minimized_equals_masked_float64(family):
    model = masked(family)
    new, step = minimized(model)
    assert rel(model, new) <= 1e-10
    lay = layout(new)
    assert step.metrics["stream_width"] == [32, 29]
    assert new.get_submodule(lay.token_embedding).weight.shape[1] == 29
    if lay.shared_head_counts:  # Phi-3: the config's head count is every block's, the most any must keep
        assert [a.num_heads for a in lay.attention] == [4, 4, 4] and new.config.num_attention_heads == 4
    else:
        assert [a.num_heads for a in lay.attention] == ([2, 4, 4] if family in GQA + ["mistral", "qwen3", "falcon"]
                                                        else [2, 3, 3])
    assert all(model.get_submodule(m.down).weight.numel() > new.get_submodule(m.down).weight.numel()
               for m in lay.mlps)
    norms = [type(new.get_submodule(s.path)) for s in lay.norms]
    assert set(norms) == {CompensatedLayerNorm if layout(model).norm_kinds == {"layernorm"} else RMSNorm}
    assert step.metrics["params"][1] < step.metrics["params"][0]


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma"])
def test_minimized_equals_masked_float32(family):
    model = masked(family, torch.float32)
    new, _ = minimized(model)
    assert rel(model, new) <= 1e-5


@pytest.mark.parametrize("family", ["gpt2", "phi", "llama"])
def test_plain_norm_over_kept_channels_is_not_equivalent(family):
    """The tests can tell: a LayerNorm (or RMSNorm dividing by d') over the kept channels differs."""
    model = masked(family, units=False, heads=False)
    new, _ = minimized(model)
    for site in layout(new).norms:
        comp = new.get_submodule(site.path)
        if isinstance(comp, CompensatedLayerNorm):
            plain = nn.LayerNorm(comp.dim, eps=comp.eps).double()
            plain.load_state_dict(comp.state_dict())
        else:
            plain = copy.deepcopy(comp)
            plain.divisor = comp.dim
        parent, _, leaf = site.path.rpartition(".")
        setattr(new.get_submodule(parent), leaf, plain)
    assert rel(model, new) > 1e-4


def test_dead_channel_a_layernorm_still_shows_is_kept():
    """Writers zeroed but gains not: LN outputs -g_j mean / std + b_j there, so j must stay."""
    model = tiny_model("gpt_neox")
    lay = layout(model)
    for path in lay.writers:
        zero(model, path, rows=[5])
    with torch.no_grad():
        model.get_submodule(lay.token_embedding).weight[:, 5] = 0
    found = dead_units(model, lay)
    assert found.dead_channels == [5] and found.removable_channels == []
    new, step = minimized(model, "compensated-ln")
    assert step.metrics["stream_width"] == [32, 32]
    assert any("still shows" in n for n in step.notes)
    assert rel(model, new) <= 1e-10


def test_channel_mask_folds_the_norm_bias_into_the_readers():
    """With g_j = 0 the norm outputs the constant b_j: it moves into the readers' biases (the
    bias-free LM head gets one)."""
    model = masked("gpt_neox", units=False, heads=False)
    assert model.lm_head.bias is None
    new, _ = minimized(model)
    assert new.lm_head.bias is not None and new.lm_head.weight.shape == (96, 29)
    assert rel(model, new) <= 1e-10


@pytest.mark.parametrize("family", GQA)
@pytest.mark.parametrize("dead,expect", [([0, 2], (2, 2)), ([0, 1], (2, 1)), ([1], (4, 2)), ([0, 1, 2, 3], (1, 1))])
def test_grouped_kv_heads(family, dead, expect):
    """A kv head goes only with all its query heads; the other groups lose equally many."""
    model = tiny_model(family)
    faithful_norms(model)
    lay = layout(model)
    for attn in lay.attention:
        zero(model, attn.o, cols=head_cols(attn, dead))
    new, _ = minimized(model)
    assert rel(model, new) <= 1e-10
    heads, kv = expect
    for site in layout(new).attention:
        attn = new.get_submodule(site.path)
        assert (site.num_heads, site.num_kv_heads) == expect
        assert attn.q_proj.weight.shape[0] == heads * 8 and attn.k_proj.weight.shape[0] == kv * 8
        assert attn.num_key_value_groups == heads // kv
    ids = token_ids(1, 6)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), new.generate(ids, **kw))  # with the KV cache


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox", "qwen2", "falcon"])
def test_value_dead_heads(family):
    """v rows zero: the head outputs the constant value bias, folded into the output bias where
    there is one (GPT-2, GPT-NeoX, Falcon: both query heads of its kv head 0 go); without one
    (Qwen2) the head must stay."""
    model = tiny_model(family)
    faithful_norms(model)
    site = layout(model).attention[1]
    if site.qkv_order == "separate":
        zero(model, site.v, rows=head_cols(site, [0]), bias=False)
    elif site.qkv_order == "blocks":
        zero(model, site.qkv, rows=2 * 32 + head_cols(site, [1]), bias=False)
    elif site.qkv_order == "groups":  # kv head 0's rows: q 0-15 (two heads), k 16-23, v 24-31
        zero(model, site.qkv, rows=torch.arange(24, 32), bias=False)
    else:  # head 0's rows: q 0-7, k 8-15, v 16-23
        zero(model, site.qkv, rows=torch.arange(16, 24), bias=False)
    new, _ = minimized(model)
    assert rel(model, new) <= 1e-10
    assert layout(new).attention[1].num_heads == {"qwen2": 4, "falcon": 2}.get(family, 3)


def test_mlp_units_with_zero_inputs():
    """Ungated: act(c_i) is a constant folded into down's bias; gated: gate (or up) all zero."""
    gpt2 = tiny_model("gpt2")
    zero(gpt2, "transformer.h.1.mlp.c_fc", rows=torch.arange(10), bias=False)
    llama = tiny_model("llama")
    faithful_norms(llama)
    zero(llama, "model.layers.2.mlp.gate_proj", rows=torch.arange(7))
    zero(llama, "model.layers.2.mlp.up_proj", rows=torch.arange(7, 12))
    for model, layer, left in [(gpt2, 1, 118), (llama, 2, 52)]:
        new, step = minimized(model)
        assert step.metrics["layers"][layer]["mlp_units"][1] == left
        assert rel(model, new) <= 1e-10


def test_magnitude_sparsity_option_equals_the_masked_model():
    model = tiny_model("gpt2")
    lay = layout(model)
    keep = masks.magnitude(model, lay, 0.5)
    assert all(abs((~k).double().mean().item() - 0.5) < 1e-3 for k in keep.values())
    reference = copy.deepcopy(model)
    masks.apply(reference, lay, keep)
    new = copy.deepcopy(model)
    steps = ns.apply_passes(new, [("minimize", {"sparsity": "0.5", "by": "magnitude"})], ids=token_ids(),
                            tolerance=1e-10)
    assert [s.kind for s in steps] == ["reference", "exact"]  # masked first: the reference minimize must equal
    assert steps[1].parity.relative <= 1e-10 and steps[1].parity.ok
    assert rel(reference, new) <= 1e-10
    assert rel(model, new) > 1e-3  # the mask itself changed the function


def stable_argsort_keep(w: torch.Tensor, k: int) -> torch.Tensor:
    """The reference magnitude selection: zero the k smallest |w|, ties by position (stable argsort)."""
    keep = torch.ones(w.numel(), dtype=torch.bool, device=w.device)
    keep[w.detach().abs().flatten().argsort(stable=True)[:k]] = False
    return keep.view(w.shape)


def tied(shape, levels, seed, zeros=0.0) -> torch.Tensor:
    """Entries drawn from ``levels`` values (both signs: |w| ties across them), a ``zeros`` fraction
    of them planted exact zeros (signed: -0.0 and 0.0 tie too)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.tensor(levels)[torch.randint(len(levels), shape, generator=g)]
    w = w * (torch.randint(2, shape, generator=g) * 2 - 1)
    return torch.where(torch.rand(shape, generator=g) < zeros, 0.0 * w, w)


def selection_cases():
    """(name, matrix, ks): realistic random matrices, heavy ties, all-equal; k = 0, small, half,
    numel - 1 (and ones landing inside a run of ties)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype, shape in [(torch.float32, (1024, 2816)), (torch.bfloat16, (1024, 2816)), (torch.float64, (384, 1000))]:
        out.append((f"randn {dtype}", (torch.randn(shape, generator=g) * 0.02).to(dtype), None))
    out.append(("bfloat16 small randn (many ties)", (torch.randn(512, 700, generator=g) * 0.02).bfloat16(), None))
    out.append(("levels", tied((700, 600), [0.01, 0.02, 0.03, 0.05], 1), None))
    out.append(("levels, half zeros", tied((1000, 700), [0.01, 0.02], 2, zeros=0.5), None))
    out.append(("levels, planted zeros, bfloat16", tied((600, 512), [0.5, 0.25, 0.125], 3, zeros=0.2).bfloat16(), None))
    out.append(("all equal", torch.full((300, 700), 0.02), None))
    out.append(("all zero", torch.zeros(257, 300), None))
    out.append(("one row", torch.randn(1, 5000, generator=g), None))
    return out


@pytest.mark.parametrize("name,w,_", selection_cases(), ids=[c[0] for c in selection_cases()])
def test_magnitude_selection_is_the_stable_argsorts(name, w, _):
    """masks.drop_smallest (threshold + ties by position) gives the stable argsort's mask bit for
    bit, at sparsity 0, a small k, 0.3, 0.5, numel - 1 and numel."""
    n = w.numel()
    for k in (0, 1, 7, round(0.3 * n), round(0.5 * n), n - 1, n):
        got, want = masks.drop_smallest(w, k), stable_argsort_keep(w, k)
        assert got.dtype == torch.bool and got.shape == w.shape
        assert torch.equal(got, want), (name, k, (got != want).sum().item())
        assert (~got).sum().item() == k


@pytest.mark.parametrize("block", [1, 5, 64])
def test_magnitude_ties_cross_blocks(monkeypatch, block):
    """The tie cut found across many counting blocks (block sizes that split runs of ties), for every
    k on a small tied matrix; the rule fails if the last equal entries went instead of the first."""
    monkeypatch.setattr(masks, "BLOCK", block)
    w = tied((13, 17), [0.1, 0.2, 0.3], 4, zeros=0.3)
    for k in range(w.numel() + 1):
        assert torch.equal(masks.drop_smallest(w, k), stable_argsort_keep(w, k)), k
    first = masks.drop_smallest(torch.ones(4, 5), 7).flatten()  # all equal: the first 7 go
    assert first.tolist() == [False] * 7 + [True] * 13


def test_magnitude_threshold_is_torch_kthvalue():
    """The host's selection (NumPy introselect on the |w| copy) gives torch.kthvalue's value, which
    other devices use."""
    g = torch.Generator().manual_seed(5)
    for w in [torch.randn(300, 200, generator=g) * 0.02, (torch.randn(300, 200, generator=g) * 0.02).bfloat16(),
              torch.randn(300, 200, generator=g, dtype=torch.float64), tied((300, 200), [0.1, 0.2], 6, 0.4)]:
        for k in (1, 17, 30000, 59999, 60000):
            assert masks._kth_abs(w, k) == torch.kthvalue(w.abs().flatten(), k).values.item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no GPU here")
def test_magnitude_selection_on_cuda():
    for name, w, _ in selection_cases():
        n = w.numel()
        for k in (0, 1, round(0.5 * n), n - 1):
            got = masks.drop_smallest(w.cuda(), k)
            assert got.device.type == "cuda" and torch.equal(got.cpu(), stable_argsort_keep(w, k)), (name, k)


def test_magnitude_masks_every_block_matrix_by_the_rule():
    model = tiny_model("llama")
    lay = layout(model)
    keep = masks.magnitude(model, lay, 0.37)
    assert keep.keys() == masks.block_weights(model, lay).keys()
    for name, w in masks.block_weights(model, lay).items():
        assert torch.equal(keep[name], stable_argsort_keep(w, round(0.37 * w.numel()))), name


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_prune_channels_option(family, tmp_path):
    model = tiny_model(family)
    faithful_norms(model)
    lay = layout(model)
    keep = masks.prune_channels(masks.channel_energies(model, lay), 4)
    reference = copy.deepcopy(model)
    masks.apply(reference, lay, channels=keep)
    new, step = minimized(model, prune_channels="4")
    assert step.metrics["stream_width"] == [32, 28]
    assert rel(reference, new) <= 1e-10
    masks.save(tmp_path / "mask.safetensors", channels=keep)
    from_file, _ = minimized(model, mask=str(tmp_path / "mask.safetensors"))
    assert rel(reference, from_file) <= 1e-10


def test_mask_then_minimize_keeps_per_pass_parity():
    """As a recipe, the mask pass (function changed on purpose) then minimize (exact)."""
    model = tiny_model("gpt2")
    steps = ns.apply_passes(model, [("mask", {"sparsity": 0.3, "prune_channels": 2}), ("minimize", {})],
                            ids=token_ids(), tolerance=1e-10)
    assert steps[0].kind == "reference" and steps[0].parity.relative > 1e-3
    assert steps[1].parity.ok and steps[1].metrics["stream_width"] == [32, 30]


def test_compensated_ln_removes_channels_only():
    model = masked("gpt2")
    new, step = minimized(model, "compensated-ln")
    assert step.metrics["stream_width"] == [32, 29]
    assert new.transformer.h[0].mlp.c_fc.weight.shape == (29, 128)
    assert new.transformer.h[0].attn.c_proj.weight.shape == (32, 29)
    assert rel(model, new) <= 1e-10


def test_minimize_again_keeps_the_full_width_statistics():
    """A minimized model masked further and minimized again still divides by the stock d."""
    model = masked("phi", channels=(1, 2))
    once, _ = minimized(model)
    keep = torch.ones(30, dtype=torch.bool)
    keep[[0, 10]] = False
    masks.apply(once, layout(once), channels=keep)
    twice, step = minimized(once)
    assert step.metrics["stream_width"] == [30, 28]
    assert twice.model.final_layernorm.full_dim == 32
    assert rel(once, twice) <= 1e-10


def test_dead_units_report():
    found = dead_units(masked("llama"), layout(tiny_model("llama")))
    assert found.width == 32 and found.dead_channels == [3, 7, 20] == found.removable_channels
    first = found.layers[0]
    assert first.dead_units == list(range(0, 64, 5)) and first.mlp_units == 64
    assert first.dead_heads == [0, 1] and first.removable_heads == [0, 1] and first.removable_kv_heads == [0]
    assert found.layers[1].dead_heads == [1] and found.layers[1].removable_heads == []


def test_uniform_widths_go_to_the_config_and_save_a_plain_checkpoint(tmp_path):
    model = tiny_model("llama", torch.float32)
    lay = layout(model)
    for attn, mlp in zip(lay.attention, lay.mlps):
        zero(model, mlp.down, cols=torch.arange(0, 64, 4))
        zero(model, attn.o, cols=head_cols(attn, [1, 3]))
    new, step = minimized(model)
    assert (new.config.intermediate_size, new.config.num_attention_heads, new.config.num_key_value_heads) == (48, 2, 2)
    saved = ns.save(new, tmp_path / "out")
    assert saved["custom_modules"] == 0 and "modeling_normsurgery.py" not in saved["files"]
    plain = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert rel(model, plain) <= 1e-5


def test_saved_outputs_load_both_ways(tmp_path):
    ids = token_ids()
    outs = {}
    for family in ["gpt2", "llama", "qwen2"]:
        new, _ = minimized(masked(family))
        out = tmp_path / family
        saved = ns.save(new, out)
        assert "modeling_normsurgery.py" in saved["files"] and not saved["plain_transformers"]
        back = ns.load(out, dtype=torch.float64)
        assert isinstance(back.get_submodule(layout(back).norms[0].path), (CompensatedLayerNorm, RMSNorm))
        faithful_norms(back)
        assert rel(new, back, ids) <= 1e-12
        outs[family] = (new, out)
    remote = remote_logits([o for _, o in outs.values()], ids, tmp_path)
    for family, (new, out) in outs.items():
        theirs = remote[out][1]
        mine = outputs(new, ids)
        assert ((theirs - mine).abs().max() / mine.abs().max()).item() <= 1e-12


VARIANTS = {"gptj": ("gptj", {}), "stablelm sequential": ("stablelm", dict(use_parallel_residual=False)),
            "stablelm qk layernorm": ("stablelm", dict(qk_layernorm=True)),
            "cohere qk norm": ("cohere", dict(use_qk_norm=True)), "falcon": ("falcon", {})}


def test_per_layer_head_counts_of_attentions_reading_their_own_save_and_load_both_ways(tmp_path):
    """GPT-J, StableLM and Falcon read head counts off the attention module (not the config),
    Cohere's QK norm gains have one row per head, StableLM's one LayerNorm per head: a minimized
    model generates as the masked one (KV cache), saves, and loads with the counts and per-head
    norms restored, in this process and in a clean one."""
    ids = token_ids()
    outs = {}
    for name, (family, config) in VARIANTS.items():
        model = masked(family, **config)
        new, _ = minimized(model)
        assert rel(model, new) <= 1e-10, name
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(token_ids(1, 6), **kw), new.generate(token_ids(1, 6), **kw)), name
        lay = layout(new)
        assert [a.num_heads for a in lay.attention] == ([2, 3, 3] if family == "gptj" else [2, 4, 4]), name
        out = tmp_path / name.replace(" ", "-")
        ns.save(new, out)
        back = ns.load(out, dtype=torch.float64)
        faithful_norms(back)
        assert rel(new, back, ids) <= 1e-12, name
        first = back.get_submodule(lay.attention[0].path)
        if family == "cohere":
            assert first.q_norm.weight.shape == (2, 8) and first.k_norm.weight.shape == (1, 8)
        else:
            assert getattr(first, "num_attention_heads" if family == "gptj" else "num_heads") == 2
        if config.get("qk_layernorm"):
            assert len(first.q_layernorm.norms) == 2 and len(first.k_layernorm.norms) == 1
        outs[name] = (new, out)
    remote = remote_logits([o for _, o in outs.values()], ids, tmp_path)
    gptj = outs["gptj"][0].transformer.rotary_emb  # a loader builds GPT-J's rotary table in float32
    gptj.embed_positions.copy_(create_sinusoidal_positions(gptj.max_positions, gptj.pos_embd_dim))
    for name, (new, out) in outs.items():
        mine = outputs(new, ids)
        assert ((remote[out][1] - mine).abs().max() / mine.abs().max()).item() <= 1e-12, name


def phi3_masked(dtype):
    """Phi-3 with heads 0-1, 2-3 and 0-2 dead in its blocks; in each, units 0-7 dead by the gate's
    rows (act(0) = 0), 8-15 by the up's rows, 16-23 by down's columns."""
    model = tiny_model("phi3", dtype)
    if dtype == torch.float64:
        faithful_norms(model)
    lay = layout(model)
    for attn, mlp, dead in zip(lay.attention, lay.mlps, ([0, 1], [2, 3], [0, 1, 2])):
        zero(model, attn.o, cols=head_cols(attn, dead))
        zero(model, mlp.up, rows=torch.arange(0, 8))
        zero(model, mlp.up, rows=64 + torch.arange(8, 16))
        zero(model, mlp.down, cols=torch.arange(16, 24))
    return model


def test_phi3_blocks_keep_one_head_count_and_its_fused_rows_shrink_to_a_plain_checkpoint(tmp_path):
    """Phi-3 reads the query rows' count off the shared config: every block keeps the most any
    must (2 query heads, 1 kv head: layer 2 keeps its dead head 2); its stacked gate_up loses
    gate and up rows together. Uniform widths: the config says them, the checkpoint is stock."""
    model = phi3_masked(torch.float64)
    new, _ = minimized(model)
    assert rel(model, new) <= 1e-10
    assert [(a.num_heads, a.num_kv_heads) for a in layout(new).attention] == [(2, 1)] * 3
    assert new.model.layers[0].self_attn.qkv_proj.weight.shape == (32, 32)  # q 16, k 8, v 8 rows
    assert new.model.layers[0].mlp.gate_up_proj.weight.shape == (80, 32)
    assert (new.config.num_attention_heads, new.config.num_key_value_heads, new.config.intermediate_size) == (2, 1, 40)
    model = phi3_masked(torch.float32)
    new, _ = minimized(model)
    saved = ns.save(new, tmp_path / "out")
    assert saved["custom_modules"] == 0
    plain = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(plain) is type(model) and rel(model, plain) <= 1e-5


def test_gpt_neox_round_trip(tmp_path):
    new, _ = minimized(masked("gpt_neox"))
    ns.save(new, tmp_path / "out")
    back = ns.load(tmp_path / "out", dtype=torch.float64)
    assert rel(new, back) <= 1e-12


@pytest.mark.parametrize("family,passes,reason", [
    ("bert", [("minimize", {})], "Post-LN"),
    ("gpt2", [("crmsnorm", {}), ("minimize", {})], "is a crmsnorm"),
    ("gpt2", [("minimize", {"by": "wanda", "sparsity": 0.5})], "option by 'wanda': choose one of magnitude, activation"),
    ("gpt2", [("minimize", {"sparsity": 1.5})], "sparsity"),
])
def test_refusals(family, passes, reason):
    with pytest.raises(ns.SurgeryError, match=reason):
        ns.apply_passes(tiny_model(family), passes)


def test_a_loaded_minimized_checkpoint_saves_again(tmp_path):
    """Per-layer head counts survive load -> save -> load (they live in module attributes)."""
    new, _ = minimized(masked("gpt2"))
    ns.save(new, tmp_path / "a")
    again = ns.load(tmp_path / "a", dtype=torch.float64)
    ns.save(again, tmp_path / "b")
    third = ns.load(tmp_path / "b", dtype=torch.float64)
    ids = token_ids()
    ref = new(ids).logits
    assert ((third(ids).logits - ref).abs().max() / ref.abs().max()).item() <= 1e-12


def test_bytes_are_counted_in_the_storage_dtype(tmp_path):
    """Issue 28: a bf16 checkpoint's sizes in bytes are bf16's (2 per value), not the working
    float32's: the "after" figure is what the written tensors hold."""
    from safetensors.torch import load_file
    from importlib import import_module

    tiny_model("llama", torch.float32).to(torch.bfloat16).save_pretrained(tmp_path / "in")
    result = import_module("normsurgery.commands.convert").convert(tmp_path / "in", tmp_path / "out",
                                                          [("minimize", {"prune_units": 0.25})], verify=False)
    step = result.steps[-1]
    written = sum(t.numel() * t.element_size() for f in (tmp_path / "out").glob("*.safetensors")
                  for t in load_file(f).values())
    assert step.metrics["bytes"] == [2 * step.metrics["params"][0], written]
    assert f"bytes {2 * step.metrics['params'][0]:,} -> {written:,}" in step.notes[-1]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_shrinking_selects_in_the_weights_own_dtype(family):
    """Channels, units and heads are kept by selecting a matrix's entries as it is held (exact in
    any dtype): no float64 matrix is made (an embedding's copy would double a streamed part's
    memory), and the entries kept are the ones held, bit for bit (GPT-2's Conv1D stores W^T)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from normsurgery.passes import _shrink

    class Float64Matrices(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.made += [func for t in tree_leaves(out)
                          if isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.dim() > 1]
            return out

    model = tiny_model(family, torch.float32)
    lay = layout(model)
    embedding, writer, reader = (model.get_submodule(p) for p in (lay.embeddings[0], lay.writers[0],
                                                                    lay.norms[0].readers[0]))
    keep = torch.tensor([0, 2, 3, 7])
    expected = [algebra.weight(embedding)[:, keep], algebra.weight(writer)[keep], algebra.weight(reader)[:, keep]]
    with Float64Matrices() as seen:
        _shrink.keep_outputs(embedding, keep)
        _shrink.keep_outputs(writer, keep)
        _shrink.keep_inputs(reader, keep)
    assert seen.made == []
    for mod, want in zip((embedding, writer, reader), expected):
        assert mod.weight.dtype == torch.float32 and torch.equal(algebra.weight(mod), want)


def test_head_counts_the_config_class_refuses_are_recorded_by_the_modules(tmp_path):
    """Found on a 2048-wide Llama with 16 heads: minimize kept 11 in every block, and writing 11 into
    LlamaConfig (hidden_size a multiple of the head count, checked on saving and loading) failed the
    save with an internal error. The config keeps its counts, the attention modules record theirs,
    and the output loads (through the runtime) computing the masked model."""
    from normsurgery.io.checkpoint import config_refusal

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=4, intermediate_size=64, vocab_size=96,
                                             max_position_embeddings=64)).to(torch.float64)
    zero(model, "model.layers.0.self_attn.o_proj", cols=head_cols(layout(model).attention[0], [1]), bias=False)
    zero(model, "model.layers.1.self_attn.o_proj", cols=head_cols(layout(model).attention[1], [2]), bias=False)
    model.save_pretrained(tmp_path / "in")
    result = ns.convert(tmp_path / "in", tmp_path / "out", [("minimize", {})])
    assert result.ok
    notes = " ".join(n for s in result.steps for n in s.notes)
    out = ns.load(tmp_path / "out")
    assert [a.num_heads for a in layout(out).attention] == [3, 3]
    refused = config_refusal(T.LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8), num_attention_heads=3)
    if refused is not None:  # transformers that checks it
        assert "LlamaConfig refuses 3" in notes and out.config.num_attention_heads == 4
    ids = token_ids(seed=4)
    assert rel(model, out, ids) <= 1e-10


def test_a_destructive_prune_is_saved_with_a_warning_and_a_mild_one_without(tmp_path):
    """Issue 47.4: `convert smollm2 --pass minimize:prune_units=0.1` kept 15% of the input's top-1
    predictions, and the garbage it generated was saved with exit 0 and no word. A step that changes
    the function on purpose and keeps fewer than DAMAGING_TOP1 of them now says so in one warning
    line (stderr), in --json's warnings and in the saved record; the exit code stays 0."""
    import json

    from normsurgery.cli import app
    from normsurgery.commands.convert import DAMAGING_TOP1
    from normsurgery.core.parity import probe_ids

    runner = apart_runner()
    demo = "normsurgery/demo/llama-tiny"
    source = ns.Source.open(demo)
    probe = probe_ids(source.tokenizer, source.config.vocab_size, None, 4, 64)  # convert's probe
    reference = outputs(ns.load(demo), probe).argmax(-1)
    for fraction, damaging in ((0.02, False), (0.2, True)):
        out = tmp_path / f"units{fraction}"
        r = runner.invoke(app, ["convert", demo, str(out), "--pass", f"minimize:prune_units={fraction}", "--json"])
        assert r.exit_code == 0, r.output
        data = json.loads(r.stdout)
        agreement = (outputs(ns.load(out), probe).argmax(-1) == reference).double().mean().item()  # the saved folder's
        assert (agreement < DAMAGING_TOP1) == damaging, agreement
        lines = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
        record = json.loads((out / "config.json").read_text())["normsurgery"]
        if not damaging:
            assert not lines and not data["warnings"] and "warnings" not in record, r.stderr
            continue
        assert len(lines) == 1 and data["warnings"] == [lines[0].removeprefix("warning: ")] == record["warnings"]
        assert f"top-1 agreement with the model before it {agreement:.3f}" in lines[0], (lines, agreement)
        assert "by=activation" in lines[0] and "normsurgery heal" in lines[0] and "KL" in lines[0]
        assert f"**Warning:** {record['warnings'][0]}" in (out / "README.md").read_text()  # the card


def test_a_minimize_that_removed_nothing_is_compared_with_the_input(tmp_path):
    """Issue 47.11: with nothing masked, the output was said to be compared with "the model after
    minimize (reference) (reference: it changes the function on purpose)", which changed nothing."""
    from typer.testing import CliRunner

    from normsurgery.cli import app

    r = CliRunner().invoke(app, ["convert", "normsurgery/demo/gpt2-tiny", str(tmp_path / "out"), "--pass", "minimize"])
    assert r.exit_code == 0 and "saved folder vs the input (logits)" in r.output, r.output
    assert "reference" not in r.output and "that model vs the input" not in r.output, r.output
