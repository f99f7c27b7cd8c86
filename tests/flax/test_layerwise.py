import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jl
import jmp_lite.flax as jlf

from .flax_testing import LinenBlock, LinenLM, jit, lm_loss, tokens

F16_POLICY = "params=float32,compute=float16,output=float32"


@pytest.fixture(scope="module")
def lm():
  """(model, variables, tokens, its stages by block): a 3-block LM, initialised once."""
  model, toks = LinenLM(layers=3), tokens()
  variables = jit(model.init)(jax.random.key(0), toks)
  stages = jlf.layerwise_stages(
    model, variables, toks, stage_modules=LinenBlock, overrides={"pos": 0}
  )
  return model, variables, toks, stages


def test_stages_from_block_calls(lm):
  *_, stages = lm
  assert stages.num_stages == 4
  assert stages.stage_paths == (("LinenBlock_0",), ("LinenBlock_1",), ("LinenBlock_2",))
  s = stages.param_stages
  assert s["Embed_0"]["embedding"] == 0 and s["pos"] == 0
  assert {v for v in jax.tree.leaves(s["LinenBlock_1"])} == {1}
  assert s["Dense_0"]["kernel"] == 3 and s["LayerNorm_0"]["scale"] == 3


def test_root_parameter_needs_an_override_and_tied_weights_are_rejected(lm):
  model, variables, toks, _ = lm
  with pytest.raises(ValueError, match="Parameter pos belongs to module <root>"):
    jlf.layerwise_stages(model, variables, toks, stage_modules=LinenBlock)

  class Tied(nn.Module):
    @nn.compact
    def __call__(self, x):
      shared = nn.Dense(4)
      x = LinenBlock(4, 1)(shared(x))
      return shared(x)

  x = jnp.ones((2, 3, 4))
  tied = Tied()
  # layerwise_stages traces abstractly: the variables' shapes are all it reads.
  tied_variables = jax.eval_shape(tied.init, jax.random.key(0), x)
  with pytest.raises(ValueError, match="Dense_0"):
    jlf.layerwise_stages(tied, tied_variables, x, stage_modules=LinenBlock)
  with pytest.raises(ValueError, match="No stage module ran"):
    jlf.layerwise_stages(model, variables, toks, stage_modules=nn.Conv, overrides={"pos": 0})
  with pytest.raises(TypeError, match="linen Module classes"):
    jlf.layerwise_stages(model, variables, toks, stage_modules=int)


def test_sequential_children_are_stages():
  model = nn.Sequential([nn.Dense(8), nn.tanh, nn.Dense(8), nn.Dense(2)])
  x = jnp.ones((4, 3))
  variables = jax.eval_shape(model.init, jax.random.key(0), x)  # only shapes are read
  stages = jlf.layerwise_stages(model, variables, x, sequential_children=True)
  # nn.tanh is a function, not a module: three module children, four stages.
  assert stages.num_stages == 4
  assert [stages.param_stages[f"layers_{i}"]["kernel"] for i in (0, 2, 3)] == [0, 1, 2]


def test_wrapped_apply_is_the_identity_outside_layerwise_gradients(lm):
  model, variables, toks, stages = lm
  apply_fn = stages.wrap(jlf.policy_apply(model, F16_POLICY))
  plain = jlf.policy_apply(model, F16_POLICY)
  wrapped, ref = jit(lambda v: (apply_fn(v, toks), plain(v, toks)))(variables)
  np.testing.assert_array_equal(wrapped, ref)


def test_linen_model_trains_in_fp16_with_layerwise_scaling_unedited(lm):
  model, variables, toks, stages = lm

  def train(apply_fn, loss_scale, steps=12):
    create = lambda params: jlf.TrainState.create(
      apply_fn=apply_fn, params=params, tx=optax.adam(1e-2), loss_scale=loss_scale
    )
    state = jit(create)(variables["params"])  # eagerly, each moment's zeros compile on their own

    traces = []

    def step(state):
      traces.append(1)

      def loss_fn(params):
        return lm_loss(state.apply_fn({"params": params}, toks), toks)

      loss, grads = state.value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), loss

    step = jit(step)
    losses = []
    for _ in range(steps):
      state, loss = step(state)
      losses.append(float(loss))
    assert len(traces) == 1
    return np.asarray(losses), state

  ref, _ = train(model.apply, None)
  losses, state = train(
    stages.wrap(jlf.policy_apply(model, F16_POLICY)), stages.loss_scale(initial_scale=2.0**10)
  )
  scales = np.log2(np.asarray(state.loss_scale.scales))
  assert len(set(scales.tolist())) > 1  # the stages found different scales
  assert int(state.loss_scaling_state.skipped_steps) <= 1
  assert ref[-1] < 0.8 * ref[0]
  np.testing.assert_allclose(losses, ref, rtol=2e-2)


def test_stage_gradients_match_fp32(lm):
  model, variables, toks, stages = lm
  scale = stages.loss_scale()
  scale = scale.with_scales(jnp.asarray([2.0**16, 2.0**13, 2.0**10, 2.0**7], jnp.float32))
  apply_fn = stages.wrap(jlf.policy_apply(model, F16_POLICY))
  loss = lambda p: lm_loss(apply_fn({"params": p}, toks), toks)
  # The reference: the same fp16 forward pass with one scale that suits every stage.
  static = jl.StaticLossScale(2.0**10)

  @jit
  def gradients(params):  # ours and both references, compiled as one program
    _, grads = scale.value_and_grad(loss)(params)
    _, ref = jl.scaled_value_and_grad(loss, static)(params)
    ref32 = jax.grad(lambda p: lm_loss(model.apply({"params": p}, toks), toks))(params)
    return grads.stats.amax, scale.unscale(grads), static.unscale(ref), ref32

  amax, unscaled, ref, ref32 = gradients(variables["params"])
  assert amax.shape == (3,)
  leaves = (jax.tree.leaves(unscaled), jax.tree.leaves(ref), jax.tree.leaves(ref32))
  for g, r, r32 in zip(*leaves, strict=True):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, r, rtol=0, atol=1e-2 * np.abs(r32).max() + 1e-6)
