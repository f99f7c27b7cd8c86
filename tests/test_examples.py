"""The examples end to end in --quick mode, and the comparison's JSON.

Everything runs in-process on tiny models (the quick presets compile with
XLA's backend optimizations off), so the file takes about a minute on 2 cores.
The comparison runs the LM's underflow scenario (a global batch of
2^19 tokens, --replicas 1024 at the quick preset's 512 tokens per step) with
the three recipes whose relation the issue pins down: fp32, fp16 without
loss scaling (measurably worse) and fp16 with a dynamic scale (matches fp32).
A second comparison runs four recipes of the opt-in low-precision-params group (bf16
parameters), the split and its references among them, and checks its outputs and the split's
exactness; its fp32-master (the bf16 recipe) is also the fp8 test's bf16 reference.
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jl
from jmp_lite import fp8

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

from examples import charlm, common, compare, digits, low_precision

from .autocast_testing import census

QUICK = ["--quick", "--no-progress"]


def _finite(values):
  return all(math.isfinite(v) for v in values)


def _decreased(curve, fraction=0.2):
  """The mean of the last `fraction` of a loss curve is below its first value."""
  tail = max(1, int(len(curve) * fraction))
  return float(np.mean(curve[-tail:])) < curve[0]


@pytest.mark.parametrize("module", [charlm, digits, compare])
def test_help(module, capsys):
  with pytest.raises(SystemExit) as exit_info:
    module.build_parser().parse_args(["--help"])
  assert exit_info.value.code == 0
  assert "--quick" in capsys.readouterr().out


def test_recipes_and_half():
  assert list(common.RECIPES) == [
    "fp32",
    "bf16",
    "fp16",
    "fp16-static",
    "fp16-dynamic",
    "fp16-layerwise",
    "fp8",
  ]
  # CPU has native bf16, so "half" is bf16 (jl.half_dtype()).
  assert common.get_recipe("half").name == "bf16"
  with pytest.raises(ValueError, match="Unknown recipe"):
    common.get_recipe("fp12")
  with pytest.raises(ValueError, match="power of two"):
    common.TrainConfig(replicas=3)


def test_data_is_the_documented_split():
  train, val = charlm.read_corpus()
  assert train.dtype == np.uint8 and train.max() < charlm.VOCAB
  assert 0.88 < len(train) / (len(train) + len(val)) < 0.92
  x_train, _, x_val, y_val = digits.load_data()
  assert x_train.shape == (1437, 8, 8, 1) and x_val.shape == (360, 8, 8, 1)
  assert 0.0 <= x_train.min() and x_train.max() <= 1.0
  assert sorted(set(y_val.tolist())) == list(range(10))


def test_digits_quick_with_layerwise_scaling(tmp_path):
  # BatchNorm, stage boundaries and LayerwiseLossScale together.
  out = digits.main([*QUICK, "--recipe", "fp16-layerwise", "--json", str(tmp_path / "d.json")])
  result = out["result"]
  assert json.loads((tmp_path / "d.json").read_text())["result"]["recipe"] == "fp16-layerwise"
  assert _decreased(result["train_loss"])
  assert result["final"]["val_accuracy"] > 0.5  # 10 classes: chance is 0.1
  assert len(result["stage_scales"][-1]) == 4
  assert result["skipped"] == sorted(set(result["skipped"]))
  assert all(0 <= s < result["steps"] for s in result["skipped"])


FP8_REPLICAS = 2**20
"""The loss over 2^20 tokens (replicas = 2^20): under E5M2 with a unit scale every output
gradient would flush, and a run that learns from this loss learns from any."""


@pytest.fixture(scope="module")
def fp8_run():
  """The LM's quick preset under fp8 (30 steps) at FP8_REPLICAS. Its bf16 reference is the
  low-precision-params run's fp32-master (the bf16 recipe, at the same replicas)."""
  model_config, quick = charlm.PRESETS["quick"]
  config = dataclasses.replace(quick, replicas=FP8_REPLICAS, progress=False)
  task = charlm.CharLMTask(model_config, seed=config.seed)
  return common.train(task, common.RECIPES["fp8"], config), config


