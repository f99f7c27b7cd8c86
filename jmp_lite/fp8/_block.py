r"""Block scaling as DeepSeek-V3 trains: fp32 scales per tile, fp32 sums every 128 of K (private).

In the canonical form ``[B, M, K] x [B, N, K] -> [B, M, N]`` (see ``_rowwise``), activations
and gradients get one scale per 1 x 128 tile (a row, 128 elements of the contraction), weights
one per 128 x 128 block, each the tile's amax over E4M3's largest value, in fp32. With
:math:`c` indexing the 128-wide chunks of K,

.. math::

  y_{bmn} = \sum_c \Big(\sum_{k \in c} q(a)_{bmk}\, q(b)_{bnk}\Big)_{\text{fp32}}
  s_a[b, m, c]\; s_b[b, \lfloor n / 128 \rfloor, c].

The promotion to fp32 every 128 elements of K is expressed as one fp8 ``dot_general`` batched
over the chunks (each a K=128 fp8 product with an fp32 result), the per-chunk scales applied
in fp32, and a sum over the chunks in fp32: the fp8 accumulator never sums more than 128
products. The intermediate holds ``K / 128`` fp32 partial products of the output's size.
K, M and N that are not multiples of the tiles are padded with zeros (exact: a zero adds
nothing to a sum or to an amax).
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
from jmp_lite.fp8._quantize import quantize

TILE = 128


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  extra = -x.shape[axis] % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths)


def tile_scales(x: jax.Array, rows: int, dtype: Any, cols: int = TILE) -> jax.Array:
  r"""fp32 scales of ``[B, R, K]`` per ``rows x cols`` tile: the tile's amax over fp8_max.

  Args:
    x: a ``[B, R, K]`` array, already padded to multiples of ``rows`` and ``cols``.
    rows: tile height (1 for activations and gradients, 128 for weights).
    dtype: the fp8 format.
    cols: tile width along K.

  Returns:
    float32 scales ``[B, R / rows, K / cols]``; 1 for an all-zero or non-finite tile.
  """
  batch, r, k = x.shape
  fp8_max = jnp.float32(dtypes.FORMATS[np.dtype(dtype).name].max)
  tiles = jnp.abs(x.astype(F32)).reshape(batch, r // rows, rows, k // cols, cols)
  amax = jnp.max(tiles, axis=(2, 4))
  scale = amax / fp8_max
  usable = jnp.isfinite(amax) & (amax > 0) & (scale > 0)
  return jnp.where(usable, scale, 1.0)


def _expand(scale: jax.Array, rows: int, cols: int) -> jax.Array:
  """Per-tile scales broadcast back to the elements of the padded operand."""
  return jnp.repeat(jnp.repeat(scale, rows, axis=1), cols, axis=2)


def block_product(a, b, a_rows, b_rows, dtype, out_dtype, precision) -> jax.Array:
  """``[B, M, K] x [B, N, K] -> [B, M, N]`` with tile scales and fp32 sums per 128 of K."""
  (batch, m, _), n = a.shape, b.shape[1]
  a = _pad_to(_pad_to(a, 2, TILE), 1, a_rows)
  b = _pad_to(_pad_to(b, 2, TILE), 1, b_rows)
  s_a, s_b = tile_scales(a, a_rows, dtype), tile_scales(b, b_rows, dtype)
  q_a = quantize(a, _expand(s_a, a_rows, TILE), dtype)
  q_b = quantize(b, _expand(s_b, b_rows, TILE), dtype)
  chunks = a.shape[2] // TILE
  q_a = q_a.reshape(batch, a.shape[1], chunks, TILE)
  q_b = q_b.reshape(batch, b.shape[1], chunks, TILE)
  # One K=128 fp8 product per chunk, each with an fp32 result: [B, C, M, N].
  dims = (((3,), (3,)), ((0, 2), (0, 2)))
  partial = lax.dot_general(q_a, q_b, dims, precision, preferred_element_type=F32)
  row_a = jnp.repeat(s_a, a_rows, axis=1).transpose(0, 2, 1)[..., :, None]  # [B, C, M, 1]
  row_b = jnp.repeat(s_b, b_rows, axis=1).transpose(0, 2, 1)[..., None, :]  # [B, C, 1, N]
  out = jnp.sum(partial * row_a * row_b, axis=1)
  return out[:, :m, :n].astype(out_dtype)


class BlockSpec(NamedTuple):
  """The static part of one block-scaled matmul (canonical form)."""

  dtype: np.dtype
  weight_rows: int  # 128: the weight's 128 x 128 blocks
  out_dtype: np.dtype
  a_dtype: np.dtype
  b_dtype: np.dtype
  precision: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def block_matmul(a, b, spec: BlockSpec):
  """``[B, M, K] x [B, N, K] -> [B, M, N]``: 1 x 128 tiles for ``a``, blocks for ``b``."""
  return block_product(a, b, 1, spec.weight_rows, spec.dtype, spec.out_dtype, spec.precision)


def _fwd(a, b, spec):
  return block_matmul(a, b, spec), (a, b)


def _bwd(spec, residuals, g):
  a, b = residuals
  t = lambda x: jnp.swapaxes(x, 1, 2)
  # da = g . b^T: g in 1 x 128 tiles along N; the weight's 128 x 128 blocks, transposed.
  da = block_product(g, t(b), 1, spec.weight_rows, spec.dtype, spec.a_dtype, spec.precision)
  # db = g^T . a^T: both in 1 x 128 tiles along the tokens (128 x 1 in their own layout).
  db = block_product(t(g), t(a), 1, 1, spec.dtype, spec.b_dtype, spec.precision)
  return da, db


block_matmul.defvjp(_fwd, _bwd)
