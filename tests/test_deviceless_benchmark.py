"""benchmarks/deviceless.py: the HLO reader on hand-written modules, and deviceless compiles.

The compiles need the ``aot`` extra (the CUDA plugin and libtpu: 0.5-0.7 GB each, which CI does
not install): where a compiler is missing its test is skipped with the reason, and the reader's
tests still run.
"""

import functools
import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from benchmarks import _hlo, deviceless


def _installed(name):
  try:
    return importlib.util.find_spec(name) is not None
  except ModuleNotFoundError:  # its parent package is absent
    return False


HAS_CUDA, HAS_TPU = _installed("jax_plugins.xla_cuda12"), _installed("libtpu")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the aot extra (jax-cuda12-plugin) is absent")
needs_tpu = pytest.mark.skipif(not HAS_TPU, reason="the aot extra (libtpu) is absent")

MODULE = """HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

%fused_add (p0: f32[4,8], p1: f32[4,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[4,8]{1,0} parameter(1)
  ROOT %add.1 = f32[4,8]{1,0} add(%p0, %p1)
}

%body (state: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %state = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%state), index=1
  %sum = f32[4,8]{1,0} fusion(%x, %x), kind=kLoop, calls=%fused_add
  %reduced = f32[4,8]{1,0} all-reduce(%sum), replica_groups={}, to_apply=%fused_add
  ROOT %next = (s32[], f32[4,8]{1,0}) tuple(%i, %reduced)
}

%cond (state.1: (s32[], f32[4,8])) -> pred[] {
  %state.1 = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main.1 (x.1: f32[4,8], /*index=1*/big.1: bf16[8192,8192]) -> f32[4,8] {
  %x.1 = f32[4,8]{1,0} parameter(0)
  %big.1 = bf16[8192,8192]{1,0} parameter(1)
  %wide = f32[8192,8192]{1,0} fusion(%big.1), kind=kLoop, calls=%fused_add
  %gemm = (bf16[4,8]{1,0}, s8[16]{0}) custom-call(%x.1, %x.1), custom_call_target="__cublas$lt$matmul"
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}) tuple(%zero, %x.1)
  %loop = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[4,8]{1,0} get-tuple-element(%loop), index=1
}
"""  # noqa: E501


def test_kernel_summary_counts_launches_bytes_and_large_buffers():
  summary = _hlo.kernel_summary(MODULE)
  # The entry's two kernels, and the while body's two, three times over; bookkeeping is free.
  assert summary["kernels"] == {"all-reduce": 3, "custom-call": 1, "fusion:kLoop": 4}
  assert summary["kernel_count"] == 8
  assert summary["collectives"] == {"all-reduce": 3}
  assert summary["gemm_custom_calls"] == {"__cublas$lt$matmul": 1}
  assert summary["large_buffers"] == {"f32[8192,8192]": 1}
  small = 4 * 8 * 4  # one f32[4,8]
  wide = 8192 * 8192 * (2 + 4)  # reads the bf16 input once, writes the f32 result
  gemm = small + (4 * 8 * 2 + 16)  # x once (the same operand twice), a tuple result
  body = 3 * ((small + small) + (small + small))  # fusion(x, x) and all-reduce(sum)
  assert summary["bytes_moved"] == wide + gemm + body


def test_shape_bytes_of_arrays_and_tuples():
  assert _hlo.shape_bytes("f32[8,16,1024,1024]{3,2,1,0}") == 8 * 16 * 1024 * 1024 * 4
  assert _hlo.shape_bytes("(bf16[3]{0}, f8e4m3fn[5]{0}, pred[])") == 6 + 5 + 1
  with pytest.raises(ValueError, match="ENTRY"):
    _hlo.kernel_summary("HloModule m\n")


def test_unknown_targets_and_sizes_are_refused():
  with pytest.raises(ValueError, match="accepted: h200, v5e, v6e"):
    deviceless.target_device("a100")
  with pytest.raises(SystemExit, match="Unknown widths"):
    deviceless.main(["--widths", "512"])
  with pytest.raises(SystemExit, match="Unknown recipes"):
    deviceless.main(["--recipes", "bf17"])


def _smoke(tmp_path, target):
  recipes = "flax_bf16,policy_bf16,policy_fp16_scaled,fp8"
  result = deviceless.main(
    ["--smoke", "--targets", target, "--recipes", recipes, "--out", str(tmp_path)]
  )
  (rows,) = result["tables"].values()
  assert json.loads((tmp_path / "deviceless.json").read_text())["tables"] == result["tables"]
  assert "| policy_bf16 |" in (tmp_path / "deviceless.md").read_text()
  for name, row in rows.items():
    assert "error" not in row, (name, row.get("error"))
    assert row["kernel_count"] == sum(row["kernels"].values()) > 0
    assert row["argument_mib"] > 0 and row["hbm_bytes"] > 0
  return rows


@needs_cuda
def test_smoke_compiles_for_an_h200(tmp_path):
  rows = _smoke(tmp_path, "h200")
  assert all(row["hbm_bytes_source"] == "kernel roofline" for row in rows.values())
  # The fp8 recipe's matmuls are fp8 in the GPU program (cuBLASLt or Triton, by XLA's choice).
  assert rows["fp8"]["kernels"].get("fusion:kCustom", 0) + len(rows["fp8"]["gemm_custom_calls"])


