r"""16-bit parameters (``jl.low_precision_params``): bytes, step time, and the exact split.

Three parts, on the char-LM model of ``examples/charlm.py`` (its CPU preset; the quick preset
with ``--quick``), whose model, batches and loss are the example's own:

(a) **Bytes per parameter** of the parameters plus the optimizer state, counted from the actual
    pytrees (the ``nbytes`` of every leaf of ``params`` and ``opt_state`` after ``tx.init``,
    over the number of parameter elements), with ``optax.adam``: fp32-master Adam (fp32
    parameters, 12 bytes and Adam's step count) against bf16 parameters wrapped in
    ``jl.low_precision_params`` by each method, with fp32 or bf16 moments (``state_dtype``).
    The wrapper's state adds a few scalars (step count, key data, two counters).
(b) **Step time** of each method relative to the fp32-master step, in one process, interleaved
    rounds, median of per-round ratios (``benchmarks._common``), every step compiled with the
    examples' options (``examples.common.step_compiler_options``: on CPU, XLA's copy insertion
    with region analysis) and, on CPU, the methods also with XLA's defaults, which copy every
    donated array that the step reads twice (a 16-bit moment read for the update and again to
    store its new value): 15-35% of a 16-bit-state step on two cores. Every step is the example's
    (the model under ``jmp_lite.flax.policy_apply``, the example's cross-entropy and its AdamW
    chain: ``examples.common.make_optimizer``), on the example's batches in order (on one
    repeated batch the model memorizes it and the step time drifts). The fp32-master step runs
    ``params=float32,compute=bfloat16,output=float32``; the others
    ``params=bfloat16,compute=bfloat16,output=float32``: the same compute. The stochastic
    method runs with each PRNG implementation JAX offers (``threefry2x32``, the default,
    ``rbg`` and ``unsafe_rbg``, as ``seed=jax.random.key(0, impl=...)``). The optimizer is
    also timed alone (``tx.update`` and ``optax.apply_updates`` on the first batch's gradients,
    ``UPDATE_STEPS`` per round): the methods' own cost, without the model around it.
(c) **Exactness of the split** (not with ``--quick`` unless ``--exactness-steps`` is given):
    the preset's training run (AdamW with its schedule, its batches) three times:

    * ``split``: bf16 parameters, ``low_precision_params(..., "split")``;
    * ``view``: fp32 master parameters whose forward pass reads the split's 16-bit view,
      ``high, _ = jmp_lite._rounding.split_float32(master)`` (round to nearest, ties away from
      zero); the gradients with respect to the view, in fp32, update the master;
    * ``fp32_master``: the standard policy ``params=float32,compute=bfloat16``, whose view is
      XLA's cast (round to nearest, ties to even) and whose LayerNorm and embedding compute
      from the fp32 parameters.

    After every step it counts the elements of ``jl.master_params`` of the split run whose bit
    patterns differ from the view run's master; it reports the split's ``inexact`` counter and
    the final training and validation loss of each run. The split and view runs share one
    compiled gradient program (see :func:`exactness_runs`). Bit equality also needs XLA to
    round the update before adding it in both optimizer programs: XLA:CPU's legacy emitters
    (``--xla_cpu_use_fusion_emitters=false``) contract the split's multiply-add into an FMA, and
    the two then differ by an ulp.

Run: python -m benchmarks.low_precision_params [--rounds 60] [--steps 3] [--json out.json]
     python -m benchmarks.low_precision_params --quick   (tiny, for tests)
     python -m benchmarks.low_precision_params --no-timing --exactness-steps 1000

The figures of docs/benchmarks.md ("16-bit parameters"):

  python -m benchmarks.low_precision_params --rounds 60 \
    --json docs/figures/low_precision_params.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl
import jmp_lite.flax as jlf
from benchmarks._common import core_version, finish, median_ratio, time_interleaved, versions
from examples import charlm, common
from jmp_lite import _rounding

FP32_MASTER_POLICY = "params=float32,compute=bfloat16,output=float32"
BF16_PARAMS_POLICY = "params=bfloat16,compute=bfloat16,output=float32"
STOCHASTIC_TARGET = 0.51  # bytes of stochastic rounding with bf16 moments / fp32-master Adam
OVERHEAD_TARGET = 1.10  # step time of any method / the fp32-master step
UPDATE_STEPS = 20  # updates per variant per round when the optimizer is timed alone
TAIL = 100  # the final training loss: the mean over this many last steps
# XLA's backend optimizations off (the example's quick preset): --quick compiles in seconds.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
XLA_DEFAULTS = " [xla defaults]"  # the suffix of a step compiled without the step options


class Variant(NamedTuple):
  """One way of storing the parameters and the optimizer state.

  Attributes:
    name: its name in the tables.
    method: the ``jl.low_precision_params`` method, ``None`` for fp32-master.
    moments: the moments' dtype (``state_dtype``; fp32 keeps the inner state's own).
    impl: the PRNG implementation of the seed.
  """

  name: str
  method: str | None = None
  moments: str = "float32"
  impl: str = "threefry2x32"


BYTES_VARIANTS = (
  Variant("fp32_master"),
  Variant("nearest", "nearest"),
  Variant("nearest_bf16_moments", "nearest", "bfloat16"),
  Variant("stochastic", "stochastic"),
  Variant("stochastic_bf16_moments", "stochastic", "bfloat16"),
  Variant("kahan", "kahan"),
  Variant("kahan_bf16_moments", "kahan", "bfloat16"),
  Variant("split", "split"),
  Variant("split_bf16_moments", "split", "bfloat16"),
)
PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
TIMED_VARIANTS = (
  *BYTES_VARIANTS,
  *(
    Variant(f"stochastic{moments}_{impl}", "stochastic", dtype, impl)
    for impl in PRNG_IMPLS[1:]
    for moments, dtype in (("", "float32"), ("_bf16_moments", "bfloat16"))
  ),
)


def log(text: str) -> None:
  """Progress, on stderr (the tables go to stdout)."""
  print(text, file=sys.stderr, flush=True)


def make_tx(variant: Variant, inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """``inner`` as the variant runs it: as it is for fp32-master, else wrapped."""
  if variant.method is None:
    return inner
  moments = None if variant.moments == "float32" else jnp.dtype(variant.moments)
  seed = jax.random.key(0, impl=variant.impl)
  return jl.low_precision_params(inner, variant.method, seed=seed, state_dtype=moments)


def init_params(task: charlm.CharLMTask, seed: int) -> Any:
  """The example's fp32 initial parameters (one jitted init, as ``examples.common.train``)."""
  init = jax.jit(
    lambda key: task.model.init(key, *task.init_inputs()), compiler_options=FAST_COMPILE
  )
  return init(jax.random.key(seed))["params"]


