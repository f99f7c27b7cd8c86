"""Kept so that imports from ``jmp_lite.flax.optimizer`` keep working: the
implementation is private (``jmp_lite.flax._optimizer``); use ``jmp_lite.flax.<name>``.
"""

from jmp_lite.flax._optimizer import (
  Optimizer as Optimizer,
)
