"""export --to nemotron-nas: a Llama-shaped checkpoint (Llama, Mistral, Qwen2, SmolLM), stock or
with per-layer widths (minimize, squeeze, mask: MLP units or key/value heads removed unevenly,
which otherwise load only through normsurgery's runtime), as NVIDIA's DeciLM ("nemotron-nas")
checkpoint: the one format in which vLLM, SGLang, TensorRT-LLM, MLX-LM and ExLlamaV3 read per-layer
widths. Checked in MLX-LM or vLLM (``runtime_check``) and in transformers against the checkpoint in
torch before anything is left.

What is written:
- config.json: ``DeciLMForCausalLM`` / ``nemotron-nas``, Llama's keys (``rope_theta`` at the top
  level, ``rope_scaling`` for scaled RoPE), and one ``block_configs[i]`` per layer:
  ``attention`` {``no_op``, ``n_heads_in_group``: query heads per key/value head} and ``ffn``
  {``no_op``, ``ffn_mult``}; ``auto_map`` to ``configuration_decilm.py`` and ``modeling_decilm.py``,
  copied beside it with normsurgery's runtime (``modeling_normsurgery.py``), so
  ``AutoConfig.from_pretrained(folder, trust_remote_code=True)`` reads it (vLLM and TensorRT-LLM
  call it so) and ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` runs
  it in transformers (Llama's modules at each layer's widths, as NVIDIA's checkpoints ship theirs);
- Llama's tensor names. Each MLP's width is ``int(2 * ffn_mult * hidden / 3)`` rounded up to a
  multiple of 256 (``configuration_decilm.ffn_width``): its units padded with zero units to that
  multiple (zero gate, up and down entries: silu(0) * 0 = 0, exactly nothing added; the bytes
  they take are stated) and ``ffn_mult`` chosen so the formula gives that width back. MLX-LM
  refuses any other ffn key (``intermediate_size``), so none is written;
- ``no_op`` where a layer's attention or MLP computes nothing (its output projection zero, or
  every MLP unit dead, and no bias): its tensors and its norm are not written (DeciLM has no
  norm before a no-op sublayer);
- biases where the model has them (Qwen2's q, k and v): the format has one flag for all four
  attention projections (and one for the MLP's three), so a projection without one gets zeros.

What the format cannot say is refused, one line, before anything is written: query heads that
differ by layer, a head width other than hidden / heads (GGUF's ``deci`` says both: ``export --to
gguf``), norms other than plain RMSNorm with one epsilon (removed, compensated, with a bias), a
head with a bias, removed residual channels, scaled or soft-capped logits, a sliding window,
partial RoPE, another MLP than SwiGLU.

The checks: the folder in MLX-LM or vLLM (``runtime_check.compare_runtime``, ``--check``; the
default: the first installed) in float32 against the checkpoint in torch float32 (``loader.load``:
our runtime for rewritten ones): logits on the probe (relative error, KL, top-1 within float32
rounding) and greedy tokens; then the folder in transformers (``AutoModelForCausalLM``, its
``auto_map``): logits on the probe. The weights are written in the checkpoint's storage dtype,
which holds them exactly (the padding is zeros): they compute the same function. What the
padding costs is said: the MLP units kept and written, the weight files' bytes in and out.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..core import algebra, devices, runtime
from . import configuration_decilm, runtime_check
from ..io.checkpoint import RUNTIME_FILE, finish
from ..io.loader import load
from ..io.source import Source, weight_files
from ..core.errors import SurgeryError
from ..core.families import layout
from ..core.layout import Layout
from ..core.options import MAX_SHARD_SIZE, ExportOptions
from ..io.output import written
from ..core.parity import Comparison, compare
from ..engine.runner import Job, job_scope
from ..io.shards import ShardWriter, header_room
from ..io.texts import text_of

#: the families whose blocks DeciLM computes (Llama's: pre-norm RMSNorm, rotary attention, SwiGLU)
FAMILIES = ("llama", "mistral", "qwen2")
CONFIG_FILE = "configuration_decilm.py"
MODEL_FILE = "modeling_decilm.py"
ACTIVATIONS = ("silu",)


@dataclass
class Plan:
    """What each layer becomes: its block config, and (live sublayers) the source's modules."""

    blocks: list[dict]  # block_configs
    units: list[int | None]  # MLP units of the source per layer (None: no_op)
    widths: list[int | None]  # the written MLP widths (multiples of 256)
    kv_heads: list[int | None]  # None: no_op attention
    attention_bias: bool
    mlp_bias: bool
    padding_bytes: int = 0

    def as_dict(self) -> dict:
        return {"mlp_units": self.units, "mlp_widths": self.widths, "kv_heads": self.kv_heads,
                "no_op_attention": [i for i, k in enumerate(self.kv_heads) if k is None],
                "no_op_mlp": [i for i, u in enumerate(self.units) if u is None],
                "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias,
                "units_kept": self.kept, "units_written": sum(w for w in self.widths if w is not None),
                "padding_bytes": self.padding_bytes}

    @property
    def kept(self) -> int:
        """The MLP units of the source the folder holds (its other units are zero padding)."""
        return sum(u for u in self.units if u is not None)


