"""The GPU benchmark script (benchmarks/gpu.py, its probe and recipes) in --smoke mode, any backend.

The smoke run checks the structure of what the script writes and that every recipe and probe
case produced a figure or a recorded error; the helpers that read GPU HLO and classify
accumulators are checked against hand-made inputs, since no GPU runs here.
"""

import gzip
import json
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from benchmarks import _gpu_probe, _gpu_recipes, gpu

SMOKE_SECTIONS = "probe,recipes,sizes"
# Compiled and timed in the smoke run: the references, the loss-scaling pair and the sizes
# section's recipes; the others are traced and lowered (test_every_recipe_lowers).
TIMED = (
  "fp32_highest",
  "flax_bf16",
  "policy_bf16",
  "policy_fp16",
  "policy_fp16_scaled",
  "fp8",
  "fp8_fast",
)


# One worker runs this module under pytest-xdist, so its module fixture runs once.
pytestmark = pytest.mark.xdist_group("gpu_benchmark")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
  out = tmp_path_factory.mktemp("gpu")
  # The sizes section at the recipes' own width only, which reuses their rows (no compile).
  width = str(gpu.SMOKE.model["width"])
  args = ["--smoke", "--out", str(out), "--only", SMOKE_SECTIONS, "--save-hlo", "--widths", width]
  result = gpu.main([*args, "--recipes", ",".join(TIMED)])
  written = json.loads((out / "gpu.json").read_text())
  return result, written, (out / "gpu.md").read_text(), out


def _is_time(x):
  return isinstance(x, float) and x > 0 and math.isfinite(x)


def test_smoke_writes_every_recipe(smoke):
  result, written, md, out = smoke
  width = gpu.SMOKE.model["width"]
  for name in _gpu_recipes.SAVED_HLO:
    with gzip.open(out / f"hlo_{name}_d{width}.txt.gz", "rt") as f:
      assert "HloModule" in f.read()
  assert written["sections"].keys() == {"probe", "recipes", "sizes"}
  assert written["env"]["jax"] == jax.__version__
  assert written["env"]["device_kind"] == jax.devices()[0].device_kind
  s = gpu.SMOKE
  rows = written["sections"]["recipes"]["rows"]
  assert list(rows) == [n for n in _gpu_recipes.RECIPES if n in TIMED]  # the order
  for name, row in rows.items():
    assert row["label"] in md
    if "error" in row:
      # error_text's "TypeName: first line of the message", in the table where no time is.
      assert re.fullmatch(r"[A-Za-z_]\w*: [^\n]*", row["error"]), (name, row["error"])
      assert "ms" in row or f"| {row['label']} | {row['error']} |" in md, name
      continue
    assert _is_time(row["ms"]), (name, row)
    assert len(row["losses"]) == s.warmup + s.rounds * s.steps
    assert all(math.isfinite(x) for x in row["losses"]), name
    assert row["final_loss"] == row["losses"][-1]
    assert set(row["gemms"]) == {"cublas", "cublaslt", "cublaslt_fp8", "triton_gemm", "cudnn"}
  # Every recipe runs on CPU; each reference's ratio to itself is exactly 1.
  assert not [name for name, row in rows.items() if "ms" not in row]
  for ref in _gpu_recipes.REFERENCES:
    assert rows[ref][f"x_{ref}"] == 1.0
  assert _is_time(written["sections"]["recipes"]["loss_scaling_cost"])
  assert written["skipped"] == []
  assert result["sections"]["recipes"]["rows"] == rows


# Run a step in test_fp8_recipes_run_a_step_in_fp8_near_the_bf16_policy: the stateless fp8
# recipes, and delayed scaling calibrated at init with no per-step select (NaN if uncalibrated).
FP8_RUN = [*_gpu_recipes.FP8_RECIPES, "fp8_delayed_calibrated"]
LOWERED = [n for n in _gpu_recipes.RECIPES if n not in TIMED and n not in FP8_RUN]


@pytest.mark.parametrize("name", LOWERED)
def test_every_recipe_lowers(name):
  config, batch = gpu.SMOKE.model, gpu.SMOKE.batch
  tokens = jax.random.randint(jax.random.key(0), (batch, config["length"]), 0, config["vocab"])
  spec = _gpu_recipes.RECIPES[name].build(config)
  state = spec.init(_gpu_recipes.init_params(config, tokens), tokens)
  lowered = jax.jit(spec.step).lower(state, tokens)
  assert "dot_general" in lowered.as_text()
  _, loss = jax.eval_shape(spec.step, state, tokens)
  assert loss.shape == () and loss.dtype == jnp.float32


