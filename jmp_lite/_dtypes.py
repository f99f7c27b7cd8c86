"""Facts about the floating-point formats mixed precision training uses.

Every number here comes from :func:`jax.numpy.finfo` (backed by ml_dtypes), so
the table cannot drift from what XLA does. The facts that drive loss scaling:
float16 holds magnitudes from 2^-24 (smallest subnormal) to 65504, so small
gradients underflow unless the loss is scaled up; bfloat16 has float32's
exponent range and 8 bits of precision; the fp8 formats trade range (E5M2) for
precision (E4M3) and need per-tensor scales.
"""

from __future__ import annotations

import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

DTypeLike = Any  # a dtype name, np.dtype, or scalar type such as jnp.bfloat16
ScalarType = Any  # a JAX scalar type such as jnp.bfloat16 (typed Any in jax.numpy's stubs)


class FormatInfo(NamedTuple):
  """Range and precision of one floating-point format.

  Attributes:
    name: the canonical dtype name, e.g. ``"float16"``.
    dtype: the ``np.dtype``.
    exponent_bits: the width of the exponent field.
    mantissa_bits: the explicitly stored fraction bits.
    max: the largest finite value.
    min_normal: the smallest positive normal value.
    min_subnormal: the smallest positive (subnormal) value.
    epsilon: the gap between 1.0 and the next larger value.
    bits: the total width, ``1 + exponent_bits + mantissa_bits``.

  >>> info = FORMATS["float16"]
  >>> info.max, info.min_subnormal == 2.0**-24, info.epsilon == 2.0**-10
  (65504.0, True, True)
  """

  name: str
  dtype: np.dtype
  exponent_bits: int
  mantissa_bits: int
  max: float
  min_normal: float
  min_subnormal: float
  epsilon: float
  bits: int


def _format_info(dtype: np.dtype) -> FormatInfo:
  info = jnp.finfo(dtype)
  return FormatInfo(
    name=dtype.name,
    dtype=dtype,
    exponent_bits=int(info.nexp),
    mantissa_bits=int(info.nmant),
    max=float(info.max),
    min_normal=float(info.smallest_normal),
    min_subnormal=float(info.smallest_subnormal),
    epsilon=float(info.eps),
    bits=int(info.bits),
  )


FLOAT8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))

FORMATS: types.MappingProxyType[str, FormatInfo] = types.MappingProxyType(
  {
    info.name: info
    for info in map(
      _format_info,
      (
        np.dtype(jnp.float32),
        np.dtype(jnp.float16),
        np.dtype(jnp.bfloat16),
        *FLOAT8_DTYPES,
      ),
    )
  }
)
"""The formats that matter for mixed precision, keyed by canonical dtype name."""

# Canonical short name first: it is the one `str(Policy)` writes.
_NAMES: dict[np.dtype, tuple[str, ...]] = {
  np.dtype(jnp.float32): ("f32", "float32", "full", "fp32"),
  np.dtype(jnp.float16): ("f16", "float16", "fp16"),
  np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
  np.dtype(jnp.float64): ("f64", "float64", "fp64"),
  np.dtype(jnp.float8_e4m3fn): ("f8e4m3", "float8_e4m3fn", "e4m3", "fp8_e4m3"),
  np.dtype(jnp.float8_e5m2): ("f8e5m2", "float8_e5m2", "e5m2", "fp8_e5m2"),
}
_BY_NAME = {name: dtype for dtype, names in _NAMES.items() for name in names}
ACCEPTED_NAMES: tuple[str, ...] = (*_BY_NAME, "half")


def format_info(dtype: DTypeLike) -> FormatInfo:
  """Returns the range and precision of a floating dtype.

  Args:
    dtype: a name or dtype-like object, as :func:`parse_dtype` accepts.

  Returns:
    The :class:`FormatInfo` of the dtype, read from :func:`jax.numpy.finfo`.

  >>> format_info("f16").max
  65504.0
  """
  return _format_info(parse_dtype(dtype))


def parse_dtype(value: DTypeLike) -> np.dtype:
  """Returns the floating ``np.dtype`` named by ``value``.

  Args:
    value: a name (``"bf16"``, ``"bfloat16"``, ``"f16"``, ``"float16"``,
      ``"f32"``, ``"float32"``, ``"full"``, ``"f64"``, ``"float64"``,
      ``"half"``, ``"float8_e4m3fn"``, ``"float8_e5m2"`` and the short forms
      ``"fp16"``, ``"fp32"``, ``"e4m3"``, ``"e5m2"``...; the error for an unknown
      name lists them all; case and surrounding whitespace are ignored) or
      any dtype-like object (``np.dtype``, ``jnp.bfloat16``, ``np.float32``).

  Returns:
    The ``np.dtype``; ``"half"`` is :func:`half_dtype` of the default device.

  Raises:
    ValueError: for an unknown name.
    TypeError: for a dtype that is not floating point.

  >>> parse_dtype("bf16"), parse_dtype(" Float16 "), parse_dtype(jnp.float32)
  (dtype(bfloat16), dtype('float16'), dtype('float32'))
  """
  if value is None:  # np.dtype(None) would silently mean float64
    raise TypeError(
      f"Expected a floating dtype or one of the names {', '.join(ACCEPTED_NAMES)}; got None."
    )
  if isinstance(value, str):
    name = value.strip().lower()
    if name == "half":
      return np.dtype(half_dtype())
    if name not in _BY_NAME:
      try:
        dtype = np.dtype(name)
      except TypeError:
        dtype = None
      if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
          f"{value!r} is not a floating-point dtype; accepted names: {', '.join(ACCEPTED_NAMES)}."
        )
      raise ValueError(
        f"Unknown dtype name {value!r}; accepted names: {', '.join(ACCEPTED_NAMES)}."
      )
    return _BY_NAME[name]
  try:
    dtype = np.dtype(value)
  except TypeError as e:
    raise TypeError(
      f"Expected a floating dtype or one of the names {', '.join(ACCEPTED_NAMES)}; "
      f"got {value!r} of type {type(value).__name__}."
    ) from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"Expected a floating-point dtype, got {dtype.name} (from {value!r}).")
  return dtype


