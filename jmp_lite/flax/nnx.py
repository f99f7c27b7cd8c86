"""Kept so that imports from this module path keep working; use ``jmp_lite.flax.<name>``."""

from jmp_lite.flax._nnx import PolicyModule, policy_view

__all__ = ["PolicyModule", "policy_view"]
