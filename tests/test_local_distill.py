"""Blockwise local distillation (engine/local_distill.py): each changed block's nMSE to the teacher's
block falls, unchanged blocks are not trained, and the blocks streamed one at a time give the same
result as the model held whole."""

import copy

import torch
from peft import LoraConfig, get_peft_model

from models import VOCAB, tiny_model
from normsurgery.commands.convert import apply_passes
from normsurgery.core import algebra
from normsurgery.core.families import layout
from normsurgery.engine.local_distill import LocalConfig, block_inputs, changed_blocks, local_distill
from normsurgery.engine.width_teacher import width_cut

LORA = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def _student():
    """(teacher, peft student): block 1 of a tiny llama loses 24 of its 64 MLP units, the others nothing."""
    original = tiny_model("llama", torch.float32)
    student = copy.deepcopy(original)
    down = layout(student).mlps[1].down
    with torch.no_grad():
        w = algebra.weight(student.get_submodule(down), None).clone()
        w[:, :24] = 0
        algebra.set_weight(student.get_submodule(down), w)
    apply_passes(student, [("minimize", {})])
    teacher = width_cut(original, student.requires_grad_(False))
    torch.manual_seed(0)
    peft = get_peft_model(student, LORA)
    teacher.model = peft  # the teacher's forward: the base, adapters off, the removed units back
    return teacher, peft


def _windows():
    return torch.randint(0, VOCAB, (8, 16), generator=torch.Generator().manual_seed(3))


def _lora(model, block):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n and f".layers.{block}." in n}


def test_the_changed_block_learns_its_teachers_output_and_no_other_trains():
    teacher, student = _student()
    changed = changed_blocks(student, teacher.removed)
    assert changed == {1}
    before = {i: _lora(student, i) for i in (0, 2)}
    rows = local_distill(teacher, student, _windows(), changed, LocalConfig(steps=40, lr=1e-2, batch_size=4))
    assert rows[1]["nmse_after"] < 0.5 * rows[1]["nmse_before"], rows
    assert rows[1]["nmse_before"] > 1e-3  # the cut block missed part of its update
    assert rows[0]["nmse_before"] is None and rows[2]["nmse_before"] is None
    for i in (0, 2):
        assert all(torch.equal(p, _lora(student, i)[n]) for n, p in before[i].items())


def test_streamed_one_block_at_a_time_equals_whole(tmp_path):
    whole_t, whole = _student()
    streamed_t, streamed = _student()
    config = LocalConfig(steps=10, lr=1e-2, batch_size=4)
    rows_w = local_distill(whole_t, whole, _windows(), {1}, config)
    blocks = streamed.get_base_model().model.layers
    one = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    held = []
    hooks = [b.register_forward_pre_hook(lambda m, a: held.append(sum(p.numel() for p in blocks.parameters())))
             for b in blocks]
    rows_s = local_distill(streamed_t, streamed, _windows(), {1}, config, stash=tmp_path / "stash")
    for h in hooks:
        h.remove()
    assert held and max(held) == one  # while a block runs, the others wait on disk
    assert rows_w == rows_s
    a, b = dict(whole.named_parameters()), dict(streamed.named_parameters())
    assert all(torch.equal(p, b[n]) for n, p in a.items())
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in b.items())  # it trained


def test_the_cached_block_inputs_are_the_teachers_stream():
    """h_{i+1} = f_T,i(h_i) from block 0's captured input equals the teacher's own block inputs."""
    teacher, student = _student()
    ids = _windows()[:4]
    seen = []
    blocks = student.get_base_model().model.layers
    hooks = [b.register_forward_pre_hook(lambda m, a, k: seen.append(a[0] if a else k["hidden_states"]),
                                         with_kwargs=True) for b in blocks]
    with torch.no_grad(), teacher.active():
        teacher.model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    (args, kwargs), = block_inputs(teacher, ids, 4)
    h = args[0]
    with torch.no_grad(), teacher.active():
        for i, b in enumerate(blocks):
            assert torch.equal(h, seen[i])
            out = b(h, *args[1:], **kwargs)
            h = out[0] if isinstance(out, tuple) else out
