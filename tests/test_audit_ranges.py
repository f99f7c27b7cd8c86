"""The audit's range transfer functions, each checked against the primitive it models.

For every entry of ``TRANSFER`` the primitive itself (``jax.lax``, in float64) is evaluated on
points of its operands' intervals: the end points, zero, interior points and, for an unbounded
end, the infinity and large finite values. Every non-NaN result must lie in the interval the
transfer function gives (soundness); for the exact transfers of monotone or piecewise-monotone
primitives the interval's ends must be results (tightness). NaN results (``inf - inf``,
``sqrt(-1)``) are no values a range tracks.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jmp_lite import _jaxpr
from jmp_lite._audit import _graph, _ranges
from jmp_lite._audit._ranges import EXPANDING_SUM, TRANSFER, UNKNOWN, Facts, Range

INF = math.inf
# Intervals of every shape: positive, negative, zero-crossing, touching zero, points, half-
# and fully unbounded, beyond float64's exp range.
INTERVALS = [
  Range(2.0, 3.0),
  Range(-3.0, -0.5),
  Range(-2.0, 3.0),
  Range(0.0, 4.0),
  Range(-4.0, 0.0),
  Range(0.0, 0.0),
  Range(1.5, 1.5),
  Range(-INF, 2.0),
  Range(-1.0, INF),
  UNKNOWN,
  Range(700.0, 800.0),
  Range(-800.0, -700.0),
]
BINARY_INTERVALS = [INTERVALS[i] for i in (0, 1, 2, 3, 5, 7, 9, 10)]
FINITE = [r for r in INTERVALS if r.bounded]


def points(r: Range) -> np.ndarray:
  """Points of ``r``: its ends, zero when inside, interior points; large values toward an
  unbounded end, and the infinity itself."""
  lo = r.lo if math.isfinite(r.lo) else min(r.hi, 0.0) - 1e300
  hi = r.hi if math.isfinite(r.hi) else max(r.lo, 0.0) + 1e300
  pts = {r.lo, r.hi, *np.linspace(lo, hi, 7)}
  for end in (r.lo, r.hi):
    if not math.isfinite(end):
      pts.update(math.copysign(m, end) for m in (1e6, 1e30, 1e300))
  pts.update(p for p in (0.0, 1.0, -1.0, 0.5) if r.lo <= p <= r.hi)
  # Always 16 points (repeated as needed): one shape, so each primitive compiles once.
  return np.resize(np.array(sorted(pts), np.float64), 16)


def evaluate(fn, *operands: np.ndarray) -> np.ndarray:
  """``fn`` on every combination of the operands' points, in float64, NaN dropped."""
  grids = [g.ravel() for g in np.meshgrid(*operands, indexing="ij")]
  with np.errstate(all="ignore"), jax.enable_x64(True):
    out = np.asarray(fn(*(jnp.asarray(g, jnp.float64) for g in grids)), np.float64).ravel()
  return out[~np.isnan(out)]


def assert_contains(r: Range, values: np.ndarray, rtol: float = 1e-12):
  # XLA's float64 exp/atan2 may differ from Python's math by an ulp.
  slack = lambda bound: rtol * abs(bound) if math.isfinite(bound) else 0.0
  below = values[values < r.lo - slack(r.lo)]
  above = values[values > r.hi + slack(r.hi)]
  assert below.size == 0 and above.size == 0, f"{r} misses {below[:3]} {above[:3]}"


def assert_tight(r: Range, values: np.ndarray):
  np.testing.assert_allclose([values.min(), values.max()], [r.lo, r.hi], rtol=1e-12)


# --------------------------------------------------------------------------------------------
# Unary primitives: reference, facts, and whether the transfer is exact on bounded intervals.

UNARY = {
  "neg": (lax.neg, Facts(), True),
  "abs": (lax.abs, Facts(), True),
  "exp": (lax.exp, Facts(), True),
  "exp2": (lax.exp2, Facts(), True),
  "expm1": (lax.expm1, Facts(), True),
  "sqrt": (lax.sqrt, Facts(), False),  # negative inputs give NaN: [0, ...] stays sound
  "square": (lax.square, Facts(), True),
  "tanh": (lax.tanh, Facts(), False),
  "logistic": (lax.logistic, Facts(), False),
  "sin": (lax.sin, Facts(), False),
  "cos": (lax.cos, Facts(), False),
  "erf": (lax.erf, Facts(), False),
  "sign": (lax.sign, Facts(), False),
  "atan": (lax.atan, Facts(), False),
  "log": (lax.log, Facts(), False),
  "log1p": (lax.log1p, Facts(), False),
  "rsqrt": (lax.rsqrt, Facts(), False),
}
POWERS = (2, 3, 4, 1, 0, -1, -2, -3)


