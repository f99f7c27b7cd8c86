from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jl
import jmp_lite.flax as jlf

from .flax_testing import (
  F32,
  LinenConvNet,
  LinenLM,
  images,
  jit,
  leaf_rel_errors,
  linen_init,
  lm_loss,
  tokens,
)

F16_POLICY = "params=float32,compute=float16,output=float32"


def _train_step(state, toks):
  def loss_fn(params):
    return lm_loss(state.apply_fn({"params": params}, toks), toks)

  loss, grads = state.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def test_linen_model_trains_in_fp16_with_dynamic_loss_scaling():
  model, toks = LinenLM(), tokens()
  params = linen_init(model, jax.random.key(0), toks)["params"]

  step = jit(_train_step)
  initial = jlf.TrainState.create(
    apply_fn=model.apply,
    params=params,
    tx=optax.adam(3e-2),
    policy=F16_POLICY,
    loss_scale=jl.DynamicLossScale(jnp.float32(2.0**10), period=2),
  )
  state = initial
  assert state.policy == jl.get_policy(F16_POLICY)
  losses = []
  for _ in range(4):
    state, loss = step(state, toks)
    losses.append(float(loss))
  assert losses[-1] < losses[0] - 0.3
  assert int(state.step) == 4 and int(state.loss_scaling_state.skipped_steps) == 0
  assert float(state.loss_scale.loss_scale) == 2.0**12  # grew twice (period=2)
  # Persistent state: fp32 master weights and optimizer state, no 16-bit copy.
  leaves = jax.tree.leaves((state.params, state.opt_state.inner_state))
  assert {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)} == {F32}

  # A scale that overflows fp16: the step is skipped, nothing moves, the scale halves.
  # (Same state structure as before, so the step is not compiled again.)
  huge = jl.DynamicLossScale(jnp.float32(2.0**40), period=2)
  state = initial.replace(opt_state=initial.opt_state._replace(loss_scale=huge))
  new, _ = step(state, toks)
  assert not bool(new.loss_scaling_state.last_finite)
  assert int(new.loss_scaling_state.skipped_steps) == 1
  assert float(new.loss_scale.loss_scale) == 2.0**39
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params), strict=True):
    np.testing.assert_array_equal(a, b)
  assert int(new.opt_state.inner_state[0].count) == 0  # Adam did not advance


class StateWithStats(jlf.TrainState):
  batch_stats: Any = None


def _bn_step(state, x):
  def loss_fn(params):
    logits, new = state.apply_fn(
      {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
    )
    return jnp.mean(logits**2), new["batch_stats"]

  (loss, stats), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads, batch_stats=stats), loss


def test_subclass_with_batch_stats_and_no_loss_scaling():
  model, x = LinenConvNet(), images()
  variables = linen_init(model, jax.random.key(0), x)
  state = StateWithStats.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=optax.sgd(0.1),
    policy="p=f32,c=bf16,o=f32",
    batch_stats=variables["batch_stats"],
  )
  # No loss scale is NoOpLossScale(): nothing scaled, the counters kept all the same.
  assert isinstance(state.loss_scale, jl.NoOpLossScale)
  assert int(state.loss_scaling_state.skipped_steps) == 0

  new, loss = jit(_bn_step)(state, x)
  assert int(new.loss_scaling_state.steps) == 1 and bool(new.loss_scaling_state.last_finite)
  assert loss.dtype == F32
  assert {v.dtype for v in jax.tree.leaves((new.params, new.batch_stats))} == {F32}
  assert not np.allclose(
    new.batch_stats["BatchNorm_0"]["var"], state.batch_stats["BatchNorm_0"]["var"]
  )


def test_params_are_stored_in_the_policy_param_dtype():
  model, toks = nn.Dense(3), jnp.ones((2, 4))
  params = jax.eval_shape(model.init, jax.random.key(0), toks)["params"]
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
  state = jlf.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax.sgd(1.0), policy="bf16"
  )
  assert {p.dtype for p in jax.tree.leaves((state.params, state.opt_state.inner_state))} == {
    np.dtype(jnp.bfloat16)
  }


