"""prepbn: the RepBN modules, padding-masked statistics, re-estimation, and the folded result."""

import copy
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

import normsurgery as ns
from normsurgery import checkpoint
from normsurgery.families import layout
from normsurgery.errors import SurgeryError
from normsurgery.passes import prepbn
from normsurgery.registry import PassContext
from normsurgery.runtime import ChannelAffine, RepBN

from models import tiny_model, token_ids

GPT2 = "normsurgery/demo/gpt2-tiny"
SAMPLE = Path("normsurgery/data/sample.txt")
SHAKESPEARE = Path(__file__).resolve().parents[1] / "../shared/data/tinyshakespeare.txt"
#: what computing a normalisation statistic at run time looks like
STATISTICS = {F.layer_norm, F.rms_norm, F.batch_norm, F.group_norm, torch.rsqrt, torch.Tensor.rsqrt,
              torch.var, torch.Tensor.var, torch.std, torch.Tensor.std, torch.var_mean}


class StatisticCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in STATISTICS:
            self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def run_modules(model, ids):
    """Classes of every module that runs in a forward, and the statistic functions called."""
    ran = set()
    hooks = [m.register_forward_hook(lambda mod, a, o: ran.add(type(mod).__name__)) for m in model.modules()]
    with torch.no_grad(), StatisticCalls() as calls:
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return ran, calls.seen


def installed(family, dtype=torch.float32):
    model = tiny_model(family, dtype)
    progs = prepbn.install(model, layout(model))
    return model, progs


def test_lam_schedule_and_budget_check():
    warmup, decay = prepbn.schedule(100, -1, -1)
    assert (warmup, decay) == (10, 80)
    lams = [prepbn.lam_at(s, warmup, decay) for s in range(100)]
    assert lams[:10] == [1.0] * 10 and lams[89] == 0.0 and lams[-1] == 0.0
    assert all(a > b for a, b in zip(lams[9:90], lams[10:90]))  # strictly decreasing over the decay
    with pytest.raises(SurgeryError, match="exceed the budget"):
        prepbn.schedule(100, 30, 80)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_repbn_starts_equal_to_the_norm_with_a_frozen_divisor(family):
    """After the init, RepBN (eval) is g (x - m) / s + b: m the mean of the channel means for
    LayerNorm (0 for RMSNorm), s the mean per-token divisor of the norm's input."""
    model, progs = installed(family, torch.float64)
    ids = token_ids(4, 16)
    prepbn.init_from_norms(model, progs, ids)
    prog = progs[1]
    captured = {}
    h = prog.norm.register_forward_pre_hook(lambda mod, a: captured.update(x=a[0].detach().double()))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    x = captured["x"]
    st = prepbn.input_moments(model, [prog.norm], ids, per_token=[(prog.kind, prog.repbn.eps)])[0]
    g = prog.norm.weight.double()
    b = prog.norm.bias.double() if getattr(prog.norm, "bias", None) is not None else 0.0
    m = st["mean"].mean() if family == "gpt2" else 0.0
    bn = copy.deepcopy(prog.repbn).eval()
    assert torch.allclose(bn(x), g * (x - m) / st["s"] + b, rtol=1e-9, atol=1e-9)
    assert torch.allclose(bn.running_mean, x.reshape(-1, x.shape[-1]).mean(0))


def test_running_statistics_are_frozen_and_used_in_eval_mode():
    bn = RepBN(8).double()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.eta.fill_(0.3)
    bn.eval()
    before = [bn.running_mean.clone(), bn.running_var.clone()]
    x = 5 * torch.randn(3, 7, 8, dtype=torch.float64) + 2
    y = bn(x)
    assert torch.equal(bn.running_mean, before[0]) and torch.equal(bn.running_var, before[1])
    expected = bn.weight * (x - bn.running_mean) / torch.sqrt(bn.running_var + bn.eps) + bn.bias + 0.3 * x
    assert torch.allclose(y, expected, rtol=1e-12, atol=1e-12)
    bn.train()
    bn(x)
    assert not torch.equal(bn.running_mean, before[0])  # training mode moves them


def padded_batch():
    """Two sequences of 16 tokens, the second with 6 of padding on the right."""
    ids = token_ids(2, 16, seed=3)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    return ids, mask


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_padding_does_not_enter_the_statistics(family):
    model, progs = installed(family)
    repbns = [p.repbn for p in progs]
    prepbn.init_from_norms(model, progs, token_ids(2, 16))
    prepbn.finish(model, layout(model), progs)
    ids, mask = padded_batch()
    other = ids.clone()
    other[1, 10:] = (other[1, 10:] + 17) % 96  # different padding tokens
    stats = []
    for batch in (ids, other):
        prepbn.reestimate(model, repbns, batch, attention_mask=mask)
        stats.append(torch.cat([torch.cat([b.running_mean, b.running_var]) for b in repbns]))
    assert torch.allclose(stats[0], stats[1], rtol=1e-6, atol=1e-7)
    prepbn.reestimate(model, repbns, other, attention_mask=torch.ones_like(mask))
    unmasked = torch.cat([torch.cat([b.running_mean, b.running_var]) for b in repbns])
    assert not torch.allclose(stats[1], unmasked, rtol=1e-3, atol=1e-4)  # without the mask they would
    # training-mode forwards (batch statistics, running update) skip the padding too
    hook = prepbn.attach_token_mask(model, repbns)
    moved = []
    for batch in (ids, other):
        for b in repbns:  # training mode for the RepBNs only: the model's dropout stays off
            b.running_mean.zero_()
            b.train()
        with torch.no_grad():
            model(input_ids=batch, attention_mask=mask)
        moved.append(torch.cat([b.running_mean for b in repbns]))
    hook.remove()
    assert torch.allclose(moved[0], moved[1], rtol=1e-6, atol=1e-7)


def test_refuses_post_ln_and_needs_text():
    bert = tiny_model("bert")
    reason = ns.registry.get("prepbn").applies(bert, layout(bert))
    assert "Post-LN" in reason and "per-channel affine" in reason
    with pytest.raises(SurgeryError, match="text"):
        ns.apply_passes(tiny_model("gpt2", torch.float32), [("prepbn", {"steps": 2})])


def test_saved_model_computes_no_statistics(tmp_path):
    """A short end-to-end run on the demo model: trained, re-estimated, folded, saved, loaded."""
    model = checkpoint.load(GPT2, torch.float32)
    ctx = PassContext(tokenizer=checkpoint.load_tokenizer(GPT2), text=SAMPLE.read_text())
    opts = {"steps": 4, "batch_size": 2, "seq_len": 32, "eval_samples": 4, "calib_samples": 4}
    step = ns.apply_passes(model, [("prepbn", opts)], context=ctx)[0]
    assert step.metrics["steps"] == 4 and step.metrics["fold"]["norms_folded"] == len(layout(model).norms)
    ids = token_ids(2, 16)
    checkpoint.save(model, tmp_path / "out")
    loaded = checkpoint.load(tmp_path / "out", torch.float32)
    for m in (model, loaded):
        ran, stats = run_modules(m, ids)
        assert stats == [], f"statistics computed at run time: {stats}"
        assert not ran & {"LayerNorm", "GPT2RMSNorm", "RepBN", "ProgressiveNorm"}
        assert all(isinstance(m.get_submodule(s.path), ChannelAffine) for s in layout(m).norms)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, loaded(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # the unmodified model does compute them (the check can fail)
    assert run_modules(checkpoint.load(GPT2, torch.float32), ids)[1]
