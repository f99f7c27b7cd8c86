"""Kept so that imports from ``jmp_lite.flax.accumulate`` keep working: the
implementation is private (``jmp_lite.flax._accumulate``); use ``jmp_lite.flax.<name>``.
"""

from jmp_lite.flax._accumulate import (
  conv_general_dilated as conv_general_dilated,
)
from jmp_lite.flax._accumulate import (
  dot_general as dot_general,
)
from jmp_lite.flax._accumulate import (
  einsum as einsum,
)
