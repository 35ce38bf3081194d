"""Files, above core only: safetensors shards (headers, reader, writer), checkpoints (resolved
once: source; where each tensor lies: stored; read with the right head: loader; configs and
records: checkpoint), the atomic locked output folder, the stash (tensors set aside on disk while
training needs the memory), texts and model cards.

A floor imports only the floors below it (tests/test_architecture.py)."""
