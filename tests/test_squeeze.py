"""squeeze: structured masks, release, the Squeeze-Release cycle, resume, the command.

Exactness is checked in float64 against the masked model built separately (``masks.apply``);
release against the tensor it was given; resume against an uninterrupted run, file for file.
"""

from __future__ import annotations

import copy
import importlib
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import normsurgery as ns
from normsurgery.core import masks
from normsurgery.cli import app
from normsurgery.core.families import layout
from normsurgery.core.norms import faithful_norms
from normsurgery.commands.squeeze import Setup, SqueezeOptions, release, squeeze_model
from normsurgery.io.ours import png_marked

from models import rel, tiny_model, token_ids, torchrun_cli

DEMO = "normsurgery/demo/llama-tiny"
SAMPLE, HELD = "normsurgery/data/sample.txt", "normsurgery/data/heldout.txt"
runner = CliRunner()
SMALL = {"batch_size": 2, "seq_len": 16, "eval_samples": 2}


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def float64_model(family):
    model = tiny_model(family)
    faithful_norms(model)  # norms compute in float64 too
    return model


@pytest.mark.parametrize("family", ["gpt2", "llama", "gpt_neox"])
def test_unit_and_head_masks_then_minimize_equal_the_masked_model_float64(family):
    model = float64_model(family)
    lay = layout(model)
    reference = copy.deepcopy(model)
    params = {**masks.prune_units(reference, lay, 0.5), **masks.prune_heads(reference, lay, 0.5)}
    masks.apply(reference, lay, params, masks.prune_channels(masks.channel_energies(reference, lay), 4))
    new = copy.deepcopy(model)
    ns.apply_passes(new, [("minimize", {"prune_units": 0.5, "prune_heads": 0.5, "prune_channels": 4})])
    assert rel(reference, new) <= 1e-10
    assert rel(model, new) > 1e-3  # the masks changed the function; minimize kept the masked one
    new_lay = layout(new)
    assert all(new.get_submodule(m.down).weight.numel() * 2 <= model.get_submodule(m.down).weight.numel()
               for m in new_lay.mlps)
    assert [a.num_heads for a in new_lay.attention] == [2] * 3  # half the KV groups, with their query heads
    assert new_lay.stream_width == 28


def test_the_weakest_units_and_heads_are_masked():
    model = tiny_model("llama")
    lay = layout(model)
    mlp, attn = lay.mlps[1], lay.attention[1]
    with torch.no_grad():
        model.get_submodule(mlp.down).weight[:, [5, 9]] *= 1e-3  # units 5 and 9 write almost nothing
        model.get_submodule(attn.o).weight[:, 8:16] *= 1e-3  # query head 1 (of KV group 0) is faint...
        model.get_submodule(attn.o).weight[:, 0:8] *= 1e-3  # ...and so is head 0: group 0 is the weakest
    units = masks.prune_units(model, lay, 2 / 64)[f"{mlp.down}.weight"]
    assert (~units).any(0).nonzero().flatten().tolist() == [5, 9]
    heads = masks.prune_heads(model, lay, 0.5)[f"{attn.o}.weight"]
    assert (~heads).any(0).nonzero().flatten().tolist() == list(range(16))


def test_release_fills_only_zeros_inside_live_rows_and_columns():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 5, generator=g)
    w[2] = 0  # a pruned row
    w[:, 3] = 0  # a pruned column
    w[0, 0] = w[4, 1] = w[5, 4] = 0  # unstructured zeros
    before = w.clone()
    n = masks.release(w, 0.1, torch.Generator().manual_seed(0))
    assert n == 3
    changed = w != before
    assert changed.nonzero().tolist() == [[0, 0], [4, 1], [5, 4]]
    assert (w[2] == 0).all() and (w[:, 3] == 0).all()
    survivors = before[before != 0]
    assert (w[changed].abs() < 5 * 0.1 * survivors.pow(2).mean().sqrt()).all()
    again = before.clone()
    masks.release(again, 0.1, torch.Generator().manual_seed(0))
    assert torch.equal(again, w)  # deterministic with the seed


