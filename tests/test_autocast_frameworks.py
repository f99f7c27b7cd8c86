"""Differential tests of jl.autocast on framework models: Flax linen and NNX, Equinox, Haiku.

tests/test_autocast_models.py covers plain-JAX models (MLP, conv + norm, a transformer block,
a custom_vjp op), a small linen model and an Equinox MLP. Here, per framework, a conv + norm
model, a transformer block with its own softmax and RMSNorm, a linen ``nn.scan`` stack and an
NNX model run through ``nnx.split``/``nnx.merge``. For each: ``autocast(f)`` against the
hand-written 16-bit version (pure casts) and fp32, the outputs and gradients of all three in
one compiled program, and a census of the rewritten program against the op table. Then bad input
on models: token ids (a non-floating leaf) pass through, unknown primitives take the default.

The bound: outputs within 2**-5 of fp32 (relative), every gradient leaf within 2**-4 (bf16
noise: 8 significant bits); a leaf whose fp32 gradient is below ``FLOOR`` times the whole
gradient's norm is measured against the whole gradient's norm (a key bias under a softmax has
an exact gradient of zero, its fp32 value is rounding noise). The comparison: autocast's error
on the output and on the whole gradient (all leaves as one vector) at most ``SLACK`` times the
hand-written version's. Both are bf16 noise, two roundings of one model, and their ratio moves
with the input: over 4 inputs per model here it ranged over 0.78-1.29 (mean 1.0), hence 1.3.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_lite as jl

from .autocast_testing import census, hand_written, rel_err

POLICY = jl.get_policy("params=float32,compute=bfloat16,output=float32")
FP32_OPS = ("exp", "log", "log1p", "rsqrt", "sqrt", "logistic", "reduce_sum", "erf_inv", "pow")
MATMULS = ("dot_general", "conv_general_dilated")
SLACK = 1.3
FLOOR = 2**-8
# Flax's and Equinox's GroupNorm compute their statistics in fp32 themselves.
UPCASTING = frozenset({"linen_conv_norm", "equinox_conv_norm"})
CLASSES = 10


def _keys(n, seed=0):
  return jax.random.split(jax.random.key(seed), n)


def own_softmax(s):
  e = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
  return e / e.sum(-1, keepdims=True)


# Flax linen.


def linen_conv_norm():
  import flax.linen as nn

  class ConvNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.GroupNorm(num_groups=4)(nn.Conv(8, (3, 3), use_bias=False)(x)))
      return nn.Dense(CLASSES)(x.mean((1, 2)))

  model, x = ConvNorm(), jax.random.normal(jax.random.key(0), (4, 6, 6, 3))
  return model.apply, jax.jit(model.init)(jax.random.key(0), x), x


def _linen_rmsnorm():
  import flax.linen as nn

  class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
      scale = self.param("scale", lambda k, s: 1 + 0.1 * jax.random.normal(k, s), x.shape[-1:])
      return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale

  return RMSNorm


def linen_transformer():
  import flax.linen as nn

  RMSNorm = _linen_rmsnorm()

  class Block(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(32, 16)(tokens)  # int32 token ids: a non-floating leaf
      h = RMSNorm()(x)
      q, k, v = (nn.DenseGeneral((2, 8), name=n)(h) for n in "qkv")
      p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8**0.5, axis=-1)
      x = x + nn.DenseGeneral(16, axis=(-2, -1))(jnp.einsum("bhqk,bkhd->bqhd", p, v))
      x = x + nn.Dense(16)(nn.gelu(nn.Dense(32)(RMSNorm()(x))))
      return nn.Dense(CLASSES)(x).reshape(-1, CLASSES)

  tokens = jax.random.randint(_keys(2)[1], (2, 4), 0, 32)
  model = Block()
  return model.apply, jax.jit(model.init)(jax.random.key(0), tokens), tokens


def linen_scan():
  import flax.linen as nn

  RMSNorm = _linen_rmsnorm()

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return x + nn.Dense(16)(jnp.tanh(RMSNorm()(x))), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      layers = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
      x, _ = layers()(nn.Dense(16)(x), None)
      return nn.Dense(CLASSES)(x)

  model, x = Stack(), jax.random.normal(_keys(3)[2], (8, 12))
  return model.apply, jax.jit(model.init)(jax.random.key(0), x), x


# Flax NNX.


def nnx_block():
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.LayerNorm(16, rngs=rngs)
      self.qkv = nnx.Linear(16, 48, rngs=rngs)
      self.out = nnx.Linear(16, CLASSES, rngs=rngs)

    def __call__(self, x):
      q, k, v = jnp.split(self.qkv(self.norm(x)), 3, axis=-1)
      return self.out(x + jax.nn.softmax(q @ k.T / 4.0, axis=-1) @ v)

  graphdef, state = nnx.split(Block(nnx.Rngs(0)))
  x = jax.random.normal(_keys(4)[3], (8, 16))
  return (lambda state, x: nnx.merge(graphdef, state)(x)), state, x


# Equinox.


def _eqx_rmsnorm():
  eqx = pytest.importorskip("equinox")

  class RMSNorm(eqx.Module):
    scale: jax.Array

    def __call__(self, x):
      return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale

  return RMSNorm


def equinox_conv_norm():
  eqx = pytest.importorskip("equinox")
  k = _keys(3, seed=1)
  model = eqx.nn.Sequential(
    [
      eqx.nn.Conv2d(3, 8, 3, padding=1, key=k[0]),
      eqx.nn.GroupNorm(4, 8),
      eqx.nn.Lambda(jax.nn.relu),
      eqx.nn.Lambda(lambda x: x.mean((1, 2))),
      eqx.nn.Linear(8, CLASSES, key=k[1]),
    ]
  )
  params, static = eqx.partition(model, eqx.is_inexact_array)
  x = jax.random.normal(k[2], (4, 3, 6, 6))
  return (lambda p, x: jax.vmap(eqx.combine(p, static))(x)), params, x


def equinox_transformer():
  eqx = pytest.importorskip("equinox")
  RMSNorm = _eqx_rmsnorm()

  class Block(eqx.Module):
    norm: RMSNorm
    qkv: eqx.nn.Linear
    mlp: eqx.nn.MLP
    head: eqx.nn.Linear

    def __init__(self, key):
      k = jax.random.split(key, 3)
      self.norm = RMSNorm(1 + 0.1 * jax.random.normal(k[0], (16,)))
      self.qkv = eqx.nn.Linear(16, 48, key=k[0])
      self.mlp = eqx.nn.MLP(16, 16, 32, 1, activation=jax.nn.gelu, key=k[1])
      self.head = eqx.nn.Linear(16, CLASSES, key=k[2])

    def __call__(self, x):  # x: (tokens, 16)
      q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.norm)(x)), 3, axis=-1)
      x = x + own_softmax(q @ k.T / 4.0) @ v  # a hand-written softmax
      x = x + jax.vmap(self.mlp)(jax.vmap(self.norm)(x))
      return jax.vmap(self.head)(x)

  params, static = eqx.partition(Block(jax.random.key(5)), eqx.is_inexact_array)
  x = jax.random.normal(_keys(6)[5], (8, 16))
  return (lambda p, x: eqx.combine(p, static)(x)), params, x


# Haiku.


def _haiku(fn, x):
  hk = pytest.importorskip("haiku")
  net = hk.without_apply_rng(hk.transform(fn))
  return net.apply, jax.jit(net.init)(jax.random.key(0), x), x


def haiku_conv_norm():
  import haiku as hk

  def fn(x):
    x = jax.nn.relu(hk.GroupNorm(4)(hk.Conv2D(8, 3)(x)))
    return hk.Linear(CLASSES)(x.mean((1, 2)))

  return _haiku(fn, jax.random.normal(_keys(8)[7], (4, 6, 6, 3)))


def haiku_transformer():
  import haiku as hk

  def fn(x):  # x: (batch, tokens, 16)
    h = hk.RMSNorm(-1)(x)
    x = x + hk.MultiHeadAttention(2, 8, w_init=hk.initializers.VarianceScaling())(h, h, h)
    x = x + hk.nets.MLP([32, 16], activation=jax.nn.gelu)(hk.RMSNorm(-1)(x))
    return hk.Linear(CLASSES)(x).reshape(-1, CLASSES)

  return _haiku(fn, jax.random.normal(_keys(9)[8], (2, 4, 16)))


BUILDERS = {
  "linen_conv_norm": linen_conv_norm,
  "linen_transformer": linen_transformer,
  "linen_scan": linen_scan,
  "nnx": nnx_block,
  "equinox_conv_norm": equinox_conv_norm,
  "equinox_transformer": equinox_transformer,
  "haiku_conv_norm": haiku_conv_norm,
  "haiku_transformer": haiku_transformer,
}


CASES = {}


def _case(name):
  """The case's (function, parameters, input), built once per session."""
  if name not in CASES:
    CASES[name] = BUILDERS[name]()
  return CASES[name]