def test_charlm_quick_with_fp8(fp8_run):
  result, _ = fp8_run
  assert _decreased(result.train_loss)
  assert result.final["val_loss"] < math.log(charlm.VOCAB)  # better than uniform
  # Current scaling (the default) keeps no fp8 state, so there are no scales to report.
  assert result.fp8_scales is None


def test_charlm_quick_with_delayed_fp8_adapts_its_scales():
  out = charlm.main([*QUICK, "--recipe", "fp8", "--fp8-scaling", "delayed"])
  result = out["result"]
  assert _decreased(result["train_loss"])
  # Calibrated on the first batch, then updated from the amax history: no scale is 0 (none)
  # or 1 (an untouched default) at the end.
  scales = [s for per_layer in result["fp8_scales"].values() for s in per_layer]
  assert len(scales) == 3 * len(result["fp8_scales"]) > 0
  assert all(math.isfinite(s) and s not in (0.0, 1.0) for s in scales)


def test_examples_fp8_recipe_is_the_library_default():
  _, preset = charlm.PRESETS["cpu"]
  assert common.fp8_recipe(preset) == fp8.as_recipe(None) == fp8.CurrentScaling()
  parser = charlm.build_parser()
  delayed = common.train_config_from_args(parser.parse_args(["--fp8-scaling", "delayed"]), preset)
  assert common.fp8_recipe(delayed) == fp8.DelayedScaling(amax_history_length=16)
  # An explicit recipe (benchmarks/fp8_training.py's) wins over the scaling's name.
  rowwise = dataclasses.replace(delayed, fp8_recipe=fp8.RowwiseScaling())
  assert common.fp8_recipe(rowwise) == fp8.RowwiseScaling()
  with pytest.raises(ValueError, match="fp8_scaling must be one of current, delayed, got 'x'"):
    common.TrainConfig(fp8_scaling="x")


def test_examples_fp8_first_step_flushes_no_gradient(fp8_run, low_precision_run):
  # With the default recipe, step 0's parameter gradients have no zeros that bf16's lack,
  # layer by layer. bf16's: the first step of the low-precision-params run's fp32-master, the
  # bf16 recipe under another name, trained under the same configuration (FP8_REPLICAS).
  fp8_result, config = fp8_run
  _, _, returned = low_precision_run
  fp32_master = common.get_recipe("fp32-master")
  bf16 = common.RECIPES["bf16"]
  assert dataclasses.replace(fp32_master, name=bf16.name, summary=bf16.summary) == bf16
  train = dataclasses.asdict(config)
  assert returned["train"] == {k: v for k, v in train.items() if k != "progress"}
  step0 = {"fp8": fp8_result.grad_stats["0"]}
  step0["bf16"] = returned["results"]["fp32-master"]["grad_stats"]["0"]
  assert set(step0["fp8"]) == set(step0["bf16"])
  zeros = {name: {k: v["zero_fraction"] for k, v in s.items()} for name, s in step0.items()}
  # The embedding's zeros are the rows of characters absent from the batch (about 60%), which
  # rounding can only make fewer; every other layer's gradient has exactly bf16's zeros.
  assert zeros["fp8"].pop("embed") <= zeros["bf16"].pop("embed") < 0.7
  assert zeros["fp8"] == zeros["bf16"]


def test_validation_panel_keeps_a_quick_runs_points():
  # A quick run's three points: the untrained first one may be cut, the others stay in view.
  quick = {"a": {"val_loss": [2.32, 1.96, 0.94]}, "b": {"val_loss": [2.32, 1.95, 0.93]}}
  assert compare.validation_top(quick) == pytest.approx(1.05 * 2.32)
  # A full run zooms in on its trained part: 1.5 x the final loss.
  full = {"a": {"val_loss": [5.46, 2.79, *([2.3] * 8), 2.24]}}
  assert compare.validation_top(full) == pytest.approx(1.5 * 2.24)


