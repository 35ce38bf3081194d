"""heal's width-cut teacher, --local-steps and --teacher-cache (commands/heal_distill.py), through the API."""

from pathlib import Path

import pytest

import normsurgery as ns
from normsurgery.core.errors import SurgeryError
from normsurgery.engine.teacher_cache import TeacherCache

LLAMA = "normsurgery/demo/llama-tiny"
SAMPLE = Path("normsurgery/data/sample.txt")
COMMON = {"steps": 3, "seq_len": 32, "batch_size": 4, "rank": 4, "lr": 1e-2, "eval_samples": 4}


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    out = tmp_path_factory.mktemp("cut") / "cut"
    ns.convert(LLAMA, out, [("minimize", {"prune_units": 0.3, "prune_heads": 0.5})])
    return out


def test_a_width_cut_heals_from_a_teacher_sharing_its_tensors_with_local_steps_first(cut, tmp_path):
    r = ns.heal(cut, tmp_path / "h", text=SAMPLE, options={**COMMON, "teacher": LLAMA, "local_steps": 4})
    report = r.report
    assert report.objective == "kd" and "frozen copy" not in report.why
    assert len(report.local) == 8  # every block lost units and heads
    assert all(row["nmse_after"] < row["nmse_before"] for row in report.local), report.local
    assert report.kl_after < report.kl_before


def test_the_teacher_cache_at_k_vocabulary_trains_as_the_live_teacher(cut, tmp_path, monkeypatch):
    live = ns.heal(cut, tmp_path / "live", text=SAMPLE, options={**COMMON, "teacher": LLAMA}).report
    options = {**COMMON, "teacher": LLAMA, "teacher_cache": str(tmp_path / "cache"), "teacher_k": 1024}  # k = vocabulary
    read, targets = [], TeacherCache.targets
    monkeypatch.setattr(TeacherCache, "targets", lambda self, *a: read.append(a[1:]) or targets(self, *a))
    cached = ns.heal(cut, tmp_path / "cached", text=SAMPLE, options=options).report
    assert (tmp_path / "cache" / "step-000002.pt").is_file()
    assert {(s, m) for s, m in read if s >= 0} == {(0, 0), (1, 0), (2, 0)}  # the loop read every step from the cache
    assert max(abs(a - b) for a, b in zip(live.losses, cached.losses)) < 1e-3
    with pytest.raises(SurgeryError, match="another configuration"):  # the cache of another run: refused
        ns.heal(cut, tmp_path / "other", text=SAMPLE, options={**options, "seed": 1})


def test_a_frozen_copy_where_the_cut_is_not_units_and_heads(tmp_path):
    ns.convert(LLAMA, tmp_path / "sparse", [("minimize", {"prune_units": 0.3, "sparsity": 0.2})])
    r = ns.heal(tmp_path / "sparse", tmp_path / "h", text=SAMPLE, options={**COMMON, "teacher": LLAMA})
    assert "frozen copy" in r.report.why
    with pytest.raises(SurgeryError, match="local-steps"):
        ns.heal(tmp_path / "sparse", tmp_path / "h2", text=SAMPLE,
                options={**COMMON, "teacher": LLAMA, "local_steps": 2})
    with pytest.raises(SurgeryError, match="needs --train lora"):  # refused before anything is read
        ns.heal("no-such-model", tmp_path / "h3", text=SAMPLE, options={**COMMON, "local_steps": 2, "train": "norms"})
