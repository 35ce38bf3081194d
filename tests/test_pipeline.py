"""The one executor: the in-memory plan (one part) and the streamed plan (one part at a time) write
the same tensors, check the written folder the same way, and hold one part at a time."""

import importlib
import json
import re
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

import normsurgery as ns
from normsurgery.io.loader import Loader
from normsurgery.core import memory
from normsurgery.io.source import Source
from normsurgery.core.families import layout as layout_of
from normsurgery.core.families import FAMILIES

from models import CONFIGS, tiny_model

convert_mod = importlib.import_module("normsurgery.commands.convert")  # the module, not ns.convert
TEXT = Path(ns.__file__).parent / "data" / "sample.txt"  # for the passes that read text


def checkpoint_at(tmp_path, family, dtype=torch.float32, layers=None, name="in", cls=None):
    cfg = CONFIGS[family]()
    if layers is not None:  # a deeper model of the same family
        cfg.num_hidden_layers = layers
    if cls is None:
        model = tiny_model(family, dtype) if layers is None else T.AutoModelForCausalLM.from_config(cfg).to(dtype)
    else:
        torch.manual_seed(0)
        model = getattr(T, cls)(cfg).to(dtype)
        from normsurgery.core.synthetic import make_realistic
        make_realistic(model, 0)
    path = tmp_path / name
    model.eval().save_pretrained(path, max_shard_size="20KB")  # many shards: blocks cross files
    return path


def tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family,passes,verify", [
    ("gpt2", [("pre-rmsnorm", {"fold": True})], True),  # tied head: untied in the first part
    ("gemma3_text", [("flashnorm", {})], False),  # output norms left in every block: one note
    ("llama", [("flashnorm", {})], False),
    ("gpt_neox", [("crmsnorm", {})], True),  # the stream shrinks to d-1: parts change widths
    ("phi", [("pre-rmsnorm", {}), ("flashnorm", {})], True),
    ("qwen2", [("flashnorm", {}), ("rotate", {"seed": 2})], True),  # every part rotated by the same Q
    ("qwen2_moe", [("flashnorm", {})], True),  # experts stored one tensor each, across shards
    # whole-model facts from scans (issue 35): the mask's least-written channels, the channels no
    # writer writes once the blocks shrank, uniform widths into the config, Phi-3's shared head count
    ("gpt2", [("minimize", {"sparsity": 0.3, "prune_units": 0.5, "prune_heads": 0.5, "prune_channels": 3})], True),
    ("llama", [("minimize", {"prune_units": 0.25, "prune_heads": 0.5, "prune_channels": 4})], True),
    ("phi3", [("minimize", {"prune_heads": 0.5, "prune_channels": 2})], True),
    ("gpt_neox", [("flashnorm", {}), ("compensated-ln", {"prune_channels": 5})], True),
    ("qwen2", [("mask", {"prune_units": 0.5, "prune_channels": 3}), ("minimize", {})], True),
    ("llama", [("mask", {"sparsity": 0.5}), ("minimize", {})], True),  # the 7B run's recipe (README)
])
def test_both_plans_write_the_same_tensors_and_check_the_folder(tmp_path, family, passes, verify):
    src = checkpoint_at(tmp_path, family)
    mem = convert_mod.convert(src, tmp_path / "mem", passes, verify=verify, streaming=False)
    out = tmp_path / "stream"
    res = convert_mod.convert(src, out, passes, verify=verify, streaming=True, max_shard_size="20KB")
    assert res.streaming and mem.streaming is None
    # one line per fact of the whole model, not per part (issue 28): the same notes in both plans
    assert [(s.name, s.notes, s.metrics) for s in res.steps] == [(s.name, s.notes, s.metrics) for s in mem.steps]
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
    sd, mine = loaded.state_dict(), ns.load(tmp_path / "mem").state_dict()
    assert all(torch.equal(sd[k], mine[k]) for k in sd)
    if verify:  # both read the written folder back and compared it with the reference
        for r in (mem, res):
            assert r.saved["reload"] is not None and r.parity.relative == r.saved["reload"]["comparison"]["relative"]
        assert res.parity.relative == pytest.approx(mem.parity.relative, rel=1e-6, abs=1e-12)
        assert res.ok and mem.ok
        assert res.saved["plain_transformers"] == mem.saved["plain_transformers"]
        if len(passes) > 1:  # per-pass parity for recipes of several passes, in both plans
            assert all(s.parity is not None for s in res.steps + mem.steps)


def test_an_exact_step_after_a_pruning_step_is_judged_by_the_rounding_of_the_model_it_produced(tmp_path):
    """minimize zeroes what it prunes (a reference step), then removes it (exact). In float32 the
    removal errs by the pruned model's rounding, not the input's: on this Llama, jittered, the
    input rounds 4.7e-6, the pruned model 1.6e-5 and the model after the removal 7.3e-6, and the
    removal's 1.95e-5 was refused on an AMD EPYC against 4 x the input's (1.89e-5). Each step, and
    the written folder, are judged around the model they produced, in both plans and in
    ``apply_passes``: that model's own rounding is measured here on the folder read back."""
    from normsurgery.core.parity import ROUNDING_FACTOR, TOLERANCE, compare, jittered, outputs

    src = checkpoint_at(tmp_path, "llama")
    passes = [("minimize", {"prune_units": 0.25, "prune_heads": 0.5, "prune_channels": 4})]
    source = Source.open(src)
    ids = convert_mod.probe_ids(source.tokenizer, source.config.vocab_size, convert_mod.text_of(None), 4,
                                convert_mod._length(source))
    floor = TOLERANCE[torch.float32]
    for streaming in (False, True):
        out = tmp_path / f"out{streaming}"
        res = convert_mod.convert(src, out, passes, streaming=streaming)
        produced = ns.load(out)
        with torch.no_grad():
            clean = outputs(produced, ids)
            with jittered(produced):
                own = compare(clean, outputs(produced, ids)).relative
        step = next(s for s in res.steps if s.kind == "exact")
        for c in (step.parity, res.parity):  # the removal, and the folder against the pruned model
            expected = max(floor, ROUNDING_FACTOR * own) if c.relative > floor else floor
            assert c.ok and c.tolerance == pytest.approx(expected, rel=1e-2), (streaming, c.relative, c.tolerance)
    model = ns.load(src, dtype=torch.float32)
    steps = convert_mod.apply_passes(model, passes, ids=ids)
    assert all(s.parity.ok for s in steps if s.kind == "exact")


