"""fp8 delayed scaling: quantization, scale updates, the matmul and its state."""

import concurrent.futures
import contextlib
import functools
import inspect
import pickle
import re

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import jmp_lite as jl
from jmp_lite import fp8
from jmp_lite.fp8._matmul import DotOptions

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
FMT = {d: jl.FORMATS[d.name] for d in (E4M3, E5M2)}
MATMUL = (((1,), (0,)), ((), ()))


def all_values(dtype):
  """Every finite value of an 8-bit format, as float64."""
  values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
  return np.unique(values[np.isfinite(values)])


def nearest(x, grid):
  """Index-free round-to-nearest of x onto a sorted grid (ties: either neighbour)."""
  hi = np.clip(np.searchsorted(grid, x), 1, len(grid) - 1)
  lo = hi - 1
  return np.where(np.abs(x - grid[lo]) <= np.abs(grid[hi] - x), grid[lo], grid[hi])


def unit_state(config=None):
  """A delayed-scaling state with every scale set to 1 (exact on small integers)."""
  state = fp8.init_dot_state(config or fp8.Fp8Config(amax_history_length=2))
  return fp8.Fp8DotState(*(t._replace(scale=jnp.ones((), jnp.float32)) for t in state))


# Configuration -------------------------------------------------------------------------


def test_config_defaults_and_hashable():
  config = fp8.Fp8Config()
  assert (config.fwd_dtype, config.bwd_dtype) == (E4M3, E5M2)
  assert config.amax_history_length == 1024
  assert config.amax_compute_algo == "max"
  assert config.margin == 0.0
  assert config.fast_accumulation == "none"
  assert fp8.Fp8Config("e4m3", "f8e5m2") == config
  assert hash(fp8.Fp8Config(margin=1)) == hash(fp8.Fp8Config(margin=1.0))


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"amax_history_length": 0}, ValueError, "amax_history_length must be >= 1, got 0"),
    ({"amax_history_length": -3}, ValueError, "got -3"),
    ({"amax_history_length": 2.0}, TypeError, "got 2.0"),
    ({"amax_history_length": True}, TypeError, "got True"),
    ({"margin": -1}, ValueError, "margin must be finite, >= 0 and < 64, got -1"),
    ({"margin": float("nan")}, ValueError, "got nan"),
    ({"margin": float("inf")}, ValueError, "got inf"),
    ({"margin": 100}, ValueError, "got 100"),
    ({"margin": "1"}, TypeError, "got '1'"),
    ({"margin": True}, TypeError, "got True"),
    ({"amax_compute_algo": "mean"}, ValueError, "got 'mean'"),
    ({"amax_compute_algo": None}, TypeError, "got None"),
    ({"fwd_dtype": "bf16"}, ValueError, "fwd_dtype must be an fp8 format .* got bfloat16"),
    ({"bwd_dtype": jnp.float16}, ValueError, "bwd_dtype must be an fp8 format .* got float16"),
    ({"fwd_dtype": jnp.int8}, TypeError, "int8"),
    ({"fwd_dtype": "float8_e4m3fnuz"}, ValueError, "float8_e4m3fnuz"),
    ({"bwd_dtype": None}, TypeError, "None"),
    ({"fast_accumulation": "backward"}, ValueError, "fast_accumulation must be one of"),
    ({"fast_accumulation": True}, TypeError, "got True"),
  ],
)
def test_config_rejects_bad_values(kwargs, error, match):
  with pytest.raises(error, match=match):
    fp8.Fp8Config(**kwargs)


def test_init_state():
  state = fp8.init_dot_state(fp8.Fp8Config(amax_history_length=5))
  for tensor in state:
    assert tensor.scale.shape == () and tensor.scale.dtype == jnp.float32
    assert float(tensor.scale) == 0.0  # none yet: the first step quantizes with its own amax
    np.testing.assert_array_equal(tensor.amax_history, np.zeros(5, np.float32))
  with pytest.raises(ValueError, match="got 0"):
    fp8.init_scale_state(0)


