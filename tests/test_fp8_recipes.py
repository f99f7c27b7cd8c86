"""fp8 recipes: current scaling (the default), delayed scaling's first step, the protocol."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_lite as jl
from jmp_lite import fp8

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
MATMUL = (((1,), (0,)), ((), ()))
TINY = 2.0**-20  # at a scale of 1, output gradients this small are under E5M2's 2^-16
LOSS_SCALE = 2.0**12  # passed to the ops, as docs/fp8.md says


def normal(rng, shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def mlp_data(seed=0):
  rng = np.random.default_rng(seed)
  params = {"w1": normal(rng, (16, 32), 16**-0.5), "w2": normal(rng, (32, 8), 32**-0.5)}
  return params, normal(rng, (24, 16)), normal(rng, (24, 8))


def mlp_loss(params, x, y, matmul):
  h = jnp.tanh(matmul(x, params["w1"], "l1"))
  return TINY * jnp.sum((matmul(h, params["w2"], "l2") - y) ** 2)


RECIPES = {
  "default": None,  # CurrentScaling()
  "current_power_of_2": fp8.CurrentScaling(power_of_2=True),
  "delayed_fresh": fp8.DelayedScaling(amax_history_length=4),  # no calibrate call
}


@jax.jit
def fp32_grads(params, x, y):
  return jax.grad(mlp_loss)(params, x, y, lambda a, b, _: a @ b)


@pytest.mark.parametrize("name", RECIPES)
def test_first_step_with_a_tiny_loss_flushes_no_weight_gradient(name):
  """Step 0, loss x 2^-20, loss scale passed: only E4M3/E5M2 rounding error, no flush.

  The fp32 reference has no zero gradient; the fp8 gradients have exactly as many (none),
  and are within 15% of it in norm (rounding: ~5%; a flushed layer would be 100%).
  """
  recipe = RECIPES[name]
  params, x, y = mlp_data()
  state = None if recipe is None else {"l1": recipe.init_state(), "l2": recipe.init_state()}

  @jax.jit
  def step(params):
    def loss(params, amax):
      def matmul(a, b, layer):
        s = None if state is None else state[layer]
        probe = None if amax is None else amax[layer]
        options = {"loss_scale": LOSS_SCALE} if recipe is None else {"config": recipe}
        options["loss_scale"] = LOSS_SCALE
        return fp8.dot_general(a, b, MATMUL, s, probe, **options)

      return LOSS_SCALE * mlp_loss(params, x, y, matmul)

    amax = None if state is None else fp8.zeros_amax(state)
    grads = jax.grad(loss)(params, amax)
    return jax.tree.map(lambda g: g / LOSS_SCALE, grads)

  grads, reference = step(params), fp32_grads(params, x, y)
  for layer in params:
    got, want = np.asarray(grads[layer]), np.asarray(reference[layer])
    assert np.mean(got == 0) == np.mean(want == 0) == 0.0, layer
    assert np.linalg.norm(got - want) <= 0.15 * np.linalg.norm(want), layer


def reference_current(x, k, g, dtypes=(E4M3, E4M3, E5M2), power_of_2=False):
  """Current scaling from public pieces: each tensor by its own amax, in fp32."""

  def scale(t, dtype):
    s = fp8.compute_scale(fp8.compute_amax(t), 1.0, dtype)
    return 2.0 ** jnp.ceil(jnp.log2(s)) if power_of_2 else s

  s_x, s_k, s_g = scale(x, dtypes[0]), scale(k, dtypes[1]), scale(g, dtypes[2])
  q_x, q_k, q_g = fp8.quantize(x, s_x, dtypes[0]), fp8.quantize(k, s_k, dtypes[1]), None
  q_g = fp8.quantize(g, s_g, dtypes[2])
  f32 = jnp.float32
  y = lax.dot_general(q_x, q_k, MATMUL, preferred_element_type=f32) * (s_x * s_k)
  dx = lax.dot_general(q_g, q_k, (((1,), (1,)), ((), ())), preferred_element_type=f32)
  dk = lax.dot_general(q_x, q_g, (((0,), (0,)), ((), ())), preferred_element_type=f32)
  return y, dx * (s_g * s_k), dk * (s_x * s_g), (s_x, s_k, s_g)


@pytest.mark.parametrize("power_of_2", [False, True])
def test_current_scaling_quantizes_each_tensor_with_its_own_amax(power_of_2):
  rng = np.random.default_rng(3)
  x, k, g = normal(rng, (6, 8), 300.0), normal(rng, (8, 4), 1e-3), normal(rng, (6, 4), 1e-7)
  recipe = fp8.CurrentScaling(power_of_2=power_of_2)
  f = lambda x, k: fp8.dot_general(x, k, MATMUL, config=recipe)

  @jax.jit
  def run(x, k, g):
    y, vjp = jax.vjp(f, x, k)
    return y, *vjp(g)

  want_y, want_dx, want_dk, scales = jax.jit(reference_current, static_argnums=(3, 4))(
    x, k, g, (E4M3, E4M3, E5M2), power_of_2
  )
  jax.tree.map(np.testing.assert_array_equal, run(x, k, g), (want_y, want_dx, want_dk))
  if power_of_2:  # the scales really are powers of two, and the amax still fits
    for s, t, top in zip(scales, (x, k, g), (448.0, 448.0, 57344.0), strict=True):
      s = float(s)
      assert (
        s == 2.0 ** np.round(np.log2(s)) and np.abs(t).max() / s <= top < 2 * np.abs(t).max() / s
      )


def test_power_of_2_scales_make_representable_values_exact():
  """0.5 and 3 quantize exactly with power-of-two scales (2^-9, 2^-7): the product is exact;
  with amax / 448 as the scale, 4.5 comes out as 4.5000005."""
  x, k = jnp.full((2, 3), 0.5), jnp.full((3, 2), 3.0)
  exact = fp8.dot_general(x, k, MATMUL, config=fp8.CurrentScaling(power_of_2=True))
  np.testing.assert_array_equal(exact, np.full((2, 2), 4.5))
  assert float(fp8.dot_general(x, k, MATMUL)[0, 0]) == float(np.float32(4.5000005))


@pytest.mark.parametrize(
  "loss_scale",
  [jl.StaticLossScale(jnp.float32(2.0**10)), jl.LayerwiseLossScale([0, 1])],
  ids=["uniform", "layerwise"],
)
def test_current_scaling_takes_any_loss_scale(loss_scale):
  """A power-of-two factor on the loss changes no fp8 value: gradients scale exactly."""
  rng = np.random.default_rng(4)
  x, k, t = normal(rng, (6, 8)), normal(rng, (8, 4)), normal(rng, (6, 4))

  def grads(factor, loss_scale):
    loss = lambda x, k: factor * jnp.sum(fp8.dot_general(x, k, MATMUL, loss_scale=loss_scale) * t)
    return jax.grad(loss, (0, 1))(x, k)

  plain = grads(1.0, None)
  scaled = grads(2.0**10, loss_scale)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a * 2.0**10, b), plain, scaled)


def test_delayed_scaling_fresh_step_is_current_scaling_then_delayed():
  """A fresh delayed state's first step quantizes as CurrentScaling, bit for bit; once
  update saw the amaxes, the scales are the state's (amax / fp8_max)."""
  rng = np.random.default_rng(5)
  x, k, g = normal(rng, (6, 8), 50.0), normal(rng, (8, 4)), normal(rng, (6, 4), 1e-6)
  recipe = fp8.DelayedScaling(amax_history_length=2)
  state = recipe.init_state()
  assert [float(t.scale) for t in state] == [0.0, 0.0, 0.0]

  def run(state, config):
    f = lambda x, k, amax: fp8.dot_general(x, k, MATMUL, state, amax, config=config)
    amax = None if state is None else fp8.zeros_amax(state)
    y, vjp = jax.vjp(f, x, k, amax)
    return y, vjp(g)

  y, (dx, dk, amax) = run(state, recipe)
  y_current, (dx_current, dk_current, _) = run(None, fp8.CurrentScaling())
  jax.tree.map(np.testing.assert_array_equal, (y, dx, dk), (y_current, dx_current, dk_current))
  state = fp8.update(state, amax, recipe)
  want = [np.abs(x).max() / 448, np.abs(k).max() / 448, np.abs(g).max() / 57344]
  np.testing.assert_allclose([float(t.scale) for t in state], want, rtol=1e-6)
  y2, _ = run(state, recipe)  # the same batch with the state's scales: the same result
  np.testing.assert_array_equal(y2, y_current)


