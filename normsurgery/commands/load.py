"""``normsurgery.load``: a checkpoint read whole into memory, as the API's other functions take
their options (``(src, options)``: ``LoadOptions``, a dict of its fields, or its fields as keywords)."""

from __future__ import annotations

import torch

from ..core.options import LoadOptions, options_of
from ..io import loader


def load(src, options: LoadOptions | dict | None = None, **keywords):
    """``src`` (a path, cached hub id or ``Source``; rewritten or stock) loaded with the class its
    ``architectures`` names, in ``options.dtype`` (default: its storage dtype), on ``options.device``
    (default: host memory), eval mode; ``options.stock``: the plain stock class (``loader.load``)."""
    o = options_of(LoadOptions, options, keywords)
    dtype = getattr(torch, str(o.dtype).removeprefix("torch.")) if o.dtype is not None else None
    return loader.load(src, dtype, stock=o.stock, allow_pickle=o.allow_pickle, device=o.device)
