"""Shared models and program census of the autocast tests (tests/test_autocast_*.py)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite as jl
from jmp_lite import _jaxpr

POLICY = jl.get_policy("params=float32,compute=bfloat16,output=float32")
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)


def census(closed) -> dict[str, set[str]]:
  """Primitive name -> the dtypes of its floating operands, nested jaxprs included."""
  found = collections.defaultdict(set)

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      for atom in eqn.invars:
        dtype = _jaxpr.dtype_of(atom)
        if dtype is not None and jnp.issubdtype(dtype, jnp.floating):
          found[eqn.primitive.name].add(dtype.name)
      for sub in _jaxpr.sub_jaxprs(eqn):
        visit(sub.jaxpr)

  visit(closed.jaxpr)
  return dict(found)


def rmsnorm(x, scale):
  ms = jnp.mean(x * x, axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(ms + 1e-6) * scale


def block(params, x):
  """A transformer block with its own softmax and a hand-written RMSNorm."""
  h = rmsnorm(x, params["scale"])
  q, k, v = h @ params["wq"], h @ params["wk"], h @ params["wv"]
  p = jax.nn.softmax(q @ k.T / q.shape[-1] ** 0.5, axis=-1)
  x = x + (p @ v) @ params["wo"]
  return x + jax.nn.gelu(rmsnorm(x, params["scale"]) @ params["w1"]) @ params["w2"]


def block_params(d=16, seed=0):
  keys = jax.random.split(jax.random.key(seed), 7)
  shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, 2 * d)}
  params = {
    n: jax.random.normal(k, s) / np.sqrt(s[0])
    for (n, s), k in zip(shapes.items(), keys[:5], strict=True)
  }
  params["w2"] = jax.random.normal(keys[5], (2 * d, d)) / np.sqrt(2 * d)
  params["scale"] = 1 + 0.1 * jax.random.normal(keys[6], (d,))
  return params


def hand_written(fun, policy=POLICY):
  """``fun`` with pure casts: every op runs in the dtype its 16-bit inputs have."""
  return lambda *args: policy.cast_to_output(fun(*policy.cast_to_compute(args)))


def rel_err(a, b) -> float:
  a, b = (np.asarray(t, np.float64) for t in (a, b))
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def saved_residuals(fun, *args):
  """The (dtype, shape) of every value the backward pass of ``fun`` keeps, args aside."""
  from jax._src.ad_checkpoint import saved_residuals as residuals

  return sorted(
    (aval.dtype.name, tuple(aval.shape))
    for aval, why in residuals(fun, *args)
    if "argument" not in why and aval.shape
  )


def residual_bytes(fun, *args):
  from jax._src.ad_checkpoint import saved_residuals as residuals

  found = residuals(lambda *a: fun(*a).sum(), *args)
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, why in found if "argument" not in why)


def all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _jaxpr.sub_jaxprs(eqn):
      yield from all_eqns(sub.jaxpr)