def test_layerwise_note_names_each_examples_stages():
  row = {"recipe": "fp16-layerwise", "final_stage_scales": [2.0**14] * 4}
  for task, words in ((digits.DigitsTask, "conv"), (charlm.CharLMTask, "embedding")):
    note = compare.table_notes([row], 1, 3, task.stages)
    assert f"one per stage, in order: {task.stages}." in " ".join(note.split())
    assert words in task.stages
  assert "embedding" not in digits.DigitsTask.stages


# One worker runs this module under pytest-xdist, so its module fixture runs once.
pytestmark = pytest.mark.xdist_group("examples")


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
  out = tmp_path_factory.mktemp("compare")
  compare.main([*QUICK, "--recipes", "fp32,fp16,fp16-dynamic", "--out", str(out)])
  with open(out / "charlm_compare.json") as f:
    return json.load(f), out


def test_comparison_writes_table_plots_and_json(comparison):
  summary, out = comparison
  assert set(summary) >= {
    "example",
    "command",
    "platform",
    "model",
    "train",
    "table",
    "results",
    "activation_gradients",
    "wall_s",
  }
  assert summary["train"]["replicas"] == charlm.GLOBAL_BATCH_TOKENS // (16 * 32)
  for name in ("loss", "loss_scale", "grad_histogram", "underflow"):
    assert (out / f"charlm_{name}.png").stat().st_size > 1000
  assert (out / "charlm_compare.md").read_text().count("\n") == 2 + 3
  assert [row["recipe"] for row in summary["table"]] == ["fp32", "fp16", "fp16-dynamic"]
  fp32 = summary["table"][0]
  assert fp32["step_time_vs_fp32"] == 1.0 and fp32["memory_vs_fp32"] == 1.0
  fp32_bytes = summary["results"]["fp32"]["memory"]["total_bytes"]
  for row in summary["table"]:
    assert set(row) >= {
      "train_loss",
      "val_loss",
      "val_bpc",
      "val_accuracy",
      "skipped_steps",
      "final_loss_scale",
      "step_time_ms",
      "memory_mib",
      "step_time_vs_fp32",
      "memory_vs_fp32",
    }
    # Time and memory are measured; the table shows them and their ratios to fp32's.
    total_bytes = summary["results"][row["recipe"]]["memory"]["total_bytes"]
    assert row["memory_mib"] == pytest.approx(total_bytes / 2**20, rel=1e-5)
    assert row["memory_vs_fp32"] == pytest.approx(total_bytes / fp32_bytes, rel=1e-5)
    ratio = row["step_time_ms"] / fp32["step_time_ms"]
    assert row["step_time_vs_fp32"] == pytest.approx(ratio, rel=1e-5)
    # The JSON keeps 6 significant digits.
    assert row["val_bpc"] == pytest.approx(row["val_loss"] / math.log(2), rel=1e-5)


