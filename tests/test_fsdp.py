"""Training sharded with FSDP2 over two CPU processes (gloo), compared with one process: the same
held-out CE (same seed, same global batch), outputs that verify against each other, resume. The
runs are marked ``fsdp`` (over a minute together): ``make test-fsdp``, which CI runs."""

import json
import re
from pathlib import Path

import pytest
import torch

from normsurgery.core.errors import SurgeryError

from models import torchrun, torchrun_cli

LLAMA = "normsurgery/demo/llama-tiny"
SAMPLE = "normsurgery/data/sample.txt"
FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
SAME_CE = 1e-3  # nats: the bound between one process and two sharded ones


def one_and_two(tmp_path, *args, batch: int) -> list[dict]:
    """``normsurgery ARGS OPTS`` run by one process (``2 batch`` windows a step) into
    ``tmp_path/one`` and by two sharded processes (``batch`` each) into ``tmp_path/two``: the JSON
    reports. ``args``: the command, its input, then its options, where "{out}" and "{batch}" are
    filled in."""
    reports = []
    for name, procs, env in (("one", 1, {}), ("two", 2, FSDP)):
        filled = [a.format(out=tmp_path / name, batch=batch * (3 - procs)) for a in args]
        r = torchrun_cli(*filled, "--json", processes=procs, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        reports.append(json.loads(r.stdout))
    return reports


def same_folders(tmp_path) -> None:
    """The two outputs hold the same files and config, and pass ``verify`` against each other."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    a, b = (json.loads((d / "config.json").read_text()) for d in (one, two))
    assert {k: v for k, v in a.items() if k != "normsurgery"} == {k: v for k, v in b.items() if k != "normsurgery"}
    r = torchrun_cli("verify", one, two, "--json", processes=1)
    assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stdout[-2000:] + r.stderr[-2000:]


@pytest.mark.fsdp
def test_heal_full_sharded_over_two_processes_matches_one(tmp_path):
    one, two = (r["heal"] for r in one_and_two(
        tmp_path, "heal", LLAMA, "{out}", "--text", SAMPLE, "--train", "full", "--steps", "6", "--seq-len", "32",
        "--batch-size", "{batch}", "--eval-samples", "4", "--lr", "1e-3", batch=2))
    assert two["processes"] == 2 and two["tokens"] == one["tokens"]
    assert two["sharded"] is True and one["sharded"] is False and "rank" not in two  # the JSON says it (issue 54.10)
    assert abs(one["ce_before"] - two["ce_before"]) < 1e-5
    assert abs(one["ce_after"] - two["ce_after"]) < SAME_CE
    assert abs(one["ce_after"] - one["ce_before"]) > 10 * SAME_CE  # it trained
    same_folders(tmp_path)


@pytest.mark.fsdp
def test_remove_ln_sharded_over_two_processes_matches_one(tmp_path):
    """The schedule, the divisors (averaged over the processes' batches), the fold and the control
    run as in one process."""
    one, two = (r["steps"][-1]["metrics"] for r in one_and_two(
        tmp_path, "convert", LLAMA, "{out}", "--pass", "remove-ln:eval_samples=4,gap=1,seq_len=32,steps=32,"
        "batch_size={batch}", "--text", SAMPLE, batch=2))
    assert two["processes"] == 2 and two["tokens"] == one["tokens"]
    assert abs(one["ce_after"] - two["ce_after"]) < SAME_CE
    assert abs(one["ce_control"] - two["ce_control"]) < SAME_CE
    assert [r["step"] for r in one["curve"]] == [r["step"] for r in two["curve"]]
    assert two["fold_error_float32"] <= 1e-5
    same_folders(tmp_path)


WORKER = """import json, sys
import torch
from normsurgery.io.loader import load
from normsurgery.io.source import Source
from normsurgery.engine import processes, training
from normsurgery.core.calibration import tokenize, windows

out, state, batch, stop, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
source = Source.open("normsurgery/demo/llama-tiny")
model = load(source)
ids = tokenize(source.tokenizer, open("normsurgery/data/sample.txt").read())
train_ids, held = ids[:-1024], windows(ids[-1024:], 32, 4)


def on_step(step, m):
    if step == stop:
        raise SystemExit(3)  # interrupted, in every process at the same step


config = dict(steps=8, batch_size=batch, seq_len=32, lr=1e-3, save_every=2, eval_every=4, state_dir=state,
              resume=resume)
r = training.train(model, train_ids, held, config, on_step=on_step)
if processes.is_main_process():
    json.dump({"result": r.as_dict(), "weights": {n: p.sum().item() for n, p in model.named_parameters()}},
              open(out, "w"))
"""


def worker(tmp_path, name: str, procs: int, stop: int = -1, resume: bool = False, state: str = "state"):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    batch = 4 // procs
    return torchrun(str(script), tmp_path / f"{name}.json", tmp_path / state, batch, stop, int(resume),
                    processes=procs, env=FSDP)


@pytest.mark.fsdp
def test_resume_under_two_sharded_processes_reaches_the_one_process_result(tmp_path):
    assert worker(tmp_path, "one", 1, state="state1").returncode == 0
    r = worker(tmp_path, "cut", 2, stop=5)  # the state of step 4 kept, sharded (step 2's shards removed)
    assert r.returncode != 0
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        "train-state.pt", "train-state.step4.rank0-of-2.pt", "train-state.step4.rank1-of-2.pt"]
    r = worker(tmp_path, "two", 2, resume=True)
    assert r.returncode == 0, r.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert two["result"]["resumed_from"] == 4 and two["result"]["processes"] == 2
    assert [c["step"] for c in two["result"]["curve"]] == [c["step"] for c in one["result"]["curve"]]
    assert abs(one["result"]["ce_after"] - two["result"]["ce_after"]) < SAME_CE
    for name, w in one["weights"].items():  # given back whole, the same model
        assert two["weights"][name] == pytest.approx(w, rel=1e-4, abs=1e-4), name


@pytest.mark.parametrize("kept, now, says", [
    (2, 3, "is sharded over 2 processes (FSDP) and this run over 3: resume it with 2 processes under FSDP"),
    (2, None, "is sharded over 2 processes (FSDP) and this run is not: resume it with 2 processes under FSDP"),
    (None, 2, "is not sharded and this run is, over 2 processes: resume it without FSDP")])
def test_a_state_resumed_on_another_number_of_shards_is_refused_in_one_line(tmp_path, kept, now, says):
    from normsurgery.engine.train_state import STATE_FILE, load_state
    from normsurgery.engine.training import TrainConfig

    torch.save({"fingerprint": "f", "step": 2, **({"shards": kept} if kept else {})}, tmp_path / STATE_FILE)
    with pytest.raises(SurgeryError, match=re.escape(says)) as e:
        load_state(TrainConfig(state_dir=tmp_path, resume=True), "f", now)
    assert "\n" not in str(e.value)


def test_fsdp_version_1_is_refused(monkeypatch):
    from normsurgery.core import devices

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(SurgeryError, match="FSDP version 1 is not supported: shard with FSDP2"):
        devices.sharding()
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert devices.sharding()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert not devices.sharding()


def test_prepbn_is_refused_under_fsdp(monkeypatch, tmp_path):
    """prepbn rewrites weights in the middle of training: refused in one line, before training."""
    import normsurgery as ns

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(SurgeryError, match=r"prepbn rewrites .* \(FSDP\) does not allow: run it data parallel"):
        ns.convert("normsurgery/demo/gpt2-tiny", tmp_path / "out", [("prepbn", {"steps": 12, "warmup": 3, "decay": 8})],
                   text=Path(SAMPLE))
    assert not (tmp_path / "out").exists()