@needs_cuda
def test_every_fp8_recipe_compiles_for_an_h200(tmp_path):
  from benchmarks import _gpu_recipes

  recipes = ",".join(["policy_bf16", "fp8", *_gpu_recipes.FP8_RECIPES])
  result = deviceless.main(
    ["--smoke", "--targets", "h200", "--recipes", recipes, "--out", str(tmp_path)]
  )
  (rows,) = result["tables"].values()
  assert list(rows) == recipes.split(",")
  for name, row in rows.items():
    assert "error" not in row, (name, row.get("error"))
    assert row["kernel_count"] == sum(row["kernels"].values()) > 0


@needs_tpu
def test_smoke_compiles_for_tpu_v5e(tmp_path):
  rows = _smoke(tmp_path, "v5e")
  assert all(row["hbm_bytes_source"] == "XLA cost analysis" for row in rows.values())


@needs_tpu
def test_tpu_preset_compiles_to_the_program_without_it():
  # Why jmp_lite.flax and autocast declare no fp32-accumulation preset: on TPU the preset
  # compiles to the program without it.
  device = deviceless.target_device("v5e")
  sharding = jax.sharding.SingleDeviceSharding(device)
  x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=sharding)

  def compiled(precision):
    def loss(a, b):
      dims = (((1,), (0,)), ((), ()))
      return jnp.sum(jax.nn.gelu(lax.dot_general(a, b, dims, precision)).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, x).compile()

  plain, declared = compiled(None), compiled(lax.DotAlgorithmPreset.BF16_BF16_F32)
  strip = lambda c: re.sub(r"metadata=\{[^}]*\}|, stack_frame_id=\d+", "", c.as_text())
  assert _hlo.kernel_summary(strip(plain)) == _hlo.kernel_summary(strip(declared))
  assert plain.cost_analysis()["bytes accessed"] == declared.cost_analysis()["bytes accessed"]
  assert plain.memory_analysis().temp_size_in_bytes == declared.memory_analysis().temp_size_in_bytes


@needs_cuda
def test_the_policy_softmax_writes_no_fp32_scores_on_the_h200():
  # jmp_lite.flax's softmax of 16-bit scores computes in fp32 but materializes only 16-bit
  # arrays on the GPU: XLA:GPU's softmax fusions wrote the fp32 x - max out when it had two uses.
  import jmp_lite.flax as jlf

  sharding = jax.sharding.SingleDeviceSharding(deviceless.target_device("h200"))
  scores = jax.ShapeDtypeStruct((4, 16, 512, 512), jnp.bfloat16, sharding=sharding)  # 32 MiB
  mask = jax.ShapeDtypeStruct((4, 1, 512, 512), jnp.bool_, sharding=sharding)

  def loss(z, m, softmax):
    return jnp.sum(softmax(z, m).astype(jnp.float32) ** 2)

  def large_buffers(softmax):
    step = jax.jit(jax.grad(lambda z, m: loss(z, m, softmax)))
    return _hlo.kernel_summary(step.lower(scores, mask).compile().as_text())["large_buffers"]

  fp32_scores = "f32[4,16,512,512]"  # 64 MiB: listed when written
  plain_fp32 = lambda z, m: jax.nn.softmax(jnp.where(m, z.astype(jnp.float32), -1e30))
  assert fp32_scores in large_buffers(plain_fp32)  # the measure sees such a buffer
  assert fp32_scores not in large_buffers(lambda z, m: jlf.softmax(z, -1, m))


def _attention_cost(attention, target):
  """Temp bytes, roofline bytes and custom calls of one causal attention layer's gradient."""
  import flax.linen as nn

  sharding = jax.sharding.SingleDeviceSharding(deviceless.target_device(target))
  q = jax.ShapeDtypeStruct((4, 512, 8, 64), jnp.bfloat16, sharding=sharding)

  def loss(q, k, v):
    mask = nn.make_causal_mask(jnp.zeros(q.shape[:2]))
    return jnp.sum(attention(q, k, v, mask=mask).astype(jnp.float32) ** 2)

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q).compile()
  summary = _hlo.kernel_summary(compiled.as_text())
  temp = compiled.memory_analysis().temp_size_in_bytes
  return temp, summary["bytes_moved"], summary["gemm_custom_calls"]


@needs_cuda
def test_the_policy_attention_keeps_and_moves_less_than_flax_bf16_on_the_h200():
  # jmp_lite.flax's attention (fp32 softmax, 16-bit probabilities) against Flax's in bf16, one
  # causal layer's gradient: less temp memory (only the 16-bit probabilities are kept for the
  # backward pass, not the scores) and fewer bytes (the softmax backward's row sums come from
  # the [q, heads, depth] output, not from a pass over the [heads, q, k] probabilities).
  import flax.linen as nn

  import jmp_lite.flax as jlf

  flax_temp, flax_bytes, _ = _attention_cost(nn.dot_product_attention, "h200")
  temp, moved, _ = _attention_cost(jlf.dot_product_attention, "h200")
  assert temp < flax_temp
  assert moved < flax_bytes


@needs_cuda
def test_the_fused_attention_is_cudnns_kernel_on_the_h200_and_jmp_lites_on_a_tpu():
  import jmp_lite.flax as jlf

  fused = functools.partial(jlf.dot_product_attention, implementation="cudnn")
  temp, moved, calls = _attention_cost(fused, "h200")
  own_temp, own_moved, _ = _attention_cost(jlf.dot_product_attention, "h200")
  assert sorted(calls) == ["__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward"]
  assert temp < own_temp / 3 and moved < own_moved / 3  # no [4, 8, 512, 512] array written
  if HAS_TPU:
    tpu = _attention_cost(fused, "v5e")
    assert tpu[:2] == _attention_cost(jlf.dot_product_attention, "v5e")[:2]
