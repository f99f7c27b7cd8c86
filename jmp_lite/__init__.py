"""jmp_lite: mixed precision training for JAX, Flax and Optax.

A drop-in replacement for DeepMind's jmp (``import jmp_lite as jmp``) with its
bugs fixed, plus Optax loss-scaling transformations, layer-wise adaptive loss
scaling and Flax integration.
"""

# Submodules are attributes (jl.flax, jl.fp8) but stay out of __all__: `from jmp_lite import *`
# must not rebind a user's `flax`.
from jmp_lite import flax as flax
from jmp_lite import fp8 as fp8
from jmp_lite._audit import (
  AUDIT_CHECKS,
  AuditConfig,
  AuditReport,
  Finding,
  SourceLocation,
  audit,
  audit_jaxpr,
)
from jmp_lite._dtypes import FORMATS, FormatInfo, format_info, half_dtype, parse_dtype
from jmp_lite._loss_scale import (
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  StaticLossScale,
  all_finite,
  select_tree,
)
from jmp_lite._policy import Policy, cast_to_full, cast_to_half, get_policy
from jmp_lite._step_check import check_loss_scaling
from jmp_lite._transform import (
  LossScalingState,
  get_loss_scale,
  get_loss_scaling_state,
  loss_scaling,
  scaled_value_and_grad,
)
from jmp_lite.diagnostics import (
  Culprit,
  GradientStats,
  LossScaleHealth,
  LossScaleMonitor,
  every_n_steps,
  gradient_statistics,
  likely_culprits,
  loss_scale_health,
  parameter_order,
  stats_to_metrics,
)
from jmp_lite.fp8 import (
  Fp8Config,
  Fp8DotAmax,
  Fp8DotState,
  Fp8Policy,
  Fp8ScaleState,
  get_fp8_policy,
)
from jmp_lite.layerwise import (
  BoundaryStats,
  LayerwiseGrads,
  LayerwiseLossScale,
  StackedStages,
  check_stages,
  stage_boundary,
  stages_from_paths,
)

__version__ = "0.1.0"

__all__ = (
  "AUDIT_CHECKS",
  "FORMATS",
  "AuditConfig",
  "AuditReport",
  "BoundaryStats",
  "Culprit",
  "DynamicLossScale",
  "Finding",
  "FormatInfo",
  "Fp8Config",
  "Fp8DotAmax",
  "Fp8DotState",
  "Fp8Policy",
  "Fp8ScaleState",
  "GradientStats",
  "LayerwiseGrads",
  "LayerwiseLossScale",
  "LossScale",
  "LossScaleHealth",
  "LossScaleMonitor",
  "LossScalingState",
  "NoOpLossScale",
  "Policy",
  "SourceLocation",
  "StackedStages",
  "StaticLossScale",
  "all_finite",
  "audit",
  "audit_jaxpr",
  "cast_to_full",
  "cast_to_half",
  "check_loss_scaling",
  "check_stages",
  "every_n_steps",
  "format_info",
  "get_fp8_policy",
  "get_loss_scale",
  "get_loss_scaling_state",
  "get_policy",
  "gradient_statistics",
  "half_dtype",
  "likely_culprits",
  "loss_scale_health",
  "loss_scaling",
  "parameter_order",
  "parse_dtype",
  "scaled_value_and_grad",
  "select_tree",
  "stage_boundary",
  "stages_from_paths",
  "stats_to_metrics",
)