def decoded_keys(monkeypatch) -> list[str]:
    """The checkpoint keys read into tensors from now on (``shards.Reader.read_into``)."""
    from normsurgery.io import shards

    seen, read_into = [], shards.Reader.read_into
    monkeypatch.setattr(shards.Reader, "read_into", lambda self, key, out: seen.append(key) or read_into(self, key, out))
    return seen


@pytest.mark.parametrize("family,untouched,touched", [
    ("llama", ("self_attn.o_proj.weight", "mlp.down_proj.weight", "embed_tokens.weight"), ("q_proj", "up_proj")),
    ("gpt2", ("attn.c_proj.weight", "mlp.c_proj.bias"), ("wte.weight", "c_attn.weight", "c_fc.bias")),  # tied: untied
])
def test_a_streamed_fold_copies_what_it_does_not_read_without_decoding_it(tmp_path, monkeypatch, family, untouched,
                                                                          touched):
    """flashnorm says what it reads (its norms and their readers): streamed, the other tensors' bytes
    are copied as stored, never read into tensors, and the folder is the in-memory plan's, bit for bit."""
    src = checkpoint_at(tmp_path, family)
    convert_mod.convert(src, tmp_path / "mem", [("flashnorm", {})], verify=False, streaming=False)
    seen = decoded_keys(monkeypatch)
    convert_mod.convert(src, tmp_path / "stream", [("flashnorm", {})], verify=False, streaming=True)
    assert not [k for k in seen if k.endswith(untouched)]
    assert all(any(t in k for k in seen) for t in touched)
    a, b = tensors(tmp_path / "mem"), tensors(tmp_path / "stream")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(k.endswith(untouched) for k in b)


@pytest.mark.parametrize("omitted", ["readers", "norms"])
def test_a_pass_that_reads_what_it_does_not_declare_is_refused(tmp_path, monkeypatch, omitted):
    """A pass whose ``reads`` leaves out what it reads meets a tensor left unread: refused as an
    internal error, never written from a rewrite that silently skipped it (torch leaves a tensor
    multiplied in place by a meta one unchanged)."""
    import dataclasses

    from normsurgery.core import registry
    from normsurgery.passes import flashnorm

    def reads(lay, options):
        sites = flashnorm.folded(lay, options)
        return {s.path for s in sites} if omitted == "readers" else {r for s in sites for r in s.readers}

    p = registry.get("flashnorm")
    monkeypatch.setitem(registry.PASSES, "flashnorm", dataclasses.replace(p, reads=reads))
    src = checkpoint_at(tmp_path, "llama")
    with pytest.raises(ns.SurgeryError, match="internal: .*(reads|computed from) a parameter"):
        convert_mod.convert(src, tmp_path / "out", [("flashnorm", {})], verify=False, streaming=True)
    assert not (tmp_path / "out").exists()


def test_reading_an_undeclared_tensor_into_one_read_is_refused(tmp_path, monkeypatch):
    """A pass that reads a tensor it does not declare, only to scale one it declares in place: the
    tensor left unread is meta, and torch would leave the scaled one unchanged without a word. The
    operation is refused (nothing it made is meta, so only the operation shows it)."""
    from normsurgery.core import registry

    def apply(model, lay, ctx):
        for i, block in enumerate(model.model.layers):
            if not lay.holds(f"model.layers.{i}"):
                continue
            with torch.no_grad():
                block.self_attn.q_proj.weight.mul_(block.self_attn.o_proj.weight[0, 0])
        return registry.PassReport("scale-q")

    def reads(lay, options):
        return {f"model.layers.{i}.self_attn.q_proj" for i in range(64)}

    monkeypatch.setitem(registry.PASSES, "scale-q", registry.Pass(
        "scale-q", "test", "exact", "llama", lambda m, lay: None, apply, blockwise=True, tracked=True, reads=reads))
    src = checkpoint_at(tmp_path, "llama")
    with pytest.raises(ns.SurgeryError, match="internal: .*reads a parameter its pass does not declare"):
        convert_mod.convert(src, tmp_path / "out", [("scale-q", {})], verify=False, streaming=True)


CLASSES = [("llama", "LlamaModel"), ("llama", "LlamaForSequenceClassification"),
           ("gpt_neox", "GPTNeoXForTokenClassification"), ("bert", "BertForMaskedLM"), ("gpt2", "GPT2Model")]


@pytest.mark.parametrize("family,cls", CLASSES)
def test_every_head_converts_and_verifies_in_both_plans(tmp_path, family, cls):
    """Before: a streamed convert or verify of a base model, or of a sequence classifier without
    a pad token, crashed (exit 3): the streamed path read ``.logits`` and ran batches unpadded."""
    src = checkpoint_at(tmp_path, family, cls=cls)
    assert Source.open(src).config.pad_token_id is None or "Sequence" not in cls
    spec = [("bn-fold", {})] if family == "bert" else [("flashnorm", {})]
    if family == "bert":  # Post-LN: nothing to fold, so a pass that applies to every model
        spec = []
    results = {}
    for streaming in (False, True):
        if spec:
            r = convert_mod.convert(src, tmp_path / f"out{streaming}", spec, streaming=streaming)
            assert r.ok and r.saved["reload"] is not None
            results[streaming] = r.parity
        v = ns.verify(src, src if not spec else tmp_path / f"out{streaming}", generate=0, streaming=streaming)
        assert v.ok and (v.streaming is not None) == streaming
        assert v.output == ("last hidden state" if FAMILIES[family].classes[cls].path is None else "logits")
        results[("verify", streaming)] = v
    a, b = results[("verify", False)], results[("verify", True)]
    assert b.relative == pytest.approx(a.relative, rel=1e-6, abs=1e-12) and a.top1 == b.top1
    if spec:
        assert results[True].relative == pytest.approx(results[False].relative, rel=1e-6, abs=1e-12)


