"""Mixed precision for Flax: apply a precision policy to linen and NNX models from outside.

* :func:`policy_apply` / :func:`policy_init`: a linen model's ``apply`` /
  ``init`` under a policy, via :func:`flax.linen.intercept_methods`.
* :func:`policy_view`: a low-precision view of an NNX model for the forward pass.
* :class:`ModulePolicies`: what they run a model under, a policy with
  per-module-class :class:`ModuleOverride` entries taken over
  :data:`DEFAULT_OVERRIDES` (normalization and embeddings keep fp32);
  :class:`ExplicitDtypeWarning` names modules built with their own ``dtype=``.
* :func:`dot_general`, :func:`conv_general_dilated`, :func:`einsum`: 16-bit
  matmuls and convolutions (accumulated in fp32 by the hardware), with an
  optional fp32 result or fp32 weight gradient.
* :func:`dot_product_attention`, :func:`softmax`: attention with an fp32
  softmax that keeps 16-bit residuals; ``implementation="cudnn"``: the same
  by cuDNN's fused kernel on a GPU (no ``T x T`` array written).
* :class:`TrainState`, :class:`Optimizer`: Flax's training state and NNX
  optimizer with loss scaling built in.
* :class:`DynamicScale`, :class:`DynamicScaleResult`: a drop-in for Flax's
  ``flax.training.dynamic_scale`` (``from jmp_lite.flax import dynamic_scale
  as dynamic_scale_lib``), with :meth:`DynamicScale.select` to keep a skipped
  step's state.
* :func:`layerwise_stages`: stage boundaries for layer-wise loss scaling,
  inserted by module class or for ``nn.Sequential`` children.
* :mod:`jmp_lite.flax.fp8` (import it explicitly): fp8 matmuls with delayed
  scaling for linen and NNX layers.
"""

from jmp_lite.flax._accumulate import conv_general_dilated, dot_general, einsum
from jmp_lite.flax._attention import dot_product_attention, softmax
from jmp_lite.flax._dynamic_scale import DynamicScale, DynamicScaleResult
from jmp_lite.flax._explicit_dtypes import ExplicitDtypeWarning
from jmp_lite.flax._fused_attention import FusedAttentionUnavailableWarning
from jmp_lite.flax._kernel_hooks import FLAX_HOOKS
from jmp_lite.flax._layerwise import LayerwiseStages, layerwise_stages
from jmp_lite.flax._linen import policy_apply, policy_init
from jmp_lite.flax._module_override import (
  DEFAULT_OVERRIDES,
  FP32,
  FP32_RECOMPUTED,
  ModuleOverride,
)
from jmp_lite.flax._module_policy import ModulePolicies
from jmp_lite.flax._nnx import PolicyModule, policy_view
from jmp_lite.flax._optimizer import Optimizer
from jmp_lite.flax._train_state import TrainState

__all__ = (
  # Running a model under a policy
  "policy_apply",
  "policy_init",
  "policy_view",
  "PolicyModule",
  # Per-module precision
  "ModulePolicies",
  "ModuleOverride",
  "FP32",
  "FP32_RECOMPUTED",
  "DEFAULT_OVERRIDES",
  "FLAX_HOOKS",
  "ExplicitDtypeWarning",
  # 16-bit kernels
  "dot_general",
  "conv_general_dilated",
  "einsum",
  "dot_product_attention",
  "softmax",
  "FusedAttentionUnavailableWarning",
  # Training with loss scaling
  "TrainState",
  "Optimizer",
  "DynamicScale",
  "DynamicScaleResult",
  # Layer-wise loss scaling
  "LayerwiseStages",
  "layerwise_stages",
)
