"""Round trips: convert, save, load back (plain transformers where promised), same logits."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T

import normsurgery as ns
from normsurgery.core.runtime import RMSNorm

from models import rel, remote_logits, tiny_model, token_ids
from normsurgery.core.parity import compare, outputs

GPT2 = "normsurgery/demo/gpt2-tiny"
LLAMA = "normsurgery/demo/llama-tiny"


def test_gpt2_pre_rmsnorm_loads_with_plain_transformers(tmp_path):
    out = tmp_path / "out"
    result = ns.convert(GPT2, out, [("pre-rmsnorm", {"fold": True})])
    assert result.ok and result.parity.relative <= 1e-5
    assert result.saved["plain_transformers"]
    ids = token_ids(2, 32)
    original = T.AutoModelForCausalLM.from_pretrained(GPT2)
    plain = T.AutoModelForCausalLM.from_pretrained(out)
    assert type(plain).__name__ == "GPT2LMHeadModel"
    assert rel(original, plain, ids) <= 1e-5
    ours = ns.load(out)
    assert isinstance(ours.transformer.ln_f, RMSNorm)
    assert rel(original, ours, ids) <= 1e-5
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "modeling_normsurgery.py"):
        assert (out / f).is_file()
    record = json.loads((out / "config.json").read_text())["normsurgery"]
    assert [p["name"] for p in record["passes"]] == ["pre-rmsnorm"]
    assert record["passes"][0]["options"] == {"fold": True}


def test_trust_remote_code_loads_the_runtime(tmp_path):
    out = tmp_path / "out"
    ns.convert(GPT2, out, [("pre-rmsnorm", {})])
    code = ("import sys, torch, transformers as T\n"
            f"m = T.AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
            "o = T.AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "assert type(m.transformer.ln_f).__name__ == 'RMSNorm', type(m.transformer.ln_f)\n"
            "ids = torch.arange(32)[None]\n"
            "a, b = o(ids).logits, m(ids).logits\n"
            "print(((a - b).abs().max() / a.abs().max()).item())\n")
    # a clean interpreter that cannot import normsurgery: only transformers and torch
    r = subprocess.run([sys.executable, "-I", "-c", code, GPT2], capture_output=True, text=True,
                       env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.strip().splitlines()[-1]) <= 1e-5


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_an_output_that_needs_the_runtime_fails_a_plain_load(tmp_path, family):
    """Loaded with the stock class, these outputs would drop or mis-read weights: a plain load
    must raise, while normsurgery.load and trust_remote_code=True give the converted function."""
    src, out = tmp_path / "src", tmp_path / "out"
    original = tiny_model(family, torch.float32)
    original.save_pretrained(src)
    result = ns.convert(src, out, [("crmsnorm", {})])
    assert result.saved["plain_transformers"] is False
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == f"normsurgery_{family}"
    with pytest.raises(ValueError, match="trust_remote_code"):
        T.AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(ValueError, match="trust_remote_code"):
        T.AutoConfig.from_pretrained(out)
    ids = token_ids(2, 16)
    assert rel(original, ns.load(out), ids) <= 1e-5
    head, logits = remote_logits([out], ids, tmp_path)[out]
    assert compare(outputs(original.double(), ids), logits).relative <= 1e-5
    # normsurgery reads it as its stock family (same architecture as the input)
    assert ns.verify(src, out).ok


def test_llama_flashnorm_round_trip_sharded(tmp_path):
    out = tmp_path / "out"
    ns.convert(LLAMA, out, [("flashnorm", {})], max_shard_size="1MB")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    assert not (out / "modeling_normsurgery.py").exists()
    plain = T.AutoModelForCausalLM.from_pretrained(out)
    assert torch.all(plain.model.norm.weight == 1)
    assert rel(T.AutoModelForCausalLM.from_pretrained(LLAMA), plain, token_ids(2, 32)) <= 1e-5
    # a sharded checkpoint converts again (input side of the index)
    again = ns.convert(out, tmp_path / "again", [("flashnorm", {})])
    assert again.parity.relative <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("family,pass_name", [("gpt2", "pre-rmsnorm"), ("llama", "flashnorm")])
def test_half_precision_inputs(tmp_path, dtype, family, pass_name):
    src = tmp_path / "src"
    tiny_model(family, torch.float32).to(dtype).save_pretrained(src)
    result = ns.convert(src, tmp_path / "out", [(pass_name, {})])
    name = str(dtype).removeprefix("torch.")
    assert result.storage_dtype == name
    assert result.work_dtype == "float32"
    # the rewrite before the cast, in float32 against the input's widening: the arithmetic's own 1e-5
    step = result.steps[0].parity
    assert step.ok and step.tolerance == 1e-5 and step.relative <= 1e-5 and "float32" in step.reason
    # the folder as written against the rewrite before the cast: within what rounding those tensors
    # into that dtype costs (the null, measured around the folder), on relative error and on KL
    assert result.ok and f"stored in {name}" in result.parity.reason and "the cast rounded" in result.parity.reason
    null = result.baseline
    assert null["draws"] == 3 and null == result.parity.null
    assert 0 < result.parity.relative <= 4 * null["relative"] == result.parity.tolerance
    assert result.parity.kl <= 16 * null["kl"] == result.parity.kl_tolerance
    saved = ns.load(tmp_path / "out")
    assert next(saved.parameters()).dtype == dtype


@pytest.mark.parametrize("streaming", [False, True])
def test_the_cast_is_measured_on_what_was_written(tmp_path, monkeypatch, streaming):
    """A half-precision result is checked read back from the folder written, against the
    reference: a weight damaged on its way to the file is caught though the model in memory is
    right; nothing is saved, or with force it is saved and the result says the check failed."""
    from safetensors.torch import load_file, save_file

    from normsurgery.io import shards

    src = tmp_path / "src"
    tiny_model("llama", torch.float32).to(torch.bfloat16).save_pretrained(src)
    close = shards.ShardWriter.close

    def damaging(writer):
        names = close(writer)
        f = writer.folder / names[0]
        sd = load_file(f)
        sd["model.layers.0.mlp.down_proj.weight"] *= 3
        save_file(sd, f, metadata={"format": "pt"})
        return names

    monkeypatch.setattr(shards.ShardWriter, "close", damaging)
    with pytest.raises(ns.SurgeryError, match="broke parity.*nothing was saved"):
        ns.convert(src, tmp_path / "out", [("flashnorm", {})], streaming=streaming)
    assert not (tmp_path / "out").exists()
    forced = ns.convert(src, tmp_path / "forced", [("flashnorm", {})], force=True, streaming=streaming)
    assert not forced.parity.ok and not forced.ok and forced.parity.relative > forced.parity.tolerance
    # the record and the card say the check failed (before: the card said nothing, and loading plainly)
    record = json.loads((tmp_path / "forced" / "config.json").read_text())["normsurgery"]
    assert record["parity"]["ok"] is False and record["parity"]["failed"].startswith("relative error")
    card = (tmp_path / "forced" / "README.md").read_text()
    assert "**The check failed**" in card and "outputs differ from the reference's beyond tolerance" in card
    monkeypatch.setattr(shards.ShardWriter, "close", close)
    fine = ns.convert(src, tmp_path / "fine", [("flashnorm", {})], streaming=streaming)
    assert fine.parity.ok and fine.ok and "stored in bfloat16" in fine.parity.reason
    record = json.loads((tmp_path / "fine" / "config.json").read_text())["normsurgery"]
    assert record["parity"]["ok"] is True and record["parity"]["relative"] == fine.parity.relative
    assert "The check failed" not in (tmp_path / "fine" / "README.md").read_text()


@pytest.mark.parametrize("streaming", [True, False])
def test_a_single_pass_records_its_parity_and_the_overall_one(tmp_path, streaming):
    """Before: a one-pass streamed convert stored relative_error null and its card had no per-pass
    row, though the command printed the figure; config.json had no overall parity."""
    src = tmp_path / "src"
    tiny_model("llama", torch.float32).save_pretrained(src)
    r = ns.convert(src, tmp_path / "out", [("flashnorm", {})], streaming=streaming)
    record = json.loads((tmp_path / "out" / "config.json").read_text())["normsurgery"]
    step = record["passes"][0]
    assert step["relative_error"] == r.parity.relative and step["tolerance"] == 1e-5 and step["reason"]
    assert record["parity"]["loader"] == "plain transformers" and record["parity"]["ok"] is True
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"| flashnorm | {r.parity.relative:.2e} | 1.0e-05 |" in card


def test_a_model_read_whole_is_freed_before_the_folder_is_read_back(tmp_path, monkeypatch):
    """The one-part plan: the weights are gone once written (the folder read back does not stack
    on them), and the check still compares with the outputs computed before."""
    from normsurgery.engine import writer

    src = tmp_path / "src"
    tiny_model("llama", torch.float32).save_pretrained(src)
    check, devices = writer.check_written, []

    def checking(folder, records, plan, storage, work, *args):
        devices.extend({p.device.type for p in work.model.parameters()})
        return check(folder, records, plan, storage, work, *args)

    monkeypatch.setattr(writer, "check_written", checking)
    result = ns.convert(src, tmp_path / "out", [("flashnorm", {})], streaming=False)
    assert devices == ["meta"] and result.saved["plain_transformers"] and result.ok
    assert result.streaming is None and 0 < result.parity.relative <= 1e-5



def test_a_model_left_in_training_mode_is_checked_as_its_function_not_a_dropout_draw(tmp_path):
    """A model built from a config is in training mode, where its outputs are a random draw
    (dropout). The save's check compares the folder with the model's function: outputs are read
    with every module in eval mode, and each module's mode is left as it was. With dropout on, the
    reference differed from the folder by 0.56 (relative) and the check passed only because the
    model's rounding was measured with dropout too."""
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=1024, n_positions=64))
    model.transformer.h[1].attn.eval()  # a mixed state, restored as it was
    ids = token_ids(2, 16)
    first = outputs(model, ids)
    assert torch.equal(first, outputs(model, ids))
    assert model.training and not model.transformer.h[1].attn.training and model.transformer.h[0].attn.training
    info = ns.save(model, tmp_path / "out")
    assert info["reload"]["comparison"]["relative"] == 0.0, info["reload"]
    assert torch.equal(outputs(T.GPT2LMHeadModel.from_pretrained(tmp_path / "out"), ids), first)

