"""Differential tests of jl.autocast on whole models: plain JAX, Flax linen and Equinox.

For each model, ``autocast(f)`` against the hand-written 16-bit version (pure casts) and fp32:
outputs and gradients within bf16 noise of fp32 and not worse than the hand-written version,
and a census of the rewritten program's operand dtypes against the op table.
"""

import jax
import jax.numpy as jnp
import pytest

import jmp_lite as jl

from .autocast_testing import block, block_params, census, hand_written, rel_err

POLICY = jl.get_policy("params=float32,compute=bfloat16,output=float32")
FP32_OPS = ("exp", "log", "log1p", "rsqrt", "sqrt", "logistic", "reduce_sum", "erf_inv", "pow")
MATMULS = ("dot_general", "conv_general_dilated")


def _keys(n, seed=0):
  return jax.random.split(jax.random.key(seed), n)


def cross_entropy(logits, labels):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], -1))


def mlp_case():
  k = _keys(4)
  params = {
    "w1": jax.random.normal(k[0], (16, 32)) / 4,
    "b1": jnp.zeros(32),
    "w2": jax.random.normal(k[1], (32, 10)) / 6,
  }
  x = jax.random.normal(k[2], (8, 16))

  def f(p, x):
    return jax.nn.gelu(x @ p["w1"] + p["b1"]) @ p["w2"]

  return f, params, x


def conv_norm_case():
  k = _keys(3)
  params = {"kernel": jax.random.normal(k[0], (3, 3, 2, 4)) / 4, "scale": jnp.ones(4)}
  x = jax.random.normal(k[1], (2, 6, 6, 2))

  def f(p, x):
    y = jax.lax.conv_general_dilated(
      x, p["kernel"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    mean, var = jnp.mean(y, (1, 2), keepdims=True), jnp.var(y, (1, 2), keepdims=True)
    y = (y - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"]
    return jax.nn.relu(y).mean((1, 2))

  return f, params, x


def transformer_case():
  return block, block_params(d=8), jax.random.normal(jax.random.key(1), (8, 8))


@jax.custom_vjp
def softplus_op(x):
  return jnp.logaddexp(x, 0.0)


softplus_op.defvjp(lambda x: (softplus_op(x), x), lambda x, g: (jax.nn.sigmoid(x) * g,))


def custom_vjp_case():
  _, params, x = mlp_case()
  del params["b1"]  # unused: its zero gradient has no relative error
  return (lambda p, x: softplus_op(x @ p["w1"]) @ p["w2"]), params, x


def linen_case():
  import flax.linen as nn

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.LayerNorm()(nn.Dense(32)(x))
      w = jax.nn.softmax(x @ x.T / 32**0.5)
      return nn.Dense(10)(jax.nn.gelu(w @ x))

  model, x = Model(), jax.random.normal(jax.random.key(2), (8, 16))
  return model.apply, jax.jit(model.init)(jax.random.key(0), x), x


def equinox_case():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(16, 10, 32, 2, activation=jax.nn.gelu, key=jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  x = jax.random.normal(jax.random.key(3), (8, 16))
  return (lambda p, x: jax.vmap(eqx.combine(p, static))(x)), params, x


CASES = {
  "mlp": mlp_case,
  "conv_norm": conv_norm_case,
  "transformer": transformer_case,
  "custom_vjp": custom_vjp_case,
  "linen": linen_case,
  "equinox": equinox_case,
}


def _grad_and_output(f):
  """The gradient of a cross-entropy on ``f``'s output, and the output, in one ``grad`` call."""
  labels = jnp.arange(8) % 10

  def loss(p, x):
    out = f(p, x)
    return cross_entropy(out[:, :10], labels[: out.shape[0]] % out.shape[-1]), out

  return jax.grad(loss, has_aux=True)


@pytest.mark.parametrize("case", CASES)
def test_autocast_is_within_bf16_noise_and_not_worse_than_hand_written(case):
  f, params, x = CASES[case]()
  # fp32, autocast and hand-written, outputs and gradients, compiled as one program: one
  # compile, not six (the unit tier's time is XLA compiling); they share no value but the inputs.
  versions = (f, jl.autocast(f, POLICY), hand_written(f))
  run = jax.jit(lambda p, x: tuple(_grad_and_output(g)(p, x) for g in versions))
  (ref_grad, ref_out), *results = run(params, x)
  errors = {}
  for name, (grad, out) in zip(("autocast", "hand"), results, strict=True):
    assert out.dtype == jnp.float32
    assert all(d.dtype == jnp.float32 for d in jax.tree.leaves(grad))
    flat, want = jax.tree.leaves(grad), jax.tree.leaves(ref_grad)
    errors[name] = (
      rel_err(out, ref_out),
      max(rel_err(a, b) for a, b in zip(flat, want, strict=True)),
    )
  (out_auto, grad_auto), (out_hand, grad_hand) = errors["autocast"], errors["hand"]
  assert out_auto < 2**-5 and grad_auto < 2**-4, errors  # bf16 noise: 8 significant bits
  assert out_auto <= 1.1 * out_hand and grad_auto <= 1.1 * grad_hand, errors


@pytest.mark.parametrize("case", CASES)
def test_rewritten_program_census_matches_the_table(case):
  f, params, x = CASES[case]()
  rewritten = census(jax.make_jaxpr(jl.autocast(f, POLICY))(params, x))
  for primitive in FP32_OPS:
    if case == "custom_vjp" and primitive in ("exp", "log1p"):
      # logaddexp inside the user's rule, which runs at its input dtypes.
      assert rewritten[primitive] == {"bfloat16"}, primitive
    elif primitive in rewritten:
      assert rewritten[primitive] == {"float32"}, (primitive, rewritten[primitive])
  matmuls = [p for p in MATMULS if p in rewritten]
  assert matmuls, rewritten
  for primitive in matmuls:
    assert rewritten[primitive] == {"bfloat16"}, (primitive, rewritten[primitive])