def tree_bytes(tree: Any) -> int:
  """Bytes of the arrays of ``tree`` (typed PRNG keys count their key data)."""
  return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def count_bytes(params: Any, variants: Sequence[Variant]) -> dict[str, Any]:
  """Part (a): bytes of params + ``optax.adam`` state per variant, from ``tx.init``."""
  n = sum(int(p.size) for p in jax.tree.leaves(params))
  half = jl.cast_to_half(params)
  stored = {v.name: params if v.method is None else half for v in variants}
  states = {v.name: make_tx(v, optax.adam(1e-3)).init(stored[v.name]) for v in variants}
  out: dict[str, Any] = {"param_elements": n, "variants": {}}
  for variant in variants:
    params_bytes = tree_bytes(stored[variant.name])
    state_bytes = tree_bytes(states[variant.name])
    out["variants"][variant.name] = {
      "method": variant.method,
      "moments": variant.moments,
      "params_bytes": params_bytes,
      "opt_state_bytes": state_bytes,
      "bytes_per_param": (params_bytes + state_bytes) / n,
    }
  total = lambda v: v["params_bytes"] + v["opt_state_bytes"]
  base = total(out["variants"]["fp32_master"])
  for v in out["variants"].values():
    v["ratio_vs_fp32_master"] = total(v) / base
  stochastic = out["variants"]["stochastic_bf16_moments"]["ratio_vs_fp32_master"]
  out["stochastic_bf16_moments_target"] = {
    "target": STOCHASTIC_TARGET,
    "ratio": stochastic,
    "meets_target": bool(stochastic <= STOCHASTIC_TARGET),
  }
  return out


