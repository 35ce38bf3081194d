"""The one fine-tuning loop: schedule, resume, several processes."""

import json

import pytest
import torch

from normsurgery.core.errors import SurgeryError
from normsurgery.engine.training import TrainConfig, heldout_ce, train

from models import tiny_model, token_ids, torchrun_cli

LLAMA = "normsurgery/demo/llama-tiny"
SAMPLE = "normsurgery/data/sample.txt"


def data():
    return token_ids(1, 3000, seed=1)[0], token_ids(4, 32, seed=2)


def test_schedule_warms_up_then_decays_to_min_lr():
    c = TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup=10)
    lrs = [c.lr_at(s) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] == pytest.approx(1e-4, rel=1e-2)


def test_resume_reaches_the_uninterrupted_result(tmp_path):
    ids, held = data()
    config = dict(steps=6, batch_size=2, seq_len=32, lr=1e-3, save_every=2, eval_every=3, state_dir=tmp_path / "s")
    whole = tiny_model("gpt2", torch.float32)
    ref = train(whole, ids, held, TrainConfig(**config))

    class Stop(Exception):
        pass

    def interrupt(step, model):
        if step == 5:  # the state of step 4 is saved; step 5 never finishes
            raise Stop

    part = tiny_model("gpt2", torch.float32)
    with pytest.raises(Stop):
        train(part, ids, held, TrainConfig(**config), on_step=interrupt)
    resumed = tiny_model("gpt2", torch.float32)  # a fresh process would load the original again
    got = train(resumed, ids, held, TrainConfig(**config, resume=True))
    assert got.resumed_from == 4 and got.losses == ref.losses and got.curve == ref.curve
    for (n, a), b in zip(whole.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), n
    assert got.ce_after == ref.ce_after == pytest.approx(heldout_ce(resumed, held, objective="causal-lm"))
    # another configuration cannot pick up this state
    with pytest.raises(SurgeryError, match="from another run"):
        train(tiny_model("gpt2", torch.float32), ids, held, TrainConfig(**{**config, "lr": 2e-3}, resume=True))


def test_training_gives_the_callers_generator_back():
    """The loop seeds torch's global generator (dropout draws from it): a run is its
    configuration's alone, whatever the caller drew before, and the caller's generator is given
    back as it was (issue 54: it was left where the loop's draws took it)."""
    ids, held = data()
    runs = []
    for seed in (1, 2):
        model = tiny_model("gpt2", torch.float32, resid_pdrop=0.1)  # dropout: the loop draws from the generator
        torch.manual_seed(seed)
        before = torch.random.get_rng_state()
        runs.append(train(model, ids, held, TrainConfig(steps=2, batch_size=2, seq_len=32, lr=1e-3)).losses)
        assert torch.equal(torch.random.get_rng_state(), before)
    assert runs[0] == runs[1]


def test_on_step_metrics_and_params_subset():
    ids, held = data()
    model = tiny_model("llama", torch.float32)
    frozen = {n: p.clone() for n, p in model.named_parameters() if "mlp" not in n}
    mlp = [p for n, p in model.named_parameters() if "mlp" in n]
    r = train(model, ids, held, TrainConfig(steps=4, batch_size=2, seq_len=32, lr=1e-3, eval_steps=(2,)),
              params=mlp, on_step=lambda step, m: {"seen": step})
    assert [row["step"] for row in r.curve] == [0, 2, 4] and [row.get("seen") for row in r.curve] == [None, 1, 3]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    assert all(p.requires_grad for p in model.parameters())  # flags given back
    assert r.trainable_parameters == sum(p.numel() for p in mlp) and r.tokens == 4 * 2 * 32


def test_two_cpu_processes_form_one_group_and_write_once(tmp_path):
    """torchrun with two processes: one gloo group, half the batches each, one output."""
    out = tmp_path / "out"
    r = torchrun_cli("heal", LLAMA, out, "--text", SAMPLE, "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                     "--eval-samples", "2", "--json", timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)  # one JSON document: only the main process printed
    assert report["heal"]["processes"] == 2 and report["heal"]["tokens"] == 2 * 2 * 2 * 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "model.safetensors").is_file()


def test_a_resumed_run_says_where_it_resumed():
    from normsurgery.engine.training import TrainResult

    r = TrainResult(steps=120, tokens=1000, seconds=3.0, processes=1, precision="no", ce_before=4.0,
                    ce_after=3.0, trainable_parameters=10, resumed_from=50)
    assert r.done() == "trained 120 steps (resumed at step 50: 70 in this run, 1,000 tokens, 3 s, fp32)"
    r.resumed_from = None
    assert r.done() == "trained 120 steps (1,000 tokens, 3 s, fp32)"


def test_plateau_rule():
    from normsurgery.engine.training import plateaued

    def curve(*ces, start=0):
        return [{"step": start + 10 * i, "heldout_ce": c} for i, c in enumerate(ces)]

    assert not plateaued(curve(3.0, 2.9, 2.8, 2.7), 0, 2, 1e-3)  # improving
    assert plateaued(curve(3.0, 2.9, 2.9, 2.95), 0, 2, 1e-3)  # two evaluations without improving
    assert not plateaued(curve(3.0, 2.9, 2.9, 2.85), 0, 2, 1e-3)  # improved again
    assert not plateaued(curve(3.0, 2.9, 2.8995, 2.9), 0, 3, 1e-3)  # 5e-4 is no improvement: 2 of 3
    # evaluations before ``settle`` (a schedule still changing the model) do not count
    assert not plateaued(curve(2.0, 3.0, 3.1, 3.2), 15, 2, 1e-3)
    assert plateaued(curve(2.0, 3.0, 3.1, 3.2, 3.3), 15, 2, 1e-3)


def test_training_stops_when_heldout_ce_stops_improving():
    """A model that cannot improve (learning rate ~0) stops after ``patience`` evaluations; one
    that can runs to the cap; the result says which."""
    ids, held = data()
    config = dict(steps=24, batch_size=2, seq_len=32, eval_every=4, patience=2)
    stuck = train(tiny_model("llama", torch.float32), ids, held, TrainConfig(lr=1e-12, **config))
    assert stuck.steps == 8 and stuck.cap == 24 and stuck.tokens == 8 * 2 * 32 and len(stuck.losses) == 8
    assert [r["step"] for r in stuck.curve] == [0, 4, 8] and "of at most 24" in stuck.done()
    learning = train(tiny_model("llama", torch.float32), ids, held, TrainConfig(lr=3e-3, **config))
    assert learning.steps == 24 and learning.cap is None and learning.ce_after < learning.ce_before
    with pytest.raises(SurgeryError, match="needs evaluations during training"):
        TrainConfig(steps=10, patience=2).check()


def test_a_loss_that_turns_nan_stops_the_training_in_one_line():
    """A diverged run (here: the weights poisoned with NaN at the start of the third step) stops at
    that step with the last finite loss, instead of training on to save NaN weights."""
    ids, held = data()
    model = tiny_model("llama", torch.float32)

    def poison(step, m):
        if step == 2:
            with torch.no_grad():
                m.model.embed_tokens.weight.fill_(float("nan"))

    with pytest.raises(SurgeryError, match=r"training diverged at step 3 of 6: the loss is nan \(the last finite one "
                                           r"\d+\.\d+\); nothing was saved: a lower --lr may hold"):
        train(model, ids, held, TrainConfig(steps=6, batch_size=2, seq_len=32, lr=1e-3), on_step=poison)