def _delayed_run(x, k, g, state, recipe):
  f = lambda x, k, amax: fp8.dot_general(x, k, MATMUL, state, amax, config=recipe)
  y, vjp = jax.vjp(f, x, k, fp8.zeros_amax(state))
  return y, vjp(g)


def test_calibrated_delayed_scaling_uses_the_calibrated_scales_and_never_flushes():
  """first_step="calibrated": after fp8.calibrate the step is the default recipe's, bit for
  bit; an uncalibrated state gives NaN products (loud), not zeros, and observes the amaxes, so
  that fp8.update sets its scales."""
  rng = np.random.default_rng(5)
  x, k, g = normal(rng, (6, 8), 50.0), normal(rng, (8, 4)), normal(rng, (6, 4), 1e-6)
  trusted = fp8.DelayedScaling(amax_history_length=2, first_step="calibrated")
  default = fp8.DelayedScaling(amax_history_length=2)
  loss = lambda amax, recipe: jnp.sum(
    fp8.dot_general(x, k, MATMUL, recipe.init_state(), amax, config=recipe) * g
  )
  calibrated = fp8.calibrate(lambda amax: loss(amax, trusted), trusted.init_state(), trusted)
  want = [np.abs(x).max() / 448, np.abs(k).max() / 448, np.abs(g).max() / 57344]
  np.testing.assert_allclose([float(t.scale) for t in calibrated], want, rtol=1e-6)
  got, wanted = (
    _delayed_run(x, k, g, calibrated, trusted),
    _delayed_run(x, k, g, calibrated, default),
  )
  jax.tree.map(np.testing.assert_array_equal, got, wanted)
  current = _delayed_run(x, k, g, default.init_state(), default)[0]
  np.testing.assert_array_equal(got[0], current)  # = current scaling on the calibration batch

  y, (dx, dk, observed) = _delayed_run(x, k, g, trusted.init_state(), trusted)
  assert np.isnan(y).all() and np.isnan(dx).all() and np.isnan(dk).all()
  np.testing.assert_allclose(
    [float(observed.input), float(observed.kernel), float(observed.output_grad)],
    [np.abs(x).max(), np.abs(k).max(), np.abs(g).max()],
    rtol=1e-6,
  )
  state = fp8.update(trusted.init_state(), observed, trusted)
  np.testing.assert_array_equal(_delayed_run(x, k, g, state, trusted)[0], current)


def _depends_on_input(jaxpr):
  """Whether the closed jaxpr's (only) output is computed from its (only) input."""
  reached = set(jaxpr.jaxpr.invars)
  for eqn in jaxpr.jaxpr.eqns:
    if any(v in reached for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)):
      reached.update(eqn.outvars)
  return jaxpr.jaxpr.outvars[0] in reached


@pytest.mark.parametrize("first_step", ["own_amax", "calibrated"])
def test_calibrated_delayed_scale_reads_nothing_of_the_tensor(first_step):
  """The quantization's scale depends on the tensor's amax only under the default first step
  (a select in every step); a calibrated state's scale is the state's."""
  from jmp_lite.fp8._matmul import DotSpec, scale_for

  spec = DotSpec(
    MATMUL, E4M3, E5M2, *(np.dtype(jnp.float32),) * 3, None, frozenset(), False, 0.0,
    lax.Precision.HIGHEST, lax.Precision.HIGHEST, trust_state=first_step == "calibrated",
  )  # fmt: skip
  jaxpr = jax.make_jaxpr(lambda amax: scale_for(jnp.float32(0.5), amax, E4M3, spec))(1.0)
  assert _depends_on_input(jaxpr) == (first_step == "own_amax")


