"""Kept so that imports from this module path keep working; use ``jmp_lite.flax.<name>``."""

from jmp_lite.flax._optimizer import Optimizer

__all__ = ["Optimizer"]
