"""Argument checks shared across the package (private).

Each check takes the value and the name the caller knows it by, and raises
TypeError (wrong kind) or ValueError (right kind, wrong value) with a message
that names both.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _compat
from jmp_lite import _dtypes as dtypes

T = TypeVar("T")


def is_concrete(x) -> bool:
  """Whether ``x`` has a value now, i.e. is not traced.

  Args:
    x: anything.

  Returns:
    False for a tracer (inside ``jit``, ``grad``...), True otherwise.
  """
  return not _compat.is_tracer(x)


def as_scale(
  value: jax.typing.ArrayLike,
  name: str,
  *,
  warn_integer: bool = False,
  expected: str = "a positive number or a scalar array",
) -> jax.Array:
  """Converts a loss scale to a strongly typed floating scalar and checks it.

  Args:
    value: a number or scalar array, possibly traced (then only its type and
      shape are checked).
    name: the argument's name, for the error messages.
    warn_integer: warn when an integer scale is converted to float32, as
      jmp's ``DynamicLossScale`` does.
    expected: what ``value`` may be, for the TypeError.

  Returns:
    A scalar array of ``value``'s floating dtype (float32 for an integer).
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (numbers.Real, np.ndarray, np.generic, jax.Array)
  ):
    raise TypeError(f"{name} must be {expected}, got {type(value).__name__}.")
  if np.dtype(getattr(value, "dtype", None)) == np.bool_:
    raise TypeError(f"{name} must be {expected}, got a bool array.")
  scale = jnp.asarray(value)
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    if not jnp.issubdtype(scale.dtype, jnp.integer):
      raise TypeError(f"{name} must be a real number, got dtype {scale.dtype}.")
    if warn_integer:
      # jmp's wording, so that filters written for jmp's warning still match.
      warnings.warn(
        f"Expected floating type for {name}, got {scale.dtype}; it is converted to float32. "
        f"Pass a float (2.0 ** 15, or jnp.float32(2 ** 15)) to keep this dtype explicit.",
        stacklevel=4,  # _as_scale <- __post_init__ <- __init__ <- the caller
      )
    scale = scale.astype(jnp.float32)
  # A weakly typed scale would change type after the first adjust() and force
  # jit to retrace; an explicit dtype makes it strong.
  scale = jnp.asarray(scale, dtype=scale.dtype)
  if scale.shape != ():
    raise ValueError(f"{name} must be a scalar, got shape {scale.shape}.")
  if is_concrete(scale) and not (np.isfinite(float(scale)) and float(scale) > 0):
    raise ValueError(f"{name} must be positive and finite, got {float(scale)}.")
  return scale


def as_real(value: Any, name: str, expected: str) -> float:
  """Converts a static real number (configuration, not traced) to a Python float.

  Args:
    value: a concrete number or real scalar array, not a bool.
    name: the argument's name, for the error messages.
    expected: what ``name`` must be, for the TypeError (``"a positive number"``).

  Returns:
    ``value`` as a Python float (range checks are the caller's).
  """
  if _compat.is_tracer(value):
    raise TypeError(
      f"{name} is static configuration and must be a concrete number, got a traced value; "
      "build the object outside jit or pass a Python float."
    )
  real = not isinstance(value, (bool, np.bool_)) and isinstance(
    value, (numbers.Real, np.ndarray, np.generic, jax.Array)
  )
  array = np.asarray(value) if real else None
  if array is None or not (
    jnp.issubdtype(array.dtype, jnp.integer) or jnp.issubdtype(array.dtype, jnp.floating)
  ):
    raise TypeError(f"{name} must be {expected}, got {value!r}.")
  if array.shape != ():
    raise ValueError(f"{name} must be a scalar, got shape {array.shape}.")
  return float(array)


def as_bound(
  value: Any,
  name: str,
  dtype: np.dtype,
  *,
  allow_zero: bool = False,
  warn_integer: bool = False,
) -> float:
  """Converts a static bound to a Python float representable in ``dtype``.

  Args:
    value: a concrete positive finite number (or 0 with ``allow_zero``).
    name: the argument's name, for the error messages.
    dtype: the dtype the bound is compared in.
    allow_zero: also accept 0 (jmp accepts a zero ``min_loss_scale``).
    warn_integer: warn, with jmp's wording, when ``value`` is an integer, as
      jmp's ``DynamicLossScale`` does for ``min_loss_scale``.

  Returns:
    ``value`` as a Python float.
  """
  bound = as_real(value, name, "a positive number")
  if warn_integer and not jnp.issubdtype(np.asarray(value).dtype, jnp.floating):
    warnings.warn(
      f"Expected floating type for {name}, got {jnp.asarray(value).dtype}; it is converted "
      f"to the float {bound}. Pass a float to keep this explicit.",
      stacklevel=4,  # as_bound <- __post_init__ <- __init__ <- the caller
    )
  with np.errstate(over="ignore"):
    rounded = float(np.asarray(bound, dtype=dtype))
  if allow_zero and bound == 0:
    return 0.0
  accepted = "a finite number >= 0" if allow_zero else "positive and finite"
  if not (math.isfinite(bound) and bound > 0):
    raise ValueError(f"{name} must be {accepted}, got {bound}.")
  if not (math.isfinite(rounded) and rounded > 0):
    raise ValueError(
      f"{name}={bound} is not representable in the loss scale's dtype "
      f"{np.dtype(dtype).name} (it rounds to {rounded})."
    )
  return bound