def _flat(tree) -> list[np.ndarray]:
  return [np.asarray(a, np.float64) for a in _leaves(tree)]


def _grad_errs(grad, want) -> tuple[float, float]:
  """(the whole gradient's relative error, the largest leaf's: see the module docstring)."""
  got, ref = _flat(grad), _flat(want)
  total = np.sqrt(sum(float(np.sum(b * b)) for b in ref))
  whole = np.sqrt(sum(float(np.sum((a - b) ** 2)) for a, b in zip(got, ref, strict=True)))
  leaves = [
    np.linalg.norm(a - b) / (n if (n := np.linalg.norm(b)) >= FLOOR * total else total)
    for a, b in zip(got, ref, strict=True)
  ]
  return float(whole / total), float(max(leaves))


def _grad_and_output(f):
  """``f``'s output and the gradient of a cross-entropy on it, in one ``grad`` call."""

  def loss(p, x):
    out = f(p, x)
    labels = jnp.arange(out.shape[0]) % CLASSES
    logp = jax.nn.log_softmax(out.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], -1)), out

  return jax.grad(loss, has_aux=True)


def _leaves(tree):
  return [a for a in jax.tree.leaves(tree) if jnp.issubdtype(a.dtype, jnp.floating)]


@pytest.mark.parametrize("case", BUILDERS)
def test_autocast_is_within_bf16_noise_and_not_worse_than_hand_written(case):
  f, params, x = _case(case)
  # fp32, autocast and hand-written compiled as one program: one compile, not three (the unit
  # tier's time is XLA compiling); the three computations share no value but their inputs.
  versions = (f, jl.autocast(f, POLICY), hand_written(f))
  run = jax.jit(lambda p, x: tuple(_grad_and_output(g)(p, x) for g in versions))
  (ref_grad, ref_out), *results = run(params, x)
  errors = {}
  for name, (grad, out) in zip(("autocast", "hand"), results, strict=True):
    assert out.dtype == jnp.float32
    assert jax.tree.structure(grad) == jax.tree.structure(ref_grad)
    assert all(d.dtype == jnp.float32 for d in _leaves(grad))
    errors[name] = (rel_err(out, ref_out), *_grad_errs(grad, ref_grad))
  (out_auto, grad_auto, leaf_auto), (out_hand, grad_hand, _) = errors["autocast"], errors["hand"]
  assert out_auto < 2**-5 and leaf_auto < 2**-4, errors
  assert out_auto <= SLACK * out_hand and grad_auto <= SLACK * grad_hand, errors


