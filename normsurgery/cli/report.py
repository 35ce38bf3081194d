"""What the commands print for people: tables (fitting 80 columns: long cells wrap, names never
cut), the prune and squeeze plots (written as any output is: :func:`plotting`). ``--json`` output is
the result's ``as_dict`` (see each command).

Cells are rich ``Text``, never markup, so ``[[pass]]`` or a path with brackets prints as is.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from rich import box
from rich.table import Table
from rich.cells import cell_len
from rich.text import Text

SHORT = 12  # the widest cell of a column kept whole: 1.23e-13, -1.2345e+04, yes
# no vertical rules: more room in 80 columns
STYLE = {"box": box.SIMPLE_HEAD, "pad_edge": False, "collapse_padding": True}


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}e}" if (x != 0 and (abs(x) < 1e-2 or abs(x) >= 1e4)) else f"{x:.4g}"
    return str(x)


def table(title: str, columns, rows, *, show_header: bool = True, right: tuple[int, ...] = ()) -> Table:
    """A table of literal text, fitting the console by wrapping text, never by cutting a number:
    a column whose cells are all short (numbers, yes/no: at most ``SHORT`` characters) keeps its
    full width, headers included; the others fold, names too. A cell may hold several lines."""
    rows = [[c if isinstance(c, Text) else Text(str(c)) for c in row] for row in rows]
    t = Table(title=Text(title), show_header=show_header, **STYLE)
    for i, col in enumerate(columns):
        cells = [Text(col)] * show_header + [row[i] for row in rows]
        widest = max((cell_len(line) for c in cells for line in c.plain.splitlines() or [""]), default=0)
        short = all(cell_len(line) <= SHORT for c in rows for line in c[i].plain.splitlines())
        t.add_column(Text(col), no_wrap=short, overflow="fold",
                     min_width=widest if short else None, justify="right" if i in right else "left")
    for row in rows:
        t.add_row(*row)
    return t


def red(text: str) -> Text:
    return Text(text, style="red")


def green(text: str) -> Text:
    return Text(text, style="green")


# ---- convert ----

def convert_tables(result, src, out) -> list:
    rows = []
    for s in result.steps:
        p = s.parity
        ok = ("yes" if p.ok else red("NO")) if p is not None and s.kind == "exact" else "-"
        rows.append((s.name, s.kind, fmt(p and p.relative), fmt(p and p.max_abs), fmt(p and p.kl),
                     fmt(p and p.top1), ok))
    kept = f", {len(result.kept_float32)} tensors kept in float32" if result.kept_float32 else ""
    stored = result.storage_dtype + kept
    title = f"convert {src} -> {out} (rewritten in {result.work_dtype}, stored in {stored})"
    out_tables = [table(title, ("pass", "kind", "rel. error", "max |Δ|", "KL", "top-1", "ok"), rows)]
    for s in result.steps:
        if s.metrics.get("curve"):
            out_tables.append(curve_table(s.name, s.metrics["curve"]))
        if "ce_control" in s.metrics:
            out_tables.append(control_table(s.name, s.metrics))
        if "layers" in s.metrics and "params" in s.metrics:
            out_tables.append(size_table(s.name, s.metrics))
    return out_tables


def control_table(name: str, m: dict) -> Table:
    """A trained pass's held-out CE beside the vanilla fine-tune at the same budget (the control
    the papers judge against)."""
    before = m["ce_before"]
    rows = [("the input", f"{before:.4f}", "-", "0"),
            (f"after {name}", f"{m['ce_after']:.4f}", f"{m['ce_after'] - before:+.4f}", f"{m['tokens']:,}"),
            ("vanilla fine-tune (control)", f"{m['ce_control']:.4f}", f"{m['ce_control'] - before:+.4f}",
             f"{m['control_tokens']:,}")]
    return table(f"{name} vs the control: {m['gap_to_control']:+.4f} nats (held-out CE)",
                 ("model", "held-out CE", "vs input", "tokens"), rows, right=(1, 2, 3))


def loads_with(saved: dict) -> str:
    """What was checked about loading the saved folder (``checkpoint.save``)."""
    reload = saved.get("reload")
    if reload is None:
        return "not loaded back: how it loads was not checked"
    c = reload["comparison"]
    return (f"loads with {reload['loader']} (checked: loaded back, relative error {fmt(c['relative'])})"
            + ("; plain transformers loads it with different outputs" if reload.get("plain_transformers") else "")
            + (f"; its outputs DIFFER beyond tolerance ({c['failed']}): saved with --force" if c.get("ok") is False
               else ""))


def curve_table(name: str, curve: list[dict]) -> Table:
    """A trained pass's evaluations: step, stage, what was removed, training loss, held-out CE."""
    keys = ["step", "tokens"] + [k for k in ("stage", "removed") if any(k in r for r in curve)] + ["loss", "heldout_ce"]
    rows = [[(f"{row[k]:.4f}" if isinstance(row.get(k), float) else str(row.get(k, "-")))
             if row.get(k) is not None else "-" for k in keys] for row in curve]
    return table(f"{name}: training curve (held-out CE never trained on)", [k.replace("_", " ") for k in keys],
                 rows, right=tuple(i for i, k in enumerate(keys) if k != "stage"))


