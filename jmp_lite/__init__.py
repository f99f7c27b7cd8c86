"""jmp_lite: mixed precision training for JAX, Flax and Optax.

A drop-in replacement for DeepMind's jmp (``import jmp_lite as jmp``) with its
bugs fixed, plus Optax loss-scaling transformations, layer-wise adaptive loss
scaling and Flax integration.
"""

from jmp_lite.dtypes import FORMATS, FormatInfo, format_info, half_dtype, parse_dtype
from jmp_lite.layerwise import (
  BoundaryStats,
  LayerwiseGrads,
  LayerwiseLossScale,
  StackedStages,
  stage_boundary,
  stages_from_paths,
)
from jmp_lite.loss_scale import (
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  StaticLossScale,
  all_finite,
  select_tree,
)
from jmp_lite.policy import Policy, cast_to_full, cast_to_half, get_policy
from jmp_lite.transform import (
  LossScalingState,
  get_loss_scale,
  get_loss_scaling_state,
  loss_scaling,
  scaled_value_and_grad,
)

__version__ = "0.1.0"

__all__ = (
  "FORMATS",
  "BoundaryStats",
  "DynamicLossScale",
  "FormatInfo",
  "LayerwiseGrads",
  "LayerwiseLossScale",
  "LossScale",
  "LossScalingState",
  "NoOpLossScale",
  "Policy",
  "StackedStages",
  "StaticLossScale",
  "all_finite",
  "cast_to_full",
  "cast_to_half",
  "format_info",
  "get_loss_scale",
  "get_loss_scaling_state",
  "get_policy",
  "half_dtype",
  "loss_scaling",
  "parse_dtype",
  "scaled_value_and_grad",
  "select_tree",
  "stage_boundary",
  "stages_from_paths",
)