@pytest.fixture(scope="module")
def smoke_batch():
  config, batch = gpu.SMOKE.model, gpu.SMOKE.batch
  tokens = jax.random.randint(jax.random.key(0), (batch, config["length"]), 0, config["vocab"])
  return config, tokens, _gpu_recipes.init_params(config, tokens)


def _first_step(name, config, tokens, params):
  spec = _gpu_recipes.RECIPES[name].build(config)
  step = jax.jit(spec.step)
  state = spec.init(params, tokens)
  return step, state, step(state, tokens)


@pytest.fixture(scope="module")
def bf16_first_loss(smoke_batch):
  """The bf16 policy's first loss on the smoke batch, computed once for every fp8 recipe."""
  _, _, (_, loss) = _first_step("policy_bf16", *smoke_batch)
  return loss


@pytest.mark.parametrize("name", FP8_RUN)
def test_fp8_recipes_run_a_step_in_fp8_near_the_bf16_policy(name, smoke_batch, bf16_first_loss):
  config, tokens, params = smoke_batch
  bf16_loss = bf16_first_loss
  step, state, (new_state, loss) = _first_step(name, config, tokens, params)
  new_params = new_state[0]  # (params, opt_state), or (params, fp8 state, opt_state)
  # The first loss is the bf16 policy's to fp8's error (the same parameters and batch).
  assert abs(float(loss) - float(bf16_loss)) < 0.02 * float(bf16_loss), (loss, bf16_loss)
  assert "f8e4m3fn" in step.lower(state, tokens).as_text().lower()  # MLIR's f8E4M3FN: fp8
  moved = lambda a, b: bool(jnp.all(jnp.isfinite(a)) and jnp.any(a != b))
  assert all(jax.tree.leaves(jax.tree.map(moved, new_params, params))), name


def test_smoke_sizes_reuse_the_recipes_rows(smoke):
  # --widths kept the recipes' own width, whose rows the sizes section reuses.
  _, written, md, _ = smoke
  (row,) = written["sections"]["sizes"]["rows"]
  assert (row["config"]["width"], row["config"]["layers"]) == gpu.SMOKE.sizes[0]
  recipes = written["sections"]["recipes"]["rows"]
  assert row["reused"] == "recipes"
  assert row["recipes"] == {n: recipes[n] for n in _gpu_recipes.SIZE_RECIPES}
  assert _is_time(row["fp8_over_bf16"])
  assert all(_is_time(row["recipes"][n]["ms"]) for n in _gpu_recipes.SIZE_RECIPES)
  width, layers = gpu.SMOKE.sizes[0]
  assert md.count(f"\n| {width} | {layers} |") == 1


def test_smoke_probe_shows_fp32_accumulation_on_cpu(smoke):
  _, written, md, _ = smoke
  cases = written["sections"]["probe"]["cases"]
  assert len(cases) == 2 * len(_gpu_probe.probe_cases(jnp.float16, 8, 16, 32))
  assert {c["dtype"] for c in cases} == {"bfloat16", "float16"}
  for case in cases:  # a verdict, or the stage that failed
    assert ("verdict" in case) != ("error" in case), case
    assert "verdict" in case or case["error"].startswith(("lower:", "compile:", "run:"))
  by_name = {(c["case"], c["dtype"]): c for c in cases}
  if written["env"]["platform"] == "cpu":
    # XLA:CPU accumulates 16-bit dots in fp32 and rounds once, declared or not.
    for key in (("matmul", "bfloat16"), ("matmul", "float16"), ("matmul, preset", "bfloat16")):
      assert by_name[key]["verdict"] == "fp32 accumulate, one rounding", key
      assert by_name[key]["ones_error_eps"] <= 0.5
    assert by_name[("matmul, preset", "bfloat16")]["declared"] is True
    assert by_name[("matmul", "bfloat16")]["declared"] is False
  f32 = by_name[("matmul, preferred f32", "bfloat16")]
  assert f32["out_dtype"] == "float32" and f32["ones_error_eps"] == 0.0
  assert "## Matmul probe" in md and md.count("| matmul, preset |") == 2


