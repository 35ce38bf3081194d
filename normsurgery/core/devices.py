"""Where work runs: the one decision of a command's device (``--device auto|cpu|cuda|cuda:N``).

- ``auto``: the first GPU torch sees (``cuda:LOCAL_RANK`` in a process of a distributed launch),
  else the CPU;
- ``cpu``, ``cuda`` (the first GPU, or the launch's), ``cuda:N``: as named; a GPU named where
  torch sees none, or an index it does not have, is refused.

What follows from the choice, everywhere: a checkpoint's parts are read into host memory and
moved to the device as they are entered (``checkpoint.Loader``), so the rewrites, the checks'
forward passes and training compute there; a tensor is written from a host copy
(``shards.ShardWriter``); training runs on :func:`make_accelerator`'s device and precision,
moving the model there and giving it back where it found it (``training.train``), its random
state kept per device (:func:`rng_state`). Other code follows the model (:func:`of`) or its inputs.

Several processes shard the training state (FSDP2, ``fully_shard``) where accelerate's own FSDP
configuration asks for it (:func:`sharding`); their precision is :func:`shard_policy`'s.

Checks on a GPU compute in IEEE float32 and float64: TF32 matrix products (10 bits of mantissa)
would round about 1e-3 relative, far above a float32 check's 1e-5, so a job (``runner``) computes
with TF32 off for matmuls and cuDNN (:func:`exact_arithmetic`), and puts the caller's flags back
when it ends (float64 runs at full precision on any GPU
that has it: an H200 does). Training on a GPU uses bf16 autocast by ``--precision``, not TF32.

Nothing here imports torch at module level: :func:`check` answers usage errors before torch loads.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

from .errors import SurgeryError, UsageError

SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")
HELP = "where to compute: auto (the first GPU torch sees, else the CPU), cpu, cuda or cuda:N"

#: training precision, ``--precision`` -> accelerate's ``mixed_precision`` ("auto": bf16 autocast
#: on a GPU that supports it, float32 elsewhere; :func:`mixed_precision`); "no" is fp32's old name
PRECISIONS = {"auto": "auto", "fp32": "no", "bf16": "bf16", "fp16": "fp16", "no": "no"}
PRECISION_CHOICES = ("auto", "fp32", "bf16", "fp16")
PRECISION_HELP = "training precision: auto (bf16 autocast on a GPU that has it, else fp32) | fp32 | bf16 | fp16"


def check(spec: str) -> str:
    """``spec`` when it names a device this module can choose from (a usage error otherwise)."""
    if not isinstance(spec, str) or not SPEC.fullmatch(spec):
        raise UsageError(f"--device {spec!r}: choose auto, cpu, cuda or cuda:N")
    return spec


def choose(spec: str = "auto"):
    """The device ``spec`` names (see the module docstring). Nothing is set: a command makes a GPU
    current for its job alone (``runner.choose_device``), TF32 off too (:func:`exact_arithmetic`)."""
    import torch

    check(spec)
    if spec == "cpu":
        return torch.device("cpu")
    cuda = torch.cuda.is_available()
    if spec == "auto" and not cuda:
        return torch.device("cpu")
    if not cuda:
        raise SurgeryError(f"--device {spec}: torch sees no GPU here (torch {torch.__version__}, "
                           f"{'built without CUDA' if torch.version.cuda is None else 'CUDA ' + torch.version.cuda}); "
                           "use --device cpu or auto")
    index = int(spec.partition(":")[2] or os.environ.get("LOCAL_RANK", 0))
    if index >= torch.cuda.device_count():
        raise SurgeryError(f"--device {spec}: torch sees {torch.cuda.device_count()} GPU(s), numbered from 0")
    return torch.device("cuda", index)


#: torch's float32 precision settings of the newer API (``torch.backends.*.fp32_precision``), by
#: (backend, op), each parent before its children
FP32 = (("generic", "all"), *((b, o) for b in ("cuda", "mkldnn") for o in ("all", "matmul", "conv", "rnn")))


def _legacy() -> tuple:
    """(getter, setter) of each older setting: the float32 matmul precision (whose ``allow_tf32``
    flag is its "high"), cuDNN's and oneDNN's ``allow_tf32``. A getter raises where the newer
    settings were set against it."""
    import torch

    c = torch._C
    return ((torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
            (c._get_cudnn_allow_tf32, c._set_cudnn_allow_tf32), (c._get_onednn_allow_tf32, c._set_onednn_allow_tf32))


def _read(get):
    try:
        return get()
    except RuntimeError:  # the newer settings were set against it: not readable, and not put back
        return None


@contextmanager
def fp32_kept():
    """The block's float32 arithmetic settings put back as it found them, older and newer alike (a
    setting of one API rewrites the other's: ``allow_tf32 = False`` after
    ``set_float32_matmul_precision("medium")`` leaves the precision unreadable; putting the flag
    back would not give "medium" back)."""
    import torch

    legacy = [_read(get) for get, _ in _legacy()]
    newer = {k: torch._C._get_fp32_precision_getter(*k) for k in FP32}
    try:
        yield
    finally:
        for (_, put), value in zip(_legacy(), legacy):
            if value is not None:
                put(value)
        for k, value in newer.items():
            torch._C._set_fp32_precision_setter(*k, value)


@contextmanager
def exact_arithmetic():
    """For the block (a job: ``runner``): IEEE float32 matrix products (CUDA's and oneDNN's: no TF32,
    no bf16), convolutions and RNNs (TF32 off), set through both of torch's APIs, so that either
    reads it: the float32 matmul precision "highest" and cuDNN's ``allow_tf32`` flag (which
    accelerate and transformers read; torch >= 2.9 raises on reading one set against the newer
    settings) where it reads, and each CUDA op's ``fp32_precision`` "ieee" (a parent's, the
    ``generic`` or ``cuda`` one, would otherwise still reach an op left at "none"). Then every
    setting put back (:func:`fp32_kept`)."""
    import torch

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    with fp32_kept():
        torch.set_float32_matmul_precision("highest")  # matmul.allow_tf32 False, and oneDNN's matmul IEEE
        if _read(lambda: cudnn.allow_tf32) is not None:
            cudnn.allow_tf32 = False
        for setting in (matmul, cudnn.conv, cudnn.rnn):  # each op's own: a parent's "tf32" no longer reaches it
            setting.fp32_precision = "ieee"
        yield


def is_gpu(device) -> bool:
    """Whether ``device`` is a GPU (where accelerate, autocast and TF32 apply)."""
    import torch

    return torch.device(device).type == "cuda"


def mixed_precision(precision: str, device) -> str:
    """accelerate's ``mixed_precision`` for a :data:`PRECISIONS` spelling on ``device``: ``auto``
    is bf16 autocast on a GPU that supports it, else none (float32)."""
    import torch

    if precision not in PRECISIONS:
        raise SurgeryError(f"unknown precision {precision!r}; choose {', '.join(PRECISION_CHOICES)}")
    if precision == "auto":
        return "bf16" if is_gpu(device) and torch.cuda.is_bf16_supported() else "no"
    return PRECISIONS[precision]


FSDP_ENV = "ACCELERATE_USE_FSDP"


def sharding() -> bool:
    """Whether training shards its state over the processes (FSDP2): asked the way accelerate's
    users ask, ``accelerate launch --use_fsdp --fsdp_version 2`` (or a config file's
    ``distributed_type: FSDP`` with ``fsdp_version: 2``), which sets ``ACCELERATE_USE_FSDP=true``
    and ``FSDP_VERSION=2``: the same two variables under ``torchrun``. FSDP version 1 is refused."""
    if os.environ.get(FSDP_ENV, "false").lower() != "true":
        return False
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise SurgeryError(f"FSDP version {os.environ.get('FSDP_VERSION', '1')} is not supported: shard with FSDP2 "
                           "(accelerate launch --use_fsdp --fsdp_version 2, or FSDP_VERSION=2)")
    return True


def shard_policy(mixed: str):
    """FSDP2's MixedPrecisionPolicy for accelerate's ``mixed`` (:func:`mixed_precision`): bf16
    compute over float32 master weights, gradients reduced in float32; float32 (no policy) where
    ``mixed`` is "no". fp16 is refused (it needs a sharded gradient scaler)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed == "fp16":
        raise SurgeryError("sharded training (FSDP) computes in bf16 or fp32: use --precision bf16 or auto")
    if mixed == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def processes() -> tuple[int, int]:
    """(this process's rank, the number of processes): (0, 1) outside a distributed group."""
    import torch

    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def mean_over_processes(t):
    """``t`` averaged over the processes of a distributed group, in place (unchanged when alone):
    a statistic a forward keeps (a running mean) stays one value in every process."""
    import torch

    n = processes()[1]
    if n > 1:
        torch.distributed.all_reduce(t)  # a sum: gloo has no average
        t /= n
    return t


