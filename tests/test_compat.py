"""Each entry of jmp_lite/_compat.py and jmp_lite/flax/_compat.py does what its callers rely on,
on the installed JAX and Flax (a release that changes one fails here, not somewhere inside)."""

import inspect
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jmp_lite import _compat
from jmp_lite.flax import _compat as flax_compat

F32 = jnp.float32


def _eqns(fn, *args):
  return jax.make_jaxpr(fn)(*args).jaxpr.eqns


def test_extend_core_types_the_parts_of_a_jaxpr():
  core = _compat.extend_core()
  closed = jax.make_jaxpr(jax.grad(lambda x: jnp.sin(x) + 2.0))(1.0)
  assert isinstance(closed, core.ClosedJaxpr) and isinstance(closed.jaxpr, core.Jaxpr)
  jaxpr = jax.make_jaxpr(lambda x: x + 2.0)(1.0).jaxpr
  (eqn,) = jaxpr.eqns
  assert isinstance(eqn.primitive, core.Primitive) and eqn.primitive.name == "add"
  assert [isinstance(v, core.Literal) for v in eqn.invars] == [False, True]
  assert eqn.invars[1].val == 2.0
  # The variable JAX writes for an output nothing reads (the walks skip it).
  dropped = core.DropVar(jax.typeof(jnp.float32(1.0)))
  assert (str(dropped), dropped.aval) == ("_", jax.typeof(jnp.float32(1.0)))
  assert not any(isinstance(v, core.DropVar) for v in eqn.outvars)


def test_primitive_names_are_jaxs():
  names = _compat.primitive_names()
  traced = {e.primitive.name for e in _eqns(lambda x: jnp.exp(x).sum() * (x @ x), jnp.ones(3))}
  assert traced == {"exp", "reduce_sum", "dot_general", "mul"}
  assert traced | {"convert_element_type", "cond", "scan", "while"} <= names
  assert "exp2x" not in names


@pytest.mark.parametrize("transform", [jax.jit, jax.vmap, jax.grad])
def test_is_tracer_is_true_under_a_transform_only(transform):
  seen = []

  def f(x):
    seen.append(_compat.is_tracer(x))
    return x.sum() if transform is jax.grad else x

  transform(f)(jnp.ones(3))
  assert seen == [True]
  assert [_compat.is_tracer(v) for v in (jnp.ones(3), np.ones(3), 1.0, "x", None)] == [False] * 5


def _replay(jaxpr, consts, args):
  """Evaluates a jaxpr by binding each equation again, as the autocast interpreter does."""
  env = dict(zip(jaxpr.constvars, consts, strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  core = _compat.extend_core()
  read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
  for eqn in jaxpr.eqns:
    outs = _compat.bind(eqn.primitive, eqn.params, *map(read, eqn.invars))
    env.update((v, o) for v, o in zip(eqn.outvars, outs, strict=True))
  return [read(v) for v in jaxpr.outvars]


def test_bind_replays_every_kind_of_equation():
  @jax.custom_vjp
  def clip_grad(x):
    return x

  clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))

  def f(x):
    y = jax.jit(lambda a: (jnp.sin(a), a * 3.0))(x)  # a call primitive, two results
    z = jax.nn.relu(y[0] - 0.25)  # custom_jvp_call
    s = jax.lax.scan(lambda c, a: (c + a, c * a), 0.0, x)  # a primitive of two results
    return clip_grad(z) * y[1], jax.lax.cumsum(s[1]), s[0]

  x = jnp.linspace(-1.0, 1.0, 5)
  closed = jax.make_jaxpr(f)(x)
  names = {e.primitive.name for e in closed.jaxpr.eqns}
  assert {"jit", "custom_jvp_call", "custom_vjp_call", "scan"} <= names
  got = _replay(closed.jaxpr, closed.consts, [x])
  for a, b in zip(got, jax.tree.leaves(f(x)), strict=True):
    np.testing.assert_array_equal(a, b)
  # The replayed custom rules are still the rules: the gradient is the clipped one.
  loss = lambda x: jnp.sum(_replay(closed.jaxpr, closed.consts, [x])[0] * 10.0)
  np.testing.assert_array_equal(jax.grad(loss)(x), jax.grad(lambda x: jnp.sum(f(x)[0] * 10.0))(x))
  (one,) = _compat.bind(jax.lax.exp_p, {"accuracy": None}, x)
  np.testing.assert_array_equal(one, jnp.exp(x))


def test_name_stacks_are_the_scopes_being_traced():
  assert str(_compat.new_name_stack()) == ""
  stacks = []

  def f(x):
    with jax.named_scope("outer"), jax.named_scope("inner"):
      stacks.append(str(_compat.current_name_stack()))
    return x

  jax.make_jaxpr(f)(1.0)
  assert stacks == ["outer/inner"]


