"""benchmarks/gpu.py's ``probe`` section: what a backend does with 16-bit dots.

For bf16 and fp16 operands, :func:`probe_cases` lists plain ``lax.dot_general``, with the
accumulation preset (``DotAlgorithmPreset.BF16_BF16_F32``/``F16_F16_F32``), with
``preferred_element_type=float32``, a long contraction (where XLA may split K), a convolution,
and vector-vector and matrix-vector dots. :func:`probe_one` lowers, compiles and runs a case:
whether the StableHLO declares the algorithm, what the optimized HLO calls (:func:`hlo_calls`,
:func:`gemm_counts`, also read for every recipe), and which accumulator the results show
(:func:`accumulation_error`, :func:`accumulation_verdict`).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from benchmarks._common import error_text

# ---------------------------------------------------------------------------------------------
# Optimized HLO: what the matmuls became


def hlo_calls(text: str) -> dict[str, dict[str, int]]:
  """Tallies of an optimized HLO module's custom-call targets, fusion kinds and dot algorithms."""
  return {
    "custom_calls": dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))),
    "fusion_kinds": dict(collections.Counter(re.findall(r'"kind":"([^"]+)"', text))),
    "algorithms": dict(collections.Counter(re.findall(r"algorithm=(\w+)", text))),
    "dots": {"dot": len(re.findall(r"= \S+ dot\(", text))},
  }


def gemm_counts(calls: dict[str, dict[str, int]]) -> dict[str, int]:
  """The table's columns: cuBLAS, cuBLASLt and fp8 cuBLASLt gemms, Triton gemm fusions, cuDNN."""
  targets, kinds = calls["custom_calls"], calls["fusion_kinds"]

  def count(names: dict[str, int], keep: Callable[[str], bool]) -> int:
    return sum(n for name, n in names.items() if keep(name))

  return {
    "cublas": count(targets, lambda t: t == "__cublas$gemm"),
    "cublaslt": count(targets, lambda t: t.startswith("__cublas$lt") and "f8" not in t),
    "cublaslt_fp8": count(targets, lambda t: t.startswith("__cublas$lt") and "f8" in t),
    "triton_gemm": count(kinds, lambda k: "triton" in k and "gemm" in k),
    "cudnn": count(targets, lambda t: t.startswith("__cudnn"))
    + count(kinds, lambda k: k.startswith("__cudnn")),
  }


def temp_mib(compiled: Any) -> float | None:
  try:
    stats = compiled.memory_analysis()
  except Exception:  # a backend without a memory analysis
    return None
  return None if stats is None else stats.temp_size_in_bytes / 2**20


# ---------------------------------------------------------------------------------------------
# Matmul probe: accumulation per platform


def accumulation_error(result: np.ndarray, exact: np.ndarray, dtype: Any) -> float:
  r"""Worst relative error of ``result`` against ``exact``, in units of the epsilon of the
  operands' ``dtype`` (so a 16-bit and an fp32 output are judged on one scale).

  An fp32 accumulator rounded once into a 16-bit output stays within 0.5 (far below with an
  fp32 output); rounding fp32 partial sums into 16 bits again (e.g. split-K through a 16-bit
  buffer) adds up to 0.5 per rounding; a 16-bit accumulator drifts far beyond (a bf16 sum of
  ones stops growing at 256).
  """
  eps = float(ml_dtypes.finfo(dtype).eps)
  error = np.abs(result.astype(np.float64) - exact) / np.abs(exact)
  return float(np.max(error) / eps)


def accumulation_verdict(error: float) -> str:
  """Names the accumulator from the worst :func:`accumulation_error` of a case's tests."""
  if error <= 0.51:  # 0.5 from the output's rounding, 0.01 for fp32's own
    return "fp32 accumulate, one rounding"
  if error <= 4:
    return "fp32 partials, rounded more than once"
  return "16-bit accumulate"


class ProbeCase(NamedTuple):
  name: str
  fn: Callable[[jax.Array, jax.Array], jax.Array]
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  big_index: tuple[Any, ...] = (..., 0)  # where the lhs holds the ones test's large element
  reference: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul  # in fp64


