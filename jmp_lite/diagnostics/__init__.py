r"""Gradient statistics and loss-scale health, computed inside the train step.

Three tools, all jit-compatible with no host sync in the hot path:

* :func:`gradient_statistics`: per leaf or per layer, a histogram of
  :math:`\lfloor\log_2|g|\rfloor`, the fraction of zeros, of non-finite
  values, and of values that would underflow (round to 0), land in the
  subnormal range, or overflow once multiplied by a loss scale and stored in
  a target format. Cheap enough to return as metrics every N steps
  (:func:`every_n_steps`).
* :class:`LossScaleMonitor` and :func:`loss_scale_health`: collapse detection
  from the counters of :func:`jmp_lite.loss_scaling`'s state: the scale at its
  minimum for K consecutive steps, or a skipped-step rate above a threshold.
* :func:`likely_culprits` (on the host, on fetched statistics): names the
  layers where non-finite gradients start, or that overflow or underflow, in
  the forward order :func:`parameter_order` reads from the model.

A train step that logs all three::

  from jmp_lite import diagnostics

  monitor = diagnostics.LossScaleMonitor.create(window=100)

  @jax.jit
  def train_step(params, opt_state, monitor, batch, step):
    loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, batch)
    # Statistics of the scaled gradients, as float16 must hold them.
    stats = diagnostics.every_n_steps(
        step, 100, diagnostics.gradient_statistics, grads, format="float16")
    updates, opt_state = tx.update(grads, opt_state, params)
    monitor = monitor.update(opt_state)
    health = diagnostics.loss_scale_health(opt_state, monitor)
    return optax.apply_updates(params, updates), opt_state, monitor, (loss, stats, health)

  # on the host, when health.unhealthy:
  print(health.describe())
  order = diagnostics.parameter_order(loss_fn, params, batch)
  print(diagnostics.likely_culprits(stats, order=order))

:mod:`jmp_lite.plotting` draws the statistics and the loss-scale history.
"""

from jmp_lite.diagnostics._culprits import Culprit, likely_culprits
from jmp_lite.diagnostics._gradient_stats import (
  DEFAULT_EXPONENT_RANGE as DEFAULT_EXPONENT_RANGE,  # gradient_statistics' default
)
from jmp_lite.diagnostics._gradient_stats import GradientStats, gradient_statistics
from jmp_lite.diagnostics._health import LossScaleHealth, LossScaleMonitor, loss_scale_health
from jmp_lite.diagnostics._metrics import every_n_steps, stats_to_metrics
from jmp_lite.diagnostics._parameter_order import parameter_order

__all__ = (
  # Gradient statistics
  "gradient_statistics",
  "GradientStats",
  # Metrics for a logger
  "every_n_steps",
  "stats_to_metrics",
  # Loss-scale health
  "loss_scale_health",
  "LossScaleHealth",
  "LossScaleMonitor",
  # Culprit layers
  "likely_culprits",
  "Culprit",
  "parameter_order",
)

# The implementation lives in private modules (``jmp_lite.diagnostics._*``); use the names above.