# Quantization --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("scale", [1.0, 2.0**-7, 0.37])
def test_quantize_rounds_to_nearest_representable(dtype, scale):
  grid = all_values(dtype)
  fmt = FMT[dtype]
  rng = np.random.default_rng(0)
  # Magnitudes from below the smallest subnormal to the largest value, both signs.
  mags = np.exp(rng.uniform(np.log(fmt.min_subnormal / 4), np.log(fmt.max), 4000))
  v = (mags * rng.choice([-1, 1], mags.shape)).astype(np.float32)
  x = (v.astype(np.float64) * np.float32(scale)).astype(np.float32)
  q = fp8.quantize(x, scale, dtype)
  assert q.dtype == dtype
  ratio = x.astype(np.float64) / np.float64(np.float32(scale))
  np.testing.assert_array_equal(np.asarray(q, np.float64), nearest(ratio, grid))
  # Every representable value survives quantize-dequantize exactly (scale 1).
  np.testing.assert_array_equal(
    np.asarray(fp8.quantize_dequantize(grid.astype(np.float32), 1.0, dtype)), grid
  )


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantization_error_bound_per_format(dtype):
  """|qdq(x) - x| <= eps/2 |x| in the normal range, <= scale * min_subnormal / 2 below."""
  fmt = FMT[dtype]
  rng = np.random.default_rng(1)
  scale = np.float32(0.013)
  x = (rng.standard_normal(20000) * np.exp(rng.uniform(-12, 0, 20000))).astype(np.float32)
  x *= fmt.max * scale / np.abs(x).max()  # amax maps exactly to the top of the range
  err = np.abs(np.asarray(fp8.quantize_dequantize(x, scale, dtype), np.float64) - x)
  normal = np.abs(x) >= fmt.min_normal * scale
  assert normal.any() and (~normal).any()
  assert np.all(err[normal] <= fmt.epsilon / 2 * np.abs(x[normal]) * (1 + 1e-6))
  assert np.all(err[~normal] <= fmt.min_subnormal / 2 * scale * (1 + 1e-6))
  # The bound is nearly attained (its supremum is u / (1 + u), u = eps / 2): a finer
  # grid than the format's would fail this.
  u = fmt.epsilon / 2
  assert (err[normal] / np.abs(x[normal])).max() > 0.95 * u / (1 + u)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_saturates_finite_values_and_keeps_non_finite(dtype):
  fmt = FMT[dtype]
  x = jnp.array([fmt.max * 3, -fmt.max * 1e6, 1e38, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
  q = np.asarray(fp8.quantize(x, 0.5, dtype), np.float64)
  np.testing.assert_array_equal(q[:3], [fmt.max, -fmt.max, fmt.max])
  if dtype == E4M3:  # no inf in e4m3fn: non-finite becomes NaN
    assert np.isnan(q[3:]).all()
  else:
    np.testing.assert_array_equal(q[3:5], [np.inf, -np.inf])
    assert np.isnan(q[5])


def test_quantize_accepts_16_bit_inputs_and_rejects_non_fp8_targets():
  x = jnp.array([1.0, -3.0, 0.3], jnp.bfloat16)
  q = fp8.quantize(x, 0.25, E4M3)
  np.testing.assert_array_equal(np.asarray(q, np.float32), [4.0, -12.0, 1.25])
  assert fp8.quantize_dequantize(x, 0.25, E4M3).dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="got float16"):
    fp8.quantize(x, 1.0, jnp.float16)
  with pytest.raises(TypeError, match="int32"):
    fp8.quantize(x, 1.0, jnp.int32)


def test_compute_amax():
  assert float(fp8.compute_amax(jnp.array([-3.0, 2.0], jnp.bfloat16))) == 3.0
  assert float(fp8.compute_amax(jnp.zeros((0, 4)))) == 0.0
  assert np.isnan(fp8.compute_amax(jnp.array([1.0, jnp.nan])))


# Scale updates -------------------------------------------------------------------------


@pytest.mark.parametrize(
  "amax, previous, dtype, margin, expected",
  [
    (896.0, 1.0, E4M3, 0, 2.0),  # 896 / 448
    (896.0, 1.0, E4M3, 1, 4.0),  # one power of two of headroom
    (896.0, 1.0, E4M3, 2.5, 2.0 * 2.0**2.5),
    (57344.0 / 8, 1.0, E5M2, 0, 0.125),
    (0.0, 0.3, E4M3, 0, 0.3),  # all-zero tensor: keep the previous scale
    (np.inf, 0.3, E4M3, 0, 0.3),
    (np.nan, 0.3, E5M2, 0, 0.3),
    (-5.0, 0.3, E4M3, 0, 0.3),
    (1e-45, 0.3, E4M3, 0, 0.3),  # the new scale would underflow to 0
  ],
)
def test_compute_scale(amax, previous, dtype, margin, expected):
  scale = fp8.compute_scale(amax, previous, dtype, margin)
  assert scale.dtype == jnp.float32
  np.testing.assert_allclose(float(scale), expected, rtol=1e-7)


A = 448.0  # e4m3 max: amaxes as multiples of it give round scales
#: (observed amax, history after, scale after) for L = 3, by hand.
MAX_RULE = [
  (A, [A, 0, 0], 1.0),
  (4 * A, [4 * A, A, 0], 4.0),
  (2 * A, [2 * A, 4 * A, A], 4.0),
  (A / 2, [A / 2, 2 * A, 4 * A], 4.0),
  (A / 4, [A / 4, A / 2, 2 * A], 2.0),  # 4A has left the window
  (np.inf, [A / 4, A / 2, 2 * A], 2.0),  # an overflow is not recorded
  (np.nan, [A / 4, A / 2, 2 * A], 2.0),
  (0.0, [0, A / 4, A / 2], 0.5),
  (8 * A, [8 * A, 0, A / 4], 8.0),
]
MOST_RECENT_RULE = [
  (A, [A, 0, 0], 1.0),
  (4 * A, [4 * A, A, 0], 4.0),
  (2 * A, [2 * A, 4 * A, A], 2.0),
  (A / 2, [A / 2, 2 * A, 4 * A], 0.5),
  (A / 4, [A / 4, A / 2, 2 * A], 0.25),
  (np.inf, [A / 4, A / 2, 2 * A], 0.25),
  (np.nan, [A / 4, A / 2, 2 * A], 0.25),
  (0.0, [0, A / 4, A / 2], 0.25),  # zero amax keeps the previous scale
  (8 * A, [8 * A, 0, A / 4], 8.0),
]


@pytest.mark.parametrize("algo, trajectory", [("max", MAX_RULE), ("most_recent", MOST_RECENT_RULE)])
@pytest.mark.parametrize("use_jit", [False, True])
def test_update_scale_hand_worked_histories(algo, trajectory, use_jit):
  def step(state, amax):
    return fp8.update_scale(state, amax, E4M3, amax_compute_algo=algo)

  step = jax.jit(step) if use_jit else step
  state = fp8.init_scale_state(3)
  for amax, history, scale in trajectory:
    state = step(state, jnp.float32(amax))
    np.testing.assert_array_equal(state.amax_history, np.array(history, np.float32))
    assert float(state.scale) == scale, (amax, history)


def test_update_scale_history_of_one_and_stacked_states():
  state = fp8.update_scale(fp8.init_scale_state(1), 2 * A, E4M3)
  assert float(state.scale) == 2.0 and state.amax_history.tolist() == [2 * A]
  # Stacked (e.g. nn.scan layers): shape [layers] scales, [layers, L] histories.
  stacked = fp8.Fp8ScaleState(jnp.ones((2,)), jnp.zeros((2, 4)))
  new = fp8.update_scale(stacked, jnp.array([A, 4 * A]), E4M3)
  np.testing.assert_array_equal(new.scale, [1.0, 4.0])
  np.testing.assert_array_equal(new.amax_history[:, 0], [A, 4 * A])
  with pytest.raises(ValueError, match="amax must have the scale's shape"):
    fp8.update_scale(stacked, jnp.float32(1), E4M3)
  with pytest.raises(ValueError, match="amax_history must have shape"):
    fp8.update_scale(fp8.Fp8ScaleState(jnp.ones(()), jnp.zeros(())), 1.0, E4M3)


def test_update_uses_forward_format_for_operands_and_backward_format_for_gradients():
  config = fp8.Fp8Config(amax_history_length=2, margin=1)
  state = {"a": fp8.init_dot_state(config), "b": [fp8.init_dot_state(config)]}
  amax = jax.tree.map(lambda z: z + 57344.0, fp8.zeros_amax(state))
  new = fp8.update(state, amax, config)
  assert jax.tree.structure(new) == jax.tree.structure(state)
  for dot in (new["a"], new["b"][0]):
    assert float(dot.input.scale) == float(dot.kernel.scale) == 57344.0 / 448 * 2
    assert float(dot.output_grad.scale) == 2.0
  with pytest.raises(ValueError, match="zeros_amax"):
    fp8.update(state, {"a": amax["a"]}, config)
  with pytest.raises(TypeError, match="Fp8DotAmax"):
    fp8.update(state, {"a": 1.0, "b": [2.0]}, config)


# The matmul ----------------------------------------------------------------------------

DIMENSION_NUMBERS = [
  ((3, 4), (4, 5), MATMUL),
  ((4, 3), (4, 5), (((0,), (0,)), ((), ()))),  # lhs transposed
  ((2, 3, 4), (2, 4, 5), (((2,), (1,)), ((0,), (0,)))),  # batched
  ((3, 2, 4, 6), (6, 5, 4), (((2, 3), (2, 0)), ((), ()))),  # two contractions, permuted
  ((3, 2, 4), (5, 2, 3), (((0,), (2,)), ((1,), (1,)))),  # batch axes not leading
  ((3,), (4,), (((), ()), ((), ()))),  # outer product
]


def value_and_vjp(f, x, k, g):
  """f(x, k) and its VJP applied to g, in one compiled program (fast on CPU)."""

  @jax.jit
  def run(x, k, g):
    y, vjp = jax.vjp(f, x, k)
    return y, vjp(g)

  return run(x, k, g)


def small_integers(shape, seed, high):
  """Values that both fp8 formats hold exactly, so fp8 matmuls are exact."""
  return jnp.asarray(np.random.default_rng(seed).integers(-high, high + 1, shape), jnp.float32)


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", DIMENSION_NUMBERS)
def test_dot_general_is_exact_on_representable_values(lhs_shape, rhs_shape, dims):
  """With exactly representable data the fp8 matmul and its VJP equal fp32's bit for bit."""
  x, k = small_integers(lhs_shape, 0, 4), small_integers(rhs_shape, 1, 4)
  state = unit_state()
  g = small_integers(jax.eval_shape(lambda: lax.dot_general(x, k, dims)).shape, 2, 4)
  got = value_and_vjp(lambda x, k: fp8.dot_general(x, k, dims, state), x, k, g)
  want = value_and_vjp(lambda x, k: lax.dot_general(x, k, dims), x, k, g)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def quantization_error(v, scale, dtype):
  """Per-element bound on |dequantize(quantize(v)) - v| (no saturation)."""
  fmt = jl.FORMATS[np.dtype(dtype).name]
  return fmt.epsilon / 2 * np.abs(v) + fmt.min_subnormal / 2 * scale


def scaled_state(x, k, g, config):
  """The state delayed scaling reaches after one step that saw x, k and g."""
  state = fp8.init_dot_state(config)
  amax = fp8.Fp8DotAmax(*(fp8.compute_amax(t) for t in (x, k, g)))
  return fp8.update(state, amax, config)


@pytest.mark.parametrize("recipe", ["hybrid", "e4m3", "e5m2"])
def test_dot_general_error_within_format_bounds(recipe):
  """Forward and gradients are within the elementwise bound the formats imply.

  For y = x @ k with e_x, e_k the per-element quantization errors,
  |y_fp8 - y| <= e_x @ (|k| + e_k) + |x| @ e_k; the same for dx = g @ k.T, dk = x.T @ g.
  """
  config = fp8.get_fp8_policy(f"fp8=delayed:{recipe}", amax_history_length=4).config
  fwd, bwd = config.fwd_dtype, config.bwd_dtype
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((16, 32)) * 3, jnp.float32)
  k = jnp.asarray(rng.standard_normal((32, 8)) * 0.05, jnp.float32)
  g = jnp.asarray(rng.standard_normal((16, 8)) * 1e-3, jnp.float32)
  state = scaled_state(x, k, g, config)
  s_x, s_k, s_g = (float(t.scale) for t in state)
  y, (dx, dk) = value_and_vjp(
    lambda x, k: fp8.dot_general(x, k, MATMUL, state, config=config), x, k, g
  )
  xs, ks, gs = (np.asarray(t, np.float64) for t in (x, k, g))
  ex, ek = quantization_error(xs, s_x, fwd), quantization_error(ks, s_k, fwd)
  eg = quantization_error(gs, s_g, bwd)
  xq, kq, gq = dequantized(x, s_x, fwd), dequantized(k, s_k, fwd), dequantized(g, s_g, bwd)
  slack = 1e-5  # fp32 accumulation and the final rescale

  def check(got, a, b, aq, bq, bound):
    got, want = np.asarray(got, np.float64), a @ b
    err = np.abs(got - want)
    assert np.all(err <= bound + slack * np.abs(want).max()), np.max(err - bound)
    # The error is the quantization's: the result is the product of the quantized operands
    # (exact products, an fp32 sum of K terms, two fp32 scalings), which is not the exact one.
    fp32_error = (a.shape[1] + 2) * 2.0**-24 * (np.abs(aq) @ np.abs(bq))
    assert np.all(np.abs(got - aq @ bq) <= fp32_error), np.max(np.abs(got - aq @ bq) - fp32_error)
    assert not np.all(err <= fp32_error)

  check(y, xs, ks, xq, kq, ex @ (np.abs(ks) + ek) + np.abs(xs) @ ek)
  check(dx, gs, ks.T, gq, kq.T, eg @ (np.abs(ks) + ek).T + np.abs(gs) @ ek.T)
  check(dk, xs.T, gs, xq.T, gq, ex.T @ (np.abs(gs) + eg) + np.abs(xs).T @ eg)