@pytest.mark.parametrize("name", list(UNARY))
def test_unary_transfers_contain_the_primitives_values(name):
  fn, facts, exact = UNARY[name]
  for r in INTERVALS:
    out = TRANSFER[name]([r], facts)
    values = evaluate(fn, points(r))
    assert_contains(out, values)
    if exact and r.bounded and math.isfinite(out.hi):
      assert_tight(out, values)


@pytest.mark.parametrize("y", POWERS)
def test_integer_pow_contains_the_primitives_values(y):
  for r in INTERVALS:
    out = TRANSFER["integer_pow"]([r], Facts(exponent=y))
    values = evaluate(lambda x: lax.integer_pow(x, y), points(r))
    assert_contains(out, values)
    if y > 0 and r.bounded:
      assert_tight(out, values)


def test_exp_of_a_shifted_argument_is_at_most_one():
  # exp(x - max(x)): the walk knows the argument is <= 0 whatever its interval says.
  facts = Facts(nonpositive_argument=True)
  for name, fn in (("exp", lax.exp), ("exp2", lax.exp2), ("expm1", lax.expm1)):
    for r in INTERVALS:
      out = TRANSFER[name]([r], facts)
      pts = points(r)
      if (pts <= 0).any():
        assert_contains(out, evaluate(fn, np.resize(pts[pts <= 0], 16)))
      assert out.hi <= 1.0 and out.expanded_by is None
  assert TRANSFER["exp"]([UNKNOWN], facts) == Range(0.0, 1.0)


# --------------------------------------------------------------------------------------------
# Binary and ternary primitives

BINARY = {
  "add": (lax.add, True),
  "sub": (lax.sub, True),
  "mul": (lax.mul, True),
  "div": (lax.div, True),
  "max": (lax.max, True),
  "min": (lax.min, True),
  "atan2": (lax.atan2, False),
  "pow": (lax.pow, False),
}


@pytest.mark.parametrize("name", list(BINARY))
def test_binary_transfers_contain_the_primitives_values(name):
  fn, exact = BINARY[name]
  for a, b in itertools.product(BINARY_INTERVALS, repeat=2):
    out = TRANSFER[name]([a, b], Facts())
    values = evaluate(fn, points(a), points(b))
    assert_contains(out, values)
    zero_divisor = name == "div" and b.lo <= 0 <= b.hi
    if exact and a.bounded and b.bounded and not zero_divisor and math.isfinite(out.hi):
      assert_tight(out, values)


def test_a_square_written_as_x_times_x():
  # x * x of one variable is >= 0 even when x is unbounded; with bounds, a product's bounds.
  facts = Facts(repeated_operand=True)
  for r in INTERVALS:
    out = TRANSFER["mul"]([r, r], facts)
    assert_contains(out, evaluate(lambda x: x * x, points(r)))
  assert TRANSFER["mul"]([UNKNOWN, UNKNOWN], facts) == Range(0.0, INF, "x * x")


def test_clamp_contains_the_primitives_values():
  cases = [Range(0.0, 0.0), Range(-1.0, 1.0), Range(0.0, 10.0), UNKNOWN, Range(2.0, 3.0)]
  for low, x, high in itertools.product(cases, INTERVALS[:10], cases):
    out = TRANSFER["clamp"]([low, x, high], Facts())
    values = evaluate(lax.clamp, points(low), points(x), points(high))
    assert_contains(out, values)
    if low.bounded and x.bounded and high.bounded:
      assert_tight(out, values)


# --------------------------------------------------------------------------------------------
# Reductions

SUMS = {
  "reduce_sum": lambda x: jnp.sum(x, axis=-1),
  "cumsum": lambda x: lax.cumsum(x, axis=x.ndim - 1),
  "reduce_prod": lambda x: jnp.prod(x, axis=-1),
  "cumprod": lambda x: lax.cumprod(x, axis=x.ndim - 1),
  "cumlogsumexp": lambda x: lax.cumlogsumexp(x, axis=x.ndim - 1),
}


