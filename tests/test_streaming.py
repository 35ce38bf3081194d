"""Streaming (one block at a time) against the in-memory path: same tensors, same checks."""

import importlib
import json

import pytest
import torch
import transformers as T
from safetensors.torch import load_file

import normsurgery as ns
from normsurgery import streaming

from models import CONFIGS, tiny_model

convert_mod = importlib.import_module("normsurgery.convert")  # the module, not ns.convert


def checkpoint(tmp_path, family, dtype=torch.float32, layers=None, name="in"):
    model = tiny_model(family, dtype)
    if layers is not None:  # a deeper model of the same family
        cfg = CONFIGS[family]()
        cfg.num_hidden_layers = layers
        model = T.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    path = tmp_path / name
    model.save_pretrained(path, max_shard_size="20KB")  # many shards: blocks cross files
    return path


def tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family,passes,verify", [
    ("gpt2", [("pre-rmsnorm", {"fold": True})], True),  # tied head: untied in the first part
    ("llama", [("flashnorm", {})], False),
    ("gpt_neox", [("crmsnorm", {})], True),  # the stream shrinks to d-1: parts change widths
    ("phi", [("pre-rmsnorm", {}), ("flashnorm", {})], False),
])
def test_streaming_writes_the_in_memory_tensors(tmp_path, family, passes, verify):
    src = checkpoint(tmp_path, family)
    mem = convert_mod.convert(src, tmp_path / "mem", passes, verify=verify, streaming=False)
    out = tmp_path / "stream"
    res = convert_mod.convert(src, out, passes, verify=verify, streaming=True, max_shard_size="20KB")
    assert res.streaming and mem.streaming is None
    a, b = tensors(tmp_path / "mem"), tensors(out)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    # a valid index: every tensor in the file it names, every shard named
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert res.saved["shards"] > 1 and len(set(index["weight_map"].values())) == res.saved["shards"]
    for k, f in index["weight_map"].items():
        assert k in load_file(out / f)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in b.values())
    # the same config, and transformers loads the result (its runtime where modules were rebuilt)
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (tmp_path / "mem", out))
    ca.pop("normsurgery"), cb.pop("normsurgery")
    assert ca == cb
    loaded = T.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    sd = loaded.state_dict()
    assert all(torch.equal(sd[k], ns.load(tmp_path / "mem").state_dict()[k]) for k in sd)
    if verify:
        assert res.parity.relative == pytest.approx(mem.parity.relative, rel=1e-6, abs=1e-12)
        assert res.ok


def test_streaming_verify_agrees_with_in_memory(tmp_path):
    src = checkpoint(tmp_path, "llama", torch.float64)
    convert_mod.convert(src, tmp_path / "out", [("flashnorm", {})], verify=False, streaming=True)
    for dtype in (torch.float64, torch.float32):
        mem = ns.verify(src, tmp_path / "out", dtype=dtype, generate=0, streaming=False)
        got = ns.verify(src, tmp_path / "out", dtype=dtype, streaming=True)
        assert got.streaming and mem.streaming is None
        assert got.relative == pytest.approx(mem.relative, rel=1e-6, abs=1e-15)
        assert got.top1 == mem.top1 and got.ok
    assert got.relative <= 1e-5 and mem.relative > 0
    # a model that differs is told apart
    m = ns.load(src)
    with torch.no_grad():
        m.model.norm.weight.mul_(1.5)
    m.save_pretrained(tmp_path / "other", max_shard_size="20KB")
    assert not ns.verify(src, tmp_path / "other", dtype=torch.float64, streaming=True).ok


def test_streaming_holds_one_part_whatever_the_depth(tmp_path, monkeypatch):
    """The parameters held at once stay those of about one part as the model grows 4x."""
    held = []
    load = streaming.Loader.load

    def counting(self, scope):
        load(self, scope)
        held.append(sum(p.numel() for p in self.model.parameters() if p.device.type != "meta")
                    + sum(t.numel() for kept in self.spare.values() for t in kept))  # freed, kept for reuse

    monkeypatch.setattr(streaming.Loader, "load", counting)
    peaks, totals = [], []
    for layers in (4, 16):
        src = checkpoint(tmp_path, "llama", layers=layers, name=f"in{layers}")
        held.clear()
        convert_mod.convert(src, tmp_path / f"out{layers}", [("flashnorm", {})], streaming=True)
        peaks.append(max(held))
        totals.append(streaming.Shards(src).numel)
    assert totals[1] > 3.5 * totals[0]
    assert peaks[1] == peaks[0] < totals[0] / 2