def test_dot_general_observes_amax_through_the_probe():
  x = jnp.array([[1.0, -7.0], [2.0, 3.0]])
  k = jnp.array([[0.5], [-0.25]])
  state = unit_state()

  def loss(x, k, amax):
    return jnp.sum(fp8.dot_general(x, k, MATMUL, state, amax) * jnp.array([[3.0], [-5.0]]))

  observed = jax.jit(jax.grad(loss, argnums=2))(x, k, fp8.zeros_amax(state))
  # max |x|, max |k| and max |g| for the output gradient g = (3, -5)^T.
  expected = {"input": 7.0, "kernel": 0.5, "output_grad": 5.0}
  assert type(observed) is fp8.Fp8DotAmax and jax.tree.map(float, observed)._asdict() == expected
  # Without a probe nothing is observed, and the gradients are unchanged.
  with_probe = jax.grad(loss, argnums=(0, 1))(x, k, fp8.zeros_amax(state))
  without = jax.grad(lambda x, k: loss(x, k, None), argnums=(0, 1))(x, k)
  jax.tree.map(np.testing.assert_array_equal, with_probe, without)


def test_dot_general_dtypes_and_fp32_accumulation():
  state = unit_state()
  x = jnp.ones((2, 4096), jnp.bfloat16)
  k = jnp.full((4096, 1), 2.0**-8, jnp.bfloat16)

  @jax.jit
  def run(x, k):
    y = fp8.dot_general(x, k, MATMUL, state)
    y32 = fp8.dot_general(x, k, MATMUL, state, preferred_element_type=jnp.float32)
    grads = jax.grad(lambda x, k: fp8.dot_general(x, k, MATMUL, state).sum(), (0, 1))(x, k)
    return y, y32, grads

  y, y32, (dx, dk) = run(x, k)
  assert y.dtype == jnp.bfloat16 and float(y[0, 0]) == 16.0  # fp32 sum of 2^-8s: exact
  assert y32.dtype == jnp.float32
  assert dx.dtype == dk.dtype == jnp.bfloat16


def dequantized(v, scale, dtype):
  return np.asarray(fp8.quantize(v, scale, dtype), np.float64) * np.float64(scale)


@pytest.mark.parametrize("recipe", ["hybrid", "e4m3", "e5m2"])
def test_bf16_results_are_the_scaled_fp32_sum_rounded_once(recipe):
  """A bf16 result is the product of the quantized operands (exact products, an fp32 sum,
  scaled in fp32) rounded once to bf16, forward and both gradients."""
  config = fp8.get_fp8_policy(f"fp8=delayed:{recipe}", amax_history_length=4).config
  fwd, bwd = config.fwd_dtype, config.bwd_dtype
  rng = np.random.default_rng(7)
  bf16 = jnp.bfloat16
  x = jnp.asarray(rng.standard_normal((16, 64)) * 3, bf16)
  k = jnp.asarray(rng.standard_normal((64, 8)) * 0.05, bf16)
  g = jnp.asarray(rng.standard_normal((16, 8)) * 1e-3, bf16)
  state = scaled_state(x, k, g, config)  # amax / fp8_max: no short binary expansion
  y, (dx, dk) = value_and_vjp(
    lambda x, k: fp8.dot_general(x, k, MATMUL, state, config=config), x, k, g
  )
  assert y.dtype == dx.dtype == dk.dtype == bf16
  s_x, s_k, s_g = (float(t.scale) for t in state)
  xq, kq, gq = dequantized(x, s_x, fwd), dequantized(k, s_k, fwd), dequantized(g, s_g, bwd)
  for got, a, b in ((y, xq, kq), (dx, gq, kq.T), (dk, xq.T, gq)):
    want = a @ b  # float64
    got = np.asarray(got, np.float64)
    half_ulp = np.exp2(np.floor(np.log2(np.abs(want))) - 8)  # bf16: 8 significant bits
    fp32_error = (a.shape[1] + 2) * 2.0**-24 * (np.abs(a) @ np.abs(b))  # sum, then 2 scalings
    assert np.all(np.abs(got - want) <= half_ulp + fp32_error)


def hlo_instructions(fun, *args):
  """name -> (result type, opcode, operand names, attributes) of a lowered program's HLO."""
  text = jax.jit(fun).lower(*args).as_text(dialect="hlo")
  pattern = re.compile(r"^\s*(?:ROOT )?([\w.-]+) = (\S+?)(?:\{[\d,]*\})? ([\w-]+)\(([^)]*)\)(.*)$")
  out = {}
  for line in text.splitlines():
    if m := pattern.match(line):
      name, result, opcode, operands, rest = m.groups()
      out[name] = (result, opcode, [o.strip() for o in operands.split(",") if o.strip()], rest)
  return out


