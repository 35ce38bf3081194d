import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one torch thread unless told otherwise: the suite's small models gain little from two, and two
# spinning threads collapse when anything else holds a core (normsurgery/threads.py)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
