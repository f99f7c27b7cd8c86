"""Kept so that imports from ``jmp_lite.transform`` keep working; use ``jmp_lite.<name>``."""

from jmp_lite._transform import (
  LossScalingState,
  get_loss_scale,
  get_loss_scaling_state,
  loss_scaling,
  scaled_value_and_grad,
)

__all__ = [
  "LossScalingState",
  "get_loss_scale",
  "get_loss_scaling_state",
  "loss_scaling",
  "scaled_value_and_grad",
]
