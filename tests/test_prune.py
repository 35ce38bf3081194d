"""prune: removing layers equals skipping them; KV cache stays right; scores match a hand computation;
bad input gives one line, a non-zero exit and no output."""

import json
import math
from pathlib import Path

import pytest
import torch
import transformers as T
from typer.testing import CliRunner

import normsurgery as ns
import normsurgery.cli.prune  # noqa: F401  (registers prune and heal)
from normsurgery.core.families import layout
from normsurgery.cli import app
from normsurgery.core.analysis import residual_states
from normsurgery.commands.prune import count_layers, prune_model, score_layers, select_layers

from conftest import assert_refused, causal_ce, marked_text, record_reads, window_starts
from models import CAUSAL, CONFIGS, MASKED, tiny_model, token_ids

LLAMA = "normsurgery/demo/llama-tiny"
SAMPLE = "normsurgery/data/sample.txt"
runner = CliRunner()


def blocks(model):
    return model.get_submodule(layout(model).layers_path)


def skip_layers(model, removed):
    """The reference by hand: the same model with the removed blocks returning their input."""
    def identity(module, args, kwargs, output):
        x = args[0] if args else kwargs["hidden_states"]
        return (x, *output[1:]) if isinstance(output, tuple) else x
    return [blocks(model)[i].register_forward_hook(identity, with_kwargs=True) for i in removed]


FLOAT64 = dict(dtype=torch.float64, experts_implementation="eager")  # the default grouped_mm takes no float64


def auto_class(family):
    return T.AutoModelForMaskedLM if family in MASKED else T.AutoModelForCausalLM


def layer_indices(model):
    return [[m.layer_idx for m in b.modules() if isinstance(getattr(m, "layer_idx", None), int)]
            for b in blocks(model)]


def skipped_logits(model, removed, ids):
    handles = skip_layers(model, removed)
    with torch.no_grad():
        out = model(input_ids=ids).logits
    for h in handles:
        h.remove()
    return out


@pytest.mark.parametrize("family", CONFIGS)
def test_pruned_checkpoint_equals_the_model_with_those_layers_skipped(family, tmp_path):
    removed = [1]
    ids = token_ids(2, 16)
    model = tiny_model(family)
    # loading recomputes some buffers (Gemma's embedding scale) in float32: compare like with like
    ns.save(model, tmp_path / "original")
    original = auto_class(family).from_pretrained(tmp_path / "original", **FLOAT64).eval()
    reference = {"memory": skipped_logits(model, removed, ids), "plain": skipped_logits(original, removed, ids)}
    record = prune_model(model, removed)
    assert record["kept"] == [0, 2] and model.config.num_hidden_layers == 2
    ns.save(model, tmp_path / "out")
    plain = auto_class(family).from_pretrained(tmp_path / "out", **FLOAT64).eval()
    assert type(plain) is type(model) and len(blocks(plain)) == 2
    assert plain.config.num_hidden_layers == 2
    for m in (model, plain):
        no_index = family == "mpnet"  # MPNet's blocks keep no layer_idx (no KV cache)
        assert [set(idx) for idx in layer_indices(m)] == ([set(), set()] if no_index else [{0}, {1}])
        if hasattr(model.config, "layer_types"):
            assert len(m.config.layer_types) == 2
    with torch.no_grad():
        for name, m in (("memory", model), ("plain", plain)):
            out, ref = m(input_ids=ids).logits, reference[name]
            assert (out - ref).abs().max() <= 1e-12 * ref.abs().max(), name
    if model.config.tie_word_embeddings:
        assert plain.get_output_embeddings().weight.data_ptr() == plain.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("family", CAUSAL)
def test_generation_with_kv_cache_equals_generation_without_after_pruning(family, tmp_path):
    model = tiny_model(family, torch.float32)
    prompts = token_ids(2, 5, seed=3)
    kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    prune_model(model, [0])
    ns.save(model, tmp_path / "out")
    plain = T.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    for m in (model, plain):
        assert torch.equal(m.generate(prompts, use_cache=True, **kw), m.generate(prompts, use_cache=False, **kw))


def test_layer_types_and_windows_follow_the_kept_layers():
    cfg = CONFIGS["qwen2"]()
    cfg.num_hidden_layers, cfg.use_sliding_window, cfg.sliding_window, cfg.max_window_layers = 4, True, 4, 2
    cfg.layer_types = None
    cfg = T.Qwen2Config(**{**cfg.to_dict(), "layer_types": None})
    model = T.AutoModelForCausalLM.from_config(cfg).eval()
    assert model.config.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    prune_model(model, [1, 2])
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert model.config.max_window_layers == 1
    assert [b.self_attn.sliding_window for b in model.model.layers] == [None, 4]