def test_release_on_a_minimized_model_touches_only_its_exact_zeros():
    model = tiny_model("gpt2", torch.float32)
    ns.apply_passes(model, [("minimize", {"prune_units": 0.25, "sparsity": 0.3})])
    weights = masks.block_weights(model, layout(model))
    before = {k: w.detach().clone() for k, w in weights.items()}
    others = {n: p.detach().clone() for n, p in model.named_parameters() if n not in weights}
    n = release(model, 0.1, seed=0, cycle=1)
    changed = sum(int((w != before[k]).sum()) for k, w in weights.items())
    assert n == changed > 0
    for k, w in weights.items():
        assert (before[k][w != before[k]] == 0).all(), k
    assert all(torch.equal(p, others[n]) for n, p in model.named_parameters() if n in others)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_cycle_minimize_is_exact_float64_and_reaches_the_target(family):
    model = float64_model(family)
    p0 = sum(p.numel() for p in model.parameters())
    train_ids, held = token_ids(1, 3000, seed=1)[0], token_ids(4, 16, seed=2)
    opts = SqueezeOptions(target=0.5, cycles=2, steps_per_cycle=2, sparsity=0.3, **SMALL)
    model, result = squeeze_model(model, train_ids, held, opts, Setup(4))
    assert [c.cycle for c in result.cycles] == [1, 2]
    for c in result.cycles:
        assert c.minimize_relative <= 1e-10 and c.minimize_tolerance == 1e-10
        assert c.released > 0 and c.tokens == 2 * 2 * 16
    assert result.cycles[0].params > result.cycles[1].params
    assert result.cycles[1].params <= 0.5 * p0 == 0.5 * result.original["params"]
    assert result.cycles[1].params == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_an_unreachable_goal_is_refused_with_the_reason():
    model = tiny_model("llama", torch.float32)
    opts = SqueezeOptions(target=0.1, cycles=1, steps_per_cycle=1, structure=("heads",), **SMALL)
    with pytest.raises(ns.SurgeryError, match=r"masking 95% of the heads leaves .* more than this cycle's goal"):
        squeeze_model(model, token_ids(1, 500)[0], token_ids(2, 16), opts, Setup(4))


@pytest.mark.parametrize("family, reason", [("mixtral", "mixture of experts"), ("gemma2", "sandwich norms"),
                                             ("bert", "Post-LN")])
def test_a_family_minimize_refuses_is_refused_before_any_work(family, reason):
    opts = SqueezeOptions(cycles=1, steps_per_cycle=1, **SMALL)
    calls = []
    with pytest.raises(ns.SurgeryError, match=f"squeeze: pass minimize does not apply.*{reason}"):
        squeeze_model(tiny_model(family, torch.float32), token_ids(1, 500)[0], token_ids(2, 16), opts, Setup(4),
                      progress=lambda *a: calls.append(a))
    assert calls == []  # nothing was measured or masked first


def _interrupt_at(note_part):
    def progress(stage, done, total, note=""):
        if note_part in note:
            raise KeyboardInterrupt

    return progress


def test_a_resumed_squeeze_equals_an_uninterrupted_one(tmp_path):
    text, held = open(SAMPLE).read()[:20000], open(HELD).read()[:4000]
    opts = {"target": 0.6, "cycles": 2, "steps_per_cycle": 4, "save_every": 2, **SMALL}
    ns.squeeze(DEMO, tmp_path / "whole", text=text, eval_text=held, options=opts)
    for where in ("cycle 2: finding the mask", "cycle 2: retraining, step 3/4"):
        out = tmp_path / where.split(":")[1].strip().split(",")[0]
        with pytest.raises(KeyboardInterrupt):
            ns.squeeze(DEMO, out, text=text, eval_text=held, options=opts, progress=_interrupt_at(where))
        assert not out.exists()
        state = out.parent / f".{out.name}.squeeze-state"
        assert (state / "squeeze.pt").is_file()
        assert (state / "train" / "train-state.pt").is_file() == ("step" in where)
        result = ns.squeeze(DEMO, out, text=text, eval_text=held, options=opts, resume=True)
        assert result.resumed_at == 2 and not state.exists()
        a, b = load_file(tmp_path / "whole/model.safetensors"), load_file(out / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), where
    with pytest.raises(ns.SurgeryError, match="nothing to resume"):
        ns.squeeze(DEMO, tmp_path / "never", text=text, eval_text=held, options=opts, resume=True)


