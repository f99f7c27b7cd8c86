"""Kept so that imports from this module path keep working; use ``jmp_lite.flax.<name>``."""

from jmp_lite.flax._accumulate import conv_general_dilated, dot_general, einsum, is_16bit_float

__all__ = ["conv_general_dilated", "dot_general", "einsum", "is_16bit_float"]