@pytest.mark.parametrize(
  "fast, forward, backward",
  [
    ("none", "highest", "highest"),
    ("forward", "default", "highest"),
    ("all", "default", "default"),
  ],
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matmuls_are_in_the_form_xla_gpu_fuses_into_fp8_gemms(fast, forward, backward, dtype):
  """The HLO form XLA:GPU turns into one cuBLASLt fp8 GEMM, its scale included.

  Every dot takes the fp8 arrays themselves (not ``convert(fp8) * scale``: XLA:GPU removes
  that round trip and runs a bf16 GEMM on unquantized values) and its f32 result is multiplied
  by a scalar broadcast (the GEMM's output scale); the kernel gradient comes out in the
  kernel's layout (no transpose). The precision selects fast accumulation.
  """
  config = fp8.Fp8Config(amax_history_length=2, fast_accumulation=fast)
  state = fp8.init_dot_state(config)
  dense = (((2,), (0,)), ((), ()))
  x, k, g = jnp.ones((2, 8, 16), dtype), jnp.ones((16, 32), dtype), jnp.ones((2, 8, 32), dtype)
  fun = lambda x, k, g, s: value_and_vjp(
    lambda x, k: fp8.dot_general(x, k, dense, s, config=config), x, k, g
  )
  instructions = hlo_instructions(fun, x, k, g, state)
  dots = {n: i for n, i in instructions.items() if i[1] == "dot"}
  assert len(dots) == 3
  # HLO prints no operand_precision for DEFAULT.
  precisions = sorted(
    (re.findall(r"operand_precision=\{(\w+),", i[3]) or ["default"])[0] for i in dots.values()
  )
  assert precisions == sorted([forward, backward, backward])
  formats = []
  for dot, (result, _, operands, _) in dots.items():
    assert result.startswith("f32[")
    formats.append(sorted(instructions[o][0].split("[")[0] for o in operands))
    users = [i for i in instructions.values() if dot in i[2]]
    assert [u[1] for u in users] == ["multiply"]
    assert [instructions[o][1] for o in users[0][2] if o != dot] == ["broadcast"]
  both = ["f8e4m3fn", "f8e5m2"]
  assert sorted(formats) == [["f8e4m3fn", "f8e4m3fn"], both, both]
  assert not [i for i in instructions.values() if i[1] == "transpose" and i[0].startswith("f32")]


def test_dot_general_rejects_bad_arguments():
  state = unit_state()
  x = jnp.ones((2, 3))
  with pytest.raises(TypeError, match="floating-point array, got dtype int32"):
    fp8.dot_general(jnp.ones((2, 3), jnp.int32), x.T, MATMUL, state)
  with pytest.raises(ValueError, match=r"16 or 32 bits .* float8_e4m3fn"):
    fp8.dot_general(x.astype(E4M3), x.T, MATMUL, state)
  with pytest.raises(TypeError, match="state must be an Fp8DotState"):
    fp8.dot_general(x, x.T, MATMUL, {"scale": 1.0})
  with pytest.raises(TypeError, match="amax must be an Fp8DotAmax"):
    fp8.dot_general(x, x.T, MATMUL, state, (0.0, 0.0, 0.0))
  with pytest.raises(ValueError, match="Invalid rhs dimensions"):
    fp8.dot_general(x, x.T, (((1,), (2,)), ((), ())), state)
  with pytest.raises(ValueError, match="dimension_numbers must be"):
    fp8.dot_general(x, x.T, ((1, 0),), state)
  with pytest.raises(TypeError, match="config must be an fp8 recipe"):
    fp8.dot_general(x, x.T, MATMUL, state, config="hybrid")
  with pytest.raises(ValueError, match=r"loss_scale must be a scalar, got shape \(2,\)"):
    fp8.dot_general(x, x.T, MATMUL, state, loss_scale=jnp.ones(2))
  bad = state._replace(input=fp8.Fp8ScaleState(jnp.ones(3), jnp.zeros(2)))
  with pytest.raises(ValueError, match=r"state\.input\.scale must be a scalar"):
    fp8.dot_general(x, x.T, MATMUL, bad)


def test_dot_general_under_vmap_and_jit():
  state = unit_state()
  xs, k = small_integers((5, 3, 4), 4, 3), small_integers((4, 2), 5, 3)
  f = jax.jit(jax.vmap(lambda x: fp8.dot_general(x, k, MATMUL, state)))
  np.testing.assert_array_equal(f(xs), jnp.einsum("bij,jk->bik", xs, k))


def test_einsum_takes_exactly_the_keyword_options_of_dot_general():
  """einsum passes its options on to dot_general: the two keyword lists cannot drift apart."""
  keyword_only = [
    name
    for name, p in inspect.signature(fp8.dot_general).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
  ]
  assert list(DotOptions.__annotations__) == keyword_only
  state = unit_state()
  x = jnp.ones((2, 3))
  with pytest.raises(TypeError, match="unexpected keyword argument 'precison'"):
    fp8.einsum("ij,jk->ik", x, x.T, state, precison=None)
  y = fp8.einsum("ij,jk->ik", x, x.T, state, preferred_element_type=jnp.bfloat16)
  assert y.dtype == jnp.bfloat16 and y.tolist() == [[3.0, 3.0], [3.0, 3.0]]


def test_current_scaling_scopes_nest_and_stay_in_their_thread():
  """Every open scope counts an op traced inside; another thread sees none of them."""
  state = unit_state()
  x, k = jnp.full((1, 1), 896.0), jnp.full((1, 1), 448.0)  # 896 saturates E4M3 at scale 1
  exact, saturated = 896.0 * 448.0, 448.0 * 448.0

  def traced(probe):
    return float(fp8.dot_general(x, k, MATMUL, state, probe)[0, 0])

  probe = fp8.zeros_amax(state)
  with fp8.current_scaling() as outer:
    assert traced(probe) == exact  # its own scale: exact
    with fp8.current_scaling() as inner:
      assert traced(probe) == exact
      assert traced(None) == exact  # current scaling without a probe, counted by neither
      with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(traced, probe).result() == saturated  # delayed: saturated
  assert (outer.probed_ops, inner.probed_ops) == (2, 1)
  assert traced(probe) == saturated


# einsum --------------------------------------------------------------------------------


@pytest.mark.parametrize(
  "subscripts, lhs_shape, rhs_shape",
  [
    ("bd,df->bf", (3, 4), (4, 5)),
    ("btd,df->bft", (2, 3, 4), (4, 5)),
    ("bhd,hdf->bf", (3, 2, 4), (2, 4, 5)),
    ("bqhd,bkhd->bhqk", (2, 3, 2, 4), (2, 5, 2, 4)),
    ("...d,df->...f", (2, 3, 4), (4, 5)),
    ("...d,...df->...f", (2, 3, 4), (3, 4, 5)),
    ("ij,jk", (3, 4), (4, 5)),  # implicit output
    ("ba,ac", (3, 4), (4, 5)),
    ("bd,dfz->bf", (3, 4), (4, 5, 2)),  # z is summed away first
    ("i,j->ij", (3,), (4,)),
  ],
)
def test_einsum_matches_jnp_einsum(subscripts, lhs_shape, rhs_shape):
  state = unit_state()
  x, k = small_integers(lhs_shape, 6, 2), small_integers(rhs_shape, 7, 2)
  g = small_integers(jnp.einsum(subscripts, x, k).shape, 8, 2)
  got = value_and_vjp(lambda x, k: fp8.einsum(subscripts, x, k, state), x, k, g)
  want = value_and_vjp(lambda x, k: jnp.einsum(subscripts, x, k), x, k, g)
  jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.parametrize(
  "subscripts, shapes, match",
  [
    ("ab,bc,cd->ad", ((2, 2), (2, 2)), "exactly two operands"),
    ("ii,ij->j", ((2, 2), (2, 3)), "Repeated index"),
    ("ab,bc->ac", ((2, 3, 4), (3, 4)), "do not fit the lhs operand of rank 3"),
    ("ab,bc->ac", ((2, 3), (4, 5)), "Index 'b' .* size 3 in lhs and 4 in rhs"),
    ("ab,bc->ad", ((2, 3), (3, 5)), "appear in no operand"),
    ("a1,1c->ac", ((2, 3), (3, 5)), "Invalid subscripts"),
  ],
)
def test_einsum_rejects_bad_subscripts(subscripts, shapes, match):
  state = unit_state()
  with pytest.raises(ValueError, match=match):
    fp8.einsum(subscripts, jnp.ones(shapes[0]), jnp.ones(shapes[1]), state)


# Training with fp8 ---------------------------------------------------------------------

CONFIG = fp8.Fp8Config(amax_history_length=8)


def normal(rng, shape, scale=1.0):
  # NumPy, not jax.random: eager jax.random compiles op by op, seconds on a busy CPU.
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def mlp_init(seed=0):
  rng = np.random.default_rng(seed)
  return {"w1": normal(rng, (8, 32), 8**-0.5), "w2": normal(rng, (32, 4), 32**-0.5)}


def mlp_data(n=64, seed=1):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((n, 8))
  y = np.sin(x @ rng.standard_normal((8, 4)))
  return jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32)


