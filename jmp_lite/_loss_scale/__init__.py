"""Loss scales: keep small fp16 gradients from underflowing (private).

fp16's smallest subnormal is 2^-24, so gradients below it become zero. Scaling
the loss by S before ``jax.grad`` scales every gradient by S (the chain rule is
linear); dividing by S afterwards, in fp32, recovers the true gradients. With S
a power of two both multiplications are exact.

Three kinds, with jmp's names and constructor order:

* :class:`NoOpLossScale`: S = 1 (fp32 or bf16 training).
* :class:`StaticLossScale`: a fixed S.
* :class:`DynamicLossScale`: S adapts. After ``period`` consecutive finite
  steps it grows by ``factor``; on a non-finite step it shrinks by ``factor``
  (not below ``min_loss_scale``) and the step is skipped by the caller.

Each is an immutable pytree (:func:`jax.tree_util.register_dataclass`) whose
state (the scale and counters) are leaves and whose configuration is static, so
it can live in a jitted train step's state without recompilation as the scale
moves. The modules: ``_contract`` (the :class:`LossScale` protocol,
:class:`ScaledGrads`, :func:`is_loss_scale`), ``_grad`` (the value and
gradients of a scaled loss), ``_finiteness`` (:func:`all_finite`,
:func:`select_tree`), ``_fixed`` (the kinds with one scale; no-op and static)
and ``_dynamic``.
"""

from jmp_lite._loss_scale._contract import (
  STATIC,
  GradOptions,
  LossScale,
  ScaledGrads,
  ValueAndGradTransform,
  checked_field,
  gradient_scale_value,
  is_loss_scale,
)
from jmp_lite._loss_scale._dynamic import DynamicLossScale
from jmp_lite._loss_scale._finiteness import all_finite, combine_across, select_tree
from jmp_lite._loss_scale._fixed import NoOpLossScale, StaticLossScale
from jmp_lite._loss_scale._grad import Differentiation, UserCall, grad_of_scaled_loss

__all__ = (
  "STATIC",
  "Differentiation",
  "DynamicLossScale",
  "GradOptions",
  "LossScale",
  "NoOpLossScale",
  "ScaledGrads",
  "StaticLossScale",
  "UserCall",
  "ValueAndGradTransform",
  "all_finite",
  "checked_field",
  "combine_across",
  "gradient_scale_value",
  "grad_of_scaled_loss",
  "is_loss_scale",
  "select_tree",
)
