"""jl.check_loss_scaling catches the two wirings that train badly without an error."""

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jl
import jmp_lite.flax as jlf

X = jax.random.normal(jax.random.key(0), (8, 4))
Y = jax.random.normal(jax.random.key(1), (8, 2))
PARAMS = {"w": jax.random.normal(jax.random.key(2), (4, 2)), "b": jnp.zeros(2)}


def loss_fn(p, x, y):
  pred = (x.astype(jnp.float16) @ p["w"].astype(jnp.float16)).astype(jnp.float32) + p["b"]
  return jnp.mean((pred - y) ** 2)


def make_step(tx, take_grads):
  @jax.jit
  def step(params, opt_state, x, y):
    grads = take_grads(params, opt_state, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return step


def scaled(params, opt_state, x, y):
  return jl.scaled_value_and_grad(loss_fn, opt_state)(params, x, y)[1]


def by_hand(params, opt_state, x, y):  # the step of shared/DESIGN.md
  loss_scale = jl.get_loss_scale(opt_state)
  return jax.grad(lambda p: loss_scale.scale(loss_fn(p, x, y)))(params)


def unscaled(params, opt_state, x, y):
  return jax.grad(loss_fn)(params, x, y)


SCALE = jl.DynamicLossScale(jnp.float32(2.0**12))


@pytest.mark.parametrize("take_grads", [scaled, by_hand])
def test_a_correct_step_passes_and_its_arguments_are_untouched(take_grads):
  tx = jl.loss_scaling(optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1)), SCALE)
  opt_state = tx.init(PARAMS)
  step = jax.jit(make_step(tx, take_grads), donate_argnums=(0, 1))
  params = jax.tree.map(jnp.copy, PARAMS)
  jl.check_loss_scaling(step, params, opt_state, X, Y)
  np.testing.assert_array_equal(params["w"], PARAMS["w"])  # not donated, not moved
  assert float(opt_state.loss_scale.loss_scale) == 2.0**12


def test_gradients_of_the_unscaled_loss_are_reported():
  tx = jl.loss_scaling(optax.sgd(0.1), SCALE)
  with pytest.raises(ValueError, match="gradients of the unscaled loss"):
    jl.check_loss_scaling(make_step(tx, unscaled), PARAMS, tx.init(PARAMS), X, Y)


def test_clipping_before_loss_scaling_is_reported():
  tx = optax.chain(optax.clip_by_global_norm(0.1), jl.loss_scaling(optax.sgd(0.1), SCALE))
  with pytest.raises(ValueError, match="a transformation before loss_scaling"):
    jl.check_loss_scaling(make_step(tx, scaled), PARAMS, tx.init(PARAMS), X, Y)
  # Differentiated by hand, the scaled gradients are not seen: both causes are named.
  with pytest.raises(ValueError, match=r"unscaled loss .* or a transformation before"):
    jl.check_loss_scaling(make_step(tx, by_hand), PARAMS, tx.init(PARAMS), X, Y)


def test_layerwise_step_passes():
  def staged(p, x, y):
    h = jl.stage_boundary(jnp.tanh(x @ p["w"]), 0)
    return jnp.mean((h + p["b"] - y) ** 2)

  tx = jl.loss_scaling(optax.sgd(0.1), jl.LayerwiseLossScale({"w": 0, "b": 1}))

  @jax.jit
  def step(params, opt_state):
    _, grads = jl.scaled_value_and_grad(staged, opt_state)(params, X, Y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  jl.check_loss_scaling(step, PARAMS, tx.init(PARAMS))


def _train_state():
  model = nn.Dense(2)
  params = model.init(jax.random.key(0), X)["params"]
  return jlf.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=optax.sgd(0.1),
    policy="p=f32,c=f16,o=f32",
    loss_scale=SCALE,
  )


def test_train_state_steps():
  def loss(state, p):
    return jnp.mean((state.apply_fn({"params": p}, X) - Y) ** 2)

  @jax.jit
  def good(state):
    _, grads = state.value_and_grad(lambda p: loss(state, p))(state.params)
    return state.apply_gradients(grads=grads)

  @jax.jit
  def bad(state):
    return state.apply_gradients(grads=jax.grad(lambda p: loss(state, p))(state.params))

  jl.check_loss_scaling(good, _train_state())
  with pytest.raises(ValueError, match="unscaled loss"):
    jl.check_loss_scaling(bad, _train_state())


