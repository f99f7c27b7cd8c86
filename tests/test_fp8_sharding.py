"""fp8 on several devices (jmp_lite/fp8/_sharding.py): amax reductions, sharding, microsteps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jmp_lite import fp8

from .fp8_testing import (
  CONFIG,
  MATMUL,
  assert_close,
  init_mlp_state,
  mlp_data,
  mlp_init,
  mlp_loss,
  small_integers,
  unit_state,
)

# Multi-device and gradient accumulation ------------------------------------------------


def _mesh():
  devices = jax.devices()
  assert len(devices) == 8, "tests expect 8 host CPU devices; see tests/conftest.py"
  return jax.make_mesh((8,), ("data",), devices=devices)


@jax.jit
def full_batch_update(params, state, x, y):
  """The reference: one device, the whole batch, a sum loss (so shards add up)."""
  grads, amax = jax.grad(mlp_loss, argnums=(0, 2))(
    params, state, fp8.zeros_amax(state), x, y, reduce=jnp.sum
  )
  return grads, amax, fp8.update(state, amax, CONFIG)


@pytest.mark.parametrize("check_vma", [True, False])
def test_amax_is_max_reduced_across_devices_under_shard_map(check_vma):
  mesh = _mesh()
  params, (x, y) = mlp_init(), mlp_data(32)
  # Give each device a different input range, so max and sum differ.
  x = x * jnp.repeat(jnp.arange(1.0, 9.0), 4)[:, None]
  state = init_mlp_state(set_scales=True)
  ref_grads, _, ref_state = full_batch_update(params, state, x, y)

  def per_device(params, state, x, y):
    grads, amax = jax.grad(mlp_loss, argnums=(0, 2))(
      params, state, fp8.zeros_amax(state), x, y, reduce=jnp.sum
    )
    if not check_vma:  # untyped: local gradients and observations, reduced by hand
      grads = jax.lax.psum(grads, "data")
    # With check_vma, JAX sums the gradients of replicated parameters itself and the
    # fp8 matmul max-reduces the observations of a replicated probe; axis_name is then
    # a no-op, and needed without it.
    new_state = fp8.update(state, amax, CONFIG, axis_name="data")
    return grads, new_state, fp8.compute_amax(x)[None]

  rep, data = PartitionSpec(), PartitionSpec("data")
  x, y = (jax.device_put(t, NamedSharding(mesh, data)) for t in (x, y))
  f = jax.jit(
    jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(rep, rep, data, data),
      out_specs=(rep, rep, data),
      check_vma=check_vma,
    )
  )
  grads, new_state, local_amax = f(params, state, x, y)
  # Each device saw its own shard; the state took the max over them, not the sum.
  np.testing.assert_array_equal(local_amax, jnp.abs(x).reshape(8, 4, 8).max(axis=(1, 2)))
  assert float(new_state["l1"].input.amax_history[0]) == float(local_amax.max())
  assert float(local_amax.sum()) > 2 * float(local_amax.max())
  assert_close(new_state, ref_state, rtol=1e-6)  # matmuls of other shapes may round differently
  assert_close(grads, ref_grads, rtol=1e-5)


def test_amax_is_global_under_sharded_jit():
  mesh = _mesh()
  params, (x, y) = mlp_init(), mlp_data(32)
  x = x * jnp.repeat(jnp.arange(1.0, 9.0), 4)[:, None]
  state = init_mlp_state(set_scales=True)
  _, _, ref_state = full_batch_update(params, state, x, y)
  sharding = NamedSharding(mesh, PartitionSpec("data"))
  xs, ys = jax.device_put(x, sharding), jax.device_put(y, sharding)
  with jax.set_mesh(mesh):  # explicit sharding: the mesh the transposed matmuls live on
    _, _, new_state = full_batch_update(params, state, xs, ys)
  assert_close(new_state, ref_state, rtol=1e-6)
  assert float(new_state["l1"].input.amax_history[0]) == float(jnp.abs(x).max())


def test_out_sharding_under_explicit_sharding():
  mesh = _mesh()
  state = unit_state()
  x = jax.device_put(small_integers((16, 4), 9, 3), NamedSharding(mesh, PartitionSpec("data")))
  k = small_integers((4, 3), 10, 3)
  with jax.set_mesh(mesh):

    @jax.jit
    def run(x, k):
      y = fp8.dot_general(x, k, MATMUL, state, out_sharding=PartitionSpec("data", None))
      # A transposed output: the matmul's result is resharded to the requested layout.
      z_fn = lambda x, k: fp8.einsum(
        "bd,df->fb", x, k, state, out_sharding=PartitionSpec(None, "data")
      )
      return y, z_fn(x, k), jax.grad(lambda x, k: z_fn(x, k).sum(), (0, 1))(x, k)

    y, z, (dx, dk) = run(x, k)
  assert y.sharding.spec == PartitionSpec("data", None)
  assert z.sharding.spec == PartitionSpec(None, "data")
  assert dx.sharding.spec == PartitionSpec("data", None)  # cotangents sharded like primals
  np.testing.assert_array_equal(y, x @ k)
  np.testing.assert_array_equal(z, (x @ k).T)
  np.testing.assert_array_equal(dk, jnp.broadcast_to(x.sum(0)[:, None], (4, 3)))


def test_amax_is_max_combined_across_microsteps():
  params, (x, y) = mlp_init(), mlp_data(32)
  x = x * jnp.repeat(jnp.arange(1.0, 5.0), 8)[:, None]
  state = init_mlp_state(set_scales=True)
  ref_grads, ref_amax, ref_state = full_batch_update(params, state, x, y)

  @jax.jit
  def accumulate(params, state, x, y):
    def microstep(carry, batch):
      grads, amax = carry
      g, a = jax.grad(mlp_loss, argnums=(0, 2))(
        params, state, fp8.zeros_amax(state), *batch, reduce=jnp.sum
      )
      return (jax.tree.map(jnp.add, grads, g), fp8.combine_amax(amax, a)), None

    zeros = (jax.tree.map(jnp.zeros_like, params), fp8.zeros_amax(state))
    batches = (x.reshape(4, 8, 8), y.reshape(4, 8, 4))
    (grads, amax), _ = jax.lax.scan(microstep, zeros, batches)
    return grads, amax, fp8.update(state, amax, CONFIG)

  grads, amax, new_state = accumulate(params, state, x, y)
  assert float(amax["l1"].input) == float(ref_amax["l1"].input) == float(jnp.abs(x).max())
  assert_close(amax, ref_amax, rtol=1e-6)
  assert_close(new_state, ref_state, rtol=1e-6)
  assert_close(grads, ref_grads, rtol=1e-5)
  # An overflowed microstep wins the max and is then dropped by update.
  bad = fp8.combine_amax(amax, jax.tree.map(lambda a: a * jnp.inf, amax))
  assert np.isinf(bad["l1"].output_grad)
  assert_close(fp8.update(state, bad, CONFIG)["l1"].output_grad, state["l1"].output_grad, rtol=0)
