"""The ground floor: plain data and decisions made once, importing no other floor. The data types
(layout), the family table and its adapters, the registry of passes, every command's options,
the one decision of where work runs (devices), pure tensor functions (algebra, norms, rotation,
masks, analysis), the parity and precision judgements, memory estimates and errors.

A floor imports only the floors below it (tests/test_architecture.py)."""
