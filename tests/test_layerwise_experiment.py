"""Smoke tests of the layer-wise experiment and benchmark scripts (``--quick`` mode).

Both run in-process (JAX is already initialised) on tiny models: the checks are on the
structure of the JSON they write and on the relations its figures must satisfy (the best static
scale is the sweep's minimum, a static scale does not move, fp32 training skips no step), not on
the figures themselves.
"""

import itertools
import json
import math
import statistics

import pytest

from benchmarks import layerwise_overhead, layerwise_underflow


def _fraction(x):
  return isinstance(x, float) and 0.0 <= x <= 1.0


# One worker runs this module under pytest-xdist, so its module fixture runs once.
pytestmark = pytest.mark.xdist_group("layerwise_experiment")


@pytest.fixture(scope="module")
def underflow_results(tmp_path_factory):
  out = tmp_path_factory.mktemp("layerwise_underflow")
  layerwise_underflow.main(["--quick", "--out", str(out), "--no-plot"])
  with open(out / "layerwise_underflow.json") as f:
    results = json.load(f)
  assert (out / "layerwise_underflow.md").read_text().count("| layer |") == len(results["tasks"])
  return results


def test_underflow_json_structure(underflow_results):
  config = underflow_results["config"]
  assert config["quick"] and config["methods"] == list(layerwise_underflow.METHODS)
  assert [t["task"] for t in underflow_results["tasks"]] == ["deep_tanh", "residual"]
  for task in underflow_results["tasks"]:
    layers = len(task["layer_names"])
    assert set(task) >= {"spread_bits", "static_sweeps", "static_log2_scale", "methods", "targets"}
    assert set(task["methods"]) == set(layerwise_underflow.METHODS)
    for name, method in task["methods"].items():
      # --quick trains fewer steps than --curve-points: one point per step.
      assert len(method["loss_curve"]) == config["steps"]
      assert all(math.isfinite(x) and x > 0 for x in method["loss_curve"])
      assert len(method["eval_loss"]) == len(config["seeds"])
      assert all(math.isfinite(x) for x in method["eval_loss"])
      assert all(isinstance(s, int) and 0 <= s < config["steps"] for s in method["skipped_steps"])
      if name in layerwise_underflow.SCALED_METHODS:
        assert len(method["underflow_per_layer"]) == layers
        assert all(_fraction(x) for x in method["underflow_per_layer"])
        assert _fraction(method["underflow_max_layer"])
        below = method["underflow_below_range_per_layer"]
        assert all(
          b <= u + 1e-12 for b, u in zip(below, method["underflow_per_layer"], strict=True)
        )
    # Every layer-wise stage ends with a power-of-two scale of its own.
    (lw_scales,) = task["methods"]["layerwise"]["final_log2_scale"]
    assert len(lw_scales) == layers and all(float(e).is_integer() for e in lw_scales)
    # fp32 computes in fp32 without a scale (log2 1 = 0) and so never skips a step; fp16 runs
    # at a static scale of 1; static keeps the scale the sweep picked.
    assert task["methods"]["fp32"]["skipped_steps"] == [0]
    assert task["methods"]["fp32"]["final_log2_scale"] == [[0.0]]
    assert task["methods"]["fp16"]["final_log2_scale"] == [[0.0]]
    assert task["methods"]["static"]["final_log2_scale"] == [[task["static_log2_scale"][0]]]
    sweep = task["static_sweeps"][0]
    assert sweep["log2_scales"] == config["static_log2_scales"] == list(range(41))
    assert len(sweep["total_underflow"]) == len(sweep["log2_scales"])
    # The best static scale: the least total underflow among those that never overflow, the
    # smallest of any tie.
    fits = [
      (u, e)
      for u, e, o in zip(
        sweep["total_underflow"], sweep["log2_scales"], sweep["overflow"], strict=True
      )
      if not o
    ]
    assert (sweep["best_total_underflow"], sweep["best_log2_scale"]) == min(fits)
    assert task["static_log2_scale"] == [sweep["best_log2_scale"]]
    targets = task["targets"]
    lw = task["methods"]["layerwise"]
    assert targets["layerwise_max_layer_underflow"] == lw["underflow_max_layer"]
    assert targets["layerwise_every_layer_at_or_below_target"] == (
      lw["underflow_max_layer"] <= config["underflow_fraction"]
    )
    assert targets["underflow_fraction"] == config["underflow_fraction"]


