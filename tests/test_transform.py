import functools
import os
import pickle

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import jmp_lite as jl

T, F = True, False


def _params():
  return {"w": jnp.asarray([[0.5, -1.0], [2.0, 0.25]]), "b": jnp.asarray([0.1, -0.2])}


def _grads(seed, poison=None):
  key = jax.random.PRNGKey(seed)
  g = {
    "w": jax.random.normal(key, (2, 2)),
    "b": jax.random.normal(jax.random.fold_in(key, 1), (2,)),
  }
  if poison is not None:
    g["w"] = g["w"].at[0, 1].set(poison)
  return g


def assert_bitwise_equal(a, b):
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))


def _inner():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 50)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-2))


def _run(tx, grads_seq, scale_of_grads=None):
  params = _params()
  state = tx.init(params)
  step = jax.jit(tx.update)
  for grads in grads_seq:
    s = jl.get_loss_scale(state).loss_scale if scale_of_grads is None else scale_of_grads
    scaled = jax.tree.map(lambda g, s=s: g * s, grads)
    updates, state = step(scaled, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


@pytest.mark.parametrize("poison", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize(
  "loss_scale", [jl.NoOpLossScale(), jl.StaticLossScale(2.0**8), jl.DynamicLossScale(2.0**8)]
)
def test_overflow_step_is_skipped_exactly(poison, loss_scale):
  tx = jl.loss_scaling(_inner(), loss_scale)
  good = [_grads(i) for i in range(4)]
  params_a, state_a = _run(tx, [good[0], good[1], _grads(9, poison), good[2], good[3]])
  params_b, state_b = _run(tx, good)
  assert_bitwise_equal(params_a, params_b)
  assert_bitwise_equal(state_a.inner_state, state_b.inner_state)  # Adam's count did not advance
  assert int(state_a.steps) == 5 and int(state_a.skipped_steps) == 1
  assert int(state_b.skipped_steps) == 0


def test_skipped_step_returns_zero_updates_and_counters():
  tx = jl.loss_scaling(optax.adam(1e-2), jl.DynamicLossScale(2.0**8))
  params = _params()
  state = tx.init(params)
  log = []
  for poison in [None, jnp.nan, jnp.inf, None, jnp.nan]:
    updates, state = tx.update(_grads(0, poison), state, params)
    log.append((int(state.skipped_steps), int(state.consecutive_skips), bool(state.last_finite)))
    if poison is not None:
      assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))
  assert log == [(0, 0, T), (1, 1, F), (2, 2, F), (2, 0, T), (3, 1, F)]
  assert float(state.loss_scale.loss_scale) == 2.0**5


def test_scale_trajectory_equals_dynamic_loss_scale_adjust():
  pattern = [T, T, F, T, T, T, F, F, T, T, T]
  initial = jl.DynamicLossScale(jnp.float32(2.0**6), period=2)
  tx = jl.loss_scaling(optax.sgd(0.1), initial)
  params = _params()
  state = tx.init(params)
  step = jax.jit(tx.update)
  expected = initial
  for finite in pattern:
    grads = _grads(1, None if finite else jnp.inf)
    _, state = step(grads, state, params)
    expected = expected.adjust(jnp.asarray(finite))
    assert float(state.loss_scale.loss_scale) == float(expected.loss_scale)
    assert int(state.loss_scale.counter) == int(expected.counter)


def test_unscales_with_the_scale_that_produced_the_gradients():
  # period=1: the scale doubles on this very step; unscaling must use the old one.
  tx = jl.loss_scaling(optax.sgd(1.0), jl.DynamicLossScale(2.0**4, period=1))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  updates, state = tx.update({"w": jnp.asarray([16.0, 32.0])}, state, params)
  np.testing.assert_array_equal(updates["w"], [-1.0, -2.0])
  assert float(jl.get_loss_scale(state).loss_scale) == 2.0**5


