"""benchmarks/fp8_recipe_errors.py, fp8_training.py and fp8_sharding.py at tiny sizes.

The numerics script's cases are checked for what they show: row scales against a per-tensor
E5M2 gradient, stale delayed scales on heavy tails, and a 14-bit accumulator over all of K
against one promoted to fp32 every 128 elements; its accumulator model with fp32 sums is
``fp8.BlockScaling``'s matmul.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import fp8_recipe_errors, fp8_sharding, fp8_training
from examples import charlm, common
from jmp_lite import fp8
from jmp_lite.flax import fp8 as flax_fp8


def test_row_scales_beat_a_per_tensor_e5m2_gradient_and_nothing_flushes():
  rows = fp8_recipe_errors.measure("wide_gradients", 128)
  dx = lambda name, metric="frobenius": rows[name]["dx"]["vs_fp32"][metric]
  # Rows of g spanning 2^-20..2^4 fit in E5M2's 32 binades: per-tensor current scaling flushes
  # no row (median row error is rounding), but E5M2's 2 mantissa bits lose to row-wise E4M3's 3.
  assert dx("current", "row_median") < 0.08
  assert dx("current") > 1.4 * dx("rowwise")
  assert dx("block (DeepSeek-V3)") < 0.7 * dx("current")
  assert dx("bf16") < 0.005


def test_stale_delayed_scales_saturate_heavy_tailed_activations():
  rows = fp8_recipe_errors.measure("student_t", 128)
  y = lambda name: rows[name]["y"]["vs_fp32"]["frobenius"]
  # Scales from another batch of t_3 samples: this batch's larger values saturate at 448.
  assert y("delayed (another batch's scales)") > 4 * y("current")
  assert y("current") < 0.05


def test_the_report_has_every_recipe_and_model(tmp_path, monkeypatch):
  monkeypatch.setattr(fp8_recipe_errors, "DISTRIBUTIONS", ("outliers",))
  result = fp8_recipe_errors.run((128,), 128, 128, tmp_path, "cmd")
  rows = result["errors"]["outliers"]["128"]
  names = [*fp8_recipe_errors.RECIPES, *(name for name, _, _ in fp8_recipe_errors.MODELS)]
  assert list(rows) == names
  assert json.loads((tmp_path / "fp8_numerics.json").read_text())["errors"] == result["errors"]
  md = (tmp_path / "fp8_numerics.md").read_text()
  assert md.count("| block (DeepSeek-V3) |") == 2  # the fp32 table and the bf16 table
  # bf16's error against itself is zero; a model row has only the forward product.
  assert rows["bf16"]["y"]["vs_bf16"]["frobenius"] == 0.0
  assert set(rows[fp8_recipe_errors.MODELS[0][0]]) == {"y"}
  assert "## The 14-bit accumulator's own error (model)" in md


def test_the_accumulator_model_with_fp32_sums_is_the_block_recipe():
  x, w, _ = fp8_recipe_errors.data("outliers", 128, 512, 128)
  model = fp8_recipe_errors.accumulator_model(x, w, per_tensor=False, promote=True, bits=None)
  dims = fp8_recipe_errors.MATMUL
  bf16 = lambda v: jnp.asarray(v).astype(jnp.bfloat16)
  want = fp8.dot_general(
    bf16(x), bf16(w), dims, config=fp8.BlockScaling(), preferred_element_type=jnp.float32
  )
  np.testing.assert_allclose(model, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_truncation_keeps_the_leading_bits_toward_zero():
  x = jnp.asarray([1 + 2.0**-13 + 2.0**-14, -(1 + 2.0**-13 + 2.0**-14), 3.0, 0.0])
  assert fp8_recipe_errors.truncate(x, 14).tolist() == [1 + 2.0**-13, -(1 + 2.0**-13), 3.0, 0.0]


def test_promotion_every_128_reduces_the_14_bit_accumulators_error():
  x, w, _ = fp8_recipe_errors.data("student_t", 128, 4096, 128)
  exact = fp8_recipe_errors.accumulator_model(x, w, per_tensor=False, promote=True, bits=None)
  error = lambda promote: fp8_recipe_errors.relative_errors(
    fp8_recipe_errors.accumulator_model(x, w, per_tensor=False, promote=promote), exact
  )["frobenius"]
  promoted, unpromoted = error(True), error(False)
  assert unpromoted > 4 * promoted
  assert 2.0**-14 < unpromoted < 2.0**-6  # 128 truncations of up to 2^-13 each


def test_training_smoke_reports_each_run_against_bf16(tmp_path):
  result = fp8_training.main(
    ["--smoke", "--steps", "2", "--runs", "fp8_current,bf16", "--out", str(tmp_path)]
  )
  runs = result["runs"]
  assert list(runs) == ["bf16", "fp8_current"]  # in the script's order
  bf16 = runs["bf16"]["val_loss"]
  for name, row in runs.items():
    assert row["vs_bf16"] == pytest.approx((row["val_loss"] - bf16) / bf16)
    assert abs(row["vs_bf16"]) < 0.01, name  # 3 steps of the quick model: fp8 rounding only
    assert row["skipped"] == 0
  assert "| fp8_current |" in (tmp_path / "fp8_training.md").read_text()
  with pytest.raises(SystemExit, match="Unknown runs"):
    fp8_training.main(["--smoke", "--runs", "fp9", "--out", str(tmp_path)])


@pytest.mark.parametrize("keep_first_last", [False, True])
def test_training_runs_every_dense_in_fp8_or_all_but_the_first_and_last(keep_first_last):
  plan, model = fp8_training.runs(2, smoke=True, keep_first_last=keep_first_last)
  recipe, config = plan["fp8_current"]
  task = charlm.CharLMTask(model, seed=0)
  setup = common.make_setup(task, recipe, config)
  params, model_state, fp8_state, _ = setup.state
  loss_fn = common.make_loss_fn(setup)
  with flax_fp8.placement_report() as report:
    jax.eval_shape(loss_fn, params, None, model_state, fp8_state, task.train_batch(0), None)
  kept = report.kept
  if not keep_first_last:
    assert kept == {} and len(report.fp8) == len(report.layers) > 2
  else:
    # The first block's q/k/v (one input, counted together) and the head.
    assert sorted(p.rsplit("/", 1)[-1] for p in kept) == ["head", "key", "query", "value"]
    assert len(report.fp8) == len(report.layers) - 4


def test_sharding_counts_each_collective_per_execution(tmp_path):
  # FSDP on 8 devices: the bf16 layer gathers its bf16 kernel and sums the kernel gradient's
  # partial products in bf16; current scaling gathers the E4M3 kernel and sums in fp32; block
  # scaling sums fp32 per 1024-row tile of the transposed gradient, in a loop counted per trip,
  # and one fp32 scalar, the zeros that loop writes its tiles into.
  shape = fp8_sharding.SMOKE_SHAPE
  kernel = shape["d"] * shape["f"]
  result = fp8_sharding.main(["--smoke", "--out", str(tmp_path)])
  rows = result["rows"]
  assert rows["bf16"]["collectives"] == {
    "all-gather": {"bf16": 2 * kernel},
    "all-reduce": {"bf16": 2 * kernel},
  }
  current = rows["current"]["collectives"]
  assert current["all-gather"] == {"f8e4m3fn": kernel}
  assert current["all-reduce"]["f32"] == 4 * kernel
  assert rows["block"]["collectives"]["all-reduce"] == {"f32": 4 * kernel + 4}
  assert json.loads((tmp_path / "fp8_sharding.json").read_text())["rows"] == rows
  assert "| block |" in (tmp_path / "fp8_sharding.md").read_text()
