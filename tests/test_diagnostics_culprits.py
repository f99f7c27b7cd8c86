"""diagnostics.likely_culprits (jmp_lite/diagnostics/_culprits.py)."""

import jax.numpy as jnp
import pytest

from jmp_lite import diagnostics as diag


def fake_stats(**layers):
  out = {}
  for name, (nonfinite, overflow, underflow) in layers.items():
    out[name] = diag.GradientStats(
      size=jnp.int32(100),
      zero_fraction=jnp.float32(0),
      nonfinite_fraction=jnp.float32(nonfinite),
      underflow_fraction=jnp.float32(underflow),
      subnormal_fraction=jnp.float32(0),
      overflow_fraction=jnp.float32(overflow),
      max_abs=jnp.float32(1),
      histogram=jnp.zeros(0, jnp.int32),
      min_exponent=jnp.int32(0),
      loss_scale=jnp.float32(1024),
    )
  return out


def test_culprit_is_the_non_finite_layer_closest_to_the_output():
  # NaN enters the backward pass at Dense_2 and spreads to Dense_1 and Dense_0.
  stats = fake_stats(
    Dense_0=(1, 0, 0), Dense_1=(1, 0, 0), Dense_2=(0.2, 0, 0), Dense_3=(0, 0, 0), Dense_10=(0, 0, 0)
  )
  (culprit,) = diag.likely_culprits(stats)
  assert culprit.name == "Dense_2" and culprit.problem == "non-finite"
  assert "2 earlier layers" in str(culprit)
  # Natural order puts Dense_10 last; an explicit forward order overrides it.
  order = ["Dense_3/kernel", "Dense_2/kernel", "Dense_1/kernel", "Dense_0/kernel"]
  assert diag.likely_culprits(stats, order=order)[0].name == "Dense_0"


def test_overflow_and_underflow_culprits_are_ranked():
  stats = fake_stats(a=(0, 0.01, 0), b=(0, 0.2, 0), c=(0, 0, 0.5), d=(0, 0, 0.005))
  culprits = diag.likely_culprits(stats, max_results=5)
  assert [(c.name, c.problem) for c in culprits] == [
    ("b", "overflow"),
    ("a", "overflow"),
    ("c", "underflow"),  # d is under the 1% threshold
  ]
  assert diag.likely_culprits(fake_stats(a=(0, 0, 0))) == ()
  with pytest.raises(TypeError, match="string"):
    diag.likely_culprits(stats, order="abc")


def test_every_layer_non_finite_names_the_first_layer_run():
  stats = fake_stats(Dense_0=(1, 0, 0), Dense_1=(0.5, 0, 0), Dense_2=(1, 0, 0))
  (culprit,) = diag.likely_culprits(stats)
  assert (culprit.name, culprit.problem, culprit.fraction) == ("Dense_0", "non-finite", 1.0)
  assert "at or before the first layer run" in culprit.explanation
  assert "every layer after it (2 layers)" in culprit.explanation
  order = ["Dense_2/kernel", "Dense_0/kernel", "Dense_1/kernel"]
  assert diag.likely_culprits(stats, order=order)[0].name == "Dense_2"
