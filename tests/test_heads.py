"""Checkpoints keep their own class and head: base models, classifiers and LMs load with the class
their config names, go through convert, verify and prune, and are saved with the same class,
loadable with plain transformers and computing the same outputs. A weight the class expects but
the checkpoint lacks is an error, never a random init; so is a head or base model the class has
not (other unexpected tensors are a warning: tests/test_stale_keys.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import normsurgery as ns
from normsurgery.io.loader import load
from normsurgery.core.errors import SurgeryNote
import normsurgery.cli.prune  # noqa: F401  (registers prune and heal)
from normsurgery.cli import app
from normsurgery.core.families import FAMILIES, layout
from normsurgery.commands.prune import prune_model, score_layers
from normsurgery.core.parity import compare, outputs, output_kind

from models import CONFIGS, make_realistic, token_ids

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def make(tmp_path, family, cls, dtype=torch.float32, seed=0, **config):
    """A tiny checkpoint of class ``cls`` (realistic weights, no tokenizer: probes are random ids)."""
    cfg = CONFIGS[family]()
    for k, v in config.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = getattr(T, cls)(cfg).to(dtype).eval()
    make_realistic(model, seed)
    path = Path(tmp_path) / cls
    model.save_pretrained(path)
    return path


def plain(path):
    """The folder loaded as a user without normsurgery would: the class its config names."""
    cfg = T.AutoConfig.from_pretrained(path)
    return getattr(T, cfg.architectures[0]).from_pretrained(path).eval()


def rel(a, b, ids):
    return compare(outputs(a, ids), outputs(b, ids), output_kind(a)).relative


CASES = [  # family, class, pass, objective, head
    ("llama", "LlamaModel", "flashnorm", "none", None),
    ("llama", "LlamaForSequenceClassification", "flashnorm", "sequence-classification", "score"),
    ("gpt_neox", "GPTNeoXForTokenClassification", "pre-rmsnorm:fold=true", "token-classification", "classifier"),
    ("gpt2", "GPT2ForSequenceClassification", "pre-rmsnorm:fold=true", "sequence-classification", "score"),
    ("gpt2", "GPT2Model", "crmsnorm", "none", None),
    ("gemma3_text", "Gemma3TextModel", "flashnorm", "none", None),
    ("phi3", "Phi3Model", "flashnorm", "none", None),
    ("gemma2", "Gemma2ForSequenceClassification", "flashnorm", "sequence-classification", "score"),
]


@pytest.mark.parametrize("family,cls,spec,objective,head", CASES)
def test_convert_keeps_the_class_and_head(tmp_path, family, cls, spec, objective, head):
    src = make(tmp_path, family, cls)
    model = ns.load(src)
    assert type(model).__name__ == cls
    lay = layout(model)
    assert (lay.objective, lay.head) == (objective, head) and not lay.tied
    if head is None:  # a base model: its modules have no prefix, its final norm no reader
        assert lay.layers_path in ("layers", "h") and lay.output_norm is lay.final_norm
    if spec == "crmsnorm":  # the base model's output would lose a dimension: refused, with the reason
        r = run("convert", src, tmp_path / "out", "--pass", spec)
        assert r.exit_code == 1 and "the model's output" in r.output and not (tmp_path / "out").exists()
        return
    out = tmp_path / "out"
    r = run("convert", src, out, "--pass", spec, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["ok"] and data["saved"]["plain_transformers"]
    assert data["saved"]["reload"]["comparison"]["relative"] <= 1e-5
    assert json.loads((out / "config.json").read_text())["architectures"] == [cls]
    loaded = plain(out)
    assert type(loaded).__name__ == cls
    ids = token_ids(3, 16)
    original = plain(src)
    assert rel(original, loaded, ids) <= 1e-5
    assert outputs(loaded, ids).shape == outputs(original, ids).shape
    if head is None:  # the final norm's gain stayed in it: there is nothing to fold it into
        assert not torch.all(loaded.get_submodule(lay.final_norm.path).weight == 1)
    else:  # the head took the final norm's gain
        assert not torch.equal(loaded.get_submodule(head).weight, original.get_submodule(head).weight)
    assert run("verify", src, out).exit_code == 0


@pytest.mark.parametrize("family,cls", [("bert", "BertModel"), ("mpnet", "MPNetModel"),
                                        ("mpnet", "MPNetForSequenceClassification"),
                                        ("mpnet", "MPNetForTokenClassification"), ("llama", "LlamaModel"),
                                        ("llama", "LlamaForSequenceClassification"),
                                        ("gpt_neox", "GPTNeoXForTokenClassification"),
                                        ("gpt2", "GPT2ForSequenceClassification")])
def test_prune_keeps_the_class_and_head(tmp_path, family, cls):
    src = make(tmp_path, family, cls)
    out = tmp_path / "pruned"
    r = run("prune", src, out, "--layers", "1", "--method", "last", "--seq-len", "32", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["saved"]["plain_transformers"] and data["ce"] == {}
    loaded = plain(out)
    assert type(loaded).__name__ == cls and loaded.config.num_hidden_layers == 2
    reference = ns.load(src)
    prune_model(reference, data["prune"]["removed"])
    ids = token_ids(2, 16)
    assert rel(reference, loaded, ids) <= 1e-6
    scores = score_layers(ns.load(src), ids)  # scoring reads hidden states: no head needed
    # one block at a time: what runs after the blocks (a pooler, a classifier's dense) is read with the last
    streamed = tmp_path / "streamed"
    r = run("prune", src, streamed, "--layers", "1", "--method", "last", "--seq-len", "32", "--streaming")
    assert r.exit_code == 0, r.output
    assert rel(loaded, plain(streamed), ids) == 0
    assert torch.isfinite(scores.angular).all() and scores.tokens == 32


def test_heal_and_ce_need_a_language_modelling_head(tmp_path):
    demo = Path("normsurgery/demo/llama-tiny")
    src = make(tmp_path, "llama", "LlamaModel", vocab_size=len(T.AutoTokenizer.from_pretrained(demo)))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (src / f).write_bytes((demo / f).read_bytes())
    out = tmp_path / "healed"
    r = run("prune", src, out, "--layers", "1", "--heal", "--steps", "1", "--seq-len", "16")
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and "has no language-modelling head" in lines[0], r.output
    assert not out.exists()
    r = run("heal", src, out, "--text", "normsurgery/data/sample.txt", "--steps", "1", "--seq-len", "16")
    assert r.exit_code == 1 and "has no language-modelling head" in r.output and not out.exists()
    r = run("prune", src, out, "--layers", "1", "--seq-len", "16", "--samples", "4")
    assert r.exit_code == 0 and "no cross-entropy: LlamaModel has no language-modelling head" in r.output


def test_verify_x_x_passes_for_every_class_the_tool_accepts(tmp_path):
    """Before: a base model or a classifier was run with a random LM head, drawn anew at each load."""
    for family, fam in FAMILIES.items():
        for cls in fam.classes:
            src = make(tmp_path / family, family, cls)
            r = run("verify", src, src, "--samples", "2", "--seq-len", "16", "--generate", "4", "--json")
            assert r.exit_code == 0, (cls, r.output)
            v = json.loads(r.stdout)
            assert v["relative"] == 0.0 and v["output"] == ("last hidden state" if fam.classes[cls].path is None
                                                            else "logits"), cls


def test_missing_unexpected_and_misshaped_weights_are_errors(tmp_path):
    base = make(tmp_path, "llama", "LlamaModel")
    cfg = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ns.SurgeryError, match=r"weights missing lm_head\.weight"):
        ns.load(base)
    (base / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    with pytest.raises(ns.SurgeryError, match=r"mis-shaped layers\.0\.mlp\.down_proj\.weight"):
        ns.load(base)
    lm = make(tmp_path, "llama", "LlamaForCausalLM")
    cfg = json.loads((lm / "config.json").read_text())
    (lm / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaModel"]}))
    with pytest.raises(ns.SurgeryError, match=r"unexpected lm_head\.weight \(LlamaModel has no module lm_head"):
        ns.load(lm)
    gpt2 = make(tmp_path, "gpt2", "GPT2LMHeadModel")  # old GPT-2 files hold a constant no class reads: fine
    weights = load_file(gpt2 / "model.safetensors")
    save_file({**weights, "transformer.h.0.attn.masked_bias": torch.tensor(-1e4)}, gpt2 / "model.safetensors",
              metadata={"format": "pt"})
    assert type(ns.load(gpt2)).__name__ == "GPT2LMHeadModel"
    double = make(tmp_path, "gpt2", "GPT2DoubleHeadsModel")
    r = run("verify", double, double)
    assert r.exit_code == 1 and "GPT2DoubleHeadsModel is not a class normsurgery handles" in r.output


def test_plain_transformers_is_claimed_only_when_checked(tmp_path):
    """pre-rmsnorm's RMSNorms are stock-equivalent only on a centred stream; a mask stops it being
    centred. Before: the output was said to load with plain transformers, and differed by 2e-3."""
    src, out = make(tmp_path, "gpt2", "GPT2LMHeadModel"), tmp_path / "out"
    r = run("convert", src, out, "--pass", "pre-rmsnorm", "--pass", "mask:sparsity=0.3", "--pass", "minimize",
            "--json")
    assert r.exit_code == 0, r.output
    saved = json.loads(r.stdout)["saved"]
    assert saved["plain_transformers"] is False
    assert saved["reload"]["plain_transformers"]["relative"] > 1e-4  # what plain loading would give
    assert saved["reload"]["comparison"]["relative"] <= 1e-5
    records = json.loads((out / "config.json").read_text())["normsurgery"]["modules"]
    assert records and not any(rec.get("stock_equivalent") for rec in records)
    ids = token_ids(2, 32)
    with pytest.raises(ValueError, match="trust_remote_code"):  # plain loading fails loudly
        T.AutoModelForCausalLM.from_pretrained(out)
    ours, stock = ns.load(out), load(out, stock=True)
    assert rel(ours, stock, ids) > 1e-4  # the claim would have been false
    again = tmp_path / "again"  # a re-save keeps the honest mark
    ns.save(ours, again)
    assert not any(r.get("stock_equivalent") for r in json.loads((again / "config.json").read_text())
                   ["normsurgery"]["modules"])


def test_a_rewritten_classifier_loads_with_trust_remote_code(tmp_path):
    """crmsnorm stores the stream in d-1 dims: the runtime rebuilds NormSurgery<Class> for the
    checkpoint's own class, in an interpreter that has only torch and transformers."""
    src = make(tmp_path, "gpt_neox", "GPTNeoXForTokenClassification")
    out = tmp_path / "out"
    result = ns.convert(src, out, [("crmsnorm", {})])
    assert result.ok and result.saved["plain_transformers"] is False
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["GPTNeoXForTokenClassification"]
    assert cfg["auto_map"] == {"AutoModelForTokenClassification":
                               "modeling_normsurgery.NormSurgeryGPTNeoXForTokenClassification",
                               "AutoConfig": "modeling_normsurgery.NormSurgeryGPTNeoXConfig"}
    assert cfg["model_type"] == "normsurgery_gpt_neox"
    ids = token_ids(2, 16)
    torch.save(ids, tmp_path / "ids.pt")
    code = ("import sys, torch, transformers as T\n"
            "m = T.AutoModelForTokenClassification.from_pretrained(sys.argv[2], trust_remote_code=True).eval()\n"
            "torch.save((type(m).__name__, m(input_ids=torch.load(sys.argv[1])).logits), sys.argv[3])\n")
    r = subprocess.run([sys.executable, "-I", "-c", code, str(tmp_path / "ids.pt"), str(out), str(tmp_path / "o.pt")],
                       capture_output=True, text=True, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    name, remote = torch.load(tmp_path / "o.pt")
    assert name == "NormSurgeryGPTNeoXForTokenClassification"
    assert compare(outputs(plain(src), ids), remote).relative <= 1e-5


# ---- sentence-transformers checkpoints (issue 47.5): the base model under a masked LM's config ----

def headless(tmp_path, cls, config, prefix: str, name: str = "st", modules: bool = False):
    """A tiny ``cls`` base model (with its pooler) saved as sentence-transformers saves one: only the
    base model's weights (their keys with ``prefix`` before them), the config naming the masked LM
    the encoder was pretrained as (all-mpnet-base-v2: MPNetForMaskedLM); ``modules``: also
    sentence-transformers' modules.json."""
    torch.manual_seed(0)
    model = cls(config).eval()
    make_realistic(model, 0)
    path = Path(tmp_path) / name
    model.save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    save_file({prefix + k: v for k, v in weights.items()}, path / "model.safetensors", metadata={"format": "pt"})
    data = json.loads((path / "config.json").read_text())
    data["architectures"] = [cls.__name__.replace("Model", "ForCausalLM" if modules else "ForMaskedLM")]
    (path / "config.json").write_text(json.dumps(data))
    if modules:
        (path / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "",
                                                        "type": "sentence_transformers.models.Transformer"}]))
    return path, model


