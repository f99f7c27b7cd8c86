"""The 16-bit parameters benchmark (benchmarks/low_precision_params.py) in --quick mode.

It runs on the char-LM example's quick preset, in a subprocess with XLA's default flags:
tests/conftest.py switches XLA:CPU to its legacy emitters, which contract a multiply and an
add in one fusion into an FMA. The split adds the update to the fp32 value inside the update's
fusion (one rounding) where fp32 training's ``optax.apply_updates`` adds it in a fusion of its
own (two roundings), so there the two differ by an ulp: a compiler's choice, not a lost update.
The bytes are exact (array sizes), so they are asserted to the byte; step times only as positive
ratios.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("tqdm")  # examples.common's optional dependency

from examples import charlm

_ROOT = pathlib.Path(__file__).resolve().parents[1]

# One worker runs this module under pytest-xdist, so its module fixture runs once.
pytestmark = pytest.mark.xdist_group("low_precision_params_benchmark")

# Bytes per parameter element of (params, optimizer state) with optax.adam.
PER_ELEMENT = {
  "fp32_master": (4, 4 + 4),  # fp32 params; fp32 mu, nu
  "nearest": (2, 4 + 4),  # bf16 params; fp32 moments
  "nearest_bf16_moments": (2, 2 + 2),
  "stochastic": (2, 4 + 4),
  "stochastic_bf16_moments": (2, 2 + 2),
  "kahan": (2, 4 + 4 + 2),  # + the bf16 compensation
  "kahan_bf16_moments": (2, 2 + 2 + 2),
  "split": (2, 4 + 4 + 2),  # + the int16 low halves
  "split_bf16_moments": (2, 2 + 2 + 2),
}
ADAM_COUNT = 4  # optax.adam's int32 step count
# LowPrecisionParamsState's scalars: the int32 step count, the threefry key data (2 x uint32),
# the int32 rounded_away and inexact.
WRAPPER = 4 + 8 + 4 + 4


def quick_model_elements() -> int:
  """Parameters of the quick preset's CharLM, from its shapes."""
  c = charlm.PRESETS["quick"][0]
  w = c.width
  block = 2 * 2 * w + 4 * (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w)  # norms, attn, mlp
  return (
    charlm.VOCAB * w + c.seq_len * w + c.depth * block + 2 * w + (w * charlm.VOCAB + charlm.VOCAB)
  )


@pytest.fixture(scope="module")
def result(tmp_path_factory):
  path = tmp_path_factory.mktemp("low_precision_params") / "out.json"
  command = ["--quick", "--exactness-steps", "3", "--json", str(path)]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  done = subprocess.run(
    [sys.executable, "-m", "benchmarks.low_precision_params", *command],
    cwd=_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "(c) 3 steps" in done.stdout
  return json.loads(path.read_text())


def test_bytes_per_parameter_are_counted_exactly(result):
  n = result["bytes"]["param_elements"]
  assert n == quick_model_elements()
  variants = result["bytes"]["variants"]
  assert list(variants) == list(PER_ELEMENT)
  for name, (params, state) in PER_ELEMENT.items():
    fixed = ADAM_COUNT + (0 if name == "fp32_master" else WRAPPER)
    v = variants[name]
    assert v["params_bytes"] == params * n, name
    assert v["opt_state_bytes"] == state * n + fixed, name
    assert v["bytes_per_param"] == (params * n + state * n + fixed) / n, name
    assert v["ratio_vs_fp32_master"] == (params * n + state * n + fixed) / (12 * n + ADAM_COUNT)
  # The target: stochastic rounding with bf16 moments at <= 0.51x fp32-master Adam.
  target = result["bytes"]["stochastic_bf16_moments_target"]
  assert target["ratio"] == (6 * n + ADAM_COUNT + WRAPPER) / (12 * n + ADAM_COUNT)
  assert target["meets_target"] and 0.5 < target["ratio"] < 0.51


def test_step_time_ratios(result):
  timing = result["timing"]
  assert timing["fp32_master_ms"] > 0
  assert timing["step_compiler_options"] == {
    "xla_backend_optimization_level": 0,  # the quick preset's
    "xla_cpu_copy_insertion_use_region_analysis": True,
  }
  timed = {k: v for k, v in timing.items() if isinstance(v, dict) and "median_ms" in v}
  assert set(timed) == {"fp32_master", "nearest"}  # --quick times one method
  # Each also compiled with XLA's defaults, and compared with fp32-master compiled so.
  for v in (*timed.values(), *(v["xla_defaults"] for v in timed.values())):
    assert v["median_ms"] > 0 and v["ratio_vs_fp32_master"] > 0
    assert v["cpu_ratio_vs_fp32_master"] > 0
  assert timed["fp32_master"]["ratio_vs_fp32_master"] == 1.0
  assert timed["fp32_master"]["xla_defaults"]["ratio_vs_fp32_master"] == 1.0
  assert timing["overhead_target"]["worst_ratio_xla_defaults"] == max(
    v["xla_defaults"]["ratio_vs_fp32_master"] for v in timed.values()
  )
  updates = result["update_timing"]
  assert updates.keys() == timed.keys() and updates["fp32_master"]["ratio_vs_fp32_master"] == 1.0
  assert all(v["median_ms"] > 0 and v["ratio_vs_fp32_master"] > 0 for v in updates.values())
  assert timing["overhead_target"]["worst_ratio"] == max(
    v["ratio_vs_fp32_master"] for v in timed.values()
  )


def test_split_reconstructs_the_master_that_reads_its_view(result):
  e = result["exactness"]
  assert e["steps"] == 3 and e["param_elements"] == result["bytes"]["param_elements"]
  assert e["differing_elements"] == 0 and e["steps_with_differences"] == {}
  assert e["differing_view_elements"] == 0
  assert e["max_abs_difference"] == 0.0 and e["inexact"] == 0
  runs = e["runs"]
  # The same arithmetic on the same bits: the same losses.
  assert runs["split"] == runs["view"]
  assert all(r["finite"] for r in runs.values())
  # The standard policy reads a different view (and fp32 LayerNorm/embedding parameters).
  assert runs["fp32_master"]["val_loss"] != runs["split"]["val_loss"]
