"""Kept so that imports from ``jmp_lite.transform`` keep working: the
implementation is private (``jmp_lite._transform``); use ``jmp_lite.<name>``.
"""

from jmp_lite._transform import (
  LossScalingState as LossScalingState,
)
from jmp_lite._transform import (
  get_loss_scale as get_loss_scale,
)
from jmp_lite._transform import (
  get_loss_scaling_state as get_loss_scaling_state,
)
from jmp_lite._transform import (
  loss_scaling as loss_scaling,
)
from jmp_lite._transform import (
  scaled_value_and_grad as scaled_value_and_grad,
)
