"""Loss-scale health: collapse and skip-rate detection inside the jitted step.

:func:`jmp_lite.loss_scaling`'s state counts steps and skips; a
:class:`LossScaleMonitor` carried beside it adds how long the scale has sat at
its minimum and which recent steps were skipped. :func:`loss_scale_health`
turns both into a verdict, a pytree of arrays a step can return.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _transform, _validation
from jmp_lite._loss_scale import LossScale


def _at_minimum(scale: LossScale) -> jax.Array:
  return jnp.asarray(scale.at_minimum)


class LossScaleMonitor(NamedTuple):
  """Tracks what :class:`jmp_lite.LossScalingState` does not.

  That is how long the scale has been at its minimum, and which recent steps
  were skipped. A pytree of three arrays; create it once, update it after
  each ``tx.update`` inside the jitted step and carry it like the optimizer
  state::

    monitor = diagnostics.LossScaleMonitor.create(window=100)
    ...
    updates, opt_state = tx.update(grads, opt_state, params)
    monitor = monitor.update(opt_state)

  Attributes:
    steps_at_minimum: consecutive updates that left the scale at its minimum.
    recent_skips: ``bool[window]``, a ring buffer of skipped-step flags.
    updates: the number of updates observed.
  """

  steps_at_minimum: jax.Array
  recent_skips: jax.Array
  updates: jax.Array

  @classmethod
  def create(cls, window: int = 100) -> LossScaleMonitor:
    """A fresh monitor.

    Args:
      window: the number of recent steps the skip rate covers (default 100).

    Returns:
      A monitor that has observed no update.

    Raises:
      TypeError: if ``window`` is not an int.
      ValueError: if ``window < 1``.
    """
    window = _validation.check_int(window, "window", 1)
    return cls(
      steps_at_minimum=jnp.zeros((), jnp.int32),
      recent_skips=jnp.zeros((window,), jnp.bool_),
      updates=jnp.zeros((), jnp.int32),
    )

  @property
  def window(self) -> int:
    """The number of recent steps the skip rate covers."""
    return int(np.shape(self.recent_skips)[0])

  def update(self, opt_state: Any) -> LossScaleMonitor:
    """Records the step that produced ``opt_state`` (call once per update).

    Args:
      opt_state: the optimizer state after ``tx.update``, or any state
        containing one :class:`jmp_lite.LossScalingState`.

    Returns:
      The monitor with that step recorded.
    """
    state = _transform.get_loss_scaling_state(opt_state)
    at_min = _at_minimum(state.loss_scale)
    slot = self.updates % self.window
    return LossScaleMonitor(
      steps_at_minimum=jnp.where(at_min, self.steps_at_minimum + 1, 0).astype(jnp.int32),
      recent_skips=self.recent_skips.at[slot].set(~state.last_finite),
      updates=self.updates + 1,
    )


class LossScaleHealth(NamedTuple):
  """Whether loss scaling works (a pytree of arrays, jit-compatible).

  Attributes:
    loss_scale: the current scale.
    at_minimum: the scale equals its ``min_loss_scale`` (dynamic scales; for
      a ``LayerwiseLossScale``, any stage's scale).
    steps_at_minimum: consecutive steps at the minimum. With a monitor,
      exact; without, the consecutive skipped steps while at the minimum (a
      lower bound).
    consecutive_skips: from the loss-scaling state.
    steps: from the loss-scaling state.
    skipped_steps: from the loss-scaling state.
    skip_rate: skipped fraction of the monitor's window (of all steps
      without a monitor).
    collapsed: ``steps_at_minimum >= max_steps_at_minimum``.
    skip_rate_too_high: ``skip_rate > max_skip_rate`` once enough steps
      were observed.
    unhealthy: either of the two.
  """

  loss_scale: jax.Array
  at_minimum: jax.Array
  steps_at_minimum: jax.Array
  consecutive_skips: jax.Array
  steps: jax.Array
  skipped_steps: jax.Array
  skip_rate: jax.Array
  collapsed: jax.Array
  skip_rate_too_high: jax.Array
  unhealthy: jax.Array

  def describe(self) -> str:
    """A human-readable verdict with what to do (host-side: reads the values).

    Returns:
      A line of figures, then a paragraph per problem found (``COLLAPSED``,
      ``TOO MANY SKIPS``), or ``healthy.``.
    """
    h = jax.device_get(self)
    scale, steps = float(h.loss_scale), int(h.steps)
    lines = [
      f"loss scale {scale:g} after {steps} steps; {int(h.skipped_steps)} skipped "
      f"({int(h.consecutive_skips)} in a row now); recent skip rate {float(h.skip_rate):.1%}."
    ]
    if bool(h.collapsed):
      lines.append(
        f"COLLAPSED: the scale has been at its minimum for {int(h.steps_at_minimum)} "
        "consecutive steps and gradients are still non-finite. Lowering the scale does not "
        "help: something produces inf/NaN independent of the scale (an op overflowing in "
        "16 bits, a log of 0, a NaN in the data). Find the layer with "
        "jl.diagnostics.likely_culprits(stats) and the op with jl.audit(...)."
      )
    if bool(h.skip_rate_too_high):
      lines.append(
        f"TOO MANY SKIPS: {float(h.skip_rate):.0%} of recent steps were skipped, so the "
        "model barely trains. If the scale oscillates, raise hysteresis or lower the growth "
        "(larger period); if it sits low, see jl.diagnostics.likely_culprits(stats)."
      )
    if not bool(h.unhealthy):
      lines.append("healthy.")
    return "\n".join(lines)


def loss_scale_health(
  opt_state: Any,
  monitor: LossScaleMonitor | None = None,
  *,
  max_steps_at_minimum: int = 10,
  max_skip_rate: float = 0.2,
  min_steps: int | None = None,
) -> LossScaleHealth:
  """Collapse detection from :func:`jmp_lite.loss_scaling`'s counters (jit-compatible).

  Args:
    opt_state: the optimizer state, or any state containing one
      :class:`jmp_lite.LossScalingState`.
    monitor: a :class:`LossScaleMonitor` updated with this state, for the exact
      time at the minimum and a windowed skip rate.
    max_steps_at_minimum: K: collapsed once the scale has been at its minimum
      for K consecutive steps (default 10).
    max_skip_rate: flagged when the skip rate exceeds this (default 0.2).
    min_steps: steps that must be observed before the skip rate is judged
      (default: the monitor's window, or 100 without a monitor), so the
      initial back-off from a high starting scale is not an alarm.

  Returns:
    A :class:`LossScaleHealth` of arrays; ``health.unhealthy`` is the alarm.

  Raises:
    TypeError: for a ``monitor`` that is not a :class:`LossScaleMonitor`, or
      a non-int ``max_steps_at_minimum`` or ``min_steps``.
    ValueError: for counts below 1, a ``max_skip_rate`` outside [0, 1], or an
      ``opt_state`` without exactly one loss-scaling state.
  """
  max_steps_at_minimum = _validation.check_int(max_steps_at_minimum, "max_steps_at_minimum", 1)
  max_skip_rate = _validation.as_real(max_skip_rate, "max_skip_rate", "a number in [0, 1]")
  if not 0 <= max_skip_rate <= 1:
    raise ValueError(f"max_skip_rate must be a number in [0, 1], got {max_skip_rate!r}.")
  if monitor is not None and not isinstance(monitor, LossScaleMonitor):
    raise TypeError(f"monitor must be a LossScaleMonitor, got {type(monitor).__name__}.")
  state = _transform.get_loss_scaling_state(opt_state)
  at_min = _at_minimum(state.loss_scale)
  if monitor is None:
    steps_at_min = jnp.where(at_min, state.consecutive_skips, 0)
    observed = state.steps
    skip_rate = state.skipped_steps / jnp.maximum(state.steps, 1)
    min_steps = 100 if min_steps is None else min_steps
  else:
    steps_at_min = monitor.steps_at_minimum
    observed = jnp.minimum(monitor.updates, monitor.window)
    skip_rate = jnp.sum(monitor.recent_skips, dtype=jnp.int32) / jnp.maximum(observed, 1)
    min_steps = monitor.window if min_steps is None else min_steps
  min_steps = _validation.check_int(min_steps, "min_steps", 1)
  skip_rate = skip_rate.astype(jnp.float32)
  collapsed = steps_at_min >= max_steps_at_minimum
  too_many = (skip_rate > max_skip_rate) & (observed >= min_steps)
  return LossScaleHealth(
    loss_scale=jnp.asarray(state.loss_scale.loss_scale),
    at_minimum=at_min,
    steps_at_minimum=steps_at_min.astype(jnp.int32),
    consecutive_skips=state.consecutive_skips,
    steps=state.steps,
    skipped_steps=state.skipped_steps,
    skip_rate=skip_rate,
    collapsed=collapsed,
    skip_rate_too_high=too_many,
    unhealthy=collapsed | too_many,
  )
