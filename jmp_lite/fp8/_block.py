r"""Block scaling as DeepSeek-V3 trains: fp32 scales per tile, fp32 sums every 128 of K (private).

In the canonical form ``[B, M, K] x [B, N, K] -> [B, M, N]`` (see ``_rowwise``), activations
and gradients get one scale per 1 x 128 tile (a row, 128 elements of the contraction), weights
one per 128 x 128 block, each the tile's amax over E4M3's largest value, in fp32. With
:math:`c` indexing the 128-wide chunks of K,

.. math::

  y_{bmn} = \sum_c \Big(\sum_{k \in c} q(a)_{bmk}\, q(b)_{bnk}\Big)_{\text{fp32}}
  s_a[b, m, c]\; s_b[b, \lfloor n / 128 \rfloor, c].

The promotion to fp32 every 128 elements of K is expressed as a loop (``lax.scan``) over the
chunks: each step one K=128 fp8 ``dot_general`` with an fp32 result, its per-chunk scales applied
in fp32, added to an fp32 accumulator in the order of the chunks. The fp8 accumulator never sums
more than 128 products. An outer loop takes the output's rows 1024 at a time (``ROW_TILE``), so
that the fp32 arrays alive (one tile's sum and one chunk's product) stay small next to the
output, which is written in its own dtype.
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

from jmp_lite import _compat
from jmp_lite import _dtypes as dtypes
from jmp_lite._fp8_config import F32
from jmp_lite.fp8._quantize import quantize
from jmp_lite.fp8._sharding import vary

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


# Output rows per step of the loop over row tiles: the fp32 sum of one tile is at most
# ROW_TILE x N, however large M is.
ROW_TILE = 1024


def block_product(a, b, a_rows, b_rows, dtype, out_dtype, precision, axes=()) -> jax.Array:
  """``[B, M, K] x [B, N, K] -> [B, M, N]`` with tile scales and fp32 sums per 128 of K.

  ``axes``: ``shard_map`` axes K is split over, in whole tiles: the fp32 sums add over them.
  """
  (batch, m, _), n = a.shape, b.shape[1]
  a = _pad_to(_pad_to(a, 2, TILE), 1, a_rows)
  b = _pad_to(_pad_to(b, 2, TILE), 1, b_rows)
  s_a, s_b = tile_scales(a, a_rows, dtype), tile_scales(b, b_rows, dtype)
  q_a = quantize(a, _expand(s_a, a_rows, TILE), dtype)
  q_b = quantize(b, _expand(s_b, b_rows, TILE), dtype)
  chunks, padded_n = a.shape[2] // TILE, b.shape[1]
  row_a = jnp.repeat(s_a, a_rows, axis=1)  # [B, M, C]
  row_b = jnp.repeat(s_b, b_rows, axis=1).transpose(2, 0, 1)[..., None, :]  # [C, B, 1, N]
  q_b = q_b.reshape(batch, padded_n, chunks, TILE).transpose(2, 0, 1, 3)  # [C, B, N, 128]
  # Rows in R tiles of T (padded with zero rows, whose products are zero and sliced off).
  tiles = -(-a.shape[1] // ROW_TILE)
  rows = -(-a.shape[1] // tiles)
  q_a, row_a = _pad_to(q_a, 1, rows * tiles), _pad_to(row_a, 1, rows * tiles)
  q_a = q_a.reshape(batch, tiles, rows, chunks, TILE).transpose(1, 3, 0, 2, 4)  # [R, C, B, T, 128]
  row_a = row_a.reshape(batch, tiles, rows, chunks).transpose(1, 3, 0, 2)[
    ..., None
  ]  # [R, C, B, T, 1]
  dims = (((2,), (2,)), ((0,), (0,)))

  def add_chunk(acc, chunk):
    # One K=128 fp8 product with an fp32 result, scaled in fp32 and added to the fp32 sum in
    # the order of the chunks.
    q_a, q_b, row_a, row_b = chunk
    partial = lax.dot_general(q_a, q_b, dims, precision, preferred_element_type=F32)
    return acc + partial * row_a * row_b, None

  def row_tile(_, tile):
    # Loops keep one row tile's fp32 sum and one chunk's product alive, where a dot batched
    # over the chunks would write K / 128 fp32 products of the output's size.
    q_a, row_a = tile
    # Under shard_map the sum varies over the axes its operands do (a loop carry keeps its type).
    varying = frozenset().union(*map(_compat.varying_axes, (q_a, q_b, row_a, row_b)))
    acc = vary(jnp.zeros((batch, rows, padded_n), F32), varying)
    acc, _ = lax.scan(add_chunk, acc, (q_a, q_b, row_a, row_b))
    return None, (lax.psum(acc, axes) if axes else acc).astype(out_dtype)

  _, out = lax.scan(row_tile, None, (q_a, row_a))  # [R, B, T, N]
  out = out.transpose(1, 0, 2, 3).reshape(batch, tiles * rows, padded_n)
  return out[:, :m, :n]


class BlockSpec(NamedTuple):
  """The static part of one block-scaled matmul (canonical form)."""

  dtype: np.dtype
  weight_rows: int  # 128: the weight's 128 x 128 blocks
  out_dtype: np.dtype
  a_dtype: np.dtype
  b_dtype: np.dtype
  precision: Any
  row_axes: tuple = ()  # shard_map axes the rows of ``a`` (the tokens) are split over


def check_local_tokens(tokens: int, tile: int, recipe: str, axes: tuple) -> None:
  """Raises unless each device's share of the tokens is whole tiles of the weight gradient."""
  if axes and tokens % tile:
    raise ValueError(
      f"{recipe} on explicit mesh axes {axes}: each device's tokens ({tokens}) must be a "
      f"multiple of {tile}, the weight gradient's tiles along the tokens, for the sharded "
      "program to quantize as one device does."
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def block_matmul(a, b, spec: BlockSpec):
  """``[B, M, K] x [B, N, K] -> [B, M, N]``: 1 x 128 tiles for ``a``, blocks for ``b``."""
  check_local_tokens(a.shape[1], TILE, "BlockScaling", spec.row_axes)
  return block_product(a, b, 1, spec.weight_rows, spec.dtype, spec.out_dtype, spec.precision)


def _fwd(a, b, spec):
  return block_matmul(a, b, spec), (a, b)


def _bwd(spec, residuals, g):
  a, b = residuals
  t = lambda x: jnp.swapaxes(x, 1, 2)
  # da = g . b^T: g in 1 x 128 tiles along N; the weight's 128 x 128 blocks, transposed.
  da = block_product(g, t(b), 1, spec.weight_rows, spec.dtype, spec.a_dtype, spec.precision)
  # db = g^T . a^T: both in 1 x 128 tiles along the tokens (128 x 1 in their own layout).
  db = block_product(t(g), t(a), 1, 1, spec.dtype, spec.b_dtype, spec.precision, spec.row_axes)
  return da, db


block_matmul.defvjp(_fwd, _bwd)