def test_float64_work_dtype_is_exact(tmp_path):
    src = tmp_path / "src"
    tiny_model("llama", torch.float64).save_pretrained(src)
    result = ns.convert(src, tmp_path / "out", [("flashnorm", {})])
    assert result.work_dtype == "float64"
    assert result.parity.relative <= 1e-10
    # the float64-faithful norms used for the check are not saved: a stock checkpoint remains
    assert result.saved["custom_modules"] == 0


def test_input_is_never_modified(tmp_path):
    digest = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(GPT2).iterdir()}
    ns.convert(GPT2, tmp_path / "out", [("flashnorm", {})])
    assert digest == {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in Path(GPT2).iterdir()}


def test_hub_id_from_the_local_cache(tmp_path):
    """A hub id resolves to its snapshot in the cache (offline), like from_pretrained does."""
    snap = tmp_path / "hub" / "models--demo--gpt2-tiny" / "snapshots" / "0123abcd"
    shutil.copytree(GPT2, snap)
    (tmp_path / "hub" / "models--demo--gpt2-tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--demo--gpt2-tiny" / "refs" / "main").write_text("0123abcd")
    code = ("import normsurgery as ns\n"
            f"r = ns.convert('demo/gpt2-tiny', {str(tmp_path / 'out')!r}, [('flashnorm', {{}})])\n"
            "print(r.parity.relative)\n")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.strip().splitlines()[-1]) <= 1e-5
    assert (tmp_path / "out" / "tokenizer.json").is_file()


