"""jl.autocast and jl.full_precision (jmp_lite/_autocast/_api.py): arguments and their
errors, non-floating leaves, transformations of the autocast function, full_precision and
name-scope patterns."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jl
from jmp_lite import _jaxpr

from .autocast_testing import (
  BF16,
  F32,
  POLICY,
  block,
  block_params,
  census,
  rel_err,
)


def test_non_floating_leaves_pass_through():
  def f(x, n, flag):
    return {"y": x * n, "n": n + 1, "flag": flag, "key": jax.random.key(0)}

  out = jl.autocast(f, POLICY)(jnp.ones(3), jnp.arange(3), "static")
  assert out["y"].dtype == F32 and out["n"].dtype == jnp.int32 and out["flag"] == "static"
  np.testing.assert_array_equal(out["n"], [1, 2, 3])
  assert jax.dtypes.issubdtype(out["key"].dtype, jax.dtypes.prng_key)


@pytest.mark.parametrize(
  ("kwargs", "error", "match"),
  [
    ({"policy": "params=float32,compute=bfloat17"}, ValueError, "bfloat17"),
    ({"policy": "prams=float32"}, ValueError, "prams"),
    ({"policy": 3}, TypeError, "policy must be"),
    ({"overrides": {"exp": "fp32"}}, ValueError, r"overrides\['exp'\] = 'fp32'"),
    ({"table": ["exp"]}, TypeError, "table must be a mapping"),
    ({"scopes": {"(": "float32"}}, ValueError, "not a regular expression"),
    ({"scopes": {"head": "float31"}}, ValueError, r"scopes\['head'\]: .*float31"),
    ({"scopes": ["head"]}, TypeError, "scopes must map name-scope patterns to dtypes"),
  ],
)
def test_bad_arguments_raise_naming_the_part(kwargs, error, match):
  kwargs = {"policy": POLICY, **kwargs}
  with pytest.raises(error, match=match):
    jl.autocast(jnp.exp, kwargs.pop("policy"), **kwargs)


def test_jit_grad_vmap_and_traced_once():
  params, x = block_params(d=8), jax.random.normal(jax.random.key(1), (4, 8))
  traces = []

  def counted(p, x):
    traces.append(1)
    return block(p, x)

  loss = lambda p, x: jl.autocast(counted, POLICY)(p, x).sum()
  step = jax.jit(jax.grad(loss))
  grads = step(params, x)
  step(params, x + 1)
  assert len(traces) == 1  # traced once; the second call reuses the compiled step
  assert all(g.dtype == F32 for g in jax.tree.leaves(grads))
  want = jax.jit(jax.grad(lambda p, x: block(p, x).sum()))(params, x)
  for name in grads:
    assert rel_err(grads[name], want[name]) < 0.03, name
  # grad of autocast and autocast inside grad agree.
  inside = jax.jit(jax.grad(lambda p: jl.autocast(block, POLICY)(p, x).sum()))(params)
  for name in grads:
    np.testing.assert_allclose(inside[name], grads[name], rtol=1e-6, atol=1e-6)
  # Parameters closed over are constants of the program, in their own (fp32) dtype: their
  # matmuls still take bf16 operands.
  closure = jax.jit(jax.grad(lambda p: jl.autocast(lambda x: block(p, x), POLICY)(x).sum()))(params)
  for name in grads:
    assert closure[name].dtype == F32 and rel_err(closure[name], want[name]) < 0.03, name
  batched = jax.jit(jax.vmap(jl.autocast(block, POLICY), (None, 0)))(params, x[None])
  np.testing.assert_allclose(batched[0], jax.jit(jl.autocast(block, POLICY))(params, x), rtol=1e-6)


def test_autocast_of_grad_rewrites_the_backward_pass():
  params, x = block_params(d=8), jax.random.normal(jax.random.key(1), (4, 8))
  loss = lambda p, x: block(p, x).sum()
  outer = census(jax.make_jaxpr(jax.grad(jl.autocast(loss, POLICY)))(params, x))
  assert outer["reduce_sum"] == {"bfloat16", "float32"}  # JAX's bf16 sums in the backward pass
  inner = census(jax.make_jaxpr(jl.autocast(jax.grad(loss), POLICY))(params, x))
  assert inner["reduce_sum"] == {"float32"} and inner["dot_general"] == {"bfloat16"}
  grads = jax.jit(jl.autocast(jax.grad(loss), POLICY))(params, x)
  want = jax.jit(jax.grad(loss))(params, x)
  for name in grads:
    assert grads[name].dtype == F32 and rel_err(grads[name], want[name]) < 0.03, name


def test_full_precision_returns_the_dtype_it_was_given():
  x = jnp.linspace(0.1, 0.9, 8).astype(jnp.bfloat16)
  got = jl.full_precision(lambda a: {"y": jnp.exp(a) * 3, "n": jnp.arange(2)})(x)
  assert got["y"].dtype == BF16 and got["n"].dtype == jnp.int32
  np.testing.assert_array_equal(got["y"], (jnp.exp(x.astype(F32)) * 3).astype(jnp.bfloat16))
  assert jl.full_precision(jnp.exp)(jnp.ones(2, jnp.float16)).dtype == jnp.float16
  # The gradient keeps the argument's dtype too.
  assert jax.grad(lambda a: jl.full_precision(jnp.exp)(a).sum().astype(F32))(x).dtype == BF16


def test_full_precision_inside_autocast_runs_in_fp32():
  w, x = jnp.full((4, 3), 0.25), jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)

  def f(w, x):
    h = x @ w
    return jl.full_precision(lambda h, w2: jnp.tanh(h) @ w2)(h, w.T)

  closed = jax.make_jaxpr(jl.autocast(f, POLICY))(w, x)
  dots = [e for e in closed.jaxpr.eqns if e.primitive.name == "dot_general"]
  operands = [[_jaxpr.dtype_of(v).name for v in e.invars] for e in dots]
  assert operands == [["bfloat16", "bfloat16"], ["float32", "float32"]]
  assert census(closed)["tanh"] == {"float32"}
  h = (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(F32)
  want = (jnp.tanh(h) @ w.T.astype(jnp.bfloat16).astype(F32)).astype(jnp.bfloat16)
  np.testing.assert_array_equal(jl.autocast(f, POLICY)(w, x), want.astype(F32))


def test_scope_patterns_pick_the_dtype_of_flax_module_paths():
  import flax.linen as nn

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = jnp.tanh(nn.Dense(4)(x))
      return nn.Dense(2, name="head")(x)

  model, x = Model(), jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
  params = jax.jit(model.init)(jax.random.key(0), x)
  fn = jl.autocast(model.apply, POLICY, scopes={r"/head$": "float32"})
  by_scope = collections.defaultdict(set)
  for eqn in jax.make_jaxpr(fn)(params, x).jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      by_scope[str(eqn.source_info.name_stack)] |= {_jaxpr.dtype_of(v).name for v in eqn.invars}
  assert dict(by_scope) == {"Model/Dense_0": {"bfloat16"}, "Model/head": {"float32"}}
  # The head reads the fp32 kernel, unrounded.
  dense = jl.Policy("f32", "bf16", "bf16").cast_to_compute(params["params"]["Dense_0"])
  h = jnp.tanh(x.astype(jnp.bfloat16) @ dense["kernel"] + dense["bias"]).astype(F32)
  head = params["params"]["head"]
  np.testing.assert_allclose(fn(params, x), h @ head["kernel"] + head["bias"], rtol=1e-6)
