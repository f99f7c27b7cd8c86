"""Broadcasts whose gradient is a sum: computed in fp32.

The derivative of a broadcast (a bias added to every row, a norm's scale, the statistic a
``keepdims`` mean hands back) sums the cotangent over the broadcast axes: JAX transposes an
explicit ``broadcast_in_dim``, or the size-1 axes an elementwise operation broadcasts, into a
``reduce_sum`` in the cotangent's dtype. For a 16-bit value that is a long sum in 16 bits (bf16
keeps 8 significant bits: the 257th of 256 equal terms is lost). The broadcasts below compute
as written and state their tangent through fp32, so that the transposed program sums in fp32
and rounds once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

_F32 = np.dtype(np.float32)

# Elementwise primitives whose derivative with respect to a broadcast operand needs no broadcast
# value (so none is ever a residual).
ELEMENTWISE = frozenset({"add", "add_any", "sub", "mul"})


def broadcast_summing_in_fp32(broadcast: Callable[[Any], Any], x: Any) -> Any:
  """``broadcast(x)``, its derivative's sum over the broadcast axes in fp32.

  Args:
    broadcast: a broadcast of ``x`` (linear in ``x``).
    x: the 16-bit operand.

  Returns:
    ``broadcast(x)``, in ``x``'s dtype.
  """

  @jax.custom_jvp
  def run(x):
    return broadcast(x)

  @run.defjvp
  def run_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # Linear in t: transposed, the fp32 broadcast becomes an fp32 sum of the cotangent.
    return run(x), broadcast(t.astype(_F32)).astype(t.dtype)

  return run(x)


def elementwise_summing_in_fp32(op: Callable[..., Any], args: list[Any], shape: tuple) -> Any:
  """``op(*args)`` (an elementwise operation broadcasting size-1 axes), the gradients of its
  broadcast 16-bit operands summed in fp32.

  Forward, ``op`` runs on the operands as given (nothing is broadcast in memory). Its tangent
  is the sum of one term per differentiated operand; the term of a broadcast operand takes its
  tangent broadcast through fp32, so that its transpose sums the cotangent in fp32. The
  operations are those of :data:`ELEMENTWISE`, whose derivative with respect to that operand
  needs no broadcast value: the backward pass keeps what it keeps for ``op``.

  Args:
    op: the operation, e.g. ``lax.mul``.
    args: its operands.
    shape: the result's shape.

  Returns:
    ``op(*args)``.
  """

  def full(x):
    dims = tuple(range(len(shape) - np.ndim(x), len(shape)))  # a scalar, or size-1 axes
    return jax.lax.broadcast_in_dim(x, shape, dims)

  @jax.custom_jvp
  def run(*args):
    return op(*args)

  def run_jvp(primals, tangents):
    out, total = run(*primals), None
    for i, t in enumerate(tangents):
      if isinstance(t, SymbolicZero):
        continue
      x = primals[i]
      if np.shape(x) != tuple(shape):  # a broadcast operand: its tangent through fp32
        x, t = full(x), full(t.astype(_F32)).astype(t.dtype)
      term = jax.jvp(lambda x, i=i: op(*primals[:i], x, *primals[i + 1 :]), (x,), (t,))[1]
      total = term if total is None else total + term
    return out, jnp.zeros_like(out) if total is None else total

  run.defjvp(run_jvp, symbolic_zeros=True)
  return run(*args)
