"""diagnostics.LossScaleMonitor and loss_scale_health (jmp_lite/diagnostics/_health.py)."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_lite as jl
from jmp_lite import diagnostics as diag
from jmp_lite import loss_scaling

from .diagnostics_testing import jit


def run_updates(pattern, loss_scale, window=4, **health_kwargs):
  """Feeds finite (True) / NaN (False) gradients through loss_scaling; returns healths."""
  tx = loss_scaling(optax.sgd(0.1), loss_scale)
  params = {"w": jnp.ones(2)}
  state, monitor = tx.init(params), diag.LossScaleMonitor.create(window=window)

  @jit
  def step(state, monitor, finite):
    grads = {"w": jnp.where(finite, 1.0, jnp.nan) * jnp.ones(2)}
    _, state = tx.update(grads, state, params)
    monitor = monitor.update(state)
    with_monitor = diag.loss_scale_health(state, monitor, **health_kwargs)
    without = diag.loss_scale_health(state, **health_kwargs)
    return state, monitor, with_monitor, without

  out = []
  for finite in pattern:
    state, monitor, h, h_bare = step(state, monitor, jnp.asarray(finite))
    out.append((jax.device_get(h), jax.device_get(h_bare)))
  return out


def test_collapse_after_k_steps_at_minimum():
  scale = jl.DynamicLossScale(jnp.float32(8), min_loss_scale=2.0)
  pattern = [False] * 8  # 8 -> 4 -> 2, then stuck at the minimum
  healths = run_updates(pattern, scale, max_steps_at_minimum=3)
  at_min = [int(h.steps_at_minimum) for h, _ in healths]
  assert [float(h.loss_scale) for h, _ in healths] == [4, 2, 2, 2, 2, 2, 2, 2]
  assert at_min == [0, 1, 2, 3, 4, 5, 6, 7]
  assert [bool(h.collapsed) for h, _ in healths] == [False, False, False] + [True] * 5
  # Without a monitor: consecutive skips while at the minimum, a lower bound.
  assert [int(b.steps_at_minimum) for _, b in healths] == [0, 2, 3, 4, 5, 6, 7, 8]
  assert "COLLAPSED" in healths[-1][0].describe()


def test_advice_names_public_functions():
  scale = jl.DynamicLossScale(jnp.float32(8), min_loss_scale=2.0)
  collapsed = run_updates([False] * 8, scale, max_steps_at_minimum=3)[-1][0].describe()
  scale = jl.DynamicLossScale(jnp.float32(2.0**10), period=1)
  skipping = run_updates([True, False] * 6, scale, window=4, max_skip_rate=0.25)[-1][0]
  named = re.findall(r"\bjl\.([\w.]+)\(", collapsed + skipping.describe())
  assert sorted(set(named)) == ["audit", "diagnostics.likely_culprits"]
  assert jl.diagnostics.likely_culprits.__name__ == "likely_culprits"


def test_recovering_run_is_healthy():
  # Two overflows at the start (the scale backs off), then clean steps: no alarm. The
  # scale reaches its minimum on the way but leaves it, so it never collapses.
  scale = jl.DynamicLossScale(jnp.float32(4), period=2, min_loss_scale=1.0)
  healths = run_updates([False, False] + [True] * 14, scale, window=12, max_steps_at_minimum=3)
  assert not any(bool(h.unhealthy) or bool(b.unhealthy) for h, b in healths)
  last = healths[-1][0]
  assert float(last.skip_rate) == 0.0 and int(last.skipped_steps) == 2
  assert float(last.loss_scale) == 128.0  # 1 at step 2, then x2 every 2 clean steps
  assert "healthy." in last.describe()


def test_skip_rate_over_the_window():
  # Every other step overflows: the scale oscillates and half the steps are lost.
  scale = jl.DynamicLossScale(jnp.float32(2.0**10), period=1)
  healths = run_updates([True, False] * 6, scale, window=4, max_skip_rate=0.25)
  rates = [float(h.skip_rate) for h, _ in healths]
  assert rates[:4] == pytest.approx([0.0, 0.5, 1 / 3, 0.5]) and rates[-1] == 0.5
  flagged = [bool(h.skip_rate_too_high) for h, _ in healths]
  assert flagged == [False, False, False] + [True] * 9  # judged once the window is full
  assert not any(bool(h.collapsed) for h, _ in healths)
  assert "TOO MANY SKIPS" in healths[-1][0].describe()
  # Without a monitor the total rate is judged after min_steps (default 100): not yet.
  assert not any(bool(b.skip_rate_too_high) for _, b in healths)


def test_static_scale_has_no_minimum_but_skips_count():
  healths = run_updates([False] * 5, jl.StaticLossScale(2.0**15), window=5, max_skip_rate=0.5)
  assert not any(bool(h.at_minimum) or bool(h.collapsed) for h, _ in healths)
  assert bool(healths[-1][0].skip_rate_too_high) and float(healths[-1][0].skip_rate) == 1.0


def test_layerwise_scale_collapses_when_a_stage_sits_at_its_minimum():
  scale = jl.LayerwiseLossScale({"a": 0, "b": 1}, initial_scale=2.0**14, min_loss_scale=2.0**8)
  tx = loss_scaling(optax.sgd(0.1), scale)
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  state, monitor = tx.init(params), diag.LossScaleMonitor.create(window=4)
  # What the layer-wise value-and-grad returns when stage 0's gradient is NaN.
  no_boundary = jl.layerwise.BoundaryStats(jnp.zeros(1), jnp.zeros((1, jl.layerwise.HIST_BINS)))
  nan = jl.ScaledGrads({"a": jnp.full(2, jnp.nan), "b": jnp.ones(2)}, no_boundary)

  @jit
  def step(state, monitor):
    _, state = tx.update(nan, state, params)
    monitor = monitor.update(state)
    return state, monitor, diag.loss_scale_health(state, monitor, max_steps_at_minimum=2)

  at_min = []
  for _ in range(5):
    state, monitor, health = step(state, monitor)
    at_min.append(bool(health.at_minimum))
  # The overflowing stage drops by margin_bits (3) per overflow: 2^14 -> 2^11 -> 2^8 = min.
  assert at_min == [False, True, True, True, True] and bool(health.collapsed)
  with pytest.raises(TypeError, match="loss_scale=1"):
    diag.gradient_statistics(params, loss_scale=scale)


def test_health_argument_errors():
  state = loss_scaling(optax.sgd(0.1), jl.NoOpLossScale()).init({"w": jnp.ones(1)})
  with pytest.raises(ValueError, match="max_steps_at_minimum"):
    diag.loss_scale_health(state, max_steps_at_minimum=0)
  with pytest.raises(ValueError, match="max_skip_rate"):
    diag.loss_scale_health(state, max_skip_rate=1.5)
  with pytest.raises(TypeError, match="LossScaleMonitor"):
    diag.loss_scale_health(state, monitor=object())
  with pytest.raises(ValueError, match="min_steps"):
    diag.loss_scale_health(state, min_steps=0)
  with pytest.raises(ValueError, match="window"):
    diag.LossScaleMonitor.create(window=0)
  with pytest.raises(ValueError, match="loss_scaling"):
    diag.loss_scale_health(optax.sgd(0.1).init({"w": jnp.ones(1)}))
