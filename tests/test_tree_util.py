"""jmp_lite._tree_util: the tree helpers shared by the loss scales and the Flax wrappers."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_lite import _tree_util


def test_copy_arrays_gives_buffers_of_their_own_and_keeps_everything_else():
  mesh = jax.make_mesh((8,), ("data",))
  sharded = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("data")))
  tree = {
    "sharded": sharded,
    "weak": jnp.asarray(2.0),  # weakly typed
    "half": jnp.ones(3, jnp.bfloat16),
    "key": jax.random.key(0),
    "host": np.ones(2, np.float32),
    "static": "kept",
  }
  copied = _tree_util.copy_arrays(tree)
  assert copied["host"] is tree["host"] and copied["static"] == "kept"
  for name in ("sharded", "weak", "half", "key"):
    a, b = tree[name], copied[name]
    assert b is not a and (b.dtype, b.sharding) == (a.dtype, a.sharding)
    assert jax.typeof(b).weak_type == jax.typeof(a).weak_type == (name == "weak")
    data = jax.random.key_data if name == "key" else np.asarray
    np.testing.assert_array_equal(data(b), data(a))
  # Its own buffers: deleting the original leaves the copy intact.
  tree["sharded"].delete()
  np.testing.assert_array_equal(copied["sharded"], np.arange(16.0))
  # Traceable, so an init under jit or eval_shape can use it.
  shapes = jax.eval_shape(_tree_util.copy_arrays, copied["half"])
  assert (shapes.shape, shapes.dtype) == ((3,), jnp.bfloat16)