def hand_states(model, ids, mask):
    """h_0..h_{L-1} from output_hidden_states; h_L is the final norm's input, caught by hand."""
    caught = []
    h = model.model.norm.register_forward_pre_hook(lambda mod, args: caught.append(args[0]))
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    h.remove()
    L = model.config.num_hidden_layers
    assert torch.allclose(model.model.norm(caught[0]), out.hidden_states[L])  # HF's last entry is normed
    return list(out.hidden_states[:L]) + caught


def test_angular_distance_and_block_influence_against_a_hand_computation():
    model = tiny_model("llama")
    ids = token_ids(2, 6)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    states = hand_states(model, ids, mask)
    real = [(b, t) for b in range(2) for t in range(6) if mask[b, t]]

    def cos(i, j, b, t):
        x, y = states[i][b, t].tolist(), states[j][b, t].tolist()
        return sum(p * q for p, q in zip(x, y)) / math.sqrt(sum(p * p for p in x) * sum(q * q for q in y))

    scores = score_layers(model, ids, mask)
    L = model.config.num_hidden_layers
    assert scores.tokens == len(real) == 10
    for i in range(L + 1):
        for j in range(i + 1, L + 1):
            hand = sum(math.acos(cos(i, j, b, t)) / math.pi for b, t in real) / len(real)
            assert abs(scores.angular[i, j].item() - hand) < 1e-12
    for l in range(L):
        hand = 1 - sum(cos(l, l + 1, b, t) for b, t in real) / len(real)
        assert abs(scores.influence[l].item() - hand) < 1e-12
    assert all(torch.equal(a, b) for a, b in zip(residual_states(model, ids, mask), states))


def test_a_layer_that_writes_nothing_is_the_one_removed():
    model = tiny_model("llama", torch.float32)
    for w in (model.model.layers[1].self_attn.o_proj, model.model.layers[1].mlp.down_proj):
        w.weight.data.zero_()
    scores = score_layers(model, token_ids(4, 16))
    assert scores.angular[1, 2].item() < 1e-3 and scores.influence[1].item() < 1e-6
    for method in ("angular", "block-influence"):
        assert select_layers(method, 1, scores).layers == (1,)


def test_float16_models_with_large_hidden_states_score_without_overflow():
    """|h|^2 of a float16 stream whose entries are in the hundreds exceeds float16's range
    (65504): a dot product taken in float16 is inf and the cosine NaN. The scores must equal a
    float64 computation on the same (float16) states."""
    model = tiny_model("llama", torch.float16)
    model.model.embed_tokens.weight.data.mul_(200.0)
    ids = token_ids(2, 16)
    states = residual_states(model, ids)
    assert all(s.dtype == torch.float16 and torch.isfinite(s).all() for s in states)
    assert torch.isinf((states[0] * states[0]).sum(-1)).any()  # in float16 the dot product overflows
    u = [s.double().reshape(-1, s.shape[-1]) for s in states]
    u = [x / x.norm(dim=-1, keepdim=True) for x in u]
    scores = score_layers(model, ids)
    for i in range(len(u)):
        for j in range(len(u)):
            hand = torch.arccos((u[i] * u[j]).sum(-1).clamp(-1, 1)).mean() / math.pi
            if i == j:  # a state against itself: 0, up to arccos(1 - d eps) ~ sqrt(2 d eps) of float64's rounding
                # of the dot product (its order differs by CPU), which arccos magnifies at 1
                assert scores.angular[i, j].item() < 1e-7 and hand.item() < 1e-7, i
            else:
                assert abs(scores.angular[i, j].item() - hand.item()) < 1e-9, (i, j)
    hand = [1 - (u[l] * u[l + 1]).sum(-1).mean().item() for l in range(len(u) - 1)]
    assert torch.allclose(scores.influence, torch.tensor(hand, dtype=torch.float64), atol=1e-12, rtol=0)


