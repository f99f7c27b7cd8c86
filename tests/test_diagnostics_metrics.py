"""diagnostics.every_n_steps and stats_to_metrics (jmp_lite/diagnostics/_metrics.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import diagnostics as diag

from .diagnostics_testing import as_float, jit


def test_every_n_steps_runs_only_on_multiples():
  grads = {"w": jnp.array([0.0, 1.0])}

  @jit
  def metrics(step):
    return diag.every_n_steps(step, 3, diag.gradient_statistics, grads, format="bfloat16")

  for step in range(7):
    zero_fraction = as_float(metrics(step)["w"].zero_fraction)
    assert zero_fraction == (0.5 if step % 3 == 0 else 0.0)
  with pytest.raises(ValueError, match="n must"):
    diag.every_n_steps(0, 0, diag.gradient_statistics, grads)
  with pytest.raises(TypeError, match="integer scalar"):
    diag.every_n_steps(0.5, 2, diag.gradient_statistics, grads)


def test_stats_to_metrics_is_flat_and_scalar():
  metrics = diag.stats_to_metrics(diag.gradient_statistics({"a": {"w": jnp.ones(3)}}))
  assert set(metrics) == {
    f"grads/a/{f}"
    for f in (
      "zero_fraction",
      "nonfinite_fraction",
      "underflow_fraction",
      "subnormal_fraction",
      "overflow_fraction",
      "max_abs",
    )
  }
  assert all(np.shape(v) == () for v in metrics.values())