def test_budget_skips_recipes_and_says_so(tmp_path):
  result = gpu.main(["--smoke", "--out", str(tmp_path), "--only", "recipes", "--budget-s", "0"])
  rows = result["sections"]["recipes"]["rows"]
  assert all(row["skipped"] == "time budget" for row in rows.values())
  assert sorted(result["skipped"]) == sorted(f"recipes/{n}" for n in _gpu_recipes.RECIPES)
  md = (tmp_path / "gpu.md").read_text()
  assert "Skipped (time budget): recipes/flax_bf16" in md
  assert json.loads((tmp_path / "gpu.json").read_text())["skipped"] == result["skipped"]


def test_only_rejects_unknown_sections():
  with pytest.raises(SystemExit):
    gpu.parse_args(["--only", "probe,nope"])
  assert gpu.parse_args(["--only", "sizes, probe"]).only == ["sizes", "probe"]


def test_gemm_counts_read_gpu_hlo():
  text = "\n".join(
    [
      '%a = (bf16[8,16]{1,0}, s8[4]{0}) custom-call(%x, %y), custom_call_target="__cublas$gemm"',
      "%b = (f32[8,16]{1,0}, s8[4]{0}) custom-call(%x, %y), "
      'custom_call_target="__cublas$lt$matmul"',
      "%c = (bf16[8,16]{1,0}, s8[4]{0}) custom-call(%q, %r, %s, %t), "
      'custom_call_target="__cublas$lt$matmul$f8"',
      "%d = (bf16[8,16]{1,0}, s8[4]{0}) custom-call(%q, %r, %s, %t), "
      'custom_call_target="__cublas$lt$matmul$f8"',
      '%e = bf16[8,16]{1,0} fusion(%x, %y), kind=kCustom, calls=%g, backend_config={"operation_'
      'queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{}}}',
      '%f = f32[8]{0} fusion(%x), kind=kCustom, backend_config={"fusion_backend_config":'
      '{"kind":"__triton"}}',
      "%g = (f32[1,2,3,4]{3,2,1,0}, u8[0]{0}) custom-call(%x, %y), "
      'custom_call_target="__cudnn$convForward"',
      "%h = f32[8,16]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}, "
      "algorithm=dot_bf16_bf16_f32",
    ]
  )
  calls = _gpu_probe.hlo_calls(text)
  assert calls["custom_calls"]["__cublas$lt$matmul$f8"] == 2
  assert calls["fusion_kinds"] == {"__triton_gemm": 1, "__triton": 1}
  assert calls["algorithms"] == {"dot_bf16_bf16_f32": 1}
  assert calls["dots"] == {"dot": 1}
  assert _gpu_probe.gemm_counts(calls) == {
    "cublas": 1,
    "cublaslt": 1,
    "cublaslt_fp8": 2,
    "triton_gemm": 1,
    "cudnn": 1,
  }


def _sum_in(values, dtype):
  """Sequential sum, rounding to ``dtype`` after every addition (a ``dtype`` accumulator)."""
  acc = dtype(0)
  for v in values:
    acc = dtype(np.float64(acc) + v)
  return acc


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16])
def test_accumulation_error_tells_accumulators_apart(dtype):
  k = 4096
  big = 2.0 ** (ml_dtypes.finfo(dtype).nmant + 1)
  ones = np.array([big] + [1.0] * (k - 1))
  exact = np.array([ones.sum()])
  once = np.array([np.float32(ones.sum())]).astype(dtype)  # fp32 accumulator, rounded once
  sixteen = np.array([_sum_in(ones, dtype)])
  assert sixteen[0] == big  # every 1 is lost
  once_error = _gpu_probe.accumulation_error(once, exact, dtype)
  assert once_error <= 0.5
  assert _gpu_probe.accumulation_verdict(once_error) == "fp32 accumulate, one rounding"
  error = _gpu_probe.accumulation_error(sixteen, exact, dtype)
  assert error > 4 and _gpu_probe.accumulation_verdict(error) == "16-bit accumulate"
  # Two fp32 halves each rounded to 16 bits, then added and rounded: within a few epsilons.
  halves = [np.float32(h.sum()).astype(dtype) for h in np.split(ones, 2)]
  split = np.array([dtype(np.float64(halves[0]) + np.float64(halves[1]))])
  assert _gpu_probe.accumulation_error(split, exact, dtype) <= 4
