"""Checkpoints on the hub hold tensors the current classes do not load: buffers stored by older
transformers (BERT's ``embeddings.position_ids``, GPT-2's ``attn.bias`` / ``attn.masked_bias``,
a rotary ``inv_freq`` per layer). transformers loads them without a word; so must we (issue 28:
``sentence-transformers/all-MiniLM-L6-v2`` was refused by verify and prune). Any other unexpected
weight is loaded past with one ``warning:`` line, as transformers reports it; it is an error only
where it shows the wrong class was chosen (a head the class has not)."""

import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import normsurgery as ns
import normsurgery.cli.inspect  # noqa: F401  (registers inspect)
import normsurgery.cli.prune  # noqa: F401  (registers prune)
from normsurgery.cli import app
from normsurgery.core.errors import SurgeryWarning

from models import CONFIGS, make_realistic, token_ids

runner = CliRunner()
N = 64  # the tiny configs' positions


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def with_stale(tmp_path, family, cls, extra):
    """A tiny checkpoint of ``cls`` whose file also holds ``extra`` ({key: tensor}), as an old
    save_pretrained wrote it."""
    torch.manual_seed(0)
    model = getattr(T, cls)(CONFIGS[family]()).eval()
    make_realistic(model, 0)
    path = Path(tmp_path) / cls
    model.save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    assert not set(extra) & set(weights)
    save_file({**weights, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    return path


def tril(n=N):
    return torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)


STALE = {  # family, class, the stale tensors its hub checkpoints hold
    "bert": ("bert", "BertModel", {"embeddings.position_ids": torch.arange(N).unsqueeze(0),
                                   "embeddings.token_type_ids": torch.zeros(1, N, dtype=torch.long)}),
    "bert-prefixed": ("bert", "BertForMaskedLM", {"bert.embeddings.position_ids": torch.arange(N).unsqueeze(0)}),
    "gpt2": ("gpt2", "GPT2LMHeadModel", {**{f"transformer.h.{i}.attn.bias": tril() for i in range(3)},
                                         **{f"transformer.h.{i}.attn.masked_bias": torch.tensor(-1e4)
                                            for i in range(3)}}),
    "llama": ("llama", "LlamaForCausalLM", {f"model.layers.{i}.self_attn.rotary_emb.inv_freq":
                                            1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8) for i in range(3)}),
}


@pytest.mark.parametrize("case", list(STALE))
def test_stale_buffers_load_without_a_word(tmp_path, case):
    """Before: 'cannot load ... weights unexpected embeddings.position_ids (transformers would fill
    them at random)' (a non-persistent buffer escaped the suffix list; so did a per-layer inv_freq)."""
    family, cls, extra = STALE[case]
    src = with_stale(tmp_path, family, cls, extra)
    plain = getattr(T, cls).from_pretrained(src).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SurgeryWarning)  # not even a warning
        ours = ns.load(src)
        ids = token_ids(2, 16)
        with torch.no_grad():
            a, b = plain(input_ids=ids), ours(input_ids=ids)
        key = "logits" if "logits" in a else "last_hidden_state"
        assert torch.equal(a[key], b[key])
        v = ns.verify(src, src, samples=2, seq_len=16, generate=0)
        assert v.relative == 0.0
        r = ns.prune(src, tmp_path / "pruned", {"layers": 1, "method": "last", "samples": 2, "seq_len": 16})
        assert ns.load(tmp_path / "pruned").config.num_hidden_layers == 2, r
        if family != "bert":  # no exact pass applies to a Post-LN model
            ns.convert(src, tmp_path / "converted", [("flashnorm", {})])
            assert ns.verify(src, tmp_path / "converted", samples=2, seq_len=16, generate=0).relative < 1e-5


def test_cli_accepts_a_bert_checkpoint_with_stale_buffers(tmp_path):
    """The issue's commands, on a BertModel saved as all-MiniLM-L6-v2 is (position_ids stored)."""
    family, cls, extra = STALE["bert"]
    src = with_stale(tmp_path, family, cls, extra)
    for args in (("verify", src, src, "--samples", "2", "--seq-len", "16"),
                 ("prune", src, tmp_path / "out", "--layers", "1", "--method", "last", "--seq-len", "16"),
                 ("inspect", src, "--json")):
        r = run(*args)
        assert r.exit_code == 0, (args[0], r.output)
        assert "warning:" not in r.output and "unexpected" not in r.output, (args[0], r.output)


def test_an_unexpected_weight_is_one_warning_line(tmp_path):
    """A tensor no module of the class reads, inside the model (a bias the config turned off): loaded
    past, as transformers does, with one warning naming it; a random fill is for missing weights."""
    src = with_stale(tmp_path, "llama", "LlamaForCausalLM", {"model.layers.0.mlp.down_proj.bias": torch.ones(32)})
    with pytest.warns(SurgeryWarning, match=r"unexpected model\.layers\.0\.mlp\.down_proj\.bias") as caught:
        ns.load(src)
    assert len(caught) == 1 and "at random" not in str(caught[0].message)
    r = run("verify", src, src, "--samples", "2", "--seq-len", "16", "--json")  # two loads, one line
    assert r.exit_code == 0, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and "model.layers.0.mlp.down_proj.bias" in lines[0], r.stderr
    assert json.loads(r.stdout)["relative"] == 0.0


def test_a_head_the_class_has_not_is_an_error_with_the_reason(tmp_path):
    """The checkpoint of a head class whose config names the base model: saving it as the base
    model would drop the head without a word."""
    src = with_stale(tmp_path, "bert", "BertModel", {"cls.predictions.bias": torch.zeros(96)})
    with pytest.raises(ns.SurgeryError) as e:
        ns.load(src)
    message = str(e.value)
    assert "unexpected cls.predictions.bias" in message and "BertModel has no module cls" in message, message
    assert "at random" not in message
    r = run("verify", src, src)
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and "cls.predictions.bias" in lines[0], r.output
