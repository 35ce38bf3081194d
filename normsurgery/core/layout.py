"""The data a pass reads: where a model keeps its stream's writers, norms, readers and head.

An adapter (``adapters.py``) turns a loaded model into a :class:`Layout`; passes read only it and
never name a model attribute. Every fact a pass needs is stated here, read from the live modules:
the stream width as stored now, each norm's kind, gain offset and eps, the training objective.

Placement:
- ``pre``: x += f(norm(x)) for each sublayer in turn (GPT-2, Llama, ...);
- ``parallel``: x += attn(norm_a(x)) + mlp(norm_m(x)) in one step (GPT-NeoX, Phi; Phi shares
  one norm between both, which is just a norm site with both sublayers' readers);
- ``post``: x = norm(x + f(x)) (BERT): the stream itself is normalised, so norm passes refuse.

A ``pre`` block may also normalise its sub-blocks' outputs: x += norm_out(f(norm_in(x))) (Gemma 2
and 3's sandwich norms). Such a norm has role "output" and no readers: what it writes is the
stream, so its gain has no linear layer to fold into, and the stream is not the writers' sum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: norm kinds: what a norm computes over its input x (``families.norm_kind`` reads it off the module)
NORM_KINDS = ("layernorm", "rmsnorm", "crmsnorm", "compensated-layernorm", "other")
#: what the model's head is trained for ("none": a base model, whose output is its last hidden state)
OBJECTIVES = ("causal-lm", "masked-lm", "sequence-classification", "token-classification", "none")
#: objectives with a language-modelling loss (cross-entropy over the vocabulary)
LM_OBJECTIVES = ("causal-lm", "masked-lm")


@dataclass(frozen=True)
class NormSite:
    """A norm over the residual stream and the linear layers that read its output.

    ``kind`` is one of NORM_KINDS; the gain is ``offset + weight`` (Gemma: 1; None when the
    module's class is not known, so nothing may be folded); ``eps`` its epsilon.
    """

    path: str
    readers: tuple[str, ...]
    role: str  # "attn", "mlp", "attn+mlp", "final", "embed", "post", "output" (a sub-block's output norm)
    kind: str = "other"
    offset: float | None = 0.0
    eps: float | None = None


@dataclass(frozen=True)
class AttentionSite:
    """One block's self-attention: its projections and head layout, read from current shapes.

    Separate ``q``/``k``/``v`` or one fused ``qkv``: ``qkv_order`` "blocks" stacks all q rows
    (num_heads * head_dim), then all k, then all v (num_kv_heads * head_dim each: GPT-2, Phi-3);
    "heads" stacks q, k, v per head (GPT-NeoX, num_kv_heads = num_heads); "groups" stacks, per kv
    head, its query heads, then its k, then its v (Falcon's new decoder architecture). Query head h
    reads key/value head h // (num_heads // num_kv_heads). ``count_attrs`` are the module
    attributes its forward reads that follow the head counts, each with its quantity: "heads",
    "kv_heads", "groups" (query heads per kv head) or "width" (heads * head_dim).
    ``per_head`` are parameters whose first axis indexes heads, or module lists with one module per
    head, each with its part ("q": query heads, "k": kv heads): per-head QK norms (Cohere's
    [heads, head_dim] gains, StableLM's LayerNorm per head).
    """

    path: str
    o: str
    head_dim: int
    num_heads: int
    num_kv_heads: int
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv: str | None = None
    qkv_order: str = "separate"  # "separate" | "blocks" | "heads" | "groups"
    count_attrs: tuple[tuple[str, str], ...] = ()
    per_head: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class MlpSite:
    """One block's MLP: down(act(up x)), or down(act(gate x) * up x) when ``gate`` is set;
    ``stacked``: gate and up are one linear (``up`` = ``gate``), gate's rows first (Phi-3)."""

    up: str
    down: str
    act: str  # path of the activation module
    gate: str | None = None
    stacked: bool = False


@dataclass(frozen=True)
class Layout:
    family: str
    placement: str  # "pre" | "parallel" | "post"
    stream_width: int  # residual channels as stored now (a writer's output width)
    hidden_size: int  # the config's width (stays the stock d when channels are removed)
    layers_path: str  # path of the ModuleList of blocks
    token_embedding: str
    embeddings: tuple[str, ...]  # embeddings whose rows are added to the stream
    writers: tuple[str, ...]  # linears whose outputs are added to the stream
    norms: tuple[NormSite, ...]  # every stream norm, final norm last
    head: str | None  # the output layer (reads the final norm); None for a base model, whose
    # final norm then has no reader: its output is the model's output, nothing may be folded out of it
    tied: bool  # head shares its weight with the token embedding
    objective: str = "causal-lm"  # one of OBJECTIVES
    qk_norms: tuple[str, ...] = ()  # per-head norms inside attention: not foldable
    attention: tuple[AttentionSite, ...] = ()  # one per block
    mlps: tuple[MlpSite, ...] = ()  # one per block
    # (quantity, config key) the stock __init__ builds widths from: "intermediate", "heads",
    # "kv_heads", "head_dim" (only where the stock code reads head_dim from the config)
    config_widths: tuple[tuple[str, str], ...] = ()
    # module paths this layout is restricted to (``restrict``); () for the whole model
    scope: tuple[str, ...] = ()
    eps_keys: tuple[str, ...] = ()  # config keys the stock norms read their eps from
    # mixture-of-experts blocks; their routed experts read and write through stacked [experts, out, in]
    # tensors, named as readers and writers by parameter path (a linear's last axis reads its input)
    experts: tuple[str, ...] = ()
    bias_flags: tuple[str, ...] = ()  # config flags that give the stock linears biases
    # the forward reads head counts off the config all blocks share: every block keeps as many heads
    shared_head_counts: bool = False
    plain_logits: bool = True  # the logits are the head's linear output as it is (``families.Family``)
    undescribed: str = ""  # why ``attention`` and ``mlps`` are left empty, where the adapter says
    # modules outside the blocks, besides the final norm and the head, that run after the blocks (a
    # pooler, the layers of a head before its output layer): streamed with the last block
    after: tuple[str, ...] = ()

    @property
    def final_norm(self) -> NormSite | None:
        return self.norms[-1] if self.norms and self.norms[-1].role == "final" else None

    @property
    def output_norm(self) -> NormSite | None:
        """The final norm when its output is the model's output (a base model): no reader to
        fold its gain into, and its width is the output's."""
        final = self.final_norm
        return final if final is not None and not final.readers else None

    @property
    def gated_mlp(self) -> bool:
        """Whether the blocks' MLPs multiply two linear maps of their input (gate and up, a mixture
        of experts' gate_up): quadratic in the input's scale, where a plain MLP is linear in it up to
        its activation."""
        return bool(self.experts) or any(m.gate is not None for m in self.mlps)

    @property
    def norm_kinds(self) -> set[str]:
        return {s.kind for s in self.norms}

    def holds(self, path: str | None) -> bool:
        """Whether the module or parameter ``path`` lies in this Layout's scope (any, unscoped)."""
        return path is not None and (not self.scope or any(path == p or path.startswith(p + ".") for p in self.scope))

    def restrict(self, scope: tuple[str, ...]) -> Layout:
        """The sites inside the modules ``scope`` (paths and everything under them): what a pass
        sees when it rewrites one part of a model (streaming). Whole-model facts (family,
        placement, widths, head, tying, objective) stay; a norm site's readers must lie in the
        same scope. Empty ``scope``: the whole layout."""
        if not scope:
            return self
        part = dataclasses.replace(self, scope=tuple(scope))
        inside = part.holds

        norms = tuple(s for s in self.norms if inside(s.path))
        outside = [r for s in norms for r in s.readers if not inside(r)]
        if outside:
            raise ValueError(f"{outside[0]} reads a norm inside {scope} but lies outside it")
        return dataclasses.replace(
            self, embeddings=tuple(p for p in self.embeddings if inside(p)),
            writers=tuple(p for p in self.writers if inside(p)), norms=norms,
            qk_norms=tuple(p for p in self.qk_norms if inside(p)),
            attention=tuple(a for a in self.attention if inside(a.path)),
            experts=tuple(p for p in self.experts if inside(p)),
            mlps=tuple(m for m in self.mlps if inside(m.down)), scope=tuple(scope))
