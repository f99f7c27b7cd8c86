"""Broadcasts whose gradient is a sum, summed in fp32 (jmp_lite/_autocast/_broadcast.py)."""

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite as jl

from .autocast_testing import all_eqns


def test_gradients_of_broadcast_16_bit_values_sum_in_fp32():
  # A bias and a scale broadcast over 300 rows: their gradients are sums over the rows, which
  # the rule computes in fp32 and rounds once (JAX alone sums in the cotangent's bf16).
  x = jax.random.normal(jax.random.key(0), (300, 16)).astype(jnp.bfloat16)
  params = {"b": jnp.full((16,), 0.5, jnp.bfloat16), "s": jnp.full((16,), 2.0, jnp.bfloat16)}
  f = lambda p, x: ((x * p["s"] + p["b"]).astype(jnp.float32) ** 2).sum()
  bf16 = jnp.bfloat16
  jaxpr = jax.make_jaxpr(jax.grad(jl.autocast(f, "params=bfloat16,compute=bfloat16")))(params, x)
  long_sums = [
    e.invars[0].aval.dtype.name
    for e in all_eqns(jaxpr.jaxpr)
    if e.primitive.name == "reduce_sum" and e.invars[0].aval.shape[0] == 300
  ]
  assert long_sums and set(long_sums) == {"float32"}, long_sums
  assert "bfloat16" in {
    e.invars[0].aval.dtype.name
    for e in all_eqns(jax.make_jaxpr(jax.grad(f))(params, x).jaxpr)
    if e.primitive.name == "reduce_sum" and e.invars[0].aval.shape[0] == 300
  }  # the test can fail: JAX's own program sums these in bf16
  grads = jax.grad(jl.autocast(f, "params=bfloat16,compute=bfloat16"))(params, x)
  # The reference: the same bf16 cotangents, summed in fp32, rounded once.
  y = (x * params["s"] + params["b"]).astype(jnp.float32)
  ct = (2 * y).astype(bf16).astype(jnp.float32)
  np.testing.assert_array_equal(grads["b"], ct.sum(0).astype(bf16))
  np.testing.assert_array_equal(
    grads["s"], (ct * x.astype(jnp.float32)).astype(bf16).astype(jnp.float32).sum(0).astype(bf16)
  )
  # Forward mode goes through the rule's JVP, with the tangent of x (not broadcast) only.
  _, tangent = jax.jvp(lambda x: jl.autocast(f, "params=bfloat16,compute=bfloat16")(params, x),
                       (x,), (jnp.ones_like(x),))  # fmt: skip
  _, expected = jax.jvp(lambda x: f(params, x), (x,), (jnp.ones_like(x),))
  np.testing.assert_allclose(tangent, expected, rtol=1e-2)