def test_a_sequence_classifier_reads_each_rows_last_token(tmp_path):
    """The probe is unpadded: every row's last token, as one row at a time gives."""
    from normsurgery.core.parity import outputs

    model = ns.load(checkpoint_at(tmp_path, "llama", cls="LlamaForSequenceClassification"))
    ids = torch.randint(0, 96, (3, 16), generator=torch.Generator().manual_seed(0))
    batch = outputs(model, ids)
    rows = torch.cat([model(input_ids=r[None]).logits for r in ids])
    assert torch.allclose(batch, rows, atol=1e-6) and model.config.pad_token_id is None


def test_streaming_verify_agrees_with_in_memory(tmp_path):
    src = checkpoint_at(tmp_path, "llama", torch.float64)
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


@pytest.mark.parametrize("passes,parts", [
    ([("flashnorm", {})], 1),
    # scans (two, each reading every part in a work of its own) run before a part is read
    ([("minimize", {"prune_units": 0.5, "prune_heads": 0.5, "prune_channels": 4})], 1)])
def test_streaming_holds_one_part_whatever_the_depth(tmp_path, monkeypatch, passes, parts):
    """The parameters held at once, by every loader alive, stay those of about one part as the
    model grows 4x, while a scan reads too."""
    import gc
    import weakref

    held, loaders = [], weakref.WeakSet()
    load = Loader.load

    def counting(self, scope, *unread):
        load(self, scope, *unread)
        loaders.add(self)
        held.append(sum(sum(p.numel() for p in x.model.parameters() if p.device.type != "meta")
                        + sum(t.numel() for kept in x.spare.values() for t in kept)  # freed, kept for reuse
                        for x in loaders))

    monkeypatch.setattr(Loader, "load", counting)
    peaks, totals = [], []
    for layers in (4, 16):
        src = checkpoint_at(tmp_path, "llama", layers=layers, name=f"in{layers}")
        held.clear()
        convert_mod.convert(src, tmp_path / f"out{layers}", passes, streaming=True)
        gc.collect()
        peaks.append(max(held))
        totals.append(Source.open(src).index.numel)
    assert totals[1] > 3.5 * totals[0]
    assert peaks[1] == peaks[0] < parts * totals[0] / 2


def test_a_scan_run_ahead_refuses_a_pass_where_its_stage_starts(tmp_path, monkeypatch):
    """crmsnorm then minimize, streamed: minimize's scans run before any part is read for writing,
    each part brought through crmsnorm first; the first is refused with the pass's reason, as
    entering it would be, before anything is collected."""
    from normsurgery.core import masks

    src = checkpoint_at(tmp_path, "gpt2")
    collected = []
    monkeypatch.setattr(masks, "channel_energies", lambda *a: collected.append(a))
    with pytest.raises(ns.SurgeryError, match="ln_1 is a crmsnorm"):
        convert_mod.convert(src, tmp_path / "out", [("crmsnorm", {}), ("minimize", {"prune_channels": 4})],
                            streaming=True, verify=False)
    assert collected == []


def test_a_freed_part_is_reused_only_when_nothing_holds_it(tmp_path):
    """The loader reads the next block into the tensors the last one gave back (no new pages),
    but never into a tensor a view still reads."""
    src = checkpoint_at(tmp_path, "llama", torch.bfloat16)
    stored = tensors(src)
    source = Source.open(src)
    model = source.meta_model(torch.float32)
    loader = Loader(model, source, torch.float32, "cpu")
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


def test_a_whole_model_pass_is_refused_when_the_model_does_not_fit(tmp_path, monkeypatch):
    src = checkpoint_at(tmp_path, "gpt2")
    monkeypatch.setattr(memory, "available", lambda: 2**20)
    with pytest.raises(ns.SurgeryError, match="GiB are available; it cannot run on this machine$"):
        convert_mod.convert(src, tmp_path / "out", [("minimize", {"prune_units": 0.5, "by": "activation"})],
                            text=TEXT)  # text given: the plan is what refuses
    with pytest.raises(ns.SurgeryError, match="GiB are available: it cannot run on this machine$"):  # not --in-memory
        convert_mod.convert(src, tmp_path / "out", [("remove-ln", {})], streaming=True, text=TEXT)
    res = convert_mod.convert(src, tmp_path / "out", [("pre-rmsnorm", {})])  # blockwise: streamed
    assert res.streaming and res.ok
    # scans first, then part by part: minimize streams where it does not fit (issue 35), and loads
    # the whole model where it does (a scan reads every part once more)
    res = convert_mod.convert(src, tmp_path / "min", [("minimize", {"prune_units": 0.5})])
    assert res.streaming.startswith("in memory this needs") and res.ok
    monkeypatch.undo()
    assert convert_mod.convert(src, tmp_path / "min2", [("minimize", {"prune_units": 0.5})]).streaming is None


@pytest.mark.parametrize("family,passes,match", [
    ("gpt2", [("minimize", {"prune_units": 0.5, "by": "activation"})],
     r"minimize cannot run one block at a time \(by=activation scores units and heads on a forward pass"),
    ("gpt2", [("remove-ln", {})], r"remove-ln cannot run one block at a time \(it trains the whole model\)"),
    ("llama", [("pre-rmsnorm", {})], "already RMSNorm"),
])
def test_streaming_refuses_and_writes_nothing(tmp_path, family, passes, match):
    src = checkpoint_at(tmp_path, family)
    with pytest.raises(ns.SurgeryError, match=match) as refused:
        convert_mod.convert(src, tmp_path / "out", passes, streaming=True, text=TEXT)  # text given: the plan refuses
    assert "already RMSNorm" in match or str(refused.value).endswith("; --in-memory loads the whole model")  # it fits
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["in"]  # no temporary folder left either


