"""Quantization to an fp8 format with a per-tensor scale (private)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jmp_lite import _dtypes as dtypes
from jmp_lite._fp8_config import F32, as_fp8_dtype


def compute_amax(x: jax.typing.ArrayLike) -> jax.Array:
  r"""The absolute maximum :math:`\max_i |x_i|` as a float32 scalar.

  Args:
    x: an array of any shape.

  Returns:
    A float32 scalar: 0 for an empty array, NaN if ``x`` holds a NaN.

  >>> float(compute_amax(jnp.array([-3.0, 2.0])))
  3.0
  """
  x = jnp.asarray(x)
  return jnp.max(jnp.abs(x), initial=0).astype(F32)


def quantize(x: jax.typing.ArrayLike, scale: jax.typing.ArrayLike, dtype: Any) -> jax.Array:
  r"""Returns ``x / scale`` rounded to the fp8 ``dtype``, saturating finite values.

  .. math:: q = \mathrm{fp8}\big(\mathrm{sat}(x / s)\big)

  The division is done in float32 and rounds to nearest even. :math:`\mathrm{sat}`
  clips finite values beyond the format's range to :math:`\pm` max (the amax
  grew since the scale was computed); inf and NaN stay non-finite (NaN in
  ``float8_e4m3fn``, which has no inf), so an overflow upstream still reaches
  the finiteness check of :func:`jmp_lite.loss_scaling` instead of being
  clipped into a finite value.

  Args:
    x: a floating array.
    scale: :math:`s`, the value of one fp8 unit (a scalar, or broadcastable
      to ``x``).
    dtype: the fp8 format (``float8_e4m3fn`` or ``float8_e5m2``).

  Returns:
    The fp8 array :math:`q`, shaped like ``x``.

  >>> quantize(jnp.array([1.0, 500.0]), 0.5, "float8_e4m3fn").tolist()
  [2.0, 448.0]
  """
  dtype = as_fp8_dtype(dtype, "dtype")
  fp8_max = dtypes.FORMATS[dtype.name].max
  x = jnp.asarray(x).astype(F32)
  y = x / jnp.asarray(scale, F32)
  return jnp.where(jnp.isfinite(x), jnp.clip(y, -fp8_max, fp8_max), y).astype(dtype)


def dequantize(q: jax.typing.ArrayLike, scale: jax.typing.ArrayLike, dtype: Any = F32) -> jax.Array:
  r"""Returns :math:`q \cdot s` (computed in float32) in ``dtype``.

  Args:
    q: an fp8 array (any array is accepted).
    scale: :math:`s`, the scale ``q`` was quantized with.
    dtype: the result dtype (default float32).

  Returns:
    ``q * scale`` in ``dtype``.
  """
  q = jnp.asarray(q)
  return (q.astype(F32) * jnp.asarray(scale, F32)).astype(dtype)


def quantize_dequantize(
  x: jax.typing.ArrayLike, scale: jax.typing.ArrayLike, dtype: Any
) -> jax.Array:
  r"""The fp8 value of ``x``: :math:`s \cdot \mathrm{fp8}(\mathrm{sat}(x / s))` in x's dtype.

  Args:
    x: a floating array.
    scale: :math:`s`.
    dtype: the fp8 format.

  Returns:
    ``dequantize(quantize(x, scale, dtype), scale, x.dtype)``.

  >>> quantize_dequantize(jnp.array([0.3]), 1.0, "float8_e4m3fn").tolist()
  [0.3125]
  """
  x = jnp.asarray(x)
  return dequantize(quantize(x, scale, dtype), scale, x.dtype)
