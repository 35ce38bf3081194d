import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one torch thread unless told otherwise: the suite's small models gain little from two, and two
# spinning threads collapse when anything else holds a core (normsurgery/core/threads.py)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402


def apart_runner():
    """A CliRunner whose ``stdout`` holds the command's stdout alone (tables, JSON), its warnings
    and errors in ``stderr``: click < 8.2 mixes stderr into stdout unless told not to; 8.2 keeps
    them apart and has no such option. ``output`` then holds stdout only under click < 8.2."""
    from typer.testing import CliRunner

    try:
        return CliRunner(mix_stderr=False)
    except TypeError:
        return CliRunner()


def assert_refused(result, out=None, match: str = "", code: int = 1, kept: bool = False) -> None:
    """A CLI refusal (``result``: typer's CliRunner result): exit ``code``, one line of output, an
    ``error:`` line holding ``match``, no traceback; and, given ``out``, nothing left there: no
    folder (unless ``kept``: the user's own, which the refusal keeps) and no temporary sibling.
    The one such check of the suite (``from conftest import assert_refused``)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert match in lines[0], result.output
    assert "Traceback" not in result.output and "internal error" not in result.output, result.output
    if out is not None:
        out = Path(out)
        assert kept or not out.exists(), f"{out} was left behind"
        assert not list(out.parent.glob(f".{out.name}.*")), f"a temporary folder beside {out} was left behind"


def causal_ce(model, windows) -> float:
    """A causal LM's mean next-token cross-entropy (nats) on ``windows`` [n, T], computed here, by
    hand, as an oracle for the implementation's held-out CE."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        logits = model.eval()(input_ids=windows).logits.double()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()


#: a run of digits: tokens the bundled sample never holds, put at the end of a text as a marker of its held-out part
DIGITS = " 0123456789" * 40


def marked_text(body: str, tokenizer, fraction: float = 0.1):
    """``body`` followed by :data:`DIGITS`, which fall inside the text's last ``fraction`` of tokens
    (the part held out): (text, its token ids, the marker's token ids found nowhere in ``body``, the
    first position held out), all computed here from the tokenizer alone."""
    text = body + DIGITS
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    marks = set(tokenizer(DIGITS, add_special_tokens=False).input_ids) - \
        set(tokenizer(body, add_special_tokens=False).input_ids)
    first = len(ids) - int(fraction * len(ids))
    at = [i for i, t in enumerate(ids.tolist()) if t in marks]
    assert marks and at and min(at) > first, "the marker must lie inside the held-out end"
    return text, ids, marks, first


def record_reads(monkeypatch) -> dict:
    """What each reader of the text gets, recorded as [n, T] token windows: prune's layer scores
    ("scores"), the training batches ("batches"), CE on the training text's windows that heal
    measures ("training CE", :func:`normsurgery.commands.heal.run`: CE and KL, ``training.heldout``), and held-out
    CE ("held-out": prune's, and the training loop's before and after)."""
    import importlib

    heal, prune, training = (importlib.import_module(f"normsurgery.{m}")
                             for m in ("commands.heal", "commands.prune", "engine.training"))

    reads = {"scores": [], "batches": [], "training CE": [], "held-out": []}

    def spy(module, name, key, pick):
        real = getattr(module, name)

        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            reads[key].append(pick(args, out))
            return out
        monkeypatch.setattr(module, name, wrapped)

    spy(prune, "score_layers", "scores", lambda args, out: args[1])
    spy(training, "_batch", "batches", lambda args, out: out[0])
    spy(heal, "heldout", "training CE", lambda args, out: args[1])
    spy(training, "heldout", "held-out", lambda args, out: args[1])  # prune's heldout_ce computes with it
    return reads


def window_starts(ids, windows) -> list[int]:
    """Where each of ``windows`` [n, T] starts in the token stream ``ids`` (each must occur in it)."""
    import torch

    slides = ids.unfold(0, windows.shape[1], 1)
    starts = []
    for w in windows:
        found = torch.nonzero((slides == w).all(-1)).flatten().tolist()
        assert found, "a window that is no slice of the text"
        starts.append(found[0])
    return starts
