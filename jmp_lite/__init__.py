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
from jmp_lite._dtypes import (
  FORMATS,
  FormatInfo,
  format_info,
  half_dtype,
  parse_dtype,
  scalar_type,
)
from jmp_lite._loss_scale import (
  DynamicLossScale,
  GradOptions,
  LossScale,
  NoOpLossScale,
  ScaledGrads,
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
  "scalar_type",
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
  "ScaledGrads",
  "GradOptions",
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

# Imported on first use: `import jmp_lite` imports neither Flax nor matplotlib.
_LAZY_NAMESPACES = ("flax", "plotting")


def __getattr__(name: str) -> Any:
  import importlib  # here, so that the module has no `importlib` attribute

  if name in _LAZY_NAMESPACES:
    return importlib.import_module(f"jmp_lite.{name}")
  raise AttributeError(f"module 'jmp_lite' has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY_NAMESPACES})
