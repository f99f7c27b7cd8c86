"""Shared by the Flax tests: small real models and jaxpr/HLO inspection helpers.

Each model exists in linen and NNX: a one-block transformer LM (embedding,
multi-head attention, MLP, LayerNorm) and a convnet with BatchNorm. Nothing
in them mentions a dtype, which is the point: jmp_lite applies the policy from
outside.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.extend import core as jex_core

import jmp_lite.flax as jlf

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


def jit(fun, **kwargs):
  """jax.jit with XLA's backend optimizations off: these tests check values and
  dtypes, not speed, and on 2 CPU cores compiling dominates their run time."""
  return jax.jit(fun, compiler_options={"xla_backend_optimization_level": 0}, **kwargs)


VOCAB, WIDTH, HEADS, LENGTH, CLASSES = 32, 16, 2, 8, 4


class LinenBlock(nn.Module):
  width: int = WIDTH
  heads: int = HEADS

  @nn.compact
  def __call__(self, x, mask=None):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads)(h, h, mask=mask)
    h = nn.LayerNorm()(x)
    h = nn.Dense(4 * self.width)(h)
    return x + nn.Dense(self.width)(nn.gelu(h))


class LinenLM(nn.Module):
  vocab: int = VOCAB
  width: int = WIDTH
  layers: int = 1

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.width)(tokens)
    pos = self.param("pos", nn.initializers.normal(0.02), (tokens.shape[-1], self.width))
    x = x + pos
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = LinenBlock(self.width)(x, mask)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


class LinenConvNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    x = nn.Conv(8, (3, 3), strides=(2, 2))(x)
    x = x.mean(axis=(1, 2))
    return nn.Dense(CLASSES)(x)


class NnxBlock(nnx.Module):
  def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, width, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x, mask=None):
    h = self.norm1(x)
    x = x + self.attn(h, mask=mask, deterministic=True)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NnxLM(nnx.Module):
  def __init__(self, vocab: int = VOCAB, width: int = WIDTH, heads: int = HEADS, *, rngs):
    self.embed = nnx.Embed(vocab, width, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (LENGTH, width)))
    self.block = NnxBlock(width, heads, rngs=rngs)
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, vocab, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[...]
    x = self.block(x, nnx.make_causal_mask(tokens))
    return self.head(self.norm(x))


class NnxConvNet(nnx.Module):
  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.conv2 = nnx.Conv(8, 8, (3, 3), strides=(2, 2), rngs=rngs)
    self.head = nnx.Linear(8, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv1(x)))
    return self.head(self.conv2(x).mean(axis=(1, 2)))


@functools.partial(jit, static_argnums=0)
def linen_init(model: nn.Module, key: jax.Array, *args):
  """``model.init(key, *args)``, compiled once per (hashable) model and argument shapes.

  Call it outside traced code: a jit with compiler options cannot be nested.
  """
  return model.init(key, *args)


@functools.cache
def _nnx_init(cls: type[nnx.Module], seed: int):
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: cls(rngs=nnx.Rngs(seed))))
  return graphdef, jit(lambda: nnx.state(cls(rngs=nnx.Rngs(seed))))()


def nnx_model(cls: type[nnx.Module], seed: int = 0) -> nnx.Module:
  """A fresh ``cls(rngs=nnx.Rngs(seed))``, its initialisers compiled once per class and seed.

  Built eagerly, an NNX model compiles each initialiser op by op at XLA's default
  optimization level: seconds on 2 cores. Compiled here, the parameters match the
  eager ones up to the rounding of the initialisers' last multiply. Each call
  returns new Variables, so tests may update the model in place. Call it outside
  traced code: a jit with compiler options cannot be nested.
  """
  graphdef, state = _nnx_init(cls, seed)
  return nnx.merge(graphdef, state, copy=True)


def nnx_compiled(fun, *objects):
  """``nnx.jit(fun)`` bound to the NNX ``objects``, compiled with :func:`jit`'s options.

  Returns ``step(*args)``, which runs ``fun(*objects, *args)`` compiled and
  updates ``objects`` in place, as ``nnx.jit`` does (spelled out with
  split/merge: ``nnx.jit`` takes no compiler options).
  """
  graphdef, _ = nnx.split(objects)

  @jit
  def pure(state, *args):
    objs = nnx.merge(graphdef, state)
    return fun(*objs, *args), nnx.state(objs)

  def step(*args):
    out, state = pure(nnx.state(objects), *args)
    nnx.update(objects, state)
    return out

  return step


def tokens(seed: int = 0, batch: int = 2) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (batch, LENGTH), 0, VOCAB)


def images(seed: int = 0, batch: int = 4) -> jax.Array:
  return jax.random.normal(jax.random.key(seed), (batch, 8, 8, 3))


def lm_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Next-token cross-entropy (whatever dtype the logits arrive in)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def eqns(jaxpr) -> Iterator[jex_core.JaxprEqn]:
  """Every equation of ``jaxpr`` and of the jaxprs nested in its equations."""
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
          yield from eqns(sub)


def in_dtypes(eqn) -> tuple[np.dtype, ...]:
  return tuple(np.dtype(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype"))


def out_dtype(eqn) -> np.dtype:
  return np.dtype(eqn.outvars[0].aval.dtype)


def products(jaxpr) -> list:
  """The dot_general and conv_general_dilated equations of ``jaxpr``."""
  return [e for e in eqns(jaxpr) if e.primitive.name in ("dot_general", "conv_general_dilated")]


def check_lean_products(jaxpr, narrow: np.dtype = BF16, *, wide: int = 0) -> int:
  """Asserts every matmul/conv on ``narrow`` operands is a 16-bit product.

  Both operands are ``narrow`` and so is the result, as in a Flax layer built
  with ``dtype=narrow`` (the backends accumulate such products in fp32; see
  :func:`jmp_lite.flax.dot_general`), except exactly ``wide`` fp32 results (the
  layer computing a model's fp32 output). No dot declares a precision (every
  backend accumulates them in fp32 undeclared). Returns how many products
  there are, so that callers can check the test is not vacuous.
  """
  count = found_wide = 0
  for eqn in products(jaxpr):
    dtypes = in_dtypes(eqn)
    if narrow not in dtypes:
      continue
    assert dtypes == (narrow, narrow), f"mixed operands {dtypes} in {eqn}"
    if out_dtype(eqn) == F32:
      found_wide += 1
    else:
      assert out_dtype(eqn) == narrow, f"a {out_dtype(eqn)} result: {eqn}"
      assert eqn.params["preferred_element_type"] in (None, narrow), eqn
    if eqn.primitive.name == "dot_general":
      assert eqn.params["precision"] is None, f"precision {eqn.params['precision']}: {eqn}"
    count += 1
  assert found_wide == wide, f"{found_wide} fp32 results, expected {wide}"
  return count


_HLO_OP = re.compile(
  r"stablehlo\.(dot_general|convolution)\b(.*?):\s*\(tensor<([^>]*)>,\s*tensor<([^>]*)>\)"
  r"\s*->\s*tensor<([^>]*)>"
)


def hlo_products(text: str) -> list[tuple[str, str, str, str, str]]:
  """(op, attributes, lhs type, rhs type, result type) of every dot/conv in StableHLO text."""
  return [m.groups() for m in _HLO_OP.finditer(text)]


def check_hlo_products(text: str, narrow: str = "bf16", *, wide: int = 0) -> int:
  """Asserts every dot/conv with ``narrow`` operands in lowered HLO is a 16-bit product.

  Exactly ``wide`` of them return f32, and none declares an algorithm.
  """
  count = found_wide = 0
  ops = hlo_products(text)
  assert ops, "no dot_general/convolution found in the HLO"
  for op, attributes, lhs, rhs, result in ops:
    if lhs.endswith(narrow) or rhs.endswith(narrow):
      assert lhs.endswith(narrow) and rhs.endswith(narrow), (op, lhs, rhs)
      if result.endswith("f32"):
        found_wide += 1
      else:
        assert result.endswith(narrow), f"{op} ({lhs}, {rhs}) -> {result}"
      assert "algorithm" not in attributes, (op, attributes)
      count += 1
  assert found_wide == wide, f"{found_wide} f32 results, expected {wide}"
  return count


def island_activation_dtypes(jaxpr) -> set[np.dtype]:
  """The dtypes of the activations (arrays of rank 2 or more) that enter or leave a checkpoint
  (a recomputed island), forward and backward."""
  dtypes = set()
  for eqn in eqns(jaxpr):
    if eqn.primitive.name in ("remat2", "checkpoint"):
      for var in (*eqn.invars, *eqn.outvars):
        aval = var.aval
        if jnp.issubdtype(aval.dtype, jnp.floating) and len(aval.shape) >= 2:
          dtypes.add(np.dtype(aval.dtype))
  return dtypes


def primitive_dtypes(jaxpr, name: str) -> set[np.dtype]:
  """Output dtypes of every equation of primitive ``name``."""
  return {out_dtype(e) for e in eqns(jaxpr) if e.primitive.name == name}


def rel_error(a, b) -> float:
  """max |a - b| / max |b| over a whole pytree (one scale for all leaves)."""
  a = [np.asarray(x, np.float64) for x in jax.tree.leaves(a)]
  b = [np.asarray(x, np.float64) for x in jax.tree.leaves(b)]
  num = max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))
  return num / max(float(np.max(np.abs(y))) for y in b)


def leaf_rel_errors(ours, ref) -> dict[str, float]:
  """``||ours - ref|| / ||ref||`` (Frobenius norms) of each leaf, keyed by its path.

  A leaf whose reference is exactly zero gets 0 if ``ours`` is zero too, else inf: a
  relative error cannot excuse a gradient the reference does not have.
  """
  flat_ref, treedef = jax.tree_util.tree_flatten_with_path(ref)
  flat_ours = treedef.flatten_up_to(ours)
  errors = {}
  for (path, r), o in zip(flat_ref, flat_ours, strict=True):
    r, o = np.asarray(r, np.float64), np.asarray(o, np.float64)
    assert o.shape == r.shape, (jax.tree_util.keystr(path), o.shape, r.shape)
    num, den = float(np.linalg.norm(o - r)), float(np.linalg.norm(r))
    errors[jax.tree_util.keystr(path)] = num / den if den else (0.0 if num == 0 else np.inf)
  return errors


def explicit_dtype_warnings(fn, *args) -> list[str]:
  """The messages of the ExplicitDtypeWarnings ``fn(*args)`` issues, every one counted."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")  # no deduplication
    fn(*args)
  return [str(w.message) for w in caught if w.category is jlf.ExplicitDtypeWarning]
