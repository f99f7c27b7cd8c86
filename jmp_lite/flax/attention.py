"""Kept so that imports from this module path keep working; use ``jmp_lite.flax.<name>``."""

from jmp_lite.flax._attention import dot_product_attention, softmax

__all__ = ["dot_product_attention", "softmax"]
