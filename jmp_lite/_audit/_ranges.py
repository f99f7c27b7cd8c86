r"""Value ranges: an interval per value, to tell which casts can overflow.

Every value of the audited program gets a :class:`Range` :math:`[lo, hi]`
that contains it (NaN aside): literals and closed-over constants give exact
ones, inputs and parameters :data:`UNKNOWN`, and each primitive maps its
operands' ranges to its result's by a pure *transfer function*,
``TRANSFER[primitive](ranges, facts)``. A value whose bounds are unknown
because a range-expanding operation made it (an ``exp``, a power, a long sum)
carries that operation's name, :attr:`Range.expanded_by`: the ``cast`` check
reports it when it is cast to a narrower format.

Ranges are a static over-approximation: a transfer may give a wider interval
than the values reach, never a narrower one. Values that already overflowed
to :math:`\pm\infty` in a 16/8-bit format are not tracked: the operation that
overflowed is judged where it ran in that format. Nor is rounding: a cast or a
``reduce_precision`` keeps its operand's range, although rounding may move a
value by up to half a unit in the last place of the narrower format.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jmp_lite import _dtypes as dtypes
from jmp_lite import _jaxpr
from jmp_lite._audit import _graph

# A sum of at least this many values of unknown range can exceed float16's
# range even if every value fits it (1024 values of 64 reach 65504), so its
# result counts as range-expanding. A property of the range, not of the
# precision: the ``reduction`` check's ``long_reduction`` does not change it.
EXPANDING_SUM = 1024

_MAX_CONST_SIZE = 1 << 20  # larger constants (closed-over weights) are not read back


class Range(NamedTuple):
  """An interval that contains every (non-NaN) value of an array."""

  lo: float
  hi: float
  # Set when an operation that expands the range (exp, powers, long sums)
  # produced the value and its bounds are unknown; the string names that op.
  expanded_by: str | None = None
  # When the only expansion is a sum of this many values: dividing by at least
  # as much (a mean) gives back values within the summands' range.
  growth: float = 0.0

  @property
  def magnitude(self) -> float:
    """The largest absolute value in the range."""
    return max(abs(self.lo), abs(self.hi))

  @property
  def bounded(self) -> bool:
    """Whether both ends are finite."""
    return math.isfinite(self.lo) and math.isfinite(self.hi)


UNKNOWN = Range(-math.inf, math.inf)
"""The range of a value nothing is known about (an input, a parameter)."""


class Facts(NamedTuple):
  """What a transfer function may know of an equation besides its operands' ranges."""

  operand_dtype: np.dtype | None = None  # the first operand's dtype (casts)
  exponent: int = 2  # integer_pow's y
  reduced: int = 1  # values combined into each result of a reduction
  repeated_operand: bool = False  # a binary op applied to one variable twice: x * x
  nonpositive_argument: bool = False  # an exp of x - max(x)


TransferFn = Callable[[Sequence[Range], Facts], Range]
"""``(operand ranges, facts) -> result range``: pure, one per primitive."""


def range_of_value(value: Any) -> Range:
  """The range of a constant: its smallest and largest non-NaN values.

  Args:
    value: an array or scalar.

  Returns:
    Its exact range; :data:`UNKNOWN` for empty, all-NaN, non-numeric or very
    large constants.
  """
  if np.size(value) > _MAX_CONST_SIZE:
    return UNKNOWN
  try:
    arr = np.asarray(value)
    if arr.size == 0 or not (arr.dtype.kind in "biu" or jnp.issubdtype(arr.dtype, jnp.floating)):
      return UNKNOWN
    arr = arr.astype(np.float64)
  except Exception:  # an opaque constant such as a PRNG key
    return UNKNOWN
  finite = arr[~np.isnan(arr)]
  if finite.size == 0:
    return UNKNOWN
  return Range(float(finite.min()), float(finite.max()))


