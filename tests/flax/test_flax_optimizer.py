import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_testing import (
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

import jmp_lite as jl
import jmp_lite.flax as jlf

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
  assert isinstance(optimizer.loss_scale, jl.NoOpLossScale)
  with pytest.raises(ValueError, match="loss_scaling"):
    optimizer.loss_scaling_state  # noqa: B018
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
  assert isinstance(grads, jl.LayerwiseGrads)
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