def size_table(name: str, m: dict) -> Table:
    """minimize's per-layer sizes, before -> after: MLP units, heads, parameters, bytes (exact
    counts in --json)."""
    def pair(v, unit=None):
        if not v:
            return "-"
        a, b = (human(x, unit) for x in v) if unit is not None else map(str, v)
        return f"{a} -> {b}" if v[0] != v[1] else a

    rows = [(str(i), pair(w.get("mlp_units")), pair(w.get("heads")), pair(w.get("params"), ""),
             pair(w.get("bytes"), "B")) for i, w in enumerate(m["layers"])]
    rows.append(("other", "", "", pair(m["other"]["params"], ""), pair(m["other"]["bytes"], "B")))
    rows.append(("total", "", "", pair(m["params"], ""), pair(m["bytes"], "B")))
    stream = m.get("stream_width")
    return table(f"{name}: sizes per layer (residual stream {pair(stream)})",
                 ("layer", "MLP units", "heads", "parameters", "bytes"), rows, right=(3, 4))


def human(n: int, unit: str = "") -> str:
    """1234567 -> '1.23M' (parameters) or '1.23 MB' (unit 'B')."""
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{' ' if unit else ''}{prefix}{unit}"
    return f"{n}{' ' if unit else ''}{unit}"


# ---- verify ----

def verify_table(r, a, b, dtype) -> Table:
    d = "Δlogit" if r.output == "logits" else "Δh"
    rows = [("compared", r.output), (f"max |{d}|", r.max_abs), (f"mean |{d}|", r.mean_abs),
            ("relative error", r.relative), ("tolerance", r.tolerance), ("why this tolerance", r.reason)]
    rows += ([("KL(a||b)", r.kl)] + ([("KL tolerance", r.kl_tolerance)] if r.kl_tolerance is not None else [])
             + [("top-1 agreement", r.top1)] if r.output == "logits" else [("mean-pooled cosine (worst)", r.cosine)])
    if r.null is not None:
        n = r.null
        rows += [(f"rounding alone ({n['draws']} draws, worst)", f"relative {fmt(n['relative'])}"
                  + (f", KL {fmt(n['kl'])}, top-1 {fmt(n['top1'])}" if n.get("kl") is not None else ""))]
    rows += [("greedy agreement", r.generation)] if r.generation is not None else []
    rows = [(k, fmt(v)) for k, v in rows]
    notes = list(dict.fromkeys(row["note"] for row in r.layers if row["note"]))  # each said once
    for row in r.layers:
        mark = f" [{notes.index(row['note']) + 1}]" if row["note"] else ""
        rows.append((f"h_{row['state']}: {row['what']}", fmt(row["relative"]) + f" ({row['basis']}){mark}"))
    t = table(f"verify {a} vs {b} in {dtype}", ("metric", "value"), rows)
    if notes:
        t.caption = Text("\n".join(f"[{i + 1}] {n}" for i, n in enumerate(notes)), justify="left")
    return t