def union(*ranges: Range) -> Range:
  """The smallest range containing ``ranges``; keeps the first expansion among them."""
  return Range(min(r.lo for r in ranges), max(r.hi for r in ranges), _expanded(*ranges))


def _expanded(*ranges: Range) -> str | None:
  return next((r.expanded_by for r in ranges if r.expanded_by), None)


def _interval(lo: float, hi: float, expanded_by: str | None = None, growth: float = 0.0) -> Range:
  """A range whose NaN ends (``inf - inf``) become the unbounded ones."""
  lo = -math.inf if math.isnan(lo) else lo
  return Range(lo, math.inf if math.isnan(hi) else hi, expanded_by, growth)


def _mul_bounds(a: Range, b: Range) -> tuple[float, float]:
  prods = [0.0 if x == 0 or y == 0 else x * y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
  return min(prods), max(prods)  # 0 * inf is 0 for bounds: the product is 0 or NaN


def _safe(fn: Callable[[float], float], x: float, default: float) -> float:
  try:
    return fn(x)
  except (OverflowError, ValueError, ZeroDivisionError):
    return default


def _divided(a: Range, lo: float, hi: float, divisor: float) -> Range:
  """The range ``[lo, hi]`` of ``a / d`` with ``|d| >= divisor``: what made ``a``
  overflow-prone (an exp, a power) still does, except a sum's growth that a
  division by the number of summands (a mean) undoes."""
  if a.growth and divisor >= a.growth:
    return Range(lo, hi)
  return Range(lo, hi, a.expanded_by, a.growth / divisor if a.growth else 0.0)


# --------------------------------------------------------------------------------------------
# Transfer functions


def _same(ranges: Sequence[Range], facts: Facts) -> Range:
  """Ops whose result is some of the operand's values (reshape, slice, max...)."""
  return ranges[0]


def _opaque(ranges: Sequence[Range], facts: Facts) -> Range:
  """Anything else: unknown bounds, and whatever expanded an operand still does."""
  return Range(-math.inf, math.inf, _expanded(*ranges))


def _unknown(ranges: Sequence[Range], facts: Facts) -> Range:
  return UNKNOWN


def _union_of(first: int, end: int | None) -> TransferFn:
  """Ops whose result is one of some operands' values: ``operands[first:end]``."""
  return lambda ranges, facts: union(*ranges[first:end])


def _bounded(lo: float, hi: float) -> TransferFn:
  return lambda ranges, facts: Range(lo, hi)


def _convert(ranges: Sequence[Range], facts: Facts) -> Range:
  r, src = ranges[0], facts.operand_dtype
  if src is None or src.itemsize >= 4 or not jnp.issubdtype(src, jnp.floating):
    return r
  m = dtypes.format_info(src).max
  if m >= 1e38:
    return r  # bfloat16: float32's range
  # A float16/fp8 value fits its format or is inf already: whatever made it
  # overflow-prone was judged where it was computed in that format.
  return Range(min(max(r.lo, -m), m), max(min(r.hi, m), -m)) if r.bounded else UNKNOWN


def _neg(ranges: Sequence[Range], facts: Facts) -> Range:
  r = ranges[0]
  return Range(-r.hi, -r.lo, r.expanded_by, r.growth)


def _abs(ranges: Sequence[Range], facts: Facts) -> Range:
  r = ranges[0]
  lo = 0.0 if r.lo <= 0 <= r.hi else min(abs(r.lo), abs(r.hi))
  return Range(lo, r.magnitude, r.expanded_by)


def _add(ranges: Sequence[Range], facts: Facts) -> Range:
  a, b = ranges
  return _interval(a.lo + b.lo, a.hi + b.hi, _expanded(a, b))


def _sub(ranges: Sequence[Range], facts: Facts) -> Range:
  a, b = ranges
  return _interval(a.lo - b.hi, a.hi - b.lo, _expanded(a, b))


def _mul(ranges: Sequence[Range], facts: Facts) -> Range:
  a, b = ranges
  if facts.repeated_operand and not a.bounded:  # x * x: a square
    return Range(0.0, math.inf, a.expanded_by or "x * x")
  lo, hi = _mul_bounds(a, b)
  for x, c in ((a, b), (b, a)):
    if x.growth and c.lo == c.hi and c.lo != 0:  # sum * (1 / n)
      return _divided(x, lo, hi, 1 / abs(c.lo))
  return Range(lo, hi, _expanded(a, b))


def _div(ranges: Sequence[Range], facts: Facts) -> Range:
  a, b = ranges
  # A mean of exp or of x**2 (sum / n) can overflow as the sum can.
  if b.bounded and not b.lo <= 0 <= b.hi:  # e.g. sum / n
    lo, hi = _mul_bounds(a, Range(1 / b.hi, 1 / b.lo))
    return _divided(a, lo, hi, min(abs(b.lo), abs(b.hi)))
  return Range(-math.inf, math.inf, a.expanded_by)


def _max(ranges: Sequence[Range], facts: Facts) -> Range:
  a, b = ranges
  return Range(max(a.lo, b.lo), max(a.hi, b.hi), _expanded(a, b))


def _min(ranges: Sequence[Range], facts: Facts) -> Range:
  a, b = ranges
  return Range(min(a.lo, b.lo), min(a.hi, b.hi), _expanded(a, b))


def _clamp(ranges: Sequence[Range], facts: Facts) -> Range:
  low, x, high = ranges  # clamp(low, x, high) = min(max(x, low), high)
  lo = min(max(x.lo, low.lo), high.lo)
  hi = min(max(x.hi, low.hi), high.hi)
  return Range(lo, hi, _expanded(x, low, high))


def _exponential(name: str, fn: Callable[[float], float]) -> TransferFn:
  def transfer(ranges: Sequence[Range], facts: Facts) -> Range:
    r = ranges[0]
    if facts.nonpositive_argument:  # exp(x - max(x)) <= 1
      r = Range(min(r.lo, 0.0), min(r.hi, 0.0))
    hi = _safe(fn, r.hi, math.inf)
    return Range(_safe(fn, r.lo, 0.0), hi, name if hi == math.inf else None)

  return transfer


def _power(name: str) -> TransferFn:
  def transfer(ranges: Sequence[Range], facts: Facts) -> Range:
    r, y = ranges[0], facts.exponent
    if r.bounded and (y > 0 or not r.lo <= 0 <= r.hi):
      vals = [_safe(lambda v: v**y, v, math.inf) for v in (r.lo, r.hi)]
      lo = 0.0 if y % 2 == 0 and r.lo <= 0 <= r.hi else min(vals)
      return Range(lo, max(vals))
    lo = 0.0 if y % 2 == 0 else -math.inf  # even powers are >= 0
    return Range(lo, math.inf, r.expanded_by or (name if y >= 2 else None))

  return transfer


def _sqrt(ranges: Sequence[Range], facts: Facts) -> Range:
  r = ranges[0]
  return Range(math.sqrt(max(r.lo, 0.0)), math.sqrt(max(r.hi, 0.0)), r.expanded_by)


def _accumulate(name: str) -> TransferFn:
  adds = name in ("reduce_sum", "cumsum")

  def transfer(ranges: Sequence[Range], facts: Facts) -> Range:
    r, n = ranges[0], facts.reduced
    if r.bounded and adds:  # n values, or every prefix of n values (cumsum)
      return Range(min(r.lo * n, r.lo), max(r.hi * n, r.hi))
    if r.expanded_by or n < EXPANDING_SUM:
      return Range(-math.inf, math.inf, r.expanded_by)
    return Range(-math.inf, math.inf, f"{name} of {n} values", float(n) if adds else 0.0)

  return transfer


_SAME_VALUES = _jaxpr.TRANSPARENT - {"convert_element_type"} | {
  "slice",
  "dynamic_slice",
  "gather",
  "reduce_max",
  "reduce_min",
  "cummax",
  "cummin",
  "rev",
  "sort",
}

TRANSFER: Mapping[str, TransferFn] = {
  **{name: _same for name in _SAME_VALUES},
  "convert_element_type": _convert,
  "concatenate": _union_of(0, None),
  "select_n": _union_of(1, None),  # the cases, not the predicate
  "pad": _union_of(0, 2),  # the operand and the padding value
  "dynamic_update_slice": _union_of(0, 2),  # the operand and the update, not the indices
  "tanh": _bounded(-1.0, 1.0),
  "logistic": _bounded(0.0, 1.0),
  "sin": _bounded(-1.0, 1.0),
  "cos": _bounded(-1.0, 1.0),
  "erf": _bounded(-1.0, 1.0),
  "sign": _bounded(-1.0, 1.0),
  "atan": _bounded(-math.pi / 2, math.pi / 2),
  "atan2": _bounded(-math.pi, math.pi),
  "neg": _neg,
  "abs": _abs,
  "add": _add,
  "sub": _sub,
  "mul": _mul,
  "div": _div,
  "max": _max,
  "min": _min,
  "clamp": _clamp,
  "exp": _exponential("exp", math.exp),
  "exp2": _exponential("exp2", lambda x: 2.0**x),
  "expm1": _exponential("expm1", math.expm1),
  "square": _power("square"),
  "integer_pow": _power("integer_pow"),
  "sqrt": _sqrt,
  "pow": lambda ranges, facts: Range(-math.inf, math.inf, "pow"),
  **{name: _accumulate(name) for name in sorted(_graph.ACCUMULATING)},
  **{name: _unknown for name in ("log", "log1p", "rsqrt", "dot_general", "conv_general_dilated")},
}
"""The transfer function of each primitive; others get unknown bounds and keep expansions."""


def transfer_of(primitive: str) -> TransferFn:
  """The transfer function of ``primitive``: its entry of :data:`TRANSFER`, else one that
  gives unknown bounds and keeps an operand's expansion."""
  return TRANSFER.get(primitive, _opaque)


def facts_of(eqn: Any, graph: _graph.Graph) -> Facts:
  """What the transfer of ``eqn`` needs to know beyond its operands' ranges.

  Args:
    eqn: an equation.
    graph: the graph of the jaxpr that holds it.

  Returns:
    Its :class:`Facts`.
  """
  name, invars = eqn.primitive.name, eqn.invars
  repeated = len(invars) == 2 and invars[0] is invars[1] and not _jaxpr.is_literal(invars[0])
  return Facts(
    operand_dtype=_jaxpr.dtype_of(invars[0]) if invars else None,
    exponent=eqn.params.get("y", 2) if name == "integer_pow" else 2,
    reduced=_graph.reduced_size(eqn) if name in _graph.ACCUMULATING else 1,
    repeated_operand=repeated,
    nonpositive_argument=name in _graph.EXPONENTIALS and _graph.nonpositive_argument(graph, eqn),
  )


def transfer(eqn: Any, graph: _graph.Graph, ranges: Sequence[Range]) -> Range:
  """The range of an equation's results (all of them: the walk gives each the same).

  Args:
    eqn: an equation without a sub-jaxpr that returns its results.
    graph: the graph of the jaxpr that holds it.
    ranges: its operands' ranges.

  Returns:
    The result range by :data:`TRANSFER`; :data:`UNKNOWN` for non-float results.
  """
  out_dtype = _jaxpr.dtype_of(eqn.outvars[0]) if eqn.outvars else None
  if out_dtype is None or not jnp.issubdtype(out_dtype, jnp.floating) or not ranges:
    return UNKNOWN
  return transfer_of(eqn.primitive.name)(ranges, facts_of(eqn, graph))
