"""bf16 parameters through jl.flax.TrainState and the NNX Optimizer, and through orbax."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jmp_lite as jl

METHODS = ("nearest", "stochastic", "kahan", "split")
POLICY = "params=bfloat16,compute=bfloat16,output=float32"
X = jax.random.normal(jax.random.key(0), (32, 8))
Y = jnp.tanh(X @ jax.random.normal(jax.random.key(1), (8, 4)))


def optimizer(method):
  # Stochastic rounding with bf16 moments: 2 + 2 + 2 bytes per parameter.
  state_dtype = jnp.bfloat16 if method == "stochastic" else None
  return jl.low_precision_params(optax.adam(1e-2), method, seed=3, state_dtype=state_dtype)


def checkpoint_round_trip(tree, like, path):
  """Saves ``tree`` with orbax and restores it into the structure of ``like``."""
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as checkpointer:
    return checkpointer.restore(path, abstract)


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


@pytest.mark.parametrize("method", METHODS)
def test_linen_train_state_trains_bf16_params_and_resumes_from_orbax(method, tmp_path):
  model = Mlp()
  params = model.init(jax.random.key(2), X)["params"]

  def create():
    return jl.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optimizer(method), policy=POLICY
    )

  @jax.jit
  def step(state):
    def loss_fn(params):
      return jnp.mean((state.apply_fn({"params": params}, X) - Y) ** 2)

    loss, grads = state.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  state = create()
  assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
  losses = []
  for _ in range(6):
    state, loss = step(state)
    losses.append(float(loss))
  saved = checkpoint_round_trip(state, create(), os.fspath(tmp_path / "ckpt"))
  for _ in range(6):
    state, loss = step(state)
    saved, saved_loss = step(saved)
    assert float(saved_loss) == float(loss)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(saved), strict=True):
    np.testing.assert_array_equal(a, b)
  assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
  assert float(loss) < 0.8 * losses[0]


class NnxMlp(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(8, 16, param_dtype=jnp.bfloat16, rngs=rngs)
    self.out = nnx.Linear(16, 4, param_dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


@pytest.mark.parametrize("method", METHODS)
def test_nnx_optimizer_trains_bf16_params_and_resumes_from_orbax(method, tmp_path):
  policy = jl.get_policy(POLICY)

  def create():
    model = NnxMlp(nnx.Rngs(2))
    return model, jl.flax.Optimizer(model, optimizer(method), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt):
    def loss_fn(model):
      return jnp.mean((jl.flax.policy_view(model, policy)(X) - Y) ** 2)

    loss, grads = opt.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  model, opt = create()
  first = float(step(model, opt))
  for _ in range(5):
    step(model, opt)
  saved = checkpoint_round_trip(
    nnx.to_pure_dict(nnx.state((model, opt))),
    nnx.to_pure_dict(nnx.state(create())),
    os.fspath(tmp_path / "ckpt"),
  )
  resumed_model, resumed_opt = create()
  state = nnx.state((resumed_model, resumed_opt))
  nnx.replace_by_pure_dict(state, saved)
  nnx.update((resumed_model, resumed_opt), state)
  for _ in range(6):
    loss = step(model, opt)
    assert float(step(resumed_model, resumed_opt)) == float(loss)
  for a, b in zip(
    jax.tree.leaves(nnx.state((model, opt))),
    jax.tree.leaves(nnx.state((resumed_model, resumed_opt))),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  assert model.hidden.kernel.dtype == jnp.bfloat16
  assert float(loss) < 0.8 * first
