import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_lite as jl
import jmp_lite.flax as jlf

from .flax_testing import (
  F32,
  NnxConvNet,
  NnxLM,
  images,
  jit,
  leaf_rel_errors,
  lm_loss,
  nnx_compiled,
  nnx_model,
  tokens,
)

F16_POLICY = "params=float32,compute=float16,output=float32"


def train_step(model, optimizer, toks):
  def loss_fn(model):
    return lm_loss(jlf.policy_view(model, F16_POLICY)(toks), toks)

  loss, grads = optimizer.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def _params(model):
  return [np.asarray(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_nnx_model_trains_in_fp16_with_dynamic_loss_scaling():
  model, toks = nnx_model(NnxLM), tokens()
  scale = jl.DynamicLossScale(jnp.float32(2.0**10), period=2)
  optimizer = jlf.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param, loss_scale=scale)
  step = nnx_compiled(train_step, model, optimizer)
  losses = [float(step(toks)) for _ in range(4)]
  assert losses[-1] < losses[0] - 0.3
  state = optimizer.loss_scaling_state
  assert int(state.skipped_steps) == 0 and bool(state.last_finite)
  assert float(optimizer.loss_scale.loss_scale) == 2.0**12  # grew twice (period=2)
  # fp32 master weights and optimizer state, no 16-bit copy anywhere.
  assert {p.dtype for p in _params(model)} == {F32}
  leaves = jax.tree.leaves(nnx.as_pure(optimizer.opt_state))
  assert {x.dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)} == {F32}

  # A scale that overflows fp16: skipped, parameters untouched, scale halved.
  # Set in place (NNX state), so the step is not compiled again.
  optimizer.opt_state.loss_scale.loss_scale[...] = jnp.float32(2.0**40)
  before = _params(model)
  step(toks)
  for a, b in zip(_params(model), before, strict=True):
    np.testing.assert_array_equal(a, b)
  assert int(optimizer.loss_scaling_state.skipped_steps) == 1
  assert float(optimizer.loss_scale.loss_scale) == 2.0**39


def test_without_loss_scale_it_is_nnx_optimizer():
  model, toks = nnx_model(NnxLM), tokens()
  optimizer = jlf.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  assert isinstance(optimizer, nnx.Optimizer)
  # No loss scale is NoOpLossScale(): nothing scaled, the counters kept all the same.
  assert isinstance(optimizer.loss_scale, jl.NoOpLossScale)
  assert int(optimizer.loss_scaling_state.skipped_steps) == 0
  loss_fn = lambda m: lm_loss(m(toks), toks)
  # Unscaled: the same value and gradients as nnx.value_and_grad.
  (value, grads), (ref_value, ref_grads) = nnx.eval_shape(
    lambda m: (optimizer.value_and_grad(loss_fn)(m), nnx.value_and_grad(loss_fn)(m)), model
  )
  assert value.dtype == ref_value.dtype and jax.tree.structure(grads) == jax.tree.structure(
    ref_grads
  )


def test_value_and_grad_has_aux_and_validates_argnums():
  model, toks = nnx_model(NnxLM), tokens()
  optimizer = jlf.Optimizer(
    model, optax.sgd(0.1), wrt=nnx.Param, loss_scale=jl.StaticLossScale(jnp.float32(8.0))
  )

  def loss_fn(x, m):
    logits = m(x)
    return lm_loss(logits, x), logits

  graphdef, state = nnx.split((model, optimizer))

  @jit
  def run(state):
    model, optimizer = nnx.merge(graphdef, state)
    (loss, logits), grads = optimizer.value_and_grad(loss_fn, has_aux=True, argnums=1)(toks, model)
    ref = nnx.grad(lambda m: loss_fn(toks, m)[0])(model)
    return loss, logits, grads, ref

  loss, logits, grads, ref = run(state)
  assert logits.shape == (2, 8, 32) and loss.shape == ()
  # The gradients are those of the scaled loss (8x), which update() unscales.
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref), strict=True):
    np.testing.assert_allclose(g, 8 * r, rtol=1e-5, atol=1e-6)
  with pytest.raises(TypeError, match="argnums must be an int"):
    optimizer.value_and_grad(loss_fn, argnums=(0, 1))


class StagedMlp(nnx.Module):
  """Three Linear layers, one stage each (plain-JAX stage boundaries)."""

  def __init__(self, *, rngs):
    self.layers = nnx.List([nnx.Linear(3, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)])
    self.head = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    for k, layer in enumerate(self.layers):
      x = jl.stage_boundary(jnp.tanh(layer(x)), k)
    return self.head(x)


def test_layerwise_loss_scale_gives_true_gradients():
  model, x = nnx_model(StagedMlp), jit(lambda: jax.random.normal(jax.random.key(1), (4, 3)))()
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  stages = jax.tree_util.tree_map_with_path(
    lambda path, _: 2 if path[0].key == "head" else path[1].key, params
  )
  scale = jl.LayerwiseLossScale(stages).with_scales([2.0**10, 2.0**4, 2.0**7])
  lr = 2.0**-3
  optimizer = jlf.Optimizer(model, optax.sgd(lr), wrt=nnx.Param, loss_scale=scale)
  loss_fn = lambda m: jnp.sum(m(x) ** 2)

  def step(model, optimizer):  # the reference, then the step, compiled as one program
    true = nnx.grad(loss_fn)(model)
    _, grads = optimizer.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.as_pure(true), grads

  true, grads = nnx_compiled(step, model, optimizer)()
  assert isinstance(grads, jl.ScaledGrads)
  moved = jax.tree.map(lambda a, b: (b - a) / -lr, params, nnx.as_pure(nnx.state(model, nnx.Param)))
  for name, err in leaf_rel_errors(moved, true).items():
    assert err < 1e-6, name  # stage 0 arrived 2^-6 of its true value when scaled by S_2 only
  np.testing.assert_array_equal(optimizer.loss_scale.scales.shape, (3,))


