"""The autocast interpreter (jmp_lite/_autocast/_interpret.py): program dtypes kept, matmul
operands, user casts, nested programs (jit, scan, cond, while, checkpoint, shard_map), user
rules, name scopes, and the lean residuals of fp32 operations."""

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite as jl
from jmp_lite import _jaxpr

from .autocast_testing import (
  F32,
  POLICY,
  block,
  block_params,
  census,
  hand_written,
  rel_err,
  residual_bytes,
  saved_residuals,
)


def test_matmul_takes_compute_operands_and_keeps_program_accumulation():
  w, x = jnp.ones((4, 3)), jnp.ones((2, 4))

  def f(w, x):  # the user widens both operands: the product still runs on bf16 operands
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), preferred_element_type=F32)

  closed = jax.make_jaxpr(jl.autocast(f, POLICY))(w, x)
  # bf16 operands with an fp32 result; XLA:CPU's branch widens them first (it has no kernel for
  # every such product), the others keep them.
  (branches,) = [e.params["branches"] for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
  operands = sorted(
    tuple(_jaxpr.dtype_of(v).name for v in e.invars)
    for b in branches
    for e in b.jaxpr.eqns
    if e.primitive.name == "dot_general"
  )
  assert operands == [("bfloat16", "bfloat16"), ("float32", "float32")]
  lowered = jax.jit(jl.autocast(f, POLICY)).trace(w, x).lower(lowering_platforms=("cuda",))
  assert "bf16" in lowered.as_text() and "preferred" not in lowered.as_text()
  np.testing.assert_array_equal(jl.autocast(f, POLICY)(w, x), jnp.full((2, 3), 4.0))


def test_user_cast_is_respected():
  x = jnp.linspace(0.0, 2.0, 8)
  # The user rounds exp's result to fp16: it is rounded once, from the fp32 exp.
  got = jl.autocast(lambda a: jnp.exp(a).astype(jnp.float16), POLICY)(x)
  np.testing.assert_array_equal(got, jnp.exp(x).astype(jnp.float16).astype(F32))
  # The user's fp32 region stays fp32, matmul operands aside.
  f = lambda a: (a.astype(F32) * 1.001).sum()
  assert census(jax.make_jaxpr(jl.autocast(f, POLICY))(x))["mul"] == {"float32"}


def test_inner_jit_is_rewritten():
  x = jnp.linspace(0.1, 0.9, 8)
  f = jax.jit(lambda a: jnp.exp(a) * 2)
  assert census(jax.make_jaxpr(jl.autocast(f, POLICY))(x))["exp"] == {"float32"}
  want = 2 * jnp.exp(x).astype(jnp.bfloat16)  # the fp32 exp, rounded for the bf16 product
  np.testing.assert_array_equal(jl.autocast(f, POLICY)(x), want.astype(F32))


def test_scan_carries_keep_their_dtype():
  x, w = jnp.linspace(-1, 1, 12).reshape(3, 4), jnp.full((4, 4), 0.1)

  def f(w, x):
    def body(carry, xi):
      h, c = carry
      h = jnp.tanh(h @ w) + jnp.exp(xi)
      return (h, c + jnp.exp(xi).sum()), h.sum()

    (h, c), ys = jax.lax.scan(body, (x[0], jnp.zeros((), F32)), x)
    return h, c, ys

  closed = jax.make_jaxpr(jl.autocast(f, POLICY))(w, x)
  (scan,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
  # The fp32 carry enters and leaves fp32, the bf16 one bf16; the body's exp runs in fp32.
  assert [_jaxpr.dtype_of(v).name for v in scan.outvars[:2]] == ["bfloat16", "float32"]
  assert census(closed)["exp"] == {"float32"}
  h, c, _ = jl.autocast(f, POLICY)(w, x)
  np.testing.assert_allclose(c, jnp.exp(x.astype(jnp.bfloat16).astype(F32)).sum(), rtol=1e-6)
  assert rel_err(h, f(w, x)[0]) < 0.02
  grads = jax.grad(lambda w: jl.autocast(f, POLICY)(w, x)[0].sum())(w)
  assert grads.dtype == F32 and rel_err(grads, jax.grad(lambda w: f(w, x)[0].sum())(w)) < 0.03


def test_cond_and_while_are_rewritten():
  x = jnp.linspace(0.1, 0.9, 8)

  def f(x):
    y = jax.lax.cond(x.sum() > 0, jnp.exp, lambda a: a * 2, x)
    _, z = jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.log1p(c[1])), (0, y))
    return z

  closed = jax.make_jaxpr(jl.autocast(f, POLICY))(x)
  assert census(closed)["exp"] == {"float32"} and census(closed)["log1p"] == {"float32"}
  xb = x.astype(jnp.bfloat16).astype(F32)
  r = lambda a: a.astype(jnp.bfloat16).astype(F32)  # the program's bf16 carries
  np.testing.assert_array_equal(
    jl.autocast(f, POLICY)(x), r(jnp.log1p(r(jnp.log1p(r(jnp.exp(xb))))))
  )