def test_recipes_are_hashable_and_check_their_fields():
  assert hash(fp8.CurrentScaling()) == hash(fp8.CurrentScaling())
  assert fp8.as_recipe(None) == fp8.CurrentScaling()
  delayed = fp8.as_recipe(fp8.Fp8Config(amax_history_length=3))
  assert type(delayed) is fp8.DelayedScaling and delayed.amax_history_length == 3
  assert delayed.first_step == "own_amax"
  with pytest.raises(ValueError, match=r"first_step.*'first'"):
    fp8.DelayedScaling(first_step="first")
  assert isinstance(fp8.CurrentScaling(), fp8.Fp8Recipe)
  assert isinstance(delayed, fp8.Fp8Recipe)
  assert fp8.CurrentScaling("float8_e5m2").fwd_dtype == E5M2
  with pytest.raises(TypeError, match="power_of_2 must be a bool, got 1"):
    fp8.CurrentScaling(power_of_2=1)
  with pytest.raises(ValueError, match="margin must be finite"):
    fp8.CurrentScaling(margin=-1.0)
  with pytest.raises(ValueError, match="fwd_dtype"):
    fp8.CurrentScaling(fwd_dtype=jnp.bfloat16)
  with pytest.raises(TypeError, match=r"config must be an fp8 recipe.*got 'current'"):
    fp8.dot_general(jnp.ones((2, 3)), jnp.ones((3, 2)), MATMUL, config="current")
  state = fp8.init_dot_state()
  with pytest.raises(ValueError, match="CurrentScaling keeps no state: pass state=None"):
    fp8.dot_general(jnp.ones((2, 3)), jnp.ones((3, 2)), MATMUL, state, config=fp8.CurrentScaling())


def test_a_state_without_a_recipe_is_delayed_scaling():
  x, k = jnp.full((2, 3), 0.5), jnp.full((3, 2), 3.0)
  state = fp8.Fp8DotState(*(t._replace(scale=jnp.float32(1)) for t in fp8.init_dot_state()))
  np.testing.assert_array_equal(fp8.dot_general(x, k, MATMUL, state), np.full((2, 2), 4.5))
  np.testing.assert_array_equal(fp8.einsum("ij,jk->ik", x, k, state), np.full((2, 2), 4.5))


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


# Row-wise scaling ------------------------------------------------------------------------

from jmp_lite.fp8._rowwise import row_scales  # noqa: E402


def quantization_error(v, scale, dtype):
  """Per-element bound on |dequantize(quantize(v)) - v| (no saturation)."""
  fmt = jl.FORMATS[np.dtype(dtype).name]
  return fmt.epsilon / 2 * np.abs(v) + fmt.min_subnormal / 2 * scale


def np_row_scales(x, dtype):
  """2^ceil(log2(amax / fp8_max)) per row (the last axis), 1 for an all-zero row."""
  amax = np.abs(np.asarray(x, np.float64)).max(axis=-1, keepdims=True)
  top = jl.FORMATS[np.dtype(dtype).name].max
  with np.errstate(divide="ignore"):
    return np.where(amax > 0, 2.0 ** np.ceil(np.log2(amax / top)), 1.0)


def test_row_scales_are_powers_of_two_rounded_up_per_row():
  x = jnp.array(
    [[448.0, -3.0], [1.0, 0.5], [0.0, 0.0], [-3e-3, 1e-3], [449.0, 0.0], [1.0, jnp.inf]]
  )
  got = np.asarray(row_scales(x, E4M3))[:, 0]
  # 448 fits at 1; 1/448 rounds up to 2^-8; zeros and inf rows keep 1; 449 needs 2.
  np.testing.assert_array_equal(got, [1.0, 2.0**-8, 1.0, 2.0**-17, 2.0, 1.0])
  np.testing.assert_array_equal(got[:5], np_row_scales(x[:5], E4M3)[:, 0])
  assert float(row_scales(jnp.array([[57344.0]]), E5M2)[0, 0]) == 1.0


def test_rowwise_is_exact_where_a_per_tensor_scale_loses_the_small_rows():
  """Rows of small integers times very different powers of two: one scale per row keeps each
  exact (x's rows and w's columns), so the product is exact; one scale per tensor flushes the
  small rows (2^-20 below the outlier row)."""
  rng = np.random.default_rng(6)
  ints = lambda shape: rng.integers(-8, 9, shape).astype(np.float32)
  x = ints((4, 16)) * (2.0 ** np.array([12, 0, -8, -20], np.float32))[:, None]
  w = ints((16, 3)) * (2.0 ** np.array([0, -6, 9], np.float32))[None, :]
  x, w = jnp.asarray(x), jnp.asarray(w)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  recipes = (fp8.RowwiseScaling(), fp8.CurrentScaling())
  both = jax.jit(lambda x, w: [fp8.dot_general(x, w, MATMUL, config=r) for r in recipes])
  rowwise, per_tensor = (np.asarray(v) for v in both(x, w))
  np.testing.assert_array_equal(rowwise, want)
  assert np.all(per_tensor[3] == 0) and np.any(want[3] != 0)