def test_comparison_results_are_sane(comparison):
  summary, _ = comparison
  results = summary["results"]
  steps = summary["train"]["steps"]
  for name, r in results.items():
    assert len(r["train_loss"]) == len(r["loss_scale"]) == steps, name
    assert _finite(r["train_loss"]) and _finite(r["val_loss"]), name
    assert all(0 <= s < steps for s in r["skipped"]), name
    # Every scale is a power of two (unscaling is exact): 1, or 2^15 halved or doubled.
    assert all(math.frexp(s)[0] == 0.5 for s in r["loss_scale"]), name
    memory = r["memory"]  # compiled.memory_analysis(); donated arguments are counted once
    assert memory["total_bytes"] == (
      memory["argument_size_in_bytes"]
      + memory["output_size_in_bytes"]
      - memory["alias_size_in_bytes"]
      + memory["temp_size_in_bytes"]
    )
    assert r["compile_s"] > 0
    for layers in r["grad_stats"].values():
      for stats in layers.values():
        assert 0.0 <= stats["zero_fraction"] <= 1.0
        assert 0.0 <= stats["underflow_fraction"] <= 1.0
  assert results["fp32"]["skipped"] == []
  assert results["fp32"]["loss_scale"] == results["fp16"]["loss_scale"] == [1.0] * steps
  # The step takes the same parameters and optimizer state in every recipe (a policy changes
  # only how it computes), and the dynamic scale's state besides.
  arguments = {name: r["memory"]["argument_size_in_bytes"] for name, r in results.items()}
  dynamic = jax.tree.leaves(jl.DynamicLossScale(jnp.float32(1.0)))
  assert arguments == {
    "fp32": arguments["fp32"],
    "fp16": arguments["fp32"],
    "fp16-dynamic": arguments["fp32"] + sum(x.nbytes for x in dynamic),
  }
  # The dynamic scale starts at 2^15 and halves after each skipped step (hysteresis 1).
  scales, skipped = results["fp16-dynamic"]["loss_scale"], results["fp16-dynamic"]["skipped"]
  assert scales[0] == 2.0**15
  halved = [i for i in range(steps - 1) if scales[i + 1] == scales[i] / 2]
  assert halved == [s for s in skipped if s < steps - 1]


def test_underflow_scenario(comparison):
  """fp32 learns; fp16 with a dynamic scale matches it; fp16 without scaling is worse."""
  results = {r["recipe"]: r for r in comparison[0]["table"]}
  fp32 = comparison[0]["results"]["fp32"]
  assert _decreased(fp32["train_loss"])
  assert fp32["val_loss"][-1] < fp32["val_loss"][0] - 0.5
  assert abs(results["fp16-dynamic"]["val_loss"] - results["fp32"]["val_loss"]) < 0.01
  assert results["fp16"]["val_loss"] > results["fp32"]["val_loss"] + 0.05
  # The mechanism: most activation gradients of the trained fp32 model are below fp16's
  # smallest subnormal, and the dynamic scale lifts nearly all of them into range.
  act = comparison[0]["activation_gradients"]
  head = act["stats"]["head"]
  assert head["underflow_fraction"] > 0.5
  assert act["stats_at_dynamic_scale"]["head"]["underflow_fraction"] < 0.01


# Pure 16-bit training: the opt-in low-precision-params group.
LOW_PRECISION = common.RECIPE_GROUPS["low-precision-params"]


def test_low_precision_group_is_opt_in(capsys):
  assert LOW_PRECISION == (
    "fp32-master",
    "fp32-master-view",
    "bf16-nearest",
    "bf16-stochastic",
    "bf16-kahan",
    "bf16-split",
  )
  for example in compare.EXAMPLES:
    assert not set(LOW_PRECISION) & set(compare.DEFAULT_RECIPES[example])
    assert compare.recipe_names(None, example) == list(compare.DEFAULT_RECIPES[example])
  assert compare.recipe_names("fp32, low-precision-params", "charlm") == ["fp32", *LOW_PRECISION]
  assert common.get_recipe("bf16-stochastic").moment_dtype == "bfloat16"
  with pytest.raises(SystemExit):
    compare.build_parser().parse_args(["--help"])
  assert "low-precision-params" in capsys.readouterr().out


