"""Distillation from the model before a layer cut: the teacher shares the student's tensors, computes
the original, and the loss the loop trains on is the KL to it at T over the predicted positions."""

import copy

import pytest
import torch

from normsurgery.commands.heal import HealOptions, heal_model
from normsurgery.commands.heal_teacher import Teaching
from normsurgery.commands.prune import prune_model
from normsurgery.core.distillation import kd_loss_sum
from normsurgery.core.errors import SurgeryError
from normsurgery.engine.teacher import Distillation, LayerCut, cut_of
from normsurgery.engine.training import TrainConfig, _batch, train

from models import tiny_model, token_ids

NO_DROPOUT = {"bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}
MASK_ID = 3


def cut_model(family: str, layers=(1,), **config):
    """(the original, a copy of it; the student: the copy with ``layers`` cut; the Cut)."""
    model = tiny_model(family, torch.float32, **NO_DROPOUT.get(family, {}), **config)
    original = copy.deepcopy(model)
    cut = cut_of(model, layers)
    prune_model(model, layers)
    return original, model, cut


def logits(model, ids, causal=True):
    with torch.no_grad():
        return model(input_ids=ids, **({"use_cache": False} if causal else {})).logits


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "bert"])
def test_the_assembled_teacher_is_the_original_and_shares_the_students_tensors(family):
    original, student, cut = cut_model(family)
    ids = token_ids(2, 16, seed=3)
    causal = family != "bert"
    teacher = LayerCut(student, cut)
    students = {p.data_ptr() for p in student.parameters()}
    with teacher.assembled():
        inside = {p.data_ptr() for p in student.parameters()}
        assert student.config.num_hidden_layers == original.config.num_hidden_layers
    cut_ptrs = {p.data_ptr() for b in cut.blocks.values() for p in b.parameters()}
    assert inside == students | cut_ptrs  # the student's own tensors and the cut blocks: nothing copied
    assert teacher.nbytes == cut.nbytes == sum(p.numel() * 4 for b in cut.blocks.values() for p in b.parameters())
    assert torch.equal(teacher.targets(ids, 0, 0), logits(original, ids, causal))
    # the student is given back as it was: its own layers, config and function
    assert student.config.num_hidden_layers == original.config.num_hidden_layers - 1
    assert not torch.allclose(logits(student, ids, causal), logits(original, ids, causal), atol=1e-3)


def test_the_teacher_of_a_lora_student_is_its_base_with_the_adapters_off():
    from peft import LoraConfig, get_peft_model

    original, student, cut = cut_model("llama")
    peft = get_peft_model(student, LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)  # the adapters change the student's function
    ids = token_ids(2, 16, seed=4)
    assert torch.equal(LayerCut(peft, cut).targets(ids, 0, 0), logits(original, ids))


def test_train_norms_teacher_holds_the_norms_as_they_were():
    """The norms train in place: the teacher holds their starting values (small copies), not the trained ones."""
    original, student, cut = cut_model("llama")
    norms = [p for n, p in student.named_parameters() if "norm" in n]
    teacher = LayerCut(student, cut, norms)
    with torch.no_grad():
        for p in norms:
            p.mul_(1.5)
    ids = token_ids(2, 16, seed=5)
    assert torch.equal(teacher.targets(ids, 0, 0), logits(original, ids))
    assert all(torch.equal(a, b) for a, b in zip(norms, [p * 1 for p in norms]))  # trained values back in place
    assert teacher.nbytes == cut.nbytes + sum(p.numel() * 4 for p in norms)


def first_loss(family: str, objective: str = "kd", temperature: float = 1.0) -> tuple[float, float]:
    """(the loss the loop reports for step 0 of a heal distilling from the cut teacher, the same
    written out from the original's and the pruned model's logits on the step's windows)."""
    original, student, cut = cut_model(family)
    ids, held = token_ids(1, 400, seed=1)[0], token_ids(2, 16, seed=2)
    opts = HealOptions(steps=1, seq_len=16, batch_size=2, objective=objective, temperature=temperature)
    causal = family != "bert"
    inputs, labels = _batch(ids, TrainConfig(steps=1, batch_size=2, seq_len=16), 0, 0, 0, 1,
                            None if causal else (MASK_ID, student.config.vocab_size))
    s, t = logits(student, inputs, causal), logits(original, inputs, causal)
    mask = labels != -100
    if causal:
        s, t, mask = s[:, :-1], t[:, :-1], mask[:, 1:]
    total, count = kd_loss_sum(s, t, temperature, mask)
    _, report = heal_model(student, ids, held, opts, mask_token_id=MASK_ID, teacher=Teaching(cut, "original"))
    return report.losses[0], (total / count).item()


@pytest.mark.parametrize("family, temperature", [("llama", 1.0), ("llama", 2.0), ("bert", 2.0)])
def test_the_loss_is_the_kl_to_the_original_at_t_over_the_predicted_positions(family, temperature):
    """Fails when the teacher is silently the student (the loss would be 0), when the temperature
    is not applied, and (bert) when the positions not masked are averaged in."""
    got, expected = first_loss(family, temperature=temperature)
    assert expected > 1e-3 and got == pytest.approx(expected, rel=1e-4)


def test_kd_plus_ce_adds_the_weighted_ce():
    got_kd, kd = first_loss("llama", "kd")
    got_both, _ = first_loss("llama", "kd+ce")
    original, student, cut = cut_model("llama")
    ids = token_ids(1, 400, seed=1)[0]
    inputs, _ = _batch(ids, TrainConfig(steps=1, batch_size=2, seq_len=16), 0, 0, 0, 1, None)
    out = student(input_ids=inputs, labels=inputs, use_cache=False)
    assert got_both == pytest.approx(kd + out.loss.item(), rel=1e-4)


def test_a_distilling_objective_needs_a_teacher_and_the_resume_fingerprint_names_it(tmp_path):
    with pytest.raises(SurgeryError, match="distils from a teacher"):
        Distillation(None, "kd")
    original, student, cut = cut_model("llama")
    ids, held = token_ids(1, 400, seed=1)[0], token_ids(2, 16, seed=2)
    config = dict(steps=2, batch_size=2, seq_len=16, save_every=1, state_dir=tmp_path / "s")
    train(student, ids, held, TrainConfig(**config), distillation=Distillation(LayerCut(student, cut), "kd"))
    with pytest.raises(SurgeryError, match="from another run"):
        train(student, ids, held, TrainConfig(**config, resume=True),
              distillation=Distillation(LayerCut(student, cut), "kd", temperature=2.0))
