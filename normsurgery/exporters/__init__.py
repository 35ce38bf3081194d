"""Formats other runtimes read, above the engine: each a writer plus a check of the written file in
its own runtime (ONNX Runtime, llama.cpp through xllamacpp, MLX-LM for nemotron-nas folders).

A floor imports only the floors below it (tests/test_architecture.py)."""

#: what a GGUF output is, said where it names a folder (``output.check_file``)
GGUF_FILE = "GGUF is one file (name it OUT.gguf)"