@pytest.mark.parametrize("grad_dtype", [jnp.float16, jnp.bfloat16])
def test_16_bit_gradients_are_unscaled_in_fp32(grad_dtype):
  tx = jl.loss_scaling(optax.sgd(1.0), jl.StaticLossScale(2.0**14))
  params = {"w": jnp.zeros(1, jnp.float32)}
  state = tx.init(params)
  # 2^-10 * 2^-14 = 2^-24 would flush in bf16 arithmetic and is subnormal in fp16.
  grads = {"w": jnp.asarray([2.0**-10], grad_dtype)}
  updates, _ = tx.update(grads, state, params)
  assert updates["w"].dtype == jnp.float32
  assert float(updates["w"][0]) == -(2.0**-24)
  updates, _ = tx.update(grads, state)  # without params: still fp32
  assert updates["w"].dtype == jnp.float32 and float(updates["w"][0]) == -(2.0**-24)


def test_clipping_inside_sees_unscaled_gradients():
  grads = {"w": jnp.asarray([0.3, 0.4])}  # norm 0.5 < 1: no clipping
  params = {"w": jnp.zeros(2)}
  tx = jl.loss_scaling(
    optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), jl.StaticLossScale(2.0**10)
  )
  updates, _ = tx.update(jax.tree.map(lambda g: g * 2.0**10, grads), tx.init(params), params)
  np.testing.assert_allclose(updates["w"], [-0.3, -0.4], rtol=1e-6)


def test_inside_a_chain_and_found_there():
  tx = optax.chain(jl.loss_scaling(optax.sgd(1.0), jl.DynamicLossScale(2.0**3)), optax.scale(0.5))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  assert float(jl.get_loss_scale(state).loss_scale) == 8.0
  updates, state = tx.update({"w": jnp.asarray([8.0, 16.0])}, state, params)
  np.testing.assert_array_equal(updates["w"], [-0.5, -1.0])
  updates, state = tx.update({"w": jnp.asarray([jnp.nan, 16.0])}, state, params)
  np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
  assert float(jl.get_loss_scale(state).loss_scale) == 4.0


@pytest.mark.parametrize("order", ["multisteps_outside", "multisteps_inside"])
def test_with_multisteps_gradient_accumulation(order):
  k = 3
  if order == "multisteps_outside":
    tx = optax.MultiSteps(jl.loss_scaling(optax.sgd(1.0), jl.StaticLossScale(4.0)), k)
  else:
    tx = jl.loss_scaling(optax.MultiSteps(optax.sgd(1.0), k), jl.StaticLossScale(4.0))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  step = jax.jit(tx.update)
  total = jnp.zeros(2)
  micro = [jnp.asarray([1.0, 2.0]), jnp.asarray([3.0, 4.0]), jnp.asarray([5.0, 0.0])]
  for g in micro:
    s = jl.get_loss_scale(state).loss_scale
    updates, state = step({"w": g * s}, state, params)
    total = total + updates["w"]
  np.testing.assert_allclose(total, -sum(micro) / k, rtol=1e-6)


def test_multisteps_inside_skips_only_the_bad_microstep():
  tx = jl.loss_scaling(optax.MultiSteps(optax.sgd(1.0), 2), jl.DynamicLossScale(2.0))
  params = {"w": jnp.zeros(1)}
  state = tx.init(params)
  applied = []
  for g in [1.0, jnp.inf, 3.0]:
    s = jl.get_loss_scale(state).loss_scale
    updates, state = tx.update({"w": jnp.asarray([g]) * s}, state, params)
    applied.append(float(updates["w"][0]))
  assert applied == [0.0, 0.0, -2.0]  # mean of the two finite microsteps


def test_with_inject_hyperparams():
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  tx = jl.loss_scaling(inner, jl.DynamicLossScale(2.0**4))
  params = _params()
  state = tx.init(params)
  state.inner_state.hyperparams["learning_rate"] = jnp.asarray(5e-3)
  step = jax.jit(tx.update)
  _, state = step(_grads(0, jnp.nan), state, params)
  assert int(state.inner_state.inner_state[0].count) == 0
  _, state = step(_grads(0), state, params)
  assert int(state.inner_state.inner_state[0].count) == 1
  assert state.inner_state.hyperparams["learning_rate"] == np.float32(5e-3)