@pytest.mark.parametrize("weight_grad", ["fp8", "compute_dtype"])
@pytest.mark.parametrize("seed", [0, 1])
def test_rowwise_matmul_and_gradients_within_format_bounds(weight_grad, seed):
  """Against float64: each output and gradient element within the bound of E4M3 rounding of
  both operands of its product, with the per-row scales; the weight gradient in the compute
  dtype (fp32 here) is the fp32 product."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((8, 32)) * np.exp(rng.uniform(-6, 6, (8, 1)))  # rows of every range
  w = rng.standard_normal((32, 6)) * 0.1
  g = rng.standard_normal((8, 6)) * np.exp(rng.uniform(-12, 0, (8, 1))) * 1e-5
  recipe = fp8.RowwiseScaling(weight_grad=weight_grad)

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, MATMUL, config=recipe), x, w)
    return y, *vjp(g)

  y, dx, dw = (np.asarray(v, np.float64) for v in run(*(jnp.float32(v) for v in (x, w, g))))
  x, w, g = (np.asarray(np.float32(v), np.float64) for v in (x, w, g))

  def bound(a, b):  # a [M, K] @ b [K, N], a's rows and b's columns scaled
    ea = quantization_error(a, np_row_scales(a, E4M3), E4M3)
    eb = quantization_error(b, np_row_scales(b.T, E4M3).T, E4M3)
    return ea @ (np.abs(b) + eb) + np.abs(a) @ eb

  for got, a, b in ((y, x, w), (dx, g, w.T)) + (((dw, x.T, g),) if weight_grad == "fp8" else ()):
    want = a @ b
    assert np.all(np.abs(got - want) <= bound(a, b) + 1e-6 * np.abs(want).max())
    assert np.linalg.norm(got - want) <= 0.1 * np.linalg.norm(want)
  if weight_grad == "compute_dtype":
    np.testing.assert_allclose(dw, x.T @ g, rtol=1e-5, atol=1e-6 * np.abs(x.T @ g).max())


from jmp_lite.fp8._quantize import quantize as _quantize  # noqa: E402
from jmp_lite.fp8._rowwise import _rowwise_product, gemm_dtype  # noqa: E402


def fp32_rowwise_product(a, b, a_dtype, b_dtype, out_dtype):
  """The row-wise product with the GEMM's fp32 sum scaled before any rounding."""
  s_a, s_b = row_scales(a, a_dtype), row_scales(b, b_dtype)
  q_a, q_b = _quantize(a, s_a, a_dtype), _quantize(b, s_b, b_dtype)
  dims = (((2,), (2,)), ((0,), (0,)))
  out = lax.dot_general(q_a, q_b, dims, lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return (out * (s_a * jnp.swapaxes(s_b, 1, 2))).astype(out_dtype)


def test_rowwise_gemm_writes_the_output_dtype_when_it_has_fp32_range():
  """bf16 operands: the forward GEMM and both fp8 gradient GEMMs write bf16 (half the bytes of
  fp32), the scales applied after; float16 keeps an fp32 GEMM result (its sum may pass 65504
  where the scaled result does not)."""
  assert gemm_dtype(jnp.bfloat16) == jnp.bfloat16 and gemm_dtype(jnp.float32) == jnp.float32
  assert gemm_dtype(jnp.float16) == jnp.float32
  for dtype, want in ((jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float32)):
    x, w, g = jnp.ones((16, 64), dtype), jnp.ones((64, 8), dtype), jnp.ones((16, 8), dtype)
    dots = dot_general_avals(fp8.RowwiseScaling(), x, w, g)
    assert len(dots) == 3
    for operands, out in dots:
      assert [o.dtype for o in operands] == [E4M3, E4M3] and out.dtype == want


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
@pytest.mark.parametrize("a_dtype", [E4M3, E5M2])
def test_rowwise_rounding_before_the_power_of_two_scales_changes_no_bit(out_dtype, a_dtype):
  """Against the GEMM's fp32 sum scaled and then rounded: bit-identical, on rows spanning
  2^-40..2^40 and on chosen rows: one at 2^100 against columns at 2^27 (products past bf16's
  and fp32's largest value: inf in both where they overflow), one at 2^-60."""
  rng = np.random.default_rng(11)
  a = extreme_rows(rng, (2, 12, 200), -40, 40)
  b = extreme_rows(rng, (2, 10, 200), -40, 40)
  unit = lambda v: v / np.abs(v).max(-1, keepdims=True)  # rows of amax 1
  a[0, 0] = unit(rng.standard_normal(200)) * 2.0**100
  b[0, :3] = unit(rng.standard_normal((3, 200))) * 2.0**27
  a[1, 0] = unit(rng.standard_normal(200)) * 2.0**-60
  a, b = jnp.asarray(a).astype(out_dtype), jnp.asarray(b).astype(out_dtype)
  highest = lax.Precision.HIGHEST
  got = jax.jit(lambda a, b: _rowwise_product(a, b, a_dtype, E4M3, out_dtype, highest))(a, b)
  want = jax.jit(lambda a, b: fp32_rowwise_product(a, b, a_dtype, E4M3, out_dtype))(a, b)
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_array_equal(got, want)
  if out_dtype != jnp.float16:
    assert np.isinf(got[0, 0, :3]).any() and np.isfinite(got[1]).all()


# Block scaling (DeepSeek-V3) -------------------------------------------------------------

from jmp_lite.fp8._block import tile_scales  # noqa: E402


def np_tile_scale(x, rows, cols=128):
  """Per-element fp32 scale of a 2-D array in rows x cols tiles (amax / 448; 1 if zero)."""
  m, k = x.shape
  pm, pk = -m % rows, -k % cols
  padded = np.pad(np.abs(np.asarray(x, np.float32)), ((0, pm), (0, pk)))
  tiles = padded.reshape((m + pm) // rows, rows, (k + pk) // cols, cols).max(axis=(1, 3))
  scale = np.where(tiles > 0, tiles / np.float32(448), np.float32(1)).astype(np.float32)
  return np.repeat(np.repeat(scale, rows, 0), cols, 1)[:m, :k]


def np_block_matmul(a, b, a_rows, b_rows):
  """a [M, K] @ b [K, N] as the recipe computes it, in float64: per-tile E4M3 values, exact
  fp8 products summed per 128-chunk of K, each chunk scaled, the chunks summed."""
  s_a, s_b = np_tile_scale(a, a_rows), np_tile_scale(b.T, b_rows).T
  q = lambda v, s: (np.asarray(v, np.float32) / s).astype(E4M3).astype(np.float64)
  q_a, q_b = q(a, s_a), q(b, s_b)
  out = 0.0
  for c in range(0, a.shape[1], 128):
    chunk = q_a[:, c : c + 128] @ q_b[c : c + 128]  # exact in float64
    out = out + chunk * s_a[:, c : c + 1] * s_b[c : c + 1, :]
  return out


def test_block_tiles_are_1x128_for_activations_and_128x128_for_weights():
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((1, 256, 256)) * np.exp(rng.uniform(-8, 8, (1, 256, 1))))
  x = x.astype(jnp.float32)
  tiles, blocks = tile_scales(x, 1, E4M3), tile_scales(x, 128, E4M3)
  assert tiles.shape == (1, 256, 2) and blocks.shape == (1, 2, 2)
  # amax / 448 in fp32 (XLA may divide by multiplying with 1/448: one ulp).
  ulp = {"rtol": 2.0**-22}
  np.testing.assert_allclose(np.repeat(tiles[0], 128, 1), np_tile_scale(x[0], 1), **ulp)
  np.testing.assert_allclose(
    np.repeat(np.repeat(blocks[0], 128, 0), 128, 1), np_tile_scale(x[0], 128), **ulp
  )
  want = np.abs(np.asarray(x[0, 128:, :128])).max() / np.float32(448)
  np.testing.assert_allclose(float(blocks[0, 1, 0]), want, **ulp)
  zeros = tile_scales(jnp.zeros((1, 1, 128)), 1, E4M3)
  assert float(zeros[0, 0, 0]) == 1.0


@pytest.mark.parametrize("k", [128, 200, 384])
def test_block_matmul_is_the_chunked_fp32_sum_of_its_tiles(k):
  """The matmul (and both gradients) against a float64 emulation of the recipe: tiles of
  1 x 128 (x, g) and 128 x 128 (w), E4M3 everywhere, fp8 sums per 128-chunk of K promoted to
  fp32; K = 200 is padded. Agreement to fp32 rounding of the chunk sums."""
  rng = np.random.default_rng(k)
  m, n = 6, 130  # N over one block: two weight blocks along N
  # Chunks of K with very different ranges: a per-row scale would flush the small chunk.
  x = rng.standard_normal((m, k)) * np.where(np.arange(k) < 128, 2.0**8, 2.0**-8)
  w, g = rng.standard_normal((k, n)), rng.standard_normal((m, n)) * 1e-3
  x, w, g = (np.asarray(v, np.float32) for v in (x, w, g))
  recipe = fp8.BlockScaling()

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, MATMUL, config=recipe), x, w)
    return y, *vjp(g)

  y, dx, dw = (np.asarray(v, np.float64) for v in run(x, w, g))
  for got, want in (
    (y, np_block_matmul(x, w, 1, 128)),
    (dx, np_block_matmul(g, w.T, 1, 128)),  # the weight's blocks, transposed
    (dw, np_block_matmul(x.T, g, 1, 1)),  # x^T and g in tiles along the tokens
  ):
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
  exact = x.astype(np.float64) @ w
  assert np.linalg.norm(y - exact) <= 0.1 * np.linalg.norm(exact)


