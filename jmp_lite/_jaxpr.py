"""Private helpers for walking jaxprs, shared by ``jmp_lite._audit`` and :mod:`diagnostics`.

Only ``jax.extend.core`` types (from :mod:`jmp_lite._compat`) and documented jaxpr
attributes (``eqns``, ``invars``, ``outvars``, ``params``, ``source_info``) are used, so the walk
does not depend on which primitives carry sub-jaxprs: every ``Jaxpr`` or
``ClosedJaxpr`` found in an equation's params (``jit``, ``scan``, ``cond``
branches, ``while`` bodies, ``custom_jvp_call``, ``custom_vjp_call``,
``checkpoint``/``remat``, ``shard_map``...) is visited.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from jmp_lite import _compat

# Ops that only move or re-type values.
TRANSPARENT = frozenset(
  {
    "convert_element_type",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "stop_gradient",
    "copy",
    "copy_p",
    "transpose",
    "reduce_precision",
  }
)

# Primitives that run their sub-jaxpr once on their operands (a function call):
# values flow in and out one to one. Loops (scan, while) and branches (cond) do
# not qualify for mapping outputs back, since their outputs are not the result
# of a single run of one sub-jaxpr.
_LOOP_PRIMITIVES = frozenset({"scan", "while", "cond", "fori_loop"})


class SubJaxpr(NamedTuple):
  """A sub-jaxpr of an equation and how the equation's operands bind to it."""

  jaxpr: Any  # jax.extend.core.Jaxpr
  consts: Sequence[Any]  # values of jaxpr.constvars (empty for open jaxprs)
  # For each of jaxpr.invars, the equation operand (Var or Literal) it receives,
  # or None when the binding is not a plain positional one.
  bindings: tuple[Any, ...]
  # Whether jaxpr.outvars are, one to one, the equation's outvars.
  returns_outputs: bool


def _jaxprs_in(value: Any) -> Iterator[tuple[Any, Sequence[Any]]]:
  if isinstance(value, _compat.extend_core().ClosedJaxpr):
    yield value.jaxpr, value.consts
  elif isinstance(value, _compat.extend_core().Jaxpr):
    yield value, ()
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _jaxprs_in(item)


def sub_jaxprs(eqn: Any) -> list[SubJaxpr]:
  """The sub-jaxprs of ``eqn`` with their operand bindings."""
  found = [(name, j, c) for name, value in eqn.params.items() for j, c in _jaxprs_in(value)]
  out = []
  for name, jaxpr, consts in found:
    n_in = len(jaxpr.invars)
    operands = list(eqn.invars)
    if eqn.primitive.name == "while" and name == "cond_jaxpr":
      # while operands: cond consts, body consts, carry; cond sees cond consts + carry.
      nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
      operands = operands[:nc] + operands[nc + nb :]
    if n_in == len(operands):
      bindings = tuple(operands)
    elif n_in < len(operands):
      # cond: the predicate comes first; while body: cond consts come first.
      bindings = tuple(operands[len(operands) - n_in :])
    else:
      bindings = (None,) * n_in
    returns = (
      len(found) == 1
      and eqn.primitive.name not in _LOOP_PRIMITIVES
      and len(jaxpr.outvars) == len(eqn.outvars)
    )
    out.append(SubJaxpr(jaxpr, consts, bindings, returns))
  return out


def is_literal(atom: Any) -> bool:
  """Whether ``atom`` is a literal (a constant written into the jaxpr), not a variable."""
  return isinstance(atom, _compat.extend_core().Literal)


def dtype_of(atom: Any) -> np.dtype | None:
  """The numpy dtype of a jaxpr atom; None for tokens and extended dtypes (PRNG keys)."""
  dtype = getattr(getattr(atom, "aval", None), "dtype", None)
  try:
    return np.dtype(dtype) if dtype is not None else None
  except TypeError:
    return None


def shape_of(atom: Any) -> tuple[int, ...]:
  """The shape of a jaxpr atom (``()`` when it has none)."""
  return tuple(getattr(getattr(atom, "aval", None), "shape", ()))


def aval_str(atom: Any) -> str:
  """The short type of a jaxpr atom, e.g. ``"float16[2,4]"``."""
  aval = getattr(atom, "aval", None)
  return aval.str_short() if aval is not None else repr(atom)


def path_name(path: Sequence[Any]) -> str:
  """``"params/Dense_0/kernel"`` for a pytree key path."""
  parts = []
  for key in path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)