@pytest.mark.parametrize("family, dtype, shard", [("gpt2", torch.float32, "20KB"), ("llama", torch.bfloat16, "20KB"),
                                                  ("bert", torch.float16, "20KB"), ("mixtral", torch.float32, "5GB")])
def test_our_writer_writes_what_save_pretrained_writes(tmp_path, family, dtype, shard):
    """save writes shards tensor by tensor (normsurgery/io/shards.py) instead of save_pretrained:
    the same file names, index, config dtype and tensors, tied copies dropped, a mixture's
    experts one tensor each (in one file: the two pack the experts into shards in other orders)."""
    from safetensors.torch import load_file

    model = tiny_model(family, dtype)
    model.save_pretrained(tmp_path / "hf", max_shard_size=shard)
    saved = ns.save(model, tmp_path / "ours", max_shard_size=shard)
    assert saved["reload"]["comparison"]["relative"] == 0.0
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    ours = sorted(p.name for p in (tmp_path / "ours").iterdir())
    assert sorted(names + ["README.md"]) == ours and len(names) >= 3  # and our model card
    if shard == "20KB":
        index = [json.loads((tmp_path / d / "model.safetensors.index.json").read_text())["weight_map"]
                 for d in ("hf", "ours")]
        assert index[0] == index[1]
    for name in names:
        if name.endswith(".safetensors"):
            a, b = load_file(tmp_path / "hf" / name), load_file(tmp_path / "ours" / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    config = [json.loads((tmp_path / d / "config.json").read_text()) for d in ("hf", "ours")]
    # and the top-level RoPE keys runtimes reading the keys before transformers 5 need (test_mlx)
    extra = {k: config[1][k] for k in config[1].keys() - config[0].keys()}
    assert {k: v for k, v in config[1].items() if k not in extra} == config[0]
    rope = config[0].get("rope_parameters") or {}
    assert extra == {k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope}


@pytest.mark.parametrize("stack, cat", [(0, 1), (0, 0), (1, 2), (2, 0)])
def test_tensors_stored_per_expert_merge_as_transformers_merges_them(tmp_path, stack, cat):
    """Stored reads each expert's tensor into its slice of the merged one: the same tensor as
    transformers' MergeModulelist(stack) then Concatenate(cat) (contiguous slices or not)."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import Concatenate, MergeModulelist

    from normsurgery.io.stored import Stored
    from normsurgery.io.shards import Index, Reader

    g = torch.Generator().manual_seed(0)
    groups = {p: [torch.randn(3, 5, generator=g) for _ in range(4)] for p in ("w1", "w3")}
    save_file({f"experts.{e}.{p}": t for p, ts in groups.items() for e, t in enumerate(ts)}, tmp_path / "m.safetensors")
    merged = MergeModulelist(stack).convert({p: list(ts) for p, ts in groups.items()}, ["w1", "w3"], ["x"])
    expected = Concatenate(cat).convert(merged, ["w1", "w3"], ["x"])["x"]
    index = Index([tmp_path / "m.safetensors"])
    stored = Stored(tuple(tuple(f"experts.{e}.{p}" for e in range(4)) for p in ("w1", "w3")), stack, cat)
    assert stored.shape(index) == tuple(expected.shape)
    got = stored.read_into(Reader(index), torch.empty(expected.shape, dtype=torch.float64))
    assert torch.equal(got, expected.double())


def test_a_missing_folder_is_not_sent_to_hf_download(tmp_path):
    """Issue 28: only something shaped like a hub id (owner/name) gets the `hf download` advice."""
    from normsurgery.io.source import resolve
    from normsurgery.core.errors import SurgeryError

    with pytest.raises(SurgeryError, match="no such folder") as e:
        resolve(tmp_path / "missing")
    assert "hf download" not in str(e.value)
    with pytest.raises(SurgeryError, match="hf download someone/no-such-model-28"):
        resolve("someone/no-such-model-28")


def sentence_transformers_folder(tmp_path) -> Path:
    """The demo GPT-2 laid out as sentence-transformers saves a model: ``modules.json`` naming the
    transformer (the folder itself), a pooling module (a folder of config only) and a dense module
    with its own weights; and an ``onnx/`` folder holding a copy of the model's weights."""
    from safetensors.torch import save_file

    src = tmp_path / "st"
    shutil.copytree(GPT2, src)
    (src / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]))
    (src / "1_Pooling").mkdir()
    (src / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 64, "pooling_mode_mean_tokens": true}')
    (src / "2_Dense").mkdir()
    (src / "2_Dense" / "config.json").write_text('{"in_features": 64, "out_features": 8}')
    save_file({"linear.weight": torch.ones(8, 64)}, src / "2_Dense" / "model.safetensors")
    (src / "onnx").mkdir()
    (src / "onnx" / "model.onnx").write_bytes(b"a stale copy of the input's weights")
    return src


