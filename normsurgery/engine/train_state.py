"""Resumable training state: where a command keeps it (:func:`state_dir`), what one optimizer step's
state holds (model, optimizer, scheduler, random generators, the losses and evaluations so far),
written atomically by the main process (a sharded run: each process its shard, :func:`shard_file`)
and read back only by the same run (:func:`fingerprint`: the options that decide the steps, the
objective, the process count and the tokens), so that ``resume`` continues exactly as the
uninterrupted run would (``training.train``).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from ..core import devices
from ..core.errors import SurgeryError

STATE_FILE = "train-state.pt"
#: the options that decide what a run's steps compute: a state saved under others is another run's
FINGERPRINT_KEYS = ("steps", "batch_size", "seq_len", "lr", "min_lr", "warmup", "weight_decay", "grad_accum",
                    "clip", "precision", "seed")


def state_dir(out, what: str = "train") -> Path:
    """Where a command keeps its resumable state for ``out``: ``.OUT.WHAT-state`` beside it (``train``:
    the trained passes' training, convert; ``squeeze``: squeeze's cycles)."""
    return Path(out).parent / f".{Path(out).name}.{what}-state"


def fingerprint(config, ids: torch.Tensor, objective: str, processes: int) -> str:
    """What identifies a run (``config``: a ``TrainConfig``) on the tokens ``ids``."""
    text = repr(([getattr(config, k) for k in FINGERPRINT_KEYS], objective, processes, len(ids)))
    return hashlib.sha256(text.encode() + ids.to(devices.HOST).numpy().tobytes()).hexdigest()[:16]  # host


def save_state(path: Path, state: dict) -> None:
    """``state`` at ``path``, atomically (a temporary file replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(config, fingerprint: str, shards: int | None) -> dict:
    """The state kept in ``config.state_dir``, refused in one line when another run's, or kept
    sharded over another number of processes than ``shards`` (None: not sharded)."""
    path = Path(config.state_dir) / STATE_FILE
    if not path.is_file():
        raise SurgeryError(f"nothing to resume: no training state at {path}")
    state = torch.load(path, map_location=devices.HOST, weights_only=False)
    kept = state.get("shards")
    if kept != shards:
        how = f"sharded over {kept} processes (FSDP)" if kept else "not sharded"
        now = "is not" if not shards else f"over {shards}" if kept else f"is, over {shards} processes"
        raise SurgeryError(f"the training state at {path} is {how} and this run {now}: resume it "
                           f"{f'with {kept} processes under FSDP' if kept else 'without FSDP'}, or start afresh "
                           "without --resume")
    if state.get("fingerprint") != fingerprint:
        raise SurgeryError(f"the training state at {path} is from another run (other text, options or process "
                           "count); resume with the same ones or start afresh without --resume")
    return state


def shard_file(state_dir, step: int, rank: int, procs: int) -> Path:
    """Process ``rank``'s shard of the state at ``step`` (a file per step: the one the state names
    survives an interrupted save)."""
    return Path(state_dir) / f"train-state.step{step}.rank{rank}-of-{procs}.pt"


def restore(config, fingerprint: str, model, optimizer, shards, acc) -> dict:
    """The state kept in ``config.state_dir`` put back into ``model`` and ``optimizer`` (sharded:
    this process's shards, ``processes.Shards``) and the random generators; the state (its step,
    scheduler, losses, curve and held-out CE before) returned."""
    procs, rank = acc.num_processes, acc.process_index
    state = load_state(config, fingerprint, procs if shards else None)
    if shards:
        local = torch.load(shard_file(config.state_dir, state["step"], rank, procs), map_location=devices.HOST,
                           weights_only=False)
        shards.load_local(local, optimizer)
        devices.restore_rng(local)
    else:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        devices.restore_rng(state)
    return state


def keep(config, common: dict, model, optimizer, shards, acc, kept: int | None) -> int | None:
    """The state after step ``common["step"]`` saved (``common``: what every process's state holds;
    sharded: each process its shard, then the main one the state naming them, the shards of the
    step ``kept`` before removed). Returns the step whose shards the state now names."""
    procs, rank, done = acc.num_processes, acc.process_index, common["step"]
    path = Path(config.state_dir) / STATE_FILE
    if shards:
        save_state(shard_file(config.state_dir, done, rank, procs),
                   {**shards.local_state(optimizer), **devices.rng_state()})
        acc.wait_for_everyone()
        if acc.is_main_process:
            save_state(path, {**common, "shards": procs})
        acc.wait_for_everyone()
        if kept is not None:  # the state now names this step's shards
            shard_file(config.state_dir, kept, rank, procs).unlink(missing_ok=True)
        kept = done
    elif acc.is_main_process:
        save_state(path, {**common, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                          **devices.rng_state()})
    acc.wait_for_everyone()
    return kept