def make_accelerator(precision: str, device):
    """The training processes' Accelerator on ``device`` (:func:`choose`; a GPU is the current CUDA
    device, ``runner.choose_device``; no default, which would silently train on the CPU) with ``precision``
    (:func:`mixed_precision`). On the CPU it asks for the CPU, so
    ``torchrun`` processes join one gloo group. A data-parallel accelerator even where FSDP is
    asked (:func:`sharding`): ``training`` shards the model itself, since accelerate's FSDP2 refuses
    the CPU and keeps the model sharded (upcast, on the meta device) after training. The float32
    settings it finds (a job's: TF32 off, :func:`exact_arithmetic`) hold after it: accelerate turns
    TF32 on where it has a dynamo backend."""
    import torch
    from accelerate import Accelerator

    device = torch.device(device)
    mixed = mixed_precision(precision, device)
    asked = os.environ.pop(FSDP_ENV, None)  # training shards the model itself (training.Shards), not accelerate
    try:
        with fp32_kept():  # accelerate turns TF32 on (a dynamo backend): the job's settings (TF32 off) kept
            return Accelerator(mixed_precision=mixed, cpu=not is_gpu(device))
    except ValueError as e:  # accelerate's state is per process: its precision is fixed once set
        raise SurgeryError(str(e)) from None
    finally:
        if asked is not None:
            os.environ[FSDP_ENV] = asked