def noted(r, cls):
    notes = [line for line in r.output.splitlines() if line.startswith("note:") and "sentence-transformers" in line]
    assert len(notes) == 1 and f"loaded as {cls}" in notes[0], r.output


ST = {"bert": (T.BertModel, "BertForMaskedLM", "cls."), "mpnet": (T.MPNetModel, "MPNetForMaskedLM", "lm_head.")}


@pytest.mark.parametrize("family,prefix", [("bert", ""), ("bert", "bert."), ("mpnet", ""), ("mpnet", "mpnet.")])
def test_a_sentence_transformers_encoder_loads_as_its_base_model(tmp_path, family, prefix):
    """all-mpnet-base-v2's config names MPNetForMaskedLM while its file holds MPNetModel's weights and
    pooler: verify, inspect, prune and convert refused it ("weights missing lm_head...", then "no
    adapter for 'mpnet'"). Now read as sentence-transformers reads it (AutoModel: the base class),
    with one note; the output is saved as the base class, the pooler kept, and computes what the
    base model computed."""
    cls, masked, head = ST[family]
    base = cls.__name__
    src, model = headless(tmp_path, cls, CONFIGS[family](), prefix)
    ids = token_ids(2, 16)
    with pytest.warns(SurgeryNote, match=f"without {masked}'s head: loaded as {base}"):
        loaded = ns.load(src)
    assert type(loaded) is cls and rel(model, loaded, ids) == 0
    r = run("inspect", src)
    assert r.exit_code == 0 and base in r.output, r.output
    noted(r, base)
    for plan in ("--in-memory", "--streaming"):  # streamed: the pooler runs after the last block
        r = run("verify", src, src, "--json", plan)
        assert r.exit_code == 0 and json.loads(r.stdout)["output"] == "last hidden state", r.output
        noted(r, base)
    r = run("convert", src, tmp_path / "out", "--pass", "flashnorm")  # no exact pass applies to Post-LN
    assert r.exit_code == 1 and f"{family} is Post-LN" in r.output and "missing" not in r.output, r.output
    out = tmp_path / "pruned"
    r = run("prune", src, out, "--layers", "1", "--method", "last", "--seq-len", "16", "--json")
    assert r.exit_code == 0, r.output
    noted(r, base)
    removed = json.loads(r.stdout)["prune"]["removed"]
    assert json.loads((out / "config.json").read_text())["architectures"] == [base]
    saved = load_file(out / "model.safetensors")
    assert "pooler.dense.weight" in saved and not any(k.startswith(head) for k in saved)
    pruned, info = T.AutoModel.from_pretrained(out, output_loading_info=True)  # as sentence-transformers loads it
    assert type(pruned) is cls and not info["missing_keys"] and not info["unexpected_keys"]
    with pytest.warns(SurgeryNote):
        reference = ns.load(src)
    prune_model(reference, removed)
    assert pruned.config.num_hidden_layers == 2 and rel(reference, pruned.eval(), ids) <= 1e-6


