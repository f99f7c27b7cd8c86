"""Kept so that imports from ``jmp_lite.flax.attention`` keep working: the
implementation is private (``jmp_lite.flax._attention``); use ``jmp_lite.flax.<name>``.
"""

from jmp_lite.flax._attention import (
  dot_product_attention as dot_product_attention,
)
from jmp_lite.flax._attention import (
  softmax as softmax,
)
