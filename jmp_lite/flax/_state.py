"""What the Flax training states share (private)."""

from __future__ import annotations

from typing import Any

from jmp_lite._transform import get_loss_scaling_state


def has_loss_scaling(opt_state: Any) -> bool:
  """Whether ``opt_state`` holds a :class:`jmp_lite.LossScalingState`."""
  try:
    get_loss_scaling_state(opt_state)
  except ValueError:
    return False
  return True
