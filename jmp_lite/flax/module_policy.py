"""Kept so that imports from this module path keep working; use ``jmp_lite.flax.<name>``."""

from jmp_lite.flax import (
  DEFAULT_OVERRIDES,
  FLAX_HOOKS,
  FP32,
  FP32_RECOMPUTED,
  ExplicitDtypeWarning,
  ModulePolicies,
  ModulePolicy,
)

__all__ = [
  "DEFAULT_OVERRIDES",
  "FLAX_HOOKS",
  "FP32",
  "FP32_RECOMPUTED",
  "ExplicitDtypeWarning",
  "ModulePolicies",
  "ModulePolicy",
]