# ---- passes, inspect ----

def passes_table(ps) -> Table:
    """One row per pass; options one per line, never cut."""
    t = Table(title="passes", **STYLE)
    t.add_column("name", no_wrap=True)
    t.add_column("kind", no_wrap=True)
    t.add_column("what it does; where it applies", overflow="fold")
    t.add_column("options", no_wrap=True)
    for p in ps:
        t.add_row(Text(p.name), Text(p.kind), Text(f"{p.description}. Applies to: {p.families}"),
                  Text("\n".join(f"{k}={'auto' if v is None else v}" for k, v in p.options.items()) or "-"))
    return t


def inspect_tables(info: dict, src) -> list:
    rows = [(k.replace("_", " "), str(v)) for k, v in info.items() if k not in ("passes", "norm_sites", "dead")]
    rows += [(f"norm ({s['role']})", f"{s['path']} -> {', '.join(s['readers']) or '(the stream)'}")
             for s in info["norm_sites"]]
    rows += [(f"pass {name}", green("applies") if why == "applies" else why) for name, why in info["passes"].items()]
    tables = [table(f"inspect {src}", ("", ""), rows, show_header=False)]
    if info["dead"]:
        tables.append(dead_table(info["dead"]))
    return tables


def outlier_tables(r: dict, a: str, b: str | None) -> list:
    """Per residual state and per linear: max|x| / RMS and kurtosis (rows averaged), of A (and B)."""
    pairs = [r["a"]] + ([r["b"]] if r["b"] else [])
    cols = ["max/RMS", "kurtosis"] if len(pairs) == 1 else ["max/RMS A", "max/RMS B", "kurt. A", "kurt. B"]

    def cells(key, i):
        return [fmt(p[key][i][stat]) for stat in ("max_over_rms", "kurtosis") for p in pairs]

    title = f"{a}" if b is None else f"A = {a}, B = {b}"
    n = len(r["a"]["stream"])
    stream = [(f"h_{i}" + (" (final norm in)" if i == n - 1 else ""), *cells("stream", i)) for i in range(n)]
    weights = [(w["linear"], *cells("weights", i)) for i, w in enumerate(r["a"]["weights"])]
    right = tuple(range(1, len(cols) + 1))
    return [table(f"residual stream: {title} (per token, averaged)", ["state", *cols], stream, right=right),
            table("weights: per output channel, averaged", ["linear", *cols], weights, right=right)]


def dead_table(dead: dict) -> Table:
    """Per layer: dead MLP units, dead and removable heads, channels its writers leave zero."""
    rows = [(str(d["layer"]), f"{len(d['dead_units'])}/{d['mlp_units']}", f"{len(d['dead_heads'])}/{d['heads']}",
             str(len(d["removable_heads"])), f"{len(d['removable_kv_heads'])}/{d['kv_heads']}",
             str(len(d["unwritten_channels"]))) for d in dead["layers"]]
    return table(f"dead units (stream: {dead['width']} channels, {len(dead['dead_channels'])} unwritten, "
                 f"{len(dead['removable_channels'])} removable)",
                 ("layer", "MLP units\ndead", "heads\ndead", "heads\nremovable", "KV heads\nremovable",
                  "channels\nunwritten"), rows)  # two-line headers: the table fits 80 columns


# ---- prune, heal ----