def make_loss(task: charlm.CharLMTask, policy: str):
  """The example's mean cross-entropy of a batch, the model run under ``policy``."""
  apply_fn = jlf.policy_apply(task.model, policy)

  def loss_terms(params, batch):
    args, kwargs = task.model_args(batch, train=True)
    return task.loss_terms(apply_fn({"params": params}, *args, **kwargs), batch)

  def loss(params, batch):
    terms = loss_terms(params, batch)
    return terms["loss"] / terms["count"]

  return loss, loss_terms


def make_step(loss, tx: optax.GradientTransformation):
  """A training step: the gradients of ``loss``, ``tx``'s update, ``optax.apply_updates``."""

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step


def time_variants(
  task: charlm.CharLMTask,
  config: common.TrainConfig,
  params: Any,
  variants: Sequence[Variant],
  rounds: int,
  steps: int,
) -> dict[str, Any]:
  """Part (b): every variant's step in interleaved rounds, ratios to fp32-master.

  Every variant trains on the example's batches in order, one per step (on the device before
  timing): on one repeated batch the model memorizes it, and step times drift with the values.
  """
  warmup = 2
  batches = [jax.device_put(task.train_batch(i)) for i in range(warmup + rounds * steps)]
  # Every variant under the examples' step options; on CPU the methods without another PRNG
  # also under XLA's defaults, which copy every donated array a step reads twice.
  defaults = FAST_COMPILE if config.fast_compile else None
  runs = [(v, "", common.step_compiler_options(config.fast_compile)) for v in variants]
  if jax.default_backend() == "cpu":
    runs += [(v, XLA_DEFAULTS, defaults) for v in variants if v.impl == "threefry2x32"]
  compiled, states, compile_s = {}, {}, {}
  for variant, suffix, options in runs:
    name = variant.name + suffix
    policy = FP32_MASTER_POLICY if variant.method is None else BF16_PARAMS_POLICY
    p = jax.tree.map(jnp.copy, params if variant.method is None else jl.cast_to_half(params))
    tx = make_tx(variant, common.make_optimizer(config))
    state = (p, tx.init(p))
    t0 = time.perf_counter()
    step = jax.jit(
      make_step(make_loss(task, policy)[0], tx), donate_argnums=(0, 1), compiler_options=options
    )
    compiled[name] = step.lower(*state, batches[0]).compile()
    compile_s[name] = time.perf_counter() - t0
    log(f"(b) compiled {name} in {compile_s[name]:.1f} s")
    for i in range(warmup):
      state = compiled[name](*state, batches[i])[:2]
    states[name] = jax.block_until_ready(state)

  taken = dict.fromkeys(compiled, warmup)  # batches each variant has trained on

  def advance(name):
    def next_step(state, _):
      taken[name] += 1
      return compiled[name](*state, batches[taken[name] - 1])[:2]

    return next_step

  wall, cpu = time_interleaved({name: advance(name) for name in compiled}, states, rounds, steps)

  def ratios(name: str, suffix: str) -> dict[str, Any]:
    t, ref = np.asarray(wall[name + suffix]), np.asarray(wall["fp32_master" + suffix])
    cpu_t, cpu_ref = np.asarray(cpu[name + suffix]), np.asarray(cpu["fp32_master" + suffix])
    return {
      "median_ms": 1e3 * float(np.median(t)),
      "ratio_vs_fp32_master": median_ratio(t, ref),
      "ratio_iqr": [float(np.percentile(t / ref, q)) for q in (25, 75)],
      "cpu_ratio_vs_fp32_master": median_ratio(cpu_t, cpu_ref),
      "cpu_ratio_iqr": [float(np.percentile(cpu_t / cpu_ref, q)) for q in (25, 75)],
      "compile_s": compile_s[name + suffix],
    }

  out: dict[str, Any] = {
    "fp32_master_ms": 1e3 * statistics.median(wall["fp32_master"]),
    "step_compiler_options": common.step_compiler_options(config.fast_compile),
  }
  for variant in variants:
    out[variant.name] = {
      "method": variant.method,
      "moments": variant.moments,
      "prng": variant.impl if variant.method == "stochastic" else None,
      **ratios(variant.name, ""),
    }
    if variant.name + XLA_DEFAULTS in compiled:
      out[variant.name]["xla_defaults"] = ratios(variant.name, XLA_DEFAULTS)
  measured = [v for v in out.values() if isinstance(v, dict) and "median_ms" in v]
  worst = max(v["ratio_vs_fp32_master"] for v in measured)
  out["overhead_target"] = {
    "target": OVERHEAD_TARGET,
    "worst_ratio": worst,
    "meets_target": bool(worst <= OVERHEAD_TARGET),
  }
  if any("xla_defaults" in v for v in measured):
    worst = max(v["xla_defaults"]["ratio_vs_fp32_master"] for v in measured if "xla_defaults" in v)
    out["overhead_target"]["worst_ratio_xla_defaults"] = worst
  return out


