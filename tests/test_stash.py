"""A model's tensors set aside on disk (``stash.Stash``) come back bit for bit into the very
objects they left, ties and buffers included, and hold no memory meanwhile."""

import pytest
import torch

from normsurgery.io.stash import Stash

from models import tiny_model


@pytest.mark.parametrize("family,dtype", [("gpt2", torch.float32), ("llama", torch.bfloat16)])
def test_a_stash_holds_nothing_and_gives_back_every_tensor_to_its_object(tmp_path, family, dtype):
    model = tiny_model(family, dtype)
    objects = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    before = {k: v.clone() for k, v in objects.items()}
    if family == "llama":  # a buffer checkpoints do not hold, set aside too
        assert "model.rotary_emb.inv_freq" in objects
    stash = Stash(model, tmp_path / "aside")
    assert all(t.numel() == 0 for t in objects.values())
    stash.back()
    after = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert after.keys() == before.keys()
    for k, t in after.items():
        assert t is objects[k] and t.dtype == before[k].dtype and torch.equal(t, before[k]), k
    if family == "gpt2":  # the tie holds: one object
        assert model.lm_head.weight is model.transformer.wte.weight
    assert not any((tmp_path / "aside").iterdir())  # its own folder went