def score_table(selection, scores) -> Table:
    """Candidates with their scores as bars; the removed ones marked."""
    what = ("block influence 1 - cos(x_in, x_out)" if selection.method == "block-influence"
            else "angular distance arccos(cos(x_l, x_l+n)) / pi")
    top = max(selection.scores) or 1.0
    rows = []
    for i, (c, s) in enumerate(zip(selection.candidates, selection.scores)):
        mark = i in selection.chosen
        bar = "█" * max(1, round(30 * s / top)) if s > 0 else ""
        rows.append((c, f"{s:.4f}", red(bar) if mark else bar, "yes" if mark else ""))
    return table(f"{selection.method}: {what} over {scores.tokens} tokens (smaller = more removable)",
                 ("layer" if selection.method == "block-influence" else "block", "score", "", "removed"),
                 rows, right=(1,))


def ce_table(title: str, ce: dict[str, float], recovered: dict | None = None, other: dict | None = None,
             record: dict | None = None) -> Table:
    """Cross-entropy of each model on the held-out end of the text (``ce``) and, given
    (``other``), on --eval-text; and the share of the gap healing closed on each
    (``heal.recovery``), marked where it is adaptation to the text rather than recovery. Where the
    ``record`` holds KL(teacher || model) (a heal with a teacher), a KL column beside each CE, the
    teacher (the original) at 0, and the share of the KL closed."""
    rec, record = recovered or {}, record or {}
    kls = [(k, record.get(k)) for k, ran in (("heldout_kl", True), ("eval_text_kl", other is not None)) if ran]
    with_kl = any(kl for _, kl in kls)

    def share(key: str) -> str:
        x = rec.get(key)
        return "-" if x is None else f"{100 * x:.1f}%" + (" (adaptation)" if key == "heldout" and x > 1 else "")

    def cells(name: str, values: list) -> list:
        return [c for v, (_, kl) in zip(values, kls) for c in
                [fmt_ce(v), *([fmt_ce((kl or {}).get(name))] if with_kl else [])]]

    on = ["held-out end of the text"] + (["--eval-text"] if other is not None else [])
    columns = ("model", *[c for w in on for c in ([f"{w.split(' end')[0]}\nCE", f"{w.split(' end')[0]}\nKL"]
                                                  if with_kl else [w])])
    if other is None and not with_kl:
        columns = ("model", "CE (nats/token)")
    body = [(name, *cells(name, [v, *([other.get(name)] if other is not None else [])])) for name, v in ce.items()]
    if any(rec.get(k) is not None for k in ("heldout", "eval_text", "kl_heldout", "kl_eval_text")):
        keys = [("heldout", "kl_heldout"), ("eval_text", "kl_eval_text")][:len(kls)]
        body.append(("gap recovered by healing", *[c for ce_key, kl_key in keys for c in
                                                   [share(ce_key), *([share(kl_key)] if with_kl else [])]]))
    return table(title, columns, body, right=tuple(range(1, len(columns))))



