"""The thread policy: OMP_NUM_THREADS wins; else the CPUs not already busy, at least one."""

import os

import torch

from normsurgery import threads


def test_omp_num_threads_is_honoured(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.default_threads() == 3


def test_the_default_leaves_busy_cpus_alone(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for load, expected in ((0.2, 4), (1.6, 2), (3.4, 1), (9.0, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert threads.default_threads() == expected


def test_use_sets_torch_threads():
    before = torch.get_num_threads()
    try:
        assert threads.use(2) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