def mlp_loss(params, fp8_state, amax, x, y, loss_scale=None, reduce=jnp.mean):
  """A 2-layer MLP with both matmuls in fp8 (fp8_state None: float32/bfloat16 reference)."""
  if fp8_state is None:
    h = jnp.tanh(x @ params["w1"])
    out = h @ params["w2"]
  else:
    amax = amax or {"l1": None, "l2": None}
    kw = {"config": CONFIG, "loss_scale": loss_scale}
    h = jnp.tanh(fp8.dot_general(x, params["w1"], MATMUL, fp8_state["l1"], amax["l1"], **kw))
    out = fp8.dot_general(h, params["w2"], MATMUL, fp8_state["l2"], amax["l2"], **kw)
  return reduce((out.astype(jnp.float32) - y) ** 2)


def init_mlp_state(set_scales=False):
  """Fresh states (no scales yet), or with set_scales every scale 1."""
  init = (lambda: unit_state(CONFIG)) if set_scales else (lambda: fp8.init_dot_state(CONFIG))
  return {"l1": init(), "l2": init()}


@jax.jit
def fp8_grads(params, fp8_state, x, y):
  grads, amax = jax.grad(mlp_loss, argnums=(0, 2))(
    params, fp8_state, fp8.zeros_amax(fp8_state), x, y
  )
  return grads, fp8.update(fp8_state, amax, CONFIG)


def test_gradients_close_to_bf16_reference():
  params, (x, y) = mlp_init(), mlp_data()
  state = init_mlp_state()
  _, state = fp8_grads(params, state, x, y)  # one step to calibrate the scales
  grads, _ = fp8_grads(params, state, x, y)
  bf16 = jl.get_policy("p=f32,c=bf16,o=f32")
  ref_loss = lambda p: mlp_loss(bf16.cast_to_compute(p), None, None, bf16.cast_to_compute(x), y)
  ref = jax.jit(jax.grad(ref_loss))(params)
  ref = bf16.cast_to_param(ref)
  # Per-element errors are below eps/2 per quantized operand: e4m3 (fwd) and e5m2 (bwd);
  # in norm they average down. Bound by one e4m3 epsilon, well above bf16's own error.
  tol = jl.FORMATS["float8_e4m3fn"].epsilon
  # And the operands were quantized: e4m3's epsilon is 16x bf16's, so fp8's error is some 16x
  # bf16's own (against fp32; measured 13x); at least 4x.
  fp32 = jax.jit(jax.grad(lambda p: mlp_loss(p, None, None, x, y)))(params)
  eps_ratio = tol / jl.FORMATS["bfloat16"].epsilon
  rel_error = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  for name in params:
    rel = rel_error(grads[name], ref[name])
    assert eps_ratio / 4 * rel_error(ref[name], fp32[name]) < rel < tol, (name, rel)


def test_training_adapts_scales_and_tracks_bf16():
  params, (x, y) = mlp_init(), mlp_data()
  state = init_mlp_state()
  ref = params
  opt = optax.adam(0.02)
  opt_state, ref_state = opt.init(params), opt.init(params)

  @jax.jit
  def ref_step(p, s):
    bf16 = jl.get_policy("p=f32,c=bf16,o=f32")
    g = jax.grad(
      lambda p: mlp_loss(bf16.cast_to_compute(p), None, None, bf16.cast_to_compute(x), y)
    )(p)
    u, s = opt.update(bf16.cast_to_param(g), s)
    return optax.apply_updates(p, u), s

  scales = []
  for _ in range(40):
    grads, state = fp8_grads(params, state, x, y)
    updates, opt_state = opt.update(grads, opt_state)
    params = optax.apply_updates(params, updates)
    ref, ref_state = ref_step(ref, ref_state)
    scales.append([float(t.scale) for dot in state.values() for t in dot])
  # Scales start at 1 and move to amax / fp8_max: input ~ 3/448, gradients far smaller.
  assert all(s != 1.0 for s in scales[-1])
  assert scales[-1][2] < 1e-3 and scales[-1][0] < 0.05
  assert len({tuple(s) for s in scales}) > 2  # they keep adapting as the weights move
  for dot in state.values():  # each is its history's max over the format's largest value
    for tensor, dtype in zip(dot, (E4M3, E4M3, E5M2), strict=True):
      want = np.float32(np.max(tensor.amax_history)) / np.float32(FMT[dtype].max)
      assert float(tensor.scale) == pytest.approx(float(want), rel=1e-6)
  # Evaluated in float32: the fp8-trained and bf16-trained weights reach similar losses.
  loss, ref_loss = (float(mlp_loss(p, None, None, x, y)) for p in (params, ref))
  start = float(mlp_loss(mlp_init(), None, None, x, y))
  assert loss < 0.3 * start
  assert abs(loss - ref_loss) < 0.05 * start


# The first step: calibration -----------------------------------------------------------

TINY = 2.0**-20  # a loss this small gives output gradients under E5M2's 2^-16 at scale 1
FIRST_STEP_CASES = {
  # (input factor, loss factor, loss scale): the loss scale passed as docs/fp8.md says
  "tiny_gradients": (1.0, TINY, 2.0**12),
  "large_inputs": (2.0**10, 1.0, 1.0),  # |x| up to ~3000: saturates E4M3 (448) at scale 1
}


def matmul_data(x_factor):
  rng = np.random.default_rng(11)
  x = normal(rng, (16, 32), x_factor)
  return x, normal(rng, (32, 8), 0.2), normal(rng, (16, 8))


def matmul_loss(x, k, t, state, amax, loss_scale, factor):
  y = fp8.dot_general(x, k, MATMUL, state, amax, config=CONFIG, loss_scale=loss_scale)
  return loss_scale * factor * jnp.sum(y * t), y


