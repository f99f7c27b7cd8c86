"""One GPU run: the recipe table, fp8 against bf16 at three widths, a 16-bit matmul probe.

Sections, run in this order (``--only`` picks some):

* ``probe`` (``benchmarks/_gpu_probe.py``): what the backend does with 16-bit dots. For bf16
  and fp16 operands: plain ``lax.dot_general``, with
  ``precision=DotAlgorithmPreset.BF16_BF16_F32`` (``F16_F16_F32``), with
  ``preferred_element_type=float32``, vector-vector and matrix-vector dots and a convolution with
  the preset, and a long contraction (where XLA may split K). For each: whether it lowers and
  compiles, whether the StableHLO declares the algorithm, what the optimized HLO calls, and which
  accumulator the result shows (``accumulation_error``).
* ``recipes`` (the train steps: ``benchmarks/_gpu_recipes.py``): the pre-LN decoder LM of
  ``benchmarks/_models.py`` (d=1024, 8 layers, 16 heads, seq 1024, batch 8, vocab 256; Flax
  ``MultiHeadDotProductAttention`` with a causal mask, GELU MLP 4x, learned positions) on one
  fixed batch of random tokens, AdamW(1e-4), under each of ``RECIPES``: ms/step (median of
  interleaved rounds after 2 warm-up steps), ratios to fp32 ``highest`` and to Flax bf16 (medians
  of per-round ratios), XLA's compiled temp memory, the gemm calls in the optimized HLO, the loss
  of every step; and what loss scaling costs (fp16 with ``jl.loss_scaling`` over the same fp16
  step without it, interleaved).
* ``sizes``: fp8 (``linen_fp8`` over the bf16 policy) against the bf16 policy at d in
  {1024, 2048, 4096}, tokens per step fixed, fewer layers at larger d to fit the time budget
  (d=1024 reuses the ``recipes`` rows when that section ran).

Run from the repository root (about 6 minutes on an H100/H200, compilation included)::

  PYTHONPATH=. python benchmarks/gpu.py --out out/gpu     # or: python -m benchmarks.gpu ...
  PYTHONPATH=. python benchmarks/gpu.py --out out/gpu --only probe,sizes   # rerun parts
  PYTHONPATH=. python benchmarks/gpu.py --smoke --out /tmp/gpu   # tiny sizes, any backend

docs/benchmarks.md, "GPU (H200)", quotes the commands of its recorded runs.

``gpu.json`` and ``gpu.md`` are rewritten in ``--out`` after every recipe, so an interrupted run
keeps what it measured. A recipe or probe case that fails is recorded with its error and the run
goes on. No compilation starts once its estimated cost no longer fits in ``--budget-s`` (each
section gets a share, what it leaves unused passes on); what was skipped is listed. The report
(``gpu.md``) is rendered by ``benchmarks/_gpu_report.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import pathlib
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import flax
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax

import jmp_lite as jl
from benchmarks._common import (
  control_flow,
  error_text,
  interleaved_rounds,
  median_ratio,
  time_steps,
)
from benchmarks._gpu_probe import gemm_counts, hlo_calls, probe_cases, probe_one, temp_mib
from benchmarks._gpu_recipes import (
  CURVES,
  PRIORITY,
  RECIPES,
  REFERENCES,
  SAVED_HLO,
  SIZE_RECIPES,
  Recipe,
  compile_with,
  fast_compile_options,
  init_params,
  run_once,
)
from benchmarks._gpu_report import fmt, loss_curves, markdown

SECTIONS = ("probe", "recipes", "sizes")
# Cumulative share of --budget-s by the end of each section, when a later section is selected.
_DEADLINE_SHARE = {"probe": 0.08, "recipes": 0.55, "sizes": 1.0}


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
  hlo_dir: pathlib.Path | None = None  # with --save-hlo: where the optimized HLO goes


def _to_json(x: Any) -> Any:
  if isinstance(x, (np.ndarray, jax.Array)):
    return np.asarray(x).tolist()
  if isinstance(x, np.generic):
    return x.item()
  return str(x)


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
# Sections


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


@dataclasses.dataclass
class Run:
  """One recipe being measured: its compiled step, its state, and what was seen so far."""

  name: str
  row: dict[str, Any]
  compiled: Any = None
  state: Any = None
  times: list[float | None] = dataclasses.field(default_factory=list)  # per round, s/step


def prepare(bench: Bench, run: Run, recipe: Recipe, config: dict, params: Any, tokens: jax.Array):
  """Builds, compiles and warms up ``run``; fills in its compile figures and first losses."""
  s = bench.settings
  start = time.perf_counter()
  spec = recipe.build(config)
  state = run_once(spec.init, jax.tree.map(jnp.copy, params), tokens)  # the step donates it
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
  run.row["control_flow"] = control_flow(text)
  if bench.hlo_dir is not None and run.name in SAVED_HLO:
    # The optimized program, to read the fusions around the gemms offline.
    with gzip.open(bench.hlo_dir / f"hlo_{run.name}_d{config['width']}.txt.gz", "wt") as f:
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
      prepare(bench, run, RECIPES[name], config, params, tokens)
      budget.record(run.row["prepare_s"], config["layers"])
      runs.append(run)
      report.log(
        f"{where}: {name} compiled in {run.row['compile_s']:.1f} s, temp "
        f"{fmt(run.row['temp_mib'], '.0f')} MiB, gemms {run.row['gemms']}"
      )
    except Exception as e:
      run.row["error"] = error_text(e)
      report.log(f"{where}: {name} failed: {run.row['error']}")
    report.save()
  return runs


def time_rounds(runs: list[Run], tokens: jax.Array, rounds: int, steps: int) -> None:
  """Interleaved rounds (the order rotates); each round times ``steps`` steps of every run.

  The losses are read after the clock stops: nothing in the timed loop waits for the host.
  A run that fails is recorded with its error and times no more rounds.
  """
  by_name = {run.name: run for run in runs}

  def advance(run: Run) -> Callable[[tuple, int], tuple]:
    def step(carry, _):
      state, losses = carry
      state, loss = run.compiled(state, tokens)
      return state, (*losses, loss)

    return step

  def time_round(name: str) -> float | None:
    run = by_name[name]
    if "error" in run.row:
      return None
    try:
      (run.state, losses), seconds, _ = time_steps(advance(run), (run.state, ()), steps)
    except Exception as e:
      run.row["error"] = error_text(e)
      return None
    run.row["losses"] += [float(x) for x in losses]
    return seconds

  times = interleaved_rounds(list(by_name), rounds, time_round)
  for run in runs:
    run.times += times[run.name]


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
      bench.report.log(f"{where}: {run.name} {fmt(run.row.get('ms'), '.2f')} ms/step")
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


RUNNERS: dict[str, Callable[[Bench, dict], None]] = {
  "probe": run_probe,
  "recipes": run_recipes,
  "sizes": run_sizes,
}

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
  hlo_dir = pathlib.Path(args.out) if args.save_hlo else None
  if hlo_dir is not None:
    hlo_dir.mkdir(parents=True, exist_ok=True)
  result: dict[str, Any] = {
    "command": " ".join(["benchmarks/gpu.py", *(sys.argv[1:] if argv is None else argv)]),
    "budget_s": args.budget_s,
    "settings": settings._asdict(),
    "env": environment(),
    "sections": {},
    "skipped": [],
  }
  report = Report(pathlib.Path(args.out), result, budget)
  bench = Bench(settings, budget, report, args.recipes, hlo_dir)
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
  main()
