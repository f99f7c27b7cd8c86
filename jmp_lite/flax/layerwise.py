"""Kept so that imports from this module path keep working; use ``jmp_lite.flax.<name>``."""

from jmp_lite.flax._layerwise import LayerwiseStages, layerwise_stages

__all__ = ["LayerwiseStages", "layerwise_stages"]