def test_bf16_high_half_is_the_splits_high_half():
  from jmp_lite import _rounding

  x = jax.random.normal(jax.random.key(0), (4096,)) * jnp.logspace(-30, 30, 4096)
  # Ties (the dropped 16 bits are exactly 0x8000), both signs: away from zero.
  ties = jax.lax.bitcast_convert_type(
    jnp.asarray([0x3F808000, 0x3F818000, 0x00008000, 0x7F008000], jnp.int32), jnp.float32
  )
  x = jnp.concatenate([x, ties, -ties])
  high = common.bf16_high_half(x)
  assert high.dtype == jnp.bfloat16
  np.testing.assert_array_equal(high, _rounding.split_float32(x)[0])
  # The gradient passes through unchanged, in fp32.
  g = jax.grad(lambda v: jnp.sum(common.bf16_high_half(v).astype(jnp.float32) * 3.0))(x)
  assert g.dtype == jnp.float32 and bool(jnp.all(g == 3.0))


# Bytes per parameter of parameters + optimizer state (Adam), counted from the trees: fp32 4 + 8;
# bf16 parameters 2, with fp32 moments 8 or bf16 moments 4, Kahan's or the split's 2 more. The
# counters, key and loss-scaling state add under 0.01 per parameter.
BYTES_PER_PARAM = {"fp32-master": 12, "fp32-master-view": 12, "bf16-nearest": 10}
BYTES_PER_PARAM |= {"bf16-stochastic": 6, "bf16-kahan": 12, "bf16-split": 12}

TRAINED = ("fp32-master", "fp32-master-view", "bf16-nearest", "bf16-split")
"""The recipes of the group that low_precision_run trains: the split and its two references,
and round to nearest, whose updates rounded away the run shows. bf16-stochastic and
bf16-kahan go through the same training loop and report (only the library's method differs,
tested per method in tests/test_low_precision_params.py: training, counting what rounded
away, loss scaling around it); their states are checked in
test_every_low_precision_recipe_keeps_its_bytes_per_parameter."""


def test_every_low_precision_recipe_keeps_its_bytes_per_parameter():
  # What train() counts for the report (RunResult.state_bytes), for each recipe of the group.
  model_config, config = charlm.PRESETS["quick"]
  task = charlm.CharLMTask(model_config, seed=config.seed)
  for name in LOW_PRECISION:
    params, _, _, opt_state = common.make_setup(task, common.get_recipe(name), config).state
    elements = sum(int(np.size(p)) for p in jax.tree.leaves(params))
    per_param = (common.tree_bytes(params) + common.tree_bytes(opt_state)) / elements
    assert per_param == pytest.approx(BYTES_PER_PARAM[name], abs=0.01), name


@pytest.fixture(scope="module")
def low_precision_run(tmp_path_factory):
  """compare --recipes TRAINED at FP8_REPLICAS, for the fp8 test's bf16 reference (bf16 has
  fp32's range: the comparison's own 1024 replicas give the same losses): (the JSON, the
  output directory, the summary compare.main returned, unrounded)."""
  out = tmp_path_factory.mktemp("low_precision")
  recipes = ",".join(TRAINED)
  returned = compare.main(
    [*QUICK, "--recipes", recipes, "--replicas", str(FP8_REPLICAS), "--out", str(out)]
  )
  with open(out / "charlm_compare.json") as f:
    return json.load(f), out, returned


def test_low_precision_outputs(low_precision_run):
  summary, out, _ = low_precision_run
  steps = summary["train"]["steps"]
  assert list(summary["results"]) == list(TRAINED)
  assert (out / "charlm_low_precision.png").stat().st_size > 1000
  assert (out / "charlm_low_precision.md").read_text().count("\n") == 2 + len(TRAINED)
  rows = {row["recipe"]: row for row in summary["low_precision"]["table"]}
  assert list(rows) == list(TRAINED)
  base = summary["results"]["fp32-master"]["final"]
  for name, r in summary["results"].items():
    row = rows[name]
    assert row["bytes_per_param"] == pytest.approx(BYTES_PER_PARAM[name], abs=0.01), name
    relative = r["final"]["val_loss"] / base["val_loss"] - 1  # of values rounded to 6 digits
    assert row["val_loss_rel"] == pytest.approx(relative, abs=1e-5), name
    assert _finite(r["train_loss"]) and r["skipped"] == [], name
    share = low_precision.rounded_away_share(r)
    if common.get_recipe(name).params_method is None:
      assert share is None and row["rounded_away"] is None, name
      continue
    assert (
      r["low_precision_size"] == summary["results"]["fp32-master"]["state_bytes"]["param_elements"]
    )
    assert len(share) == steps and all(0.0 <= s <= 1.0 for s in share), name
    # The first step's learning rate is 0 (warmup): no update, none lost.
    assert share[0] == 0.0 and max(share) > 0.0, name
    assert set(row["rounded_away"]) == {"start", "middle", "end"}
  assert _decreased(summary["results"]["bf16-nearest"]["train_loss"])