def test_sentence_transformers_modules_are_copied_as_they_are(tmp_path):
    """Issue 34, finding 3: the module folders modules.json names were left behind (1_Pooling/), so
    SentenceTransformer(OUT) failed. Copied, the dense module's own weights too; a folder holding
    another copy of the input's weights is not; the output's copied folders do not stop --force."""
    src, out = sentence_transformers_folder(tmp_path), tmp_path / "out"
    ns.convert(src, out, [("flashnorm", {})], verify=False)
    for module in ("1_Pooling", "2_Dense"):
        assert _digest(out / module) == _digest(src / module)
    assert (out / "modules.json").read_text() == (src / "modules.json").read_text()
    assert not (out / "onnx").exists()
    ns.convert(src, out, [("flashnorm", {})], verify=False, force=True)
    assert _digest(out / "2_Dense") == _digest(src / "2_Dense")


def _digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_mistyped_local_path_is_no_such_folder(tmp_path, monkeypatch):
    """Issue 34, finding 11: `models/nope` (a typo beside an existing models/ folder) got the
    `hf download models/nope` advice. A path that looks local is "no such folder"; owner/name
    whose owner is no folder here is still taken for a hub id."""
    from normsurgery.io.source import resolve
    from normsurgery.core.errors import SurgeryError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for typo in ("models/nope", "./nope", "../nope", "~/no-such-folder-34"):
        with pytest.raises(SurgeryError, match="no such folder") as e:
            resolve(typo)
        assert "hf download" not in str(e.value)
    with pytest.raises(SurgeryError, match="hf download someone/no-such-model-34"):
        resolve("someone/no-such-model-34")
