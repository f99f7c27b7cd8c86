r"""The layer-wise scale rule, as functions of a scale's state and configuration.

Every ``update_period`` finite steps each stage :math:`k` gets

.. math::

  S_k = 2^{\lfloor \log_2 (M \cdot 2^{-m} / a_k) \rfloor}

with :math:`a_k` the largest true gradient magnitude of the stage over the
history, :math:`M` the gradient format's max and :math:`m` the margin (see
:class:`jmp_lite.layerwise.LayerwiseLossScale`). The functions here compute
one step of that rule; the class holds the state and delegates to them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jmp_lite import _dtypes as dtypes
from jmp_lite.layerwise._boundary import (
  HIST_BINS,
  HIST_MIN_EXP,
  BoundaryStats,
  abs_max,
  log2_histogram,
)
from jmp_lite.layerwise._stages import Spec, per_stage


def observed_amax(
  scales: jax.Array,
  scaled_leaves: Sequence[jax.Array],
  specs: Sequence[Spec],
  boundary: BoundaryStats | None,
) -> jax.Array:
  """Largest true (unscaled) gradient magnitude per stage; inf where non-finite."""
  num_stages = scales.shape[0]
  # Parameter gradients are observed at their own stage's scale.
  amax = per_stage(
    jnp.zeros((num_stages,), jnp.float32), scaled_leaves, specs, abs_max, _combine_max
  )
  amax = amax / scales
  if boundary is not None and num_stages > 1:
    # Boundary k is observed at S_{k+1}: an output of stage k+1's backward
    # pass and the input of stage k's.
    b_true = boundary.amax / scales[1:]
    amax = amax.at[:-1].max(b_true).at[1:].max(b_true)
  return amax


def _combine_max(ref: Any, value: jax.Array) -> jax.Array:
  return ref.max(value)


def _combine_add(ref: Any, value: jax.Array) -> jax.Array:
  return ref.add(value)


def scales_for(amax: jax.Array, target: float, scale: Any) -> jax.Array:
  """The largest powers of two that put ``amax`` at most at ``target``, within the bounds.

  Args:
    amax: the true maximum per stage; a stage with 0 keeps its scale.
    target: the format's max times ``2**-margin_bits``.
    scale: the :class:`~jmp_lite.layerwise.LayerwiseLossScale` (its scales and bounds).

  Returns:
    ``f32[num_stages]``.
  """
  # floor(log2(target / amax)), exactly (log2 may round a power of two down)
  # and without overflowing the division: with x = m_x 2^e_x, m_x in [0.5, 1),
  # it is e_t - e_a, minus 1 when m_t < m_a.
  m_t, e_t = jnp.frexp(jnp.float32(target))
  m_a, e_a = jnp.frexp(amax)
  exponent = e_t - e_a - (m_t < m_a).astype(e_a.dtype)
  new = jnp.where(amax > 0, jnp.ldexp(jnp.float32(1), exponent), scale.scales)
  new = jnp.clip(new, jnp.asarray(scale.min_loss_scale), jnp.asarray(scale.max_loss_scale))
  return new.astype(jnp.float32)


def shift_histogram(hist: jax.Array, shift: jax.Array) -> jax.Array:
  """Moves counts ``shift`` bins up (values multiplied by 2^shift); edge bins absorb."""
  destination = jnp.clip(jnp.arange(HIST_BINS) + shift, 0, HIST_BINS - 1)
  return jnp.zeros_like(hist).at[destination].add(hist)


def predicted_underflow(
  scale: Any,
  scaled_leaves: Sequence[jax.Array],
  specs: Sequence[Spec],
  boundary: BoundaryStats | None,
  new_scales: jax.Array,
  axis_name: Any,
) -> jax.Array:
  """Fraction of each stage's nonzero values that would underflow at ``new_scales``."""
  num_stages = scale.num_stages
  log2_scales = jnp.round(jnp.log2(scale.scales)).astype(jnp.int32)
  hist = per_stage(
    jnp.zeros((num_stages, HIST_BINS), jnp.float32),
    scaled_leaves,
    specs,
    log2_histogram,
    _combine_add,
  )  # [K, BINS], at S_k
  if boundary is not None and num_stages > 1:
    shift_down = log2_scales[:-1] - log2_scales[1:]  # boundary k to stage k's units
    hist = hist.at[1:].add(boundary.histogram)
    hist = hist.at[:-1].add(jax.vmap(shift_histogram)(boundary.histogram, shift_down))
  if axis_name is not None:
    hist = lax.psum(hist, axis_name)
  # Values below half the smallest subnormal round to zero, i.e.
  # floor(log2|g|) <= log2(min_subnormal) - 2.
  fmt = dtypes.format_info(scale.gradient_dtype)
  shift = jnp.round(jnp.log2(new_scales)).astype(jnp.int32) - log2_scales
  shifted = jax.vmap(shift_histogram)(hist, shift)
  cutoff = int(math.log2(fmt.min_subnormal)) - 2 - HIST_MIN_EXP
  total = jnp.sum(hist, axis=1)
  lost = jnp.sum(shifted[:, : cutoff + 1], axis=1)
  return jnp.where(total > 0, lost / jnp.maximum(total, 1), 0.0)


