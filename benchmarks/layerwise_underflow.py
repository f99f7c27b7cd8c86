r"""Per-layer gradient underflow in fp16 training: one loss scale vs layer-wise scales.

For every layer and every method this measures the **underflow fraction**: of
the gradient values that are nonzero in an fp32 reference of the same step
(same parameters, same batch, fp32 compute), the fraction that are exactly zero
in the fp16 run's gradients after unscaling. Methods, all trained with the same
optimizer on the same batches through ``jl.loss_scaling``:

* ``fp32``: fp32 compute (the reference; loss curve only).
* ``fp16``: fp16 compute, no loss scaling (run as a static scale of 1: the
  same arithmetic as ``jl.NoOpLossScale``).
* ``static``: the best static scale: powers of two 2^0..2^40 are swept on
  checkpoints of the fp32 run (its parameters and batches at the measurement
  steps); the scale with the lowest total underflow that overflows on none of
  them is kept (ties: the smallest).
* ``dynamic``: ``jl.DynamicLossScale(2^15, period=--dynamic-period)``, trained
  long enough to settle (it grows until it overflows, then backs off).
* ``layerwise``: ``jl.LayerwiseLossScale`` with one stage per layer,
  ``update_period=1``, ``underflow_fraction=--underflow-fraction``.

Models (one ``jl.stage_boundary`` after every layer; the identity outside
layer-wise training, so every method runs the same model code):

* ``deep_tanh``: a deep tanh MLP (28 layers of width 64, weights
  N(0, 0.5^2/fan_in), biases N(0, 1)), regressing a random tanh teacher. It
  sits in the ordered phase of tanh networks: activations stay O(1) (the biases)
  while the backward gain is about 0.5 per layer, so the gradients of the first
  layer are about 2^-45 times those of the head: more than fp16's range
  (2^-24..65504, 40 powers of two) can hold with one scale. The spread is
  measured in the fp32 reference and reported.
* ``residual``: a residual MLP (embedding, 6 blocks ``h + W2 tanh(W1 h + b1)``,
  softmax head) classifying inputs labelled by a random teacher (10 classes).

Underflow is averaged over the measurement steps of the second half of training
(steady state; steps whose fp16 gradients were non-finite are left out), then
over seeds. It is also split: values whose true magnitude times the layer's
scale is below 2^-24 are lost *to the scale*; the others were representable and
are zeros made by fp16 rounding in the forward pass (which no scale recovers).
Losses: the training loss of every step, and a held-out loss of the final
parameters computed in fp32 (4096 fresh samples). The inner optimizer is Adam
by default; ``--optimizer lamb`` or ``lion`` (update sizes that do not depend on
the gradient's magnitude) show where the lost layers matter for training.

Outputs in ``--out`` (default ``docs/figures/``): ``layerwise_underflow.json``,
``layerwise_underflow.md`` (the tables) and ``layerwise_underflow.png``.

The code: models and data in ``benchmarks/_underflow_models.py``, the comparison with the fp32
reference in ``_underflow_measure.py``, training in ``_underflow_train.py``, the JSON record,
tables and plot in ``_underflow_report.py``.

Run: python -m benchmarks.layerwise_underflow              (the defaults: ~3 min on 2 busy cores)
     python -m benchmarks.layerwise_underflow --tasks deep_tanh --optimizer lamb \
       --seeds 0 1 2 3 4 --prefix layerwise_underflow_lamb
     python -m benchmarks.layerwise_underflow --quick --out /tmp/lw   (seconds, for tests)
docs/layerwise.md quotes the commands of every recorded figure (``docs/figures/layerwise_*``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from benchmarks._common import core_version, versions, write_json
from benchmarks._underflow_measure import sweep_static
from benchmarks._underflow_models import TASKS, Data, make_model
from benchmarks._underflow_report import summarize_task, write_outputs
from benchmarks._underflow_train import (
  DEFAULT_LR,
  DYNAMIC_INITIAL_SCALE,
  METHODS,
  SCALED_METHODS,
  RunConfig,
  RunResult,
  train,
)

STATIC_LOG2_SCALES = tuple(range(41))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.layerwise_underflow",
    description=__doc__.split("\n")[0],
    epilog="See docs/layerwise.md for the recorded results.",
  )
  parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--steps", type=int, default=1000, help="training steps per run")
  parser.add_argument("--measure-every", type=int, default=50, help="steps between measurements")
  parser.add_argument(
    "--optimizer", choices=list(DEFAULT_LR), help="default: adam (sgd with --quick)"
  )
  parser.add_argument("--lr", type=float, help="learning rate (default: per optimizer)")
  parser.add_argument("--dynamic-period", type=int, default=50, help="DynamicLossScale period")
  parser.add_argument("--underflow-fraction", type=float, default=1e-3)
  parser.add_argument(
    "--margin-bits", type=int, help="LayerwiseLossScale margin_bits (default: the library's)"
  )
  parser.add_argument(
    "--amax-history-length",
    type=int,
    help="LayerwiseLossScale amax_history_length (default: the library's)",
  )
  parser.add_argument("--depth", type=int, default=28, help="deep_tanh: hidden layers")
  parser.add_argument("--blocks", type=int, default=6, help="residual: residual blocks")
  parser.add_argument("--curve-points", type=int, default=100, help="loss curve points in the JSON")
  parser.add_argument("--out", default="docs/figures", help="output directory")
  parser.add_argument("--prefix", default="layerwise_underflow", help="output file name stem")
  parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
  parser.add_argument("--quick", action="store_true", help="tiny run for tests (seconds)")
  parser.add_argument(
    "--render", metavar="JSON", help="only redraw the .md and .png of a recorded run's JSON"
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.seeds, args.steps, args.measure_every = args.seeds[:1], 8, 4
    args.depth, args.blocks, args.dynamic_period = 3, 1, 2
  if args.optimizer is None:  # SGD compiles about twice as fast as Adam: --quick is for tests
    args.optimizer = "sgd" if args.quick else "adam"
  if args.lr is None:
    args.lr = DEFAULT_LR[args.optimizer]
  if args.steps < 2 or args.measure_every < 1:
    parser.error("--steps must be >= 2 and --measure-every >= 1.")
  return args


def run_task(task_name: str, args: argparse.Namespace) -> dict[str, Any]:
  """All methods and seeds of one task."""
  model = make_model(task_name, args)
  runs: dict[str, list[RunResult]] = {m: [] for m in METHODS}
  sweeps = []

  def run(method: str, data: Data, **kwargs) -> RunResult:
    config = RunConfig(
      model,
      method,
      args.optimizer,
      args.lr,
      args.dynamic_period,
      args.underflow_fraction,
      args.margin_bits,
      args.amax_history_length,
    )
    return train(config, data, args.steps, args.measure_every, **kwargs)

  for seed in args.seeds:
    data = Data(seed, model.n_out)
    ref = run("fp32", data, keep_checkpoints=True)
    runs["fp32"].append(ref)
    # At most 8 of the fp32 run's measurement steps are the sweep's checkpoints.
    picks = np.unique(np.linspace(0, len(ref.measure_steps) - 1, 8).round().astype(int))
    sweep = sweep_static(
      model,
      data,
      [ref.checkpoints[i] for i in picks],
      [ref.measure_steps[i] for i in picks],
      STATIC_LOG2_SCALES,
    )
    ref.checkpoints = []
    sweeps.append(sweep)
    for method in SCALED_METHODS:
      runs[method].append(run(method, data, static_log2=sweep["best_log2_scale"]))
    line = ", ".join(
      f"{m} {runs[m][-1].seconds:.1f}s ({runs[m][-1].skipped_steps} skipped)" for m in METHODS
    )
    print(f"  {task_name} seed {seed}: static 2^{sweep['best_log2_scale']}; {line}", flush=True)
  return summarize_task(model, runs, sweeps, args)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the experiment, writes JSON, Markdown and PNG to ``--out``; returns the results."""
  args = parse_args(argv)
  if args.render:  # only redraw the tables and the plot of a recorded run
    with open(args.render) as f:
      results = json.load(f)
    write_outputs(results, args.render.removesuffix(".json"), not args.no_plot)
    return results
  start = time.perf_counter()
  print(
    f"{versions()} optimizer={args.optimizer} lr={args.lr} steps={args.steps} seeds={args.seeds}",
    flush=True,
  )
  results: dict[str, Any] = {
    "config": {
      k: v for k, v in vars(args).items() if k not in ("out", "prefix", "no_plot", "render")
    }
    | {
      "methods": list(METHODS),
      "static_log2_scales": list(STATIC_LOG2_SCALES),
      "dynamic_initial_scale": DYNAMIC_INITIAL_SCALE,
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "jmp_lite_sha256": core_version(),
      "command": "python -m benchmarks.layerwise_underflow "
      + " ".join(sys.argv[1:] if argv is None else argv),
    },
    "tasks": [],
  }
  for task_name in args.tasks:
    results["tasks"].append(run_task(task_name, args))
  results["seconds"] = time.perf_counter() - start
  stem = os.path.join(args.out, args.prefix)
  write_json(stem + ".json", results)
  write_outputs(results, stem, not args.no_plot)
  print(f"wrote {stem}.json, {stem}.md ({results['seconds']:.0f} s)")
  return results


if __name__ == "__main__":
  main()