def test_schedule_does_not_advance_on_skipped_steps():
  schedule = optax.linear_schedule(1.0, 0.0, 4)
  tx = jl.loss_scaling(optax.sgd(schedule), jl.StaticLossScale(1.0))
  params = {"w": jnp.zeros(1)}
  state = tx.init(params)
  lrs = []
  for g in [1.0, jnp.nan, jnp.nan, 1.0, 1.0]:
    updates, state = tx.update({"w": jnp.asarray([g])}, state, params)
    lrs.append(-float(updates["w"][0]))
  assert lrs == [1.0, 0.0, 0.0, 0.75, 0.5]


def test_extra_args_reach_contrib_transforms():
  def inner():
    return optax.chain(
      optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0)
    )

  tx, plain = jl.loss_scaling(inner(), jl.StaticLossScale(2.0)), inner()
  params = {"w": jnp.zeros(1)}
  state, plain_state = tx.init(params), plain.init(params)
  steps = []
  for loss in [1.0, 1.0, 1.0, 1.0]:  # no improvement: the plateau shrinks the step size
    value = jnp.asarray(loss)
    updates, state = tx.update({"w": jnp.asarray([2.0])}, state, params, value=value)
    expected, plain_state = plain.update(
      {"w": jnp.asarray([1.0])}, plain_state, params, value=value
    )
    np.testing.assert_array_equal(updates["w"], expected["w"])
    steps.append(float(updates["w"][0]))
  # The loss reached the plateau's `value`: patience 1, then halved on every step.
  assert steps == [-1.0, -0.5, -0.25, -0.125]


def test_init_and_update_types_match_and_step_traces_once():
  tx = jl.loss_scaling(_inner(), jl.DynamicLossScale(2.0**15, period=2))
  params = _params()
  state = tx.init(params)
  out_shapes = jax.eval_shape(tx.update, _grads(0), state, params)[1]
  in_avals = [jax.typeof(x) for x in jax.tree.leaves(state)]
  out_avals = [jax.typeof(x) for x in jax.tree.leaves(out_shapes)]
  assert in_avals == out_avals  # dtypes, shapes and weak types
  assert jax.tree.structure(state) == jax.tree.structure(out_shapes)

  traces = []

  @jax.jit
  def train_step(params, state, grads):
    traces.append(None)
    scaled = jax.tree.map(lambda g: g * jl.get_loss_scale(state).loss_scale, grads)
    updates, state = tx.update(scaled, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(8):
    params, state = train_step(params, state, _grads(i, jnp.inf if i % 3 == 0 else None))
  assert len(traces) == 1
  assert int(state.skipped_steps) == 3


def test_soak_1000_steps_with_poisoned_gradients_keeps_params_finite():
  tx = jl.loss_scaling(optax.adam(1e-3), jl.DynamicLossScale(2.0**15, period=20))
  params = _params()
  rng = np.random.default_rng(0)
  poisoned = rng.random(1000) < 0.1
  poison_values = rng.choice(np.asarray([np.nan, np.inf, -np.inf], np.float32), 1000)

  def body(carry, xs):
    params, state = carry
    bad, value = xs
    grads = _grads(0)
    grads = jax.tree.map(lambda g: g * jl.get_loss_scale(state).loss_scale, grads)
    grads["w"] = jnp.where(bad, grads["w"].at[1, 0].set(value), grads["w"])
    updates, state = tx.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None

  xs = (jnp.asarray(poisoned), jnp.asarray(poison_values))
  (params, state), _ = jax.jit(lambda c: jax.lax.scan(body, c, xs))((params, tx.init(params)))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
  assert int(state.skipped_steps) == int(poisoned.sum())
  assert int(state.inner_state[0].count) == 1000 - int(poisoned.sum())
  expected = jl.DynamicLossScale(2.0**15, period=20)
  for bad in poisoned:
    expected = expected.adjust(jnp.asarray(not bad))
  assert float(state.loss_scale.loss_scale) == float(expected.loss_scale)


def test_scaled_value_and_grad():
  def loss_fn(params, x):
    return jnp.sum((params["w"] * x) ** 2), {"n": x.shape[0]}

  params = {"w": jnp.asarray([1.0, -2.0])}
  x = jnp.asarray([3.0, 0.5])
  tx = jl.loss_scaling(optax.sgd(1.0), jl.StaticLossScale(2.0**10))
  state = tx.init(params)
  (loss, aux), grads = jl.scaled_value_and_grad(loss_fn, state, has_aux=True)(params, x)
  (ref_loss, _), ref_grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x)
  assert float(loss) == float(ref_loss) and aux == {"n": 2}
  np.testing.assert_array_equal(grads["w"], ref_grads["w"] * 2.0**10)
  _, (gp, gx) = jl.scaled_value_and_grad(
    lambda p, x: loss_fn(p, x)[0], jl.StaticLossScale(4.0), argnums=(0, 1)
  )(params, x)
  np.testing.assert_array_equal(gp["w"], ref_grads["w"] * 4.0)
  np.testing.assert_array_equal(gx, jax.grad(lambda x: loss_fn(params, x)[0])(x) * 4.0)


