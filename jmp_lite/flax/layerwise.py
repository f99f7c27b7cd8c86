"""Kept so that imports from ``jmp_lite.flax.layerwise`` keep working: the
implementation is private (``jmp_lite.flax._layerwise``); use ``jmp_lite.flax.<name>``.
"""

from jmp_lite.flax._layerwise import (
  LayerwiseStages as LayerwiseStages,
)
from jmp_lite.flax._layerwise import (
  layerwise_stages as layerwise_stages,
)