def step(
  scale: Any,
  scaled_leaves: Sequence[jax.Array],
  specs: Sequence[Spec],
  boundary: BoundaryStats | None,
  axis_name: Any,
) -> tuple[jax.Array, dict[str, Any]]:
  """One step of the rule: whether the gradients are finite, and the next state.

  Args:
    scale: the :class:`~jmp_lite.layerwise.LayerwiseLossScale` of this step.
    scaled_leaves: the scaled parameter gradients, widened to at least fp32.
    specs: their stage specs.
    boundary: the boundaries' statistics (None: not taken, one stage).
    axis_name: the axis whose devices must agree, or None.

  Returns:
    ``(finite, state)``: a bool scalar, and the next values of the state fields.
  """
  scales = scale.scales
  # One max per stage gives the statistic and the finiteness (abs_max maps NaN to inf).
  observed = observed_amax(scales, scaled_leaves, specs, boundary)  # true units
  if axis_name is not None:
    observed = lax.pmax(observed, axis_name)
  stage_finite = jnp.isfinite(observed)
  finite = jnp.all(stage_finite)
  # inf/NaN flows backwards from the loss, so the stage where it started is
  # the non-finite one with the highest index. Its gradients exceeded the
  # format's max at its scale: record that lower bound on its true maximum.
  num_stages = scale.num_stages
  highest_non_finite = num_stages - 1 - jnp.argmin(stage_finite[::-1])
  culprit = ~finite & (jnp.arange(num_stages) == highest_non_finite)
  fmt_max = dtypes.format_info(scale.gradient_dtype).max
  observed = jnp.where(stage_finite, observed, jnp.where(culprit, fmt_max / scales, 0.0))
  history = jnp.concatenate([observed[None], scale.amax_history[:-1]])
  amax = jnp.max(history, axis=0)
  new_scales = scales_for(amax, fmt_max * 2.0**-scale.margin_bits, scale)

  due = scale.steps_since_refresh >= scale.update_period - 1
  refresh = due & finite
  underflow = scale.underflow
  if scale.histograms:
    underflow = lax.cond(
      refresh,
      lambda: predicted_underflow(scale, scaled_leaves, specs, boundary, new_scales, axis_name),
      lambda: scale.underflow,
    )
  # On overflow the culprit drops to what its history allows (at least one
  # backoff); the stages below it, which only received its inf/NaN, back off
  # once, and the next refresh restores them from their history. Between
  # refreshes the boundaries are not observed, and an overflow in the
  # cotangent a stage passes down shows first in the stage below: the stage
  # above the culprit backs off once too.
  boundaries_seen = due if boundary is not None else jnp.asarray(False)
  unobserved_above = ~boundaries_seen & jnp.concatenate([jnp.zeros(1, bool), culprit[:-1]])
  backed = jnp.where(stage_finite & ~unobserved_above, scales, scales / scale.backoff_factor)
  backed = jnp.where(culprit, jnp.minimum(backed, new_scales), backed)
  backed = jnp.maximum(backed, jnp.asarray(scale.min_loss_scale, jnp.float32))
  steps = scale.steps_since_refresh
  return finite, {
    "scales": jnp.where(finite, jnp.where(refresh, new_scales, scales), backed).astype(jnp.float32),
    "steps_since_refresh": jnp.where(finite & due, 0, jnp.where(finite, steps + 1, steps)).astype(
      jnp.int32
    ),
    "amax_history": history,
    "amax": jnp.where(refresh, amax, scale.amax),
    "underflow": underflow,
  }


def back_off(scale: Any, finite: jax.Array) -> dict[str, Any]:
  """The next state without statistics: on overflow every stage backs off once."""
  backed = jnp.maximum(scale.scales / scale.backoff_factor, jnp.asarray(scale.min_loss_scale))
  return {
    "scales": jnp.where(finite, scale.scales, backed.astype(jnp.float32)),
    "steps_since_refresh": jnp.where(
      finite,
      jnp.minimum(scale.steps_since_refresh + 1, scale.update_period - 1),
      scale.steps_since_refresh,
    ),
  }