@pytest.mark.parametrize("name", list(SUMS))
def test_reductions_contain_the_primitives_values(name):
  rng = np.random.default_rng(0)
  for r, n in itertools.product(INTERVALS, (1, 3, 16)):
    out = TRANSFER[name]([r], Facts(reduced=n))
    pts = points(r)
    rows = np.stack([np.full(n, pts.min()), np.full(n, pts.max()), *rng.choice(pts, (32, n))])
    with np.errstate(all="ignore"), jax.enable_x64(True):
      values = np.asarray(SUMS[name](jnp.asarray(rows, jnp.float64))).ravel()
    assert_contains(out, values[~np.isnan(values)])
    if name == "reduce_sum" and r.bounded and r.lo <= 0 <= r.hi:
      assert_tight(out, values)  # n * lo and n * hi


def test_long_sums_expand_the_range_and_means_undo_it():
  sum_ = TRANSFER["reduce_sum"]
  short, long = Facts(reduced=EXPANDING_SUM - 1), Facts(reduced=EXPANDING_SUM)
  assert sum_([UNKNOWN], short) == UNKNOWN
  grown = sum_([UNKNOWN], long)
  assert grown == Range(-INF, INF, f"reduce_sum of {EXPANDING_SUM} values", EXPANDING_SUM)
  # A bounded sum is exact, whatever its length.
  assert sum_([Range(-1.0, 2.0)], Facts(reduced=4096)) == Range(-4096.0, 8192.0)
  # A mean divides the growth away (sum * (1/n) or sum / n); dividing by less keeps it.
  n = float(EXPANDING_SUM)
  assert TRANSFER["mul"]([grown, Range(1 / n, 1 / n)], Facts()) == Range(-INF, INF)
  assert TRANSFER["mul"]([Range(1 / n, 1 / n), grown], Facts()) == Range(-INF, INF)
  assert TRANSFER["div"]([grown, Range(n, n)], Facts()) == Range(-INF, INF)
  halved = TRANSFER["div"]([grown, Range(2.0, 2.0)], Facts())
  assert (halved.expanded_by, halved.growth) == (grown.expanded_by, n / 2)
  # A product's growth is no sum's: no mean undoes it.
  prod = TRANSFER["reduce_prod"]([UNKNOWN], long)
  assert (prod.expanded_by, prod.growth) == (f"reduce_prod of {EXPANDING_SUM} values", 0.0)
  # An expansion upstream is kept, whatever the length.
  assert sum_([Range(0.0, INF, "exp")], short) == Range(-INF, INF, "exp")


def test_expansions_flow_through_arithmetic():
  exp = TRANSFER["exp"]([UNKNOWN], Facts())
  assert exp == Range(0.0, INF, "exp")
  for name in ("add", "sub", "mul", "max", "min"):
    assert TRANSFER[name]([exp, Range(1.0, 2.0)], Facts()).expanded_by == "exp", name
  assert TRANSFER["neg"]([exp], Facts()).expanded_by == "exp"
  assert TRANSFER["clamp"]([Range(0.0, 0.0), exp, UNKNOWN], Facts()).expanded_by == "exp"
  assert TRANSFER["integer_pow"]([UNKNOWN], Facts(exponent=3)) == Range(-INF, INF, "integer_pow")
  assert TRANSFER["square"]([UNKNOWN], Facts()) == Range(0.0, INF, "square")
  assert TRANSFER["pow"]([Range(1.0, 2.0), Range(1.0, 2.0)], Facts()).expanded_by == "pow"
  # Bounded results forget what expanded their operands.
  assert TRANSFER["tanh"]([exp], Facts()) == Range(-1.0, 1.0)
  assert TRANSFER["exp"]([Range(-INF, 0.0)], Facts()) == Range(0.0, 1.0)
  # Unknown operations keep the expansion; log and rsqrt give unknown values.
  assert TRANSFER["log"]([exp], Facts()) == UNKNOWN
  assert _ranges.transfer_of("some_new_primitive")([exp], Facts()) == Range(-INF, INF, "exp")


# --------------------------------------------------------------------------------------------
# Operations that move values: the result is (a union of) the operands' values.

