"""jmp_lite._tree_util.register_dataclass: pytree roles declared on the dataclass fields."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_lite import _compat, _tree_util
from jmp_lite._tree_util import DERIVED, STATIC

POST_INITS = []


def _rebuild(obj):
  object.__setattr__(obj, "label", f"{obj.name}x{obj.count}")


@dataclasses.dataclass(frozen=True)
class Example:
  value: jax.Array
  name: str = dataclasses.field(default="a", metadata=STATIC)
  label: str = dataclasses.field(default="", init=False, metadata=DERIVED)
  count: int = dataclasses.field(default=2, metadata=STATIC)
  _: dataclasses.KW_ONLY
  extra: jax.Array = 0.0  # type: ignore[assignment]

  def __post_init__(self):
    POST_INITS.append(self)
    if float(jnp.sum(self.value)) < 0:  # a host read: fails on a tracer
      raise ValueError("value must be non-negative")
    object.__setattr__(self, "value", jnp.asarray(self.value, jnp.float32))
    _rebuild(self)


_tree_util.register_dataclass(Example, rebuild=_rebuild)


def test_fields_take_their_roles_from_their_declarations():
  assert _tree_util.pytree_fields(Example) == (("value", "extra"), ("name", "count"), ("label",))
  obj = Example(jnp.ones(2), "b", 3, extra=jnp.float32(5))
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(obj)]
  assert paths == [".value", ".extra"]
  treedef = jax.tree.structure(obj)
  assert treedef == jax.tree.structure(Example(jnp.zeros(2), "b", 3))
  assert treedef != jax.tree.structure(Example(jnp.ones(2), "c", 3))  # static: in the treedef
  assert treedef != jax.tree.structure(Example(jnp.ones(2), "b", 4))


def test_round_trip_with_tracers_skips_validation_and_rebuilds_derived_fields():
  obj = Example(jnp.ones(2), "b", 3, extra=jnp.float32(5))
  POST_INITS.clear()
  traced = []

  @jax.jit
  def negate(o):
    traced.append(o)
    return jax.tree.map(lambda x: -x, o)  # would fail validation: a tracer, and negative

  out = negate(obj)
  assert POST_INITS == []
  assert isinstance(traced[0].value, jax.core.Tracer)
  assert (traced[0].name, traced[0].count, traced[0].label) == ("b", 3, "bx3")
  np.testing.assert_array_equal(out.value, [-1.0, -1.0])
  assert float(out.extra) == -5.0
  assert (out.name, out.count, out.label) == ("b", 3, "bx3")
  # A placeholder of any kind goes in as is.
  leaves, treedef = jax.tree.flatten(obj)
  placeholders = [object() for _ in leaves]
  rebuilt = jax.tree.unflatten(treedef, placeholders)
  assert [rebuilt.value, rebuilt.extra] == placeholders and rebuilt.label == "bx3"
  assert POST_INITS == []


def test_a_change_of_static_field_retraces():
  f = jax.jit(lambda o: o.value * o.count)
  assert float(f(Example(jnp.ones(1), count=2))[0]) == 2.0
  assert float(f(Example(jnp.full(1, 3.0), count=2))[0]) == 6.0
  assert _compat.jit_cache_size(f) == 1
  assert float(f(Example(jnp.ones(1), count=5))[0]) == 5.0
  assert _compat.jit_cache_size(f) == 2


def test_registration_errors():
  @dataclasses.dataclass(frozen=True)
  class Derived:
    x: int = dataclasses.field(default=0, metadata=DERIVED)

  with pytest.raises(ValueError, match=r"derived fields \('x',\): give rebuild="):
    _tree_util.register_dataclass(Derived)
  with pytest.raises(TypeError, match="needs a dataclass"):
    _tree_util.register_dataclass(int)


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
