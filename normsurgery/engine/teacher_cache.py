"""The teacher cache (``heal --teacher-cache DIR``): a teacher's top-k log-probabilities on exactly
the windows training reads, computed once from the live teacher, kept on disk, read back by the
training loop in place of the teacher (which is then not loaded).

The windows of micro-batch ``m`` of step ``s`` for process ``r`` are ``training._batch``'s: a
function of (seed, s, m, r) and the options, so they are known before training starts. For each
(s, m, r) the cache holds ``distillation.top_k`` of the teacher's logits at temperature T: per
window position the k largest log-probabilities (float32), their token ids (int32) and the log of
the remaining mass (float32), **k x (4 + 4) + 4 bytes per token** (k 64: 516 bytes), one
file of tensors per step (``torch.save``, read back with ``weights_only``), plus the held-out
batches' targets at T = 1 (so the held-out KL to the teacher is reported without it). Each entry also keeps a hash of its input windows: reading
back windows other than those cached is an error, never a silent misread.

A cache is made for one configuration: the training tokens, the held-out windows, the options
that decide the windows (``steps``, ``batch_size``, ``grad_accum``, ``seq_len``, ``seed``,
``eval_batch_size``), the
process count, masked-LM masking, k, T and the teacher (its identity as the caller names it:
:func:`fingerprint`). A directory holding another configuration's cache is refused, naming what
differs; the same configuration's partial cache (an interrupted build) is completed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..core import devices
from ..core.distillation import TopK, top_k
from ..core.errors import SurgeryError
from . import training
from .train_state import save_state

MANIFEST = "teacher-cache.json"
#: the step a teacher is asked at for held-out windows (``engine.teacher.EVAL``), ``micro`` the batch's index
EVAL = -1
HELDOUT = "heldout.pt"
#: the training options that decide which windows a step reads
WINDOW_KEYS = ("steps", "batch_size", "grad_accum", "seq_len", "seed", "eval_batch_size")


def bytes_per_token(k: int) -> int:
    """Bytes the cache keeps per window position: k log-probabilities and ids, one tail."""
    return k * (4 + 4) + 4


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(t.detach().to(devices.HOST).contiguous().numpy().tobytes())  # host
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class Spec:
    """What a cache holds beyond the training run's windows: ``k`` tokens per position at
    temperature ``temperature`` of the teacher ``teacher`` (its identity as the caller names it,
    e.g. its path and record digest), for ``processes`` processes, with masked-LM masking ``mlm``
    (``training._mlm_spec``'s; None: causal)."""

    k: int = 64
    temperature: float = 1.0
    teacher: str = ""
    processes: int = 1
    mlm: tuple[int, int] | None = None


def fingerprint(config, ids: torch.Tensor, heldout: torch.Tensor, spec: Spec) -> dict:
    """What a cache is a cache of (``config``: a ``training.TrainConfig``), as named fields."""
    return {"text": _digest(torch.as_tensor(ids).reshape(-1)), "heldout": _digest(heldout),
            **{key: getattr(config, key) for key in WINDOW_KEYS},
            **asdict(spec), "mlm": list(spec.mlm) if spec.mlm else None, "temperature": float(spec.temperature)}


def _step_file(directory: Path, step: int) -> Path:
    return directory / f"step-{step:06d}.pt"


def _load(path: Path) -> dict:
    return torch.load(path, map_location=devices.HOST, weights_only=True)


def _entry(prefix: str, targets: TopK, inputs: torch.Tensor) -> dict:
    return {f"{prefix}logp": targets.logp.float(), f"{prefix}ids": targets.ids.to(torch.int32),
            f"{prefix}tail": targets.tail.float(),
            f"{prefix}windows": torch.frombuffer(bytearray(bytes.fromhex(_digest(inputs))), dtype=torch.uint8)}


def _holds(tensors: dict, prefix: str, inputs: torch.Tensor) -> bool:
    return f"{prefix}logp" in tensors and bytes(tensors[f"{prefix}windows"].tolist()).hex() == _digest(inputs)


def _read(tensors: dict, prefix: str, inputs: torch.Tensor, temperature: float, where: str) -> TopK:
    if f"{prefix}logp" not in tensors:
        raise SurgeryError(f"the teacher cache has no targets for {where}")
    if not _holds(tensors, prefix, inputs):
        raise SurgeryError(f"the teacher cache holds other windows than those training reads at {where}: "
                           "it was made for another text or options; remove it to rebuild it")
    return TopK(tensors[f"{prefix}logp"], tensors[f"{prefix}ids"].long(), tensors[f"{prefix}tail"], temperature)


def _check_manifest(directory: Path, wanted: dict) -> dict | None:
    """The manifest kept in ``directory`` (None: none), refused in one line when another
    configuration's."""
    path = directory / MANIFEST
    if not path.is_file():
        if directory.is_dir() and any(directory.iterdir()):
            raise SurgeryError(f"{directory} is not empty and holds no teacher cache: give an empty or new directory")
        return None
    kept = json.loads(path.read_text())
    differ = [key for key in wanted if kept.get("fingerprint", {}).get(key) != wanted[key]]
    if differ:
        raise SurgeryError(f"the teacher cache at {directory} was made for another configuration ({', '.join(differ)} "
                           "differ): give another --teacher-cache directory, or remove this one to rebuild it")
    return kept


@torch.no_grad()
def build(directory, teacher, data: tuple[torch.Tensor, torch.Tensor], config, spec: Spec = Spec(),
          device=None) -> "TeacherCache":
    """The cache of ``teacher`` (anything with ``targets(inputs, step, micro)`` giving logits; the
    held-out batches are asked for at step :data:`EVAL`) in ``directory`` for a training run of ``config``
    on ``data`` (the training tokens, the held-out windows): built where missing, completed where
    interrupted, refused where made for another configuration. Runs on one process (the main
    one), over every process's windows, the teacher's forwards on ``device`` (default the host)."""
    directory, (train_ids, heldout) = Path(directory), data
    train_ids = torch.as_tensor(train_ids).reshape(-1).to(devices.HOST)
    wanted = fingerprint(config, train_ids, heldout, spec)
    kept = _check_manifest(directory, wanted)
    if kept is None or not kept.get("complete"):
        directory.mkdir(parents=True, exist_ok=True)
        manifest = {"fingerprint": wanted, "bytes_per_token": bytes_per_token(spec.k), "complete": False}
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
        device = device or devices.HOST
        for step in range(config.steps):
            if _step_file(directory, step).is_file():
                continue  # written by an interrupted build of the same configuration
            entries = {}
            for micro in range(config.grad_accum):
                for rank in range(spec.processes):
                    inputs, _ = training._batch(train_ids, config, step, micro, rank, spec.processes, spec.mlm)
                    targets = top_k(teacher.targets(inputs.to(device), step, micro), spec.k, spec.temperature)
                    entries.update(_entry(f"m{micro}.r{rank}.", targets.to(devices.HOST), inputs))
            save_state(_step_file(directory, step), entries)
        save_state(directory / HELDOUT, _heldout_entries(teacher, heldout, spec, device, config.eval_batch_size))
        (directory / MANIFEST).write_text(json.dumps({**manifest, "complete": True}, indent=1))
    return TeacherCache(directory, wanted)


def _heldout_entries(teacher, heldout: torch.Tensor, spec: Spec, device, batch_size: int) -> dict:
    """Per held-out batch ``i`` (``batch_size`` windows, as evaluations read them: masked LMs with
    ``training.heldout_ce``'s masks), its targets at T = 1."""
    mlm, entries = spec.mlm, {}
    inputs = training.mask_tokens(heldout, *mlm, torch.Generator().manual_seed(0))[0] if mlm else heldout
    for i, s in enumerate(range(0, len(inputs), batch_size)):
        x = inputs[s:s + batch_size]
        entries.update(_entry(f"h{i}.", top_k(teacher.targets(x.to(device), EVAL, i), spec.k, 1.0).to(devices.HOST),
                              x))
    return entries


class TeacherCache:
    """A built cache, read as a teacher (``engine.teacher.Teacher``): :meth:`targets` gives this
    process's (``rank``) :class:`TopK` of step ``step``'s micro-batch ``micro``, on the inputs'
    device. One step's file is held in memory at a time."""

    def __init__(self, directory, wanted: dict, rank: int = 0):  # (rank: this process's windows)
        self.directory, self.fingerprint, self.rank = Path(directory), wanted, rank
        self.temperature, self.k = wanted["temperature"], wanted["k"]
        self._step, self._tensors = None, {}

    @classmethod
    def open(cls, directory, wanted: dict, rank: int = 0) -> "TeacherCache":
        """The complete cache in ``directory`` made for ``wanted`` (:func:`fingerprint`), or a refusal."""
        kept = _check_manifest(Path(directory), wanted)
        if kept is None or not kept.get("complete"):
            raise SurgeryError(f"no complete teacher cache at {directory}: build it first (heal --teacher-cache "
                               "with the teacher available)")
        return cls(directory, wanted, rank)

    def for_rank(self, rank: int) -> "TeacherCache":
        return TeacherCache(self.directory, self.fingerprint, rank)

    def targets(self, inputs: torch.Tensor, step: int, micro: int) -> TopK | None:
        """Step ``step``'s micro-batch ``micro`` (at :data:`EVAL`: held-out batch ``micro``, at T = 1;
        None for windows the cache does not hold, e.g. another text's: no KL is measured there)."""
        if step != self._step:
            path = self.directory / HELDOUT if step == EVAL else _step_file(self.directory, step)
            if not path.is_file():
                raise SurgeryError(f"the teacher cache at {self.directory} has no step {step + 1}")
            self._step, self._tensors = step, _load(path)
        if step == EVAL:
            if not _holds(self._tensors, f"h{micro}.", inputs):
                return None
            return _read(self._tensors, f"h{micro}.", inputs, 1.0, f"held-out batch {micro}").to(inputs.device)
        where = f"step {step + 1}, micro-batch {micro}, process {self.rank}"
        return _read(self._tensors, f"m{micro}.r{self.rank}.", inputs, self.temperature, where).to(inputs.device)