def test_selection_rules():
    model = tiny_model("gpt2", torch.float32)
    scores = score_layers(model, token_ids(2, 8))
    scores.influence = torch.tensor([0.5, 0.1, 0.4], dtype=torch.float64)
    assert select_layers("block-influence", 2, scores).layers == (1, 2)
    assert select_layers("last", 1, num_layers=8).layers == (6,)
    assert select_layers("last", 3, num_layers=8).layers == (4, 5, 6)
    d = scores.block_distance(2)
    sel = select_layers("angular", 2, scores)
    assert sel.layers == ((0, 1) if d[0] <= d[1] else (1, 2)) and sel.scores == d.tolist()
    assert count_layers(8, fraction=0.25) == 2
    for kwargs, match in [({"layers": 8}, "the model has 8"), ({"layers": 0}, "at least 1"),
                          ({"fraction": 0.01}, "rounds to 0"), ({}, "exactly one"),
                          ({"layers": 2, "fraction": 0.5}, "exactly one"), ({"fraction": 1.0}, r"--fraction must be in \(0, 1\), got 1.0")]:
        with pytest.raises(Exception, match=match):
            count_layers(8, **kwargs)


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_prune_cli_saves_a_plain_checkpoint_and_shows_why(tmp_path):
    out, png = tmp_path / "pruned", tmp_path / "scores.png"
    r = run("prune", LLAMA, out, "--layers", 2, "--samples", 8, "--plot", png, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["prune"]["layers_after"] == 6 and len(data["prune"]["removed"]) == 2
    assert data["ce"]["pruned"] >= data["ce"]["original"] - 0.05
    plain = T.AutoModelForCausalLM.from_pretrained(out)
    assert len(plain.model.layers) == 6
    assert json.loads((out / "config.json").read_text())["normsurgery"]["prune"]["method"] == "angular"
    assert (out / "tokenizer.json").is_file() and png.stat().st_size > 1000
    r = run("prune", LLAMA, tmp_path / "table", "--fraction", 0.25, "--method", "block-influence", "--samples", 4)
    assert r.exit_code == 0, r.output
    assert "block influence" in r.output and "removed 2 of 8 layers" in r.output


def test_prune_alone_measures_cross_entropy_on_the_held_out_end_of_the_text(tmp_path):
    """Issue 34.7: without --heal the CE is the held-out one (the end of --text, never the calibration
    windows), recorded and carded as such; --eval-samples counts."""
    from normsurgery.core.calibration import split_heldout, tokenize, windows
    from normsurgery.engine.training import heldout_ce

    text = Path("normsurgery/data/sample.txt").read_text()
    text += " ".join(f"zq{i * 7919 % 1000}x" for i in range(1500))  # the end: unlike anything calibrated on
    (tmp_path / "text.txt").write_text(text)
    out = tmp_path / "pruned"
    r = run("prune", LLAMA, out, "--layers", 2, "--samples", 4, "--seq-len", 64, "--eval-samples", 3,
            "--text", tmp_path / "text.txt", "--json")
    assert r.exit_code == 0, r.output
    ce = json.loads(r.stdout)["ce"]
    _, end = split_heldout(tokenize(T.AutoTokenizer.from_pretrained(LLAMA), text), 0.1, 64)
    held = windows(end, 64, 3)
    assert ce["original"] == pytest.approx(heldout_ce(T.AutoModelForCausalLM.from_pretrained(LLAMA), held), abs=1e-4)
    assert ce["pruned"] == pytest.approx(heldout_ce(T.AutoModelForCausalLM.from_pretrained(out), held), abs=1e-4)
    record = json.loads((out / "config.json").read_text())["normsurgery"]
    assert record["heldout_ce"] == ce
    assert record["heldout"] == {"text": "the last 10% of the text (never trained on)", "windows": 3, "seq_len": 64}
    card = (out / "README.md").read_text()
    assert "on the last 10% of the text (never trained on): 3 windows of 64 tokens" in card
    r = run("prune", LLAMA, tmp_path / "table", "--layers", 2, "--samples", 4, "--seq-len", 64)
    assert r.exit_code == 0 and "held out: the last 10% of the text (never trained on)" in r.output, r.output


def test_layer_scores_and_healing_never_read_the_held_out_end(tmp_path, monkeypatch):
    """Issues 47.2 and 47.10: the text's last 10% of tokens, held out for CE, ends in digits found
    nowhere before; layer scores, training batches and the training text's CE never read them,
    every held-out window lies in that last 10%, and the CE recorded is the one computed here on them."""
    tok = T.AutoTokenizer.from_pretrained(LLAMA)
    text, ids, marks, first = marked_text(Path(SAMPLE).read_text(), tok)
    reads = record_reads(monkeypatch)
    r = ns.prune(LLAMA, tmp_path / "out", {"layers": 2, "samples": 8, "seq_len": 64, "eval_samples": 3}, text=text,
                 heal={"steps": 2, "batch_size": 4, "eval_samples": 3})
    for reader in ("scores", "batches", "training CE"):
        assert reads[reader] and not any(t in marks for w in reads[reader] for t in w.flatten().tolist()), reader
    held = reads["held-out"]
    assert len(held) == 4 and all(torch.equal(w, held[0]) for w in held)  # original, pruned; before, after healing
    assert all(s >= first for s in window_starts(ids, held[0])) and any(t in marks for t in held[0][-1].tolist())
    assert r.ce["original"] == pytest.approx(causal_ce(T.AutoModelForCausalLM.from_pretrained(LLAMA), held[0]),
                                             abs=1e-4)


def test_fewer_held_out_windows_than_asked_are_said(tmp_path):
    """Issue 47.2: --eval-samples 16 evaluated 5 windows, said only in config.json. The held-out last
    10% of the sample (computed here) holds floor(its tokens / 128) windows: said in one line."""
    ids = T.AutoTokenizer.from_pretrained(LLAMA)(Path(SAMPLE).read_text(), add_special_tokens=False).input_ids
    end = max(128, int(0.1 * len(ids)))
    fit = end // 128
    assert fit < 16
    r = run("prune", LLAMA, tmp_path / "out", "--layers", 1, "--samples", 2, "--eval-samples", 16)
    said = " ".join(r.output.split())
    assert r.exit_code == 0 and (f"{fit} window{'s' if fit != 1 else ''}, not the 16 asked (--eval-samples): the held-out 10% of the text "
                                 f"is {end} tokens") in said, r.output
    record = json.loads((tmp_path / "out" / "config.json").read_text())["normsurgery"]["heldout"]
    assert record["windows"] == fit and record["asked"] == 16


def test_prune_measures_eval_text_beside_the_held_out_end(tmp_path):
    """Issue 47.2: --eval-text is measured beside the held-out end of --text, for the original and
    the pruned model; one window asked: the first 128 tokens of each, CE computed here."""
    tok = T.AutoTokenizer.from_pretrained(LLAMA)
    other = Path("normsurgery/data/heldout.txt")
    r = run("prune", LLAMA, tmp_path / "out", "--layers", 2, "--samples", 2, "--eval-samples", 1,
            "--eval-text", other, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    ids = tok(Path(SAMPLE).read_text(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    start = len(ids) - max(128, int(0.1 * len(ids)))
    windows = {"ce": ids[start:start + 128][None],
               "eval_text_ce": tok(other.read_text(), add_special_tokens=False, return_tensors="pt").input_ids[:, :128]}
    models = {"original": T.AutoModelForCausalLM.from_pretrained(LLAMA),
              "pruned": T.AutoModelForCausalLM.from_pretrained(tmp_path / "out")}
    for key, w in windows.items():
        for name, model in models.items():
            assert data[key][name] == pytest.approx(causal_ce(model, w), abs=1e-4), (key, name)
    r = run("prune", LLAMA, tmp_path / "table", "--layers", 2, "--samples", 2, "--eval-samples", 1,
            "--eval-text", other)
    assert "--eval-text" in r.output and f"{data['eval_text_ce']['pruned']:.4f}" in r.output, r.output


@pytest.mark.parametrize("args, match", [
    (["--layers", 8], "the model has 8"),
    (["--fraction", 0.01], "rounds to 0"),
    ([], "exactly one of --layers"),
    (["--layers", 2, "--text", "MISSING"], "no text file"),
    (["--layers", 2, "--text", "EMPTY"], "is empty"),
    (["--layers", 2, "--text", "SHORT"], "fewer than one sequence of 128"),
    (["--layers", 2, "--seq-len", 4096], "longer than the model's 256 positions"),
])
def test_prune_refuses_bad_input(tmp_path, args, match):
    texts = {"MISSING": tmp_path / "missing.txt", "EMPTY": tmp_path / "empty.txt", "SHORT": tmp_path / "short.txt"}
    texts["EMPTY"].write_text("  \n")
    texts["SHORT"].write_text("To be, or not to be: that is the question.")
    args = [texts.get(a, a) if isinstance(a, str) else a for a in args]
    out = tmp_path / "out"
    assert_refused(run("prune", LLAMA, out, *args), out, match)


def test_prune_refuses_an_existing_output_and_a_missing_input(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = run("prune", LLAMA, out, "--layers", 2)
    assert r.exit_code == 1 and "already exists" in r.output and not any(out.iterdir())
    missing = tmp_path / "missing-out"
    assert_refused(run("prune", tmp_path / "no-model", missing, "--layers", 1), missing, "no checkpoint")


def test_select_layers_refuses_an_unknown_method_instead_of_reading_it_as_last(tmp_path):
    said = "'angualr': choose one of angular, block-influence, last (did you mean 'angular'?)"
    with pytest.raises(ns.SurgeryError) as e:
        select_layers("angualr", 1, num_layers=4)
    assert str(e.value) == f"--method {said}"
    r = run("prune", LLAMA, tmp_path / "out", "--layers", 2, "--method", "angualr")  # a usage error, before loading
    assert r.exit_code == 2 and said in " ".join(r.output.replace("│", " ").split()) and not (tmp_path / "out").exists()
