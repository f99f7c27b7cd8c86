"""Kept so that imports from ``jmp_lite.policy`` keep working; use ``jmp_lite.<name>``."""

from jmp_lite._policy import Policy, cast_to_full, cast_to_half, get_policy

__all__ = ["Policy", "cast_to_full", "cast_to_half", "get_policy"]
