"""diagnostics.parameter_order (jmp_lite/diagnostics/_parameter_order.py)."""

import functools

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

import jmp_lite as jl
from jmp_lite import diagnostics as diag
from jmp_lite import scaled_value_and_grad

from .diagnostics_testing import as_float, jit, stats_of

F16 = jnp.float16


def test_parameter_order_follows_the_forward_pass():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      # Names deliberately out of alphabetical order.
      x = nn.Dense(4, name="zeta")(x)
      x = jax.jit(nn.relu)(nn.Dense(4, name="alpha")(x))
      return nn.Dense(1, name="mid")(x)

  x = jnp.ones((2, 3))
  params = jit(Net().init)(jax.random.key(0), x)
  policy = jl.get_policy("p=f32,c=f16,o=f32")
  # The policy casts every parameter first, in tree order: casts are not uses.
  order = diag.parameter_order(lambda p, x: Net().apply(policy.cast_to_compute(p), x), params, x)
  layers = list(dict.fromkeys(name.split("/")[1] for name in order))
  assert layers == ["zeta", "alpha", "mid"]


class OutOfOrderNet(nn.Module):
  """Three Dense layers run alpha, zeta, mid: tree (sorted) order is alpha, mid, zeta.

  Linear, so an inf in the input reaches every layer (a ReLU could zero it).
  """

  @nn.compact
  def __call__(self, x):
    for name in ("alpha", "zeta", "mid"):
      x = nn.Dense(4, name=name)(x)
    return x


EXECUTION_ORDER = tuple(
  f"params/{layer}/{leaf}" for layer in ("alpha", "zeta", "mid") for leaf in ("kernel", "bias")
)


def _one_device_replicated():
  # A trivial sharding: the constraint is in the jaxpr on any number of devices.
  return jax.sharding.NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec())


def test_parameter_order_looks_through_ops_that_only_move_or_annotate():
  from jax.ad_checkpoint import checkpoint_name

  x = jnp.ones((2, 3))
  params = jit(OutOfOrderNet().init)(jax.random.key(0), x)
  sharding = _one_device_replicated()
  moves = {
    "sharding_constraint": lambda p: jax.lax.with_sharding_constraint(p, sharding),
    "eqx.filter_shard": lambda p: eqx.filter_shard(p, sharding),
    "nn.with_logical_constraint": lambda p: jax.tree.map(
      lambda w: nn.with_logical_constraint(
        w, ("batch", "embed")[-w.ndim :], rules=(("embed", "data"),), mesh=sharding.mesh
      ),
      p,
    ),
    "optimization_barrier": jax.lax.optimization_barrier,
    "jit": jax.jit(lambda p: jax.tree.map(lambda w: w.astype(F16).astype(jnp.float32), p)),
    "device_put": lambda p: jax.device_put(p, sharding),
    "copy": lambda p: jax.tree.map(jnp.copy, p),
    "checkpoint_name": lambda p: jax.tree.map(lambda w: checkpoint_name(w, "w"), p),
  }
  for name, move in moves.items():
    # Each is really in the jaxpr (one kind of op on every parameter), not traced away.
    primitives = {e.primitive.name for e in jax.make_jaxpr(move)(params).jaxpr.eqns}
    assert len(primitives) == 1, (name, primitives)
    apply = lambda p, x, move=move: OutOfOrderNet().apply(move(p), x)
    assert diag.parameter_order(apply, params, x) == EXECUTION_ORDER, name
  everything = lambda p: functools.reduce(lambda p, move: move(p), moves.values(), p)
  assert diag.parameter_order(lambda p: OutOfOrderNet().apply(everything(p), x), params) == (
    EXECUTION_ORDER
  )
  # A parameter that is only constrained, never computed with, is unused: it comes last.
  extra = {"params": {**params["params"], "aaa_unused": jnp.ones(2)}}

  def loss_fn(p):
    p = dict(jax.lax.with_sharding_constraint(p, sharding)["params"])
    del p["aaa_unused"]
    return OutOfOrderNet().apply({"params": p}, x)

  assert diag.parameter_order(loss_fn, extra) == (*EXECUTION_ORDER, "params/aaa_unused")


def test_inf_at_the_input_of_a_sharded_loss_blames_the_first_layer():
  # FSDP-style code (and eqx.filter_shard, nn.with_logical_constraint) constrains every
  # parameter before the model runs; an inf in the batch makes every layer's gradients NaN.
  x = jnp.ones((2, 3))
  params = jit(OutOfOrderNet().init)(jax.random.key(0), x)
  sharding = _one_device_replicated()

  def loss_fn(p, x):
    p = jax.lax.with_sharding_constraint(p, sharding)
    return jnp.mean(OutOfOrderNet().apply(p, x) ** 2)

  order = diag.parameter_order(loss_fn, params, x)
  assert order == EXECUTION_ORDER
  poisoned = x.at[0, 1].set(jnp.inf)
  grads = jit(lambda p, x: scaled_value_and_grad(loss_fn, jl.StaticLossScale(2.0**8))(p, x)[1])(
    params, poisoned
  )
  stats = jax.device_get(stats_of(grads, format="float16"))
  assert all(as_float(s.nonfinite_fraction) > 0 for s in stats.values())  # every layer
  (culprit,) = diag.likely_culprits(stats, order=order)
  assert (culprit.name, culprit.problem) == ("params/alpha", "non-finite")
  assert "the cause is at or before the first layer run" in str(culprit)
