"""What normsurgery wrote, as it can show it: ``--force`` replaces only that (``output.check_output``,
``output.check_file``), never a file of the user's.

- a model card (README.md, or ``NAME.md`` beside a file): its YAML header tags it ``normsurgery``
  (:func:`our_card`; ``modelcard.header`` writes the tag);
- a file output, by its kind (:class:`FileKind`): its first bytes are the format's magic, and it
  carries our mark. A GGUF file (:data:`GGUF`): ``GGUF`` and its card beside it (``NAME.gguf.md``)
  ours; a plot (:data:`PLOT`): PNG's signature and a ``Software`` text chunk reading :data:`MARK`
  before the image data (``savefig(metadata={"Software": MARK})``, :func:`png_marked`).

A file of the right magic without our mark (a GGUF file converted elsewhere, a PNG drawn by hand)
is the user's, and kept.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

#: the line in the YAML header of every card normsurgery writes (its tags)
CARD_TAG = "- normsurgery"
#: the ``Software`` text of every PNG normsurgery writes
MARK = "normsurgery"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def our_card(card: Path) -> bool:
    """Whether ``card`` is a model card normsurgery wrote: its YAML header tags it ``normsurgery``."""
    try:
        text = Path(card).read_text()
    except (OSError, UnicodeDecodeError):
        return False
    head, sep, _ = text.removeprefix("---\n").partition("\n---\n")
    return text.startswith("---\n") and bool(sep) and CARD_TAG in head.splitlines()


def card_of(path: Path) -> Path:
    """The card written beside the file ``path``: ``NAME.md``."""
    return path.with_name(f"{path.name}.md")


def png_marked(path: Path) -> bool:
    """Whether the PNG ``path`` holds a ``tEXt`` chunk ``Software`` = :data:`MARK` before its image
    data (chunks: 4-byte big-endian length, 4-byte type, data, 4-byte CRC)."""
    try:
        with open(path, "rb") as f:
            f.seek(len(PNG_SIGNATURE))
            while len(head := f.read(8)) == 8:
                length, kind = struct.unpack(">I4s", head)
                if kind == b"IDAT":
                    return False
                data = f.read(length)
                if kind == b"tEXt" and data.partition(b"\0")[::2] == (b"Software", MARK.encode()):
                    return True
                f.seek(4, 1)
    except OSError:
        return False
    return False


@dataclass(frozen=True)
class FileKind:
    """A file output: what it is, for the refusals; the bytes it starts with; whether its card is
    written beside it (:func:`card_of`); whether a file of that magic carries our mark, and what
    a refusal says when it does not."""

    name: str  # "a GGUF file"
    what: str  # said when OUT names a folder
    magic: bytes
    card: bool
    marked: Callable[[Path], bool]
    unmarked: str

    def paths(self, out: Path) -> list[Path]:
        """The files writing ``out`` puts in place: ``out`` and, with a card, its card."""
        return [out, card_of(out)] if self.card else [out]

    def not_ours(self, out: Path) -> tuple[Path, str] | None:
        """The first file that writing ``out`` would replace (``out``, then its card) and that is not
        ours, with why; None when each is ours or absent."""
        if out.exists() or out.is_symlink():
            try:
                with open(out, "rb") as f:
                    head = f.read(len(self.magic))
            except OSError as e:
                return out, f"cannot be read ({e.strerror or e})"
            if head != self.magic:
                return out, f"is not {self.name}"
            if not self.marked(out):
                return out, f"is {self.name} normsurgery did not write ({self.unmarked})"
        card = card_of(out)
        if self.card and (card.exists() or card.is_symlink()) and not our_card(card):
            return card, "is not a card normsurgery wrote"
        return None


GGUF = FileKind("a GGUF file", "GGUF is one file (name it OUT.gguf)", b"GGUF", True,
                lambda path: our_card(card_of(path)), "no card of normsurgery's beside it")
PLOT = FileKind("a PNG plot", "a plot is one PNG file (name it PLOT.png)", PNG_SIGNATURE, False, png_marked,
                f"no Software text '{MARK}' in it")