@pytest.mark.parametrize("streaming", [False, True])
def test_a_missing_tensor_is_an_error(tmp_path, streaming):
    src = checkpoint_at(tmp_path, "llama")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    f = index["weight_map"].pop("model.layers.1.mlp.up_proj.weight")
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    rest = {k: v for k, v in load_file(src / f).items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(rest, src / f, metadata={"format": "pt"})
    with pytest.raises(ns.SurgeryError, match=r"weights missing model\.layers\.1\.mlp\.up_proj\.weight"):
        convert_mod.convert(src, tmp_path / "out", [("flashnorm", {})], verify=False, streaming=streaming)


@pytest.mark.parametrize("demo", ["llama-tiny", "gpt2-tiny"])
def test_streaming_prune_copies_the_in_memory_result(tmp_path, demo):
    import shutil

    from normsurgery.commands.prune import prune_model, score_layers

    src = tmp_path / "in"  # the demo model (it has a tokenizer) in many shards
    ns.load(f"normsurgery/demo/{demo}").save_pretrained(src, max_shard_size="200KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(f"normsurgery/demo/{demo}/{f}", src / f)
    mem = ns.prune(src, tmp_path / "mem", {"layers": 1, "seq_len": 16, "samples": 3})
    got = ns.prune(src, tmp_path / "stream", {"layers": 1, "seq_len": 16, "samples": 3, "streaming": True})
    assert torch.allclose(got.scores.angular, mem.scores.angular, atol=1e-6)
    assert torch.allclose(got.scores.influence, mem.scores.influence, atol=1e-6)
    assert got.removed["kept"] == mem.removed["kept"] and got.streaming and not mem.streaming
    a, b = tensors(tmp_path / "mem"), tensors(tmp_path / "stream")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert T.AutoConfig.from_pretrained(tmp_path / "stream").num_hidden_layers == mem.removed["layers_before"] - 1
    for r in (mem, got):  # both read the folder back: the pruned model's outputs, exactly
        assert r.saved["plain_transformers"] and r.saved["reload"]["comparison"]["relative"] == 0.0
    ids = torch.randint(0, 96, (3, 16), generator=torch.Generator().manual_seed(0))
    model = ns.load(src)  # scored and pruned in memory by the functions themselves
    assert score_layers(model, ids).angular.shape == got.scores.angular.shape
    prune_model(model, got.selection.layers)
    pruned = ns.load(tmp_path / "stream")
    assert torch.equal(pruned(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("streaming", [True, False])
def test_every_progress_bar_reaches_its_total(tmp_path, streaming):
    """Issue 28: "outputs 0/1" never moved."""
    src = checkpoint_at(tmp_path, "llama")
    last = {}
    convert_mod.convert(src, tmp_path / "out", [("flashnorm", {})], streaming=streaming,
                        progress=lambda stage, done, total, note="": last.__setitem__(stage, (done, total)))
    assert {"outputs", "write", "check"} <= last.keys()
    assert all(done == total for done, total in last.values()), last


# ---------------------------------------------------------------------------------------------
# unchanged tensors are copied as bytes (issue 30)


def raw(path):
    """{name: (dtype, shape, bytes)} of every tensor in a folder's shards."""
    from normsurgery.io.shards import read_header

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        header, start = read_header(f)
        data = f.read_bytes()
        for k, v in header.items():
            a, b = v["data_offsets"]
            out[k] = (v["dtype"], v["shape"], data[start + a:start + b])
    return out


@pytest.fixture
def copies(monkeypatch):
    """The names ShardWriter.copy wrote (as stored bytes) and those ShardWriter.add wrote (from memory)."""
    from normsurgery.io.shards import ShardWriter

    seen = {"copied": [], "added": []}
    copy, add = ShardWriter.copy, ShardWriter.add

    def copying(self, name, *a, **k):
        seen["copied"].append(name)
        return copy(self, name, *a, **k)

    def adding(self, name, *a, **k):
        seen["added"].append(name)
        return add(self, name, *a, **k)

    monkeypatch.setattr(ShardWriter, "copy", copying)
    monkeypatch.setattr(ShardWriter, "add", adding)
    return seen


FLASHNORM_UNTOUCHED = ("embed_tokens.weight", "o_proj.weight", "down_proj.weight")


@pytest.mark.parametrize("dtype,work", [(torch.bfloat16, None), (torch.float32, torch.float64)])
@pytest.mark.parametrize("streaming", [True, False])
def test_flashnorm_copies_the_tensors_it_leaves_as_stored_bytes(tmp_path, copies, dtype, work, streaming):
    """flashnorm changes the norms and their readers: every other tensor is written as the input
    stores it (bytes, dtype, shape), copied without being cast; the changed ones from memory."""
    src = checkpoint_at(tmp_path, "llama", dtype)
    out = tmp_path / "out"
    convert_mod.convert(src, out, [("flashnorm", {})], streaming=streaming, work_dtype=work, verify=False,
                        max_shard_size="20KB")
    before, after = raw(src), raw(out)
    assert before.keys() == after.keys()
    untouched = {k for k in before if k.endswith(FLASHNORM_UNTOUCHED)}
    assert set(copies["copied"]) == untouched and len(untouched) == 1 + 2 * CONFIGS["llama"]().num_hidden_layers
    assert set(copies["added"]) == set(before) - untouched
    for k in untouched:
        assert after[k] == before[k]
    assert all(after[k][0] == before[k][0] for k in before)  # stored as the input stores it
    # the output loads (the headers are valid) and computes the input's function: the changed tensors are right too
    r = ns.verify(src, out, dtype=torch.float64)
    assert r.ok, r.failed


def test_a_pass_that_changes_nothing_writes_the_input_bytes(tmp_path, copies):
    """A blockwise pass that rewrites nothing: every tensor copied as stored, in both plans; flashnorm
    run again on a folded model (it writes gains of 1 and scales by them) gives the same bytes."""
    from normsurgery.core import registry
    from normsurgery.core.registry import PassReport

    def nothing(model, lay, ctx):
        for p in model.parameters():  # reads every value of the part, writes none
            if p.device.type == "meta":
                continue
            float(p.detach().float().abs().sum())
        return PassReport("test-nothing")

    registry.register("test-nothing", registry.Declared("changes nothing", "exact", "tests", blockwise=True),
                      lambda m, lay: None, tracked=True)(nothing)
    try:
        src = checkpoint_at(tmp_path, "llama", torch.bfloat16)
        before = raw(src)
        for streaming in (True, False):
            copies["copied"].clear()
            out = tmp_path / f"same-{streaming}"
            convert_mod.convert(src, out, [("test-nothing", {})], streaming=streaming, max_shard_size="20KB")
            assert raw(out) == before and sorted(copies["copied"]) == sorted(before)
    finally:
        registry.PASSES.pop("test-nothing")
    once, twice = tmp_path / "once", tmp_path / "twice"
    convert_mod.convert(src, once, [("flashnorm", {})], streaming=True, verify=False, max_shard_size="20KB")
    convert_mod.convert(once, twice, [("flashnorm", {})], streaming=True, max_shard_size="20KB")
    assert raw(twice) == raw(once)


def test_a_write_through_data_is_not_copied(tmp_path, copies):
    """A pass registered in one's own code may write a parameter through ``.data`` (which torch's
    version counter does not see): every tensor of the parts it ran on is written from memory,
    with its new values, none copied as stored."""
    from normsurgery.core import registry
    from normsurgery.core.registry import PassReport

    def halve(model, lay, ctx):
        for site in lay.norms:
            model.get_submodule(site.path).weight.data.mul_(0.5)
        return PassReport("test-halve")

    registry.register("test-halve", registry.Declared("halves the norms' gains", "exact", "tests", blockwise=True),
                      lambda m, lay: None)(halve)
    try:
        src = checkpoint_at(tmp_path, "llama", torch.bfloat16)
        convert_mod.convert(src, tmp_path / "out", [("test-halve", {})], streaming=True, verify=False)
    finally:
        registry.PASSES.pop("test-halve")
    a, b = tensors(src), tensors(tmp_path / "out")
    norms = [k for k in a if k.endswith("norm.weight")]  # the final norm too
    assert norms and all(torch.equal(b[k], a[k] * 0.5) for k in norms)
    assert not copies["copied"] and a.keys() == b.keys()


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("family,passes", [
    ("gpt2", [("pre-rmsnorm", {"fold": True}), ("rotate", {})]),
    ("llama", [("flashnorm", {}), ("rotate", {"seed": 1})]),
    ("gpt_neox", [("crmsnorm", {})]),
    ("llama", [("minimize", {"sparsity": 0.2, "prune_units": 0.5, "prune_heads": 0.5, "prune_channels": 3})]),
    ("gpt2", [("compensated-ln", {"prune_channels": 3})]),
    ("gemma3_text", [("flashnorm", {"keep_tied": True})]),
])
def test_every_value_a_built_in_pass_changes_is_noted(tmp_path, monkeypatch, family, passes, streaming):
    """Built-in passes are ``tracked``: the executor sees their writes by version counter and
    identity alone (no patch of ``Parameter.data``). Every parameter whose values a step changed is
    noted (``sweep.changed``); a pass writing through ``.data`` and claiming to be tracked is caught
    (the oracle can fail)."""
    from normsurgery.core import registry
    from normsurgery.engine import sweep
    from normsurgery.core.registry import PassReport

    snaps, missed = {}, []
    versions, changed = sweep.versions, sweep.changed

    def snapshot(model):
        snaps[id(model)] = [(n, p, p.detach().clone()) for n, p in model.named_parameters() if p.device.type != "meta"]
        return versions(model)

    def check(model, before, everything=False):
        noted = changed(model, before, everything)
        live, seen = {id(p) for p in model.parameters()}, {id(p) for p in noted}
        missed.extend(n for n, p, old in snaps[id(model)] if id(p) in live and id(p) not in seen
                      and not torch.equal(p.detach(), old))
        return noted

    monkeypatch.setattr(sweep, "versions", snapshot)
    monkeypatch.setattr(sweep, "changed", check)
    src = checkpoint_at(tmp_path, family)
    convert_mod.convert(src, tmp_path / "out", passes, streaming=streaming, verify=False)
    assert not missed

    def halve(model, lay, ctx):
        for site in lay.norms:
            model.get_submodule(site.path).weight.data.mul_(0.5)
        return PassReport("test-halve")

    registry.register("test-halve", registry.Declared("halves the norms' gains", "exact", "tests", blockwise=True),
                      lambda m, lay: None, tracked=True)(halve)  # a false claim
    try:
        convert_mod.convert(src, tmp_path / "out2", [("test-halve", {})], streaming=streaming, verify=False)
    finally:
        registry.PASSES.pop("test-halve")
    norms = {f"{s.path}.weight" for s in layout_of(ns.load(src)).norms}
    assert missed and set(missed) <= norms


REWRITE = [("flashnorm", {}), ("rotate", {"seed": 1})]


@pytest.mark.parametrize("streaming", [False, True])
def test_no_parameter_carries_an_attribute_of_ours(tmp_path, monkeypatch, streaming):
    """What a step changed is the executor's to know (``Work.changed``): as each part is written
    (every step run on it), its parameters carry no attribute (a parameter read or made carries
    none)."""
    from normsurgery.engine import writer

    seen, write = {}, writer._write_part

    def spying(work, part, *a, **k):
        seen.update({n: vars(p) for n, p in work.model.named_parameters() if p.device.type != "meta"})
        return write(work, part, *a, **k)

    monkeypatch.setattr(writer, "_write_part", spying)
    convert_mod.convert(checkpoint_at(tmp_path, "llama"), tmp_path / "out", REWRITE, streaming=streaming, verify=False)
    assert seen and not any(seen.values())


def test_a_model_rewritten_in_memory_carries_no_attribute_of_ours():
    """``apply_passes`` on one's own model: its parameters carry the attributes they had, no more."""
    model = tiny_model("llama")
    before = {n: dict(vars(p)) for n, p in model.named_parameters()}
    ns.apply_passes(model, REWRITE)
    assert all(vars(p) == before.get(n, {}) for n, p in model.named_parameters())


def test_an_untouched_part_is_never_read(tmp_path, monkeypatch, copies):
    """prune --streaming (no step runs on a kept block) copies each kept tensor's bytes under its
    renumbered name, reading nothing while it writes; the folder loads as the in-memory prune's."""
    from normsurgery.io import shards
    from normsurgery.engine import writer

    src = checkpoint_at(tmp_path, "llama", torch.bfloat16)
    reads, writing = [], []
    read_into, write = shards.Reader.read_into, writer.write_parts

    def spying(self, key, out):
        if writing:
            reads.append(key)
        return read_into(self, key, out)

    def spied_write(*a, **k):
        writing.append(True)
        try:
            return write(*a, **k)
        finally:
            writing.clear()

    monkeypatch.setattr(shards.Reader, "read_into", spying)
    monkeypatch.setattr(writer, "write_parts", spied_write)
    opts = {"layers": 1, "method": "last", "seq_len": 16}
    got = ns.prune(src, tmp_path / "stream", {**opts, "streaming": True})
    assert reads == [] and copies["added"] == [] and len(copies["copied"]) == len(raw(tmp_path / "stream"))
    ns.prune(src, tmp_path / "mem", opts)
    assert raw(tmp_path / "stream") == raw(tmp_path / "mem")
    assert got.saved["reload"]["comparison"]["relative"] == 0.0
    before = raw(src)
    kept = [i for i in range(CONFIGS["llama"]().num_hidden_layers) if i not in got.selection.layers]
    assert kept != list(range(len(kept)))  # the test renumbers blocks
    for k, v in raw(tmp_path / "stream").items():  # block j holds input block kept[j]'s bytes
        parts = k.split(".")
        if parts[1] == "layers":
            parts[2] = str(kept[int(parts[2])])
        assert before[".".join(parts)] == v, k


def test_a_copied_tensor_is_still_checked_for_nan(tmp_path, monkeypatch):
    """An unread part's tensors are checked for NaN or Inf as they are copied (not only when the
    check reads the input again: without it, nothing else would), as reading refuses them."""
    from normsurgery.engine import writer

    write, raised = writer.write_parts, []

    def spied_write(*a, **k):
        try:
            return write(*a, **k)
        except ns.SurgeryError:
            raised.append(True)
            raise

    monkeypatch.setattr(writer, "write_parts", spied_write)
    src = checkpoint_at(tmp_path, "llama", torch.bfloat16)
    sd = tensors(src)
    name = next(k for k in sd if ".layers.0.mlp." in k)  # kept (--method last removes a later block)
    sd[name][0, 0] = float("nan")
    for f in src.glob("*.safetensors"):
        f.unlink()
    (src / "model.safetensors.index.json").unlink()
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ns.SurgeryError, match=f"^{re.escape(str(src))} holds NaN or Inf weights: {name}"):
        ns.prune(src, tmp_path / "out", {"layers": 1, "method": "last", "seq_len": 16, "streaming": True})
    assert raised  # refused while copying


# ---------------------------------------------------------------------------------------------
# the check's floor (issue 30): two forwards, a third only when the first comparison needs it


@pytest.fixture
def forwards(monkeypatch):
    """Every model forward the executor runs, counted at parity.outputs as the executor's modules
    call it (the sweep's forwards, a model reader's, a model saved from memory)."""
    from normsurgery.engine import check
    from normsurgery.engine import sweep
    from normsurgery.engine import writer

    calls, real = [], sweep.outputs

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    for module in (sweep, check, writer):
        monkeypatch.setattr(module, "outputs", counting)
    return calls


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("dtype,passes,expected", [
    (torch.float32, [("flashnorm", {})], 2),  # within float32's 1e-5: the reference and the folder
    # bf16: the reference, the rewrite before the cast (checked at float32's 1e-5), the folder, and
    # the null of what the cast's rounding costs (DRAWS draws around the folder)
    (torch.bfloat16, [("flashnorm", {})], 6),
])
def test_a_checked_convert_runs_two_forwards_and_a_baseline_only_when_needed(tmp_path, forwards, streaming,
                                                                            dtype, passes, expected):
    src = checkpoint_at(tmp_path, "llama", dtype)
    res = convert_mod.convert(src, tmp_path / "out", passes, streaming=streaming)
    assert res.ok and len(forwards) == expected == res.forwards
    assert (res.baseline is not None) == (expected == 6)
    assert 0 < res.seconds_check and res.as_dict()["seconds_check"] == res.seconds_check
    forwards.clear()
    res = convert_mod.convert(src, tmp_path / "fast", passes, streaming=streaming, verify=False, force=True)
    assert forwards == [] and res.forwards == 0 and res.seconds_check == 0.0


def test_identical_outputs_need_no_baseline(tmp_path, forwards):
    """bf16 weights the pass leaves as they were: the folder's outputs equal the input's, no baseline
    (the reference, the rewrite before the cast, the folder)."""
    from normsurgery.core import registry
    from normsurgery.core.registry import PassReport

    registry.register("test-nothing2", registry.Declared("changes nothing", "exact", "tests", blockwise=True),
                      lambda m, lay: None)(lambda model, lay, ctx: PassReport("test-nothing2"))
    try:
        src = checkpoint_at(tmp_path, "llama", torch.bfloat16)
        res = convert_mod.convert(src, tmp_path / "out", [("test-nothing2", {})], streaming=True)
    finally:
        registry.PASSES.pop("test-nothing2")
    assert res.ok and res.parity.relative == 0 and len(forwards) == 3 and res.baseline is None


@pytest.mark.parametrize("streaming", [True, False])
def test_an_exact_step_out_of_tolerance_refuses_before_anything_is_written(tmp_path, monkeypatch, streaming):
    """convert runs in the natural order (issue 49): the reference's and each step's outputs are
    measured, then the steps judged, and only then the rewrite written. An exact step 1% off in one
    layer, after an exact one that is right, refuses with its message before any shard or staging
    folder exists, in either plan (before: it refused once the folder was written)."""
    from pathlib import Path as P

    from normsurgery.core import registry
    from normsurgery.core.registry import PassReport
    from normsurgery.io import shards

    def off(model, lay, ctx):
        for site in lay.norms:
            if site.path == "model.layers.1.post_attention_layernorm":
                with torch.no_grad():
                    model.model.layers[1].mlp.up_proj.weight.mul_(1.01)
        return PassReport("test-off")

    made, opened, mkdir, init = [], [], P.mkdir, shards.ShardWriter.__init__

    def making(self, *args, **kwargs):
        made.append(self)
        return mkdir(self, *args, **kwargs)

    def opening(self, *args, **kwargs):
        opened.append(args)
        return init(self, *args, **kwargs)

    registry.register("test-off", registry.Declared("1% off in one layer", "exact", "tests", blockwise=True),
                      lambda m, lay: None)(off)
    try:
        src = checkpoint_at(tmp_path, "llama")
        monkeypatch.setattr(P, "mkdir", making)
        monkeypatch.setattr(shards.ShardWriter, "__init__", opening)
        with pytest.raises(ns.SurgeryError, match=r"^pass test-off broke parity: relative error .* > .*; nothing was "
                                                  r"saved \(--force saves anyway\)$"):
            convert_mod.convert(src, tmp_path / "out", [("flashnorm", {}), ("test-off", {})], streaming=streaming)
    finally:
        registry.PASSES.pop("test-off")
    assert opened == [] and not [m for m in made if m.name.startswith(".out")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


# ---------------------------------------------------------------------------------------------
# compact logits (issue 30): compared from the head's input and its rows, a slab at a time


@pytest.mark.parametrize("family,dtype", [("llama", torch.bfloat16), ("gpt2", torch.float32), ("qwen2", torch.float32)])
def test_the_compact_comparison_equals_the_full_one(tmp_path, family, dtype):
    """Logits kept as the head's input (rows read from the files when compared) give the full
    comparison's figures to float rounding, either side compact, in both plans."""
    from normsurgery.engine import check
    from normsurgery.engine.sweep import CheckpointWork
    from normsurgery.core.parity import HeadInput, compare, probe_ids

    src = checkpoint_at(tmp_path, family, dtype)
    out = tmp_path / "out"
    convert_mod.convert(src, out, [("flashnorm", {})], verify=False)
    ids = probe_ids(None, CONFIGS[family]().vocab_size, None, 3, 16)
    for streamed in (True, False):
        got = {}
        for name, path in (("a", src), ("b", out)):
            for compact in (False, True):
                work = CheckpointWork(Source.open(path), torch.float32, streamed=streamed, device="cpu")
                got[name, compact] = check.read_outputs(work, ids, compact=compact)
        assert isinstance(got["a", True], HeadInput) and not isinstance(got["a", False], HeadInput)
        full = compare(got["a", False], got["b", False])
        assert full.relative > 0
        for a, b in ((True, True), (True, False), (False, True)):
            c = compare(got["a", a], got["b", b])
            assert c.max_abs == pytest.approx(full.max_abs, rel=1e-4, abs=1e-6)
            assert c.relative == pytest.approx(full.relative, rel=1e-4, abs=1e-9)
            assert c.mean_abs == pytest.approx(full.mean_abs, rel=1e-4)
            assert c.kl == pytest.approx(full.kl, rel=1e-3, abs=1e-12) and c.top1 == full.top1
        assert compare(got["a", True], got["a", False]).relative < 1e-6  # the same logits


@pytest.mark.parametrize("family", sorted(f for f, fam in __import__("normsurgery.core.families").core.families.FAMILIES.items()
                                          if fam.plain_logits))
def test_every_compact_family_gives_its_logits(tmp_path, family):
    """Each family kept compact: its logits are exactly its head applied to the head's input
    (no scale or soft cap after it), as the full forward gives them."""
    from normsurgery.engine import check
    from normsurgery.engine.sweep import CheckpointWork
    from normsurgery.core.parity import HeadInput, compare, probe_ids

    src = checkpoint_at(tmp_path, family)
    ids = probe_ids(None, CONFIGS[family]().vocab_size, None, 2, 8)
    full = check.read_outputs(CheckpointWork(Source.open(src), torch.float32, device="cpu"), ids)
    compact = check.read_outputs(CheckpointWork(Source.open(src), torch.float32, device="cpu"), ids, compact=True)
    assert isinstance(compact, HeadInput)
    assert compare(full, compact).relative < 1e-6


PEAK = """
import importlib, json, sys
import torch
conv = importlib.import_module("normsurgery.commands.convert")
import normsurgery.passes  # noqa: F401

def mb(field):
    return next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith(field))

base = mb("VmRSS:")
r = conv.convert(sys.argv[1], sys.argv[2], [("flashnorm", {})], streaming=True, verify=sys.argv[3] == "1",
                 max_shard_size="50MB")
print(json.dumps({"base": base, "peak": mb("VmHWM:"), "ok": r.ok}))
"""


def test_a_large_vocabulary_does_not_raise_the_checks_peak(tmp_path):
    """A Qwen2-shaped bf16 checkpoint with a 151936-token vocabulary (small width and depth): the
    checked streaming convert's peak RSS (/proc, a fresh process, above its RSS after imports)
    stays within one and a half of one probe's float32 logits (4 x 64 x 151936: 148 MiB) of the
    unchecked convert's: the reference and the folder are held compact (the head's input; its rows
    read from the file a slab at a time), and one positions x vocabulary tensor is held: the
    rewrite's before the cast, whose head was rewritten and is in no file (measured: 1.2 logits;
    all three full and a null draw's would be 4)."""
    import os
    import subprocess
    import sys

    cfg = T.Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, vocab_size=151936, max_position_embeddings=128,
                        tie_word_embeddings=False)
    torch.manual_seed(0)
    src = tmp_path / "in"
    T.Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    script = tmp_path / "peak.py"
    script.write_text(PEAK)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    above = {}
    for verify in ("0", "1"):
        run = subprocess.run([sys.executable, str(script), str(src), str(tmp_path / f"out{verify}"), verify],
                             capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        got = json.loads(run.stdout.strip().splitlines()[-1])
        assert got["ok"]
        above[verify] = got["peak"] - got["base"]
    logits_mb = 4 * 64 * 151936 * 4 / 2**20
    assert above["1"] - above["0"] < 1.5 * logits_mb, above


def test_convert_states_what_each_plan_needs(tmp_path):
    """Before loading: the in-memory plan's bytes and the streamed plan's (its largest part),
    in the result, --json and the streaming reason."""
    src = checkpoint_at(tmp_path, "llama", torch.bfloat16, layers=6)
    res = convert_mod.convert(src, tmp_path / "out", [("flashnorm", {})], streaming=True, verify=False)
    total = Source.open(src).index.numel * 4  # float32 working copies
    m = res.as_dict()["memory"]
    assert m["parts"] == 6 and m["in_memory"] > total and total / 6 < m["streamed"] < total
    assert "MB at a time in 6 parts; in memory about 1.0 GiB" in res.streaming  # under 0.1 GiB: MB (issue 47.11)


def test_the_estimate_counts_the_checks_outputs(tmp_path, monkeypatch):
    """A large vocabulary on a tiny width: the checks' logits outweigh every part. The figures
    stated before loading count them: the rewrite's outputs before its cast to bfloat16 and a
    tolerance's read held together (measured: the largest output a check's forward returned,
    the logits of every position), in either plan."""
    cfg = CONFIGS["llama"]()
    cfg.vocab_size = 20000
    torch.manual_seed(0)
    src = tmp_path / "in"
    T.LlamaForCausalLM(cfg).to(torch.bfloat16).eval().save_pretrained(src)
    seen = []
    real = convert_mod.Work.outputs

    def outputs(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if isinstance(out, torch.Tensor):
            seen.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(convert_mod.Work, "outputs", outputs)
    res = convert_mod.convert(src, tmp_path / "out", [("flashnorm", {})], streaming=True)
    m, logits = res.memory, max(seen)
    assert logits > Source.open(src).index.numel * 4  # the case: one output outweighs the whole model
    assert m["streamed"] >= 2 * logits and m["in_memory"] >= 2 * logits + Source.open(src).index.numel * 4
    said = f"{m['outputs'] / 2**30:.2f} GiB" if m["outputs"] >= 0.1 * 2**30 else f"{m['outputs'] / 1e6:.1f} MB"
    assert f"the checks' outputs {said} of it" in res.streaming


def test_streamed_prune_compares_no_more_states_at_once(tmp_path, monkeypatch):
    """Streamed scoring runs every calibration window through each part at once (each part read
    once), but compares the residual states batch by batch, as in memory: the float64 unit
    vectors held at once (tokens x states x width, counted where they are made) are no more
    than the in-memory plan's."""
    prune_mod = importlib.import_module("normsurgery.commands.prune")  # the module, not ns.prune

    src = Path(ns.__file__).parent / "demo" / "llama-tiny"  # with a tokenizer to read the text
    real, held = prune_mod._accumulate, {}

    for streaming in (False, True):
        def counted(states, weight, ang, cos_adj, streaming=streaming):
            held[streaming] = max(held.get(streaming, 0), len(states) * states[0][..., 0].numel() * states[0].shape[-1])
            return real(states, weight, ang, cos_adj)

        monkeypatch.setattr(prune_mod, "_accumulate", counted)
        ns.prune(src, tmp_path / f"out{streaming}", {"layers": 1, "samples": 8, "batch_size": 2, "seq_len": 16,
                                                     "streaming": streaming})
    assert 0 < held[True] <= held[False], held


def test_streamed_prune_holds_no_more_states_than_the_model(tmp_path, monkeypatch):
    """Where the calibration windows' residual states would outweigh the whole model (which the
    in-memory plan holds), streamed scoring runs them through the parts in groups that do not
    (reading the parts once per group): the states held at once (counted where each forward
    starts) stay under the model's bytes."""
    prune_mod = importlib.import_module("normsurgery.commands.prune")
    analysis = importlib.import_module("normsurgery.core.analysis")
    src = Path(ns.__file__).parent / "demo" / "llama-tiny"
    source = Source.open(src)
    cfg = source.config
    model_bytes = source.index.numel * source.storage.itemsize
    per_window = (cfg.num_hidden_layers + 1) * 32 * cfg.hidden_size * source.storage.itemsize
    samples = 2 * model_bytes // per_window + 1  # all of them: twice the model
    held, real = [], analysis.forward_base

    def counted(model, ids, mask):
        held.append(len(ids) * per_window)
        return real(model, ids, mask)

    monkeypatch.setattr(prune_mod, "forward_base", counted)
    ns.prune(src, tmp_path / "out", {"layers": 1, "samples": int(samples), "seq_len": 32, "streaming": True})
    assert len(held) > 1 and max(held) <= model_bytes and sum(held) == samples * per_window, (held, model_bytes)


@pytest.mark.parametrize("streaming", [True, False])
def test_a_tied_embedding_left_alone_is_copied_once(tmp_path, copies, streaming):
    """flashnorm keep_tied=true leaves a tied embedding (and head) as stored: its bytes are copied
    once, under the one name the output stores, and the folder loads tied."""
    cfg = CONFIGS["llama"]()
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    src = tmp_path / "in"
    model.save_pretrained(src, max_shard_size="20KB")
    before = raw(src)
    assert "lm_head.weight" not in before
    out = tmp_path / "out"
    res = convert_mod.convert(src, out, [("flashnorm", {"keep_tied": True})], streaming=streaming,
                              max_shard_size="20KB")
    after = raw(out)
    assert res.ok and after.keys() == before.keys()
    assert copies["copied"].count("model.embed_tokens.weight") == 1
    assert after["model.embed_tokens.weight"] == before["model.embed_tokens.weight"]
    assert T.AutoConfig.from_pretrained(out).tie_word_embeddings
