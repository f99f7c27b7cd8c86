"""Shared values and helpers of the fp8 tests (tests/test_fp8_*.py)."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

import jmp_lite as jl
from jmp_lite import fp8

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
F32 = jnp.float32
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


def value_and_vjp(f, x, k, g):
  """f(x, k) and its VJP applied to g, in one compiled program (fast on CPU)."""

  @jax.jit
  def run(x, k, g):
    y, vjp = jax.vjp(f, x, k)
    return y, vjp(g)

  return run(x, k, g)


def recipe_vjp(recipe):
  """A compiled ``(x, w, g) -> (y, dx, dw)``: the recipe's ``fp8.dot_general`` and its VJP."""

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, MATMUL, config=recipe), x, w)
    return y, *vjp(g)

  return run


def small_integers(shape, seed, high):
  """Values that both fp8 formats hold exactly, so fp8 matmuls are exact."""
  return jnp.asarray(np.random.default_rng(seed).integers(-high, high + 1, shape), jnp.float32)


def quantization_error(v, scale, dtype):
  """Per-element bound on |dequantize(quantize(v)) - v| (no saturation)."""
  fmt = jl.FORMATS[np.dtype(dtype).name]
  return fmt.epsilon / 2 * np.abs(v) + fmt.min_subnormal / 2 * scale


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


def assert_close(a, b, rtol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol), a, b)


def dot_general_avals(recipe, x, w, g):
  """(operand avals, result aval) of every dot_general in a recipe's matmul and its VJP."""

  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, MATMUL, config=recipe), x, w)
    return y, *vjp(g)

  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(([v.aval for v in eqn.invars], eqn.outvars[0].aval))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)

  walk(jax.make_jaxpr(run)(x, w, g).jaxpr)
  return found


def extreme_rows(rng, shape, lo, hi):
  """Normal values, each row (all axes but the last) times its own 2^u, u in [lo, hi)."""
  scales = 2.0 ** rng.integers(lo, hi, (*shape[:-1], 1))
  return np.float32(rng.standard_normal(shape) * scales)


def vjp_residuals(recipe, x, w):
  """(dtype, shape) of each array a recipe's matmul saves for its VJP (traced, not run)."""
  f = lambda x, w: fp8.dot_general(x, w, MATMUL, config=recipe)
  saved = jax.eval_shape(lambda x, w: jax.vjp(f, x, w)[1], x, w)
  return sorted((np.dtype(r.dtype).name, r.shape) for r in jax.tree.leaves(saved))


def assert_bits_equal(got, want):
  """The arrays hold the same bits (dtype, shape and every element's bit pattern)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape
  bits = np.dtype(f"u{got.dtype.itemsize}")
  np.testing.assert_array_equal(got.view(bits), want.view(bits))


def bf16_operands(rng, m, k, n):
  """bf16 ``x [m, k]``, ``w [k, n]`` and an output gradient ``g [m, n]`` with rows spread over
  2^16 (``g`` 2^-16 smaller), for the recipes' bit-exactness checks."""
  return tuple(
    jnp.asarray(extreme_rows(rng, s, lo, lo + 16), jnp.bfloat16)
    for s, lo in (((m, k), -8), ((k, n), -8), ((m, n), -24))
  )