def probe_cases(dtype: Any, m: int, k: int, long_k: int) -> list[ProbeCase]:
  """The cases for one operand dtype, most telling first (the list is cut at the deadline)."""
  preset = {
    jnp.bfloat16: lax.DotAlgorithmPreset.BF16_BF16_F32,
    jnp.float16: lax.DotAlgorithmPreset.F16_F16_F32,
  }[dtype]
  contract = (((1,), (0,)), ((), ()))
  vector = (((0,), (0,)), ((), ()))
  mm = lambda **kw: lambda x, y: lax.dot_general(x, y, contract, **kw)
  conv = lambda **kw: lambda x, y: lax.conv_general_dilated(x, y, (1,), "VALID", **kw)
  # NCW input, OIW kernel of width 1: each output sums the k input channels.
  conv_reference = lambda x, y: np.einsum("ncw,oc->now", x, y[..., 0])
  square, long = ((m, k), (k, m)), ((m // 2, long_k), (long_k, m // 2))
  conv_shapes = ((2, k, 8), (m, k, 1), (slice(None), 0), conv_reference)
  return [
    ProbeCase("matmul", mm(), *square),
    ProbeCase("matmul, preset", mm(precision=preset), *square),
    ProbeCase("matmul, preferred f32", mm(preferred_element_type=jnp.float32), *square),
    ProbeCase(f"matmul K={long_k}", mm(), *long),
    ProbeCase(f"matmul K={long_k}, preset", mm(precision=preset), *long),
    ProbeCase("conv", conv(), *conv_shapes),
    ProbeCase("conv, preset", conv(precision=preset), *conv_shapes),
    ProbeCase(
      "vector-vector, preset",
      lambda x, y: lax.dot_general(x, y, vector, precision=preset),
      (k,),
      (k,),
    ),
    ProbeCase("matrix-vector, preset", mm(precision=preset), (m, k), (k,)),
  ]


def _probe_inputs(case: ProbeCase, dtype: Any, rng: np.random.Generator):
  """The ones test (one large element, then ones: the exact sum needs a wide accumulator) and
  random data in [0, 1); each with its exact fp64 result."""
  big = 2.0 ** (ml_dtypes.finfo(dtype).nmant + 1)  # adding 1 to it is a tie a 16-bit sum loses
  lhs = np.ones(case.lhs_shape)
  lhs[case.big_index] = big
  rhs = np.ones(case.rhs_shape)
  random = [
    rng.random(s).astype(dtype).astype(np.float64) for s in (case.lhs_shape, case.rhs_shape)
  ]
  return [
    ((jnp.asarray(x, dtype), jnp.asarray(y, dtype)), case.reference(x, y))
    for x, y in ((lhs, rhs), random)
  ]


def probe_one(case: ProbeCase, dtype: Any, rng: np.random.Generator) -> dict[str, Any]:
  """Lowers, compiles and runs one case; records the first stage that fails."""
  entry: dict[str, Any] = {"case": case.name, "dtype": jnp.dtype(dtype).name}
  stage = "inputs"
  try:
    data = _probe_inputs(case, dtype, rng)
    stage = "lower"
    lowered = jax.jit(case.fn).lower(*data[0][0])
    entry["declared"] = "algorithm" in lowered.as_text()  # the preset reached StableHLO
    stage = "compile"
    compiled = lowered.compile()
    calls = hlo_calls(compiled.as_text())
    entry["hlo"] = calls
    entry["gemms"] = gemm_counts(calls)
    stage = "run"
    (ones, ones_exact), (random, random_exact) = (
      (np.asarray(compiled(*args)), exact) for args, exact in data
    )
    entry["out_dtype"] = ones.dtype.name
    entry["ones_error_eps"] = accumulation_error(ones, ones_exact, dtype)
    entry["random_error_eps"] = accumulation_error(random, random_exact, dtype)
    entry["verdict"] = accumulation_verdict(max(entry["ones_error_eps"], entry["random_error_eps"]))
  except Exception as e:
    entry["error"] = f"{stage}: {error_text(e)}"
  return entry
