r"""MXFP8: 32-element blocks along the contraction, E8M0 (power-of-two) scales rounded up (private).

In the canonical form ``[B, M, K] x [B, N, K]`` (see ``_rowwise``), every operand of every
product (forward, input gradient, weight gradient) gets one scale per 32 consecutive elements of
its contraction,

.. math:: s = 2^{\lceil \log_2(\max_{\text{block}} |x| / \text{fp8\_max}) \rceil},

rounded *up*, so the block's amax always fits (rounding down, as the OCP MX spec's conversion
does, saturates up to a binade; arXiv 2506.08027 found rounding up necessary for training).
The emulated path quantizes, dequantizes (to bf16, which holds every fp8 value times a power of
two exactly: see :func:`mx_quantize_dequantize`) and sums the products in fp32: the same
numerics as a hardware MX GEMM that sums exactly in fp32. ``jax.nn.scaled_dot_general`` runs
it natively where the installed JAX lowers it (Blackwell GPUs); :func:`native_support` says
whether it does, and why not.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_lite import _dtypes as dtypes
from jmp_lite._fp8_config import F32
from jmp_lite.fp8._matmul import power_of_2_above
from jmp_lite.fp8._quantize import quantize

BLOCK = 32
# E8M0 spans 2^-127..2^127; 2^-127 is a float32 subnormal, which XLA may flush to zero.
MIN_SCALE, MAX_SCALE = 2.0**-126, 2.0**127


def e8m0_scales(x: jax.Array, dtype: Any, block: int = BLOCK) -> jax.Array:
  r"""One E8M0 scale (a power of two, rounded up) per ``block`` elements of the last axis.

  Args:
    x: a ``[..., K]`` array, K a multiple of ``block``.
    dtype: the fp8 element format.
    block: elements per scale (32 for MX).

  Returns:
    float32 powers of two of shape ``[..., K / block]``, in [2^-126, 2^127]; 1 for an all-zero
    or non-finite block.
  """
  fp8_max = jnp.float32(dtypes.FORMATS[np.dtype(dtype).name].max)
  blocks = jnp.abs(x.astype(F32)).reshape(*x.shape[:-1], x.shape[-1] // block, block)
  amax = jnp.max(blocks, axis=-1)
  usable = jnp.isfinite(amax) & (amax > 0)
  raw = jnp.where(usable, amax, fp8_max) / fp8_max
  # Below 2^-126 the quotient may be flushed to zero: the smallest scale covers it.
  scale = jnp.where(raw >= MIN_SCALE, power_of_2_above(jnp.maximum(raw, MIN_SCALE)), MIN_SCALE)
  return jnp.where(usable, jnp.minimum(scale, MAX_SCALE), 1.0)


def mx_quantize_dequantize(x: jax.Array, dtype: Any) -> jax.Array:
  r"""``x [..., K]`` (K padded to 32) through MXFP8 and back, in bfloat16.

  The value :math:`q s` (an fp8 value times a power of two) is computed in fp32 and rounded to
  bf16, which is exact (bf16 has fp32's exponent range and 8 significant bits; E4M3 values
  have 4, E5M2 3) unless :math:`q s` falls below bf16's subnormal grid, multiples of
  :math:`2^{-133}`. It never does for an ``x`` on that grid (bf16 or float16 inputs: :math:`q`
  is then a multiple of :math:`2^{-133} / s`), nor when :math:`s \ge 2^{-124}` (E4M3, whose
  values are multiples of :math:`2^{-9}`) or :math:`s \ge 2^{-117}` (E5M2, :math:`2^{-16}`),
  i.e. a block amax above :math:`448 \cdot 2^{-125}` or :math:`57344 \cdot 2^{-118}`.

  Args:
    x: a ``[..., K]`` array, K a multiple of 32.
    dtype: the fp8 element format.

  Returns:
    The dequantized values in bfloat16, shaped like ``x``.
  """
  scale = jnp.repeat(e8m0_scales(x, dtype), BLOCK, axis=-1)
  return (quantize(x, scale, dtype).astype(F32) * scale).astype(jnp.bfloat16)


def _pad_k(x: jax.Array) -> jax.Array:
  extra = -x.shape[-1] % BLOCK
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)]) if extra else x


def mx_product(a, b, a_dtype, b_dtype, out_dtype, axes=()) -> jax.Array:
  """``[B, M, K] x [B, N, K] -> [B, M, N]``: MXFP8 operands, dequantized, summed in fp32.

  ``axes``: ``shard_map`` axes K is split over, in whole blocks: the fp32 sums add over them.
  """
  a, b = mx_quantize_dequantize(_pad_k(a), a_dtype), mx_quantize_dequantize(_pad_k(b), b_dtype)
  dims = (((2,), (2,)), ((0,), (0,)))
  # bf16 operands with an fp32 result: each product (at most 8 significant bits) is exact in
  # fp32, as in an fp32 matmul of the same values, and the sums are fp32's.
  out = lax.dot_general(a, b, dims, preferred_element_type=F32)
  return (lax.psum(out, axes) if axes else out).astype(out_dtype)


class MxSpec(NamedTuple):
  """The static part of one emulated MXFP8 matmul (canonical form)."""

  fwd_dtype: np.dtype
  bwd_dtype: np.dtype
  out_dtype: np.dtype
  a_dtype: np.dtype
  b_dtype: np.dtype
  row_axes: tuple = ()  # shard_map axes the rows of ``a`` (the tokens) are split over


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def mx_matmul(a, b, spec: MxSpec):
  """The emulated MXFP8 matmul, each product's operands blocked along its own contraction."""
  if spec.row_axes and a.shape[1] % BLOCK:
    raise ValueError(
      f"Mxfp8Scaling on explicit mesh axes {spec.row_axes}: each device's tokens "
      f"({a.shape[1]}) must be a multiple of {BLOCK}, the weight gradient's blocks along the "
      "tokens, for the sharded program to quantize as one device does."
    )
  return mx_product(a, b, spec.fwd_dtype, spec.fwd_dtype, spec.out_dtype)