def test_a_skipped_step_keeps_batch_stats():
  model, x = nnx_model(NnxConvNet), images()
  optimizer = jlf.Optimizer(
    model, optax.sgd(0.1), wrt=nnx.Param, loss_scale=jl.DynamicLossScale(jnp.float32(2.0**10))
  )

  def train_step(model, optimizer, x):
    loss_fn = lambda m: jnp.mean(jlf.policy_view(m, F16_POLICY)(x) ** 2)
    _, grads = optimizer.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)

  step = nnx_compiled(train_step, model, optimizer)

  def snapshot():
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(model, nnx.Not(nnx.RngState)))]

  before = snapshot()
  step(x.at[0, 0, 0, 0].set(jnp.inf))
  assert not bool(optimizer.loss_scaling_state.last_finite)
  for a, b in zip(snapshot(), before, strict=True):
    np.testing.assert_array_equal(a, b)  # params and BatchStat alike
  step(x)
  assert bool(optimizer.loss_scaling_state.last_finite)
  ref = nnx_model(NnxConvNet)
  # The forward pass alone updates the statistics.
  nnx_compiled(lambda m: jlf.policy_view(m, F16_POLICY)(x), ref)()
  np.testing.assert_allclose(model.bn.mean[...], ref.bn.mean[...], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(model.bn.var[...], ref.bn.var[...], rtol=1e-6, atol=1e-7)


# Loss scaling applied once, and optimizers that own their buffers --------------------------

SCALE = jl.DynamicLossScale(jnp.float32(2.0**15))


class _Weight(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.ones(1))


def _half_square(model):
  return 0.5 * jnp.sum(model.w[...] ** 2)  # gradient w


def _sgd_step(model, optimizer):
  _, grads = optimizer.value_and_grad(_half_square)(model)
  optimizer.update(model, grads)


def _sgd_update(tx, **kwargs) -> float:
  model = _Weight()
  _sgd_step(model, jlf.Optimizer(model, tx, wrt=nnx.Param, **kwargs))
  return float(model.w[...][0]) - 1.0


def test_loss_scaling_applied_twice_is_refused():
  wrapped = jl.loss_scaling(optax.sgd(0.5), SCALE)
  # Once, either way: the update is -lr * w = -0.5.
  assert _sgd_update(optax.sgd(0.5), loss_scale=SCALE) == -0.5
  assert _sgd_update(wrapped) == -0.5
  # Twice: the gradients were unscaled twice, an update of -0.5 / 2^15 = -1.5e-05.
  with pytest.raises(
    ValueError,
    match=r"^jl\.flax\.Optimizer got loss_scale=DynamicLossScale\(\.\.\.\) and a tx that "
    r"already applies loss scaling .* unscaled 2 times",
  ):
    jlf.Optimizer(_Weight(), wrapped, wrt=nnx.Param, loss_scale=SCALE)
  with pytest.raises(ValueError, match="already applies loss scaling"):
    jlf.Optimizer(
      _Weight(), optax.chain(optax.identity(), wrapped), wrt=nnx.Param, loss_scale=SCALE
    )


def test_no_loss_scale_is_noop_loss_scale():
  optimizers = [
    jlf.Optimizer(_Weight(), optax.sgd(0.5), wrt=nnx.Param, **kwargs)
    for kwargs in ({}, {"loss_scale": jl.NoOpLossScale()})
  ]
  none, noop = (nnx.as_pure(o.opt_state) for o in optimizers)
  assert jax.tree.structure(none) == jax.tree.structure(noop)
  assert _sgd_update(optax.sgd(0.5)) == _sgd_update(optax.sgd(0.5), loss_scale=jl.NoOpLossScale())
  for kwargs in ({}, {"loss_scale": jl.NoOpLossScale()}):
    model = _Weight()
    optimizer = jlf.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param, **kwargs)
    # A non-finite step is skipped and counted, as with NoOpLossScale().
    grads = jax.tree.map(lambda g: jnp.full_like(g, jnp.inf), nnx.grad(_half_square)(model))
    optimizer.update(model, grads)
    assert float(model.w[...][0]) == 1.0
    assert int(optimizer.loss_scaling_state.skipped_steps) == 1
  # A tx that applies loss scaling itself is used as it is.
  optimizer = jlf.Optimizer(_Weight(), jl.loss_scaling(optax.sgd(0.5), SCALE), wrt=nnx.Param)
  assert float(optimizer.loss_scale.loss_scale) == 2.0**15
  assert not isinstance(optimizer.loss_scaling_state.inner_state, jl.LossScalingState)


def test_an_optimizer_built_after_a_donated_step_has_buffers_of_its_own():
  scale = jl.DynamicLossScale(jnp.float32(2.0**10), period=1)
  step = nnx.jit(_sgd_step, donate_argnums=(0, 1))
  results = []
  for _ in range(2):  # a second run from the same loss scale
    model = _Weight()
    optimizer = jlf.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param, loss_scale=scale)
    assert float(optimizer.loss_scale.loss_scale) == 2.0**10
    loss_scale_arrays = jax.tree.leaves(nnx.as_pure(optimizer.opt_state).loss_scale)
    step(model, optimizer)
    assert all(x.is_deleted() for x in loss_scale_arrays)  # the step consumed them
    results.append((float(model.w[...][0]), float(optimizer.loss_scale.loss_scale)))
  assert results == [(0.5, 2.0**11)] * 2
  assert float(scale.loss_scale) == 2.0**10