def test_what_cannot_be_checked_is_refused():
  tx = jl.loss_scaling(optax.sgd(0.1), SCALE)
  state = tx.init(PARAMS)
  with pytest.raises(ValueError, match="exactly one loss scaling state"):
    jl.check_loss_scaling(make_step(tx, scaled), PARAMS, (state, state), X, Y)
  with pytest.raises(ValueError, match="never called loss_scaling's update"):
    jl.check_loss_scaling(lambda p, s: p, PARAMS, state)
  with pytest.raises(ValueError, match="power of two"):
    jl.check_loss_scaling(make_step(tx, scaled), PARAMS, state, X, Y, factor=0.3)
  # A dynamic scale that backed off to 1 can grow again: its wiring is still checked.
  at_one = jl.loss_scaling(optax.sgd(0.1), jl.DynamicLossScale(jnp.float32(1.0)))
  with pytest.raises(ValueError, match="unscaled loss"):
    jl.check_loss_scaling(make_step(at_one, unscaled), PARAMS, at_one.init(PARAMS), X, Y)


def test_nnx_optimizer_steps():
  from flax import nnx

  model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
  optimizer = jlf.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param, loss_scale=SCALE)
  loss = lambda m: jnp.mean((m(X) - Y) ** 2)

  @nnx.jit
  def good(model, optimizer):
    _, grads = optimizer.value_and_grad(loss)(model)
    optimizer.update(model, grads)

  @nnx.jit
  def bad(model, optimizer):
    optimizer.update(model, nnx.grad(loss)(model))

  kernel = np.asarray(model.kernel[...])
  jl.check_loss_scaling(good, model, optimizer)
  np.testing.assert_array_equal(model.kernel[...], kernel)  # the check ran on copies
  assert int(optimizer.step[...]) == 0
  with pytest.raises(ValueError, match="unscaled loss"):
    jl.check_loss_scaling(bad, model, optimizer)


def test_with_noop_loss_scale_the_wiring_is_checked_and_a_finding_is_a_warning():
  noop = jl.loss_scaling(optax.sgd(0.1), jl.NoOpLossScale())
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # a correct step: no warning
    jl.check_loss_scaling(make_step(noop, scaled), PARAMS, noop.init(PARAMS), X, Y)
  # Plain jax.grad trains right at a scale of 1, and would not at any other.
  with pytest.warns(UserWarning, match=r"^With NoOpLossScale this step trains .* unscaled loss"):
    jl.check_loss_scaling(make_step(noop, unscaled), PARAMS, noop.init(PARAMS), X, Y)
  # A step that never reaches loss_scaling's update is an error at any scale.
  with pytest.raises(ValueError, match="never called loss_scaling's update"):
    jl.check_loss_scaling(lambda p, s: p, PARAMS, noop.init(PARAMS))


@pytest.mark.parametrize(
  "scale", [jl.StaticLossScale(1.0), jl.DynamicLossScale(jnp.float32(1.0), min_loss_scale=1.0)]
)
def test_a_finding_is_a_warning_exactly_when_the_scale_is_1_and_stays_1(scale):
  # Not a question of kind: a static scale of 1 is NoOpLossScale's case; a dynamic scale at 1
  # grows later, and the unscaled gradients would then be wrong.
  tx = jl.loss_scaling(optax.sgd(0.1), scale)
  step = make_step(tx, unscaled)
  if isinstance(scale, jl.StaticLossScale):
    with pytest.warns(UserWarning, match=r"^With StaticLossScale this step trains .* stays 1"):
      jl.check_loss_scaling(step, PARAMS, tx.init(PARAMS), X, Y)
  else:
    with pytest.raises(ValueError, match="do not carry the loss scale"):
      jl.check_loss_scaling(step, PARAMS, tx.init(PARAMS), X, Y)


