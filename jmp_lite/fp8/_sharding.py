"""How the fp8 matmul types its results under shard_map and explicit sharding (private).

The mesh axes an array varies over under ``shard_map`` come from
:func:`jmp_lite._compat.varying_axes`; an array is marked as varying with
``lax.pcast``.
"""

from __future__ import annotations

import math
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


def _spec(x: jax.Array) -> tuple | None:
  """``x``'s partition spec, one entry per axis, if it is sharded over explicit mesh axes."""
  sharding = jax.typeof(x).sharding
  if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh.empty:
    return None
  spec = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
  return spec if any(entry is not None for entry in spec) else None


def _axes(entry: Any) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def rows_local(matmul: Any, a: jax.Array, b: jax.Array) -> jax.Array:
  r"""Runs a canonical ``matmul(a, b, row_axes)`` (``[B, M, K] x [B, N, K]``) on explicit axes.

  Outside explicit sharding it is ``matmul(a, b, ())``. When an operand is sharded over
  explicit mesh axes, the block and row-wise quantizations need whole rows and whole tiles,
  which JAX's explicit typing refuses to reshape across shards; so the matmul runs under
  ``shard_map`` with ``a``'s batch and rows (the tokens) sharded as they are, its contraction
  gathered, and ``b`` (the weight) gathered, as FSDP gathers a weight for its matmul. Each
  device then computes its rows of the output and of the input gradient as one device would.
  The weight gradient contracts the tokens, which are sharded over ``row_axes``: the matmul
  reduces its scales (``pmax``) and its fp32 sums (``psum``) over them.

  Args:
    matmul: ``matmul(a, b, row_axes) -> [B, M, N]``, differentiable.
    a: the ``[B, M, K]`` operand.
    b: the ``[B, N, K]`` operand.

  Returns:
    The ``[B, M, N]`` product, sharded as ``a``'s batch and rows.
  """
  spec_a, spec_b = _spec(a), _spec(b)
  if spec_a is None and spec_b is None:
    return matmul(a, b, ())
  mesh = jax.typeof(a if spec_a is not None else b).sharding.mesh
  batch, rows = (spec_a or (None, None, None))[:2]
  spec = jax.sharding.PartitionSpec
  a_spec, b_spec = spec(batch, rows, None), spec(batch, None, None)
  a = jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, a_spec))
  b = jax.sharding.reshard(b, jax.sharding.NamedSharding(mesh, b_spec))
  row_axes = _axes(rows)
  local = jax.shard_map(
    lambda a, b: matmul(a, b, row_axes), mesh=mesh, in_specs=(a_spec, b_spec), out_specs=a_spec
  )
  return local(a, b)


def _named(x: jax.Array, spec: Any) -> Any:
  return jax.sharding.NamedSharding(jax.typeof(x).sharding.mesh, jax.sharding.PartitionSpec(*spec))


def merge_axes(x: jax.Array, groups: tuple[int, ...]) -> jax.Array:
  """``x`` reshaped so that each output axis merges the next ``groups[i]`` axes of ``x``.

  On explicit mesh axes a merged axis keeps the sharding of its first axis (the others are
  gathered first), which is the layout of the merged values; elsewhere a plain reshape.
  """
  spec = _spec(x)
  starts = [sum(groups[:i]) for i in range(len(groups))]
  sizes = [math.prod(x.shape[s : s + n]) for s, n in zip(starts, groups, strict=True)]
  if spec is None:
    return x.reshape(sizes)
  kept = [spec[i] if any(s == i and n for s, n in zip(starts, groups, strict=True)) else None
          for i in range(x.ndim)]  # fmt: skip
  if kept != list(spec):
    x = jax.sharding.reshard(x, _named(x, kept))
  merged = [spec[s] if n else None for s, n in zip(starts, groups, strict=True)]
  return lax.reshape(x, sizes, out_sharding=_named(x, merged))


def split_axes(x: jax.Array, groups: tuple[int, ...], shape: list[int]) -> jax.Array:
  """The inverse of :func:`merge_axes`: axis ``i`` of ``x`` split into ``groups[i]`` axes.

  On explicit mesh axes the first of the split axes keeps the sharding when its size divides
  evenly over it (else the axis is gathered first).
  """
  spec = _spec(x)
  if spec is None:
    return x.reshape(shape)
  mesh, kept, out, start = jax.typeof(x).sharding.mesh, list(spec), [], 0
  for i, n in enumerate(groups):
    entry = spec[i] if n else None
    devices = math.prod(mesh.shape[a] for a in _axes(entry))
    if entry is not None and shape[start] % devices:
      kept[i] = entry = None
    out += [entry] + [None] * (n - 1) if n else []
    start += n
  if kept != list(spec):
    x = jax.sharding.reshard(x, _named(x, kept))
  return lax.reshape(x, shape, out_sharding=_named(x, out))


def computed_together(da: jax.Array, db: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The two gradients of a matmul's backward, behind one barrier, so that XLA computes both
  before either is used: the residuals and the output gradient they read are then freed at
  once, not kept alive until the later of the two is scheduled.

  Under ``shard_map`` a barrier gives its results the union of its operands' varying axes;
  where the two gradients vary over different axes (the weight gradient summed over the
  tokens' axes), they are returned as they are.
  """
  if _compat.varying_axes(da) != _compat.varying_axes(db):
    return da, db
  return lax.optimization_barrier((da, db))


def check_local_tokens(tokens: int, tile: int, recipe: str, axes: tuple) -> None:
  """Raises unless each device's share of the tokens is whole tiles (blocks) of the weight
  gradient: a tile split across devices would be quantized with two scales."""
  if axes and tokens % tile:
    raise ValueError(
      f"{recipe} on explicit mesh axes {axes}: each device's tokens ({tokens}) must be a "
      f"multiple of {tile}, the weight gradient's tiles along the tokens, for the sharded "
      "program to quantize as one device does."
    )