def time_updates(
  task: charlm.CharLMTask,
  config: common.TrainConfig,
  params: Any,
  variants: Sequence[Variant],
  rounds: int,
  steps: int,
) -> dict[str, Any]:
  """Part (b) for the optimizer alone: ``tx.update`` and ``optax.apply_updates``, ratios to
  fp32-master's, with the gradients of the first batch (in the parameters' dtype)."""
  options = FAST_COMPILE if config.fast_compile else None
  fp32_loss = make_loss(task, FP32_MASTER_POLICY)[0]
  grads = jax.jit(jax.grad(fp32_loss), compiler_options=options)(params, task.train_batch(0))
  advance, states = {}, {}
  for variant in variants:
    p = params if variant.method is None else jl.cast_to_half(params)
    g = grads if variant.method is None else jl.cast_to_half(grads)
    tx = make_tx(variant, common.make_optimizer(config))

    def update(params, opt_state, grads, tx=tx):
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    state = jax.tree.map(jnp.copy, (p, tx.init(p)))
    fn = jax.jit(
      update,
      donate_argnums=(0, 1),
      compiler_options=common.step_compiler_options(config.fast_compile),
    )
    fn = fn.lower(*state, g).compile()
    states[variant.name] = jax.block_until_ready(fn(*state, g))
    advance[variant.name] = lambda state, _, fn=fn, g=g: fn(*state, g)
  log("(b) compiled the updates")
  wall, _ = time_interleaved(advance, states, rounds, steps)
  return {
    name: {
      "median_ms": 1e3 * statistics.median(wall[name]),
      "ratio_vs_fp32_master": median_ratio(wall[name], wall["fp32_master"]),
    }
    for name in advance
  }


def split_view(master: Any) -> Any:
  """The split's 16-bit view of fp32 parameters: their high halves (nearest, ties away)."""
  return jax.tree.map(lambda x: _rounding.split_float32(x)[0], master)


def differing(a: Any, b: Any) -> jax.Array:
  """How many elements of two fp32 trees differ in their bit patterns (int32)."""
  bits = lambda x: jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
  return sum(
    (
      jnp.sum(bits(x) != bits(y), dtype=jnp.int32)
      for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ),
    jnp.zeros((), jnp.int32),
  )


def evaluate(task: charlm.CharLMTask, loss_terms, params: Any, options: Any) -> float:
  """Mean validation loss (nats per character) of ``params``."""
  terms = jax.jit(loss_terms, compiler_options=options)
  total, count = 0.0, 0.0
  for batch in task.eval_batches():
    t = jax.device_get(terms(params, batch))
    total, count = total + float(t["loss"]), count + float(t["count"])
  return total / count


