"""Processes: which one is the main one, and the model sharded over them for training (FSDP2).

Data parallel, each process holds the whole training state, unless accelerate's FSDP
configuration asks to shard it (``devices.sharding``): then each block, and the whole model, are
wrapped with FSDP2's ``fully_shard`` for the steps (:class:`Shards`), each process holding 1/N of
the weights, gradients and AdamW moments, and every process is given the whole model back after
them (``training.train``).
"""

from __future__ import annotations

import torch

from ..core.families import layout


def is_main_process() -> bool:
    """False in every process but the first of a distributed group."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) \
        or torch.distributed.get_rank() == 0


# ----------------------------------------------------------------------------- sharding (FSDP2)

#: a module's hook tables (fully_shard adds to them; :meth:`Shards.whole` takes its entries out)
_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
          "_forward_hooks_always_called", "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")


def _local(obj):
    """``obj`` (a state dict, nested) with every DTensor replaced by this process's shard."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_local(v) for v in obj]
    return obj.to_local() if isinstance(obj, DTensor) else obj


def _like(t, template):
    """A shard ``t`` as a DTensor laid out as ``template`` (itself where ``template`` is not one)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(template, DTensor) or t.ndim != template.ndim:
        return t
    return DTensor.from_local(t.to(template.device), template.device_mesh, template.placements,
                              shape=template.shape, stride=template.stride())


def _from_main(model, whole: dict) -> None:
    """Load the main process's ``whole`` state dict (empty elsewhere) into the sharded ``model``:
    each process receives its shards of each tensor in turn (ties kept: one parameter per tensor)."""
    from torch import nn
    from torch.distributed.tensor import DTensor, distribute_tensor

    state, made = {}, {}
    for key, t in model.state_dict(keep_vars=True).items():
        if id(t) not in made:
            device = torch.device(t.device_mesh.device_type) if isinstance(t, DTensor) else t.device
            full = whole[key].to(device) if whole else torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, DTensor):
                made[id(t)] = nn.Parameter(distribute_tensor(full, t.device_mesh, t.placements),
                                           requires_grad=t.requires_grad)
            else:
                torch.distributed.broadcast(full, 0)
                made[id(t)] = full
        state[key] = made[id(t)]
    model.load_state_dict(state, assign=True)


class Shards:
    """``model`` sharded in place over the processes for training (FSDP2): each block, then the
    whole model (embeddings, final norm, head), wrapped with ``fully_shard`` under ``policy``
    (``devices.shard_policy``), each process's shards sent by the main process (the others may
    hold the model on the meta device: ``runner.Job.load``). :meth:`whole` gives every process the
    whole model back as it was: plain parameters, its classes and hooks."""

    def __init__(self, model, policy):
        from torch.distributed.fsdp import fully_shard

        self.model = model
        self.before = {m: (type(m), set(vars(m)), {h: set(getattr(m, h)) for h in _HOOKS}) for m in model.modules()}
        whole = model.state_dict() if is_main_process() else {}  # the others' may wait on the meta device
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        for block in base.get_submodule(layout(base).layers_path).children():
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        _from_main(model, whole)

    def whole(self) -> None:
        """Every parameter gathered whole in every process, and fully_shard's changes undone."""
        from torch import nn
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        gathered: dict[int, nn.Parameter] = {}
        for m in self.model.modules():  # the same order in every process: one all-gather at a time
            for name, p in m._parameters.items():
                if isinstance(p, DTensor):
                    if id(p) not in gathered:
                        gathered[id(p)] = nn.Parameter(p.full_tensor(), requires_grad=p.requires_grad)
                    m._parameters[name] = gathered[id(p)]
        for m, (cls, attrs, hooks) in self.before.items():
            m.__class__ = cls
            for a in set(vars(m)) - attrs:
                if a.startswith(("__composable_api", "_is_fsdp", "_fsdp")):
                    delattr(m, a)
            for h, keys in hooks.items():
                table = getattr(m, h)
                for k in set(table) - keys:
                    del table[k]
            _module_state_mapping.pop(m, None)

    def local_state(self, optimizer) -> dict:
        """This process's shards of the model's and ``optimizer``'s states, plain tensors."""
        return {"model": _local(self.model.state_dict()), "optimizer": _local(optimizer.state_dict())}

    def load_local(self, state: dict, optimizer) -> None:
        """:meth:`local_state`'s shards put back into the sharded model and ``optimizer``."""
        template = self.model.state_dict()
        self.model.load_state_dict({k: _like(v, template[k]) for k, v in state["model"].items()})
        params = [p for g in optimizer.param_groups for p in g["params"]]
        saved = state["optimizer"]
        optimizer.load_state_dict({**saved, "state": {i: {k: _like(v, params[i]) for k, v in s.items()}
                                                      for i, s in saved["state"].items()}})
