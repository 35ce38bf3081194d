"""Files, above core only: safetensors shards (headers, reader, writer), checkpoints (validate, load
with the right head, save), the atomic locked output folder, the stash (tensors set aside on disk
while training needs the memory), texts and model cards.

A floor imports only the floors below it (tests/test_architecture.py)."""
