"""axis_name on jl.flax.TrainState and jl.flax.Optimizer: data parallelism with no pmean written."""

import pathlib

import pytest

WORKER = pathlib.Path(__file__).with_name("data_parallel_worker.py")


@pytest.mark.parametrize("case", ["linen_pmap", "nnx_shard_map"])
def test_one_skip_decision_and_averaged_gradients_on_every_device(case, run_on_8_devices):
  out = run_on_8_devices(str(WORKER), case)
  # The inf was in one device's batch: every device skipped that step, as one device does.
  assert out["skipped"] == [1] * 8 and out["one_device_skipped"] == 1, out
  assert len(set(out["scales"])) == 1 and out["scales"][0] == 2.0**9, out
  assert out["identical"], out  # the replicas never drift apart
  # The averaged gradients are those of the whole batch: fp16 rounding apart, the same steps.
  assert out["error_vs_one_device"] < 1e-2, out