def test_squeeze_command(tmp_path):
    out, png = tmp_path / "small", tmp_path / "cycles.png"
    r = run("squeeze", DEMO, out, "--text", SAMPLE, "--eval-text", HELD, "--target", "0.7", "--cycles", "2",
            "--steps-per-cycle", "2", "--batch-size", "2", "--seq-len", "16", "--eval-samples", "2", "--plot", png,
            "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [c["cycle"] for c in data["cycles"]] == [1, 2]
    assert data["cycles"][-1]["params"] <= 0.7 * data["original"]["params"]
    assert data["saved"]["reload"]["comparison"]["ok"] and png_marked(png)  # the plot, ours (``io.ours``)
    model = ns.load(out)
    assert sum(p.numel() for p in model.parameters()) == data["cycles"][-1]["params"]
    record = json.loads((out / "config.json").read_text())["normsurgery"]["squeeze"]
    assert len(record["cycles"]) == 2 and record["options"]["cycles"] == 2
    card = (out / "README.md").read_text()
    assert "- squeeze" in card and "**squeeze**: 2 cycles" in card and "no pass" not in card
    assert f"| squeeze cycle 2 | {data['cycles'][1]['ce_released']:.4f} | {data['cycles'][1]['ce_after']:.4f} |" in card
    # the control: one-shot from the input at the same target and tokens, in --json, the record and the card
    control = data["control"]
    assert control["steps"] == 4 and control["tokens"] == sum(c["tokens"] for c in data["cycles"])
    assert control["params"] <= 0.7 * data["original"]["params"] and record["control"] == control
    gap = data["cycles"][-1]["ce_after"] - control["ce_after"]
    assert f"one-shot from the input at the same target and tokens (control; squeeze is {gap:+.4f}" in card
    assert f"held-out CE {control['ce_after']:.4f}" in card
    r = runner.invoke(app, ["squeeze", DEMO, str(tmp_path / "bytes"), "--text", SAMPLE, "--target-bytes", "5000000",
                            "--cycles", "1", "--steps-per-cycle", "1", "--batch-size", "2", "--seq-len", "16",
                            "--eval-samples", "2", "--json"], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    cycle = json.loads(r.stdout)["cycles"][0]
    r = runner.invoke(app, ["squeeze", DEMO, str(tmp_path / "bytes"), "--text", SAMPLE, "--target-bytes", "5000000",
                            "--cycles", "1", "--steps-per-cycle", "1", "--batch-size", "2", "--seq-len", "16",
                            "--eval-samples", "2", "--force"], env={"COLUMNS": "80"})
    assert r.exit_code == 0 and "squeezed:" in r.stdout, r.output
    assert max(map(len, r.stdout.splitlines())) <= 80
    for figure in (f"{cycle['ce_masked']:.4f}", f"{cycle['ce_after']:.4f}", f"{cycle['minimize_relative']:.2e}"):
        assert figure in r.stdout, (figure, r.stdout)  # the table cuts no number at 80 columns
    assert sum(f.stat().st_size for f in (tmp_path / "bytes").glob("*.safetensors")) <= 5_000_000 + 20_000


def test_the_control_is_one_shot_at_the_same_target_and_steps(tmp_path, monkeypatch):
    """The control squeeze reports equals a one-cycle squeeze run by itself with every cycle's
    steps (same seed): the papers' comparison at equal size and tokens; --no-control and one
    cycle run none. While it runs, the squeezed model waits on disk (the only parameters holding
    values are the input's it starts from), and comes back bit for bit: the output holds what was
    set aside."""
    import gc

    S = importlib.import_module("normsurgery.commands.squeeze")  # the module (ns.squeeze is the function)

    text, held = open(SAMPLE).read()[:20000], open(HELD).read()[:4000]
    opts = {"target": 0.6, "cycles": 2, "steps_per_cycle": 3, **SMALL}
    seen, one_shot = [], S.one_shot

    def spy(model, *args, **kwargs):
        gc.collect()
        seen.append((sum(o.numel() for o in gc.get_objects() if type(o) is torch.nn.Parameter),
                     sum(p.numel() for p in model.parameters())))
        return one_shot(model, *args, **kwargs)

    aside = {}

    class Recorded(S.Stash):  # what the squeezed model held when it was set aside
        def __init__(self, model, folder):
            aside.update({k: v.detach().clone() for k, v in model.state_dict().items()})
            super().__init__(model, folder)

    monkeypatch.setattr(S, "one_shot", spy)
    monkeypatch.setattr(S, "Stash", Recorded)
    squeezed = ns.squeeze(DEMO, tmp_path / "squeezed", text=text, eval_text=held, options=opts)
    assert len(seen) == 1 and seen[0][0] == seen[0][1], seen
    written = load_file(tmp_path / "squeezed" / "model.safetensors")
    assert written and all(torch.equal(t, aside[k]) for k, t in written.items())
    alone = ns.squeeze(DEMO, tmp_path / "alone", text=text, eval_text=held,
                       options={**opts, "cycles": 1, "steps_per_cycle": 6})
    assert alone.control is None and squeezed.control.steps == 6
    same = [{**dataclasses.asdict(c), "seconds": 0} for c in (squeezed.control, alone.cycles[0])]
    assert same[0] == same[1]  # every figure but the wall time
    assert squeezed.cycles[-1].ce_after != squeezed.control.ce_after
    r = run("squeeze", DEMO, tmp_path / "none", "--text", SAMPLE, "--eval-text", HELD, "--target", "0.6", "--cycles",
            "2", "--steps-per-cycle", "1", "--batch-size", "2", "--seq-len", "16", "--eval-samples", "2",
            "--no-control", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["control"] is None, r.output


def test_the_default_is_one_cycle_with_the_whole_budget_and_no_control(tmp_path, monkeypatch):
    """Issue 37: one cycle (one-shot) by default, measured better than 3 at equal tokens; 900
    retraining steps in all unless --steps-per-cycle, split over the cycles (3 x 300 with
    --cycles 3, the earlier default); a default run computes no control, --cycles 2 does."""
    assert SqueezeOptions().cycles == 1 and SqueezeOptions().control
    assert SqueezeOptions().heal_options().steps == 900
    assert SqueezeOptions(cycles=3).heal_options().steps == 300
    assert SqueezeOptions(cycles=3, steps_per_cycle=7).heal_options().steps == 7
    out = tmp_path / "default"
    r = run("squeeze", DEMO, out, "--text", SAMPLE, "--eval-text", HELD, "--target", "0.7", "--steps-per-cycle", "2",
            "--batch-size", "2", "--seq-len", "16", "--eval-samples", "2", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [c["cycle"] for c in data["cycles"]] == [1] and data["control"] is None
    assert data["options"]["cycles"] == 1 and data["cycles"][0]["steps"] == 2
    assert data["cycles"][0]["params"] <= 0.7 * data["original"]["params"]
    record = json.loads((out / "config.json").read_text())["normsurgery"]["squeeze"]
    assert record["control"] is None and len(record["cycles"]) == 1
    card = (out / "README.md").read_text()
    assert "**squeeze**: 1 cycle of mask" in card and "2 steps;" in card and "control" not in card
    monkeypatch.setattr("normsurgery.core.options.SQUEEZE_STEPS", 2)  # the budget, small: no steps given, all of it
    text, held = open(SAMPLE).read()[:20000], open(HELD).read()[:4000]
    result = ns.squeeze(DEMO, tmp_path / "api", text=text, eval_text=held, options={"target": 0.7, **SMALL})
    assert len(result.cycles) == 1 and result.control is None
    assert result.cycles[0].steps == 2 and result.options["steps_per_cycle"] == 2  # the record states the split


@pytest.mark.parametrize("args, message", [
    (["--target", "1.5"], "must be in (0, 1), got 1.5"),
    (["--target", "0.5", "--target-bytes", "100"], "not both"),
    (["--structure", "units,layers"], "choose among units, heads, channels"),
    (["--train", "adapters"], "choose one of lora, norms, full"),
    (["--by", "gradient"], "choose one of magnitude, activation"),
])
def test_usage_errors_exit_2_before_loading(tmp_path, args, message):
    r = run("squeeze", DEMO, tmp_path / "out", "--text", SAMPLE, *args)
    assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / "out").exists()


def test_activation_scores_need_text_and_beat_magnitude_on_the_demo(tmp_path):
    """by=activation masks the units that write least on the text; on the trained demo model that
    costs less held-out CE than masking by weight magnitude at the same fraction."""
    from normsurgery.core.calibration import tokenize, windows
    from normsurgery.core.registry import PassContext
    from normsurgery.engine.training import heldout_ce

    source = ns.Source.open(DEMO)
    ids = tokenize(source.tokenizer, open(SAMPLE).read())
    held = windows(tokenize(source.tokenizer, open(HELD).read()), 64, 8)
    ce = {}
    for by in ("magnitude", "activation"):
        model = ns.load(DEMO)
        ns.apply_passes(model, [("mask", {"prune_units": 0.3, "by": by})],
                        context=PassContext(calibration=windows(ids, 64, 16)))
        ce[by] = heldout_ce(model, held)
    assert ce["activation"] < ce["magnitude"] - 0.2, ce
    r = run("convert", DEMO, tmp_path / "no-text", "--pass", "minimize:prune_units=0.3,by=activation")
    assert r.exit_code == 2 and "by=activation scores units and heads on calibration text" in r.output  # a usage error
    r = run("convert", DEMO, tmp_path / "text", "--pass", "minimize:prune_units=0.3,by=activation", "--text", SAMPLE)
    assert r.exit_code == 0, r.output


def test_two_cpu_processes_squeeze_once(tmp_path):
    """torchrun with two processes: the cycles' training shares the batches, one output, no state left."""
    out = tmp_path / "out"
    r = torchrun_cli("squeeze", DEMO, out, "--text", SAMPLE, "--target", "0.6", "--cycles", "2",
                     "--steps-per-cycle", "2", "--seq-len", "16", "--batch-size", "2", "--eval-samples", "2", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)  # one JSON document: only the main process printed
    assert [c["tokens"] for c in report["cycles"]] == [2 * 2 * 2 * 16] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("train, structure, held_as", [
    ("full", ("units", "heads"), "a frozen copy: --train full"),
    ("lora", ("units", "heads"), "shared with the student"),
    ("lora", ("units", "channels"), "a frozen copy: the student is not the original less MLP units")])
def test_each_cycle_distils_from_its_own_input(monkeypatch, train, structure, held_as):
    """kd (the default) reaches the loop, from a teacher computing the cycle's input model (its logits
    equal the input's: the original for cycle 1, cycle 1's output for cycle 2); --train full holds a
    frozen copy, lora shares the student's tensors plus what the cut removed (units and heads; with
    residual channels cut, a copy); ce has no teacher."""
    from normsurgery.commands import squeeze as module

    model, ids = tiny_model("llama", torch.float32), token_ids(2, 16, seed=3)
    inputs, seen = [], []
    heal = module.heal_model

    def spy(student, *args, teacher=None, **kw):
        opts = args[2]
        seen.append((opts.objective, None if teacher is None else teacher.given.targets(ids, -1, 0)))
        student, report = heal(student, *args, teacher=teacher, **kw)
        inputs.append(student(input_ids=ids).logits.detach())
        return student, report

    monkeypatch.setattr(module, "heal_model", spy)
    first = model(input_ids=ids).logits.detach()
    opts = SqueezeOptions(target=0.6, cycles=2, steps_per_cycle=1, train=train, structure=structure, **SMALL)
    _, result = squeeze_model(model, token_ids(1, 3000, seed=1)[0], token_ids(4, 16, seed=2), opts, Setup(4))
    assert [goal for goal, _ in seen] == ["kd", "kd"]
    for want, (_, got) in zip([first, inputs[0]], seen):
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert all(c.objective == "kd" and c.teacher.startswith(held_as) and c.kl_after is not None
               for c in result.cycles)
    seen.clear()
    _, result = squeeze_model(tiny_model("llama", torch.float32), token_ids(1, 3000, seed=1)[0],
                              token_ids(4, 16, seed=2), dataclasses.replace(opts, cycles=1, objective="ce"), Setup(4))
    assert seen[0][0] == "ce" and seen[0][1] is None and result.cycles[0].teacher is None
