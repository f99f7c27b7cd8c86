"""fp32 operations differentiated from their result (jmp_lite/_autocast/_from_output.py):
``exp`` and ``logistic``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jl

from .autocast_testing import F32, POLICY


@pytest.mark.parametrize("fn", [jnp.exp, jax.nn.sigmoid], ids=["exp", "logistic"])
def test_exp_and_logistic_differentiate_from_their_rounded_result(fn):
  x = jnp.linspace(-2.0, 2.0, 8).astype(jnp.bfloat16)
  y = fn(x.astype(F32)).astype(jnp.bfloat16)
  slope = y if fn is jnp.exp else y * (1 - y)  # in bf16, as the hand-written backward pass
  grad = jax.grad(lambda a: jl.autocast(fn, POLICY)(a).sum())(x)
  np.testing.assert_array_equal(grad, slope)
  _, tangent = jax.jvp(jl.autocast(fn, POLICY), (x,), (jnp.ones_like(x),))
  np.testing.assert_array_equal(tangent, slope.astype(F32))
