"""jl.autocast's per-class overrides: Equinox module classes (``modules=``), Haiku modules
(``scopes=`` on Haiku's module names), and jmp_lite policies in Haiku's own per-class policies.

Each test asserts the op dtypes of the rewritten program (a census by name scope) and compares
outputs and gradients with a hand-written version that applies the same dtypes by casts.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jl
from jmp_lite import _jaxpr

eqx = pytest.importorskip("equinox")
hk = pytest.importorskip("haiku")

POLICY = jl.get_policy("params=float32,compute=bfloat16,output=float32")
BF16, F32 = jnp.bfloat16, jnp.float32


def census_by_scope(closed, primitives=None) -> dict[tuple[str, str], set[str]]:
  """(name stack, primitive) -> the dtypes of its floating operands, casts aside."""
  found = collections.defaultdict(set)

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      for sub in _jaxpr.sub_jaxprs(eqn):
        visit(sub.jaxpr)
      name = eqn.primitive.name
      if name == "convert_element_type" or (primitives is not None and name not in primitives):
        continue
      scope = str(eqn.source_info.name_stack)
      for atom in eqn.invars:
        dtype = _jaxpr.dtype_of(atom)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
          found[scope, name].add(dtype.name)

  visit(closed.jaxpr)
  return dict(found)


def dtypes_where(found, scope_part, primitive=None) -> set[str]:
  """The operand dtypes of the equations whose innermost scope ends with ``scope_part``."""
  out = set()
  for (scope, name), dtypes in found.items():
    if scope.endswith(scope_part) and primitive in (None, name):
      out |= dtypes
  return out


# Name-scope overrides on plain JAX.


def _in_scope(name, fn):
  def scoped(*args):
    with jax.named_scope(name):
      return fn(*args)

  return scoped


def test_scoped_matmul_returns_the_scope_dtype():
  w = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3) / 3
  x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4) / 7
  # jnp.matmul states its result dtype (bf16 in the program): an fp32 scope returns fp32.
  f = jl.autocast(_in_scope("head", jnp.matmul), POLICY, scopes={"head": "float32"})
  found = census_by_scope(jax.make_jaxpr(f)(x, w), ("dot_general",))
  assert found == {("head", "dot_general"): {"float32"}}
  np.testing.assert_allclose(f(x, w), x @ w, rtol=1e-6)


def test_scoped_reduction_reads_the_unrounded_argument():
  x = jnp.linspace(0.0, 1.0, 24) / 3  # most values not exact in bf16
  # JAX's mean of a bf16 array casts it to fp32 first: in an fp32 scope that cast reads the
  # fp32 argument, and the mean's result is not rounded to bf16 for an fp32 output.
  f = jl.autocast(_in_scope("stats", jnp.mean), POLICY, scopes={"stats": "float32"})
  np.testing.assert_allclose(f(x), np.mean(np.asarray(x, np.float64)), rtol=1e-6)
  g = jl.autocast(_in_scope("stats", lambda a: jnp.mean(a) * a), POLICY, scopes={"stats": "f32"})
  np.testing.assert_allclose(g(x), jnp.mean(x) * x, rtol=1e-6)


# Equinox module classes.


class RMSNorm(eqx.Module):
  """A hand-written norm: its operations run in the dtype of its input."""

  scale: jax.Array

  def __init__(self, d):
    self.scale = 1 + 0.1 * jnp.sin(jnp.arange(d, dtype=F32))

  def __call__(self, x):
    # An epsilon exact in bf16: the program's Python scalars are traced at its 16-bit dtype.
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 2.0**-20) * self.scale


class Block(eqx.Module):
  norm: RMSNorm
  linear: eqx.nn.Linear

  def __init__(self, key):
    self.norm = RMSNorm(8)
    self.linear = eqx.nn.Linear(8, 8, key=key)

  def __call__(self, x):
    return jnp.tanh(self.linear(self.norm(x)))

  def project(self, x):
    return self.linear(x)


class Model(eqx.Module):
  blocks: list
  head: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, 3)
    self.blocks = [Block(keys[0]), Block(keys[1])]
    self.head = eqx.nn.Linear(8, 4, key=keys[2])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def model_and_input():
  return Model(jax.random.key(0)), jnp.linspace(-2.0, 2.0, 8)


def narrow(module):
  return POLICY.cast_to_compute(module)


def reference(model, x):
  """The norms in fp32 (from the fp32 input where the model is given one), the rest bf16."""
  for block in model.blocks:
    h = block.norm(x.astype(F32)).astype(BF16)
    x = jnp.tanh(narrow(block.linear)(h))
  return narrow(model.head)(x).astype(F32)


NORM = "RMSNorm=float32]"


def test_equinox_module_class_runs_in_its_dtype():
  model, x = model_and_input()
  f = jl.autocast(lambda m, x: m(x), POLICY, modules={RMSNorm: "float32"})
  found = census_by_scope(jax.make_jaxpr(f)(model, x))
  # Every floating operation of the norms reads fp32 operands; the matmuls read bf16 ones.
  assert dtypes_where(found, NORM) == {"float32"}
  assert dtypes_where(found, NORM, "mul") == {"float32"}
  assert dtypes_where(found, "eqx.nn.Linear") == {"bfloat16"}
  # Without the override the norm's elementwise operations run in the program's bf16.
  plain = census_by_scope(jax.make_jaxpr(jl.autocast(lambda m, x: m(x), POLICY))(model, x))
  assert set().union(*(d for (_, p), d in plain.items() if p == "mul")) == {"bfloat16"}
  out = jax.jit(f)(model, x)
  np.testing.assert_allclose(out, jax.jit(reference)(model, x), rtol=1e-6, atol=1e-6)


def test_equinox_gradients_have_the_model_class_and_match_the_reference():
  model, x = model_and_input()
  f = jl.autocast(lambda m, x: m(x), POLICY, modules={RMSNorm: "float32"})
  grads = jax.jit(jax.grad(lambda m: f(m, x).sum()))(model)
  # No scoped view leaks into the gradient: it is a Model of RMSNorms and Linears.
  assert type(grads) is Model and type(grads.blocks[0].norm) is RMSNorm
  assert jax.tree.structure(grads) == jax.tree.structure(model)
  want = jax.jit(jax.grad(lambda m: reference(m, x).sum()))(model)
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    assert got.dtype == F32
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-3)


def test_innermost_class_wins_and_subclasses_match():
  model, x = model_and_input()
  modules = {Block: "float32", RMSNorm: BF16, Model: "float16"}
  found = census_by_scope(jax.make_jaxpr(jl.autocast(model, POLICY, modules=modules))(x))
  # The norm inside a float32 Block runs in bf16 (rsqrt included), the Block's own matmul in
  # fp32, the head (the Model's own) in fp16; the function itself was the Model instance.
  assert dtypes_where(found, "RMSNorm=bfloat16]", "rsqrt") == {"bfloat16"}
  assert dtypes_where(found, "Block=float32]/eqx.nn.Linear", "dot_general") == {"float32"}
  assert dtypes_where(found, "Model=float16]/eqx.nn.Linear", "dot_general") == {"float16"}

  class Wide(Block):
    pass

  class Narrow(Wide):
    pass

  sub = Narrow(jax.random.key(1))
  # The most specific named class of the instance decides.
  for modules, want in (({Block: "float32"}, "float32"), ({Block: F32, Wide: BF16}, "bfloat16")):
    fn = jl.autocast(lambda b, x: b(x), POLICY, modules=modules)
    found = census_by_scope(jax.make_jaxpr(fn)(sub, x), ("tanh",))
    assert set().union(*found.values()) == {want}, modules


def test_methods_run_in_the_class_dtype_and_outputs_keep_the_class():
  model, x = model_and_input()
  fn = jl.autocast(lambda m, x: (m.blocks[0].project(x), m), POLICY, modules={Block: "float32"})
  out, same = fn(model, x)
  assert type(same) is Model and type(same.blocks[0]) is Block
  assert jax.tree.structure(same) == jax.tree.structure(model)
  found = census_by_scope(jax.make_jaxpr(fn)(model, x), ("dot_general",))
  assert set().union(*found.values()) == {"float32"}
  linear = model.blocks[0].linear
  np.testing.assert_allclose(out, linear.weight @ x + linear.bias, rtol=1e-6)


def test_named_instances_keep_their_class_for_isinstance():
  # Equinox's Sequential passes the state to the layers that are StatefulLayers.
  seq = eqx.nn.Sequential(
    [eqx.nn.Linear(4, 4, key=jax.random.key(0)), eqx.nn.BatchNorm(4, "b", mode="batch")]
  )
  model, state = eqx.nn.make_with_state(lambda: seq)()
  call = lambda m, s, x: jax.vmap(m, (0, None), (0, None), axis_name="b")(x, s)
  x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
  fn = jl.autocast(call, POLICY, modules={eqx.nn.BatchNorm: "float32"})
  out, new_state = fn(model, state, x)
  assert type(new_state) is eqx.nn.State
  found = census_by_scope(jax.make_jaxpr(lambda x: fn(model, state, x))(x), ("rsqrt", "mul"))
  assert set().union(*found.values()) == {"float32"}
  # The reference: the Linear in bf16, the BatchNorm on its output in fp32.
  h = jax.vmap(narrow(model[0]))(x.astype(BF16)).astype(F32)
  want, _ = jax.vmap(model[1], (0, None), (0, None), axis_name="b")(h, state)
  np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)


def test_scopes_win_over_module_classes():
  model, x = model_and_input()
  fn = jl.autocast(
    lambda m, x: m(x), POLICY, modules={Block: "float32"}, scopes={r"eqx\.nn\.Linear$": "bf16"}
  )
  found = census_by_scope(jax.make_jaxpr(fn)(model, x))
  assert dtypes_where(found, "Block=float32]/eqx.nn.Linear") == {"bfloat16"}
  assert dtypes_where(found, NORM.replace("RMSNorm", "Block")) == {"float32"}  # tanh


def test_a_module_as_the_function_has_its_parameters_cast_as_arguments():
  model, x = model_and_input()
  # Its parameters are the program's bf16 inputs, not fp32 constants promoting what they touch.
  found = census_by_scope(jax.make_jaxpr(jl.autocast(model, POLICY))(x), ("add", "tanh"))
  assert set().union(*found.values()) == {"bfloat16"}
  as_argument = jax.jit(jl.autocast(lambda m, x: m(x), POLICY))(model, x)
  np.testing.assert_array_equal(jax.jit(jl.autocast(model, POLICY))(x), as_argument)
  grads = jax.grad(lambda m: jl.autocast(m, POLICY)(x).sum())(model)
  want = jax.grad(lambda m: jl.autocast(lambda m, x: m(x), POLICY)(m, x).sum())(model)
  assert jax.tree.structure(grads) == jax.tree.structure(model)
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(got, ref)


def test_a_class_with_no_instance_warns_naming_it():
  model, x = model_and_input()
  fn = jl.autocast(lambda m, x: m(x), POLICY, modules={eqx.nn.GroupNorm: "float32"})
  with pytest.warns(UserWarning, match=r"no instance of equinox\..*GroupNorm"):
    out = fn(model, x)
  np.testing.assert_array_equal(out, jl.autocast(lambda m, x: m(x), POLICY)(model, x))


@pytest.mark.parametrize(
  ("modules", "error", "match"),
  [
    ({"LayerNorm": "float32"}, TypeError, r"keys are module classes.*'LayerNorm'"),
    ({eqx.nn.LayerNorm: "float31"}, ValueError, r"modules\[LayerNorm\].*float31"),
    ({eqx.nn.LayerNorm: jnp.int32}, TypeError, r"modules\[LayerNorm\]"),
    ([eqx.nn.LayerNorm], TypeError, "modules must map module classes to dtypes"),
  ],
)
def test_bad_modules_raise_naming_the_part(modules, error, match):
  with pytest.raises(error, match=match):
    jl.autocast(jnp.exp, POLICY, modules=modules)


# Haiku.


def haiku_net(x):
  h = hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)
  return hk.nets.MLP([16, 4])(h)


def haiku_params():
  net = hk.without_apply_rng(hk.transform(haiku_net))
  x = jnp.linspace(-2.0, 2.0, 24).reshape(3, 8)
  params = net.init(jax.random.key(0), x)
  params = jax.tree.map(lambda a: a + 0.1 * jnp.cos(jnp.arange(a.size).reshape(a.shape)), params)
  return net, params, x


def _haiku_with_policies(policies, make):
  """``haiku_net`` transformed with Haiku's per-class policies, each made by ``make``."""

  def run(fn, *args):
    with hk.mixed_precision.push_policy(hk.LayerNorm, make(policies["norm"])):
      with hk.mixed_precision.push_policy(hk.nets.MLP, make(policies["mlp"])):
        return fn(*args)

  return run


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_haiku_per_class_policies_take_a_jmp_lite_policy_as_jmp_does(params_dtype):
  jmp = pytest.importorskip("jmp")
  policies = {
    "norm": "params=float32,compute=float32,output=bfloat16",
    "mlp": f"params={params_dtype},compute=bfloat16,output=float32",
  }
  net, _, x = haiku_params()
  results = {}
  for name, make in (("jmp_lite", jl.get_policy), ("jmp", jmp.get_policy)):
    run = _haiku_with_policies(policies, make)
    params = run(net.init, jax.random.key(0), x)
    out = run(net.apply, params, x)
    grads = run(jax.grad(lambda p, x: net.apply(p, x).sum()), params, x)
    results[name] = (params, out, grads)
  for got, want in zip(*map(jax.tree.leaves, results.values()), strict=True):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
  params, out, grads = results["jmp_lite"]
  assert out.dtype == F32
  assert params["mlp/~/linear_0"]["w"].dtype == np.dtype(params_dtype)
  assert params["layer_norm"]["scale"].dtype == F32


