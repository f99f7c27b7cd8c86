"""Kept so that imports from ``jmp_lite.flax.train_state`` keep working: the
implementation is private (``jmp_lite.flax._train_state``); use ``jmp_lite.flax.<name>``.
"""

from jmp_lite.flax._train_state import (
  TrainState as TrainState,
)