def test_checkpoint_keeps_its_policy():
  w, x = jnp.full((4, 4), 0.1), jnp.linspace(-1, 1, 8).reshape(2, 4)
  policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  f = lambda w, x: jax.checkpoint(lambda w, x: jnp.exp(x @ w).sum(), policy=policy)(w, x)
  closed = jax.make_jaxpr(jl.autocast(f, POLICY))(w, x)
  policies = [e.params["policy"] for e in closed.jaxpr.eqns if e.primitive.name == "remat2"]
  assert policies == [policy]
  grads = jax.grad(jl.autocast(f, POLICY))(w, x)
  assert grads.dtype == F32 and rel_err(grads, jax.grad(f)(w, x)) < 0.02


def test_user_custom_vjp_rule_runs_at_its_input_dtypes():
  @jax.custom_vjp
  def op(x):
    return jnp.exp(x)

  op.defvjp(lambda x: (jnp.exp(x), x), lambda x, g: (jnp.exp(x) * g,))
  x = jnp.linspace(0.1, 0.9, 8)
  found = census(jax.make_jaxpr(jl.autocast(op, POLICY))(x))
  assert found["exp"] == {"bfloat16"}  # the user's rule, as written, on its bf16 input
  xb = x.astype(jnp.bfloat16)
  np.testing.assert_array_equal(jl.autocast(op, POLICY)(x), jnp.exp(xb).astype(F32))
  np.testing.assert_array_equal(
    jax.grad(lambda a: jl.autocast(op, POLICY)(a).sum())(x), jnp.exp(xb).astype(F32)
  )


def test_custom_jvp_softmax_is_an_fp32_softmax_with_16bit_residuals():
  z = jax.random.normal(jax.random.key(0), (4, 64)) * 3
  v = jax.random.normal(jax.random.key(1), (64, 8))
  f = lambda z, v: jax.nn.softmax(z, axis=-1) @ v
  with jax.softmax_custom_jvp(True):
    closed = jax.make_jaxpr(jl.autocast(f, POLICY))(z, v)
    assert census(closed)["exp"] == {"float32"} and census(closed)["div"] == {"float32"}
    got = jl.autocast(jax.nn.softmax, POLICY)(z)
    zb = z.astype(jnp.bfloat16).astype(F32)
    np.testing.assert_allclose(got, jax.nn.softmax(zb), rtol=1e-6)
    assert ("float32", (4, 64)) not in saved_residuals(jl.autocast(f, POLICY), z, v)
    g = jax.grad(lambda z: jl.autocast(f, POLICY)(z, v).sum())(z)
  assert rel_err(g, jax.grad(lambda z: f(z, v).sum())(z)) < 0.02


def test_fp32_ops_keep_16bit_residuals():
  w, x = jnp.full((16, 16), 0.05), jnp.linspace(-1, 1, 128).reshape(8, 16)
  f = lambda w, x: jnp.exp(x @ w) @ w + jax.lax.rsqrt(x * x + 1) @ w
  saved = saved_residuals(jl.autocast(f, POLICY), w, x)
  assert ("float32", (8, 16)) not in saved  # no fp32 activation kept
  assert ("bfloat16", (8, 16)) in saved


def test_block_keeps_no_more_residual_bytes_than_hand_written():
  params, x = block_params(d=16), jax.random.normal(jax.random.key(1), (32, 16))
  hand = residual_bytes(hand_written(block), params, x)
  assert residual_bytes(jl.autocast(block, POLICY), params, x) <= hand
  assert residual_bytes(block, params, x) > 1.5 * hand  # fp32 keeps twice the bytes


def test_name_scopes_are_kept():
  x = jnp.linspace(0.1, 0.9, 8)

  def f(x):
    with jax.named_scope("block"):
      return jnp.exp(x) * 2

  closed = jax.make_jaxpr(jl.autocast(f, POLICY))(x)
  scopes = {str(e.source_info.name_stack) for e in closed.jaxpr.eqns if e.primitive.name == "mul"}
  assert scopes == {"block"}
  assert "block" in jax.jit(jl.autocast(f, POLICY)).lower(x).as_text(debug_info=True)


def test_shard_map_body_and_sharding_constraints_are_rewritten():
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  body = lambda a: jax.lax.psum(jnp.exp(a).sum(keepdims=True), "d")
  f = lambda x: jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P())(x)
  x = jnp.linspace(0.0, 1.0, 8)
  assert census(jax.make_jaxpr(jl.autocast(f, POLICY))(x))["exp"] == {"float32"}
  xb = x.astype(jnp.bfloat16).astype(F32)
  want = jnp.exp(xb).sum(keepdims=True).astype(jnp.bfloat16).astype(F32)
  np.testing.assert_array_equal(jax.jit(jl.autocast(f, POLICY))(x), want)
  grad = jax.grad(lambda x: jl.autocast(f, POLICY)(x).sum())(x)
  np.testing.assert_array_equal(grad, jnp.exp(xb).astype(jnp.bfloat16).astype(F32))
  g = lambda x: jax.lax.with_sharding_constraint(jnp.exp(x), NamedSharding(mesh, P("d")))
  np.testing.assert_array_equal(jax.jit(jl.autocast(g, POLICY))(x), jnp.exp(x))