def test_replaying_keeps_an_equations_scope_and_source_line():
  def f(x):
    with jax.named_scope("layer"):
      return jnp.sin(x)  # the line the replayed equation must name

  (eqn,) = _eqns(f, 1.0)
  line = inspect.getsourcelines(f)[1] + 2

  def replay(x):
    with jax.named_scope("model"):
      names = _compat.current_name_stack() + eqn.source_info.name_stack
      with _compat.replaying(eqn, names):
        return _compat.bind(eqn.primitive, eqn.params, x)[0]

  (again,) = _eqns(replay, 1.0)
  assert str(again.source_info.name_stack) == "model/layer"
  user = [fr for fr in again.source_info.traceback.frames if fr.file_name == __file__]
  assert [fr.line_num for fr in user][:1] == [line]


def _mesh():
  return jax.make_mesh((2,), ("i",), devices=jax.devices()[:2])


def test_varying_axes_and_shape_dtype_struct_under_shard_map():
  x = jnp.arange(8.0)
  assert _compat.varying_axes(x) == frozenset()
  spec = _compat.shape_dtype_struct(x)
  assert (spec.shape, spec.dtype, spec.sharding) == (x.shape, x.dtype, jax.typeof(x).sharding)
  seen = {}

  def body(sharded, replicated):
    seen["axes"] = _compat.varying_axes(sharded), _compat.varying_axes(replicated)
    spec = _compat.shape_dtype_struct(sharded)
    seen["spec"] = spec.shape, spec.dtype
    # What the flax kernels use it for: a transpose whose cotangent varies like its primal.
    (grad,) = jax.linear_transpose(lambda v: v * 2.0, spec)(sharded)
    return grad + replicated

  mesh = _mesh()
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("i")))
  out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i")))(
    sharded, 1.0
  )
  assert seen["axes"] == (frozenset({"i"}), frozenset())
  assert seen["spec"] == ((4,), np.dtype(F32))
  np.testing.assert_array_equal(out, 2.0 * x + 1.0)


def test_jax_file_layout():
  jax_root = os.path.dirname(os.path.realpath(jax.__file__))
  named = {*_compat.JAX_PLUMBING, _compat.JAX_AD, _compat.JAX_CUSTOM_RULES}
  assert [rel for rel in sorted(named) if not os.path.isfile(os.path.join(jax_root, rel))] == []
  lax_file = _compat.jax_file(inspect.getsourcefile(jax.lax.sin))
  assert lax_file is not None and _compat.is_jax_lax(lax_file)
  assert _compat.jax_file(inspect.getsourcefile(jax.grad)) in _compat.JAX_PLUMBING
  assert _compat.jax_file(__file__) is None
  assert _compat.is_jax_plumbing("_src/interpreters/batching.py")
  assert not _compat.is_jax_plumbing(_compat.JAX_AD) and not _compat.is_jax_lax(_compat.JAX_AD)


def test_a_derivative_rule_runs_from_jaxs_ad_file():
  # What the audit reads from a traceback: a derivative rule's operation has a frame in
  # JAX_AD between it and the user's call; a custom_jvp rule's, one in JAX_CUSTOM_RULES.
  (cos,) = [e for e in _eqns(jax.grad(jnp.sin), 1.0) if e.primitive.name == "cos"]
  files = [_compat.jax_file(fr.file_name) for fr in cos.source_info.traceback.frames]
  assert _compat.JAX_AD in files

  @jax.custom_jvp
  def f(x):
    return jnp.sin(x)

  f.defjvp(lambda primals, tangents: (f(*primals), jnp.tanh(primals[0]) * tangents[0]))
  (tanh,) = [e for e in _eqns(jax.grad(f), 1.0) if e.primitive.name == "tanh"]
  files = [_compat.jax_file(fr.file_name) for fr in tanh.source_info.traceback.frames]
  assert _compat.JAX_CUSTOM_RULES in files


def test_is_jax_nn_recognises_jax_nns_rules():
  def rule_file(fn):
    (eqn,) = [e for e in _eqns(fn, jnp.ones(4)) if e.primitive.name == "custom_jvp_call"]
    source = eqn.params["call_jaxpr"].jaxpr.debug_info.func_src_info
    return source.partition(" at ")[2]

  with jax.softmax_custom_jvp(True):  # autocast recognises softmax's rule under this flag
    assert _compat.is_jax_nn(rule_file(jax.nn.softmax))
  assert _compat.is_jax_nn(rule_file(jax.nn.relu))
  user = jax.custom_jvp(lambda x: jnp.sin(x))
  user.defjvp(lambda p, t: (jnp.sin(p[0]), t[0]))
  assert not _compat.is_jax_nn(rule_file(user))
  assert not _compat.is_jax_nn(inspect.getsourcefile(jax.lax.sin))


def test_is_graph_node_tells_nnx_objects_from_pytrees():
  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  nodes = [model, model.kernel, nnx.Rngs(0)]
  leaves = [jnp.ones(2), 1.0, [model], {"w": jnp.ones(2)}, None]
  assert [flax_compat.is_graph_node(x) for x in nodes] == [True] * 3
  assert [flax_compat.is_graph_node(x) for x in leaves] == [False] * 5