def test_block_scales_each_chunk_of_k_where_a_row_scale_flushes():
  """A row 2^22 larger in its first 128 elements of K than after: with the first chunk's
  kernel rows zero, the product is the small chunk's alone; its own 1 x 128 tiles keep it
  (fp8 rounding), one scale per row flushes it to zero."""
  rng = np.random.default_rng(9)
  x = rng.standard_normal((4, 256)) * np.where(np.arange(256) < 128, 2.0**10, 2.0**-12)
  w = rng.standard_normal((256, 8)) * (np.arange(256) >= 128)[:, None]
  x, w = np.float32(x), np.float32(w)
  exact = x.astype(np.float64) @ w
  recipes = (fp8.BlockScaling(), fp8.RowwiseScaling())
  both = jax.jit(lambda x, w: [fp8.dot_general(x, w, MATMUL, config=r) for r in recipes])
  block, rowwise = (np.asarray(v, np.float64) for v in both(x, w))
  assert np.linalg.norm(block - exact) <= 0.1 * np.linalg.norm(exact)
  assert np.all(rowwise == 0)


def test_block_weight_gradient_uses_tiles_along_the_tokens():
  """dW = x^T g: x and g quantized in 1 x 128 tiles of x^T and g^T (128 tokens each)."""
  rng = np.random.default_rng(8)
  x = np.asarray(rng.standard_normal((256, 16)), np.float32)
  x[128:] *= 2.0**-12  # the second 128 tokens are small: their own tiles keep them
  g = np.asarray(rng.standard_normal((256, 4)), np.float32)
  loss = lambda w: jnp.sum(fp8.dot_general(x, w, MATMUL, config=fp8.BlockScaling()) * g)
  dw = jax.jit(jax.grad(loss))(jnp.zeros((16, 4)))
  want = np_block_matmul(x.T, g, 1, 1)
  np.testing.assert_allclose(np.asarray(dw, np.float64), want, rtol=2e-6, atol=1e-9)


import jmp_lite.fp8._block as _block_module  # noqa: E402


def batched_block_product(a, b, a_rows, b_rows):
  """The block product as one fp8 dot batched over the K chunks, [B, C, M, N] in fp32, each
  chunk scaled in fp32, then summed over the chunks."""
  (batch, m, _), n = a.shape, b.shape[1]
  pad, tile = _block_module._pad_to, _block_module.TILE
  a, b = pad(pad(a, 2, tile), 1, a_rows), pad(pad(b, 2, tile), 1, b_rows)
  s_a, s_b = tile_scales(a, a_rows, E4M3), tile_scales(b, b_rows, E4M3)
  expand = _block_module._expand
  q_a = _quantize(a, expand(s_a, a_rows, tile), E4M3)
  q_b = _quantize(b, expand(s_b, b_rows, tile), E4M3)
  chunks = a.shape[2] // tile
  q_a = q_a.reshape(batch, a.shape[1], chunks, tile)
  q_b = q_b.reshape(batch, b.shape[1], chunks, tile)
  dims = (((3,), (3,)), ((0, 2), (0, 2)))
  partial = lax.dot_general(q_a, q_b, dims, lax.Precision.HIGHEST, preferred_element_type=F32)
  row_a = jnp.repeat(s_a, a_rows, axis=1).transpose(0, 2, 1)[..., :, None]
  row_b = jnp.repeat(s_b, b_rows, axis=1).transpose(0, 2, 1)[..., None, :]
  return jnp.sum(partial * row_a * row_b, axis=1)[:, :m, :n]


F32 = jnp.float32