def test_underflow_values_are_sane(underflow_results):
  deep = underflow_results["tasks"][0]
  methods = deep["methods"]
  for method in layerwise_underflow.SCALED_METHODS:  # the worst layer's mean underflow
    worst = methods[method]["underflow_max_layer"]
    assert worst == max(methods[method]["underflow_per_layer"]), method
  # Without scaling fp16 loses gradient values that the layer-wise and dynamic scales keep.
  fp16 = methods["fp16"]["underflow_max_layer"]
  assert methods["layerwise"]["underflow_max_layer"] < fp16
  assert methods["dynamic"]["underflow_max_layer"] < fp16
  assert methods["static"]["underflow_max_layer"] <= fp16
  # The fp32 reference's gradients grow layer by layer from the input to the output (the deep
  # tanh net's vanishing gradients); the spread is the last layer's log2 amax minus the first's.
  (spread,) = deep["spread_bits"]
  log2_amax = spread["log2_layer_amax_at_start"]
  assert len(log2_amax) == len(deep["layer_names"])
  assert all(a < b for a, b in itertools.pairwise(log2_amax))
  assert spread["first_to_last_at_start"] == pytest.approx(log2_amax[-1] - log2_amax[0])


def test_overhead_json(tmp_path):
  path = tmp_path / "overhead.json"
  res = layerwise_overhead.main(["--quick", "--json", str(path)])
  with open(path) as f:
    assert json.load(f) == json.loads(json.dumps(res))
  expected = {v for v in layerwise_overhead.VARIANTS if not v.endswith("_histograms")}
  assert set(res["variants"]) == expected
  dynamic_ms = res["variants"]["dynamic"]["round_ms"]
  for variant in res["variants"].values():
    # The median over the interleaved rounds, and the median of the per-round ratios.
    assert variant["median_ms"] == pytest.approx(statistics.median(variant["round_ms"]))
    ratios = [t / d for t, d in zip(variant["round_ms"], dynamic_ms, strict=True)]
    assert variant["ratio_vs_dynamic"] == pytest.approx(statistics.median(ratios))
    # fp32 compute at scales of at most 2^15 (layer-wise: below fp16's max) never overflows.
    assert variant["skipped_steps"] == 0
    assert len(variant["round_ms"]) == res["config"]["rounds"]
  assert res["variants"]["dynamic"]["ratio_vs_dynamic"] == 1.0
  for name, target in layerwise_overhead.TARGETS.items():
    variant = res["variants"][name]
    assert variant["target"] == target
    # Judged on the larger of the measured and the amortized ratio (where there is one).
    judged = max(variant["ratio_vs_dynamic"], variant.get("ratio_amortized", 0.0))
    assert variant["judged_ratio"] == judged
    assert variant["meets_target"] is (judged <= target)
  p1, pinf = (res["variants"][v]["ratio_vs_dynamic"] for v in ("layerwise_p1", "layerwise_pinf"))
  assert math.isclose(
    res["variants"]["layerwise_p100"]["ratio_amortized"], pinf + (p1 - pinf) / 100
  )
  # Every layer-wise variant ran with one stage per layer and ended with finite scales.
  for name in ("layerwise_p1", "layerwise_p100", "layerwise_pinf"):
    scales = res["variants"][name]["final_log2_scales"]
    assert len(scales) == res["config"]["stages"] and all(math.isfinite(x) for x in scales)