def exactness_runs(
  task: charlm.CharLMTask, config: common.TrainConfig, params: Any, options: Any
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """Part (c)'s three runs: ``{name: step}``, ``{name: initial state}``, ``{name: loss terms}``.

  A step is two programs: the loss and gradients, then the optimizer. The split and the view
  runs call the same compiled gradient program on the same bf16 values, so their gradients are
  equal by construction: XLA may order a reduction differently in two programs that fuse
  it differently, and a gradient one bf16 ulp apart would be no fault of the split.
  """
  bf16_loss, bf16_terms = make_loss(task, BF16_PARAMS_POLICY)
  fp32_loss, fp32_terms = make_loss(task, FP32_MASTER_POLICY)
  bf16_grads = jax.jit(jax.value_and_grad(bf16_loss), compiler_options=options)
  fp32_grads = jax.jit(jax.value_and_grad(fp32_loss), compiler_options=options)
  view_of = jax.jit(split_view, compiler_options=options)

  def optimizer(tx):
    def apply(params, opt_state, grads):
      # The gradients reach an fp32 master in fp32 (the view's cast passes them through).
      grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return jax.jit(apply, compiler_options=options)

  split_tx = jl.low_precision_params(common.make_optimizer(config), "split")
  tx = common.make_optimizer(config)
  split_update, fp32_update = optimizer(split_tx), optimizer(tx)

  def step(grads, update, view=lambda p: p):
    def run(params, opt_state, batch):
      loss, g = grads(view(params), batch)
      return *update(params, opt_state, g), loss

    return run

  @functools.partial(jax.jit, compiler_options=options)  # one program, not one per leaf and op
  def initial_states(params):
    split_params = jl.cast_to_half(params)
    # The split starts from the bf16 parameters (its low halves zero): so does the master it
    # is compared with.
    start = jax.tree.map(lambda x: x.astype(jnp.float32), split_params)
    return {
      "split": (split_params, split_tx.init(split_params)),
      "view": (start, tx.init(start)),
      "fp32_master": (params, tx.init(params)),
    }

  steps = {
    "split": step(bf16_grads, split_update),
    "view": step(bf16_grads, fp32_update, view_of),
    "fp32_master": step(fp32_grads, fp32_update),
  }
  terms = {"split": bf16_terms, "view": bf16_terms, "fp32_master": fp32_terms}
  return steps, initial_states(params), terms


@jax.jit
def _final(split_params: Any, split_state: Any, view_master: Any) -> dict[str, Any]:
  """What each run's model reads, and how far the split's master is from the view's."""
  master = jl.master_params(split_params, split_state)
  view = split_view(view_master)
  pairs = zip(jax.tree.leaves(master), jax.tree.leaves(view_master), strict=True)
  largest = [jnp.max(jnp.abs(a - b)) for a, b in pairs]
  return {
    "view": view,
    "differing_view_elements": differing(split_params, view),
    "max_abs_difference": jnp.max(jnp.stack(largest)),
  }


def exactness(
  task: charlm.CharLMTask, config: common.TrainConfig, params: Any, steps: int
) -> dict[str, Any]:
  """Part (c): the split against fp32-master training that reads the split's view."""
  options = FAST_COMPILE if config.fast_compile else None
  run_step, states, terms = exactness_runs(task, config, params, options)
  # After every step: how many elements of the split's fp32 value differ from the master's.
  compare = jax.jit(lambda p, s, m: differing(jl.master_params(p, s), m))
  losses: dict[str, list[jax.Array]] = {k: [] for k in run_step}
  counts = []
  t0 = time.perf_counter()
  for i in range(steps):
    batch = task.train_batch(i)
    for name, step in run_step.items():
      *state, loss = step(*states[name], batch)
      states[name] = tuple(state)
      losses[name].append(loss)
    counts.append(compare(*states["split"], states["view"][0]))
    if (i + 1) % 100 == 0:
      log(f"(c) step {i + 1} of {steps}: {int(counts[-1])} elements differ")
  jax.block_until_ready(states)
  seconds = time.perf_counter() - t0

  split_params, split_state = states["split"]
  final = _final(split_params, split_state, states["view"][0])
  # What each run's model reads (its parameters under its policy).
  view = {"split": split_params, "view": final["view"], "fp32_master": states["fp32_master"][0]}
  counts = [int(c) for c in counts]
  tail = min(TAIL, steps)
  return {
    "steps": steps,
    "seconds": seconds,
    "param_elements": sum(int(p.size) for p in jax.tree.leaves(params)),
    "differing_elements": counts[-1],
    "steps_with_differences": {i: c for i, c in enumerate(counts) if c},
    "differing_view_elements": int(final["differing_view_elements"]),
    "max_abs_difference": float(final["max_abs_difference"]),
    "inexact": int(split_state.inexact),
    "runs": {
      name: {
        "final_train_loss": float(np.mean(np.asarray(losses[name][-tail:]))),
        "val_loss": (val := evaluate(task, terms[name], view[name], options)),
        "val_bpc": charlm.bits_per_char(val),
        "finite": bool(np.all(np.isfinite(np.asarray(losses[name])))),
      }
      for name in run_step
    },
  }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.low_precision_params", description=__doc__.split("\n")[0]
  )
  parser.add_argument("--rounds", type=int, default=60)
  parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
  parser.add_argument(
    "--exactness-steps",
    type=int,
    default=None,
    help="training steps of part (c) (the preset's: 1000; 0 skips it; --quick: 0)",
  )
  parser.add_argument("--no-timing", action="store_true", help="skip part (b)")
  parser.add_argument(
    "--variants",
    help="comma-separated variants to time (fp32_master always; default: all, --quick: nearest)",
  )
  parser.add_argument("--json", help="also write the results to this file")
  parser.add_argument(
    "--quick", action="store_true", help="the example's quick preset, 2 rounds of 1 step"
  )
  args = parser.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  args.preset = "quick" if args.quick else "cpu"
  if args.quick:
    args.rounds, args.steps = 2, 1
  names = [v.name for v in TIMED_VARIANTS]
  if args.variants:
    unknown = set(args.variants.split(",")) - set(names)
    if unknown:
      parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(names)}")
    chosen = {"fp32_master", *args.variants.split(",")}
  else:  # compiling a step takes seconds: --quick times one method
    chosen = {"fp32_master", "nearest"} if args.quick else set(names)
  args.timed = tuple(v for v in TIMED_VARIANTS if v.name in chosen)
  if args.exactness_steps is None:
    args.exactness_steps = 0 if args.quick else charlm.PRESETS["cpu"][1].steps
  return args


