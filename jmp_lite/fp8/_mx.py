r"""MXFP8: 32-element blocks along the contraction, E8M0 (power-of-two) scales rounded up (private).

In the canonical form ``[B, M, K] x [B, N, K]`` (see ``_canonical``), every operand of every
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

The emulated path's residuals are fp8: the forward pass quantizes :math:`a^\top` and
:math:`b^\top` along the gradients' contractions (the tokens, N) and saves them with their
scales as E8M0 exponents (uint8), the values the backward pass would get by quantizing the
high-precision operands.
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
from jmp_lite.fp8._canonical import Results
from jmp_lite.fp8._matmul import power_of_2_above
from jmp_lite.fp8._quantize import quantize
from jmp_lite.fp8._sharding import check_local_tokens, computed_together

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


def mx_quantize(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  r"""``x [..., K]`` padded to whole blocks: its fp8 values and E8M0 scales as uint8 exponents.

  A scale :math:`2^e` (:math:`-126 \le e \le 127`) is stored as the biased exponent
  :math:`e + 127`, the exponent field of its float32 value (and E8M0's encoding).
  """
  x = _pad_k(x)
  scale = e8m0_scales(x, dtype)
  q = quantize(x, jnp.repeat(scale, BLOCK, axis=-1), dtype)
  # A normal power of two has an all-zero significand: its bits are the exponent field alone.
  return q, (lax.bitcast_convert_type(scale, jnp.uint32) >> 23).astype(jnp.uint8)


def mx_dequantize(q: jax.Array, exponents: jax.Array) -> jax.Array:
  """The bfloat16 values of :func:`mx_quantize`'s result (as :func:`mx_quantize_dequantize`)."""
  scale = lax.bitcast_convert_type(exponents.astype(jnp.uint32) << 23, F32)
  return (q.astype(F32) * jnp.repeat(scale, BLOCK, axis=-1)).astype(jnp.bfloat16)


def _mx_dot(a, b, out_dtype, axes=()) -> jax.Array:
  """``[B, M, K] x [B, N, K] -> [B, M, N]`` of dequantized bf16 operands, summed in fp32."""
  dims = (((2,), (2,)), ((0,), (0,)))
  # bf16 operands with an fp32 result: each product (at most 8 significant bits) is exact in
  # fp32, as in an fp32 matmul of the same values, and the sums are fp32's.
  out = lax.dot_general(a, b, dims, preferred_element_type=F32)
  return (lax.psum(out, axes) if axes else out).astype(out_dtype)


def mx_product(a, b, a_dtype, b_dtype, out_dtype, axes=()) -> jax.Array:
  """``[B, M, K] x [B, N, K] -> [B, M, N]``: MXFP8 operands, dequantized, summed in fp32.

  ``axes``: ``shard_map`` axes K is split over, in whole blocks: the fp32 sums add over them.
  """
  a, b = mx_quantize_dequantize(_pad_k(a), a_dtype), mx_quantize_dequantize(_pad_k(b), b_dtype)
  return _mx_dot(a, b, out_dtype, axes)


class MxSpec(NamedTuple):
  """The recipe's static config of one emulated MXFP8 matmul (canonical form)."""

  fwd_dtype: np.dtype
  bwd_dtype: np.dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def mx_matmul(a, b, spec: MxSpec, results: Results):
  """The emulated MXFP8 matmul, each product's operands blocked along its own contraction."""
  check_local_tokens(a.shape[1], BLOCK, "Mxfp8Scaling", results.row_axes)
  return mx_product(a, b, spec.fwd_dtype, spec.fwd_dtype, results.out_dtype)


def _t(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, 1, 2)


def _fwd(a, b, spec, results):
  # The residuals are the backward's operands, quantized here from the same values along the
  # same blocks: a^T and b^T blocked along the tokens and along N. The barrier makes them the
  # residuals: without it XLA may quantize again in the backward pass, keeping the
  # high-precision operands alive instead.
  residuals = lax.optimization_barrier(
    (mx_quantize(_t(a), spec.fwd_dtype), mx_quantize(_t(b), spec.fwd_dtype))
  )
  return mx_matmul(a, b, spec, results), residuals


def _bwd(spec, results, residuals, g):
  at, bt = (mx_dequantize(*r) for r in residuals)
  g_n, g_m = (mx_quantize_dequantize(_pad_k(x), spec.bwd_dtype) for x in (g, _t(g)))
  da = _mx_dot(g_n, bt, results.a_dtype)
  db = _mx_dot(g_m, at, results.b_dtype, results.row_axes)
  return computed_together(da, db)


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
