"""A model's tensors set aside on disk while training needs the memory.

A trained pass's control (the same fine-tune with the norms kept) needs the model as it was before
the pass. Training holds 16 bytes per parameter (float32 weights, gradients and two Adam moments), so
a copy held beside it made the peak 20. On disk instead, the peak is the training's own: the input's
copy is stashed while the pass trains, and the trained model while the control trains.

:class:`Stash` writes every parameter and buffer with ``shards.ShardWriter`` (one tensor at a time,
each emptied in place once written: no serialised copy in memory) and reads each back with
``shards.Reader`` into the very object it came from, on its device, bit for bit."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from .shards import Index, Reader, ShardWriter, header_room


class Stash:
    """``model``'s parameters and buffers in ``folder`` (in a folder of this process's own, ``rank-R``
    where several processes run one job: made, then removed by :meth:`back`; one left by an
    interrupted run is replaced), each object left in the model holding an empty tensor until then."""

    def __init__(self, model, folder: Path):
        self.folder = Path(folder) / f"rank-{os.environ.get('RANK', '0')}"
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)
        self.tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # tied: once
        writer = ShardWriter(self.folder, 1 << 62, header_room(self.tensors))  # one file
        for name, t in self.tensors.items():
            writer.add(name, t)
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.file = self.folder / writer.close()[0]

    def back(self) -> None:
        """Every tensor read back into its object, on its device; the folder removed."""
        reader = Reader(Index([self.file]))
        try:
            for name, t in self.tensors.items():
                t.data = reader.read(name).to(t.device)
        finally:
            reader.close()
        shutil.rmtree(self.folder, ignore_errors=True)
