"""The forward order of a model's parameters, read from its jaxpr."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import jax

from jmp_lite import _jaxpr


def parameter_order(fn: Callable[..., Any], params: Any, *args: Any, **kwargs: Any) -> tuple:
  """The leaf names of ``params`` in the order ``fn`` first computes with them.

  ``fn`` is traced, not run. Casts, reshapes and broadcasts are not uses (a
  policy casting every parameter up front does not decide the order); the
  first real operation is. This is the forward order of the layers, which
  :func:`likely_culprits` needs.

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

  def walk(jaxpr, owners: dict[Any, frozenset[str]]):
    for eqn in jaxpr.eqns:
      position = next(counter)
      used = frozenset().union(
        *(owners.get(v, frozenset()) for v in eqn.invars if not _jaxpr.is_literal(v))
      )
      if not used:
        continue
      if eqn.primitive.name in _jaxpr.TRANSPARENT:
        for v in eqn.outvars:
          owners[v] = used
        continue
      subs = _jaxpr.sub_jaxprs(eqn)
      bound = set()
      for sub in subs:
        inner = {}
        for var, atom in zip(sub.jaxpr.invars, sub.bindings, strict=True):
          if atom is not None and not _jaxpr.is_literal(atom) and atom in owners:
            inner[var] = owners[atom]
            bound.add(atom)
        walk(sub.jaxpr, inner)
      for v in eqn.invars:  # operands used directly here
        if not _jaxpr.is_literal(v) and v in owners and v not in bound:
          for name in owners[v]:
            first.setdefault(name, position)

  walk(closed.jaxpr, {v: frozenset([n]) for v, n in zip(closed.jaxpr.invars, names, strict=True)})
  ranked = sorted(enumerate(names), key=lambda item: (first.get(item[1], math.inf), item[0]))
  return tuple(name for _, name in ranked)
