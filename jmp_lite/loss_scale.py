"""Kept so that imports from ``jmp_lite.loss_scale`` keep working; use ``jmp_lite.<name>``."""

from jmp_lite._loss_scale import (
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  StaticLossScale,
  all_finite,
  select_tree,
)

__all__ = [
  "DynamicLossScale",
  "LossScale",
  "NoOpLossScale",
  "StaticLossScale",
  "all_finite",
  "select_tree",
]