SAME = {
  "reshape": lambda x: x.reshape(-1, 1),
  "broadcast_in_dim": lambda x: lax.broadcast_in_dim(x, (2, x.size), (1,)),
  "transpose": lambda x: lax.transpose(x.reshape(-1, 1), (1, 0)),
  "squeeze": lambda x: lax.squeeze(x.reshape(1, -1), (0,)),
  "rev": lambda x: lax.rev(x, (0,)),
  "sort": lax.sort,
  "slice": lambda x: lax.slice(x, (1,), (x.size - 1,)),
  "dynamic_slice": lambda x: lax.dynamic_slice(x, (2,), (3,)),
  "gather": lambda x: x[jnp.asarray([0, 3, 3])],
  "reduce_max": lambda x: lax.reduce_max(x, (0,)),
  "reduce_min": lambda x: lax.reduce_min(x, (0,)),
  "cummax": lax.cummax,
  "cummin": lax.cummin,
  "copy": lambda x: lax.copy_p.bind(x),
  "stop_gradient": lax.stop_gradient,
  "reduce_precision": lambda x: lax.reduce_precision(x, exponent_bits=11, mantissa_bits=7),
}


@pytest.mark.parametrize("name", list(SAME))
def test_ops_that_move_values_keep_the_range(name):
  for r in INTERVALS:
    assert TRANSFER[name]([r], Facts()) == r
    with np.errstate(all="ignore"), jax.enable_x64(True):
      values = np.asarray(SAME[name](jnp.asarray(points(r), jnp.float64))).ravel()
    # reduce_precision rounds (to 7 mantissa bits here): within half an ulp of the range.
    assert_contains(r, values, rtol=2.0**-8 if name == "reduce_precision" else 1e-12)


UNIONS = {
  "concatenate": lambda a, b: lax.concatenate([a, b], 0),
  "select_n": lambda a, b: lax.select_n(jnp.arange(a.size) % 2 == 0, a, b),
  "pad": lambda a, b: lax.pad(a, b[0], [(1, 1, 0)]),
  "dynamic_update_slice": lambda a, b: lax.dynamic_update_slice(a, b[:2], (1,)),
}


@pytest.mark.parametrize("name", list(UNIONS))
def test_ops_that_combine_values_give_the_union(name):
  pred = Range(0.0, 1.0)  # select_n's predicate, and an index of dynamic_update_slice
  for a, b in itertools.product(BINARY_INTERVALS, repeat=2):
    operands = {
      "concatenate": [a, b],
      "select_n": [pred, a, b],
      "pad": [a, b],
      "dynamic_update_slice": [a, b, pred],
    }[name]
    out = TRANSFER[name](operands, Facts())
    assert out == _ranges.union(a, b)
    pa, pb = points(a), points(b)
    with np.errstate(all="ignore"), jax.enable_x64(True):
      values = np.asarray(UNIONS[name](jnp.asarray(pa), jnp.asarray(pb))).ravel()
    assert_contains(out, values)
    if a.bounded and b.bounded and name == "concatenate":
      assert_tight(out, values)


def test_union_keeps_the_first_expansion():
  assert _ranges.union(Range(1.0, 2.0), Range(-1.0, 0.0, "exp"), Range(0.0, 5.0, "pow")) == (
    Range(-1.0, 5.0, "exp")
  )


# --------------------------------------------------------------------------------------------
# Casts


@pytest.mark.parametrize("src", ["float16", "float8_e4m3fn", "float8_e5m2"])
def test_casts_from_narrow_formats_are_clipped_to_the_format(src):
  # A float16 value fits float16 or is inf (already judged where it overflowed): its float32
  # cast lies in the format's finite range.
  m = float(jnp.finfo(src).max)
  facts = Facts(operand_dtype=np.dtype(jnp.dtype(src)))
  for r in [*FINITE, Range(-1e9, 1e9), Range(1e6, 1e6)]:
    out = TRANSFER["convert_element_type"]([r], facts)
    held = np.clip(points(r), -m, m).astype(jnp.dtype(src))  # what the format holds of those points
    with jax.enable_x64(True):
      values = np.asarray(lax.convert_element_type(jnp.asarray(held), jnp.float64))
    assert_contains(out, values, rtol=float(jnp.finfo(src).eps))
    assert -m <= out.lo <= out.hi <= m
  assert TRANSFER["convert_element_type"]([UNKNOWN], facts) == UNKNOWN


@pytest.mark.parametrize("src", ["bfloat16", "float32", "int8", None])
def test_casts_from_wide_formats_keep_the_range(src):
  facts = Facts(operand_dtype=None if src is None else np.dtype(jnp.dtype(src)))
  for r in INTERVALS:
    assert TRANSFER["convert_element_type"]([r], facts) == r