def ffn_mult(width: int, hidden: int) -> float:
    """The ``ffn_mult`` (6 decimals, as MLX-LM rounds it) whose width is ``width`` (a multiple of 256)."""
    mult = round(width * 3 / (2 * hidden), 6)
    if configuration_decilm.ffn_width(mult, hidden) != width:
        raise SurgeryError(f"internal: no ffn_mult gives MLP width {width} at hidden size {hidden}")
    return mult


def padded(units: int) -> int:
    m = configuration_decilm.FFN_MULTIPLE
    return max(m, -(-units // m) * m)


def _zero(t: torch.Tensor | None) -> bool:
    return t is None or not bool(t.any())


def _mlp_dead(model, site) -> bool:
    """Whether every unit of the MLP outputs zero (its down column zero, or its gate or up row and
    bias zero: silu(0) = 0) and its down projection adds no bias: it computes nothing."""
    down, gate, up = (model.get_submodule(p) for p in (site.down, site.gate, site.up))
    dead = ~algebra.weight(down, None).any(0)
    for mod in (gate, up):
        b = getattr(mod, "bias", None)
        dead |= ~algebra.weight(mod, None).any(1) & (torch.ones_like(dead) if b is None else b.detach() == 0)
    return bool(dead.all()) and _zero(getattr(down, "bias", None))


def _attention_dead(model, site) -> bool:
    """Whether the attention outputs zero: its output projection zero, with no bias."""
    o = model.get_submodule(site.o)
    return not bool(o.weight.detach().any()) and _zero(getattr(o, "bias", None))


def refusal(source: Source, model, lay: Layout, no_op: list[bool]) -> str | None:
    """Why nemotron-nas cannot express ``model`` (None: it can); ``no_op``: per layer, whether its
    attention computes nothing (its head counts then do not matter)."""
    c = source.config
    deci = "; GGUF's deci architecture can (export --to gguf)"
    if source.family not in FAMILIES:
        return f"it is a {source.family} model; nemotron-nas holds Llama-shaped ones ({', '.join(FAMILIES)})"
    if lay.objective != "causal-lm" or lay.head is None:
        return f"{source.class_name} is no causal LM"
    if not lay.plain_logits:
        return "its logits are scaled or soft-capped after the head"
    if lay.stream_width != lay.hidden_size:
        return (f"its stream holds {lay.stream_width} of {lay.hidden_size} channels (removed channels: its norms "
                "divide by the full width)")
    if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True):
        return f"it attends within a sliding window ({c.sliding_window}), which DeciLM does not"
    rope = getattr(c, "rope_parameters", None) or {}
    if "rope_theta" not in rope or rope.get("partial_rotary_factor", 1.0) != 1.0:
        return "its RoPE is not one rotation of every head's full width"
    if c.hidden_act not in ACTIVATIONS:
        return f"its MLP's activation is {c.hidden_act}"
    if any(m.gate is None or m.stacked for m in lay.mlps) or len(lay.mlps) != len(lay.attention):
        return "its MLPs are not SwiGLU with separate gate and up projections"
    if [p for p in lay.embeddings if p != lay.token_embedding]:
        return "it adds position embeddings"
    if getattr(model.get_submodule(lay.head), "bias", None) is not None:
        return "its head has a bias (remove-ln folds the final LayerNorm's bias into it)"
    for s in lay.norms:
        mod = model.get_submodule(s.path)
        width = mod.weight.shape[0] if getattr(mod, "weight", None) is not None else None
        if s.kind != "rmsnorm" or s.offset != 0.0 or getattr(mod, "bias", None) is not None \
                or getattr(mod, "divisor", width) != width:
            return f"{s.path} is a {type(mod).__name__} ({s.kind}), not the plain RMSNorm DeciLM computes"
    if len({s.eps for s in lay.norms}) != 1:
        return "its norms use several epsilons, and DeciLM has one"
    heads = c.num_attention_heads
    for i, a in enumerate(lay.attention):
        if no_op[i]:
            continue
        if a.num_heads != heads:
            return f"layer {i} has {a.num_heads} query heads, not {heads}: DeciLM varies only key/value heads{deci}"
        if a.head_dim * heads != lay.hidden_size:
            return f"its heads are {a.head_dim} wide, and DeciLM's are hidden / heads = {lay.hidden_size / heads:g}{deci}"
        if a.qkv is not None or a.num_heads % a.num_kv_heads:
            return f"layer {i}'s attention is not Llama's grouped-query attention"
    return None


def deci_plan(source: Source, model, lay: Layout, storage: torch.dtype) -> Plan:
    """The block configs of ``model`` (refused with a SurgeryError where the format cannot say it)
    and the bytes its padding takes, stored in ``storage``."""
    no_op = [_attention_dead(model, a) for a in lay.attention]
    why = refusal(source, model, lay, no_op)
    if why:
        raise SurgeryError(f"nemotron-nas cannot express {source.name}: {why}; nothing was written")
    hidden, blocks, units, widths, kv = lay.hidden_size, [], [], [], []
    for a, m, attn_dead in zip(lay.attention, lay.mlps, no_op):
        mlp_dead = _mlp_dead(model, m)
        u = None if mlp_dead else algebra.in_width(model.get_submodule(m.down))
        units.append(u)
        widths.append(None if u is None else padded(u))
        kv.append(None if attn_dead else a.num_kv_heads)
        blocks.append({"attention": {"no_op": True} if attn_dead else
                       {"no_op": False, "n_heads_in_group": a.num_heads // a.num_kv_heads},
                       "ffn": {"no_op": True} if mlp_dead else {"no_op": False, "ffn_mult": ffn_mult(widths[-1], hidden)}})
    attention = [p for a, k in zip(lay.attention, kv) if k is not None for p in (a.q, a.k, a.v, a.o)]
    mlps = [p for m, u in zip(lay.mlps, units) if u is not None for p in (m.gate, m.up, m.down)]
    p = Plan(blocks, units, widths, kv, _biased(model, attention), _biased(model, mlps))
    per_unit = 3 * hidden + (2 if p.mlp_bias else 0)  # gate and up rows, a down column (and biases)
    p.padding_bytes = sum((w - u) * per_unit for w, u in zip(widths, units) if u is not None) * storage.itemsize
    return p


def _biased(model, paths: list[str]) -> bool:
    return any(getattr(model.get_submodule(p), "bias", None) is not None for p in paths)


def tensors(model, lay: Layout, p: Plan, storage: torch.dtype) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """(name, make) of every tensor written, in Llama's names: ``make()`` gives it, cast to
    ``storage`` on the host (one at a time: no second copy of the model), the MLPs padded with
    zero units."""
    get = model.get_submodule
    norms = {r: [s for s in lay.norms if s.role == r] for r in ("attn", "mlp", "final")}

    def param(path: str, attr: str = "weight"):
        return lambda: getattr(get(path), attr).detach().to(device=devices.HOST, dtype=storage)

    def linear(name: str, path: str, bias: bool, rows: int = 0, cols: int = 0) -> list:
        def weight():
            return torch.nn.functional.pad(param(path)(), (0, cols, 0, rows))

        def bias_():
            b = getattr(get(path), "bias", None)
            b = torch.zeros(algebra.out_width(get(path)), dtype=storage) if b is None else param(path, "bias")()
            return torch.nn.functional.pad(b, (0, rows))
        return [(f"{name}.weight", weight)] + ([(f"{name}.bias", bias_)] if bias else [])

    out = [("model.embed_tokens.weight", param(lay.token_embedding))]
    for i, (a, m) in enumerate(zip(lay.attention, lay.mlps)):
        blk = f"model.layers.{i}"
        if p.kv_heads[i] is not None:
            out.append((f"{blk}.input_layernorm.weight", param(norms["attn"][i].path)))
            for n, path in (("q_proj", a.q), ("k_proj", a.k), ("v_proj", a.v), ("o_proj", a.o)):
                out += linear(f"{blk}.self_attn.{n}", path, p.attention_bias)
        if p.units[i] is not None:
            extra = p.widths[i] - p.units[i]
            out.append((f"{blk}.post_attention_layernorm.weight", param(norms["mlp"][i].path)))
            out += linear(f"{blk}.mlp.gate_proj", m.gate, p.mlp_bias, rows=extra)
            out += linear(f"{blk}.mlp.up_proj", m.up, p.mlp_bias, rows=extra)
            out += linear(f"{blk}.mlp.down_proj", m.down, p.mlp_bias, cols=extra)
    out.append(("model.norm.weight", param(norms["final"][0].path)))
    if not lay.tied:
        out.append(("lm_head.weight", param(lay.head)))
    return out


def config(source: Source, lay: Layout, p: Plan, storage: torch.dtype, record: dict) -> dict:
    """config.json of the DeciLM folder."""
    c = source.config
    rope = dict(c.rope_parameters)
    cfg = {"architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas",
           "auto_map": {"AutoConfig": f"{CONFIG_FILE[:-3]}.DeciLMConfig",
                        "AutoModelForCausalLM": f"{MODEL_FILE[:-3]}.DeciLMForCausalLM"},
           "vocab_size": c.vocab_size, "hidden_size": lay.hidden_size, "num_hidden_layers": len(p.blocks),
           "num_attention_heads": c.num_attention_heads, "hidden_act": c.hidden_act,
           "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": lay.norms[0].eps,
           "rope_theta": rope["rope_theta"], "rope_parameters": rope,
           "attention_bias": p.attention_bias, "mlp_bias": p.mlp_bias, "tie_word_embeddings": lay.tied,
           "dtype": str(storage).removeprefix("torch."), "block_configs": p.blocks, "normsurgery": record}
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(c, key, None) is not None:
            cfg[key] = getattr(c, key)
    return cfg


@dataclass
class Exported:
    saved: dict
    plan: Plan
    dtype: str
    parity: Comparison  # the runtime against torch; ``generation``: greedy tokens agreeing
    greedy: dict
    runtime: str  # the check's runtime, in words (MLX-LM, vLLM)
    transformers: Comparison  # the folder in transformers (its auto_map's model) against the checkpoint
    weight_bytes: dict  # {"in": the checkpoint's weight files, "out": the folder's}

    def as_dict(self) -> dict:
        return {"saved": self.saved, "format": "nemotron-nas", "dtype": self.dtype, **self.plan.as_dict(),
                "weight_bytes": {**self.weight_bytes, "smaller": self.weight_bytes["out"] < self.weight_bytes["in"]},
                "check": self.runtime, "parity": self.parity.as_dict(), "greedy": self.greedy,
                "transformers": self.transformers.as_dict(), "ok": self.parity.ok and self.transformers.ok}


@job_scope
def export(src, dest, options: ExportOptions | None = None, *, text: str | None = None,
           max_shard_size: str | int = MAX_SHARD_SIZE,
           change: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> Exported:
    """``src`` written to the folder ``dest`` as a nemotron-nas checkpoint (module docstring) with
    ``options`` (``ExportOptions``: ``runtime`` (--check), ``tolerance``, ``force``, ``allow_pickle``,
    ``device``), checked in MLX-LM or vLLM and in transformers; raises SurgeryError, leaving
    nothing, where the format cannot say the model or a check fails. Written through the one
    runner (``runner.Job``: the output claimed once, the folder filled in its stage).
    ``change(name, tensor)``: a last change to each tensor written (tests: a wrong weight)."""
    options = options or ExportOptions(to="nemotron-nas")
    runtime = runtime_check.choose(options.runtime)
    text = text_of(text)
    job = Job.open(src, dest, force=options.force, allow_pickle=options.allow_pickle, device=options.device)
    source = job.source
    if source.family not in FAMILIES:  # before loading anything
        raise SurgeryError(f"nemotron-nas cannot express {source.name}: it is a {source.family} model; nemotron-nas "
                           f"holds Llama-shaped ones ({', '.join(FAMILIES)}); nothing was written")
    model = load(source, torch.float32, device=job.device)
    lay = layout(model)
    storage = source.storage
    p = deci_plan(source, model, lay, storage)
    tol = runtime_check.probe(model, runtime_check.probe_for(source, text), options.tolerance)
    with job.staged() as stage:
        record = {"export": "nemotron-nas", "source": source.name, **p.as_dict()}
        files = write(stage.path, source, model, lay, p, record, max_shard_size, change)
        checked = runtime_check.compare_runtime(runtime, stage.path, model, tol)
        if not checked.ok:
            raise SurgeryError(f"{checked.failure()}; nothing was written")
        loaded = transformers_check(stage.path, tol)
        record["parity"] = {**checked.parity.as_dict(), "runtime": runtime_check.NAMES[runtime]}
        record["transformers"] = loaded.as_dict()
        (stage.path / "config.json").write_text(json.dumps(config(source, lay, p, storage, record), indent=2) + "\n")
        stage.card("text", stage.path, text=card(Path(dest).name, source.name, p, checked))
        sizes = {"in": sum(f.stat().st_size for f in weight_files(source.path, options.allow_pickle)),
                 "out": sum((stage.path / f).stat().st_size for f in files)}
    checked.parity.device = devices.describe(job.device)
    saved = written(dest, stage, {"shards": len(files)})
    return Exported(saved, p, str(storage).removeprefix("torch."), checked.parity, checked.greedy,
                    runtime_check.NAMES[runtime], loaded, sizes)


def write(folder: Path, source: Source, model, lay: Layout, p: Plan, record: dict, max_shard_size,
          change: Callable | None) -> list[str]:
    """The DeciLM folder: the weights (shards of at most ``max_shard_size``; their names returned),
    the source's side files, the config (``record`` under ``normsurgery``) and the code its
    ``auto_map`` names."""
    from transformers.utils.hub import convert_file_size_to_int

    items = tensors(model, lay, p, source.storage)
    shards = ShardWriter(folder, convert_file_size_to_int(max_shard_size), header_room(n for n, _ in items))
    for name, make in items:
        shards.add(name, change(name, make()) if change else make())
    files = shards.close()
    finish(folder, [], source)
    shutil.copyfile(configuration_decilm.__file__, folder / CONFIG_FILE)
    shutil.copyfile(Path(configuration_decilm.__file__).with_name(MODEL_FILE), folder / MODEL_FILE)
    shutil.copyfile(runtime.__file__, folder / RUNTIME_FILE)
    (folder / "config.json").write_text(json.dumps(config(source, lay, p, source.storage, record), indent=2) + "\n")
    return files


def transformers_check(folder: Path, tol) -> Comparison:
    """``folder`` loaded as a user loads it, ``AutoModelForCausalLM.from_pretrained(folder,
    trust_remote_code=True)`` (its ``auto_map``: ``modeling_decilm.py``), float32, on the host, its
    logits on ``tol``'s probe judged against the checkpoint's; a SurgeryError when they differ."""
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    except Exception as e:  # transformers' own refusals
        raise SurgeryError(f"transformers cannot load the nemotron-nas folder: {' '.join(str(e).split())[:300]}; "
                           "nothing was written") from None
    with torch.no_grad():  # not ``parity.outputs``: normsurgery's family table does not know the class, by design
        got = loaded(input_ids=tol.ids, use_cache=False).logits.float()
    c = tol.judge(compare(tol.reference, got.to(tol.reference.device), "logits"))
    if not c.ok:
        raise SurgeryError(f"the folder in transformers (its auto_map) differs from the checkpoint: {c.failed} "
                           f"({c.reason}); nothing was written")
    return c


def runs(values: list) -> str:
    """Per-layer values in words, equal neighbours counted: "1280 x 2, no-op, 1024" (None: no-op)."""
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        word = "no-op" if values[i] is None else str(values[i])
        out.append(word if j == i else f"{word} x {j - i + 1}")
        i = j + 1
    return ", ".join(out)


def card(name: str, source: str, p: Plan, checked) -> str:
    """The folder's README: what it is, how each runtime loads it, what was checked."""
    c, runtime = checked.parity, runtime_check.NAMES[checked.runtime]
    return f"""# {name}

{source} as a DeciLM ("nemotron-nas") checkpoint, written by normsurgery `export --to nemotron-nas`:
per-layer MLP widths {runs(p.widths)}; key/value heads {runs(p.kv_heads)}. Each MLP is padded with zero units to a
multiple of 256 ({p.kept:,} units kept, written as {p.as_dict()["units_written"]:,}: {p.padding_bytes:,} bytes of
zeros), which add nothing.

Checked in {runtime} against the checkpoint in transformers (float32, probe windows): relative error
{c.relative:.2e}, KL {c.kl:.2e}, top-1 agreement {c.top1:.4f} (tolerance {c.tolerance:.1e}: {c.reason});
greedy tokens {c.generation:.0%} equal. Loaded in transformers through its `auto_map`, it computes the
checkpoint's logits within the same tolerance.

- MLX-LM: `mlx_lm.generate --model {name} --trust-remote-code --prompt "..."`, or
  `mlx_lm.load("{name}", tokenizer_config={{"trust_remote_code": True}})`
- vLLM: `vllm serve {name} --trust-remote-code` (`LLM("{name}", trust_remote_code=True)`)
- SGLang: `python -m sglang.launch_server --model-path {name} --trust-remote-code`
- TensorRT-LLM: `trtllm-serve {name} --trust_remote_code`
- transformers: `AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)` (the code beside
  the weights: `modeling_decilm.py`, Llama's modules at each layer's widths)
"""
