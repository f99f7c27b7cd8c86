"""The forward order of a model's parameters, read from its jaxpr."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import jax

from jmp_lite import _jaxpr

# Ops that move, copy or annotate values without computing with them, besides the casts and
# reshapes of `_jaxpr.TRANSPARENT`: `eqx.filter_shard`, `nn.with_logical_constraint` and FSDP
# code put a sharding constraint on every parameter before the model runs, so counting them
# as uses would give tree order. Output i is operand i when the counts match.
_PASS_THROUGH = _jaxpr.TRANSPARENT | {
  "sharding_constraint",
  "reshard",
  "mesh_cast",
  "layout_constraint",
  "shard_alike",
  "device_put",
  "optimization_barrier",
  "name",  # jax.ad_checkpoint.checkpoint_name
  "pvary",
}


def parameter_order(fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> tuple:
  """The leaf names of ``params`` in the order ``fn`` first computes with them.

  ``fn`` is traced, not run. Ops that only move, copy or annotate values are
  not uses: casts, reshapes and broadcasts (a policy casting every parameter up
  front does not decide the order), sharding constraints
  (``jax.lax.with_sharding_constraint``, ``eqx.filter_shard``,
  ``nn.with_logical_constraint``), ``device_put``, copies, optimization
  barriers and ``checkpoint_name``; values are followed through them and
  through ``jit`` and other call boundaries. The first real operation is the
  use. This is the forward order of the layers, which :func:`likely_culprits`
  needs.

  Args:
    fn: called as ``fn(params, *args, **kwargs)``, e.g. the loss function.
    params: a pytree of parameters.
    *args: the other positional arguments of ``fn``.
    **kwargs: the keyword arguments of ``fn``.

  Returns:
    A tuple of ``"a/b/c"`` path names (``"params/Dense_0/kernel"``...), one
    per leaf of ``params``: used leaves in the order of their first use, then
    unused ones in tree order.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  names = [_jaxpr.path_name(p) for p, _ in leaves]
  closed = jax.make_jaxpr(lambda p: fn(p, *args, **kwargs))(params)
  first: dict[str, int] = {}
  counter = itertools.count()
  nobody: frozenset[str] = frozenset()

  def walk(jaxpr, owners: dict[Any, frozenset[str]]) -> None:
    """Records first uses in ``jaxpr``; ``owners`` (var -> the leaves it carries) grows."""
    for eqn in jaxpr.eqns:
      position = next(counter)
      carried = [nobody if _jaxpr.is_literal(v) else owners.get(v, nobody) for v in eqn.invars]
      used = nobody.union(*carried)
      if not used:
        continue
      if eqn.primitive.name in _PASS_THROUGH:
        one_to_one = len(eqn.invars) == len(eqn.outvars)
        for i, v in enumerate(eqn.outvars):
          if one_to_one and carried[i]:
            owners[v] = carried[i]
          elif not one_to_one:
            owners[v] = used
        continue
      bound = set()
      for sub in _jaxpr.sub_jaxprs(eqn):
        inner = {}
        for var, atom in zip(sub.jaxpr.invars, sub.bindings, strict=True):
          if atom is not None and not _jaxpr.is_literal(atom) and atom in owners:
            inner[var] = owners[atom]
            bound.add(atom)
        walk(sub.jaxpr, inner)
        if sub.returns_outputs:  # a call (jit, remat, custom_jvp): follow values out of it
          for outer, out in zip(eqn.outvars, sub.jaxpr.outvars, strict=True):
            if not _jaxpr.is_literal(out) and inner.get(out):
              owners[outer] = inner[out]
      for v in eqn.invars:  # operands used directly here
        if not _jaxpr.is_literal(v) and v in owners and v not in bound:
          for name in owners[v]:
            first.setdefault(name, position)

  walk(closed.jaxpr, {v: frozenset([n]) for v, n in zip(closed.jaxpr.invars, names, strict=True)})
  ranked = sorted(enumerate(names), key=lambda item: (first.get(item[1], math.inf), item[0]))
  return tuple(name for _, name in ranked)