@pytest.mark.parametrize("b_rows", [1, 128])
def test_block_loops_equal_the_batched_chunk_sum(b_rows, monkeypatch):
  """The loops over row tiles and K chunks against one dot batched over the chunks and a sum:
  the same quantized operands, scales and exact fp8 products, each chunk's sum in fp32 and
  scaled in fp32, the chunks added in fp32; only the order of each K=128 dot's fp32 sum is the
  backend's (XLA:CPU's two dot shapes differ in a few elements' last bits), so within
  2 x 128 x 2^-24 of the sum of |terms|. Rows in tiles of 7 (20 rows, padded to 21), K = 330
  padded to 3 chunks, chunks and rows 2^-30..2^30 apart; the bf16 result is the fp32 one
  rounded."""
  monkeypatch.setattr(_block_module, "ROW_TILE", 8)
  rng = np.random.default_rng(12)
  a = extreme_rows(rng, (1, 20, 330), -30, 30)
  a *= np.float32(np.repeat(2.0 ** rng.integers(-30, 30, (1, 1, 3)), 128, 2)[..., :330])
  b = extreme_rows(rng, (1, 150, 330), -10, 10)
  a, b = jnp.asarray(a), jnp.asarray(b)
  product = functools.partial(_block_module.block_product, precision=lax.Precision.HIGHEST)
  got = jax.jit(lambda a, b: product(a, b, 1, b_rows, E4M3, F32))(a, b)
  want = jax.jit(lambda a, b: batched_block_product(a, b, 1, b_rows))(a, b)
  terms = jax.jit(lambda a, b: batched_block_product(abs(a), abs(b), 1, b_rows))(a, b)
  got, want, terms = np.asarray(got), np.asarray(want), np.asarray(terms)
  assert np.all(np.abs(got - want) <= 2 * 128 * 2.0**-24 * terms)
  bf16 = jax.jit(lambda a, b: product(a, b, 1, b_rows, E4M3, jnp.bfloat16))(a, b)
  np.testing.assert_array_equal(np.asarray(bf16), np.asarray(jnp.asarray(got).astype(jnp.bfloat16)))


def test_block_gemms_are_one_row_tile_by_one_chunk(monkeypatch):
  """Every fp8 dot (forward and both gradients) is one K=128 chunk of one tile of at most
  ROW_TILE rows, with an fp32 result: no dot writes all K / 128 partial products."""
  monkeypatch.setattr(_block_module, "ROW_TILE", 16)
  x, w, g = (
    jnp.ones((40, 384), jnp.bfloat16),
    jnp.ones((384, 200), jnp.bfloat16),
    jnp.ones((40, 200), jnp.bfloat16),
  )
  dots = dot_general_avals(fp8.BlockScaling(), x, w, g)
  # y: 40 rows in 3 tiles of 14, N = 200 padded to 256; dx: the same rows, N = 384;
  # dw: w's 256 rows (padded) in 16 tiles of 16 by x's 384 columns, K = 40 tokens padded to 128.
  want = [(1, 14, 256), (1, 14, 384), (1, 16, 384)]
  assert sorted(out.shape for _, out in dots) == sorted(want)
  for operands, out in dots:
    assert [o.shape[-1] for o in operands] == [128, 128] and out.dtype == F32


# MXFP8 ---------------------------------------------------------------------------------

from jmp_lite.fp8._mx import e8m0_scales  # noqa: E402


def test_e8m0_scales_round_up_per_32_elements():
  """One power of two per 32 elements, rounded up so the block's amax fits: 448 -> 1,
  449 -> 2 (rounding down, as the OCP conversion does, would saturate 449), 1 -> 2^-8,
  an all-zero block -> 1, tiny -> clamped at 2^-126."""
  amaxes = [448.0, 449.0, 1.0, 0.0, 2.0**-120, 57344.0]
  x = np.zeros((len(amaxes), 64), np.float32)
  x[:, 5] = amaxes  # first block of each row
  x[:, 40] = 3.0  # second block: 3 -> 2^-7 (3/448 = 0.0067 <= 2^-7)
  got = np.asarray(e8m0_scales(jnp.asarray(x), E4M3))
  assert got.shape == (6, 2)
  np.testing.assert_array_equal(got[:, 0], [1.0, 2.0, 2.0**-8, 1.0, 2.0**-126, 128.0])
  np.testing.assert_array_equal(got[:, 1], [2.0**-7] * 6)


def np_mx_matmul(a, b):
  """a [M, K] @ b [K, N] through MXFP8 (blocks of 32 along K), in float64."""

  def qdq(v):  # blocks along the last axis
    v = np.asarray(v, np.float32)
    k = v.shape[-1]
    v = np.pad(v, ((0, 0), (0, -k % 32)))
    blocks = np.abs(v).reshape(v.shape[0], -1, 32).max(-1)
    with np.errstate(divide="ignore"):
      scale = np.where(blocks > 0, 2.0 ** np.ceil(np.log2(blocks / 448.0)), 1.0)
    scale = np.repeat(scale.astype(np.float32), 32, axis=1)
    return ((v / scale).astype(E4M3).astype(np.float64) * scale)[:, :k]

  return qdq(a) @ qdq(b.T).T


@pytest.mark.parametrize("k", [64, 70])
def test_mxfp8_emulated_matmul_and_gradients_match_the_format(k):
  """The emulated path (quantize in 32-element blocks, dequantize, fp32 matmul) against a
  float64 emulation, for the output and both gradients (each blocked along its own
  contraction; K = 70 is padded); and within 10% of float64 in norm."""
  rng = np.random.default_rng(k)
  x = np.float32(rng.standard_normal((6, k)) * np.exp(rng.uniform(-5, 5, (1, k))))
  w = np.float32(rng.standard_normal((k, 40)))
  g = np.float32(rng.standard_normal((6, 40)) * 1e-4)

  @jax.jit
  def run(x, w, g):
    f = lambda x, w: fp8.dot_general(x, w, MATMUL, config=fp8.Mxfp8Scaling())
    y, vjp = jax.vjp(f, x, w)
    return y, *vjp(g)

  y, dx, dw = (np.asarray(v, np.float64) for v in run(x, w, g))
  for got, want, exact in (
    (y, np_mx_matmul(x, w), x.astype(np.float64) @ w),
    (dx, np_mx_matmul(g, w.T), g.astype(np.float64) @ w.T),
    (dw, np_mx_matmul(x.T, g), x.T.astype(np.float64) @ g),
  ):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    assert np.linalg.norm(got - exact) <= 0.1 * np.linalg.norm(exact)


from jmp_lite.fp8._mx import mx_product, mx_quantize_dequantize  # noqa: E402