def test_design_md_training_step_matches_fp32():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
  y = jnp.argmax(x @ jnp.asarray(rng.normal(size=(8, 3)), jnp.float32), axis=-1)
  init = {"w": jnp.asarray(rng.normal(size=(8, 3)) * 0.1, jnp.float32)}

  def train(policy_name):
    policy = jl.get_policy(policy_name)
    tx = jl.loss_scaling(optax.adamw(5e-2), jl.DynamicLossScale(jnp.float32(2**15)))
    params, opt_state = init, tx.init(init)
    traces = []

    @jax.jit
    def train_step(params, opt_state, x, y):
      traces.append(1)

      def loss_fn(p):
        logits = policy.cast_to_compute(x) @ policy.cast_to_compute(p)["w"]
        logits = policy.cast_to_output(logits)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

      loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(40):
      params, opt_state, loss = train_step(params, opt_state, x, y)
      losses.append(float(loss))
    assert params["w"].dtype == jnp.float32
    assert len(traces) == 1
    return np.asarray(losses), opt_state

  ref, _ = train("full")
  losses, opt_state = train("params=float32,compute=float16,output=float32")
  assert ref[-1] < 0.3 * ref[0]
  assert int(opt_state.skipped_steps) == 0
  np.testing.assert_allclose(losses, ref, rtol=2e-2, atol=2e-3)


# Multi-device ---------------------------------------------------------------------------------


def _mesh():
  assert len(jax.devices()) == 8, "tests expect 8 host CPU devices; see tests/conftest.py"
  return jax.make_mesh((8,), ("data",))


def test_shard_map_every_device_skips_together():
  mesh = _mesh()
  tx = jl.loss_scaling(optax.sgd(1.0), jl.DynamicLossScale(2.0), axis_name="data")
  params = {"w": jnp.zeros(4)}
  state = tx.init(params)
  # Device 5's local gradients overflow; the others are fine.
  local_grads = jnp.ones((8, 4)).at[5, 2].set(jnp.inf)
  local_grads = jax.device_put(local_grads, NamedSharding(mesh, PartitionSpec("data")))

  def per_device(g, params, state):
    updates, state = tx.update({"w": g[0]}, state, params)
    return updates["w"][None], state.loss_scale.loss_scale[None], state.last_finite[None]

  f = jax.jit(
    jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(PartitionSpec("data"), PartitionSpec(), PartitionSpec()),
      out_specs=PartitionSpec("data"),
    )
  )
  updates, scales, finite = f(local_grads, params, state)
  np.testing.assert_array_equal(updates, np.zeros((8, 4)))
  np.testing.assert_array_equal(scales, np.full(8, 1.0))
  np.testing.assert_array_equal(finite, np.zeros(8, bool))


