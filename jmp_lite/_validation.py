"""Argument checks shared across the package (private).

Each check takes the value and the name the caller knows it by, and raises
TypeError (wrong kind) or ValueError (right kind, wrong value) with a message
that names both.
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
  """Whether ``x`` has a value now, i.e. is not traced.

  Args:
    x: anything.

  Returns:
    False for a tracer (inside ``jit``, ``grad``...), True otherwise.
  """
  return not isinstance(x, jax.core.Tracer)


def as_scale(value: jax.typing.ArrayLike, name: str, *, warn_integer: bool = False) -> jax.Array:
  """Converts a loss scale to a strongly typed floating scalar and checks it.

  Args:
    value: a number or scalar array, possibly traced (then only its type and
      shape are checked).
    name: the argument's name, for the error messages.
    warn_integer: warn when an integer scale is converted to float32, as
      jmp's ``DynamicLossScale`` does.

  Returns:
    A scalar array of ``value``'s floating dtype (float32 for an integer).
  """
  if isinstance(value, (bool, np.bool_)) or (hasattr(value, "dtype") and value.dtype == bool):
    raise TypeError(f"{name} must be a positive number, got {value!r}.")
  scale = jnp.asarray(value)
  if not jnp.issubdtype(scale.dtype, jnp.floating):
    if not jnp.issubdtype(scale.dtype, jnp.integer):
      raise TypeError(f"{name} must be a real number or floating array, got dtype {scale.dtype}.")
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


def as_bound(value: Any, name: str, dtype: np.dtype) -> float:
  """Converts a static bound to a Python float representable in ``dtype``.

  Args:
    value: a concrete positive finite number.
    name: the argument's name, for the error messages.
    dtype: the dtype the bound is compared in.

  Returns:
    ``value`` as a Python float.
  """
  if isinstance(value, jax.core.Tracer):
    raise TypeError(
      f"{name} is static configuration and must be a concrete number, got a "
      "traced value; build the loss scale outside jit or pass a Python float."
    )
  if isinstance(value, (bool, np.bool_)) or not isinstance(
    value, (numbers.Real, np.ndarray, np.generic, jax.Array)
  ):
    raise TypeError(f"{name} must be a positive number, got {value!r}.")
  bound = float(np.asarray(value))
  with np.errstate(over="ignore"):
    rounded = float(np.asarray(bound, dtype=dtype))
  if not (math.isfinite(bound) and bound > 0):
    raise ValueError(f"{name} must be positive and finite, got {bound}.")
  if not (math.isfinite(rounded) and rounded > 0):
    raise ValueError(
      f"{name}={bound} is not representable in the loss scale's dtype "
      f"{np.dtype(dtype).name} (it rounds to {rounded})."
    )
  return bound


def check_int(value: Any, name: str, minimum: int) -> int:
  """Checks a static integer setting.

  Args:
    value: a Python or NumPy integer (not a bool).
    name: the argument's name, for the error messages.
    minimum: the smallest value allowed.

  Returns:
    ``value`` as a Python int.
  """
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral)):
    raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}.")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}.")
  return int(value)


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


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
  """Checks a string option.

  Args:
    value: the option given.
    name: the argument's name, for the error messages.
    choices: the accepted strings.

  Returns:
    ``value``, if it is one of ``choices``; TypeError or ValueError otherwise.
  """
  if not isinstance(value, str):
    raise TypeError(f"{name} must be one of {choices}, got {value!r}.")
  if value not in choices:
    raise ValueError(f"{name} must be one of {choices}, got {value!r}.")
  return value