def test_split_loses_no_update(low_precision_run):
  """bf16-split's fp32 values are bit for bit those of fp32 training reading the same view."""
  summary, _, _ = low_precision_run
  results = summary["results"]
  for key in ("train_loss", "val_loss", "val_accuracy"):
    assert results["bf16-split"][key] == results["fp32-master-view"][key], key
  exact = summary["low_precision"]["split_vs_fp32-master-view"]
  assert exact["bit_equal_share"] == 1.0 and exact["max_rel_diff"] == 0.0
  # fp32-master reads XLA's round-to-nearest view (and fp32 embedding and LayerNorm
  # parameters) of fp32 initial values: close, not equal.
  assert summary["low_precision"]["split_vs_fp32-master"]["bit_equal_share"] < 1.0


# The Equinox and Haiku examples, each against the fp32 run of the same script.
def _dynamic_trajectory(first: float, skipped: list[int], steps: int, period: int) -> list[float]:
  """jl.DynamicLossScale's scale per step from its first one and the skipped steps: halved
  after a skipped step, doubled after `period` finite steps in a row (hysteresis 1)."""
  scales, finite_run = [first], 0
  for step in range(steps - 1):
    finite_run = 0 if step in skipped else finite_run + 1
    scales.append(scales[-1] / 2 if step in skipped else scales[-1])
    if finite_run == period:
      scales[-1], finite_run = scales[-1] * 2, 0
  return scales


def _check_fp16_run(run, steps: int, period: int, backoff: int):
  """A dynamic-scale fp16 run that starts at 2^24: its first `backoff` steps overflow (the
  scale halves each time), then the scale follows the dynamic rule exactly; a skipped step
  leaves Adam's state as it was (its count is the applied steps'); the step traced once."""
  scales, skipped = run["loss_scale"], run["skipped"]
  assert scales[0] == 2.0**24 and skipped[:backoff] == list(range(backoff))
  assert backoff not in skipped  # the first finite step, at 2^(24 - backoff)
  assert scales == _dynamic_trajectory(2.0**24, skipped, steps, period)
  assert run["skipped_steps"] == len(skipped) and run["adam_count"] == steps - len(skipped)
  assert run["param_dtypes"] == ["float32"]  # fp32 master weights
  assert _decreased(run["train_loss"], 0.1) and _finite(run["train_loss"])


# The single-file training scripts a user copies (examples/optax_fp16.py, linen_train_state.py,
# nnx_optimizer.py, equinox_autocast.py): each in fp16 with a dynamic scale from 2^24.
def test_optax_script_in_fp16_learns_and_its_scale_follows_the_rule():
  from examples import optax_fp16

  run = optax_fp16.main(["--precision", "fp16"])
  # fp32 run of the script: 0.953 measured; fp16: 0.958 (9 of 150 steps skipped).
  assert run["val_accuracy"] > 0.93
  _check_fp16_run(run, steps=150, period=25, backoff=5)
  assert run["traces"] == 1  # the moving scale is state: the step is traced once