def test_sharded_jit_skip_is_global():
  mesh = _mesh()
  sharding = NamedSharding(mesh, PartitionSpec("data"))
  tx = jl.loss_scaling(optax.adam(1e-2), jl.DynamicLossScale(2.0**4))
  params = {"w": jax.device_put(jnp.ones(16), sharding)}
  state = tx.init(params)
  grads = {"w": jax.device_put(jnp.ones(16).at[11].set(jnp.nan), sharding)}
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert not bool(state.last_finite)
  np.testing.assert_array_equal(updates["w"], np.zeros(16))
  assert updates["w"].sharding.is_equivalent_to(sharding, 1)


# Checkpoints ----------------------------------------------------------------------------------


def _train(tx, params, state, seeds):
  step = jax.jit(tx.update)
  for seed in seeds:
    s = jl.get_loss_scale(state).loss_scale
    poison = jnp.inf if seed % 4 == 3 else None
    grads = jax.tree.map(lambda g, s=s: g * s, _grads(seed, poison))
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _tx():
  return jl.loss_scaling(
    _inner(), jl.DynamicLossScale(2.0**10, period=2, min_loss_scale=2.0, hysteresis=2)
  )


@pytest.mark.parametrize("via", ["pickle", "orbax"])
def test_resume_from_checkpoint_is_bit_identical(via, tmp_path):
  tx = _tx()
  params = _params()
  full_params, full_state = _train(tx, params, tx.init(params), range(12))

  params, state = _train(tx, params, tx.init(params), range(6))
  if via == "pickle":
    params, state = pickle.loads(pickle.dumps((params, state)))
  else:
    import orbax.checkpoint as ocp

    path = os.fspath(tmp_path / "ckpt")
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(path, {"params": params, "opt_state": state})
    # A fresh process would rebuild the structure from tx.init; do the same.
    target = {"params": _params(), "opt_state": _tx().init(_params())}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(path, abstract)
    params, state = restored["params"], restored["opt_state"]
  assert state.loss_scale.min_loss_scale == 2.0 and state.loss_scale.hysteresis == 2
  params, state = _train(tx, params, state, range(6, 12))
  assert_bitwise_equal(params, full_params)
  assert_bitwise_equal(state, full_state)


# Errors ---------------------------------------------------------------------------------------


def test_get_loss_scale_errors():
  with pytest.raises(ValueError, match="Found no loss_scaling states"):
    jl.get_loss_scale(optax.adam(1e-3).init({"w": jnp.zeros(1)}))
  tx = jl.loss_scaling(optax.sgd(1.0), jl.StaticLossScale(2.0))
  two = (tx.init({"w": jnp.zeros(1)}), tx.init({"w": jnp.zeros(1)}))
  with pytest.raises(ValueError, match="Found 2 loss_scaling states"):
    jl.get_loss_scale(two)
  scale = jl.StaticLossScale(2.0)
  assert jl.get_loss_scale(scale) is scale


def test_get_loss_scale_through_nesting():
  tx = optax.MultiSteps(
    optax.chain(optax.identity(), jl.loss_scaling(optax.sgd(1.0), jl.StaticLossScale(8.0))), 2
  )
  state = tx.init({"w": jnp.zeros(1)})
  assert float(jl.get_loss_scale(state).loss_scale) == 8.0
  # MultiSteps' state holds the chain's (identity's, loss_scaling's).
  assert jl.get_loss_scaling_state(state) is state.inner_opt_state[1]


def test_loss_scaling_argument_errors():
  with pytest.raises(TypeError, match=r"optax\.GradientTransformation"):
    jl.loss_scaling(optax.adam, jl.NoOpLossScale())
  with pytest.raises(TypeError, match="loss_scale must be"):
    jl.loss_scaling(optax.adam(1e-3), 2.0**15)


# Loss scaling applied once -------------------------------------------------------------------


def test_loss_scaling_of_a_loss_scaling_is_refused_at_construction():
  scale = jl.DynamicLossScale(jnp.float32(2.0**15))
  once = jl.loss_scaling(optax.sgd(0.5), scale)
  with pytest.raises(ValueError, match=r"inner=jl.loss_scaling\(...\).* unscaled 2 times"):
    jl.loss_scaling(once, scale)