@jax.jit
def calibrate_matmul(x, k, t, state, loss_scale, factor):
  loss = lambda amax: matmul_loss(x, k, t, state, amax, loss_scale, factor)
  return fp8.calibrate(loss, state, CONFIG, has_aux=True)


@functools.partial(jax.jit, static_argnames="current")
def matmul_step(x, k, t, state, loss_scale, factor, current=False):
  """y, the (loss-scaled) gradients and the observations of one fp8 matmul step."""
  grad = jax.grad(matmul_loss, argnums=(0, 1, 4), has_aux=True)
  with fp8.current_scaling() if current else contextlib.nullcontext():
    (dx, dk, amax), y = grad(x, k, t, state, fp8.zeros_amax(state), loss_scale, factor)
  return y, dx, dk, amax


@pytest.mark.parametrize("case", FIRST_STEP_CASES)
def test_first_step_after_calibration_has_only_rounding_error(case):
  """From a fresh state, calibrate, then step 0: its error is fp8 rounding, not a flush/saturation.

  With the initial scales of 1 the gradients of "tiny_gradients" are 100% zeros, and
  "large_inputs" saturates. Calibrated, each scale is amax / fp8_max, and every output and
  gradient is within the bound of E4M3 (forward) and E5M2 (gradient) rounding used in
  test_dot_general_error_within_format_bounds: e_v <= eps/2 |v| + min_subnormal/2 s_v.
  """
  x_factor, factor, loss_scale = FIRST_STEP_CASES[case]
  x, k, t = matmul_data(x_factor)
  fresh = fp8.init_dot_state(CONFIG)
  args = (jnp.float32(loss_scale), jnp.float32(factor))
  state = calibrate_matmul(x, k, t, fresh, *args)
  xs, ks, gs = (np.asarray(v, np.float64) for v in (x, k, factor * t))
  amaxes = (np.abs(x).max(), np.abs(k).max(), np.float32(factor) * np.abs(t).max())
  fp8_max = (FMT[E4M3].max, FMT[E4M3].max, FMT[E5M2].max)
  for tensor, amax, top in zip(state, amaxes, fp8_max, strict=True):
    assert float(tensor.scale) == np.float32(amax) / np.float32(top)  # exact: fp32 division
    assert float(tensor.amax_history[0]) == amax
  s_x, s_k, s_g = (float(t.scale) for t in state)
  y, dx, dk, _ = matmul_step(x, k, t, state, *args)
  dx, dk = dx / loss_scale, dk / loss_scale  # exact: a power of two
  ex, ek = quantization_error(xs, s_x, E4M3), quantization_error(ks, s_k, E4M3)
  eg = quantization_error(gs, s_g, E5M2)
  for got, want, bound in (
    (y, xs @ ks, ex @ (np.abs(ks) + ek) + np.abs(xs) @ ek),
    (dx, gs @ ks.T, eg @ (np.abs(ks) + ek).T + np.abs(gs) @ ek.T),
    (dk, xs.T @ gs, ex.T @ (np.abs(gs) + eg) + np.abs(xs).T @ eg),
  ):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)
    assert np.all(err <= bound + 1e-5 * np.abs(want).max()), np.max(err - bound)
    assert np.all((got != 0) | (want == 0))  # nothing flushed
    assert np.linalg.norm(got - want) <= 0.15 * np.linalg.norm(want)
  # The calibration pass quantized exactly as this step did: the same values, bit for bit.
  current = matmul_step(x, k, t, fresh, *args, current=True)
  jax.tree.map(np.testing.assert_array_equal, current, matmul_step(x, k, t, state, *args))


@jax.jit
def delayed_scaling_reference(x, k, t, state, loss_scale):
  """The module docstring's math with the state's scales, from public pieces."""
  s_x, s_k, s_g = (t.scale for t in state)
  f32 = jnp.float32
  q_x, q_k = fp8.quantize(x, s_x, E4M3), fp8.quantize(k, s_k, E4M3)
  y = lax.dot_general(q_x, q_k, MATMUL, preferred_element_type=f32) * (s_x * s_k)
  s = s_g * loss_scale
  q_g = fp8.quantize(loss_scale * t, s, E5M2)
  dx = lax.dot_general(q_g, q_k, (((1,), (1,)), ((), ())), preferred_element_type=f32) * (s * s_k)
  dk = lax.dot_general(q_g, q_x, (((0,), (0,)), ((), ())), preferred_element_type=f32).T
  return y, dx, dk * (s * s_x)


def test_steady_state_is_delayed_scaling_bit_for_bit():
  """With a history (every step but a fresh state's first), nothing changed: each tensor is
  quantized with its state's scale, not its own amax, and the results are the documented
  delayed-scaling math bit for bit."""
  x, k, t = matmul_data(1.0)
  state = fp8.init_dot_state(CONFIG)
  for amax in ((5.0, 0.3, 0.7), (2.0, 0.5, 3.0)):  # scales unrelated to this batch's amaxes
    state = fp8.update(state, fp8.Fp8DotAmax(*map(jnp.float32, amax)), CONFIG)
  loss_scale = jnp.float32(2.0**12)
  y, dx, dk, amax = matmul_step(x, k, t, state, loss_scale, jnp.float32(1))
  jax.tree.map(
    np.testing.assert_array_equal,
    (y, dx, dk),
    delayed_scaling_reference(x, k, t, state, loss_scale),
  )
  observed = [float(np.abs(v).max()) for v in (x, k, t)]
  assert [float(a) for a in amax] == observed
  # Under current_scaling the same step quantizes differently (its own amaxes).
  current = matmul_step(x, k, t, state, loss_scale, jnp.float32(1), current=True)
  assert not np.array_equal(current[0], y)


def test_calibrated_fp8_training_keeps_up_with_bf16_from_the_first_step():
  """Adam on a loss times 2^-20: calibrated fp8 makes the same progress as bf16 from step 1.

  Uncalibrated, step 0's gradients are all zero (scales of 1 flush them) and the first layer's
  stay zero until its output-gradient scale is set a step later: after 1 and 2 steps fp8 has
  made 0% and ~31% of bf16's progress. Calibrated, each step's gradients differ from bf16's by
  E4M3/E5M2 rounding (per-leaf error ~5%, see test_first_step_after_calibration_has_only_
  rounding_error), so the loss decrease agrees to a few per cent of bf16's; 10% allows twice
  that, and a step of lag is a 100% miss.
  """
  params, (x, y) = mlp_init(), mlp_data()
  opt = optax.adam(0.02)
  bf16, fp32 = jl.get_policy("p=f32,c=bf16,o=f32"), jl.get_policy("p=f32,c=f32,o=f32")

  @jax.jit
  def fp8_step(p, state, opt_state):
    grads, amax = jax.grad(lambda p, a: TINY * mlp_loss(p, state, a, x, y), argnums=(0, 1))(
      p, fp8.zeros_amax(state)
    )
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(p, updates), fp8.update(state, amax, CONFIG), opt_state

  @functools.partial(jax.jit, static_argnums=2)
  def reference_step(p, opt_state, policy):  # bf16, or fp32 to check the bf16 run against
    loss = lambda p: (
      TINY * mlp_loss(policy.cast_to_compute(p), None, None, policy.cast_to_compute(x), y)
    )
    updates, opt_state = opt.update(policy.cast_to_param(jax.grad(loss)(p)), opt_state)
    return optax.apply_updates(p, updates), opt_state

  calibrate = jax.jit(
    lambda p, state: fp8.calibrate(lambda a: TINY * mlp_loss(p, state, a, x, y), state, CONFIG)
  )
  evaluate = jax.jit(lambda p: mlp_loss(p, None, None, x, y))  # float32, for both
  state = calibrate(params, init_mlp_state())
  fp8_run = (params, state, opt.init(params))
  bf16_run = fp32_run = (params, opt.init(params))
  start = float(evaluate(params))
  for step in range(10):
    fp8_run, bf16_run = fp8_step(*fp8_run), reference_step(*bf16_run, bf16)
    fp32_run = reference_step(*fp32_run, fp32)
    fp8_progress, bf16_progress, fp32_progress = (
      start - float(evaluate(run[0])) for run in (fp8_run, bf16_run, fp32_run)
    )
    # The reference makes fp32's progress to bf16 rounding (measured: within 0.04%).
    assert abs(bf16_progress - fp32_progress) <= 2**-8 * fp32_progress, (step, bf16_progress)
    assert abs(fp8_progress - bf16_progress) <= 0.1 * bf16_progress, (step, fp8_progress)


