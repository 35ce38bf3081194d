"""heal's objective chosen by its teacher: found from the record (the original read once, only the cut
blocks kept, checked before training), given (--teacher), or none (ce); resume with each objective;
the teacher's memory: only the cut blocks beside the student (LoRA), a frozen copy counted (full)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import normsurgery as ns
from normsurgery.commands.heal import HealOptions, Kept, heal_model
from normsurgery.commands.heal_teacher import Teaching
from normsurgery.core import devices
from normsurgery.core.errors import SurgeryError
from normsurgery.engine.teacher import LayerCut
from normsurgery.engine.training import check_fits

from models import token_ids
from test_teacher import cut_model

LLAMA = "normsurgery/demo/llama-tiny"
SAMPLE = "normsurgery/data/sample.txt"
SMALL = {"steps": 2, "seq_len": 32, "batch_size": 2, "eval_samples": 2}


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    out = tmp_path_factory.mktemp("kd") / "pruned"
    ns.prune(LLAMA, out, {"layers": 2, "samples": 4, "seq_len": 32, "eval_samples": 2}, text=SAMPLE_TEXT())
    return out


def SAMPLE_TEXT():
    from pathlib import Path

    return Path(SAMPLE).read_text()


def test_heal_of_a_pruned_checkpoint_distils_from_the_original_its_record_names(pruned, tmp_path):
    r = ns.heal(pruned, tmp_path / "h", text=SAMPLE_TEXT(), eval_text=SAMPLE_TEXT()[:3000], options=SMALL)
    h = r.record["heal"]
    assert h["objective"] == "kd" and h["teacher"] == LLAMA and "teacher is known" in h["why"]
    kl = r.record["heldout_kl"]
    assert kl["original"] == 0.0 and kl["input"] > 0.01 and kl["healed"] == h["kl_after"]
    assert r.record["eval_text_kl"]["input"] > 0.01 and "kl_heldout" in r.record["recovered"]
    # a healed input's kept blocks changed: the teacher assembled from it is not the original, refused
    with pytest.raises(SurgeryError, match="does not compute what"):
        ns.heal(tmp_path / "h", tmp_path / "again", text=SAMPLE_TEXT(), options=SMALL)
    ce = ns.heal(tmp_path / "h", tmp_path / "ce", text=SAMPLE_TEXT(), options={**SMALL, "objective": "ce"})
    assert ce.report.objective == "ce" and "does not compute what" in ce.report.why
    assert "heldout_kl" not in ce.record


def test_without_a_record_or_teacher_heal_is_ce_and_says_why(tmp_path):
    r = ns.heal(LLAMA, tmp_path / "h", text=SAMPLE_TEXT(), options=SMALL)
    assert r.report.objective == "ce" and r.report.why == "no teacher: the input has no record of a prune"
    with pytest.raises(SurgeryError, match="distils from a teacher and none is known"):
        ns.heal(LLAMA, tmp_path / "kd", text=SAMPLE_TEXT(), options={**SMALL, "objective": "kd"})


def test_a_teacher_given_of_its_own_is_a_frozen_full_model(pruned, tmp_path):
    """--teacher naming a model that is not the student's: read whole, frozen; here the input itself,
    so the KL before healing is 0 (the teacher computes what the student computes)."""
    r = ns.heal(pruned, tmp_path / "h", text=SAMPLE_TEXT(), options={**SMALL, "teacher": str(pruned)})
    assert r.report.objective == "kd" and r.report.teacher == str(pruned)
    assert r.report.kl_before == pytest.approx(0.0, abs=1e-6) and "original" not in r.record["heldout_kl"]


@pytest.mark.parametrize("objective", ["kd", "kd+ce", "ce"])
def test_resume_mid_run_with_each_objective(objective, tmp_path):
    """A heal interrupted after step 3 (state kept at step 2) and resumed ends where the whole run ends."""
    ids, held = token_ids(1, 400, seed=1)[0], token_ids(2, 16, seed=2)
    opts = HealOptions(steps=4, seq_len=16, batch_size=2, objective=objective, temperature=2.0, lr=1e-2)

    def heal(kept, progress=None):
        _, student, cut = cut_model("llama")
        return heal_model(student, ids, held, opts, kept=kept, teacher=Teaching(cut, "original"),
                          **({"progress": progress} if progress else {}))

    whole = heal(None)[1]

    class Stop(Exception):
        pass

    def stop(done, total, loss):
        if done == 3:
            raise Stop

    with pytest.raises(Stop):
        heal(Kept(tmp_path / "s", save_every=2), stop)
    resumed = heal(Kept(tmp_path / "s", save_every=2, resume=True))[1]
    assert resumed.losses == whole.losses and resumed.kl_after == whole.kl_after and resumed.kl_before > 0


def test_full_training_counts_its_frozen_copy(monkeypatch):
    """--train full: the teacher holds a frozen copy of every parameter, and check_fits counts it."""
    _, student, cut = cut_model("llama")
    params = list(student.parameters())
    teacher = LayerCut(student, cut, params)
    weights = sum(p.numel() * p.element_size() for p in params)
    assert teacher.nbytes == cut.nbytes + weights
    need = weights + 3 * weights  # weights not on the device yet, gradients and two AdamW moments
    monkeypatch.setattr(devices, "free_bytes", lambda device: need + 1)
    check_fits(student, params, torch.device("meta"))
    with pytest.raises(SurgeryError, match="the teacher"):
        check_fits(student, params, torch.device("meta"), 1, teacher.nbytes)


PEAK = textwrap.dedent("""
    import json, resource, sys, torch, transformers as T
    from normsurgery.commands.heal import HealOptions, heal_model
    from normsurgery.commands.heal_teacher import Teaching
    from normsurgery.commands.prune import prune_model
    from normsurgery.engine.teacher import cut_of
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=8, vocab_size=96, max_position_embeddings=64)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    cut = cut_of(model, [2, 3])
    prune_model(model, [2, 3])
    teacher = Teaching(cut, "original") if sys.argv[1] == "kd" else None
    if teacher is None:
        del cut  # the ce run frees the cut blocks
    ids, held = torch.randint(0, 96, (2000,), generator=torch.Generator().manual_seed(1)), torch.randint(0, 96, (2, 32))
    heal_model(model, ids, held, HealOptions(steps=3, seq_len=32, batch_size=2, objective=sys.argv[1]), teacher=teacher)
    kept = teacher.given.nbytes if teacher else 0
    print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "cut": kept}))
""")


def peak(objective: str) -> dict:
    # glibc's mmap threshold fixed: by default it rises as large blocks are freed, and what is freed
    # below it stays resident, so the peak would depend on the order of the frees (noise of some MB)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    r = subprocess.run([sys.executable, "-c", PEAK, objective], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_peak_memory_of_a_kd_heal_is_a_ce_heals_plus_the_cut_blocks():
    """Measured as the process's peak resident memory (each heal in a process of its own): 8 blocks of
    12.6 MB, 2 cut (25 MB); a teacher that copied the student's 6 blocks would add 75 MB more."""
    ce, kd = peak("ce"), peak("kd")
    assert kd["cut"] > 20e6
    assert kd["peak"] <= ce["peak"] + kd["cut"] + 4e6, (ce, kd)