def test_create_takes_a_module_policies():
  model, x = nn.Sequential([nn.Dense(4), nn.LayerNorm()]), jnp.ones((2, 3))
  params = jit(model.init)(jax.random.key(0), x)["params"]
  create = lambda **kw: jlf.TrainState.create(
    apply_fn=model.apply, params=params, tx=optax.adam(1e-3), **kw
  )
  policies = jlf.ModulePolicies("p=bf16,c=bf16,o=f32", {nn.Dense: "f32"})
  state = create(policy=policies)
  ref = create(policy="p=bf16,c=bf16,o=f32")
  assert state.policy == ref.policy == jl.get_policy("p=bf16,c=bf16,o=f32")
  # The params (and so Adam's moments) in the object's param dtype, as with the string.
  adam = state.opt_state.inner_state[0]
  assert {p.dtype for p in jax.tree.leaves((state.params, adam.mu, adam.nu))} == {
    np.dtype(jnp.bfloat16)
  }
  jax.tree.map(np.testing.assert_array_equal, state.params, ref.params)
  # apply_fn runs under the object: its override too (the Dense in fp32).
  program = lambda s: str(jax.make_jaxpr(s.apply_fn)({"params": s.params}, x))
  by_hand = jlf.policy_apply(model, policies)
  assert program(state) == str(jax.make_jaxpr(by_hand)({"params": state.params}, x))
  assert program(state) != program(ref)
  np.testing.assert_array_equal(
    state.apply_fn({"params": state.params}, x), by_hand({"params": state.params}, x)
  )


@pytest.mark.parametrize(
  "kwargs, match",
  [
    ({"apply_fn": lambda v, x: x, "policy": F16_POLICY}, "apply_fn=model.apply"),
    ({"apply_fn": nn.Dense(3).init, "policy": F16_POLICY}, "apply_fn=model.apply"),
    # Overrides are set on a ModulePolicies passed as policy.
    (
      {"apply_fn": nn.Dense(3).apply, "policy": F16_POLICY, "overrides": {nn.Dense: "f32"}},
      "unexpected keyword argument 'overrides'",
    ),
  ],
)
def test_create_rejects_inconsistent_arguments(kwargs, match):
  with pytest.raises(TypeError, match=match):
    jlf.TrainState.create(params={}, tx=optax.sgd(1.0), **kwargs)


class StateWithRequiredStats(jlf.TrainState):
  batch_stats: Any  # no default, as with Flax's own TrainState


def test_a_skipped_step_keeps_batch_stats():
  model, x = LinenConvNet(), images()
  variables = linen_init(model, jax.random.key(0), x)
  state = StateWithRequiredStats.create(
    apply_fn=model.apply,
    params=variables["params"],
    tx=optax.sgd(0.1),
    policy=F16_POLICY,
    loss_scale=jl.DynamicLossScale(jnp.float32(2.0**10)),
    batch_stats=variables["batch_stats"],
  )
  step = jit(_bn_step)
  # An inf in the batch: the forward pass's statistics are NaN, the step is skipped.
  bad, _ = step(state, x.at[0, 0, 0, 0].set(jnp.inf))
  assert not bool(bad.loss_scaling_state.last_finite)
  for a, b in zip(
    jax.tree.leaves((bad.params, bad.batch_stats)),
    jax.tree.leaves((state.params, state.batch_stats)),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  # A finite step stores the new statistics, as Flax's TrainState does.
  good, _ = step(bad, x)
  assert bool(good.loss_scaling_state.last_finite)
  # The forward pass's own statistics (the params were untouched by the skipped step).
  _, ref = jit(state.apply_fn, static_argnames="mutable")(
    {"params": state.params, "batch_stats": state.batch_stats}, x, mutable=("batch_stats",)
  )
  for a, b in zip(
    jax.tree.leaves(good.batch_stats), jax.tree.leaves(ref["batch_stats"]), strict=True
  ):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  assert not np.allclose(
    good.batch_stats["BatchNorm_0"]["mean"], state.batch_stats["BatchNorm_0"]["mean"]
  )
  assert int(good.step) == 2


def test_layerwise_loss_scale_gives_true_gradients():
  model = nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(8), nn.tanh, nn.Dense(2)])
  x = jit(lambda: jax.random.normal(jax.random.key(1), (4, 3)))()
  params = jit(model.init)(jax.random.key(0), x)["params"]
  stages = jlf.layerwise_stages(model, {"params": params}, x, sequential_children=True)
  scale = stages.loss_scale().with_scales(2.0 ** np.arange(12, 12 - 3 * stages.num_stages, -3))
  lr = 2.0**-3
  state = jlf.TrainState.create(
    apply_fn=stages.wrap(model.apply), params=params, tx=optax.sgd(lr), loss_scale=scale
  )

  @jit
  def step(state):  # the step and the reference, compiled as one program
    def loss_fn(p):
      return jnp.sum(state.apply_fn({"params": p}, x) ** 2)

    _, grads = state.value_and_grad(loss_fn)(state.params)
    true = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads), true

  new, true = step(state)
  moved = jax.tree.map(lambda a, b: (b - a) / -lr, params, new.params)
  for name, err in leaf_rel_errors(moved, true).items():
    assert err < 1e-6, name


# Loss scaling applied once, and states that own their buffers -----------------------------

SCALE = jl.DynamicLossScale(jnp.float32(2.0**15))