@pytest.mark.parametrize(
  "inner",
  [
    lambda once: optax.chain(optax.clip_by_global_norm(1.0), once),
    lambda once: optax.MultiSteps(once, 2),
    lambda once: optax.chain(optax.identity(), optax.MultiSteps(once, 2).gradient_transformation()),
  ],
  ids=["chain", "multisteps", "chain_of_multisteps"],
)
def test_loss_scaling_of_a_transformation_containing_one_is_refused_at_init(inner):
  scale = jl.DynamicLossScale(jnp.float32(2.0**15))
  tx = jl.loss_scaling(inner(jl.loss_scaling(optax.sgd(0.5), scale)), scale)
  with pytest.raises(ValueError, match=r"already applies loss scaling \(its state holds 1 "):
    tx.init({"w": jnp.ones(1)})
  with pytest.raises(ValueError, match="already applies loss scaling"):
    jax.eval_shape(tx.init, {"w": jnp.ones(1)})


def _side_by_side(scale):
  """Two loss scalings side by side: each parameter's gradients go through one of them."""
  once = jl.loss_scaling(optax.sgd(0.5), scale)
  return optax.multi_transform({"a": once, "b": once}, {"u": "a", "v": "b"})


def test_nested_loss_scaling_is_counted_by_how_deep_it_nests():
  scale = jl.StaticLossScale(8.0)
  params = {"u": jnp.ones(1), "v": jnp.ones(1)}
  # Side by side inside another: each gradient is unscaled twice, not three times.
  with pytest.raises(ValueError) as info:
    jl.loss_scaling(_side_by_side(scale), scale).init(params)
  assert str(info.value) == (
    "jl.loss_scaling's inner optimizer already applies loss scaling (its state holds 2 "
    "LossScalingState): the gradients would be unscaled 2 times, so every update would be "
    "1/S of what it should be. Apply loss scaling once, outermost: "
    "jl.loss_scaling(optax.chain(..., optimizer), loss_scale), or a bare optimizer with "
    "loss_scale= in jl.flax.TrainState.create or jl.flax.Optimizer."
  )
  # One inside another inside another: three times.
  once = jl.loss_scaling(optax.sgd(0.5), scale)
  two_deep = once.init(params)._replace(inner_state=once.init(params))  # built by hand
  inner = optax.GradientTransformation(lambda p: two_deep, optax.sgd(0.5).update)
  with pytest.raises(
    ValueError, match=r"holds 2 LossScalingState\): .* unscaled 3 times, .* 1/S\^2 "
  ):
    jl.loss_scaling(inner, scale).init(params)


def test_a_nested_loss_scaling_state_is_counted():
  tx = jl.loss_scaling(optax.sgd(0.5), jl.StaticLossScale(8.0))
  state = tx.init({"w": jnp.zeros(1)})
  nested = state._replace(inner_state=tx.init({"w": jnp.zeros(1)}))  # built by hand
  with pytest.raises(ValueError, match=r"Found 2 loss_scaling states.*more than once"):
    jl.get_loss_scaling_state(nested)
  with pytest.raises(ValueError, match="Found 2 loss_scaling states"):
    jl.get_loss_scale((optax.EmptyState(), nested))
  assert jl.get_loss_scaling_state(state) is state


# A donated step ------------------------------------------------------------------------------


def _staged_loss(params):
  h = jl.stage_boundary(jnp.tanh(params["w"] * 2.0), 0)
  return jnp.sum((h + params["b"]) ** 2)


# Every kind of loss scale, built once and given to loss_scaling: each init is a fresh state.
DONATED_SCALES = {
  "static": lambda: jl.StaticLossScale(jnp.float32(2.0**8)),
  "dynamic": lambda: jl.DynamicLossScale(jnp.float32(2.0**8), period=1),
  "layerwise": lambda: jl.LayerwiseLossScale({"w": 0, "b": 1}, initial_scale=2.0**8),
}


