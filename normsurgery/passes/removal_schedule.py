"""remove-ln's schedule: the order of the removals and the step each happens at.

An event is ``(step, stage, removal)``, ``removal`` a list of (norm index, path index): each block's
MLP path in turn, then the q/k (or fused attention) paths, then the v paths, then the final norm,
then position 0's special case (an empty list). The order never changes; the steps do:

- fixed gaps (``wait=0``, the default): the first removal at ``start``, each next one ``gap`` steps
  later, the final norm and position 0 ``final_gap`` after the one before;
- waiting for recovery (``wait=M`` nats): the first removal at ``start``; each next one at the
  first check (every ``gap`` steps after the previous removal) where the held-out CE is back within
  M of its level just before the previous removal, and at the latest at the previous step plus
  its fair share of the steps left until the deadline (2/3 of the steps, over the removals left):
  a quick recovery leaves its steps to the removals after it.

Defaults: start after the warm-up (steps // 10); the fixed gap spreads the removals over the
first half of the steps, the final norm and position 0 twice as far apart; waiting checks every
half of that gap.
"""

from __future__ import annotations

from typing import Callable

from ..core.errors import SurgeryError

STAGES = ("mlp", "qk", "v")  # the block stages, in order; then "final", then "position 0"


def auto(n_removals: int, steps: int, start: int | None, gap: int | None, final_gap: int | None,
         wait: float = 0.0) -> tuple[int, int, int]:
    """(start, gap, final_gap) with the defaults filled in where not given (None)."""
    start = steps // 10 if start is None else start
    if gap is None:
        gap = max(1, (steps // 2 - start) // (n_removals + 2))
        gap = max(1, gap // 2) if wait > 0 else gap
    final_gap = 2 * gap if final_gap is None else final_gap
    return start, gap, final_gap


def deadline(steps: int) -> int:
    """Waiting: the step by which every removal has happened."""
    return 2 * steps // 3


def events(paths: list[list[str]], start: int, gap: int, final_gap: int) -> list:
    """The fixed schedule's events for norms with these paths (in layout order); waiting keeps their
    order and stage and decides the steps as it runs."""
    groups: dict[str, list[list[tuple[int, int]]]] = {k: [] for k in (*STAGES, "final")}
    for i, names in enumerate(paths):
        for p, name in enumerate(names):
            groups["qk" if name == "attn" else name].append([(i, p)])
    out, step = [], start
    for stage in STAGES:
        for removal in groups[stage]:
            out.append((step, stage, removal))
            step += gap
    if groups["final"]:
        step += final_gap - gap
        out.append((step, "final", groups["final"][0]))
        step += final_gap
    out.append((step, "position 0", []))
    return out


def fits(evts: list, steps: int, wait: float, gap: int) -> bool:
    """Whether the removals fit in ``steps``: the last event before the last step (fixed), or,
    waiting, the first removal's step plus the least gaps for the rest within the deadline."""
    if wait <= 0:
        return evts[-1][0] < steps
    return evts[0][0] + (len(evts) - 1) * gap <= deadline(steps)


def plan(paths: list[list[str]], options: dict) -> tuple[int, int, int, list]:
    """(start, gap, final_gap, events) for ``options`` (the pass's), refused in one line when the
    steps are too few; the smallest budget that fits is named."""
    wait = float(options.get("wait", 0.0))
    if wait > 0 and options["final_gap"] is not None:
        raise SurgeryError("remove-ln: final_gap spaces the fixed schedule; with wait the final norm waits for "
                           "recovery like every removal (gap: how often it checks)")
    n = sum(len(p) for p in paths) + 1
    start, gap, final_gap = auto(n, options["steps"], options["start"], options["gap"], options["final_gap"], wait)
    evts = events(paths, start, gap, final_gap)
    if not fits(evts, options["steps"], wait, gap):
        raise SurgeryError(too_few(evts, options, paths))
    return start, gap, final_gap, evts


def too_few(evts: list, options: dict, paths: list[list[str]]) -> str:
    """Why ``options["steps"]`` are too few, with the smallest number of steps that fits (start,
    gap and final_gap as given, chosen from the steps where not given)."""
    steps, wait, o = options["steps"], float(options.get("wait", 0.0)), options
    start, gap, final_gap = evts[0][0], *auto(len(evts), steps, o["start"], o["gap"], o["final_gap"], wait)[1:]
    least = evts[0][0] + (len(evts) - 1) * gap
    text = (f"remove-ln: the schedule needs {evts[-1][0] + 1} steps (start {start}, gap {gap}, final gap "
            f"{final_gap} for {len(evts)} removals) but steps={steps}" if wait <= 0 else
            f"remove-ln: waiting for recovery, {len(evts)} removals at least {gap} steps apart from step {start} "
            f"end at step {least} at the earliest, past the deadline at 2/3 of steps={steps} (step {deadline(steps)})")
    for more in range(steps + 1, 100 * (max(least, evts[-1][0]) + 2)):
        s, g, f = auto(len(evts), more, o["start"], o["gap"], o["final_gap"], wait)
        if fits(events(paths, s, g, f), more, wait, g):
            fixed = [k for k in ("start", "gap", "final_gap") if o[k] is not None]
            above = [k for k in fixed if o[k] > (0 if k == "start" else 1)]
            return (text + f"; the smallest budget that fits is steps={more}"
                    + (f" with {', '.join(f'{k}={o[k]}' for k in fixed)} as given" if fixed else
                       " (start and gaps chosen from the steps)")
                    + (f"; a smaller {' or '.join(above)} needs fewer" if above else ""))
    return text


def due(step: int, start: int, previous: tuple[int, float] | None, left: int, gap: int, until: int,
        margin: float, ce: Callable[[], float]) -> bool:
    """Waiting: whether the next removal happens at ``step``. ``previous``: the step of the removal
    before and the held-out CE just before it (None: none yet, the first is due at ``start``);
    ``left``: the removals not made yet, this one included; ``until``: the deadline; ``ce()``: the
    held-out CE now, measured only on a check step."""
    if previous is None:
        return step >= start
    at, level = previous
    since = step - at
    if since < gap:
        return False
    if since >= max(gap, (until - at) // left):
        return True
    return since % gap == 0 and ce() <= level + margin


def stages_run(evts: list, curve: list[dict], steps: int) -> list[dict]:
    """The schedule as it ran: each stage in order ("live" first: every norm still computing) with
    the steps it held, [from, to], and the held-out CE at its last evaluation (``evts``: the events
    made, at the steps they were made; ``curve``: the training's evaluations, each labelled with
    the stage of its step; ``steps``: how many ran)."""
    starts = {"live": 0}
    for step, stage, _ in evts:
        starts.setdefault(stage, step)
    order = [s for s in starts if starts[s] < steps]
    out = []
    for i, stage in enumerate(order):
        end = starts[order[i + 1]] - 1 if i + 1 < len(order) else steps
        ces = [row["heldout_ce"] for row in curve[1:] if row.get("stage", "live") == stage]
        out.append({"stage": stage, "from": starts[stage], "to": end, "heldout_ce": ces[-1] if ces else None})
    return out
