"""fp8 recipes (jmp_lite/fp8/_recipes.py): current scaling (the default), delayed scaling's
first step, the protocol and its checks, every recipe under sharding, through the policy
and with an inf in any operand."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_lite as jl
from jmp_lite import fp8

from .fp8_testing import (
  E4M3,
  E5M2,
  MATMUL,
  normal,
  recipe_vjp,
)

TINY = 2.0**-20  # at a scale of 1, output gradients this small are under E5M2's 2^-16


LOSS_SCALE = 2.0**12  # passed to the ops, as docs/fp8.md says


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
  run = recipe_vjp(recipe)
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


# Sharding ----------------------------------------------------------------------------------


STATELESS = {
  "current": fp8.CurrentScaling(),
  "rowwise": fp8.RowwiseScaling(),
  "block": fp8.BlockScaling(),
  "mxfp8": fp8.Mxfp8Scaling(),
}


@pytest.mark.parametrize("name", [*STATELESS, "rowwise_gw_hp"])
def test_an_inf_reaches_every_result_that_reads_it_and_no_other(name):
  """No recipe loses a non-finite value: an inf in the input, the kernel or the output gradient
  makes each of y, dx and dw that depends on it non-finite (a loss scale then skips the step),
  and leaves the others finite."""
  recipe = STATELESS.get(name, fp8.RowwiseScaling(weight_grad="compute_dtype"))
  rng = np.random.default_rng(3)
  x, w, g = normal(rng, (16, 130)), normal(rng, (130, 8)), normal(rng, (16, 8))
  run = recipe_vjp(recipe)

  assert all(np.isfinite(r).all() for r in run(x, w, g))
  reads = {"x": ("y", "dw"), "w": ("y", "dx"), "g": ("dx", "dw")}
  for bad, operand in (("x", x), ("w", w), ("g", g)):
    args = {"x": x, "w": w, "g": g, bad: operand.at[1, 2].set(np.inf)}
    results = dict(zip(("y", "dx", "dw"), run(**args), strict=True))
    for result, value in results.items():
      assert np.isfinite(value).all() != (result in reads[bad]), (bad, result)


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
  run = recipe_vjp(recipe)

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
  one_device = {}
  for name, recipe in recipes.items():
    (dx, dw), y = one_device[name] = step(x, w, recipe)
    with jax.set_mesh(mesh):
      (dx_s, dw_s), y_s = step(xs, ws, recipe)
    assert y_s.sharding.spec == PartitionSpec("data", None), name
    assert dw_s.sharding.spec == PartitionSpec("data", None), name  # sharded as the kernel
    np.testing.assert_array_equal(y_s, y, err_msg=name)
    np.testing.assert_array_equal(dx_s, dx, err_msg=name)
    np.testing.assert_allclose(dw_s, dw, rtol=0, atol=4e-7 * float(jnp.abs(dw).max()))
  # A batch axis sharded and merged with the sequence into the tokens (einsum "bsd,df->bsf"),
  # against the one-device matmul of the same tokens above (on one device the einsum is that
  # matmul, bit for bit): one program fewer per recipe than an einsum on one device.
  x3, g3 = x.reshape(8, 128, 128), g.reshape(8, 128, 8)

  def loss3(x, w, recipe):
    y = fp8.einsum("bsd,df->bsf", x, w, config=recipe)
    return jnp.sum(y * g3), y

  step3 = jax.jit(jax.grad(loss3, argnums=(0, 1), has_aux=True), static_argnums=2)
  batch = NamedSharding(mesh, PartitionSpec("data", None, None))
  for name in ("rowwise", "block", "mxfp8"):
    (dx, dw), y = one_device[name]
    with jax.set_mesh(mesh):
      (dx_s, dw_s), y_s = step3(jax.device_put(x3, batch), ws, recipes[name])
    assert y_s.sharding.spec == dx_s.sharding.spec == PartitionSpec("data", None, None), name
    np.testing.assert_array_equal(y_s, y.reshape(y_s.shape), err_msg=name)
    np.testing.assert_array_equal(dx_s, dx.reshape(dx_s.shape), err_msg=name)
    np.testing.assert_allclose(dw_s, dw, rtol=0, atol=4e-7 * float(jnp.abs(dw).max()))
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
