"""prepbn: the RepBN modules, padding-masked statistics, re-estimation, and the folded result."""

import copy
from pathlib import Path

import pytest
import torch
import transformers as T
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

import normsurgery as ns
from normsurgery.core import registry
from normsurgery.io.loader import load
from normsurgery.io.source import Source
from normsurgery.core.families import layout
from normsurgery.core.errors import SurgeryError
from normsurgery.passes import prepbn
from normsurgery.core.registry import PassContext, get
from normsurgery.engine.teacher import frozen_distillation
from normsurgery.engine.training import heldout_ce, train
from normsurgery.core.runtime import NoNorm, RepBN

from models import distillation_spy, tiny_model, token_ids

GPT2 = "normsurgery/demo/gpt2-tiny"
SAMPLE = Path("normsurgery/data/sample.txt")
#: held-out CE increase at 40 steps of 8 x 64 tokens, lr 3e-4, bundled sample text: measured +0.104
BOUND_40_STEPS = 0.2
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
    warmup, decay = prepbn.schedule(100, None, None)
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
    reason = registry.get("prepbn").applies(bert, layout(bert))
    assert "Post-LN" in reason and "per-channel affine" in reason
    with pytest.raises(SurgeryError, match="text"):
        ns.apply_passes(tiny_model("gpt2", torch.float32), [("prepbn", {"steps": 2})])


def run_pass(model, workdir=None, interrupt_at=None, train=train, **options):
    opts = {**get("prepbn").options, "steps": 12, "batch_size": 2, "seq_len": 32, "eval_samples": 2,
            "calib_samples": 4, "lr": 1e-3, **options}

    def progress(done, total, loss):
        if done == interrupt_at:
            raise KeyboardInterrupt

    ctx = PassContext(options=opts, tokenizer=Source.open(GPT2).tokenizer, text=SAMPLE.read_text(),
                      train=train, heldout_ce=heldout_ce, workdir=workdir, train_progress=progress,
                      distillation=frozen_distillation)
    return get("prepbn").apply(model, layout(model), ctx)


def small_gpt2():
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=1024, n_positions=64))


def test_resume_continues_an_interrupted_run_to_the_same_model(tmp_path):
    whole, resumed = small_gpt2(), small_gpt2()
    ref = run_pass(whole, tmp_path / "a", save_every=4)
    with pytest.raises(KeyboardInterrupt):
        run_pass(small_gpt2(), tmp_path / "b", interrupt_at=10, save_every=4)  # state of step 8 saved
    got = run_pass(resumed, tmp_path / "b", save_every=4, resume=True)
    assert got.metrics["curve"] == ref.metrics["curve"]
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_quality_and_no_statistics_after_a_short_run(tmp_path):
    """gpt2-tiny after 40 steps of 8 x 64 tokens: held-out CE within the bound measured, the
    folded model equal to the re-estimated one; saved and loaded, it computes no statistic."""
    model = load(GPT2, torch.float32)
    m = run_pass(model, steps=40, batch_size=8, seq_len=64, lr=3e-4, eval_samples=16, calib_samples=16).metrics
    assert m["ce_delta"] < BOUND_40_STEPS, m["curve"]
    assert abs(m["ce_folded"] - m["ce_after"]) < 1e-4
    assert m["fold"]["norms_folded"] == len(layout(model).norms)
    ids = token_ids(2, 16)
    ns.save(model, tmp_path / "out")
    loaded = load(tmp_path / "out", torch.float32)
    for m in (model, loaded):
        ran, stats = run_modules(m, ids)
        assert stats == [], f"statistics computed at run time: {stats}"
        assert not ran & {"LayerNorm", "RepBN", "ProgressiveNorm"}
        assert all(isinstance(m.get_submodule(s.path), NoNorm) for s in layout(m).norms)
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, loaded(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # the unmodified model does compute them (the check can fail)
    assert run_modules(load(GPT2, torch.float32), ids)[1]


def test_a_schedule_the_budget_cannot_hold_is_refused_before_the_weights_are_read(monkeypatch):
    """warm-up + decay over the step budget: refused from the options alone, nothing loaded."""
    from normsurgery.engine import sweep

    def no_reading(*a, **k):
        raise AssertionError("weights read before the schedule was checked")

    monkeypatch.setattr(sweep.Loader, "load", no_reading)
    with pytest.raises(SurgeryError, match="warm-up 30 \\+ decay 80 steps exceed the budget of 100"):
        ns.convert(GPT2, "unused-out", [("prepbn", {"steps": 100, "warmup": 30, "decay": 80})], text=SAMPLE)
    assert not Path("unused-out").exists()



def test_final_aux_pulls_only_from_the_decay_and_changes_the_run():
    """final_aux=W: from the decay's start (step = warm-up) each training forward adds the final
    norm's auxiliary loss, never before; 0 is the plain run, bit for bit; a weight changes the
    trained model and says so."""
    added = []

    def spy(*args, extra_loss=None, **kw):  # records what each training forward adds to its loss
        assert extra_loss is not None
        return train(*args, extra_loss=lambda: added.append(extra_loss()) or added[-1], **kw)

    plain, zero, aux = small_gpt2(), small_gpt2(), small_gpt2()
    a = run_pass(plain, control=False, warmup=4, decay=8)
    b = run_pass(zero, control=False, warmup=4, decay=8, final_aux=0.0)
    c = run_pass(aux, control=False, warmup=4, decay=8, final_aux=1.0, train=spy)
    assert a.metrics["curve"] == b.metrics["curve"]
    for (name, p), q in zip(plain.state_dict().items(), zero.state_dict().values()):
        assert torch.equal(p, q), name
    assert len(added) == 12 and added[:4] == [None] * 4 and all(t is not None and t.item() > 0 for t in added[4:])
    assert c.metrics["final_aux"] == 1.0 and any("auxiliary loss on its input, weight 1, from step 4" in n
                                                 for n in c.notes)
    assert not all(torch.equal(p, q) for p, q in zip(plain.state_dict().values(), aux.state_dict().values()))


def test_objective_kd_reaches_the_loop_from_a_frozen_copy_of_the_input():
    """objective kd reaches the loop, its teacher computing the pass's input (its logits equal the
    input's, after training); the default ce holds none."""
    model, ids = small_gpt2(), token_ids(2, 16, seed=3)
    want = model.eval()(input_ids=ids).logits.detach()  # (no dropout)
    seen = []
    spy = distillation_spy(seen)
    report = run_pass(model, train=spy, objective="kd", control=False)
    assert len(seen) == 1 and seen[0].objective == "kd" and report.metrics["objective"] == "kd"
    assert torch.equal(seen[0].teacher.targets(ids, -1, 0), want) and report.metrics["kl_after"] is not None
    run_pass(small_gpt2(), train=spy, control=False)
    assert seen[1] is None
