r"""Block scaling as DeepSeek-V3 trains: fp32 scales per tile, fp32 sums every 128 of K (private).

In the canonical form ``[B, M, K] x [B, N, K] -> [B, M, N]`` (see ``_canonical``), activations
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

The residuals are fp8, quantized by the forward pass with their fp32 scales: the weight's
128 x 128 blocks (transposed, the blocks of :math:`b^\top` that the input gradient reads) and
``a`` in 1 x 128 tiles along the tokens (the weight gradient's contraction, a second
quantization of ``a``), along the same tiles as the backward pass would quantize the
high-precision operands. The fp8 values are the same, except that XLA may compute a tile's
``x / scale`` as ``x * (1 / scale)`` in one layout and not in the other, which can move a
value at a rounding tie; quantized once, the forward and backward passes read the same weight.
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
from jmp_lite.fp8._canonical import Results
from jmp_lite.fp8._quantize import quantize
from jmp_lite.fp8._sharding import check_local_tokens, computed_together, vary

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


def quantize_tiles(x: jax.Array, rows: int, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """``x [B, R, K]`` padded to whole ``rows x 128`` tiles: its fp8 values and fp32 tile scales."""
  x = _pad_to(_pad_to(x, 2, TILE), 1, rows)
  scale = tile_scales(x, rows, dtype)
  return quantize(x, _expand(scale, rows, TILE), dtype), scale


# Output rows per step of the loop over row tiles: the fp32 sum of one tile is at most
# ROW_TILE x N, however large M is.
ROW_TILE = 1024


def block_product(a, b, a_rows, b_rows, dtype, out_dtype, precision, axes=()) -> jax.Array:
  """``[B, M, K] x [B, N, K] -> [B, M, N]`` with tile scales and fp32 sums per 128 of K.

  ``axes``: ``shard_map`` axes K is split over, in whole tiles: the fp32 sums add over them.
  """
  q_a, q_b = quantize_tiles(a, a_rows, dtype), quantize_tiles(b, b_rows, dtype)
  shape = (a.shape[1], b.shape[1])
  return tiled_product(q_a, a_rows, q_b, b_rows, shape, out_dtype, precision, axes)


def tiled_product(a, a_rows, b, b_rows, shape, out_dtype, precision, axes=()) -> jax.Array:
  """The product of two quantized operands ``(q, scales)``, from :func:`quantize_tiles`.

  ``shape``: the ``(M, N)`` of the result before padding.
  """
  (q_a, s_a), (q_b, s_b) = a, b
  (batch, padded_m, padded_k), padded_n = q_a.shape, q_b.shape[1]
  chunks = padded_k // TILE
  row_a = jnp.repeat(s_a, a_rows, axis=1)  # [B, M, C]
  row_b = jnp.repeat(s_b, b_rows, axis=1).transpose(2, 0, 1)[..., None, :]  # [C, B, 1, N]
  q_b = q_b.reshape(batch, padded_n, chunks, TILE).transpose(2, 0, 1, 3)  # [C, B, N, 128]
  # Rows in R tiles of T (padded with zero rows, whose products are zero and sliced off).
  tiles = -(-padded_m // ROW_TILE)
  rows = -(-padded_m // tiles)
  q_a, row_a = _pad_to(q_a, 1, rows * tiles), _pad_to(row_a, 1, rows * tiles)
  # Under shard_map the sum varies over the axes its operands do (a loop carry keeps its type).
  varying = frozenset().union(*map(_compat.varying_axes, (q_a, q_b, row_a, row_b)))
  out = _zero_output(row_a, row_b, out_dtype, varying, axes)  # [B, R * T, N]
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

  def row_tile(i, out):
    # Loops keep one row tile's fp32 sum and one chunk's product alive, where a dot batched
    # over the chunks would write K / 128 fp32 products of the output's size.
    acc = vary(jnp.zeros((batch, rows, padded_n), F32), varying)
    acc, _ = lax.scan(add_chunk, acc, (q_a[i], q_b, row_a[i], row_b))
    acc = (lax.psum(acc, axes) if axes else acc).astype(out_dtype)
    return lax.dynamic_update_slice_in_dim(out, acc, i * rows, axis=1)

  out = lax.fori_loop(0, tiles, row_tile, out)
  return out[:, : shape[0], : shape[1]]


def _zero_output(row_a, row_b, out_dtype, varying, axes) -> jax.Array:
  """The zeros the loop over row tiles writes its tiles into, ``[B, M, N]``.

  They are computed from the operands' scales (finite, so times 0 is 0): XLA hoists a constant
  to the start of the program, where every product's output would then be allocated at once.
  Summed over ``axes``, the output is invariant over them, which the scales are not: there the
  zeros come from one scale summed over ``axes`` (a scalar all-reduce).
  """
  shape = (row_a.shape[0], row_a.shape[1], row_b.shape[-1])
  if axes:
    zeros = jnp.broadcast_to(lax.psum(row_a[0, 0, 0] * 0, axes), shape).astype(out_dtype)
  else:
    zeros = ((row_a[..., :1] * 0) * (row_b[0] * 0)).astype(out_dtype)
  return vary(zeros, varying - set(axes) - _compat.varying_axes(zeros))


class BlockSpec(NamedTuple):
  """The recipe's static config of one block-scaled matmul; weights in 128 x 128 blocks."""

  dtype: np.dtype
  precision: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def block_matmul(a, b, spec: BlockSpec, results: Results):
  """``[B, M, K] x [B, N, K] -> [B, M, N]``: 1 x 128 tiles for ``a``, blocks for ``b``."""
  check_local_tokens(a.shape[1], TILE, "BlockScaling", results.row_axes)
  return block_product(a, b, 1, TILE, spec.dtype, results.out_dtype, spec.precision)


def _t(x: jax.Array) -> jax.Array:
  return jnp.swapaxes(x, 1, 2)


def _fwd(a, b, spec, results):
  check_local_tokens(a.shape[1], TILE, "BlockScaling", results.row_axes)
  # The residuals are what the backward's products read, quantized here from the same values
  # along the same tiles: the weight's blocks, which transposed are the blocks of b^T; a in
  # 1 x 128 tiles along the tokens. The barrier makes them the residuals: without it XLA may
  # quantize again in the backward pass, keeping the high-precision operands alive instead.
  q_b, q_at = lax.optimization_barrier(
    (quantize_tiles(b, TILE, spec.dtype), quantize_tiles(_t(a), 1, spec.dtype))
  )
  q_a, shape = quantize_tiles(a, 1, spec.dtype), (a.shape[1], b.shape[1])
  out = tiled_product(q_a, 1, q_b, TILE, shape, results.out_dtype, spec.precision)
  return out, (q_b, q_at)


def _bwd(spec, results, residuals, g):
  (q_b, s_b), q_at = residuals
  (m, n), k = g.shape[1:], q_at[0].shape[1]
  # da = g . b^T: g in 1 x 128 tiles along N; the weight's 128 x 128 blocks, transposed.
  q_g = quantize_tiles(g, 1, spec.dtype)
  da = tiled_product(q_g, 1, (_t(q_b), _t(s_b)), TILE, (m, k), results.a_dtype, spec.precision)
  # db = g^T . a^T: both in 1 x 128 tiles along the tokens (128 x 1 in their own layout).
  q_gt = quantize_tiles(_t(g), 1, spec.dtype)
  db = tiled_product(q_gt, 1, q_at, 1, (n, k), results.b_dtype, spec.precision, results.row_axes)
  return computed_together(da, db)


block_matmul.defvjp(_fwd, _bwd)