# --------------------------------------------------------------------------------------------
# Constants, and the facts read off real equations


def test_range_of_constants():
  assert _ranges.range_of_value(np.array([3.0, -2.0, np.nan, 7.5])) == Range(-2.0, 7.5)
  assert _ranges.range_of_value(np.array([-np.inf, 1.0])) == Range(-INF, 1.0)
  assert _ranges.range_of_value(5) == Range(5.0, 5.0)
  assert _ranges.range_of_value(np.array([True, False])) == Range(0.0, 1.0)
  assert _ranges.range_of_value(jnp.asarray([1, 2], jnp.float16)) == Range(1.0, 2.0)
  # Empty, all-NaN and opaque constants are unknown.
  assert _ranges.range_of_value(np.zeros((0, 3))) == UNKNOWN
  assert _ranges.range_of_value(np.array([np.nan, np.nan])) == UNKNOWN
  assert _ranges.range_of_value(jax.random.key(0)) == UNKNOWN
  assert _ranges.range_of_value(np.array(["a"])) == UNKNOWN


def test_range_properties():
  assert Range(-3.0, 2.0).magnitude == 3.0 and Range(-3.0, 2.0).bounded
  assert UNKNOWN.magnitude == INF and not UNKNOWN.bounded
  assert not Range(0.0, INF).bounded


def _eqns(fn, *args):
  closed = jax.make_jaxpr(fn)(*args)
  return closed.jaxpr, _graph.Graph(closed.jaxpr)


def test_facts_and_transfer_of_real_equations():
  x = jnp.ones((4, 8), jnp.float32)
  jaxpr, graph = _eqns(lambda x: jnp.exp(x - x.max(-1, keepdims=True)), x)
  (exp,) = [e for e in jaxpr.eqns if e.primitive.name == "exp"]
  assert _ranges.facts_of(exp, graph).nonpositive_argument
  assert _ranges.transfer(exp, graph, [UNKNOWN]) == Range(0.0, 1.0)
  jaxpr, graph = _eqns(lambda x: jnp.exp(x), x)
  assert not _ranges.facts_of(jaxpr.eqns[0], graph).nonpositive_argument

  jaxpr, graph = _eqns(lambda x: (x * x, x * 2.0, lax.integer_pow(x, 3)), x)
  square, double, cube = jaxpr.eqns
  assert _ranges.facts_of(square, graph).repeated_operand
  assert not _ranges.facts_of(double, graph).repeated_operand
  assert _ranges.facts_of(cube, graph).exponent == 3

  jaxpr, graph = _eqns(lambda x: (lax.reduce_sum(x, (0, 1)), lax.cumsum(x, axis=1)), x)
  assert [_ranges.facts_of(e, graph).reduced for e in jaxpr.eqns] == [32, 8]

  jaxpr, graph = _eqns(lambda x: x.astype(jnp.float32), x.astype(jnp.float16))
  assert _ranges.facts_of(jaxpr.eqns[0], graph).operand_dtype == np.dtype("float16")

  # Integer and boolean results carry no range.
  jaxpr, graph = _eqns(lambda x: (jnp.argmax(x, axis=1), x > 0), x)
  assert [e.primitive.name for e in jaxpr.eqns] == ["argmax", "gt"]
  for eqn in jaxpr.eqns:
    assert _ranges.transfer(eqn, graph, [Range(0.0, 1.0)] * len(eqn.invars)) == UNKNOWN
  assert _jaxpr.dtype_of(jaxpr.eqns[-1].outvars[0]) == np.dtype(bool)


def test_every_transfer_is_checked_here():
  checked = {
    *UNARY,
    *BINARY,
    *SUMS,
    *SAME,
    *UNIONS,
    "integer_pow",
    "clamp",
    "convert_element_type",
  }
  # Names of TRANSPARENT that no jaxpr of this JAX holds, and matmuls (unknown results).
  unchecked = {"expand_dims", "copy_p", "dot_general", "conv_general_dilated"}
  assert set(TRANSFER) - checked == unchecked
  for name in ("dot_general", "conv_general_dilated"):
    assert TRANSFER[name]([UNKNOWN, UNKNOWN], Facts()) == UNKNOWN
  for name in ("expand_dims", "copy_p"):
    assert TRANSFER[name]([Range(1.0, 2.0)], Facts()) == Range(1.0, 2.0)
