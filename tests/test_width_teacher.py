"""The width-cut teacher (engine/width_teacher.py): the student after mask + minimize plus the removed
units and heads is the original model, sharing the student's tensors."""

import copy

import pytest
import torch

from models import tiny_model, token_ids
from normsurgery.commands.convert import apply_passes
from normsurgery.core import algebra
from normsurgery.core.families import layout
from normsurgery.engine.width_teacher import NotExact, width_cut

CUT = {"prune_units": 0.3, "prune_heads": 0.5}


def _cut(family, dtype=torch.float64, within=False, **options):
    """(original, student: mask + minimize of a copy); ``within``: instead of whole kv groups, the
    first query head of every kv group masked in every block (its kv head stays, read by the others)."""
    original = tiny_model(family, dtype)
    student = copy.deepcopy(original)
    if within:
        with torch.no_grad():
            for attn in layout(student).attention:
                o = student.get_submodule(attn.o)
                w = algebra.weight(o, None).clone()
                for h in range(0, attn.num_heads, attn.num_heads // attn.num_kv_heads):
                    w[:, h * attn.head_dim:(h + 1) * attn.head_dim] = 0
                algebra.set_weight(o, w)
    apply_passes(student, [("minimize", {**CUT, **({"prune_heads": 0.0} if within else {}), **options})])
    return original, student.requires_grad_(False)  # as in training: only what trains requires grad


@pytest.mark.parametrize("family,within", [("llama", False), ("llama", True), ("gpt2", False)])
def test_the_assembled_teacher_is_the_original(family, within):
    original, student = _cut(family, within=within)
    lo, ls = layout(original), layout(student)
    assert sum(algebra.in_width(student.get_submodule(m.down)) for m in ls.mlps) < sum(
        algebra.in_width(original.get_submodule(m.down)) for m in lo.mlps)
    assert sum(a.num_heads for a in ls.attention) < sum(a.num_heads for a in lo.attention)
    assert [a.num_kv_heads for a in ls.attention] == [a.num_kv_heads // (1 if within else 2) for a in lo.attention]
    ids = token_ids(3, 16)
    with torch.no_grad():
        want, cut = original(input_ids=ids).logits, student(input_ids=ids).logits
    teacher = width_cut(original, student)
    got = teacher.targets(ids, 0, 0)
    scale = want.abs().max()
    assert (cut - want).abs().max() / scale > 1e-2  # the cut changed the function
    assert (got - want).abs().max() / scale < 1e-12  # float64: the assembled teacher is the original
    with torch.no_grad():  # the hooks are gone after the teacher ran: the student is the student again
        assert torch.equal(student(input_ids=ids).logits, cut)


def test_the_teacher_shares_the_students_tensors_and_holds_only_what_was_cut():
    original, student = _cut("llama", torch.float32)
    teacher = width_cut(original, student)
    assert teacher.model is student
    extra = {p.data_ptr() for m in teacher.removed.values() for p in m.parameters()}
    ours = {p.data_ptr() for p in student.parameters()}
    assert not extra & ours
    removed = sum(p.numel() for p in original.parameters()) - sum(p.numel() for p in student.parameters())
    held = sum(p.numel() for m in teacher.removed.values() for p in m.parameters())
    # the removed rows and columns, plus per changed attention the zeroed o columns of kept heads in
    # the removed heads' kv groups and the bias deltas
    assert removed <= held < removed * 1.5
    assert teacher.extra_bytes() == held * 4
    assert all(not p.requires_grad for m in teacher.removed.values() for p in m.parameters())


def test_the_teacher_runs_with_the_adapters_off():
    from peft import LoraConfig, get_peft_model

    original, student = _cut("llama")
    teacher = width_cut(original, student)
    peft = get_peft_model(student, LoraConfig(r=4, target_modules=["o_proj", "down_proj", "q_proj"],
                                              init_lora_weights=False))
    assert teacher.over(peft) is teacher and teacher.model is peft
    ids = token_ids(2, 16)
    with torch.no_grad():
        want, adapted = original(input_ids=ids).logits, peft(input_ids=ids).logits
    assert (adapted - want).abs().max() / want.abs().max() > 1e-3
    assert (teacher.targets(ids, 0, 0) - want).abs().max() / want.abs().max() < 1e-12
    # a shared weight that trains would make the teacher drift with the student: refused
    with pytest.raises(NotExact, match="the width-cut teacher shares them"):
        teacher.over(peft, [next(p for n, p in peft.named_parameters() if "norm" in n)])


def test_a_student_whose_kept_weights_changed_is_refused():
    original, student = _cut("llama")
    with torch.no_grad():
        student.get_submodule(layout(student).mlps[0].up).weight[0, 0] += 1e-3
    with pytest.raises(NotExact, match="not the original's"):
        width_cut(original, student)
    original, student = _cut("llama", sparsity=0.2)  # magnitude zeros inside kept units
    with pytest.raises(NotExact):
        width_cut(original, student)