def test_a_freed_part_is_reused_only_when_nothing_holds_it(tmp_path):
    """The loader reads the next block into the tensors the last one gave back (no new pages),
    but never into a tensor a view still reads."""
    src = checkpoint(tmp_path, "llama", torch.bfloat16)
    stored = tensors(src)
    model = streaming.meta_model(src, torch.float32)
    loader = streaming.Loader(model, streaming.Shards(src), torch.float32)
    q = lambda i: model.model.layers[i].self_attn.q_proj.weight  # noqa: E731
    loader.load(("model.layers.0",))
    where = q(0).data_ptr()
    loader.free(("model.layers.0",))
    loader.load(("model.layers.1",))
    assert q(1).data_ptr() == where  # reused
    assert torch.equal(q(1), stored["model.layers.1.self_attn.q_proj.weight"].float())
    view = q(1)[:2]  # still read by someone
    loader.free(("model.layers.1",))
    loader.load(("model.layers.2",))
    assert q(2).data_ptr() != where
    assert torch.equal(view, stored["model.layers.1.self_attn.q_proj.weight"][:2].float())
    assert torch.equal(q(2), stored["model.layers.2.self_attn.q_proj.weight"].float())


def test_streams_when_the_model_does_not_fit(tmp_path, monkeypatch):
    src = checkpoint(tmp_path, "gpt2")
    monkeypatch.setattr(streaming, "available_memory", lambda: 2**20)
    res = convert_mod.convert(src, tmp_path / "out", [("pre-rmsnorm", {})])
    assert "GiB are available" in res.streaming and res.ok


@pytest.mark.parametrize("family,passes,match", [
    ("gpt2", [("minimize", {})], "cannot run one block at a time"),
    ("llama", [("pre-rmsnorm", {})], "already RMSNorm"),
])
def test_streaming_refuses_and_writes_nothing(tmp_path, family, passes, match):
    src = checkpoint(tmp_path, family)
    with pytest.raises(ns.SurgeryError, match=match):
        convert_mod.convert(src, tmp_path / "out", passes, streaming=True)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in"]  # no temporary folder left either


def test_a_missing_tensor_is_an_error(tmp_path):
    src = checkpoint(tmp_path, "llama")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    f = index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    from safetensors.torch import save_file
    rest = {k: v for k, v in load_file(src / f).items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(rest, src / f, metadata={"format": "pt"})
    with pytest.raises(ns.SurgeryError, match="up_proj.weight is missing"):
        convert_mod.convert(src, tmp_path / "out", [("flashnorm", {})], verify=False, streaming=True)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_streaming_prune_copies_the_in_memory_result(tmp_path, family):
    from normsurgery.prune import prune_model, score_layers

    src = checkpoint(tmp_path, family)
    ids = torch.randint(0, 96, (3, 16), generator=torch.Generator().manual_seed(0))
    model = ns.load(src)
    mem_scores = score_layers(model, ids)
    got_scores = streaming.score(src, ids)
    assert torch.allclose(got_scores.angular, mem_scores.angular, atol=1e-6)
    assert torch.allclose(got_scores.influence, mem_scores.influence, atol=1e-6)
    mem_record = prune_model(model, [1])
    ns.save(model, tmp_path / "mem", source=src, record={"prune": mem_record})
    got = streaming.prune(src, tmp_path / "stream", [1], record={"prune": mem_record}, max_shard_size="20KB")
    assert got["kept"] == mem_record["kept"] == [0, 2]
    a, b = tensors(tmp_path / "mem"), tensors(tmp_path / "stream")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert T.AutoConfig.from_pretrained(tmp_path / "stream").num_hidden_layers == 2
    pruned = ns.load(tmp_path / "stream")
    assert torch.equal(pruned(input_ids=ids).logits, model(input_ids=ids).logits)
