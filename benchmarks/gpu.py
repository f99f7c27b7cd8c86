"""One GPU run: issue 14's recipe table, fp8 against bf16 at three widths, a 16-bit matmul probe.

Sections, run in this order (``--only`` picks some):

* ``probe``: what the backend does with 16-bit dots. For bf16 and fp16 operands: plain
  ``lax.dot_general``, with ``precision=DotAlgorithmPreset.BF16_BF16_F32`` (``F16_F16_F32``), with
  ``preferred_element_type=float32``, vector-vector and matrix-vector dots and a convolution with
  the preset, and a long contraction (where XLA may split K). For each: whether it lowers and
  compiles, whether the StableHLO declares the algorithm, what the optimized HLO calls, and which
  accumulator the result shows (:func:`accumulation_error`).
* ``recipes``: the pre-LN decoder LM of ``benchmarks/memory.py`` (d=1024, 8 layers, 16 heads,
  seq 1024, batch 8, vocab 256; Flax ``MultiHeadDotProductAttention`` with a causal mask, GELU
  MLP 4x, learned positions) on one fixed batch of random tokens, AdamW(1e-4), under each of
  :data:`RECIPES`: ms/step (median of interleaved rounds after 2 warm-up steps), ratios to fp32
  ``highest`` and to Flax bf16 (medians of per-round ratios), XLA's compiled temp memory, the
  gemm calls in the optimized HLO, the loss of every step; and what loss scaling costs (fp16 with
  ``jl.loss_scaling`` over the same fp16 step without it, interleaved).
* ``fp8_check``: ``benchmarks/fp8_check.py``'s ``diagnose()`` with its defaults, if that module
  exists, in a thread with a time limit (the fp8 loss anomaly: layer-by-layer evidence).
* ``sizes``: fp8 (``linen_fp8`` over the bf16 policy) against the bf16 policy at d in
  {1024, 2048, 4096}, tokens per step fixed, fewer layers at larger d to fit the time budget
  (d=1024 reuses the ``recipes`` rows when that section ran).

Run from the repository root (about 6 minutes on an H100/H200, compilation included)::

  PYTHONPATH=. python benchmarks/gpu.py --out out/gpu
  PYTHONPATH=. python benchmarks/gpu.py --out out/gpu --only probe,sizes   # rerun parts
  PYTHONPATH=. python benchmarks/gpu.py --smoke --out /tmp/gpu   # tiny sizes, any backend

``gpu.json`` and ``gpu.md`` are rewritten in ``--out`` after every recipe, so an interrupted run
keeps what it measured. A recipe or probe case that fails is recorded with its error and the run
goes on. No compilation starts once its estimated cost no longer fits in ``--budget-s`` (each
section gets a share, what it leaves unused passes on); what was skipped is listed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import gzip
import importlib
import importlib.util
import json
import math
import os
import pathlib
import platform
import re
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import flax
import flax.training.dynamic_scale
import jax
import jax.numpy as jnp
import jaxlib
import ml_dtypes
import numpy as np
import optax
from jax import lax

import jmp_lite as jl
import jmp_lite.flax as jlf
from benchmarks import overhead
from benchmarks.memory import TransformerLM
from jmp_lite import fp8
from jmp_lite.flax import fp8 as flax_fp8

SECTIONS = ("probe", "recipes", "fp8_check", "sizes")
NA = "-"  # a figure not measured
# Cumulative share of --budget-s by the end of each section, when a later section is selected.
_DEADLINE_SHARE = {"probe": 0.08, "recipes": 0.55, "fp8_check": 0.75, "sizes": 1.0}
LEARNING_RATE = 1e-4
INITIAL_LOSS_SCALE = 2.0**15
FP8_HISTORY = 16  # the examples' amax history length
BF16_POLICY = "params=float32,compute=bfloat16,output=float32"
FP16_POLICY = "params=float32,compute=float16,output=float32"


class Settings(NamedTuple):
  """Sizes of one run: the model, the timing and the probe."""

  model: dict[str, int]  # TransformerLM fields
  batch: int
  head_dim: int  # heads = width // head_dim in the sizes section
  sizes: tuple[tuple[int, int], ...]  # (width, layers)
  warmup: int
  rounds: int
  steps: int
  probe_m: int  # rows/columns of the probe's matrices
  probe_k: int
  probe_long_k: int  # the long contraction (split-K)
  fp8_check_kwargs: dict[str, int]  # {} = diagnose()'s defaults
  fast_compile: bool  # train steps compiled with fast_compile_options() (not for timing)


FULL = Settings(
  model={"vocab": 256, "width": 1024, "heads": 16, "layers": 8, "length": 1024},
  batch=8,
  head_dim=64,
  sizes=((1024, 8), (2048, 4), (4096, 2)),
  warmup=2,
  rounds=5,
  steps=5,
  probe_m=64,
  probe_k=4096,
  probe_long_k=32768,
  fp8_check_kwargs={},
  fast_compile=False,
)
SMOKE = Settings(
  model={"vocab": 32, "width": 32, "heads": 2, "layers": 1, "length": 16},
  batch=2,
  head_dim=16,
  sizes=((32, 1), (64, 1)),
  warmup=1,
  rounds=1,
  steps=2,
  probe_m=8,
  probe_k=512,
  probe_long_k=2048,
  fp8_check_kwargs={
    "d_model": 32,
    "layers": 1,
    "heads": 2,
    "seq": 16,
    "batch": 2,
    "vocab": 32,
    "steps": 2,
  },
  fast_compile=True,
)

# ---------------------------------------------------------------------------------------------
# Bookkeeping: clock, budget, output


class Budget:
  """The wall clock since the start, and whether a compilation still fits before ``deadline``.

  A compilation is estimated from the slowest so far, per model layer (conservative for smaller
  models: a compile has a fixed part too).
  """

  def __init__(self, seconds: float):
    self.seconds = self.deadline = seconds
    self.start = time.perf_counter()
    self.per_layer = 0.0

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def allows(self, layers: int = 0) -> bool:
    return self.elapsed() + self.per_layer * layers < self.deadline

  def record(self, seconds: float, layers: int) -> None:
    self.per_layer = max(self.per_layer, seconds / max(layers, 1))


class Report:
  """The result as it grows, written to ``gpu.json`` and ``gpu.md`` on every :meth:`save`."""

  def __init__(self, out: pathlib.Path, result: dict[str, Any], budget: Budget):
    self.out, self.result, self.budget = out, result, budget

  def log(self, message: str) -> None:
    print(f"[{self.budget.elapsed():6.1f} s] {message}", flush=True)

  def skip(self, what: str) -> None:
    self.result["skipped"].append(what)
    self.log(f"skipped (time budget): {what}")

  def save(self) -> None:
    self.result["elapsed_s"] = round(self.budget.elapsed(), 1)
    self.out.mkdir(parents=True, exist_ok=True)
    (self.out / "gpu.json").write_text(json.dumps(self.result, indent=1, default=_to_json))
    (self.out / "gpu.md").write_text(markdown(self.result))


class Bench(NamedTuple):
  """What every section works with."""

  settings: Settings
  budget: Budget
  report: Report
  recipes: tuple[str, ...]  # the recipes of the table to run (--recipes)


def _to_json(x: Any) -> Any:
  if isinstance(x, (np.ndarray, jax.Array)):
    return np.asarray(x).tolist()
  if isinstance(x, np.generic):
    return x.item()
  return str(x)


def error_text(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def environment() -> dict[str, Any]:
  """Versions, the device and the XLA/JAX settings of this process."""
  device = jax.devices()[0]
  info: dict[str, Any] = {
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "flax": flax.__version__,
    "optax": optax.__version__,
    "jmp_lite": getattr(jl, "__version__", "?"),
    "platform": device.platform,
    "device_kind": device.device_kind,
    "device_count": jax.device_count(),
    "compute_capability": getattr(device, "compute_capability", None),
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
    "env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "NVIDIA_TF32"))},
  }
  try:
    info["jax_environment_info"] = jax.print_environment_info(return_string=True)
  except Exception as e:  # e.g. nvidia-smi missing: the rest is still worth having
    info["jax_environment_info"] = error_text(e)
  return info


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


def run_probe(bench: Bench, section: dict) -> None:
  s = bench.settings
  dtypes = (jnp.bfloat16, jnp.float16)
  cases = [probe_cases(dtype, s.probe_m, s.probe_k, s.probe_long_k) for dtype in dtypes]
  section.update(shapes={"m": s.probe_m, "k": s.probe_k, "long_k": s.probe_long_k}, cases=[])
  rng = np.random.default_rng(0)
  for pair in zip(*cases, strict=True):  # one case in bf16, then in fp16, then the next case
    for dtype, case in zip(dtypes, pair, strict=True):
      if not bench.budget.allows():
        bench.report.skip(f"probe/{jnp.dtype(dtype).name}/{case.name}")
        continue
      entry = probe_one(case, dtype, rng)
      section["cases"].append(entry)
      outcome = entry.get("verdict", entry.get("error"))
      bench.report.log(f"probe {entry['dtype']} {case.name}: {outcome}")
  bench.report.save()


# ---------------------------------------------------------------------------------------------
# Train steps: one per recipe


class Step(NamedTuple):
  """A recipe's train step on one model.

  ``init(params, tokens)`` builds the state (with whatever runs once before training, e.g. fp8
  calibration); ``step(state, tokens)`` returns the next state and the step's loss; it is traced
  under ``jax.default_matmul_precision(precision)`` when that is set.
  """

  init: Callable[[Any, jax.Array], Any]
  step: Callable[[Any, jax.Array], tuple[Any, jax.Array]]
  precision: str | None = None


class Recipe(NamedTuple):
  label: str
  build: Callable[[dict[str, int]], Step]  # model config -> Step


def lm_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Next-token cross-entropy, in fp32 in every recipe."""
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def fast_compile_options() -> dict[str, Any]:
  """XLA options for programs whose speed does not matter (run once, or a smoke run): the slow
  optimizations and the gemm autotuning would cost more compile time than they save."""
  if jax.default_backend() == "cpu":
    return {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
  return {"xla_gpu_autotune_level": 0}


def compile_with(lowered: Any, options: dict[str, Any] | None) -> Any:
  if options:
    try:
      return lowered.compile(options)
    except Exception:  # an option this jaxlib does not know; a real error comes again below
      pass
  return lowered.compile()


def run_once(fn: Callable, *args: Any) -> Any:
  """``jax.jit(fn)(*args)``, compiled with :func:`fast_compile_options`."""
  return compile_with(jax.jit(fn).lower(*args), fast_compile_options())(*args)


def with_flax_dtype(dtype: Any = None) -> Callable[[dict[str, int]], Callable]:
  """The model as written; with ``dtype``, every layer built with Flax's ``dtype=``."""

  def make(config):
    model = TransformerLM(**config, dtype=dtype)
    return lambda params, tokens: model.apply({"params": params}, tokens)

  return make


def with_policy(spec: str) -> Callable[[dict[str, int]], Callable]:
  """The model as written, run by :func:`jmp_lite.flax.policy_apply` under ``spec``."""

  def make(config):
    apply = jlf.policy_apply(TransformerLM(**config), spec)
    return lambda params, tokens: apply({"params": params}, tokens)

  return make


def adamw_step(make_apply: Callable, precision: str | None = None) -> Callable[[dict], Step]:
  def build(config):
    apply, tx = make_apply(config), optax.adamw(LEARNING_RATE)
    loss_fn = lambda params, tokens: lm_loss(apply(params, tokens), tokens)

    def step(state, tokens):
      params, opt_state = state
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    return Step(lambda params, tokens: (params, tx.init(params)), step, precision)

  return build


def loss_scaled_step(make_apply: Callable) -> Callable[[dict], Step]:
  """``jl.loss_scaling(adamw, jl.DynamicLossScale)`` with ``jl.scaled_value_and_grad``."""

  def build(config):
    apply = make_apply(config)
    tx = jl.loss_scaling(
      optax.adamw(LEARNING_RATE), jl.DynamicLossScale(jnp.float32(INITIAL_LOSS_SCALE))
    )
    loss_fn = lambda params, tokens: lm_loss(apply(params, tokens), tokens)

    def step(state, tokens):
      params, opt_state = state
      loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    return Step(lambda params, tokens: (params, tx.init(params)), step)

  return build


def cond_skip_step(make_apply: Callable) -> Callable[[dict], Step]:
  """Loss scaling that skips a non-finite step with a ``lax.cond`` around the update.

  A candidate design (not the library's): the inner update and its application run only on a
  finite step, instead of being computed and then discarded by a select.
  """

  def build(config):
    apply, tx = make_apply(config), optax.adamw(LEARNING_RATE)
    loss_fn = lambda params, tokens: lm_loss(apply(params, tokens), tokens)

    def init(params, tokens):
      return params, tx.init(params), jl.DynamicLossScale(jnp.float32(INITIAL_LOSS_SCALE))

    def step(state, tokens):
      params, opt_state, scale = state
      loss, grads = scale.value_and_grad(loss_fn)(params, tokens)
      grads, finite, scale = scale.unscale_and_adjust(grads, params)

      def apply_update(params, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      params, opt_state = lax.cond(finite, apply_update, lambda p, o: (p, o), params, opt_state)
      return (params, opt_state, scale), loss

    return Step(init, step)

  return build


def undeclared(make_apply: Callable) -> Callable[[dict], Callable]:
  """``make_apply``'s model traced as on a backend where jmp_lite declares no accumulation.

  A diagnostic (the cost of ``precision=DotAlgorithmPreset...``): it swaps the private
  platform lookup of ``jmp_lite.flax.accumulate`` while the model is traced.
  """
  accumulate = importlib.import_module("jmp_lite.flax._accumulate")

  def make(config):
    apply = make_apply(config)

    def traced(*args):
      platform = accumulate._platform
      accumulate._platform = lambda: "cpu"
      try:
        return apply(*args)
      finally:
        accumulate._platform = platform

    return traced

  return make


def flax_dynamic_scale_step(make_apply: Callable) -> Callable[[dict], Step]:
  """Flax's own recipe: ``DynamicScale.value_and_grad``, the update kept only when finite."""

  def build(config):
    apply, tx = make_apply(config), optax.adamw(LEARNING_RATE)
    loss_fn = lambda params, tokens: lm_loss(apply(params, tokens), tokens)

    def init(params, tokens):
      return params, tx.init(params), flax.training.dynamic_scale.DynamicScale()

    def step(state, tokens):
      params, opt_state, scale = state
      scale, finite, loss, grads = scale.value_and_grad(loss_fn)(params, tokens)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      keep = lambda new, old: optax.tree_utils.tree_where(finite, new, old)
      new_params = keep(optax.apply_updates(params, updates), params)
      return (new_params, keep(new_opt_state, opt_state), scale), loss

    return Step(init, step)

  return build


def fp8_step(spec: str, legacy: bool = False, **config_kwargs: Any) -> Callable[[dict], Step]:
  """``linen_fp8`` over ``policy_apply(model, spec)``, calibrated on the batch before step 0
  (docs/fp8.md), the fp8 state updated every step.

  ``config_kwargs`` go to :class:`~jmp_lite.fp8.Fp8Config`; ``legacy`` traces the fp8 matmuls
  in the formulation that showed the loss anomaly (``benchmarks/fp8_check.py``).
  """

  def build(config):
    built = _fp8_build(config, spec, config_kwargs)
    if not legacy:
      return built
    legacy_dots = importlib.import_module("benchmarks.fp8_check").legacy_fp8_dots

    def traced_legacy(fn):
      def call(*args):
        with legacy_dots():
          return fn(*args)

      return call

    return Step(traced_legacy(built.init), traced_legacy(built.step))

  return build


def _fp8_build(config: dict, spec: str, config_kwargs: dict) -> Step:
  model = TransformerLM(**config)
  apply, tx = jlf.policy_apply(model, spec), optax.adamw(LEARNING_RATE)
  fp8_config = fp8.Fp8Config(amax_history_length=FP8_HISTORY, **config_kwargs)

  def loss_fn(params, amax, fp8_state, tokens):
    variables = {
      "params": params,
      flax_fp8.STATE_COLLECTION: fp8_state,
      flax_fp8.AMAX_COLLECTION: amax,
    }
    with flax_fp8.linen_fp8(fp8_config):  # outside the policy's interceptor, as documented
      return lm_loss(apply(variables, tokens), tokens)

  def calibrated_state(params, tokens):
    with flax_fp8.linen_fp8(fp8_config):  # a fresh state (scales 1), then calibrated
      fresh = model.init(jax.random.key(0), tokens)[flax_fp8.STATE_COLLECTION]
    fun = lambda amax: loss_fn(params, amax, fresh, tokens)
    return fp8.calibrate(fun, fresh, fp8_config)

  def init(params, tokens):
    return params, run_once(calibrated_state, params, tokens), tx.init(params)

  def step(state, tokens):
    params, fp8_state, opt_state = state
    loss, (grads, amax) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
      params, fp8.zeros_amax(fp8_state), fp8_state, tokens
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    new_fp8_state = fp8.update(fp8_state, amax, fp8_config)
    return (optax.apply_updates(params, updates), new_fp8_state, opt_state), loss

  return Step(init, step)


# In the order of the issue's table.
RECIPES: dict[str, Recipe] = {
  "fp32_highest": Recipe("fp32, precision highest", adamw_step(with_flax_dtype(), "highest")),
  "fp32_default": Recipe("fp32, default (TF32 on GPU)", adamw_step(with_flax_dtype())),
  "flax_bf16": Recipe(
    "Flax layers `dtype=bfloat16` (hand-written)", adamw_step(with_flax_dtype(jnp.bfloat16))
  ),
  "policy_bf16": Recipe("`jmp_lite.flax.policy_apply`, bf16", adamw_step(with_policy(BF16_POLICY))),
  "policy_fp16": Recipe("policy fp16, no loss scaling", adamw_step(with_policy(FP16_POLICY))),
  "policy_fp16_scaled": Recipe(
    "policy fp16 + `loss_scaling(DynamicLossScale)`", loss_scaled_step(with_policy(FP16_POLICY))
  ),
  "flax_fp16_dynamic_scale": Recipe(
    "Flax `dtype=float16` + Flax `DynamicScale`",
    flax_dynamic_scale_step(with_flax_dtype(jnp.float16)),
  ),
  "policy_bf16_undeclared": Recipe(
    "policy bf16 without the accumulation preset", adamw_step(undeclared(with_policy(BF16_POLICY)))
  ),
  "policy_fp16_cond_skip": Recipe(
    "policy fp16 + loss scaling, `lax.cond` skip (candidate)",
    cond_skip_step(with_policy(FP16_POLICY)),
  ),
  "fp8": Recipe("jmp_lite fp8 (`linen_fp8` over the bf16 policy)", fp8_step(BF16_POLICY)),
  "fp8_fast": Recipe(
    "fp8, fast accumulation forward", fp8_step(BF16_POLICY, fast_accumulation="forward")
  ),
  "fp8_legacy": Recipe(
    "fp8 as measured in issue 14 (legacy formulation)", fp8_step(BF16_POLICY, legacy=True)
  ),
}
# Compiled in this order, so that a cut budget keeps the comparisons the issue's targets need.
PRIORITY = (
  "flax_bf16",
  "policy_bf16",
  "fp8",
  "policy_fp16",
  "policy_fp16_scaled",
  "policy_bf16_undeclared",
  "policy_fp16_cond_skip",
  "fp8_legacy",
  "fp8_fast",
  "fp32_highest",
  "fp32_default",
  "flax_fp16_dynamic_scale",
)
SIZE_RECIPES = ("policy_bf16", "fp8", "fp8_fast")
SAVED_HLO = ("flax_bf16", "policy_bf16", "fp8")  # with --save-hlo: their optimized HLO, gzipped
HLO_DIR: pathlib.Path | None = None
REFERENCES = ("fp32_highest", "flax_bf16", "policy_bf16")  # each row's x_<name> ratios
# Loss curves shown side by side.
CURVES = ("fp32_default", "flax_bf16", "policy_bf16", "fp8", "fp8_legacy")

# ---------------------------------------------------------------------------------------------
# Compiling and timing


@dataclasses.dataclass
class Run:
  """One recipe being measured: its compiled step, its state, and what was seen so far."""

  name: str
  row: dict[str, Any]
  compiled: Any = None
  state: Any = None
  times: list[float | None] = dataclasses.field(default_factory=list)  # per round, s/step


def init_params(config: dict[str, int], tokens: jax.Array) -> Any:
  model = TransformerLM(**config)
  return run_once(lambda t: model.init(jax.random.key(0), t)["params"], tokens)


def prepare(run: Run, recipe: Recipe, config: dict, params: Any, tokens: jax.Array, s: Settings):
  """Builds, compiles and warms up ``run``; fills in its compile figures and first losses."""
  start = time.perf_counter()
  spec = recipe.build(config)
  state = spec.init(jax.tree.map(jnp.copy, params), tokens)  # the step donates its state
  compile_start = time.perf_counter()
  precision = jax.default_matmul_precision(spec.precision) if spec.precision else None
  with precision or contextlib.nullcontext():
    lowered = jax.jit(spec.step, donate_argnums=0).lower(state, tokens)
  run.compiled = compile_with(lowered, fast_compile_options() if s.fast_compile else None)
  run.row["compile_s"] = time.perf_counter() - compile_start
  run.row["temp_mib"] = temp_mib(run.compiled)
  text = run.compiled.as_text()
  calls = hlo_calls(text)
  run.row["gemms"], run.row["hlo"] = gemm_counts(calls), calls
  # A conditional makes XLA:GPU read its predicate back to the host every step.
  run.row["control_flow"] = overhead.control_flow(text)
  if HLO_DIR is not None and run.name in SAVED_HLO:
    # The optimized program, to read the fusions around the gemms offline.
    with gzip.open(HLO_DIR / f"hlo_{run.name}_d{config['width']}.txt.gz", "wt") as f:
      f.write(text)
  losses = []
  for _ in range(s.warmup):
    state, loss = run.compiled(state, tokens)
    losses.append(loss)
  run.state = jax.block_until_ready(state)
  run.row["losses"] = [float(x) for x in losses]
  run.row["prepare_s"] = time.perf_counter() - start


def prepare_all(
  bench: Bench, names: tuple[str, ...], config: dict, tokens: jax.Array, rows: dict, where: str
) -> list[Run]:
  """Prepares each recipe the budget allows; a failure is recorded in its row."""
  budget, report = bench.budget, bench.report
  params, runs = None, []
  for name in names:
    rows[name] = {"label": RECIPES[name].label}
    if not budget.allows(config["layers"]):
      rows[name]["skipped"] = "time budget"
      report.skip(f"{where}/{name}")
      continue
    run = Run(name, rows[name])
    report.log(f"{where}: compiling {name}")
    try:
      params = init_params(config, tokens) if params is None else params
      prepare(run, RECIPES[name], config, params, tokens, bench.settings)
      budget.record(run.row["prepare_s"], config["layers"])
      runs.append(run)
      report.log(
        f"{where}: {name} compiled in {run.row['compile_s']:.1f} s, temp "
        f"{_fmt(run.row['temp_mib'], '.0f')} MiB, gemms {run.row['gemms']}"
      )
    except Exception as e:
      run.row["error"] = error_text(e)
      report.log(f"{where}: {name} failed: {run.row['error']}")
    report.save()
  return runs


def time_rounds(runs: list[Run], tokens: jax.Array, rounds: int, steps: int) -> None:
  """Interleaved rounds (the order rotates); each round times ``steps`` steps of every run.

  The losses are read after the clock stops: nothing in the timed loop waits for the host.
  """
  for r in range(rounds):
    for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
      if "error" in run.row:
        run.times.append(None)
        continue
      try:
        state, losses = run.state, []
        start = time.perf_counter()
        for _ in range(steps):
          state, loss = run.compiled(state, tokens)
          losses.append(loss)
        run.state = jax.block_until_ready(state)
        run.times.append((time.perf_counter() - start) / steps)
        run.row["losses"] += [float(x) for x in losses]
      except Exception as e:
        run.row["error"] = error_text(e)
        run.times.append(None)


def median_ratio(a: list[float | None], b: list[float | None]) -> float | None:
  """Median over rounds of a / b, from rounds where both ran."""
  ratios = [x / y for x, y in zip(a, b, strict=True) if x and y]
  return statistics.median(ratios) if ratios else None


def summarize(runs: list[Run], references: tuple[str, ...]) -> None:
  """Median ms/step, ratios to each reference run and the final loss, into each row."""
  by_name = {run.name: run for run in runs}
  for run in runs:
    times = [t for t in run.times if t]
    if not times:
      continue
    run.row["ms"] = 1e3 * statistics.median(times)
    run.row["round_ms"] = [None if t is None else 1e3 * t for t in run.times]
    run.row["final_loss"] = run.row["losses"][-1]
    for ref in references:
      if ref in by_name:
        run.row[f"x_{ref}"] = median_ratio(run.times, by_name[ref].times)


def measure(
  bench: Bench, names: tuple[str, ...], config: dict, rows: dict, where: str
) -> list[Run]:
  """Prepares, times and summarizes ``names`` on ``config``: the rows of one table."""
  s = bench.settings
  tokens = jax.random.randint(jax.random.key(1), (s.batch, config["length"]), 0, config["vocab"])
  runs = prepare_all(bench, names, config, tokens, rows, where)
  if runs:
    bench.report.log(f"{where}: timing {s.rounds} rounds x {s.steps} steps")
    time_rounds(runs, tokens, s.rounds, s.steps)
    summarize(runs, REFERENCES)
    for run in runs:
      bench.report.log(f"{where}: {run.name} {_fmt(run.row.get('ms'), '.2f')} ms/step")
  bench.report.save()
  return runs


def run_recipes(bench: Bench, section: dict) -> None:
  s = bench.settings
  section.update(config=s.model, batch=s.batch, rows={})
  section["timing"] = {"warmup": s.warmup, "rounds": s.rounds, "steps": s.steps}
  names = tuple(n for n in PRIORITY if n in bench.recipes)
  runs = {run.name: run for run in measure(bench, names, s.model, section["rows"], "recipes")}
  for key, name in (
    ("loss_scaling_cost", "policy_fp16_scaled"),
    ("cond_skip_cost", "policy_fp16_cond_skip"),
  ):
    if "policy_fp16" in runs and name in runs:
      section[key] = median_ratio(runs[name].times, runs["policy_fp16"].times)
  section["rows"] = {name: section["rows"][name] for name in RECIPES if name in section["rows"]}
  print(loss_curves(section["rows"], CURVES), flush=True)


def run_sizes(bench: Bench, section: dict) -> None:
  s = bench.settings
  section.update(head_dim=s.head_dim, rows=[])
  done = bench.report.result["sections"].get("recipes", {}).get("rows", {})
  for width, layers in s.sizes:
    config = {**s.model, "width": width, "layers": layers, "heads": width // s.head_dim}
    row: dict[str, Any] = {"config": config, "recipes": {}}
    section["rows"].append(row)
    if config == s.model and all("ms" in done.get(n, {}) for n in SIZE_RECIPES):
      row.update(recipes={n: done[n] for n in SIZE_RECIPES}, reused="recipes")
    else:
      measure(bench, SIZE_RECIPES, config, row["recipes"], f"sizes d={width}")
    row["fp8_over_bf16"] = row["recipes"].get("fp8", {}).get("x_policy_bf16")
    row["fp8_fast_over_bf16"] = row["recipes"].get("fp8_fast", {}).get("x_policy_bf16")
    bench.report.save()


# ---------------------------------------------------------------------------------------------
# fp8 check hook (benchmarks/fp8_check.py, written separately)


def call_with_timeout(fn: Callable[[], Any], timeout_s: float) -> dict[str, Any]:
  """Runs ``fn()`` in a daemon thread; ``{"result": ...}``, ``{"error": ...}``, or a timeout
  (``abandoned``: the thread still runs, so the process should exit without joining it)."""
  box: dict[str, Any] = {}

  def target():
    try:
      box["result"] = fn()
    except Exception as e:
      box["error"] = error_text(e)

  thread = threading.Thread(target=target, name="fp8_check", daemon=True)
  start = time.perf_counter()
  thread.start()
  thread.join(timeout_s)
  if thread.is_alive():
    return {"error": f"timed out after {timeout_s:.0f} s", "abandoned": True}
  return {**box, "seconds": time.perf_counter() - start}


def run_fp8_check(bench: Bench, section: dict) -> None:
  if importlib.util.find_spec("benchmarks.fp8_check") is None:
    section["status"] = "absent (no benchmarks/fp8_check.py)"
    return
  timeout = bench.budget.deadline - bench.budget.elapsed()
  if timeout < 20:
    bench.report.skip("fp8_check")
    section["status"] = "skipped (time budget)"
    return
  # diagnose() skips its later recipes past its own budget; the thread's timeout is the backstop.
  kwargs = {"budget_s": 0.7 * timeout, **bench.settings.fp8_check_kwargs}
  bench.report.log(f"fp8_check: diagnose(**{kwargs}), at most {timeout:.0f} s")
  diagnose = lambda: importlib.import_module("benchmarks.fp8_check").diagnose(**kwargs)
  section.update(call_with_timeout(diagnose, timeout))
  section["status"] = "error" if "error" in section else "ok"
  bench.report.log(f"fp8_check: {section['status']} {section.get('error', '')}")


RUNNERS: dict[str, Callable[[Bench, dict], None]] = {
  "probe": run_probe,
  "recipes": run_recipes,
  "sizes": run_sizes,
  "fp8_check": run_fp8_check,
}

# ---------------------------------------------------------------------------------------------
# Markdown


def _fmt(x: Any, spec: str) -> str:
  return NA if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> list[str]:
  """A markdown table; the first ``text_columns`` columns left-aligned, the rest right."""
  aligns = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join(aligns) + "|"]
  return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _status(row: dict[str, Any]) -> str:
  return row.get("error") or row.get("skipped") or "not run"


def loss_curves(rows: dict[str, dict], names: tuple[str, ...], every: int = 5) -> str:
  """The loss every ``every`` steps (and the last), one column per recipe that has one."""
  curves = {n: rows[n]["losses"] for n in names if rows.get(n, {}).get("losses")}
  if not curves:
    return ""
  length = max(len(c) for c in curves.values())
  at = lambda c, i: _fmt(c[i] if i < len(c) else None, ".4f")
  steps = sorted({*range(0, length, every), length - 1})
  return "\n".join(
    _table(["step", *curves], [[str(i)] + [at(c, i) for c in curves.values()] for i in steps])
  )


def _md_env(env: dict[str, Any]) -> list[str]:
  return [
    f"{env['device_kind']} ({env['platform']}, compute capability "
    f"{env.get('compute_capability')}), jax {env['jax']}, jaxlib {env['jaxlib']}, flax "
    f"{env['flax']}, optax {env['optax']}, python {env['python']}; XLA_FLAGS="
    f"`{env['XLA_FLAGS'] or '(none)'}`.",
  ]


def _hlo_cell(hlo: dict[str, dict[str, int]]) -> str:
  tallies = {**hlo["custom_calls"], **hlo["fusion_kinds"], **hlo["algorithms"], **hlo["dots"]}
  return ", ".join(f"{name} x{n}" for name, n in tallies.items() if n) or "(none)"


def _md_probe(section: dict[str, Any]) -> list[str]:
  shapes = section["shapes"]
  lines = [
    "## Matmul probe",
    "",
    f"M=N={shapes['m']}, K={shapes['k']}; long: M=N={shapes['m'] // 2}, K={shapes['long_k']}. "
    "Errors: worst relative error against fp64, in units of the operands' epsilon, on the ones "
    "test (one 2^(p+1), then ones: a 16-bit sum loses every 1) and on random data in [0, 1). "
    "An fp32 accumulator rounded once stays <= 0.5; rounded partial sums add up to 0.5 per "
    "rounding; a 16-bit accumulator goes far beyond.",
    "",
  ]
  rows = [
    [
      e["case"],
      e["dtype"],
      ("no: " + e["error"]) if "error" in e else "yes",
      str(e.get("declared", NA)),
      _hlo_cell(e["hlo"]) if "hlo" in e else NA,
      e.get("out_dtype", NA),
      _fmt(e.get("ones_error_eps"), ".3f"),
      _fmt(e.get("random_error_eps"), ".3f"),
      e.get("verdict", NA),
    ]
    for e in section["cases"]
  ]
  header = [
    "case", "operands", "compiles", "algorithm in StableHLO", "optimized HLO", "out",
    "ones err", "random err", "accumulator",
  ]  # fmt: skip
  return lines + _table(header, rows, text_columns=len(header))


def _recipe_cells(row: dict[str, Any]) -> list[str]:
  if "ms" not in row:
    return [_status(row)] + [NA] * 10
  g = row["gemms"]
  return [
    _fmt(row["ms"], ".2f"),
    _fmt(row.get("x_fp32_highest"), ".2f"),
    _fmt(row.get("x_flax_bf16"), ".3f"),
    _fmt(row["temp_mib"], ".0f"),
    *(str(g[k]) for k in ("cublas", "cublaslt", "cublaslt_fp8", "triton_gemm", "cudnn")),
    str(row["control_flow"]["conditionals"]),
    _fmt(row["final_loss"], ".3f"),
  ]


def _md_recipes(section: dict[str, Any]) -> list[str]:
  c, t = section["config"], section["timing"]
  lines = [
    "## Recipes",
    "",
    f"Pre-LN decoder LM: d={c['width']}, {c['layers']} layers, {c['heads']} heads, seq "
    f"{c['length']}, batch {section['batch']}, vocab {c['vocab']}; AdamW lr {LEARNING_RATE}; one "
    f"fixed batch; {t['warmup']} warm-up steps, then {t['rounds']} interleaved rounds of "
    f"{t['steps']} steps: median ms/step, ratios are medians of per-round ratios. Gemm columns: "
    "calls in the optimized HLO.",
    "",
  ]
  header = [
    "recipe", "ms/step", "x fp32 highest", "x Flax bf16", "compiled temp MiB", "cuBLAS",
    "cuBLASLt", "fp8 cuBLASLt", "Triton gemm", "cuDNN", "conditionals", "final loss",
  ]  # fmt: skip
  lines += _table(header, [[row["label"], *_recipe_cells(row)] for row in section["rows"].values()])
  cost = _fmt(section.get("loss_scaling_cost"), ".3f")
  lines += ["", f"Loss scaling cost (policy fp16 + `loss_scaling`, over policy fp16): {cost}."]
  if "cond_skip_cost" in section:
    cond = _fmt(section["cond_skip_cost"], ".3f")
    lines += ["", f"The same with a `lax.cond` skip (candidate), over policy fp16: {cond}."]
  curves = loss_curves(section["rows"], CURVES)
  if curves:
    lines += ["", "Loss curves (the loss each step computed, warm-up included):", "", curves]
  return lines


def _size_cells(row: dict[str, Any]) -> list[str]:
  c = row["config"]
  bf16, f8, fast = (row["recipes"].get(n, {}) for n in SIZE_RECIPES)
  ms = lambda r: _fmt(r["ms"], ".2f") if "ms" in r else _status(r)
  return [
    str(c["width"]),
    str(c["layers"]),
    str(c["heads"]),
    ms(bf16),
    ms(f8),
    ms(fast),
    _fmt(row.get("fp8_over_bf16"), ".3f"),
    _fmt(row.get("fp8_fast_over_bf16"), ".3f"),
    _fmt(bf16.get("temp_mib"), ".0f"),
    _fmt(f8.get("temp_mib"), ".0f"),
    str(f8.get("gemms", {}).get("cublaslt_fp8", NA)),
    _fmt(bf16.get("final_loss"), ".3f"),
    _fmt(f8.get("final_loss"), ".3f"),
    _fmt(fast.get("final_loss"), ".3f"),
  ]


def _md_sizes(section: dict[str, Any]) -> list[str]:
  lines = [
    "## fp8 against the bf16 policy by width",
    "",
    "Same tokens per step; fewer layers at larger d to fit the time budget; heads = d / "
    f"{section['head_dim']} (head dim fixed). fp8/bf16: median of per-round ratios. A row of "
    "the recipes table is reused where the configuration is the same.",
    "",
  ]
  header = [
    "d", "layers", "heads", "bf16 ms", "fp8 ms", "fp8 fast ms", "fp8/bf16", "fp8 fast/bf16",
    "bf16 temp MiB", "fp8 temp MiB", "fp8 gemms", "bf16 loss", "fp8 loss", "fp8 fast loss",
  ]  # fmt: skip
  return lines + _table(header, [_size_cells(row) for row in section["rows"]])


def _md_fp8_check(section: dict[str, Any]) -> list[str]:
  lines = ["## fp8 check (`benchmarks/fp8_check.diagnose`)", "", f"Status: {section['status']}."]
  if "error" in section:
    lines += ["", f"Error: {section['error']}"]
  result = section.get("result")
  if isinstance(result, dict):
    if isinstance(result.get("summary"), str):
      lines += ["", result["summary"]]
    scalars = {
      k: v for k, v in result.items() if isinstance(v, (int, float, str)) and k != "summary"
    }
    lines += ["", *(f"- {k}: {v}" for k, v in scalars.items()), "", "Full result: gpu.json."]
  return lines


RENDERERS: dict[str, Callable[[dict], list[str]]] = {
  "probe": _md_probe,
  "recipes": _md_recipes,
  "sizes": _md_sizes,
  "fp8_check": _md_fp8_check,
}


def markdown(result: dict[str, Any]) -> str:
  """The report: the environment, then one part per section that ran."""
  lines = ["# GPU benchmark (`benchmarks/gpu.py`)", "", *_md_env(result["env"])]
  for name, section in result["sections"].items():
    try:
      lines += ["", *RENDERERS[name](section)]
    except KeyError:  # a section still being filled in, or one that failed early
      lines += ["", f"## {name}", "", section.get("error", "(incomplete)")]
  if result["skipped"]:
    lines += ["", "Skipped (time budget): " + ", ".join(result["skipped"]) + "."]
  lines += ["", f"Elapsed: {result.get('elapsed_s')} s. Command: `{result['command']}`."]
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="out/gpu", help="folder for gpu.json and gpu.md")
  parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round (for tests)")
  parser.add_argument("--only", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
  parser.add_argument("--budget-s", type=float, default=440.0, help="no compile starts past it")
  parser.add_argument("--rounds", type=int, help="timing rounds (default 5; smoke 1)")
  parser.add_argument("--steps", type=int, help="steps per round (default 5; smoke 2)")
  parser.add_argument("--recipes", default=",".join(RECIPES), help="recipes of the table to run")
  parser.add_argument("--widths", help="widths of the sizes section (default: all)")
  parser.add_argument(
    "--save-hlo", action="store_true", help=f"write the optimized HLO of {', '.join(SAVED_HLO)}"
  )
  args = parser.parse_args(argv)
  args.only = [s.strip() for s in args.only.split(",") if s.strip()]
  args.recipes = tuple(r.strip() for r in args.recipes.split(",") if r.strip())
  if unknown_recipes := [r for r in args.recipes if r not in RECIPES]:
    parser.error(f"--recipes {','.join(unknown_recipes)}: choose from {','.join(RECIPES)}")
  unknown = [s for s in args.only if s not in SECTIONS]
  if unknown or not args.only:
    parser.error(f"--only {','.join(unknown)}: choose from {','.join(SECTIONS)}")
  return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
  args = parse_args(argv)
  settings = SMOKE if args.smoke else FULL
  settings = settings._replace(
    rounds=args.rounds or settings.rounds, steps=args.steps or settings.steps
  )
  if args.widths:
    widths = {int(w) for w in args.widths.split(",")}
    settings = settings._replace(sizes=tuple(x for x in settings.sizes if x[0] in widths))
  budget = Budget(args.budget_s)
  global HLO_DIR
  HLO_DIR = pathlib.Path(args.out) if args.save_hlo else None
  if HLO_DIR is not None:
    HLO_DIR.mkdir(parents=True, exist_ok=True)
  result: dict[str, Any] = {
    "command": " ".join(["benchmarks/gpu.py", *(sys.argv[1:] if argv is None else argv)]),
    "budget_s": args.budget_s,
    "settings": settings._asdict(),
    "env": environment(),
    "sections": {},
    "skipped": [],
  }
  report = Report(pathlib.Path(args.out), result, budget)
  bench = Bench(settings, budget, report, args.recipes)
  bench.report.log(f"{result['env']['device_kind']}, jax {jax.__version__}; sections {args.only}")
  selected = [s for s in SECTIONS if s in args.only]
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    for name in selected:
      share = 1.0 if name == selected[-1] else _DEADLINE_SHARE[name]
      budget.deadline = args.budget_s * share
      section = result["sections"][name] = {}
      start = time.perf_counter()
      try:
        RUNNERS[name](bench, section)
      except Exception as e:  # a section's own failure: the next sections still run
        section["error"] = error_text(e)
        bench.report.log(f"{name} failed: {section['error']}")
      section["seconds"] = time.perf_counter() - start
      bench.report.save()
  bench.report.log(f"done: {args.out}/gpu.json, {args.out}/gpu.md")
  return result


if __name__ == "__main__":
  outcome = main()
  if outcome["sections"].get("fp8_check", {}).get("abandoned"):
    sys.stdout.flush()
    os._exit(0)  # the timed-out check's thread is still inside XLA: do not wait for it
