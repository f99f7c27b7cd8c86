"""The canonical form ``[B, M, K] x [B, N, K] -> [B, M, N]`` of an fp8 matmul (private).

The row-wise, block and MXFP8 matmuls quantize along rows, tiles and blocks of the
contraction, so each takes its operands with the batch, free and contracting axes flattened,
the contraction last: :func:`canonical_dot` brings any ``dot_general`` call to that form and
hands the matmul the :class:`Results` the call asks for.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from jmp_lite.fp8._matmul import DotCall
from jmp_lite.fp8._sharding import merge_axes, rows_local, split_axes


class Results(NamedTuple):
  """What a call asks of a canonical matmul's results ``y``, ``da`` and ``db`` (static)."""

  out_dtype: np.dtype  # y's: the call's result dtype
  a_dtype: np.dtype  # da's: the lhs's dtype
  b_dtype: np.dtype  # db's: the rhs's dtype
  row_axes: tuple = ()  # shard_map axes the rows of ``a`` (the tokens) are split over


def canonical_dot(call: DotCall, matmul: Any) -> jax.Array:
  """Runs ``matmul([B, M, K], [B, N, K], results) -> [B, M, N]`` for any ``dot_general`` call.

  Transposes and reshapes both operands to the canonical form (batch, free, contracting
  axes, flattened), and the result back to ``dot_general``'s layout (batch, lhs free, rhs
  free); JAX differentiates the reshapes. On explicit mesh axes the matmul runs per device on
  its rows (:func:`~jmp_lite.fp8._sharding.rows_local`), ``results.row_axes`` naming the mesh
  axes the rows are split over (``()`` otherwise).
  """
  (lc, rc), (lb, rb) = call.dims
  lhs, rhs = call.lhs, call.rhs
  free = lambda x, c, b: [i for i in range(x.ndim) if i not in c and i not in b]
  lf, rf = free(lhs, lc, lb), free(rhs, rc, rb)
  a = merge_axes(lax.transpose(lhs, (*lb, *lf, *lc)), (len(lb), len(lf), len(lc)))
  b = merge_axes(lax.transpose(rhs, (*rb, *rf, *rc)), (len(rb), len(rf), len(rc)))
  results = Results(call.out_dtype, lhs.dtype, rhs.dtype)
  out = rows_local(lambda a, b, axes: matmul(a, b, results._replace(row_axes=axes)), a, b)
  shape = [lhs.shape[i] for i in lb] + [lhs.shape[i] for i in lf] + [rhs.shape[i] for i in rf]
  out = split_axes(out, (len(lb), len(lf), len(rf)), shape)
  if call.out_sharding is not None:
    out = jax.sharding.reshard(out, call.out_sharding)
  return out