def dtype_name(dtype: DTypeLike) -> str:
  """Returns the canonical short name of a dtype, the inverse of :func:`parse_dtype`.

  Args:
    dtype: a name or dtype-like object, as :func:`parse_dtype` accepts.

  Returns:
    The name ``str(Policy)`` writes (``"bf16"``, ``"f16"``, ``"f32"``...), or
    NumPy's name for a floating dtype without a short one.

  >>> dtype_name("bfloat16"), dtype_name(np.float32)
  ('bf16', 'f32')
  """
  dtype = parse_dtype(dtype)
  names = _NAMES.get(dtype)
  return names[0] if names else dtype.name


def is_float8(dtype: DTypeLike) -> bool:
  """Whether ``dtype`` is one of the 8-bit floating formats.

  Args:
    dtype: a dtype-like object (not a name).

  Returns:
    True for a floating dtype one byte wide, e.g. ``jnp.float8_e4m3fn``.

  >>> is_float8(jnp.float8_e5m2), is_float8(jnp.bfloat16)
  (True, False)
  """
  return jnp.issubdtype(np.dtype(dtype), jnp.floating) and np.dtype(dtype).itemsize == 1


def scalar_type(dtype: DTypeLike) -> ScalarType:
  """Returns the JAX scalar type of a floating dtype: ``jnp.float16`` for ``"f16"``.

  This is what jmp's policies and ``half_dtype()`` hold, and so what
  :class:`jmp_lite.Policy` holds: a type that is callable (``jnp.float16(2.0)``
  is a float16 array), that finds the dict keys ``jnp.float16`` and
  ``np.float16``, that compares equal to ``np.dtype("float16")`` and that
  ``jnp.dtype(...)`` turns into that ``np.dtype``.

  Args:
    dtype: a name or dtype-like object, as :func:`parse_dtype` accepts.

  Returns:
    The ``jax.numpy`` scalar type of that dtype, or NumPy's for a floating
    dtype ``jax.numpy`` has no name for (long double).

  >>> scalar_type("bf16") is jnp.bfloat16, scalar_type(np.dtype("float16")) is jnp.float16
  (True, True)
  >>> scalar_type("f16")(3.0).dtype.name
  'float16'
  """
  dtype = parse_dtype(dtype)
  scalar = getattr(jnp, dtype.name, None)
  if isinstance(scalar, type) and np.dtype(scalar) == dtype:
    return scalar
  # A floating dtype jax.numpy has no name for (NumPy's longdouble): NumPy's
  # scalar type is callable and hashable too.
  return dtype.type


def half_dtype_for(platform: str, compute_capability: str | None = None) -> ScalarType:
  """The native 16-bit format of a platform: what "half" means there.

  bfloat16 on TPU, CPU and GPUs with native bf16 arithmetic (NVIDIA compute
  capability 8.0 and newer, AMD); float16 on NVIDIA GPUs older than Ampere,
  where bf16 is emulated and slow.

  Args:
    platform: ``"cpu"``, ``"gpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"``.
    compute_capability: the device's ``compute_capability`` attribute, e.g.
      ``"7.0"`` (NVIDIA) or ``"gfx90a"`` (AMD); only read on GPUs.

  Returns:
    The JAX scalar type ``jnp.bfloat16`` or ``jnp.float16``, as jmp's
    ``half_dtype`` returns.

  Raises:
    ValueError: for another platform.

  >>> half_dtype_for("gpu", "7.0") is jnp.float16
  True
  """
  platform = platform.lower()
  if platform in ("tpu", "cpu", "rocm"):
    return jnp.bfloat16
  if platform not in ("gpu", "cuda"):
    raise ValueError(f"Unknown platform {platform!r}; expected cpu, gpu, cuda, rocm or tpu.")
  major = str(compute_capability or "").split(".")[0]
  if major.isdigit() and int(major) < 8:
    return jnp.float16
  return jnp.bfloat16


def half_dtype(device: jax.Device | None = None) -> ScalarType:
  """The native 16-bit format of ``device``.

  Unlike jmp, which returns float16 everywhere but TPU, this returns bfloat16
  wherever the hardware computes it natively: on TPU, CPU, AMD GPUs and NVIDIA
  GPUs of compute capability 8.0 and newer; float16 on older NVIDIA GPUs, where
  bf16 is emulated and slow.

  Args:
    device: a JAX device (default: the first local device).

  Returns:
    The JAX scalar type ``jnp.bfloat16`` or ``jnp.float16``, as in jmp: so
    ``half_dtype()(2 ** 15)`` is an array and ``jnp.dtype(half_dtype())`` the
    ``np.dtype``.

  >>> half_dtype(jax.devices("cpu")[0]) is jnp.bfloat16
  True
  """
  device = device or jax.local_devices()[0]
  return half_dtype_for(device.platform, getattr(device, "compute_capability", None))