def test_linen_script_trains_through_train_state():
  from examples import linen_train_state

  run = linen_train_state.main(["--precision", "fp16"])
  # fp32 run of the script: 0.983 measured; fp16: 0.975 (9 of 120 steps skipped).
  assert run["val_accuracy"] > 0.95
  _check_fp16_run(run, steps=120, period=20, backoff=6)
  assert run["steps"] == 120  # TrainState.step counts skipped steps too
  assert run["stats_dtypes"] == ["float32"] and run["traces"] == 1


def test_nnx_script_trains_through_the_optimizer():
  from examples import nnx_optimizer

  run = nnx_optimizer.main(["--precision", "fp16"])
  # fp32 run of the script: 0.981 measured; fp16: 0.978 (9 of 120 steps skipped).
  assert run["val_accuracy"] > 0.95
  _check_fp16_run(run, steps=120, period=20, backoff=6)


@pytest.fixture(scope="module")
def equinox_runs():
  pytest.importorskip("equinox")
  from examples import equinox_autocast

  return {p: equinox_autocast.main(["--precision", p]) for p in ("fp32", "fp16")}


def test_equinox_example_in_fp16_learns_as_fp32_does(equinox_runs):
  fp32, fp16 = equinox_runs["fp32"], equinox_runs["fp16"]
  assert fp32["val_accuracy"] > 0.92  # 0.944 measured; 10 classes, chance is 0.1
  # fp16 skips its overflowing steps (9 of 100 measured) and reaches 0.961.
  assert fp16["val_accuracy"] > fp32["val_accuracy"] - 0.03
  for run in (fp32, fp16):
    assert run["grad_dtypes"] == run["param_dtypes"] == ["float32"]
    assert run["traces"] == 1  # the moving scale is state: the step is traced once


def test_equinox_example_loss_scale_follows_the_dynamic_rule(equinox_runs):
  fp32, fp16 = equinox_runs["fp32"], equinox_runs["fp16"]
  assert fp32["skipped"] == [] and fp32["loss_scale"] == [1.0] * len(fp32["loss_scale"])
  # At 2^24 the logits' cotangent, 2^24 (p - onehot) / 64, is far above fp16's 65504.
  _check_fp16_run(fp16, steps=100, period=20, backoff=4)


@pytest.fixture(scope="module")
def haiku_runs():
  pytest.importorskip("haiku")
  from examples import haiku_autocast

  return {p: haiku_autocast.main(["--precision", p]) for p in ("fp32", "bf16")}


def test_haiku_example_in_bf16_learns_as_fp32_does(haiku_runs):
  fp32, bf16 = haiku_runs["fp32"], haiku_runs["bf16"]
  assert fp32["val_accuracy"] > 0.9  # 0.953 measured
  assert bf16["val_accuracy"] > fp32["val_accuracy"] - 0.02  # 0.953 measured
  assert _decreased(bf16["train_loss"], 0.1) and _finite(bf16["train_loss"])
  for run in (fp32, bf16):
    assert run["skipped_steps"] == 0
    assert run["grad_dtypes"] == run["param_dtypes"] == ["float32"]


def test_haiku_example_runs_matmuls_in_bf16_and_statistics_in_fp32():
  hk = pytest.importorskip("haiku")
  from examples import haiku_autocast

  model = hk.transform(haiku_autocast.forward)
  x = jnp.zeros((2, 8, 8, 1))
  params = jax.jit(model.init, static_argnums=2)(jax.random.key(0), x, False)
  policy = jl.get_policy(haiku_autocast.POLICIES["bf16"])
  closed = jax.make_jaxpr(jl.autocast(model.apply, policy), static_argnums=3)(
    params, None, x, False
  )
  found = census(closed)
  assert found["conv_general_dilated"] == found["dot_general"] == {"bfloat16"}
  assert found["reduce_sum"] == found["rsqrt"] == {"float32"}  # the LayerNorm's statistics
  assert closed.out_avals[0].dtype == jnp.float32