def fp32_mx_product(a, b, a_dtype, b_dtype):
  """The emulated MXFP8 product with the operands dequantized to fp32 and an fp32 matmul."""

  def qdq(x, dtype):
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -x.shape[-1] % 32)])
    scale = jnp.repeat(e8m0_scales(x, dtype), 32, axis=-1)
    return _quantize(x, scale, dtype).astype(F32) * scale

  dims = (((2,), (2,)), ((0,), (0,)))
  a, b = qdq(a, a_dtype), qdq(b, b_dtype)
  return lax.dot_general(a, b, dims, lax.Precision.HIGHEST, preferred_element_type=F32)


def fp32_dequantized(x, dtype):
  scale = jnp.repeat(e8m0_scales(x, dtype), 32, axis=-1)
  return _quantize(x, scale, dtype).astype(F32) * scale


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_mxfp8_dequantizes_to_bf16_exactly(dtype):
  """q * s in bf16 is the fp32 value, bit for bit: bf16 inputs with block amaxes from 2^-133
  (the smallest bf16 subnormal; the scale is clamped at 2^-126) to 2^127, and fp32 inputs
  whose blocks' scales are at least 2^-124 (E4M3) / 2^-117 (E5M2). (The exception, an fp32
  input off bf16's subnormal grid in a block scaled by 2^-126, such as 2^-135 next to 2^-118,
  is 2^-135 in fp32 and 0 in bf16; XLA:CPU flushes that fp32 subnormal to 0 as well.)"""
  rng = np.random.default_rng(13)
  exps = np.arange(-133, 128, 2)
  x = rng.standard_normal((len(exps), 64)) * (2.0**exps)[:, None]
  x[:, 0] = 2.0**exps  # the block's amax is at least 2^e: no row is all subnormal noise
  bf16 = jnp.asarray(np.float32(x)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(
    np.asarray(mx_quantize_dequantize(bf16, dtype), np.float32), fp32_dequantized(bf16, dtype)
  )
  lowest = -124 if dtype == E4M3 else -117
  top = float(jl.FORMATS[dtype.name].max)
  fp32 = np.float32(x[exps >= lowest + 9]) if dtype == E4M3 else np.float32(x[exps >= lowest + 16])
  scales = np.asarray(e8m0_scales(jnp.asarray(fp32), dtype))
  assert scales.min() >= 2.0**lowest and np.abs(fp32).max() <= top * 2.0**127
  np.testing.assert_array_equal(
    np.asarray(mx_quantize_dequantize(jnp.asarray(fp32), dtype), np.float32),
    fp32_dequantized(jnp.asarray(fp32), dtype),
  )


@pytest.mark.parametrize("operands", [jnp.bfloat16, jnp.float32])
def test_mxfp8_bf16_operands_give_the_fp32_matmul(operands):
  """mx_product (bf16 dequantized operands, fp32 sums) against fp32 dequantized operands and
  an fp32 matmul: the same operand values and exact products, summed in fp32 in an order the
  backend picks (XLA:CPU's bf16 and fp32 dots differ in the last bits of a few sums), E4M3 and
  E5M2, rows 2^-40..2^40 apart, K = 200 padded."""
  rng = np.random.default_rng(14)
  a = jnp.asarray(extreme_rows(rng, (2, 12, 200), -40, 40)).astype(operands)
  b = jnp.asarray(extreme_rows(rng, (2, 10, 200), -40, 40)).astype(operands)
  for dtypes in ((E4M3, E4M3), (E5M2, E4M3)):
    got = jax.jit(lambda a, b, d=dtypes: mx_product(a, b, *d, F32))(a, b)
    want = np.asarray(jax.jit(lambda a, b, d=dtypes: fp32_mx_product(a, b, *d))(a, b))
    # fp32 sums of 224 exact products, reordered: within 224 * 2^-24 of the sum of |terms|.
    terms = np.asarray(jax.jit(lambda a, b, d=dtypes: fp32_mx_product(abs(a), abs(b), *d))(a, b))
    assert np.all(np.abs(np.asarray(got) - want) <= 224 * 2.0**-24 * terms)


def test_mxfp8_emulated_dots_take_bf16_operands():
  """The forward and both gradient dots read bf16 (half the bytes of fp32), sum in fp32."""
  x, w, g = jnp.ones((16, 64), F32), jnp.ones((64, 8), F32), jnp.ones((16, 8), F32)
  dots = dot_general_avals(fp8.Mxfp8Scaling(), x, w, g)
  assert len(dots) == 3
  for operands, out in dots:
    assert [o.dtype for o in operands] == [jnp.bfloat16] * 2 and out.dtype == F32


def test_mxfp8_native_path_reports_whether_this_jax_compiles_it():
  """jax.nn.scaled_dot_general: used where it compiles, and a clear error where it does not
  (JAX 0.10.2 on CPU: no lowering of 'scaled_matmul'); never a silent fallback."""
  supported, reason = fp8.mxfp8_native_support()
  assert reason.startswith(f"jax {jax.__version__} ")
  assert jax.default_backend() in reason
  x, w = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
  native = fp8.Mxfp8Scaling(implementation="scaled_dot_general")
  if supported:
    y = fp8.dot_general(x, w, MATMUL, config=native, preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(y, np.full((4, 32), 64.0))
  else:
    assert "does not compile it" in reason
    with pytest.raises(NotImplementedError, match="implementation='emulated'"):
      fp8.dot_general(x, w, MATMUL, config=native)
  if jax.default_backend() == "cpu" and jax.__version__ == "0.10.2":
    assert not supported and "scaled_matmul" in reason
  with pytest.raises(ValueError, match="implementation"):
    fp8.Mxfp8Scaling(implementation="cudnn")


# Sharding ----------------------------------------------------------------------------------

STATELESS = {
  "current": fp8.CurrentScaling(),
  "rowwise": fp8.RowwiseScaling(),
  "block": fp8.BlockScaling(),
  "mxfp8": fp8.Mxfp8Scaling(),
}


@pytest.mark.parametrize("name", STATELESS)
def test_stateless_recipes_under_fsdp_style_sharded_jit(name):
  """Tokens sharded over 8 devices and the kernel sharded along its input axis (FSDP's
  layout), on a mesh of automatic (GSPMD) axes: the sharded program computes what one device
  does (sums may be reordered). Explicit axes: the next test."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec

  recipe = STATELESS[name]
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices(), axis_types=(AxisType.Auto,))
  rng = np.random.default_rng(10)
  x, w, g = normal(rng, (16, 256)), normal(rng, (256, 8)), normal(rng, (16, 8))

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, MATMUL, config=recipe), x, w)
    return y, *vjp(g)

  want = run(x, w, g)
  shard = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
  data = PartitionSpec("data", None)  # tokens of x and g, the input axis of w
  got = run(shard(x, data), shard(w, data), shard(g, data))
  assert got[0].sharding.num_devices == 8
  for a, b in zip(got, want, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(jnp.abs(b).max()))


def test_recipes_under_fsdp_style_sharding_on_explicit_axes():
  """Tokens sharded over 8 explicit mesh axes and the kernel along its input axis (FSDP's
  layout), under jit and grad: the output and the input gradient are one device's, bit for
  bit (each device quantizes and multiplies its own rows); the weight gradient sums the
  devices' fp32 partial sums, so it is one device's within fp32 rounding. Tokens that split a
  weight-gradient tile across devices are refused at trace time."""
  from jax.sharding import AxisType, NamedSharding, PartitionSpec

  recipes = {
    **STATELESS,
    "rowwise_gw_hp": fp8.RowwiseScaling(weight_grad="compute_dtype"),
    "delayed": fp8.DelayedScaling(amax_history_length=4),
  }
  mesh = jax.make_mesh((8,), ("data",), devices=jax.devices(), axis_types=(AxisType.Explicit,))
  rng = np.random.default_rng(12)
  # 1024 tokens: 128 per device, whole 1 x 128 tiles of block scaling's weight gradient.
  x, w, g = normal(rng, (1024, 128)), normal(rng, (128, 8)), normal(rng, (1024, 8))

  def loss(x, w, recipe):
    y = fp8.dot_general(x, w, MATMUL, recipe.init_state(), config=recipe)
    return jnp.sum(y * g), y

  step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
  data = NamedSharding(mesh, PartitionSpec("data", None))
  xs, ws = jax.device_put(x, data), jax.device_put(w, data)
  for name, recipe in recipes.items():
    (dx, dw), y = step(x, w, recipe)
    with jax.set_mesh(mesh):
      (dx_s, dw_s), y_s = step(xs, ws, recipe)
    assert y_s.sharding.spec == PartitionSpec("data", None), name
    assert dw_s.sharding.spec == PartitionSpec("data", None), name  # sharded as the kernel
    np.testing.assert_array_equal(y_s, y, err_msg=name)
    np.testing.assert_array_equal(dx_s, dx, err_msg=name)
    np.testing.assert_allclose(dw_s, dw, rtol=0, atol=4e-7 * float(jnp.abs(dw).max()))
  # A batch axis sharded and merged with the sequence into the tokens (einsum "bsd,df->bsf").
  x3, g3 = x.reshape(8, 128, 128), g.reshape(8, 128, 8)

  def loss3(x, w, recipe):
    y = fp8.einsum("bsd,df->bsf", x, w, config=recipe)
    return jnp.sum(y * g3), y

  step3 = jax.jit(jax.grad(loss3, argnums=(0, 1), has_aux=True), static_argnums=2)
  batch = NamedSharding(mesh, PartitionSpec("data", None, None))
  for name in ("rowwise", "block", "mxfp8"):
    (dx, dw3), y = step3(x3, w, recipes[name])
    with jax.set_mesh(mesh):
      (dx_s, dw_s), y_s = step3(jax.device_put(x3, batch), ws, recipes[name])
    assert y_s.sharding.spec == dx_s.sharding.spec == PartitionSpec("data", None, None), name
    np.testing.assert_array_equal(y_s, y, err_msg=name)
    np.testing.assert_array_equal(dx_s, dx, err_msg=name)
    np.testing.assert_allclose(dw_s, dw3, rtol=0, atol=4e-7 * float(jnp.abs(dw3).max()))
  for recipe, tile in ((fp8.BlockScaling(), 128), (fp8.Mxfp8Scaling(), 32)):
    with (
      jax.set_mesh(mesh),
      pytest.raises(
        ValueError,
        match=rf"{type(recipe).__name__} on explicit mesh axes \('data',\): each "
        rf"device's tokens \(2\) must be a multiple of {tile}",
      ),
    ):
      step(jax.device_put(x[:16], data), ws, recipe)


# Recipes through the policy -----------------------------------------------------------------

POLICY_RECIPES = {
  "current": fp8.CurrentScaling(),
  "delayed": fp8.DelayedScaling(amax_history_length=4),
  "rowwise": fp8.RowwiseScaling(),
  "block": fp8.BlockScaling(),
  "mxfp8": fp8.Mxfp8Scaling(),
}


@pytest.mark.parametrize("name", POLICY_RECIPES)
def test_policy_configured_matmul_is_the_recipe_passed_directly(name):
  """``fp8=<name>`` builds the recipe itself: its matmul and both gradients are the directly
  passed recipe's, bit for bit (delayed scaling with a fresh state, under jit)."""
  recipe = POLICY_RECIPES[name]
  options = {"amax_history_length": 4} if name == "delayed" else {}
  config = fp8.get_fp8_policy(f"p=f32,c=bf16,o=f32,fp8={name}", **options).config
  assert config == recipe
  rng = np.random.default_rng(11)
  x, w, g = (normal(rng, s).astype(jnp.bfloat16) for s in ((8, 64), (64, 16), (8, 16)))
  state = recipe.init_state()

  @functools.partial(jax.jit, static_argnums=0)
  def run(config, x, w, g):
    y, vjp = jax.vjp(lambda x, w: fp8.dot_general(x, w, MATMUL, state, config=config), x, w)
    return y, *vjp(g)

  want, got = run(recipe, x, w, g), run(config, x, w, g)
  reference = jnp.dot(x, w, preferred_element_type=jnp.float32)
  # The recipe ran (an fp8 matmul differs from the bf16 one), and the policy's is the same.
  assert not np.array_equal(np.asarray(want[0], np.float32), reference.astype(jnp.bfloat16))
  for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(a, b)