def test_calibrate_rejects_what_would_calibrate_nothing():
  x, k, t = matmul_data(1.0)
  state = fp8.init_dot_state(CONFIG)
  no_probe = lambda amax: matmul_loss(x, k, t, state, None, 1.0, 1.0)[0]
  with pytest.raises(ValueError, match="traced no fp8 matmul with an amax probe"):
    jax.eval_shape(lambda: fp8.calibrate(no_probe, state, CONFIG))
  # A jitted loss traced before keeps its compiled delayed-scaling program.
  traced_before = jax.jit(lambda amax: matmul_loss(x, k, t, state, amax, 1.0, 1.0)[0])
  jax.eval_shape(traced_before, fp8.zeros_amax(state))
  with pytest.raises(ValueError, match=r"not a jax\.jit function compiled before"):
    jax.eval_shape(lambda: fp8.calibrate(traced_before, state, CONFIG))
  with pytest.raises(ValueError, match="holds no Fp8DotState"):
    fp8.calibrate(no_probe, {}, CONFIG)
  with pytest.raises(TypeError, match="fun must be a function"):
    fp8.calibrate(state, state, CONFIG)
  with pytest.raises(TypeError, match="Expected Fp8DotState nodes"):
    fp8.calibrate(no_probe, {"scale": 1.0}, CONFIG)


# State round trips ---------------------------------------------------------------------


def test_state_round_trips():
  state = init_mlp_state()
  state = fp8.update(state, jax.tree.map(lambda z: z + 3.0, fp8.zeros_amax(state)), CONFIG)
  tree = {"fp8": state, "step": jnp.int32(3)}

  def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)

  assert_same(pickle.loads(pickle.dumps(tree)), tree)
  target = jax.tree.map(jnp.zeros_like, tree)
  assert_same(flax.serialization.from_bytes(target, flax.serialization.to_bytes(tree)), tree)
  leaves, treedef = jax.tree.flatten(tree)
  assert_same(jax.tree.unflatten(treedef, leaves), tree)
  assert_same(jax.jit(lambda t: t)(tree), tree)
  # Paths name the fields, for checkpoint inspection.
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
  assert "['l1'].input.amax_history" in paths
  assert "['l2'].output_grad.scale" in paths


def test_state_round_trips_through_orbax(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  state = fp8.update(
    init_mlp_state(), jax.tree.map(lambda z: z + 3.0, fp8.zeros_amax(init_mlp_state())), CONFIG
  )
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "fp8", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "fp8", jax.tree.map(jnp.zeros_like, state))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, restored, state)


# Multi-device and gradient accumulation ------------------------------------------------


def _mesh():
  devices = jax.devices()
  assert len(devices) == 8, "tests expect 8 host CPU devices; see tests/conftest.py"
  return jax.make_mesh((8,), ("data",), devices=devices)


def assert_close(a, b, rtol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol), a, b)


@jax.jit
def full_batch_update(params, state, x, y):
  """The reference: one device, the whole batch, a sum loss (so shards add up)."""
  grads, amax = jax.grad(mlp_loss, argnums=(0, 2))(
    params, state, fp8.zeros_amax(state), x, y, reduce=jnp.sum
  )
  return grads, amax, fp8.update(state, amax, CONFIG)


@pytest.mark.parametrize("check_vma", [True, False])
def test_amax_is_max_reduced_across_devices_under_shard_map(check_vma):
  mesh = _mesh()
  params, (x, y) = mlp_init(), mlp_data(32)
  # Give each device a different input range, so max and sum differ.
  x = x * jnp.repeat(jnp.arange(1.0, 9.0), 4)[:, None]
  state = init_mlp_state(set_scales=True)
  ref_grads, _, ref_state = full_batch_update(params, state, x, y)

  def per_device(params, state, x, y):
    grads, amax = jax.grad(mlp_loss, argnums=(0, 2))(
      params, state, fp8.zeros_amax(state), x, y, reduce=jnp.sum
    )
    if not check_vma:  # untyped: local gradients and observations, reduced by hand
      grads = jax.lax.psum(grads, "data")
    # With check_vma, JAX sums the gradients of replicated parameters itself and the
    # fp8 matmul max-reduces the observations of a replicated probe; axis_name is then
    # a no-op, and needed without it.
    new_state = fp8.update(state, amax, CONFIG, axis_name="data")
    return grads, new_state, fp8.compute_amax(x)[None]

  rep, data = PartitionSpec(), PartitionSpec("data")
  x, y = (jax.device_put(t, NamedSharding(mesh, data)) for t in (x, y))
  f = jax.jit(
    jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(rep, rep, data, data),
      out_specs=(rep, rep, data),
      check_vma=check_vma,
    )
  )
  grads, new_state, local_amax = f(params, state, x, y)
  # Each device saw its own shard; the state took the max over them, not the sum.
  np.testing.assert_array_equal(local_amax, jnp.abs(x).reshape(8, 4, 8).max(axis=(1, 2)))
  assert float(new_state["l1"].input.amax_history[0]) == float(local_amax.max())
  assert float(local_amax.sum()) > 2 * float(local_amax.max())
  assert_close(new_state, ref_state, rtol=1e-6)  # matmuls of other shapes may round differently
  assert_close(grads, ref_grads, rtol=1e-5)


def test_amax_is_global_under_sharded_jit():
  mesh = _mesh()
  params, (x, y) = mlp_init(), mlp_data(32)
  x = x * jnp.repeat(jnp.arange(1.0, 9.0), 4)[:, None]
  state = init_mlp_state(set_scales=True)
  _, _, ref_state = full_batch_update(params, state, x, y)
  sharding = NamedSharding(mesh, PartitionSpec("data"))
  xs, ys = jax.device_put(x, sharding), jax.device_put(y, sharding)
  with jax.set_mesh(mesh):  # explicit sharding: the mesh the transposed matmuls live on
    _, _, new_state = full_batch_update(params, state, xs, ys)
  assert_close(new_state, ref_state, rtol=1e-6)
  assert float(new_state["l1"].input.amax_history[0]) == float(jnp.abs(x).max())


