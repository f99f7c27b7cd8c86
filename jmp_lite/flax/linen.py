"""Kept so that imports from this module path keep working; use ``jmp_lite.flax.<name>``."""

from jmp_lite.flax._linen import policy_apply, policy_init

__all__ = ["policy_apply", "policy_init"]