def test_loss_scaling_applied_twice_is_refused():
  tx = jl.loss_scaling(optax.sgd(0.1), SCALE)
  state = tx.init(PARAMS)
  nested = state._replace(inner_state=tx.init(PARAMS))  # built by hand: the builders refuse it
  with pytest.raises(ValueError, match=r"found 2 \(1 of them inside another: loss scaling"):
    jl.check_loss_scaling(make_step(tx, scaled), PARAMS, nested, X, Y)


# fp16 gradients of this loss overflow at the usual starting scale 2^15 (and fit at 2^11).
Y_FAR = Y + 100.0


def test_a_batch_that_overflows_at_the_starting_scale_is_checked_at_a_scale_that_fits():
  start = jl.DynamicLossScale(jnp.float32(2.0**15))
  tx = jl.loss_scaling(optax.sgd(0.1), start)
  opt_state = tx.init(PARAMS)
  grads = jax.jit(jl.scaled_value_and_grad(loss_fn, opt_state))(PARAMS, X, Y_FAR)[1]
  assert not bool(jl.all_finite(grads))  # the premise: the first step overflows
  jl.check_loss_scaling(make_step(tx, scaled), PARAMS, opt_state, X, Y_FAR)
  assert float(opt_state.loss_scale.loss_scale) == 2.0**15  # the caller's state is untouched
  # Backed off by the scale's own rule: with a hysteresis too.
  slow = jl.loss_scaling(optax.sgd(0.1), jl.DynamicLossScale(jnp.float32(2.0**15), hysteresis=2))
  jl.check_loss_scaling(make_step(slow, scaled), PARAMS, slow.init(PARAMS), X, Y_FAR)
  # The mistakes are still found there.
  with pytest.raises(ValueError, match="gradients of the unscaled loss"):
    jl.check_loss_scaling(make_step(tx, unscaled), PARAMS, opt_state, X, Y_FAR)
  clipped = optax.chain(optax.clip_by_global_norm(0.1), tx)
  with pytest.raises(ValueError, match="a transformation before loss_scaling"):
    jl.check_loss_scaling(make_step(clipped, scaled), PARAMS, clipped.init(PARAMS), X, Y_FAR)


def test_a_scale_that_cannot_go_lower_says_what_to_pass():
  for loss_scale, tried in [
    (jl.StaticLossScale(jnp.float32(2.0**15)), r"at the loss scale 32768 \(StaticLossScale\), "),
    (
      jl.DynamicLossScale(jnp.float32(2.0**15), min_loss_scale=2.0**13),
      r"at the loss scale 32768 \(DynamicLossScale\) nor backed off to 8192,",
    ),
  ]:
    tx = jl.loss_scaling(optax.sgd(0.1), loss_scale)
    with pytest.raises(ValueError, match=rf"not finite {tried}.*DynamicLossScale\(jnp"):
      jl.check_loss_scaling(make_step(tx, scaled), PARAMS, tx.init(PARAMS), X, Y_FAR)


def test_a_step_that_returns_the_state_it_was_given_is_reported():
  tx = jl.loss_scaling(optax.sgd(0.1), SCALE)

  @jax.jit
  def step(params, opt_state, x, y):
    updates, _ = tx.update(scaled(params, opt_state, x, y), opt_state, params)
    return optax.apply_updates(params, updates), opt_state  # the new state dropped

  with pytest.raises(ValueError, match=r"returns the loss scaling state it was given.*stayed at 0"):
    jl.check_loss_scaling(step, PARAMS, tx.init(PARAMS), X, Y)
  # The counters that did move (the step returns the new state): passes.
  jl.check_loss_scaling(make_step(tx, scaled), PARAMS, tx.init(PARAMS), X, Y)


