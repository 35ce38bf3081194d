"""The thread policy: OMP_NUM_THREADS wins; else the CPUs not already busy, at least one. The CLI's
entry (never the library) has OpenMP's threads sleep while they wait."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from normsurgery.core import threads


def test_omp_num_threads_is_honoured(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.default_threads() == 3


def test_the_default_leaves_busy_cpus_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "runnable_elsewhere", lambda: 0)  # the load average alone
    for load, expected in ((0.2, 4), (1.6, 2), (3.4, 1), (9.0, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert threads.default_threads() == expected


def test_use_sets_torch_threads():
    before = torch.get_num_threads()
    try:
        assert threads.use(2) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_default_counts_what_runs_now(monkeypatch):
    """A process busy for seconds is not in the 1-minute load average yet: the tasks runnable now
    (/proc/loadavg's running count, this process's own left out) count too."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    monkeypatch.setattr(threads, "open", lambda *a, **k: io.StringIO("0.10 0.08 0.05 2/311 4242\n"), raising=False)
    assert threads.runnable_elsewhere() == 1
    assert threads.default_threads() == 1
    monkeypatch.setattr(threads, "open", lambda *a, **k: io.StringIO("0.10 0.08 0.05 1/311 4242\n"), raising=False)
    assert threads.default_threads() == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 0.4, 0.1))  # the average, where it says more
    assert threads.default_threads() == 1


#: runs the CLI's entry on ``inspect`` of a folder that is not there (torch loads first), printing the
#: wait policy torch saw as it was imported and what the environment holds at the end
ENTRY = """import os, sys
seen = {}
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            seen.setdefault("torch", os.environ.get("OMP_WAIT_POLICY"))
sys.meta_path.insert(0, Watch())
sys.argv = ["normsurgery", "inspect", sys.argv[1]]
from normsurgery.cli import main
try:
    main()
except SystemExit:
    pass
print("SEEN", seen.get("torch", "not imported"))
"""


def run_python(code: str, *args, policy: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    run = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                         timeout=300)
    return run.stdout


@pytest.mark.parametrize("policy, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_cli_entry_has_threads_sleep_unless_told(tmp_path, policy, expected):
    """The CLI's entry sets OMP_WAIT_POLICY=PASSIVE before torch is imported (OpenMP reads it
    then), unless the user set it."""
    assert f"SEEN {expected}" in run_python(ENTRY, tmp_path / "missing", policy=policy)


def test_the_library_leaves_the_callers_process_alone():
    """Importing the library and its API changes no variable of the caller's environment."""
    code = ("import os; before = dict(os.environ); import normsurgery, normsurgery.commands.convert, normsurgery.cli; "
            "normsurgery.load; print('SAME', dict(os.environ) == before, os.environ.get('OMP_WAIT_POLICY'))")
    assert "SAME True None" in run_python(code)