def _fwd(a, b, spec):
  return mx_matmul(a, b, spec), (a, b)


def _bwd(spec, residuals, g):
  a, b = residuals
  t = lambda x: jnp.swapaxes(x, 1, 2)
  da = mx_product(g, t(b), spec.bwd_dtype, spec.fwd_dtype, spec.a_dtype)
  db = mx_product(t(g), t(a), spec.bwd_dtype, spec.fwd_dtype, spec.b_dtype, spec.row_axes)
  return da, db


mx_matmul.defvjp(_fwd, _bwd)


@functools.cache
def _native_support(backend: str) -> tuple[bool, str]:
  configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
  dims = (((2,), (2,)), ((0,), (0,)))
  probe = jax.jit(lambda a, b: jax.nn.scaled_dot_general(a, b, dims, configs=configs))
  shape = jax.ShapeDtypeStruct((1, 32, 64), jnp.bfloat16)
  try:
    probe.lower(shape, shape).compile()
  except Exception as e:  # what the installed JAX says about this backend, reported as is
    first = (str(e).splitlines() or [""])[0]
    return False, f"jax {jax.__version__} does not compile it on {backend}: {first}"
  return True, f"jax {jax.__version__} compiles it on {backend}"


def native_support() -> tuple[bool, str]:
  """Whether ``jax.nn.scaled_dot_general`` with MXFP8 compiles on the default backend.

  Returns:
    ``(supported, reason)``: the answer, and a sentence naming the JAX version, the backend and
    (when not supported) the error the installed JAX gave.
  """
  return _native_support(jax.default_backend())


def native_matmul(a: jax.Array, b: jax.Array, out_dtype: Any) -> jax.Array:
  """``[B, M, K] x [B, N, K]`` through ``jax.nn.scaled_dot_general`` (MXFP8 configs)."""
  supported, reason = native_support()
  if not supported:
    raise NotImplementedError(
      f"Mxfp8Scaling(implementation='scaled_dot_general') needs jax.nn.scaled_dot_general to "
      f"compile MXFP8 here, and {reason}. Use implementation='emulated' (the same numerics)."
    )
  configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
  dims = (((2,), (2,)), ((0,), (0,)))
  out = jax.nn.scaled_dot_general(a, b, dims, preferred_element_type=F32, configs=configs)
  return out.astype(out_dtype)
