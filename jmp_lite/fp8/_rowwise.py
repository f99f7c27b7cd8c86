r"""Row-wise scaling: a power-of-two scale per row of each operand along its contraction (private).

Each matmul is first brought to the canonical form ``[B, M, K] x [B, N, K] -> [B, M, N]``
(batch, free and contracting axes flattened, the contraction last), where a "row" of an operand
is everything but its contracting axes:

.. math::

  s_a[b, m] = 2^{\lceil \log_2 (\max_k |a_{bmk}| / \text{fp8\_max}) \rceil}, \qquad
  y_{bmn} = \Big(\sum_k q(a)_{bmk}\, q(b)_{bnk}\Big)_{\text{fp32}} s_a[b, m]\, s_b[b, n].

The GEMM rounds its fp32 sum to the output dtype (bf16 or fp32) before the scales are applied,
which gives the same values as rounding after them (see :func:`gemm_dtype`).

The backward pass quantizes each of its products again along *its* contraction: the input
gradient :math:`g\, k^\top` contracts the output axis (rows of :math:`g` and of :math:`k^\top`),
the weight gradient :math:`x^\top g` contracts the batch of tokens (columns of :math:`x` and
:math:`g`). Residuals are the high-precision operands.
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


def row_scales(x: jax.Array, dtype: Any, axes: tuple = ()) -> jax.Array:
  r"""One power-of-two scale per row (all axes but the last) of ``x``, rounded up.

  .. math:: s = 2^{\lceil \log_2 (\max|x_{\text{row}}| / \text{fp8\_max}) \rceil}

  A row that is all zeros, or holds inf/NaN, gets a scale of 1 (its zeros stay zeros, and its
  non-finite values stay non-finite through :func:`quantize`).

  Args:
    x: a floating array; rows are its last axis.
    dtype: the fp8 format.
    axes: ``shard_map`` axes the rows are split over (their amax is the max over them).

  Returns:
    float32 scales of shape ``x.shape[:-1] + (1,)``.
  """
  fp8_max = dtypes.FORMATS[np.dtype(dtype).name].max
  amax = jnp.max(jnp.abs(x.astype(F32)), axis=-1, keepdims=True, initial=0)
  if axes:
    amax = lax.pmax(amax, axes)
  usable = jnp.isfinite(amax) & (amax > 0)
  scale = power_of_2_above(jnp.where(usable, amax, fp8_max) / jnp.float32(fp8_max))
  return jnp.where(usable & (scale > 0), scale, 1.0)


# Output dtypes with fp32's exponent range: a GEMM may round to them before the scales apply.
_WIDE_RANGE = (np.dtype(jnp.bfloat16), np.dtype(np.float32))


def gemm_dtype(out_dtype: Any) -> np.dtype:
  r"""The dtype the row-wise GEMM writes before its power-of-two scales are applied.

  The GEMM sums in fp32 to :math:`r`; rounding :math:`r` to the output dtype and then
  multiplying by the power of two :math:`s = s_a s_b` gives the same value as rounding
  :math:`r s`, as long as :math:`r s` is 0, non-finite or normal (:math:`|r s| \ge 2^{-126}`):
  scaling by a power of two shifts the exponent and keeps the significand. bf16 and fp32 share
  fp32's exponent range, and :math:`r` (a sum of fp8 products, nonzero ones at least
  :math:`2^{-32}`) is always in it, so the GEMM writes them directly (a bf16 result is half
  the bytes of an fp32 one). Narrower formats (float16: :math:`r` may exceed 65504 where
  :math:`r s` does not) keep the fp32 result.

  Args:
    out_dtype: the product's dtype.

  Returns:
    ``out_dtype`` for bf16 and fp32, else float32.
  """
  out_dtype = np.dtype(out_dtype)
  return out_dtype if out_dtype in _WIDE_RANGE else np.dtype(F32)


def _rowwise_product(a, b, a_dtype, b_dtype, out_dtype, precision, axes=()) -> jax.Array:
  """``[B, M, K] x [B, N, K] -> [B, M, N]``, each row quantized with its own scale.

  ``axes``: ``shard_map`` axes K is split over; the scales and the fp32 sums reduce over them.
  """
  s_a, s_b = row_scales(a, a_dtype, axes), row_scales(b, b_dtype, axes)
  q_a, q_b = quantize(a, s_a, a_dtype), quantize(b, s_b, b_dtype)
  dims = (((2,), (2,)), ((0,), (0,)))
  # A per-row scale is no GEMM epilogue XLA fuses: the GEMM writes its result rounded, and a
  # second kernel scales it (exact, see gemm_dtype). Partial sums are added in fp32.
  gemm = F32 if axes else gemm_dtype(out_dtype)
  out = lax.dot_general(q_a, q_b, dims, precision, preferred_element_type=gemm)
  out = out.astype(F32) * (s_a * jnp.swapaxes(s_b, 1, 2))
  return (lax.psum(out, axes) if axes else out).astype(out_dtype)


class RowwiseSpec(NamedTuple):
  """The recipe's static config of one row-wise matmul (canonical form)."""

  fwd_dtype: np.dtype
  bwd_dtype: np.dtype
  weight_grad_fp8: bool  # False: the weight gradient in the compute dtype
  precision: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rowwise_matmul(a, b, spec: RowwiseSpec, results: Results):
  """``[B, M, K] x [B, N, K] -> [B, M, N]`` with row-wise fp8 scaling and its VJP."""
  return _rowwise_product(a, b, spec.fwd_dtype, spec.fwd_dtype, results.out_dtype, spec.precision)


def _fwd(a, b, spec, results):
  return rowwise_matmul(a, b, spec, results), (a, b)


def _bwd(spec, results, residuals, g):
  a, b = residuals
  t = lambda x: jnp.swapaxes(x, 1, 2)
  # da[B, M, K] = g[B, M, N] . b^T[B, K, N]: rows of g and of b^T, along N.
  da = _rowwise_product(g, t(b), spec.bwd_dtype, spec.fwd_dtype, results.a_dtype, spec.precision)
  axes = results.row_axes  # the tokens this product contracts
  if spec.weight_grad_fp8:  # db[B, N, K] = g^T[B, N, M] . a^T[B, K, M], along M
    db = _rowwise_product(
      t(g), t(a), spec.bwd_dtype, spec.fwd_dtype, results.b_dtype, spec.precision, axes
    )
  else:  # in the compute dtype, summed in fp32
    compute = jnp.result_type(g, a)
    dims = (((1,), (1,)), ((0,), (0,)))
    db = lax.dot_general(g.astype(compute), a.astype(compute), dims, preferred_element_type=F32)
    db = (lax.psum(db, axes) if axes else db).astype(results.b_dtype)
  return da, db


rowwise_matmul.defvjp(_fwd, _bwd)
