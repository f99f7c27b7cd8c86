"""How the modules of one Flax class run under a precision policy (private).

A :class:`~jmp_lite.Policy` says "parameters fp32, compute bf16, outputs
fp32". Some layers must not follow it: normalization statistics (a variance
of bf16 values is a difference of nearly equal large numbers) and embedding
gradients (a scatter-add of many rows in bf16 drops the small ones). A
:class:`ModuleOverride` says how the modules of one class run instead;
:data:`DEFAULT_OVERRIDES` are the ones every policy starts from, and
:class:`~jmp_lite.flax.ModulePolicies` maps module classes to overrides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_lite import _dtypes as dtypes
from jmp_lite import _validation
from jmp_lite.flax._frozen_mapping import FrozenMapping

_F32 = np.dtype(jnp.float32)


def _check_dtype(value: Any, name: str) -> np.dtype | None:
  if value is None:
    return None
  expected = (
    "a floating dtype other than fp8 (fp8 needs per-tensor scaling, which a module override does "
    "not provide; use jmp_lite's fp8 matmuls for fp8 compute)"
  )
  return _validation.check_dtype(value, name, lambda d: not dtypes.is_float8(d), expected)


@dataclasses.dataclass(frozen=True)
class ModuleOverride:
  """How the modules of one class run under a precision policy.

  The values of :class:`~jmp_lite.flax.ModulePolicies`' ``overrides``.
  Immutable and hashable (``attributes`` is stored read-only).

  Attributes:
    compute_dtype: dtype of the module's inputs and of its parameters as read
      (and of its submodules without an override of their own); ``None``
      means the policy's compute dtype.
    output_dtype: dtype of its outputs; ``None`` means the compute dtype of
      the enclosing module (the policy's compute dtype at the top, the
      policy's output dtype for the outermost call), so that the next layer
      receives activations in the dtype it computes in.
    attributes: module attributes (dataclass fields in linen, attributes in
      NNX) to set while the module runs, e.g. ``{"precision": "highest"}``.
      They take precedence over jmp_lite's kernels (see
      :class:`~jmp_lite.flax.ModulePolicies`).
    recompute: for an island (a compute dtype other than the enclosing one),
      run the module under :func:`jax.checkpoint`: the backward pass
      recomputes its forward from its narrow inputs instead of keeping its
      wide intermediates (what that saves for a LayerNorm: the Flax guide's
      "Recomputed islands"), for one more forward pass of the module. Only
      for modules that neither update variables nor draw random numbers
      (normalization without running statistics).

  >>> ModuleOverride(compute_dtype="f32").compute_dtype
  dtype('float32')
  """

  compute_dtype: np.dtype | None = None
  output_dtype: np.dtype | None = None
  attributes: Mapping[str, Any] = FrozenMapping()
  recompute: bool = False

  if TYPE_CHECKING:  # The dataclass __init__ accepts dtype names; __post_init__ parses them.

    def __init__(
      self,
      compute_dtype: dtypes.DTypeLike | None = None,
      output_dtype: dtypes.DTypeLike | None = None,
      attributes: Mapping[str, Any] = FrozenMapping(),
      recompute: bool = False,
    ) -> None: ...

  def __post_init__(self):
    set_ = lambda name, value: object.__setattr__(self, name, value)
    set_("compute_dtype", _check_dtype(self.compute_dtype, "compute_dtype"))
    set_("output_dtype", _check_dtype(self.output_dtype, "output_dtype"))
    if not isinstance(self.attributes, Mapping):
      raise TypeError(
        f"attributes must be a mapping from attribute name to value, got {self.attributes!r}."
      )
    for name in self.attributes:
      if not (isinstance(name, str) and name.isidentifier()):
        raise TypeError(f"attribute names must be identifiers, got {name!r}.")
    set_("attributes", FrozenMapping(self.attributes))
    set_("recompute", _validation.check_bool(self.recompute, "recompute"))


FP32 = ModuleOverride(compute_dtype=_F32)
"""Compute in fp32 (inputs and parameters), hand the result back in the compute dtype."""

FP32_RECOMPUTED = ModuleOverride(compute_dtype=_F32, recompute=True)
"""As :data:`FP32`, recomputed in the backward pass instead of storing fp32 intermediates."""

DEFAULT_OVERRIDES: Mapping[type, ModuleOverride] = FrozenMapping(
  {
    # Normalization: mean/variance of 16-bit activations cancel catastrophically.
    # Recomputed (cheap elementwise work) so the island stores only its 16-bit
    # input; BatchNorm updates running statistics, so it stores its fp32
    # intermediates instead.
    nn.LayerNorm: FP32_RECOMPUTED,
    nn.RMSNorm: FP32_RECOMPUTED,
    nn.GroupNorm: FP32_RECOMPUTED,
    nn.InstanceNorm: FP32_RECOMPUTED,
    nn.BatchNorm: FP32,
    nnx.LayerNorm: FP32_RECOMPUTED,
    nnx.RMSNorm: FP32_RECOMPUTED,
    nnx.GroupNorm: FP32_RECOMPUTED,
    nnx.InstanceNorm: FP32_RECOMPUTED,
    nnx.BatchNorm: FP32,
    # Embeddings: a gather is exact in any dtype, so reading the fp32 table and
    # rounding the gathered rows gives the same activations as a bf16 table,
    # while the backward scatter-add of many rows accumulates in fp32 and no
    # 16-bit copy of the table is made. (A tied ``attend`` then runs in fp32.)
    nn.Embed: FP32,
    nnx.Embed: FP32,
  }
)
"""Module classes that keep fp32 under any policy unless overridden.

Attention softmax and the loss are fp32 islands too, but not by class: the
softmax through :func:`jmp_lite.flax.dot_product_attention`, which replaces
the attention modules' default ``attention_fn``, and the loss because the
model's output is cast to the policy's output dtype.
"""