def rng_state() -> dict:
    """The random generators' states for a training state file: the CPU's, and every GPU's
    where torch sees one (``rng``, ``cuda_rng``)."""
    import torch

    return {"rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def rng_kept(device):
    """A block whose draws from torch's global generators (a seeded training's, LoRA's
    initialisation) leave them as it found them: the CPU's, and ``device``'s where a GPU (only
    that one: forking every GPU's would wake each of them in every process)."""
    import torch

    device = torch.device(device)
    gpu = [device.index if device.index is not None else torch.cuda.current_device()] if is_gpu(device) else []
    return torch.random.fork_rng(devices=gpu, device_type="cuda")


def restore_rng(state: dict) -> None:
    """The generators as :func:`rng_state` kept them (the GPUs' where both runs have them)."""
    import torch

    torch.set_rng_state(state["rng"])
    if torch.cuda.is_available() and state.get("cuda_rng") is not None:
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def describe(device) -> dict:
    """{"device": "cuda:0", "name": "NVIDIA H200"}: what a result and a model card record."""
    import torch

    device = torch.device(device)
    if is_gpu(device):
        return {"device": str(device), "name": torch.cuda.get_device_name(device)}
    return {"device": str(device), "name": "CPU" if device.type == "cpu" else device.type}


def of(model):
    """Where ``model`` computes: its first parameter's device that is not meta, else (a streamed
    model, whose parameters wait on the meta device until their part is entered: its buffers were
    placed on its device) its first buffer's, else the CPU."""
    import torch

    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != "meta":
            return t.device
    return next((b.device for b in model.buffers()), torch.device("cpu"))


def same(a, b) -> bool:
    """Whether two devices are one (``cuda`` is the current CUDA device)."""
    import torch

    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def place_buffers(model, device) -> None:
    """Move ``model``'s real buffers (rotary frequencies; a meta model's only real tensors) to ``device``."""
    for mod in model.modules():
        for name, b in mod._buffers.items():
            if b is not None and b.device.type != "meta" and not same(b.device, device):
                mod._buffers[name] = b.to(device)


def free_bytes(device) -> int | None:
    """Bytes free on a GPU ``device`` (None: not a GPU, host memory decides)."""
    import torch

    if not is_gpu(device):
        return None
    return torch.cuda.mem_get_info(torch.device(device))[0]


#: host memory: where tensors go on purpose to become bytes, numpy arrays or files (and a model with
#: no other device given), named once instead of the literal "cpu" throughout
HOST = "cpu"