def run(args: argparse.Namespace) -> dict[str, Any]:
  """All three parts on the example's model at ``args.preset``."""
  model_config, config = charlm.PRESETS[args.preset]
  task = charlm.CharLMTask(model_config, seed=config.seed)
  params = init_params(task, config.seed)
  result: dict[str, Any] = {
    "config": {
      "preset": args.preset,
      "model": dataclasses.asdict(model_config),
      "rounds": args.rounds,
      "steps": args.steps,
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "optax": optax.__version__,
      "jmp_lite_sha256": core_version(),
      "default_prng_impl": str(jax.config.jax_default_prng_impl),
      "threefry_partitionable": bool(jax.config.jax_threefry_partitionable),
      "cpu_count": os.cpu_count(),
      "command": "python -m benchmarks.low_precision_params " + " ".join(args.argv),
    },
    "bytes": count_bytes(params, BYTES_VARIANTS),
  }
  load = [os.getloadavg()] if hasattr(os, "getloadavg") else []
  if not args.no_timing:
    result["timing"] = time_variants(task, config, params, args.timed, args.rounds, args.steps)
    result["update_timing"] = time_updates(
      task, config, params, args.timed, args.rounds, UPDATE_STEPS
    )
    load += [os.getloadavg()] if load else []
  if args.exactness_steps:
    result["exactness"] = exactness(task, config, params, args.exactness_steps)
    load += [os.getloadavg()] if load else []
  result["config"]["load_average"] = [list(x) for x in load]
  return result


