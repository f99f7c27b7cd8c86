"""The fp8 diagnostics (benchmarks/fp8_check.py) at tiny sizes on the CPU.

On the CPU there is no anomaly to find: the tiny run must pass its own checks (causal, errors
finite and within fp8 rounding, exact probes), and a model with the causal mask removed must
fail the causality check.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from benchmarks import fp8_check
from jmp_lite import fp8

TINY = {"d_model": 32, "layers": 1, "heads": 2, "seq": 16, "batch": 2, "vocab": 32, "steps": 2}


# One worker runs this module under pytest-xdist, so its module fixture runs once.
pytestmark = pytest.mark.xdist_group("fp8_check")


def _e4m3_relative_rounding():
  """``||q(v) - v|| / ||v||`` for normal ``v`` quantized to E4M3 at the scale of its amax."""
  v = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
  scale = np.float32(np.abs(v).max() / float(jnp.finfo(fp8.E4M3).max))
  q = np.asarray(fp8.quantize(jnp.asarray(v), scale, fp8.E4M3), np.float64) * scale
  return float(np.linalg.norm(q - v) / np.linalg.norm(v))


@pytest.fixture(scope="module")
def tiny():
  return fp8_check.diagnose(**TINY, recipes=("fp32", "fp8"), budget_s=600)


def test_tiny_run_is_causal_and_within_fp8_rounding_of_fp32(tiny):
  assert tiny["backend"] == "cpu" and tiny["skipped"] == []
  step0 = tiny["step0"]
  ref = step0["causal"]["fp32"]
  for name in ("fp32", "fp8"):
    causal = step0["causal"][name]
    # Exactly causal: the earlier logits and the later positions' gradients are untouched...
    assert causal["past_logits_moved"] == 0 and causal["future_grad_max"] == 0
    # ...while the perturbation and the gradient do reach what they should: new tokens from t
    # on give the logits there other values, of the size of the logits themselves; fp8 moves
    # them, and its gradient reaches the earlier positions, as fp32 does, to fp8 rounding.
    assert causal["future_logits_moved"] > 0.1 * causal["past_logits_max"]
    for key in ("future_logits_moved", "past_logits_max", "past_grad_max"):
      assert causal[key] == pytest.approx(ref[key], rel=fp8_check.ACTIVATION_SUSPECT), key
    # The step, the check passes and the capturing pass compute the same logits here.
    assert causal["step_moved"] == causal["capture_moved"] == 0
    assert tiny[f"causal_leak_{name}"] is False
  errors = step0["intermediates"]["fp8"]
  assert next(iter(errors)) == "Embed_0" and list(errors)[-1] == "logits"
  assert "Block_0/attn/attention_weights" in errors
  assert all(0 < e < fp8_check.ACTIVATION_SUSPECT for e in errors.values()), errors
  assert errors["logits"] == errors["Dense_0"]  # the head's output
  # The first fp8 matmuls (q, k, v of the LayerNorm's output) are off by E4M3 rounding of both
  # operands: ||e_x k + x e_k|| / ||x k|| ~ sqrt(2) r, with r = ||q(v) - v|| / ||v|| of E4M3
  # at an amax scale (0.026 for normal v); bf16 rounding would give ~3e-3.
  assert errors["Block_0/LayerNorm_0"] < 2**-8  # their input: off by bf16 rounding only
  rounding = math.sqrt(2) * _e4m3_relative_rounding()
  for name in ("query", "key", "value"):
    assert errors[f"Block_0/attn/{name}"] == pytest.approx(rounding, rel=0.25), (name, rounding)
  grads = step0["grads"]["fp8"]
  assert {"pos", "Embed_0/embedding", "Block_0/Dense_0/kernel", "Dense_0/bias"} <= set(grads)
  assert all(0 < e < fp8_check.GRADIENT_SUSPECT for e in grads.values()), grads
  for name, curve in tiny["losses"].items():
    assert len(curve) == TINY["steps"] and all(map(math.isfinite, curve))
    assert curve[-1] < step0["loss"][name]  # AdamW on a fixed batch
  assert tiny["loss_fp8"] == tiny["losses"]["fp8"][-1]
  for field in fp8.Fp8DotState._fields:
    health = tiny["fp8_state_final"]["fp8"][field]
    assert health["nonfinite_scales"] == health["zero_scales"] == 0
    assert health["zero_latest_amax"] == health["unit_scales"] == 0  # all calibrated
  assert tiny["convert_mismatches"] == 0 and tiny["gemm_probe_inexact"] == 0
  assert tiny["verdict"] == "No anomaly found by these checks."
  assert "| recipe | loss step 0 |" in tiny["summary"]


def test_a_model_without_its_causal_mask_fails_the_check(monkeypatch):
  """The check can fail: attention over every position leaks the later tokens."""
  full = lambda tokens: jnp.ones((tokens.shape[0], 1, tokens.shape[-1], tokens.shape[-1]), bool)
  monkeypatch.setattr(nn, "make_causal_mask", full)
  result = fp8_check.diagnose(**TINY, recipes=("fp32",), budget_s=600)
  causal = result["step0"]["causal"]["fp32"]
  assert causal["past_logits_moved"] > 1e-3 * causal["past_logits_max"]
  assert causal["future_grad_max"] > 1e-3 * causal["past_grad_max"]
  assert result["causal_leak_fp32"] is True
  assert result["verdict"].startswith("CAUSAL LEAK in fp32")


def test_legacy_recipe_traces_the_formulation_that_produced_the_anomaly():
  """fp8_legacy: fp8 operands, an fp32 product scaled and cast afterwards (the old code)."""
  config = fp8.Fp8Config(amax_history_length=2)
  state = fp8.init_dot_state(config)
  state = fp8.update(state, fp8.Fp8DotAmax(*map(jnp.float32, (5.0, 0.3, 0.7))), config)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((8, 16)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((16, 4)) * 0.1, jnp.bfloat16)
  dims = (((1,), (0,)), ((), ()))
  s_x, s_k, _ = (t.scale for t in state)

  @jax.jit
  def old(x, k):
    q_x, q_k = fp8.quantize(x, s_x, fp8.E4M3), fp8.quantize(k, s_k, fp8.E4M3)
    y = lax.dot_general(q_x, q_k, dims, preferred_element_type=jnp.float32) * (s_x * s_k)
    return y.astype(jnp.bfloat16)

  with fp8_check.legacy_fp8_dots():
    legacy = jax.jit(lambda x, k: fp8.dot_general(x, k, dims, state, config=config))(x, k)
  new = jax.jit(lambda x, k: fp8.dot_general(x, k, dims, state, config=config))(x, k)
  np.testing.assert_array_equal(legacy, old(x, k))
  # The same form now: only the GPU accumulator (precision) and the kernel gradient's operand
  # order differ, neither of which changes XLA:CPU's result.
  np.testing.assert_array_equal(new, legacy)


def test_gradient_errors_measure_a_zero_gradient_against_its_share():
  ref = {"w": jnp.full((3,), 4.0), "zero": jnp.zeros((1,))}
  got = {"w": jnp.full((3,), 4.4), "zero": jnp.full((1,), 0.04)}
  errors = fp8_check.gradient_errors(got, ref)
  np.testing.assert_allclose(errors["w"], 0.1, rtol=1e-6)
  # ||ref|| = sqrt(48); the zero leaf's share is sqrt(48 / 4) = sqrt(12).
  np.testing.assert_allclose(errors["zero"], 0.04 / math.sqrt(12), rtol=1e-6)
  assert fp8_check.relative_errors(got, ref)["zero"] == pytest.approx(0.04)


def test_hlo_summary_reads_fp8_gemms():
  text = "\n".join([
    '  %cublas-lt-matmul.1 = (bf16[16,16]{1,0}, s8[33554432]{0}) custom-call(%a, %b, %c, %d), '
    'custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{'
    '"precision_config":{"operand_precision":["DEFAULT","DEFAULT"]},"epilogue":"BIAS"}}',
    '  %cublas-lt-matmul.2 = (f32[16,16]{1,0}, s8[4]{0}) custom-call(%a, %b, %c, %d), '
    'custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{'
    '"precision_config":{"operand_precision":["HIGHEST","HIGHEST"]},"epilogue":"DEFAULT"}}',
    '  %fusion.3 = bf16[16,16]{1,0} fusion(%x), kind=kLoop, calls=%f',
  ])  # fmt: skip
  summary = fp8_check.hlo_summary(text)
  assert summary["fp8_gemms"] == 2 and summary["fusions"] == 1
  assert summary["fp8_gemm_result_types"] == {"bf16": 1, "f32": 1}
  assert summary["fp8_gemm_epilogues"] == {"BIAS": 1, "DEFAULT": 1}
  assert summary["fp8_gemm_precisions"] == {"DEFAULT,DEFAULT": 1, "HIGHEST,HIGHEST": 1}