def test_haiku_module_names_in_scopes_pick_their_dtype():
  net, params, x = haiku_params()
  scopes = {r"(^|/)layer_norm(/|$)": "float32"}
  fn = jl.autocast(net.apply, POLICY, scopes=scopes)
  found = census_by_scope(jax.make_jaxpr(fn)(params, x))
  assert dtypes_where(found, "layer_norm") == {"float32"}
  assert dtypes_where(found, "layer_norm", "mul") == {"float32"}
  assert dtypes_where(found, "mlp/linear_0", "dot_general") == {"bfloat16"}
  assert dtypes_where(found, "mlp/linear_1", "dot_general") == {"bfloat16"}
  # The same dtypes, by Haiku's per-class policies: the norm in fp32 with a bf16 output, the
  # MLP (relu and matmuls) in bf16.
  jmp_like = _haiku_with_policies(
    {
      "norm": "params=float32,compute=float32,output=bfloat16",
      "mlp": "params=float32,compute=bfloat16,output=float32",
    },
    jl.get_policy,
  )
  want = jmp_like(jax.jit(net.apply), params, x)
  np.testing.assert_allclose(jax.jit(fn)(params, x), want, rtol=1e-6, atol=1e-6)
  grads = jax.jit(jax.grad(lambda p: fn(p, x).sum()))(params)
  want_grads = jmp_like(jax.jit(jax.grad(lambda p: net.apply(p, x).sum())), params)
  for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
    assert got.dtype == F32
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-3)
