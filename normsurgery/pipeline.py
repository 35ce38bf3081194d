"""The executor's map: it is split by job into

- ``plan``: the parts a model is cut into and the rewrite steps (``Part``, ``plan``, ``StepSpec``,
  ``steps_of``, what is refused before reading);
- ``scan``: a step on a part, and the whole-model facts its stages gather first;
- ``sweep``: the one executor over parts (``Work``: read, apply, forward, free), the change
  tracking and the forwards' meter;
- ``writer``: each part written to the output shards, the folder finished and checked
  (``save_work``, ``save``);
- ``check``: the reference, the tolerances and the written folder read back (``Tolerances``,
  ``check_written``, the readers).

Nothing is defined here: ``Loader`` is named for tests/test_remove_ln.py, which patches
``pipeline.Loader.load`` (the class ``checkpoint.Loader`` itself); import from the modules above.
"""

from .checkpoint import Loader  # noqa: F401
