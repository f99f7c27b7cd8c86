"""One process of ``tests/test_multiprocess.py``; every process of the run executes this file.

Usage: ``python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT LOCAL_DEVICES WORKDIR``.

It joins a ``jax.distributed`` run on CPU (coordinator on ``localhost:PORT``), trains a
data-parallel step with ``jl.loss_scaling`` over a mesh of every process's devices, puts an inf
in the last process's rows of one batch, saves and restores the whole training state with Orbax
(the recipe of docs/checkpointing.md) and runs the next step. What it saw goes to
``WORKDIR/result_PROCESS_ID.json``, which the test compares across processes. Exit status
``CANNOT_RUN`` (with the reason on stdout) means this jaxlib has no CPU collectives for several
processes; any other failure is an error.
"""

import hashlib
import json
import os
import sys

CANNOT_RUN = 77
INITIAL_SCALE = 2.0**10


def _digest(tree) -> str:
  """Hash of every leaf's bytes as this process holds them (its addressable shards)."""
  import jax
  import numpy as np

  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    for shard in sorted(leaf.addressable_shards, key=lambda s: s.device.id):
      h.update(np.asarray(shard.data).tobytes())
  return h.hexdigest()


def _differences(a, b) -> list[str]:
  """Where two pytrees differ: structure, sharding or bits (shard by shard); [] if nowhere."""
  import jax
  import numpy as np

  if jax.tree.structure(a) != jax.tree.structure(b):
    return [f"structure: {jax.tree.structure(a)} != {jax.tree.structure(b)}"]
  found = []
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
    name = jax.tree_util.keystr(path)
    if not x.sharding.is_equivalent_to(y.sharding, x.ndim):
      found.append(f"{name}: sharding {x.sharding} != {y.sharding}")
      continue
    xs = sorted(x.addressable_shards, key=lambda s: s.device.id)
    ys = sorted(y.addressable_shards, key=lambda s: s.device.id)
    data = [(np.asarray(s.data), np.asarray(t.data)) for s, t in zip(xs, ys, strict=True)]
    if x.dtype != y.dtype or any(u.tobytes() != v.tobytes() for u, v in data):
      found.append(f"{name}: {x.dtype} {data[0][0]} != {y.dtype} {data[0][1]}")
  return found


def main(process_id: int, num_processes: int, port: int, local_devices: int, workdir: str):
  os.environ["JAX_PLATFORMS"] = "cpu"
  # Values, not speed, are checked: XLA:CPU's backend optimizations off, as in tests/conftest.py.
  os.environ["XLA_FLAGS"] = (
    f"--xla_force_host_platform_device_count={local_devices}"
    " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
  )
  import jax

  try:  # CPU collectives across processes; absent from old jaxlibs.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, ValueError) as e:
    print(f"jax.distributed on CPU needs gloo collectives: {e}")
    sys.exit(CANNOT_RUN)
  jax.distributed.initialize(
    f"localhost:{port}", num_processes, process_id, initialization_timeout=60
  )

  import jax.numpy as jnp
  import numpy as np
  import optax
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jmp_lite as jl

  n = jax.device_count()
  assert n == num_processes * local_devices, (n, num_processes, local_devices)
  mesh = jax.make_mesh((n,), ("data",))
  replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  policy = jl.get_policy("p=f32,c=f16,o=f32")

  def loss_fn(params, x, y):
    pred = policy.cast_to_compute(x) @ policy.cast_to_compute(params["w"])
    pred = pred + policy.cast_to_compute(params["b"])
    return jnp.mean((policy.cast_to_output(pred) - y) ** 2)

  def make_tx():
    return jl.loss_scaling(optax.adam(1e-2), jl.DynamicLossScale(jnp.float32(INITIAL_SCALE)))

  tx = make_tx()

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # The same host data in every process; each contributes its own rows of the batch.
  rng = np.random.default_rng(0)
  host_params = {
    "w": rng.normal(size=(4, 3)).astype(np.float32),
    "b": rng.normal(size=3).astype(np.float32),
  }
  rows = 2 * n
  x_host = rng.normal(size=(rows, 4)).astype(np.float32)
  y_host = rng.normal(size=(rows, 3)).astype(np.float32)
  x_bad_host = x_host.copy()
  x_bad_host[-1, 0] = np.inf  # the last row: the last process's rows only
  mine = slice(process_id * rows // num_processes, (process_id + 1) * rows // num_processes)

  def global_batch(a):
    return jax.make_array_from_process_local_data(batch, a[mine])

  x, x_bad, y = global_batch(x_host), global_batch(x_bad_host), global_batch(y_host)

  params0 = jax.device_put(host_params, replicated)
  params1, opt_state1, loss1 = train_step(params0, tx.init(params0), x, y)
  state1 = jl.get_loss_scaling_state(opt_state1)

  # Reference for the first step: one local device, the whole batch.
  local = jax.local_devices()[0]
  ref_params = jax.device_put(host_params, local)
  ref = train_step(
    ref_params, tx.init(ref_params), jax.device_put(x_host, local), jax.device_put(y_host, local)
  )
  first_matches = bool(
    np.allclose(ref[2], np.asarray(loss1.addressable_data(0)), rtol=1e-3)
    and all(
      np.allclose(r, np.asarray(p.addressable_data(0)), rtol=0, atol=1e-5)
      for r, p in zip(jax.tree.leaves(ref[0]), jax.tree.leaves(params1), strict=True)
    )
  )

  params2, opt_state2, _ = train_step(params1, opt_state1, x_bad, y)
  state2 = jl.get_loss_scaling_state(opt_state2)

  # Orbax round trip of the whole training state, as in docs/checkpointing.md.
  path = os.path.join(workdir, "checkpoint", "step_2")
  saved = {"params": params2, "opt_state": opt_state2}
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(path, saved)

  def on_mesh(tree):
    def leaf(x):
      sharding = x.sharding if isinstance(x.sharding, NamedSharding) else replicated
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)

  fresh = jax.device_put(jax.tree.map(np.zeros_like, host_params), replicated)
  target = {"params": fresh, "opt_state": make_tx().init(fresh)}  # as a new run builds it
  with ocp.StandardCheckpointer() as ckpt:
    restored = ckpt.restore(path, on_mesh(target))

  resumed = train_step(restored["params"], restored["opt_state"], x, y)
  uninterrupted = train_step(params2, opt_state2, x, y)

  result = {
    "process_id": process_id,
    "devices": n,
    "local_rows_finite": bool(np.isfinite(x_bad_host[mine]).all()),
    "first_finite": bool(state1.last_finite.addressable_data(0)),
    "first_scale": float(state1.loss_scale.loss_scale.addressable_data(0)),
    "first_matches_reference": first_matches,
    "skip_finite": bool(state2.last_finite.addressable_data(0)),
    "skip_scale": float(state2.loss_scale.loss_scale.addressable_data(0)),
    "skipped_steps": int(state2.skipped_steps.addressable_data(0)),
    "skip_changed": _differences(params2, params1),
    "state_digest": _digest(saved),
    "restored_differences": _differences(restored, saved),
    "restored_all_on_mesh": all(
      isinstance(a.sharding, NamedSharding) and a.sharding.mesh == mesh
      for a in jax.tree.leaves(restored)
    ),
    "resumed_differences": _differences(resumed, uninterrupted),
    "resumed_digest": _digest(resumed),
  }
  with open(os.path.join(workdir, f"result_{process_id}.json"), "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  pid, count, port, devices = (int(a) for a in sys.argv[1:5])
  main(pid, count, port, devices, sys.argv[5])