@pytest.mark.parametrize("kind", DONATED_SCALES)
def test_an_init_after_a_donated_step_has_buffers_of_its_own(kind):
  loss_scale = DONATED_SCALES[kind]()
  tx = jl.loss_scaling(optax.sgd(0.1), loss_scale)
  params = lambda: {"w": jnp.asarray([0.5, -1.0]), "b": jnp.asarray([0.25, 0.5])}

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state):
    _, grads = jl.scaled_value_and_grad(_staged_loss, opt_state)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  donated = tx.init(params())
  first = step(params(), donated)
  assert all(x.is_deleted() for x in jax.tree.leaves(donated.loss_scale))  # consumed
  fresh = tx.init(params())  # a second run, or the target a checkpoint restores into
  assert float(jl.get_loss_scale(fresh).loss_scale) == 2.0**8
  assert float(loss_scale.loss_scale) == 2.0**8  # the object given is untouched
  assert_bitwise_equal(step(params(), fresh), first)


# ----------------------------------------------------------------------------------------------
# scaled_value_and_grad of an Equinox module: the differentiation transform is the user's.


def _eqx_problem():
  model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))  # holds relu/identity as leaves
  x = jax.random.normal(jax.random.key(1), (6, 4))
  y = jax.random.normal(jax.random.key(2), (6, 2))
  return model, x, y


def _eqx_loss(model, x, y):
  pred = jax.vmap(model)(x)
  return jnp.mean((pred - y) ** 2), {"pred": pred}


@pytest.mark.parametrize("make", [lambda: jl.StaticLossScale(2.0**10), lambda: jl.NoOpLossScale()])
def test_equinox_scaled_value_and_grad_is_the_gradient_of_the_scaled_loss(make):
  model, x, y = _eqx_problem()
  loss_scale = make()
  opt_state = jl.loss_scaling(optax.sgd(1.0), loss_scale).init(
    eqx.filter(model, eqx.is_inexact_array)
  )
  scale = jnp.float32(loss_scale.loss_scale)
  for jit in (lambda f: f, eqx.filter_jit):  # XLA fuses differently under jit: compare alike
    # The reference, by hand: Equinox's own transform of the scaled loss.
    (ref_scaled, (ref_loss, ref_aux)), ref_grads = jit(
      eqx.filter_value_and_grad(
        lambda m, x, y: (lambda out: (out[0] * scale, out))(_eqx_loss(m, x, y)), has_aux=True
      )
    )(model, x, y)
    (loss, aux), grads = jit(
      jl.scaled_value_and_grad(
        _eqx_loss, opt_state, has_aux=True, value_and_grad=eqx.filter_value_and_grad
      )
    )(model, x, y)
    assert_bitwise_equal(grads, ref_grads)  # None where the module holds functions
    assert_bitwise_equal((loss, aux), (ref_loss, ref_aux))
    loss, grads = jit(
      jl.scaled_value_and_grad(
        lambda m, x, y: _eqx_loss(m, x, y)[0], opt_state, value_and_grad=eqx.filter_value_and_grad
      )
    )(model, x, y)
    assert_bitwise_equal((loss, grads), (ref_loss, ref_grads))
  assert float(ref_scaled) == float(ref_loss) * float(scale)


def test_equinox_scaled_value_and_grad_with_a_layerwise_scale():
  # The layer-wise scale's boundary probes travel with the module (Equinox takes no argnums).
  model, x, y = _eqx_problem()
  loss_fn = lambda m, x, y: _eqx_loss(m, x, y)[0]
  loss_scale = jl.LayerwiseLossScale(0)  # one stage: every parameter
  loss, grads = jl.scaled_value_and_grad(
    loss_fn, loss_scale, value_and_grad=eqx.filter_value_and_grad
  )(model, x, y)
  scale = loss_scale.scales[-1]
  ref_loss, ref_grads = eqx.filter_value_and_grad(lambda *a: loss_fn(*a) * scale)(model, x, y)
  assert_bitwise_equal((loss * scale, grads.grads), (ref_loss, ref_grads))
  true_grads, finite, _ = loss_scale.unscale_and_adjust(grads, eqx.filter(model, eqx.is_array))
  assert bool(finite)
  assert_bitwise_equal(true_grads, eqx.filter_grad(loss_fn)(model, x, y))


