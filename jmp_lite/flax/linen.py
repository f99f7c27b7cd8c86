"""Kept so that imports from ``jmp_lite.flax.linen`` keep working: the
implementation is private (``jmp_lite.flax._linen``); use ``jmp_lite.flax.<name>``.
"""

from jmp_lite.flax._linen import (
  policy_apply as policy_apply,
)
from jmp_lite.flax._linen import (
  policy_init as policy_init,
)