def fmt_ce(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def heal_line(report, seconds: float | None = None) -> str:
    """Steps, throughput, what trained (--train) and (given the whole heal's wall time) the share spent
    evaluating CE before and after (held-out and training windows)."""
    share = ""
    if seconds:
        share = (f"; evaluation {max(seconds - report.seconds, 0.0):.1f} s of {seconds:.1f} s "
                 f"({100 * max(seconds - report.seconds, 0.0) / seconds:.0f}%, --eval-samples sets its size)")
    precision = "fp32" if report.mixed_precision == "no" else report.mixed_precision  # the --precision spelling
    what = {"lora": f"LoRA rank {report.rank} on {report.target_modules} linears",
            "norms": f"norms only ({report.target_modules} norms)", "full": "every parameter"}[report.train]
    return (f"healed: {report.steps} steps, {report.tokens} tokens in {report.seconds:.1f} s "
            f"({report.tokens_per_second:.0f} tokens/s, {how_trained(report.processes, report.sharded)}, precision "
            f"{precision}); {what}, "
            f"{report.trainable_parameters} trainable parameters; {objective_words(report)}{share}")


def objective_words(report) -> str:
    """What healing minimised and why: "objective kd (KL to the teacher X at T 1): the default where ..."."""
    o, why = getattr(report, "objective", "ce"), getattr(report, "why", None)
    what = {"kd": "KL to the teacher", "ce": "cross-entropy on the text"}.get(o) or \
        f"KL to the teacher + {report.ce_weight:g} x cross-entropy"
    at = f" at T {report.temperature:g}" if o != "ce" else ""
    return f"objective {o} ({what}{at})" + (f": {why}" if why else "")


def how_trained(processes: int, sharded: bool) -> str:
    """How the training ran: "1 process", "data-parallel over N processes" (each holding the whole
    training state) or "sharded (FSDP2) over N processes" (``sharded``: as the training reports it)."""
    if processes <= 1:
        return "1 process"
    return f"{'sharded (FSDP2)' if sharded else 'data-parallel'} over {processes} processes"


OVERFIT_EPOCHS = 4


def heal_warning(report) -> str | None:
    """One line when healing raised held-out CE, naming the cause measured (``HealReport.cause``)."""
    cause = report.cause
    if cause is None:
        return None
    what, before, after = report.rose
    trained = (f"CE on the training text {'fell' if report.train_ce_after < report.train_ce_before else 'rose'} "
               f"{report.train_ce_before:.4f} -> {report.train_ce_after:.4f}")
    if cause == "overfit":
        return (f"warning: healing over-fit its text: {what} rose {before:.4f} -> {after:.4f} while {trained} "
                f"({report.epochs:.1f} readings of it); give more (or more varied) text, fewer --steps, or --patience")
    why = ("as well" if report.train_ce_after >= report.train_ce_before else
           f"after {report.epochs:.2f} of one reading of the text, too little to over-fit it")
    return (f"warning: healing raised {what} {before:.4f} -> {after:.4f} and {trained} {why}: the learning rate "
            f"{report.lr:g} is too high for --train {report.train}; give a lower --lr")


def overfit_note(report) -> str | None:
    if report.epochs <= OVERFIT_EPOCHS:
        return None
    return (f"note: healing read the training text {report.epochs:.0f} times over "
            f"({report.tokens} tokens from {round(report.tokens / report.epochs)}): held-out CE may "
            "suffer from overfitting; give more text or fewer --steps")


@contextmanager
def plotting(path: Path | None, force: bool, out: Path):
    """``--plot PATH`` claimed for the block as any output is (``runner.file_output``: locked; refused
    before any work where it would replace a file normsurgery did not write, ``ours.PLOT``, or one it
    did without ``force``); yields ``draw(figure)`` (None without ``path``): the figure saved into the
    claim's stage with our mark (``ours.MARK``), then moved into place in one rename (``output.staged``:
    nothing left on a failure)."""
    if path is None:
        yield None
        return
    from ..core.errors import SurgeryError
    from ..engine.runner import file_output
    from ..io import output
    from ..io.ours import MARK, PLOT

    if Path(path).expanduser().resolve() == Path(out).expanduser().resolve():
        raise SurgeryError(f"--plot {path} is the output itself; name another file")
    with file_output(path, force, PLOT) as claim:
        def draw(fig) -> None:
            import matplotlib.pyplot as plt

            try:
                with output.staged(claim.path) as stage:
                    fig.savefig(stage.path / claim.path.name, dpi=120, format="png", metadata={"Software": MARK})
            finally:
                plt.close(fig)

        yield draw


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_scores(selection, scores):
    """The figure of prune's scores. Left: the chosen method's candidate scores (removed in red).
    Right: d(l, n) for every start l and block size n, the chosen block marked."""
    plt = _pyplot()
    L = scores.num_layers
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colours = ["tab:red" if i in selection.chosen else "tab:blue" for i in range(len(selection.candidates))]
    a.bar(range(len(selection.scores)), selection.scores, color=colours)
    a.set_xticks(range(len(selection.candidates)), selection.candidates, rotation=45 if L > 12 else 0)
    a.set_xlabel("layer" if selection.method == "block-influence" else f"block of {selection.n}")
    a.set_ylabel("1 - cos" if selection.method == "block-influence" else "angular distance / pi")
    a.set_title(f"{selection.method}: removed {', '.join(map(str, selection.layers))}")
    grid = [[float(scores.angular[l, l + n]) if l + n <= L else float("nan") for l in range(L)]
            for n in range(1, L)]
    im = b.imshow(grid, origin="lower", aspect="auto", cmap="viridis",
                  extent=(-0.5, L - 0.5, 0.5, L - 0.5))
    if selection.method != "block-influence":
        b.scatter([selection.layers[0]], [selection.n], marker="x", color="red", s=80)
    b.set_xlabel("first layer l")
    b.set_ylabel("block size n")
    b.set_title("angular distance d(l, n)")
    fig.colorbar(im, ax=b)
    fig.tight_layout()
    return fig


# ---- squeeze ----

def squeeze_table(result) -> Table:
    """One row per cycle: size reached, minimize's check, zeros released, held-out CE after
    minimize and after retraining (row 0: the input)."""
    o = result.original
    rows = [("0 (input)", "", human(o["params"]), human(o["bytes"], "B"), "", "", "", f"{o['ce']:.4f}")]
    for c in result.cycles:
        units, heads = f"{c.fraction:.2f}", f"{c.heads_fraction:.2f}"
        masked = units if heads == units else f"{units}/{heads}"
        rows.append((str(c.cycle), masked, human(c.params), human(c.bytes, "B"),
                     fmt(c.minimize_relative), human(c.released), f"{c.ce_masked:.4f}", f"{c.ce_after:.4f}"))
    if result.control:
        c = result.control
        rows.append(("one-shot", f"{c.fraction:.2f}", human(c.params), human(c.bytes, "B"), fmt(c.minimize_relative),
                     human(c.released), f"{c.ce_masked:.4f}", f"{c.ce_after:.4f}"))
    t = table("squeeze: one row per cycle (held-out CE never trained on)",
              ("cycle", "masked", "params", "bytes", "min. err", "released", "CE min.", "CE after"), rows,
              right=tuple(range(1, 8)))
    t.caption = Text("masked: the fraction of each structure masked (a/b: a of the MLP units and channels, b of the "
                     "KV-head groups, where they differ); "
                     "min. err: minimize's relative error against the masked model; released: zeros given back "
                     "to training; CE min.: once minimized, before retraining"
                     + ("; one-shot: the control, the input masked to the target at once and retrained with "
                        "the cycles' steps" if result.control else ""))
    return t


def plot_squeeze(result):
    """The figure of squeeze's held-out CE against parameters: each cycle's minimized model (before
    retraining) and retrained model, the original marked."""
    plt = _pyplot()
    o = result.original
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [o["params"]] + [c.params for c in result.cycles]
    ax.plot(xs, [o["ce"]] + [c.ce_after for c in result.cycles], "o-", label="after retraining")
    ax.plot([c.params for c in result.cycles], [c.ce_masked for c in result.cycles], "x", color="tab:red",
            label="minimized, before retraining")
    for c in result.cycles:
        ax.annotate(str(c.cycle), (c.params, c.ce_after), textcoords="offset points", xytext=(4, 4))
    ax.axhline(o["ce"], color="grey", lw=0.8, ls="--", label="original")
    ax.invert_xaxis()
    ax.set_xlabel("parameters")
    ax.set_ylabel("held-out CE (nats/token)")
    ax.set_title("squeeze: size vs held-out CE per cycle")
    ax.legend()
    fig.tight_layout()
    return fig