def as_bounds(value: Any, name: str, count: int, dtype: np.dtype) -> tuple[float, ...]:
  """Converts one static bound per stage, each checked as by :func:`as_bound`.

  Args:
    value: one bound for every stage, or a sequence of ``count`` bounds.
    name: the argument's name, for the error messages.
    count: the number of stages.
    dtype: the dtype the bounds are compared in.

  Returns:
    ``count`` Python floats.
  """
  if np.ndim(value) == 0:
    return (as_bound(value, name, dtype),) * count
  if np.shape(value) != (count,):
    raise ValueError(f"{name} must be a scalar or one value per stage ({count}), got {value!r}.")
  return tuple(as_bound(v, name, dtype) for v in value)


@overload
def check_int(value: Any, name: str, minimum: int | None) -> int: ...
@overload
def check_int(value: Any, name: str, minimum: int | None, *, optional: bool) -> int | None: ...
def check_int(value: Any, name: str, minimum: int | None, *, optional: bool = False) -> int | None:
  """Checks a static integer setting.

  Args:
    value: a Python or NumPy integer (not a bool).
    name: the argument's name, for the error messages.
    minimum: the smallest value allowed; ``None`` for no bound.
    optional: also accept ``None`` (returned as is).

  Returns:
    ``value`` as a Python int (``None`` for ``None`` with ``optional``).
  """
  if optional and value is None:
    return None
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    expected = "an int" if minimum is None else f"an int >= {minimum}"
    raise TypeError(f"{name} must be {expected}{' or None' if optional else ''}, got {value!r}.")
  if minimum is not None and value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")
  return int(value)


def check_bool(value: Any, name: str) -> bool:
  """Checks a static switch.

  Args:
    value: a Python or NumPy bool.
    name: the argument's name, for the error message.

  Returns:
    ``value`` as a Python bool.
  """
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}.")
  return bool(value)


def check_type(value: T, accepted: type | tuple[type, ...], message: str) -> T:
  """Checks that a setting is of a type the caller accepts.

  Args:
    value: the argument given.
    accepted: the types it may have, as for :func:`isinstance`.
    message: the TypeError's words before the value: what the caller accepts,
      e.g. ``"get_policy expects a string such as 'p=f32,c=bf16,o=f32'"``.

  Returns:
    ``value``, if it is an instance of ``accepted``.

  Raises:
    TypeError: ``"{message}, got {value!r} of type {its type's name}."`` otherwise.
  """
  if not isinstance(value, accepted):
    raise TypeError(f"{message}, got {value!r} of type {type(value).__name__}.")
  return value


def check_predicate(pred: Any, name: str) -> jax.Array:
  """Checks a boolean scalar at trace time (works on tracers).

  Args:
    pred: a boolean scalar, e.g. whether the gradients are finite.
    name: the argument's name, for the error messages.

  Returns:
    ``pred`` as a bool array of shape ``()``.
  """
  pred = jnp.asarray(pred)
  if pred.dtype != jnp.bool_:
    raise TypeError(f"{name} must be a boolean scalar, got dtype {pred.dtype}.")
  if pred.shape != ():
    raise ValueError(f"{name} must be a boolean scalar, got shape {pred.shape}.")
  return pred


def check_choice(
  value: Any, name: str, choices: tuple[str, ...], *, type_error: bool = True
) -> str:
  """Checks a string option.

  Args:
    value: the option given.
    name: the argument's name, for the error messages.
    choices: the accepted strings.
    type_error: a value that is not a string raises TypeError (default); with
      False, the ValueError of any other value outside ``choices``.

  Returns:
    ``value``, if it is one of ``choices``; TypeError or ValueError otherwise.
  """
  if isinstance(value, str) and value in choices:
    return value
  error = TypeError if type_error and not isinstance(value, str) else ValueError
  raise error(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}.")


def check_dtype(
  value: Any,
  name: str,
  accepted: Callable[[np.dtype], bool],
  expected: str,
  *,
  as_given: bool = False,
) -> np.dtype:
  """Parses a dtype setting and checks that it is one the caller accepts.

  Args:
    value: a dtype name or dtype-like object (see :func:`jmp_lite.parse_dtype`).
    name: the argument's name, for the error messages.
    accepted: whether a parsed dtype is allowed here.
    expected: what ``name`` must be, for the ValueError (``"an fp8 format"``).
    as_given: name ``value`` in the error as it was given (``'bf16'``) rather
      than by the dtype it parses to (``bfloat16``).

  Returns:
    The ``np.dtype``.

  Raises:
    TypeError, ValueError: :func:`jmp_lite.parse_dtype`'s, for what is not a
      floating dtype; ValueError naming ``value`` and ``expected`` for one that
      is not accepted.
  """
  dtype = dtypes.parse_dtype(value)
  if not accepted(dtype):
    got = repr(value) if as_given else dtype.name
    raise ValueError(f"{name} must be {expected}, got {got}.")
  return dtype