def test_out_sharding_under_explicit_sharding():
  mesh = _mesh()
  state = unit_state()
  x = jax.device_put(small_integers((16, 4), 9, 3), NamedSharding(mesh, PartitionSpec("data")))
  k = small_integers((4, 3), 10, 3)
  with jax.set_mesh(mesh):

    @jax.jit
    def run(x, k):
      y = fp8.dot_general(x, k, MATMUL, state, out_sharding=PartitionSpec("data", None))
      # A transposed output: the matmul's result is resharded to the requested layout.
      z_fn = lambda x, k: fp8.einsum(
        "bd,df->fb", x, k, state, out_sharding=PartitionSpec(None, "data")
      )
      return y, z_fn(x, k), jax.grad(lambda x, k: z_fn(x, k).sum(), (0, 1))(x, k)

    y, z, (dx, dk) = run(x, k)
  assert y.sharding.spec == PartitionSpec("data", None)
  assert z.sharding.spec == PartitionSpec(None, "data")
  assert dx.sharding.spec == PartitionSpec("data", None)  # cotangents sharded like primals
  np.testing.assert_array_equal(y, x @ k)
  np.testing.assert_array_equal(z, (x @ k).T)
  np.testing.assert_array_equal(dk, jnp.broadcast_to(x.sum(0)[:, None], (4, 3)))


def test_amax_is_max_combined_across_microsteps():
  params, (x, y) = mlp_init(), mlp_data(32)
  x = x * jnp.repeat(jnp.arange(1.0, 5.0), 8)[:, None]
  state = init_mlp_state(set_scales=True)
  ref_grads, ref_amax, ref_state = full_batch_update(params, state, x, y)

  @jax.jit
  def accumulate(params, state, x, y):
    def microstep(carry, batch):
      grads, amax = carry
      g, a = jax.grad(mlp_loss, argnums=(0, 2))(
        params, state, fp8.zeros_amax(state), *batch, reduce=jnp.sum
      )
      return (jax.tree.map(jnp.add, grads, g), fp8.combine_amax(amax, a)), None

    zeros = (jax.tree.map(jnp.zeros_like, params), fp8.zeros_amax(state))
    batches = (x.reshape(4, 8, 8), y.reshape(4, 8, 4))
    (grads, amax), _ = jax.lax.scan(microstep, zeros, batches)
    return grads, amax, fp8.update(state, amax, CONFIG)

  grads, amax, new_state = accumulate(params, state, x, y)
  assert float(amax["l1"].input) == float(ref_amax["l1"].input) == float(jnp.abs(x).max())
  assert_close(amax, ref_amax, rtol=1e-6)
  assert_close(new_state, ref_state, rtol=1e-6)
  assert_close(grads, ref_grads, rtol=1e-5)
  # An overflowed microstep wins the max and is then dropped by update.
  bad = fp8.combine_amax(amax, jax.tree.map(lambda a: a * jnp.inf, amax))
  assert np.isinf(bad["l1"].output_grad)
  assert_close(fp8.update(state, bad, CONFIG)["l1"].output_grad, state["l1"].output_grad, rtol=0)


# Interaction with loss scaling ---------------------------------------------------------


TX = jl.loss_scaling(optax.sgd(0.05), jl.NoOpLossScale())  # the loss scale is set per run


@functools.partial(jax.jit, static_argnames="tell_fp8")
def loss_scaled_step(params, state, opt_state, x, y, tell_fp8):
  scale = jl.get_loss_scale(opt_state)

  def loss_fn(p, amax):
    loss = mlp_loss(p, state, amax, x, y, loss_scale=scale if tell_fp8 else None)
    return scale.scale(loss)

  grads, amax = jax.grad(loss_fn, argnums=(0, 1))(params, fp8.zeros_amax(state))
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), fp8.update(state, amax, CONFIG), opt_state, amax


def train_with_loss_scaling(loss_scale, steps, x, y, *, tell_fp8=True):
  params, state = mlp_init(), init_mlp_state()
  opt_state = TX.init(params)._replace(loss_scale=loss_scale)
  history = []
  for _ in range(steps):
    params, state, opt_state, amax = loss_scaled_step(params, state, opt_state, x, y, tell_fp8)
    history.append(amax)
  return params, state, opt_state, history


def test_fp8_scales_and_loss_scale_compose_exactly():
  """A power-of-two loss scale changes no fp8 value: same params and fp8 state as without."""
  x, y = mlp_data(32)
  plain = train_with_loss_scaling(jl.StaticLossScale(jnp.float32(1)), 4, x, y)
  scaled = train_with_loss_scaling(jl.StaticLossScale(jnp.float32(2.0**14)), 4, x, y)
  for a, b in zip(plain[:2], scaled[:2], strict=True):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  assert float(plain[1]["l2"].output_grad.scale) != 1.0  # the gradient scale did adapt
  # Told nothing, the ops would record the scaled gradients' amax: 2^14 times larger.
  unaware = train_with_loss_scaling(
    jl.StaticLossScale(jnp.float32(2.0**14)), 1, x, y, tell_fp8=False
  )
  np.testing.assert_allclose(
    unaware[3][0]["l2"].output_grad, plain[3][0]["l2"].output_grad * 2.0**14, rtol=1e-6
  )


def test_overflow_skips_the_step_and_leaves_gradient_scales_alone():
  x, y = mlp_data(32)
  y = y + 1e4  # large errors, so the scaled output gradients overflow float32
  loss_scale = jl.DynamicLossScale(jnp.float32(2.0**126), period=1000)
  params, state, opt_state, history = train_with_loss_scaling(loss_scale, 1, x, y)
  ls_state = jl.get_loss_scaling_state(opt_state)
  assert not bool(ls_state.last_finite) and int(ls_state.skipped_steps) == 1
  assert float(ls_state.loss_scale.loss_scale) == 2.0**125
  jax.tree.map(np.testing.assert_array_equal, params, mlp_init())  # nothing applied
  fresh = init_mlp_state()
  for name in ("l1", "l2"):
    assert not np.isfinite(history[0][name].output_grad)  # inf stayed inf through fp8
    assert_close(state[name].output_grad, fresh[name].output_grad, rtol=0)  # ... not recorded
    # The forward pass was fine: its input amax was recorded as observed.
    assert float(state[name].input.amax_history[0]) == float(history[0][name].input)
  assert float(history[0]["l1"].input) == float(fp8.compute_amax(x))
  # With the scale backed off enough, the next steps are finite and train.
  params, state, opt_state, _ = train_with_loss_scaling(
    jl.DynamicLossScale(jnp.float32(2.0**10)), 2, x, y
  )
  assert bool(jl.get_loss_scaling_state(opt_state).last_finite)


@pytest.mark.parametrize(
  ("loss_scale", "error", "match"),
  [
    (jl.LayerwiseLossScale([0, 1]), TypeError, "gives each stage its own scale"),
    (0.0, ValueError, "positive"),
    (True, TypeError, "got bool"),
    (jnp.ones(2), ValueError, r"loss_scale must be a scalar, got shape \(2,\)"),
  ],
)
def test_dot_general_refuses_loss_scales_it_cannot_use(loss_scale, error, match):
  x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
  with pytest.raises(error, match=match):
    fp8.dot_general(x, w, MATMUL, fp8.init_dot_state(), loss_scale=loss_scale)


def test_an_fp8_state_initialized_after_a_donated_update_has_buffers_of_its_own():
  config = fp8.Fp8Config(amax_history_length=2)
  observed = fp8.Fp8DotAmax(jnp.float32(896.0), jnp.float32(0.0), jnp.float32(3584.0))
  update = jax.jit(lambda state: fp8.update(state, observed, config), donate_argnums=0)
  donated = fp8.init_dot_state(config)
  first = update(donated)
  assert donated.input.scale.is_deleted()  # the update consumed it
  fresh = fp8.init_dot_state(config)  # a second run
  assert [float(t.scale) for t in fresh] == [0.0, 0.0, 0.0]
  second = update(fresh)
  assert [float(t.scale) for t in second] == [2.0, 0.0, 0.0625]
  jax.tree.map(np.testing.assert_array_equal, second, first)
