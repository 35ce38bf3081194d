import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one torch thread unless told otherwise: the suite's small models gain little from two, and two
# spinning threads collapse when anything else holds a core (normsurgery/threads.py)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402


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
