"""How the fp8 matmul types its results under shard_map and explicit sharding (private).

The mesh axes an array varies over under ``shard_map`` come from
:func:`jmp_lite._compat.varying_axes`; an array is marked as varying with
``lax.pcast``.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax

from jmp_lite import _compat


def _sorted_axes(axes: frozenset) -> tuple:
  return tuple(sorted(axes, key=str))


def vary(x: jax.Array, axes: frozenset) -> jax.Array:
  """Marks an invariant x as varying over ``axes`` (its transpose sums over them)."""
  if not axes:
    return x
  return lax.pcast(x, _sorted_axes(axes), to="varying")


def vary_like_union(*xs: jax.Array) -> tuple[frozenset, tuple[jax.Array, ...]]:
  """The union of the axes the arrays vary over, and each array made to vary over all of it.

  Like any JAX op, the matmul works on the union of its operands' axes (the
  cotangent of an operand that was invariant is then summed over the axes it
  was broadcast along).
  """
  axes = frozenset().union(*(_compat.varying_axes(x) for x in xs))
  return axes, tuple(vary(x, axes - _compat.varying_axes(x)) for x in xs)


def match_varying(amax: jax.Array, axes: frozenset) -> jax.Array:
  """Gives an observed amax the probe's shard_map type: max over the extra axes.

  JAX would otherwise *sum* the cotangent over the axes the probe is
  invariant along, as it does for parameters; an amax must be max-reduced.
  """
  have = _compat.varying_axes(amax)
  if have - axes:
    amax = lax.pmax(amax, _sorted_axes(have - axes))
  return vary(amax, axes - have)


def result_sharding(operand: jax.Array, axes: list[int]) -> Any:
  """The sharding of a cotangent computed with its axes in the order ``axes``.

  Under explicit sharding a matmul that contracts a sharded axis needs its
  output sharding spelled out; a cotangent is sharded like its primal, whose
  spec is permuted here to the matmul's output order (as JAX's own transpose
  rule for dot_general does). ``None`` outside explicit sharding.
  """
  sharding = jax.typeof(operand).sharding
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return None
  if sharding.mesh.empty:  # an unsharded operand inside a computation over a mesh
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return None
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*([None] * len(axes))))
  spec = tuple(sharding.spec) + (None,) * (operand.ndim - len(sharding.spec))
  return jax.sharding.NamedSharding(
    sharding.mesh, jax.sharding.PartitionSpec(*(spec[a] for a in axes))
  )