@pytest.mark.parametrize("case", BUILDERS)
def test_rewritten_program_census_matches_the_table(case):
  f, params, x = _case(case)
  rewritten = census(jax.make_jaxpr(jl.autocast(f, POLICY))(params, x))
  hand = census(jax.make_jaxpr(hand_written(f))(params, x))
  for primitive in FP32_OPS:
    if primitive in rewritten:
      assert rewritten[primitive] == {"float32"}, (primitive, rewritten[primitive])
  matmuls = [p for p in MATMULS if p in rewritten]
  assert matmuls, rewritten
  for primitive in matmuls:
    assert rewritten[primitive] == {"bfloat16"}, (primitive, rewritten[primitive])
  # The census tells the two apart: the hand-written program runs some of them in bf16.
  assert any("bfloat16" in hand.get(p, ()) for p in FP32_OPS) != (case in UPCASTING), hand


# Bad input.

UNKNOWN = {  # primitives the table does not list: they run at their input dtypes
  "cbrt": jnp.cbrt,
  "sin": jnp.sin,
  "erf": jax.lax.erf,
  "atan2": lambda a: jnp.arctan2(a, 1.5 - a),
  "integer_pow": lambda a: a**3,
}
DTYPES = ("float32", "bfloat16", "float16", "int32", "uint8", "bool")


