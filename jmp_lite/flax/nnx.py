"""Kept so that imports from ``jmp_lite.flax.nnx`` keep working: the
implementation is private (``jmp_lite.flax._nnx``); use ``jmp_lite.flax.<name>``.
"""

from jmp_lite.flax._nnx import (
  PolicyModule as PolicyModule,
)
from jmp_lite.flax._nnx import (
  policy_view as policy_view,
)
