"""How work runs, above core, io and passes: the plan (parts of a model), scans and sweeps (streamed
reads and forwards), the checks of each step and of the written folder, the writer, the runner
(source resolved once, output claimed once, load, work, save) and the one training loop.

A floor imports only the floors below it (tests/test_architecture.py)."""