def test_a_state_replicated_over_devices_is_checked():
  # pmap-replicated states (and jax.device_put_replicated's) hold steps of shape (devices,).
  devices = jax.devices()[:2]
  tx = jl.loss_scaling(optax.sgd(0.1), SCALE, axis_name="d")

  def take_grads(params, opt_state, x, y):
    return jax.lax.pmean(scaled(params, opt_state, x, y), "d")

  def per_device(params, opt_state, x, y):
    updates, opt_state = tx.update(take_grads(params, opt_state, x, y), opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  step = jax.pmap(per_device, axis_name="d", devices=devices)
  replicate = lambda tree: jax.tree.map(lambda v: jnp.stack([v] * len(devices)), tree)
  params, opt_state = replicate(PARAMS), replicate(tx.init(PARAMS))
  assert opt_state.steps.shape == (2,)
  x, y = X.reshape(2, 4, 4), Y.reshape(2, 4, 2)
  jl.check_loss_scaling(step, params, opt_state, x, y)

  def drops_the_new_state(params, opt_state, x, y):
    return per_device(params, opt_state, x, y)[0], opt_state

  bad = jax.pmap(drops_the_new_state, axis_name="d", devices=devices)
  with pytest.raises(ValueError, match=r"returns the loss scaling state it was given.*stayed at 0"):
    jl.check_loss_scaling(bad, params, opt_state, x, y)


def _not_finite_error(loss_scale, x, y):
  tx = jl.loss_scaling(optax.sgd(0.1), loss_scale)
  with pytest.raises(ValueError) as info:
    jl.check_loss_scaling(make_step(tx, scaled), PARAMS, tx.init(PARAMS), x, y)
  return str(info.value)


def test_gradients_not_finite_at_a_scale_of_one_blame_the_batch_or_the_model():
  x_nan = X.at[0, 0].set(jnp.nan)
  for loss_scale, name in [
    (jl.NoOpLossScale(), "NoOpLossScale"),
    (jl.StaticLossScale(jnp.float32(1.0)), "StaticLossScale"),
  ]:
    assert _not_finite_error(loss_scale, x_nan, Y) == (
      f"The step's gradients are not finite at the loss scale 1 ({name}): at a scale of 1 or "
      "below nothing overflows because of loss scaling, so an inf or NaN is in the batch, the "
      "model or the loss; the check cannot compare the gradients. Run it on a batch whose loss "
      "and gradients are finite without loss scaling."
    )


def test_gradients_not_finite_at_a_fixed_scale_suggest_a_lower_one_that_fits_every_state():
  # fp16 gradients of this loss overflow at 4 (and fit at 1).
  y_far = Y + 2.0**16
  assert bool(jl.all_finite(jax.grad(loss_fn)(PARAMS, X, y_far)))
  assert not bool(jl.all_finite(jax.grad(lambda p: 4 * loss_fn(p, X, y_far))(PARAMS)))
  assert _not_finite_error(jl.StaticLossScale(jnp.float32(4.0)), X, y_far) == (
    "The step's gradients are not finite at the loss scale 4 (StaticLossScale), and this loss "
    "scale goes no lower (a fixed scale, or the floor min_loss_scale): every step would be "
    "skipped; the check cannot compare them. Run it on a batch without inf or NaN, or start "
    "from a lower scale, e.g. loss_scale = jl.DynamicLossScale(jnp.float32(2.0 ** 0)), passed "
    "where the state is built: tx = jl.loss_scaling(optimizer, loss_scale) and "
    "tx.init(params), jl.flax.TrainState.create(..., tx=optimizer, loss_scale=loss_scale) or "
    "jl.flax.Optimizer(model, optimizer, wrt=..., loss_scale=loss_scale)."
  )
  # The scale suggested fits.
  fits = jl.loss_scaling(optax.sgd(0.1), jl.DynamicLossScale(jnp.float32(2.0**0)))
  jl.check_loss_scaling(make_step(fits, scaled), PARAMS, fits.init(PARAMS), X, y_far)


def _by_hand(*inner):
  """A loss scaling state holding ``inner`` (the builders refuse to nest them)."""
  state = jl.loss_scaling(optax.sgd(0.1), SCALE).init(PARAMS)
  return state._replace(inner_state=inner[0] if len(inner) == 1 else inner)


def test_nested_states_are_counted_as_they_nest():
  step = make_step(jl.loss_scaling(optax.sgd(0.1), SCALE), scaled)
  for state, found in [
    (_by_hand(_by_hand(_by_hand(()))), r"found 3 \(2 of them inside another: loss scaling"),
    (_by_hand(_by_hand(()), _by_hand(())), r"found 3 \(2 of them inside another: loss scaling"),
    ((_by_hand(()), _by_hand(())), r"found 2: pass the optimizer state"),
  ]:
    with pytest.raises(ValueError, match=found):
      jl.check_loss_scaling(step, PARAMS, state, X, Y)