def report(res: dict[str, Any]) -> str:
  """The tables of the figures, as text."""
  cfg, b = res["config"], res["bytes"]
  lines = [
    f"char-LM {cfg['preset']} preset, {b['param_elements']:,} parameters",
    "",
    "(a) params + optax.adam state",
    f"{'variant':32s} {'moments':>9s} {'params B':>10s} {'state B':>10s} {'B/param':>9s} "
    f"{'x fp32':>7s}",
  ]
  for name, v in b["variants"].items():
    lines.append(
      f"{name:32s} {v['moments']:>9s} {v['params_bytes']:10d} {v['opt_state_bytes']:10d} "
      f"{v['bytes_per_param']:9.4f} {v['ratio_vs_fp32_master']:7.4f}"
    )
  t = b["stochastic_bf16_moments_target"]
  lines.append(
    f"stochastic, bf16 moments: {t['ratio']:.4f}x (target <= {t['target']}: "
    f"{'met' if t['meets_target'] else 'NOT met'})"
  )
  if "timing" in res:
    timing, updates = res["timing"], res["update_timing"]
    lines += [
      "",
      f"(b) step time, fp32-master step {timing['fp32_master_ms']:.2f} ms "
      f"(median of {cfg['rounds']} rounds x {cfg['steps']} steps)",
      f"compiler options {timing['step_compiler_options']}; 'xla defaults': the step compiled "
      "without them",
      f"{'variant':32s} {'prng':>12s} {'ms/step':>9s} {'ratio':>7s} {'IQR':>15s} {'cpu':>7s} "
      f"{'compile s':>9s} {'update ms':>9s} {'ratio':>7s} {'xla defaults':>12s}",
    ]
    for name, v in timing.items():
      if not isinstance(v, dict) or "median_ms" not in v:
        continue
      lo, hi = v["ratio_iqr"]
      defaults = f"{v['xla_defaults']['ratio_vs_fp32_master']:.3f}" if "xla_defaults" in v else ""
      lines.append(
        f"{name:32s} {v['prng'] or '':>12s} {v['median_ms']:9.2f} "
        f"{v['ratio_vs_fp32_master']:7.3f} {f'[{lo:.3f}, {hi:.3f}]':>15s} "
        f"{v['cpu_ratio_vs_fp32_master']:7.3f} {v['compile_s']:9.1f} "
        f"{updates[name]['median_ms']:9.3f} {updates[name]['ratio_vs_fp32_master']:7.3f} "
        f"{defaults:>12s}"
      )
    t = timing["overhead_target"]
    lines.append(
      f"worst ratio {t['worst_ratio']:.3f} (target <= {t['target']}: "
      f"{'met' if t['meets_target'] else 'NOT met'})"
      + (
        f"; under XLA's defaults {t['worst_ratio_xla_defaults']:.3f}"
        if "worst_ratio_xla_defaults" in t
        else ""
      )
    )
  if "exactness" in res:
    e = res["exactness"]
    lines += [
      "",
      f"(c) {e['steps']} steps ({e['seconds']:.0f} s): split master vs fp32 master reading the "
      f"split's view: {e['differing_elements']} of {e['param_elements']:,} elements differ "
      f"(max |diff| {e['max_abs_difference']:.3g}); views differ in "
      f"{e['differing_view_elements']}; inexact {e['inexact']}; steps after which elements "
      f"differed (step: count): {e['steps_with_differences'] or 'none'}",
      f"{'run':14s} {'train loss':>10s} {'val loss':>9s} {'val bpc':>8s}",
    ]
    for name, r in e["runs"].items():
      lines.append(
        f"{name:14s} {r['final_train_loss']:10.4f} {r['val_loss']:9.4f} {r['val_bpc']:8.4f}"
      )
  if cfg["load_average"]:
    loads = "; ".join(", ".join(f"{x:.1f}" for x in avg) for avg in cfg["load_average"])
    lines.append(f"load averages (start, after each part): {loads} on {cfg['cpu_count']} CPUs")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark, prints its tables, optionally writes JSON; returns the results."""
  args = parse_args(argv)
  print(versions())
  res = run(args)
  return finish(report(res), res, args.json)


if __name__ == "__main__":
  main()
