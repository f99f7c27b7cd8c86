"""Graph queries over a jaxpr: who produces a value, who uses it, what a statistic comes from.

Checks recognise patterns (``exp`` divided by its own sum, ``rsqrt`` of a
variance) by following variables through operations that only move or
re-type values. Every search is bounded, so a large model stays linear.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple

from jmp_lite import _jaxpr

# Ops that only move or re-type values: patterns are matched through them.
TRANSPARENT = _jaxpr.TRANSPARENT
# Ops a denominator or a variance may pass through between its reduction and
# its use: ``var + eps``, ``mean = sum / n``, ``sqrt``, ``max(norm, eps)``.
STATS_THROUGH = TRANSPARENT | {"add", "sub", "mul", "div", "max", "sqrt", "rsqrt", "integer_pow"}
# Reductions that add up (or multiply) their values, so their rounding errors
# and their range grow with the number of values.
ACCUMULATING = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})
EXPONENTIALS = frozenset({"exp", "exp2", "expm1"})


class Graph:
  """Producers and consumers of the variables of one jaxpr.

  Args:
    jaxpr: a ``jax.extend.core.Jaxpr``.
  """

  def __init__(self, jaxpr: Any) -> None:
    self.producer: dict[Any, Any] = {}
    self.consumers: dict[Any, list[Any]] = {}
    for eqn in jaxpr.eqns:
      for v in eqn.outvars:
        self.producer[v] = eqn
      for v in eqn.invars:
        if not _jaxpr.is_literal(v):
          self.consumers.setdefault(v, []).append(eqn)

  def sources(self, atom: Any, through: Collection[str]) -> Iterator[Any]:
    """The producers reachable back from ``atom`` through ``through`` ops.

    Args:
      atom: a variable (or literal) of the jaxpr.
      through: the primitives to look through (all their operands; only the
        cases of a ``select_n``).

    Yields:
      The first equations back from ``atom`` that are not of ``through``.
    """
    todo: list[Any] = [atom]
    seen: set[Any] = set()
    while todo and len(seen) < 64:
      a = todo.pop()
      if _jaxpr.is_literal(a) or a in seen:
        continue
      seen.add(a)
      eqn = self.producer.get(a)
      if eqn is None:
        continue
      name = eqn.primitive.name
      if name in through or name == "select_n":
        todo.extend(eqn.invars[1:] if name == "select_n" else eqn.invars)
      else:
        yield eqn

  def forward(self, var: Any) -> list[Any]:
    """``var`` and the variables derived from it through transparent ops.

    Args:
      var: a variable of the jaxpr.

    Returns:
      ``var`` first, then its reshapes, casts, broadcasts... (at most 64).
    """
    out: list[Any] = []
    todo: list[Any] = [var]
    while todo and len(out) < 64:
      v = todo.pop()
      out.append(v)
      for eqn in self.consumers.get(v, ()):
        if eqn.primitive.name in TRANSPARENT:
          todo.extend(eqn.outvars)
    return out

  def consumers_of(self, variables: Collection[Any], primitives: Collection[str]) -> Iterator[Any]:
    """The equations of ``primitives`` that use one of ``variables``.

    Args:
      variables: variables of the jaxpr.
      primitives: the primitive names wanted.

    Yields:
      Each matching equation once per variable it uses.
    """
    for v in variables:
      for eqn in self.consumers.get(v, ()):
        if eqn.primitive.name in primitives:
          yield eqn

  def back(self, atom: Any, through: Collection[str]) -> tuple[Any | None, list[Any], Any]:
    """Follows ``atom`` back through ``through`` ops along their first non-literal operand.

    Args:
      atom: a variable (or literal) of the jaxpr.
      through: the primitives to look through.

    Returns:
      ``(producer, chain, var)``: the first producer of another primitive (or
      None), the equations passed through, and the variable that producer outputs.
    """
    chain: list[Any] = []
    for _ in range(32):
      if _jaxpr.is_literal(atom):
        return None, chain, atom
      eqn = self.producer.get(atom)
      if eqn is None or eqn.primitive.name not in through:
        return eqn, chain, atom
      chain.append(eqn)
      atoms = [a for a in eqn.invars if not _jaxpr.is_literal(a)]
      if not atoms:
        return None, chain, atom
      atom = atoms[0]
    return None, chain, atom


class GraphCache:
  """One :class:`Graph` per jaxpr, built on first use."""

  def __init__(self) -> None:
    self._graphs: dict[int, tuple[Any, Graph]] = {}

  def __call__(self, jaxpr: Any) -> Graph:
    """The graph of ``jaxpr``.

    Args:
      jaxpr: a ``jax.extend.core.Jaxpr``.

    Returns:
      Its :class:`Graph`, the same object on every call.
    """
    entry = self._graphs.get(id(jaxpr))
    if entry is None or entry[0] is not jaxpr:
      entry = self._graphs[id(jaxpr)] = (jaxpr, Graph(jaxpr))
    return entry[1]


class Call(NamedTuple):
  """A call (``jit``, ``scan``, ``checkpoint``...) whose jaxpr holds the values looked at."""

  graph: Graph  # the graph of the jaxpr that holds the call
  eqn: Any  # the calling equation
  jaxpr: Any  # the called jaxpr
  # The call's operand bound to each input of ``jaxpr`` (None where the binding is unknown).
  bindings: tuple[Any, ...]


class Located(NamedTuple):
  """A variable, the graph of its jaxpr, and the calls that jaxpr is nested in (outermost first)."""

  graph: Graph
  atom: Any
  calls: tuple[Call, ...] = ()


def defining(loc: Located) -> tuple[Located, Any | None]:
  """Where a variable is computed: an input of a called jaxpr is the operand its call binds.

  Args:
    loc: the variable.

  Returns:
    ``(where, producer)``: the variable (in the outermost jaxpr it can be
    followed out to) and the equation that computes it there, or None for a
    literal or an input that is not followed further (of the audited jaxpr:
    ``where.calls`` is then empty; else of the call ``where.calls[-1]``).
  """
  for _ in range(len(loc.calls) + 1):
    if _jaxpr.is_literal(loc.atom):
      return loc, None
    eqn = loc.graph.producer.get(loc.atom)
    if eqn is not None or not loc.calls:
      return loc, eqn
    call = loc.calls[-1]
    invars = list(call.jaxpr.invars)
    operand = call.bindings[invars.index(loc.atom)] if loc.atom in invars else None
    if operand is None:
      return loc, None
    loc = Located(call.graph, operand, loc.calls[:-1])
  return loc, None


def upstream(
  graphs: GraphCache,
  loc: Located,
  follow: Callable[[Any], bool] = lambda atom: True,
  limit: int = 64,
) -> Iterator[tuple[Any, Located]]:
  """The equations a variable is computed from, nearest first, across the calls on the way.

  Follows the operands back (those ``follow`` accepts): out of a called jaxpr
  to its call's operands, and into a call that computes an operand
  (``jnp.var``'s ``jit``) to the equations that compute it inside.

  Args:
    graphs: the graphs of the jaxprs met on the way.
    loc: the variable.
    follow: whether to look at what an operand is computed from.
    limit: the most variables visited.

  Yields:
    ``(equation, where)``: each equation (calls excepted) with the
    :class:`Located` of its operands' jaxpr.
  """
  todo = [loc]
  seen: set[tuple[int, Any]] = set()
  while todo and len(seen) < limit:
    where, eqn = defining(todo.pop(0))
    if eqn is None or (id(where.graph), where.atom) in seen:
      continue
    seen.add((id(where.graph), where.atom))
    inner = [sub for sub in _jaxpr.sub_jaxprs(eqn) if sub.returns_outputs]
    if inner and len(where.calls) < 8:
      (sub,) = inner
      out = sub.jaxpr.outvars[list(eqn.outvars).index(where.atom)]
      call = Call(where.graph, eqn, sub.jaxpr, sub.bindings)
      todo.append(Located(graphs(sub.jaxpr), out, (*where.calls, call)))
      continue
    yield eqn, where
    todo.extend(Located(where.graph, a, where.calls) for a in eqn.invars if follow(a))


def reduction_origin(graphs: GraphCache, graph: Graph, atom: Any) -> tuple[Any, list[Any]]:
  """The sum/product a statistic comes from, and the equations in between.

  Searches back from ``atom`` through transparent ops, ``select_n`` cases and
  at most three arithmetic steps (``var + eps``, ``sum / n``, ``sqrt``,
  ``E[x^2] - E[x]^2``), into calls such as ``jnp.var``'s jit and back out of
  them. The budget keeps an ordinary activation (which, far enough back,
  always comes from some LayerNorm's statistics) from counting as one.

  Args:
    graphs: the graphs of the jaxprs met on the way.
    graph: the graph of the jaxpr that holds ``atom``.
    atom: the statistic.

  Returns:
    ``(reduction, chain)``: the accumulating equation (or None) and the
    equations passed on the way to it.
  """
  # (graph, atom, eqns passed, arithmetic steps, the calls we are inside of)
  stack: list[tuple[Graph, Any, list[Any], int, tuple]] = [(graph, atom, [], 0, ())]
  seen: set[tuple[int, Any]] = set()
  while stack and len(seen) < 128:
    g, a, chain, steps, calls = stack.pop()
    if _jaxpr.is_literal(a) or (id(g), a) in seen:
      continue
    seen.add((id(g), a))
    eqn = g.producer.get(a)
    if eqn is None:  # an input of a called jaxpr: continue at the call's operand
      if calls:
        outer, jaxpr, bindings = calls[-1]
        operand = bindings[list(jaxpr.invars).index(a)] if a in jaxpr.invars else None
        if operand is not None:
          stack.append((outer, operand, chain, steps, calls[:-1]))
      continue
    name = eqn.primitive.name
    if name in ACCUMULATING:
      return eqn, chain
    free = name in TRANSPARENT or name == "select_n"
    if free or (name in STATS_THROUGH and steps < 3):
      operands = eqn.invars[1:] if name == "select_n" else eqn.invars
      for op in reversed(operands):
        stack.append((g, op, [*chain, eqn], steps + (not free), calls))
      continue
    if len(calls) < 4:
      for sub in _jaxpr.sub_jaxprs(eqn):
        if sub.returns_outputs:  # e.g. jnp.var's jit: look inside
          inner = sub.jaxpr.outvars[list(eqn.outvars).index(a)]
          call = (g, sub.jaxpr, sub.bindings)
          stack.append((graphs(sub.jaxpr), inner, [*chain, eqn], steps, (*calls, call)))
  return None, []


def nonpositive_argument(graph: Graph, eqn: Any) -> bool:
  """Whether an exp's argument is ``x - max(x)``, so that its result is at most 1.

  Args:
    graph: the graph of the jaxpr that holds ``eqn``.
    eqn: an ``exp``/``exp2``/``expm1`` equation.

  Returns:
    True when the argument subtracts a ``reduce_max``.
  """
  src, _, _ = graph.back(eqn.invars[0], TRANSPARENT)
  if src is None or src.primitive.name != "sub":
    return False
  shifts = graph.sources(src.invars[1], TRANSPARENT | {"max"})
  return any(e.primitive.name == "reduce_max" for e in shifts)


def reduced_size(eqn: Any) -> int:
  """The number of values a reduction (or cumulative op) combines into each result.

  Args:
    eqn: a ``reduce_*`` or ``cum*`` equation.

  Returns:
    The product of the reduced axes' sizes.
  """
  shape = _jaxpr.shape_of(eqn.invars[0])
  if "axes" in eqn.params:
    return math.prod(shape[a] for a in eqn.params["axes"])
  if "axis" in eqn.params and shape:
    return shape[eqn.params["axis"]]
  return math.prod(shape)


def contraction_size(eqn: Any) -> int:
  """The number of products summed into each result of a dot_general / convolution.

  Args:
    eqn: a ``dot_general`` or ``conv_general_dilated`` equation.

  Returns:
    The contraction length (for a convolution: the kernel's size per output feature).
  """
  lhs, rhs = eqn.invars[:2]
  if eqn.primitive.name == "dot_general":
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    return math.prod(_jaxpr.shape_of(lhs)[d] for d in lhs_contract)
  out_feature_dim = eqn.params["dimension_numbers"].rhs_spec[0]
  shape = _jaxpr.shape_of(rhs)
  return math.prod(shape) // max(shape[out_feature_dim], 1)
