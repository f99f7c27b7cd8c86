"""The dynamic loss scale: the largest scale that keeps the gradients finite."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _validation
from jmp_lite._loss_scale._contract import STATIC, checked_field
from jmp_lite._loss_scale._fixed import OneScale


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(OneScale):
  """A loss scale that finds the largest value keeping gradients finite.

  ``adjust(grads_finite)`` implements::

    if grads_finite:
      overflow_streak = 0
      counter += 1
      if counter == period:
        counter = 0
        if loss_scale * factor is finite and <= max_loss_scale:
          loss_scale *= factor
    else:
      counter = 0
      overflow_streak += 1
      if overflow_streak >= hysteresis:
        loss_scale = max(loss_scale / factor, min_loss_scale)

  With the defaults (``hysteresis=1``, no ``max_loss_scale``) this is jmp's
  rule. Unlike jmp, ``min_loss_scale`` survives ``jit``/``tree_map``/``scan``,
  fp16 and bf16 scales work (arithmetic stays in the scale's dtype), and
  growth never reaches inf.

  Args:
    loss_scale: initial scale, a positive scalar; its dtype (default float32
      for Python numbers) is kept. Use a power of two, e.g. ``2.0 ** 15``.
    counter: consecutive finite steps so far, in ``[0, period)``.
    period: finite steps between growths, >= 1.
    factor: growth and back-off factor, > 1 (2 keeps powers of two exact).
    min_loss_scale: the scale never goes below this, a number >= 0 (0, which
      jmp accepts, warns: the scale can then reach 0 and stay there).
    max_loss_scale: the scale never grows above this (default: no bound but
      finiteness in the scale's dtype).
    hysteresis: back off only after this many consecutive non-finite steps
      (then on each further one); 1 backs off on every overflow.
    overflow_streak: consecutive non-finite steps so far (state, usually 0).

  The constructor checks and normalizes every argument; JAX's unflattening
  and ``dataclasses.replace`` do not (they rebuild a checked scale).

  >>> scale = DynamicLossScale(2.0 ** 15, period=2)
  >>> float(scale.adjust(jnp.array(True)).adjust(jnp.array(True)).loss_scale)
  65536.0
  """

  loss_scale: jax.Array
  counter: jax.Array = 0  # type: ignore[assignment]  # made an array in __post_init__
  period: int = dataclasses.field(default=2000, metadata=STATIC)
  factor: float = dataclasses.field(default=2, metadata=STATIC)
  min_loss_scale: float = dataclasses.field(default=1.0, metadata=STATIC)
  _: dataclasses.KW_ONLY
  max_loss_scale: float | None = dataclasses.field(default=None, metadata=STATIC)
  hysteresis: int = dataclasses.field(default=1, metadata=STATIC)
  overflow_streak: jax.Array = 0  # type: ignore[assignment]  # made an array in __post_init__
  _checked: bool = checked_field()

  def __post_init__(self):
    if self._checked:
      return
    # Converted here, so that the warnings they give point at the caller.
    scale = _validation.as_scale(self.loss_scale, "loss_scale", warn_integer=True)
    low = _validation.as_bound(
      self.min_loss_scale, "min_loss_scale", scale.dtype, allow_zero=True, warn_integer=True
    )
    if low == 0:
      # jmp accepts a zero floor, so code written for it must keep running; the collapse it
      # allows is silent in training, so say it here.
      warnings.warn(
        "min_loss_scale=0: a run of non-finite steps can divide the loss scale down to 0 "
        "(it underflows), and at 0 every unscaled gradient is 0 * (1/0) = NaN, so every "
        "later step is skipped and the scale never recovers. Pass a positive floor (the "
        "default is 1.0) to prevent this.",
        UserWarning,
        stacklevel=3,  # __post_init__ <- __init__ <- the caller
      )
    for name, value in _checked_fields(self, scale, low).items():
      object.__setattr__(self, name, value)
    object.__setattr__(self, "_checked", True)

  @property
  def at_minimum(self) -> jax.Array:
    """Whether the scale is at ``min_loss_scale`` (a bool scalar)."""
    return self.loss_scale <= jnp.asarray(self.min_loss_scale, self.loss_scale.dtype)

  def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
    """The next state, by the rule above.

    Args:
      grads_finite: a bool scalar, whether this step's gradients were finite.

    Returns:
      The loss scale for the next step (a non-finite step also resets
      ``counter``).
    """
    finite = _validation.check_predicate(grads_finite, "grads_finite")
    scale = self.loss_scale

    grown = scale * self.factor
    can_grow = jnp.isfinite(grown)
    if self.max_loss_scale is not None:
      can_grow &= grown <= self.max_loss_scale
    grow = (self.counter == self.period - 1) & can_grow
    streak = jnp.where(finite, 0, jnp.minimum(self.overflow_streak + 1, self.hysteresis))
    shrink = ~finite & (streak >= self.hysteresis)
    shrunk = jnp.maximum(scale / self.factor, jnp.asarray(self.min_loss_scale, scale.dtype))

    return dataclasses.replace(
      self,
      loss_scale=jnp.where(finite, jnp.where(grow, grown, scale), jnp.where(shrink, shrunk, scale)),
      counter=jnp.where(finite, (self.counter + 1) % self.period, 0),
      overflow_streak=streak,
    )


def _checked_fields(scale: DynamicLossScale, loss_scale: jax.Array, low: float) -> dict[str, Any]:
  """Every field of a new ``scale``, checked and normalized (``loss_scale`` and ``low`` are)."""
  period = scale.period
  if isinstance(period, (float, np.floating)) and float(period).is_integer():
    period = int(period)  # jmp accepts period=2000.0; 2000.5 still raises below
  period = _validation.check_int(period, "period", 1)
  hysteresis = _validation.check_int(scale.hysteresis, "hysteresis", 1)
  factor = _validation.as_real(scale.factor, "factor", "a real number > 1")
  if not (math.isfinite(factor) and factor > 1):
    raise ValueError(f"factor must be finite and > 1, got {scale.factor}.")
  high = scale.max_loss_scale
  if high is not None:
    high = _validation.as_bound(high, "max_loss_scale", loss_scale.dtype)
    if high < low:
      raise ValueError(f"max_loss_scale={high} is below min_loss_scale={low}.")
  if _validation.is_concrete(loss_scale) and not (
    low <= float(loss_scale) <= (math.inf if high is None else high)
  ):
    raise ValueError(
      f"loss_scale={float(loss_scale)} is outside [min_loss_scale, max_loss_scale]"
      f" = [{low}, {high}]."
    )
  return {
    "loss_scale": loss_scale,
    "period": period,
    "hysteresis": hysteresis,
    "min_loss_scale": low,
    "max_loss_scale": high,
    "counter": _as_count(scale.counter, "counter", period - 1),
    "overflow_streak": _as_count(scale.overflow_streak, "overflow_streak", hysteresis),
  }


def _as_count(value: Any, name: str, largest: int) -> jax.Array:
  count = jnp.asarray(value)
  if not jnp.issubdtype(count.dtype, jnp.integer) or count.shape != ():
    raise TypeError(f"{name} must be an integer scalar, got {value!r}.")
  count = jnp.asarray(count, jnp.int32)
  if _validation.is_concrete(count) and not 0 <= int(count) <= largest:
    raise ValueError(f"{name} must be in [0, {largest}], got {int(count)}.")
  return count