def test_a_partly_missing_head_is_still_an_error(tmp_path):
    """Only a head wholly absent makes the checkpoint a base model: one weight of it stored, the others
    missing, is the error it was (never a random init); a causal LM's config without its head is the
    base model only in a sentence-transformers folder (modules.json)."""
    src, _ = headless(tmp_path, T.BertModel, CONFIGS["bert"](), "bert.")
    weights = load_file(src / "model.safetensors")
    save_file({**weights, "cls.predictions.bias": torch.zeros(CONFIGS["bert"]().vocab_size)},
              src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ns.SurgeryError, match=r"cannot load .* as BertForMaskedLM: weights missing cls\.predictions"):
        ns.load(src)
    config = CONFIGS["llama"]()
    st, _ = headless(tmp_path, T.LlamaModel, config, "", name="st-llama", modules=True)
    with pytest.warns(SurgeryNote, match="without LlamaForCausalLM's head: loaded as LlamaModel"):
        assert type(ns.load(st)) is T.LlamaModel
    r = run("convert", st, tmp_path / "flash", "--pass", "flashnorm")
    assert r.exit_code == 0, r.output
    noted(r, "LlamaModel")
    assert json.loads((tmp_path / "flash" / "config.json").read_text())["architectures"] == ["LlamaModel"]
    (st / "modules.json").unlink()
    with pytest.raises(ns.SurgeryError, match=r"weights missing lm_head\.weight"):
        ns.load(st)