@settings(max_examples=12)
@given(
  name=st.sampled_from(sorted(UNKNOWN)),
  shape=st.lists(st.integers(1, 3), min_size=0, max_size=2),
)
def test_unknown_primitives_take_the_input_rule(name, shape):
  fn = UNKNOWN[name]
  x = jnp.linspace(-0.9, 0.9, int(np.prod(shape))).reshape(shape) * 1.37
  got = jl.autocast(fn, POLICY)(x)
  assert got.dtype == jnp.float32 and got.shape == tuple(shape)
  # The documented default: the op runs on its bf16 operands, as the hand-written program does.
  np.testing.assert_array_equal(got, fn(x.astype(jnp.bfloat16)).astype(jnp.float32))
  found = census(jax.make_jaxpr(jl.autocast(fn, POLICY))(x))
  assert found[name] == {"bfloat16"}


@settings(max_examples=12)
@given(dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(1, 3), max_size=2))
def test_leaves_of_every_dtype(dtype, shape):
  x = (jnp.arange(int(np.prod(shape))).reshape(shape) * 0.3 + 1).astype(dtype)
  out = jl.autocast(lambda a: {"same": a, "scaled": a * 3}, POLICY)(x)
  if jnp.issubdtype(x.dtype, jnp.floating):
    # Floating leaves: computed from the bf16 cast (an fp32 argument read unrounded where it
    # passes straight through), returned in the output dtype.
    want = x.astype(jnp.float32) if dtype == "float32" else x.astype(jnp.bfloat16)
    np.testing.assert_array_equal(out["same"], want.astype(jnp.float32))
    np.testing.assert_array_equal(out["scaled"], (x.astype(jnp.bfloat16) * 3).astype(jnp.float32))
    assert out["same"].dtype == out["scaled"].dtype == jnp.float32
  else:
    # Non-floating leaves pass through, dtype and value.
    assert out["same"].dtype == x.dtype and out["scaled"].dtype == (x * 3).dtype
    np.testing.assert_array_equal(out["same"], x)
    np.testing.assert_array_equal(out["scaled"], x * 3)


PARTS = {"params": "float32", "compute": "bfloat16", "output": "float32"}


@settings(max_examples=12)
@given(
  part=st.sampled_from(sorted(PARTS)),
  where=st.sampled_from(["key", "value"]),
  junk=st.text("xyzq17", min_size=1, max_size=3),
)
def test_policy_string_errors_name_the_part(part, where, junk):
  parts = dict(PARTS)
  if where == "value":
    parts[part] = f"bf{junk}"
    spec = ",".join(f"{k}={v}" for k, v in parts.items())
    bad = f"bf{junk}"
  else:
    spec = ",".join(f"{k + junk if k == part else k}={v}" for k, v in parts.items())
    bad = part + junk
  with pytest.raises(ValueError, match=f"'{bad}'"):
    jl.autocast(jnp.exp, spec)
