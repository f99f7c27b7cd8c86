r"""Rounding fp32 values to 16 bits: stochastically, or exactly in two halves.

Round-to-nearest moves a bf16 value only when the change exceeds half its unit
in the last place, about :math:`2^{-9}` of the value: smaller parameter updates
are lost. Two remedies live here.

* :func:`stochastic_round` rounds up or down with probabilities that make the
  result exact *in expectation*: with :math:`\lfloor x \rfloor` and
  :math:`\lceil x \rceil` the neighbouring values of the format,

  .. math::

    P\big(\mathrm{sr}(x) = \lceil x \rceil\big) =
      \frac{x - \lfloor x \rfloor}{\lceil x \rceil - \lfloor x \rfloor},
    \qquad \mathbb{E}\,\mathrm{sr}(x) = x.

* :func:`split_float32` cuts an fp32 value into a bf16 value (the nearest one)
  and the 16-bit integer that :func:`join_float32` needs to rebuild the fp32
  value bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jmp_lite import _validation

# The public names; `jmp_lite` re-exports them.
__all__ = ["stochastic_round"]


def stochastic_round(x: jax.Array, dtype: jnp.dtype, key: jax.Array) -> jax.Array:
  r"""Rounds ``x`` to ``dtype`` up or down at random, exact in expectation.

  The result is one of the two values of ``dtype`` around ``x``, the farther one
  with probability proportional to the distance from the nearer one, so
  :math:`\mathbb{E}[\mathrm{sr}(x)] = x`: exactly from fp32 to bf16 (16 random
  bits for the 16 that bf16 drops), to the 23 bits of uniform noise otherwise.
  A value of ``dtype`` stays as it is; inf and NaN stay; a value beyond the
  largest finite one rounds to that or to inf as round-to-nearest does; the
  noise never pushes a finite value to inf.

  Args:
    x: the values (fp32, or any float that ``dtype`` is narrower than).
    dtype: the floating dtype to round to, e.g. ``jnp.bfloat16``.
    key: a PRNG key; the same key gives the same rounding.

  Returns:
    ``x`` rounded to ``dtype``.

  >>> x = jnp.full((10000,), 1.0 + 2.0**-10)  # between bf16's 1 and 1 + 2**-7
  >>> y = stochastic_round(x, jnp.bfloat16, jax.random.key(0))
  >>> sorted(set(y.tolist()))
  [1.0, 1.0078125]
  >>> round(float(y.astype(jnp.float32).mean()), 4)  # 1 + 2**-10 = 1.000977
  1.001
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"stochastic_round rounds floating values, got x of dtype {x.dtype.name}.")
  dtype = _validation.check_dtype(
    dtype,
    "dtype",
    lambda d: d.itemsize < x.dtype.itemsize,
    f"a floating format narrower than x's {x.dtype.name}",
  )
  return stochastic_round_seeded(x, dtype, jax.random.bits(key, (), jnp.uint32))


def stochastic_round_seeded(x: jax.Array, dtype: jnp.dtype, seed: jax.Array) -> jax.Array:
  """:func:`stochastic_round` with its noise from a uint32 ``seed`` instead of a key.

  One JAX draw gives the seeds of many arrays at once: on CPU every Threefry call is a loop of
  its own, and a draw per array of an optimizer state cost several percent of a training step.
  """
  nearest = x.astype(dtype)
  bits = _counter_hash(seed, x.shape)
  if x.dtype == jnp.float32 and dtype == jnp.bfloat16:
    return _stochastic_round_bf16(x, nearest, bits)
  wide = nearest.astype(x.dtype)
  toward = jnp.where(x > wide, jnp.inf, -jnp.inf).astype(dtype)
  other = jnp.nextafter(nearest, toward)
  # |x - wide| is at most half of |gap|, so P(other) is in [0, 1/2]; both differences are exact
  # in x's format. Beyond the largest finite value the gap is inf and P(other) is 0.
  p_other = (x - wide) / (other.astype(x.dtype) - wide)
  # Uniform on [0, 1) in steps of 2^-23, in fp32 at least (fp16 cannot count to 2^23).
  noise = (bits >> 9).astype(jnp.promote_types(x.dtype, jnp.float32)) * 2.0**-23
  return jnp.where(noise < p_other, other, nearest)


def _stochastic_round_bf16(x: jax.Array, nearest: jax.Array, noise: jax.Array) -> jax.Array:
  """fp32 to bf16 on the bits: adding 16 random bits to the 16 that bf16 drops, then dropping
  them, rounds the magnitude up with probability exactly (dropped bits) / 2^16."""
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  high = ((bits + (noise >> 16)) >> 16).astype(jnp.uint16)
  rounded = lax.bitcast_convert_type(high, jnp.bfloat16)
  # NaN stays NaN (its bits could carry into the sign), and noise never turns a finite value
  # into inf: both take round-to-nearest's result.
  keep = jnp.isnan(x) | (jnp.isinf(rounded) & jnp.isfinite(x))
  return jnp.where(keep, nearest, rounded)


def _counter_hash(seed: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """32 random bits per element: a uint32 ``seed`` mixed with the element's index.

  A few integer operations per element (the finalizer of MurmurHash3 over
  ``index * golden ratio + seed``): on CPU, Threefry bits for every element cost more than
  the rest of an optimizer step. The index is the element's position in the whole array, so
  the bits do not depend on how the array is sharded.
  """
  h = jnp.zeros(shape, jnp.uint32)  # the row-major index, built per axis so it shards as x does
  stride = 1
  for axis in reversed(range(len(shape))):
    h = h + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
    stride *= shape[axis]
  h = h * jnp.uint32(0x9E3779B1) + seed
  h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def split_float32(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Cuts fp32 ``x`` into its nearest bf16 value and the int16 rest of its bits.

  The bf16 value is ``x`` rounded to nearest, ties away from zero (XLA's cast
  breaks ties to even: the two differ on one value in 65536). The rest is the
  signed difference of the bit patterns, so :func:`join_float32` is exact.

  Args:
    x: fp32 values.

  Returns:
    ``(high, low)``: bf16 and int16 arrays of ``x``'s shape.
  """
  bits = lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)
  # Rounding the bit pattern to a multiple of 2^16 rounds the magnitude to nearest.
  high = (bits + 0x8000) >> 16
  low = bits - (high << 16)
  return lax.bitcast_convert_type(high.astype(jnp.int16), jnp.bfloat16), low.astype(jnp.int16)


def join_float32(high: jax.Array, low: jax.Array) -> jax.Array:
  """The fp32 values that :func:`split_float32` cut into ``high`` and ``low``.

  Args:
    high: bf16 values.
    low: int16 values of the same shape.

  Returns:
    fp32 values, bit for bit those that were split.
  """
  high_bits = lax.bitcast_convert_type(high, jnp.int16).astype(jnp.int32)
  return lax.bitcast_convert_type((high_bits << 16) + low.astype(jnp.int32), jnp.float32)
