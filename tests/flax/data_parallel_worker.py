"""One case of ``tests/flax/test_data_parallel.py``, run in a process of its own.

Usage: ``python data_parallel_worker.py CASE`` with 8 host devices (``XLA_FLAGS``). A small
linen MLP with BatchNorm (case ``linen_pmap``: ``jl.flax.TrainState`` under ``jax.pmap``) or an
NNX MLP (case ``nnx_shard_map``: ``jl.flax.Optimizer`` under ``jax.shard_map``) trains three fp16
steps with a dynamic loss scale, ``axis_name="batch"`` and no hand-written ``pmean``; the second
step has an inf in one device's batch only. The same steps run on one device, on the whole
batch, as the reference. Prints one JSON line.
"""

import json
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

import jmp_lite as jl

POLICY = "params=float32,compute=float16,output=float32"
X = jax.random.normal(jax.random.key(0), (3, 64, 8))  # three steps of 64 examples
Y = jnp.tanh(X @ jax.random.normal(jax.random.key(1), (8, 4)))
X = X.at[1, 5, 0].set(jnp.inf)  # step 2: one example on device 0 only


def loss_of(logits, y):
  return jnp.mean((logits - y) ** 2)


class Mlp(nn.Module):
  axis_name: str | None = None  # BatchNorm's statistics over the whole batch, as on one device

  @nn.compact
  def __call__(self, x, train=True):
    norm = nn.BatchNorm(use_running_average=not train, momentum=0.5, axis_name=self.axis_name)
    x = norm(nn.Dense(16)(x))
    return nn.Dense(4)(nn.relu(x))


def linen(axis_name):
  model = Mlp(axis_name)
  variables = Mlp().init(jax.random.key(2), X[0], train=False)

  class State(jl.flax.TrainState):
    batch_stats: dict

  state = State.create(
    apply_fn=model.apply,
    params=variables["params"],
    batch_stats=variables["batch_stats"],
    tx=optax.sgd(0.1),  # Adam would amplify fp16 noise in near-zero gradients
    policy=POLICY,
    loss_scale=jl.DynamicLossScale(2.0**10),
    axis_name=axis_name,
  )

  def step(state, x, y):
    def loss_fn(params):
      logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, x, mutable=["batch_stats"]
      )
      return loss_of(logits, y), updates["batch_stats"]

    (_, stats), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats)

  return state, step


def run_linen():
  state, step = linen("batch")
  replicated = jax.tree.map(lambda a: jnp.stack([a] * 8), state)
  run = jax.pmap(step, axis_name="batch")
  for i in range(3):
    replicated = run(replicated, X[i].reshape(8, 8, 8), Y[i].reshape(8, 8, 4))
  one, one_step = linen(None)
  one_step = jax.jit(one_step)
  for i in range(3):
    one = one_step(one, X[i], Y[i])
  copies = [jax.tree.map(lambda a, d=d: a[d], replicated) for d in range(8)]
  return copies, one, lambda s: (s.params, s.batch_stats), lambda s: s.loss_scaling_state


class NnxMlp(nnx.Module):
  def __init__(self):
    rngs = nnx.Rngs(2)
    self.hidden, self.out = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def nnx_step(model, optimizer, x, y):
  policy = jl.get_policy(POLICY)
  loss_fn = lambda model: loss_of(jl.flax.policy_view(model, policy)(x), y)
  _, grads = optimizer.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)


def nnx_pair(axis_name):
  model = NnxMlp()
  optimizer = jl.flax.Optimizer(
    model,
    optax.sgd(0.1),
    wrt=nnx.Param,
    loss_scale=jl.DynamicLossScale(2.0**10),
    axis_name=axis_name,
  )
  return model, optimizer


def run_nnx():
  graphdef, state = nnx.split(nnx_pair("batch"))

  def per_device(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    nnx_step(model, optimizer, x, y)
    # Each device's own copy, stacked, to compare the replicas.
    return jax.tree.map(lambda a: a[None], nnx.state((model, optimizer)))

  mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
  run = jax.jit(
    jax.shard_map(
      per_device, mesh=mesh, in_specs=(P(), P("batch"), P("batch")), out_specs=P("batch")
    )
  )
  copies = []
  for i in range(3):
    stacked = run(state, X[i], Y[i])
    copies = [jax.tree.map(lambda a, d=d: a[d], stacked) for d in range(8)]
    state = copies[0]
  model, optimizer = nnx_pair(None)
  step = nnx.jit(nnx_step)
  for i in range(3):
    step(model, optimizer, X[i], Y[i])
  one = nnx.state((model, optimizer))
  one_graphdef = nnx.graphdef((model, optimizer))
  params = lambda s: s[0]

  def scaling(s):
    pair = nnx.merge(graphdef if s is not one else one_graphdef, s)
    return pair[1].loss_scaling_state

  return copies, one, params, scaling


def main(case):
  copies, one, params, scaling = {"linen_pmap": run_linen, "nnx_shard_map": run_nnx}[case]()
  leaves = [jax.tree.leaves(params(c)) for c in copies]
  identical = all(
    np.array_equal(a, b) for other in leaves[1:] for a, b in zip(leaves[0], other, strict=True)
  )
  error = max(
    float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
    for a, b in zip(leaves[0], jax.tree.leaves(params(one)), strict=True)
  )
  counters = [scaling(c) for c in copies]
  print(
    json.dumps(
      {
        "identical": identical,
        "skipped": [int(c.skipped_steps) for c in counters],
        "one_device_skipped": int(scaling(one).skipped_steps),
        "scales": [float(c.loss_scale.loss_scale) for c in counters],
        "error_vs_one_device": error,
      }
    )
  )


if __name__ == "__main__":
  main(sys.argv[1])