def test_equinox_train_step_through_loss_scaling_matches_optax():
  model, x, y = _eqx_problem()
  floats = lambda m: eqx.filter(m, eqx.is_inexact_array)
  loss_fn = lambda m, x, y: _eqx_loss(m, x, y)[0]
  # SGD with momentum: no transcendental functions (Adam's powers), whose XLA:CPU
  # approximations differ between fusions, so the two programs agree bit for bit.
  ref_tx = optax.sgd(0.1, momentum=0.9)
  tx = jl.loss_scaling(ref_tx, jl.DynamicLossScale(jnp.float32(2.0**15), period=2))
  traces = []

  @eqx.filter_jit
  def step(model, opt_state, x, y):
    traces.append(1)
    loss, grads = jl.scaled_value_and_grad(
      loss_fn, opt_state, value_and_grad=eqx.filter_value_and_grad
    )(model, x, y)
    updates, opt_state = tx.update(grads, opt_state, floats(model))
    return eqx.apply_updates(model, updates), opt_state, loss

  @eqx.filter_jit
  def ref_step(model, state, x, y):  # plain optax, no loss scaling
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, state = ref_tx.update(grads, state, floats(model))
    return eqx.apply_updates(model, updates), state, loss

  ref, ref_state = model, ref_tx.init(floats(model))
  opt_state = tx.init(floats(model))
  poisoned = x.at[0, 0].set(jnp.inf)
  for batch in [x, x, poisoned, x]:
    model, opt_state, loss = step(model, opt_state, batch, y)
    if batch is not poisoned:  # the inf step is skipped: model and momentum unchanged
      ref, ref_state, ref_loss = ref_step(ref, ref_state, batch, y)
      assert float(loss) == float(ref_loss)
    assert_bitwise_equal(floats(model), floats(ref))
    assert model.activation is ref.activation  # the module's functions are kept
  assert_bitwise_equal(opt_state.inner_state, ref_state)
  assert int(opt_state.skipped_steps) == 1 and int(opt_state.steps) == 4
  # 2^15 grew to 2^16 after two finite steps and halved on the inf.
  assert float(opt_state.loss_scale.loss_scale) == 2.0**15
  assert len(traces) == 1  # traced once as the scale moves


def test_equinox_module_through_jax_value_and_grad_names_the_leaves():
  model, x, y = _eqx_problem()
  loss_fn = lambda model, x, y: _eqx_loss(model, x, y)[0]
  scaled = jl.scaled_value_and_grad(loss_fn, jl.StaticLossScale(2.0**10))
  with pytest.raises(TypeError) as info:
    scaled(model, x, y)
  assert str(info.value) == (
    "jax.value_and_grad differentiates every leaf of the first argument, and accepts only "
    "floating-point or complex arrays (and Python floats), but these leaves are not: "
    "model.activation: a function (custom_jvp); model.final_activation: a function. For an "
    "Equinox module pass value_and_grad=eqx.filter_value_and_grad (it differentiates the "
    "floating-point arrays and leaves the rest); otherwise move the other leaves into an "
    "argument that argnums does not select (e.g. with eqx.partition)."
  )
  assert isinstance(info.value.__cause__, TypeError)  # JAX's own error, kept as the cause
  # An integer leaf, selected by argnums, is named by its path and dtype.
  tree = {"layers": [{"w": jnp.ones(2), "step": jnp.int32(3)}]}
  named = r"of argnums=1, .* not: tree\['layers'\]\[0\]\['step'\]: int32\. For"
  with pytest.raises(TypeError, match=named):
    jl.scaled_value_and_grad(
      lambda x, tree: jnp.sum(tree["layers"][0]["w"] * x), jl.NoOpLossScale(), argnums=1
    )(jnp.ones(2), tree)

  # A TypeError of the loss itself, with the same module, is not reworded.
  def bad_loss(model, x, y):
    raise TypeError("the loss's own error")

  with pytest.raises(TypeError, match=r"^the loss's own error"):
    jl.scaled_value_and_grad(
      bad_loss, jl.NoOpLossScale(), value_and_grad=eqx.filter_value_and_grad
    )(model, x, y)
