"""jmp_lite: mixed precision training for JAX, Flax and Optax.

A drop-in replacement for DeepMind's jmp (``import jmp_lite as jmp``) with its
bugs fixed, plus Optax loss-scaling transformations, layer-wise adaptive loss
scaling and Flax integration.

The top level holds what a training step uses: formats, precision policies,
loss scales, the :func:`loss_scaling` transformation and the checks. The rest
lives in namespaces: :mod:`jmp_lite.fp8`, :mod:`jmp_lite.layerwise`,
:mod:`jmp_lite.diagnostics`, :mod:`jmp_lite.flax` (imported on first use, so
``import jmp_lite`` does not import Flax) and :mod:`jmp_lite.plotting`.
"""

from typing import TYPE_CHECKING, Any

from jmp_lite import diagnostics as diagnostics
from jmp_lite import fp8 as fp8
from jmp_lite import layerwise as layerwise
from jmp_lite._audit import (
  AUDIT_CHECKS,
  AuditConfig,
  AuditReport,
  Finding,
  SourceLocation,
  audit,
  audit_jaxpr,
)
from jmp_lite._autocast import AUTOCAST_TABLE, autocast, full_precision
from jmp_lite._dtypes import FORMATS, FormatInfo, format_info, half_dtype, parse_dtype
from jmp_lite._loss_scale import (
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  StaticLossScale,
  all_finite,
  select_tree,
)
from jmp_lite._low_precision_params import (
  LowPrecisionParamsState,
  low_precision_params,
  master_params,
)
from jmp_lite._policy import Policy, cast_to_full, cast_to_half, get_policy
from jmp_lite._rounding import stochastic_round
from jmp_lite._step_check import check_loss_scaling
from jmp_lite._transform import (
  LossScalingState,
  get_loss_scale,
  get_loss_scaling_state,
  loss_scaling,
  scaled_value_and_grad,
)
from jmp_lite.layerwise import LayerwiseLossScale, stage_boundary

if TYPE_CHECKING:
  from jmp_lite import flax as flax
  from jmp_lite import plotting as plotting

__version__ = "0.1.0"

# Namespaces (jl.flax, jl.fp8, ...) are attributes but stay out of __all__: `from jmp_lite
# import *` must not rebind a user's `flax`.
__all__ = (
  # Formats
  "FORMATS",
  "FormatInfo",
  "format_info",
  "half_dtype",
  "parse_dtype",
  # Precision policies
  "Policy",
  "get_policy",
  "cast_to_full",
  "cast_to_half",
  # Op-level policies
  "autocast",
  "full_precision",
  "AUTOCAST_TABLE",
  # Loss scales
  "LossScale",
  "NoOpLossScale",
  "StaticLossScale",
  "DynamicLossScale",
  "LayerwiseLossScale",
  "stage_boundary",
  "all_finite",
  "select_tree",
  # Loss scaling as an Optax transformation
  "loss_scaling",
  "LossScalingState",
  "get_loss_scale",
  "get_loss_scaling_state",
  "scaled_value_and_grad",
  # 16-bit parameters
  "low_precision_params",
  "LowPrecisionParamsState",
  "master_params",
  "stochastic_round",
  # Checks
  "audit",
  "audit_jaxpr",
  "AuditConfig",
  "AuditReport",
  "Finding",
  "SourceLocation",
  "AUDIT_CHECKS",
  "check_loss_scaling",
)

_LAZY_NAMESPACES = ("flax", "plotting")
# Modules that became private (jmp_lite/_policy.py...); `jl.policy.get_policy` keeps working.
_OLD_MODULES = ("dtypes", "policy", "loss_scale", "transform")

# Names that were top-level before they moved into a namespace; they keep working here.
_MOVED = {
  **dict.fromkeys(
    (
      "Fp8Config",
      "Fp8DotAmax",
      "Fp8DotState",
      "Fp8Policy",
      "Fp8ScaleState",
      "get_fp8_policy",
    ),
    "fp8",
  ),
  **dict.fromkeys(
    ("BoundaryStats", "LayerwiseGrads", "StackedStages", "check_stages", "stages_from_paths"),
    "layerwise",
  ),
  **dict.fromkeys(
    (
      "Culprit",
      "GradientStats",
      "LossScaleHealth",
      "LossScaleMonitor",
      "every_n_steps",
      "gradient_statistics",
      "likely_culprits",
      "loss_scale_health",
      "parameter_order",
      "stats_to_metrics",
    ),
    "diagnostics",
  ),
}


def __getattr__(name: str) -> Any:
  import importlib  # here, so that the module has no `importlib` attribute

  if name in _LAZY_NAMESPACES or name in _OLD_MODULES:
    return importlib.import_module(f"jmp_lite.{name}")
  if name in _MOVED:
    return getattr(importlib.import_module(f"jmp_lite.{_MOVED[name]}"), name)
  raise AttributeError(f"module 'jmp_lite' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY_NAMESPACES, *_MOVED})