def _half_square(params):
  return 0.5 * jnp.sum(params["w"] ** 2)  # gradient w


def _sgd_state(**kwargs):
  return jlf.TrainState.create(
    apply_fn=lambda variables: variables, params={"w": jnp.ones(1)}, **kwargs
  )


def _sgd_step(state):
  _, grads = state.value_and_grad(_half_square)(state.params)
  return state.apply_gradients(grads=grads)


def _sgd_update(state) -> float:
  return float(_sgd_step(state).params["w"][0] - state.params["w"][0])


def test_loss_scaling_applied_twice_is_refused():
  bare, wrapped = optax.sgd(0.5), jl.loss_scaling(optax.sgd(0.5), SCALE)
  # Once, either way: the update is -lr * w = -0.5.
  assert _sgd_update(_sgd_state(tx=bare, loss_scale=SCALE)) == -0.5
  assert _sgd_update(_sgd_state(tx=wrapped)) == -0.5
  # Twice (tx built with jl.loss_scaling as every getting-started page does, and loss_scale=):
  # the gradients were unscaled twice, an update of -0.5 / 2^15 = -1.5e-05.
  with pytest.raises(
    ValueError,
    match=r"^jl\.flax\.TrainState\.create got loss_scale=DynamicLossScale\(\.\.\.\) and a tx "
    r"that already applies loss scaling .* unscaled 2 times.* Pass one of them",
  ):
    _sgd_state(tx=wrapped, loss_scale=SCALE)
  # Inside a chain, and with a scale of 1, it is applied twice all the same.
  with pytest.raises(ValueError, match="already applies loss scaling"):
    _sgd_state(
      tx=optax.chain(optax.clip_by_global_norm(1.0), wrapped), loss_scale=jl.NoOpLossScale()
    )


def test_a_tx_applying_loss_scaling_side_by_side_counts_one_unscaling_each():
  # optax.multi_transform of two loss scalings: with loss_scale= each gradient is unscaled twice.
  once = jl.loss_scaling(optax.sgd(0.5), SCALE)
  side_by_side = optax.multi_transform({"a": once, "b": once}, {"u": "a", "v": "b"})
  with pytest.raises(ValueError, match=r"unscaled 2 times, so every update would be 1/S of"):
    jlf.TrainState.create(
      apply_fn=lambda v: v,
      params={"u": jnp.ones(1), "v": jnp.ones(1)},
      tx=side_by_side,
      loss_scale=SCALE,
    )


def test_no_loss_scale_is_noop_loss_scale():
  none, noop = (
    _sgd_state(tx=optax.sgd(0.5)),
    _sgd_state(tx=optax.sgd(0.5), loss_scale=jl.NoOpLossScale()),
  )
  assert jax.tree.structure(none.opt_state) == jax.tree.structure(noop.opt_state)
  for state in (none, noop):
    assert isinstance(state.loss_scale, jl.NoOpLossScale)
    assert _sgd_update(state) == -0.5
    # A non-finite step is skipped and counted, as with NoOpLossScale().
    bad = state.apply_gradients(grads={"w": jnp.full(1, jnp.inf)})
    assert float(bad.params["w"][0]) == 1.0
    assert int(bad.loss_scaling_state.skipped_steps) == 1
  # A tx that applies loss scaling itself is used as it is.
  state = _sgd_state(tx=jl.loss_scaling(optax.sgd(0.5), SCALE))
  assert jax.tree.structure(state.opt_state) == jax.tree.structure(
    jl.loss_scaling(optax.sgd(0.5), SCALE).init({"w": jnp.ones(1)})
  )
  assert float(state.loss_scale.loss_scale) == 2.0**15


@pytest.mark.parametrize("via", ["loss_scale", "tx"])
def test_a_state_created_after_a_donated_step_has_buffers_of_its_own(via):
  scale = jl.DynamicLossScale(jnp.float32(2.0**10), period=1)
  if via == "loss_scale":
    create = lambda: _sgd_state(tx=optax.sgd(0.5), loss_scale=scale)
  else:
    create = lambda: _sgd_state(tx=jl.loss_scaling(optax.sgd(0.5), scale))
  step = jax.jit(_sgd_step, donate_argnums=0)
  donated = create()
  first = step(donated)
  assert donated.loss_scale.loss_scale.is_deleted()
  fresh = create()  # a second run, or the target a checkpoint restores into
  assert float(fresh.loss_scale.loss_scale) == 2.0**10
  second = step(fresh)
  assert float(second.loss_scale.loss_scale) == 2.0**11  # grew (period=1)
  assert float(second.params["w"][0]) == 0.5
  for a, b in zip(jax.tree.leaves(second), jax.tree.leaves(first), strict=True):
    np.testing.assert_array_equal(a, b)
