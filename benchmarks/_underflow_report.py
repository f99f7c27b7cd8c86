"""benchmarks/layerwise_underflow.py's report: the JSON record of a task, its tables and plot.

:func:`summarize_task` aggregates the runs of every seed (steady-state underflow per layer,
losses, scales, the targets); :func:`write_outputs` renders the Markdown tables
(:func:`markdown_tables`) and the PNG (:func:`plot`) from the results, also from a recorded
JSON (``--render``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

import jmp_lite as jl
from benchmarks._underflow_models import Model
from benchmarks._underflow_train import METHODS, SCALED_METHODS, RunResult


def steady_state_underflow(
  run: RunResult, steps: int, below_range: bool = False
) -> tuple[np.ndarray, np.ndarray]:
  """Mean and worst per-layer underflow over the finite measurements of the second half.

  With ``below_range``, only the values lost to the scale (see
  :func:`benchmarks._underflow_measure.layer_counts`).
  """
  keep = np.asarray([s >= steps // 2 for s in run.measure_steps]) & run.finite
  if not keep.any():
    nan = np.full(run.lost.shape[1], np.nan)
    return nan, nan
  lost = run.lost_below_range if below_range else run.lost
  fraction = lost[keep] / np.maximum(run.nonzero[keep], 1)
  return fraction.mean(axis=0), fraction.max(axis=0)


def spread_bits(ref_amax: np.ndarray) -> dict[str, float]:
  """log2 of (last layer amax / first layer amax), and of (largest / smallest layer amax)."""
  amax = np.maximum(ref_amax, np.finfo(np.float64).tiny)
  first_last = np.log2(amax[:, -1] / amax[:, 0])
  max_min = np.log2(amax.max(axis=1) / amax.min(axis=1))
  return {
    "first_to_last_at_start": float(first_last[0]),
    "first_to_last_at_end": float(first_last[-1]),
    "first_to_last_min": float(first_last.min()),
    "max_to_min_at_start": float(max_min[0]),
    "max_to_min_at_end": float(max_min[-1]),
    "max_to_min_min": float(max_min.min()),
    "log2_layer_amax_at_start": np.log2(amax[0]).tolist(),
    "log2_layer_amax_at_end": np.log2(amax[-1]).tolist(),
  }


def downsample(curve: np.ndarray, points: int) -> list[float]:
  """Means of ``points`` equal bins (a smoothed curve for the JSON and the plot)."""
  bins = np.array_split(curve, min(points, len(curve)))
  return [float(b.mean()) for b in bins]


def _paired(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
  """Per-seed differences a - b, their mean, standard deviation and standard error."""
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  std = float(d.std(ddof=1)) if len(d) > 1 else 0.0
  return {
    "per_seed": d.tolist(),
    "mean": float(d.mean()),
    "std": std,
    "stderr": std / math.sqrt(len(d)),
  }


def summarize_task(
  model: Model, runs: dict[str, list[RunResult]], sweeps: list[dict], args: argparse.Namespace
) -> dict[str, Any]:
  """Aggregates the runs of every seed into the JSON record of one task."""
  tail = max(1, args.steps // 10)
  methods: dict[str, Any] = {}
  for method in METHODS:
    seed_runs = runs[method]
    record: dict[str, Any] = {
      "final_train_loss": [float(r.losses[-tail:].mean()) for r in seed_runs],
      "eval_loss": [r.eval_loss for r in seed_runs],
      "skipped_steps": [r.skipped_steps for r in seed_runs],
      "final_log2_scale": [r.final_log2_scale for r in seed_runs],
      "loss_curve": np.mean(
        [downsample(r.losses, args.curve_points) for r in seed_runs], axis=0
      ).tolist(),
      "seconds": [r.seconds for r in seed_runs],
    }
    if method in SCALED_METHODS:
      for below, key in ((False, "underflow"), (True, "underflow_below_range")):
        means, worsts = zip(
          *(steady_state_underflow(r, args.steps, below) for r in seed_runs), strict=True
        )
        mean = np.nanmean(np.stack(means), axis=0)
        record[f"{key}_per_layer"] = mean.tolist()
        record[f"{key}_per_layer_worst"] = np.nanmax(np.stack(worsts), axis=0).tolist()
        record[f"{key}_max_layer"] = float(np.nanmax(mean))
      total = [float(r.lost[r.finite].sum() / max(r.nonzero[r.finite].sum(), 1)) for r in seed_runs]
      record["underflow_total_all_steps"] = total
      record["underflow_curve_max_layer"] = np.mean(
        [(r.lost / np.maximum(r.nonzero, 1)).max(axis=1) for r in seed_runs], axis=0
      ).tolist()
    methods[method] = record
  fp32_ref = runs["fp32"]
  spreads = [spread_bits(r.ref_amax) for r in fp32_ref]
  lw = methods["layerwise"]
  fp32_eval = np.asarray(methods["fp32"]["eval_loss"])
  fp32_train = np.asarray(methods["fp32"]["final_train_loss"])
  lw_train = np.asarray(lw["final_train_loss"])
  no_single_scale = [
    s["min_over_scales_of_max_layer_underflow"] > args.underflow_fraction for s in sweeps
  ]
  targets = {
    "underflow_fraction": args.underflow_fraction,
    "layerwise_every_layer_at_or_below_target": bool(
      lw["underflow_max_layer"] <= args.underflow_fraction
    ),
    "layerwise_max_layer_underflow": lw["underflow_max_layer"],
    # Counting only the values lost to the scale (below 2^-24 at the stage's scale).
    "layerwise_every_layer_at_or_below_target_below_range": bool(
      lw["underflow_below_range_max_layer"] <= args.underflow_fraction
    ),
    "layerwise_max_layer_underflow_below_range": lw["underflow_below_range_max_layer"],
    "no_single_scale_meets_target": bool(all(no_single_scale)),
    "best_single_scale_max_layer_underflow": [
      s["min_over_scales_of_max_layer_underflow"] for s in sweeps
    ],
    "spread_exceeds_fp16_range": bool(
      all(s["first_to_last_min"] > math.log2(65504 / 2.0**-24) for s in spreads)
    ),
    "final_train_loss_layerwise_minus_fp32": _paired(lw_train, fp32_train),
    "eval_loss_layerwise_minus_fp32": _paired(np.asarray(lw["eval_loss"]), fp32_eval),
    "eval_loss_layerwise_minus_dynamic": _paired(
      np.asarray(lw["eval_loss"]), np.asarray(methods["dynamic"]["eval_loss"])
    ),
  }
  # "Within noise": the mean paired difference (same seeds, same batches) of the final training
  # loss is within 2 standard errors of the paired differences, or below 0.5% of the loss.
  d = targets["final_train_loss_layerwise_minus_fp32"]
  targets["layerwise_matches_fp32_within_noise"] = (
    bool(abs(d["mean"]) <= max(2 * d["stderr"], 0.005 * float(fp32_train.mean())))
    if len(fp32_train) > 1
    else None  # one seed: no noise estimate
  )
  return {
    "task": model.name,
    "title": model.title,
    "layer_names": list(model.layer_names),
    "spread_bits": spreads,
    "static_sweeps": sweeps,
    "static_log2_scale": [s["best_log2_scale"] for s in sweeps],
    "methods": methods,
    "targets": targets,
  }


def _fmt_pct(x: float) -> str:
  if x is None or not np.isfinite(x):
    return "n/a"
  if x == 0:
    return "0"
  if x < 1e-3:
    return f"{100 * x:.3f}"
  return f"{100 * x:.2f}" if x < 0.1 else f"{100 * x:.1f}"


def _mean_std(values: Sequence[float], digits: int = 4) -> str:
  v = np.asarray(values, np.float64)
  if len(v) == 1:
    return f"{v[0]:.{digits}f}"
  return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


def markdown_tables(results: dict[str, Any]) -> str:
  """The per-layer underflow table and the loss summary of every task, in Markdown."""
  lines = []
  seeds = results["config"]["seeds"]
  for task in results["tasks"]:
    m, t = task["methods"], task["targets"]
    lines.append(f"### {task['task']}: {task['title']}\n")
    lines.append(
      "Gradient spread in the fp32 reference, log2(amax of the last layer's gradients / amax "
      "of the first layer's), at step 0 and the smallest over training: "
      + ", ".join(
        f"seed {seed}: {s['first_to_last_at_start']:.1f} and {s['first_to_last_min']:.1f}"
        for seed, s in zip(seeds, task["spread_bits"], strict=True)
      )
      + " (fp16 spans about 40 powers of two, 2^-24..65504).\n"
    )
    lines.append(
      "Best static scale per seed: "
      + ", ".join(f"2^{e}" for e in task["static_log2_scale"])
      + ". The best any single scale does for its worst layer (on the fp32 checkpoints): "
      + ", ".join(_fmt_pct(x) + "%" for x in t["best_single_scale_max_layer_underflow"])
      + ".\n"
    )
    lines += [
      "Underflow % per layer (mean over the measurements of the second half of training and "
      "over seeds). The last column counts only the values lost to the scale (true value times "
      "the stage's scale below 2^-24); the rest are zeros of fp16 rounding in the forward pass, "
      "which no loss scale recovers.\n",
      "| layer | " + " | ".join(SCALED_METHODS) + " | layerwise, below range |",
      "|" + "---|" * (len(SCALED_METHODS) + 2),
    ]
    for i, name in enumerate(task["layer_names"]):
      cells = [_fmt_pct(m[meth]["underflow_per_layer"][i]) for meth in SCALED_METHODS]
      cells.append(_fmt_pct(m["layerwise"]["underflow_below_range_per_layer"][i]))
      lines.append(f"| {name} | " + " | ".join(cells) + " |")
    worst = [f"**{_fmt_pct(m[meth]['underflow_max_layer'])}**" for meth in SCALED_METHODS]
    worst.append(f"**{_fmt_pct(m['layerwise']['underflow_below_range_max_layer'])}**")
    lines.append("| **worst layer** | " + " | ".join(worst) + " |")
    lines += [
      "",
      "| method | steps skipped (per seed) | final train loss | held-out loss (fp32) "
      "| final log2 scale |",
      "|---|---|---|---|---|",
    ]
    for meth in METHODS:
      scales = m[meth]["final_log2_scale"]
      if meth == "layerwise":
        lo = min(min(s) for s in scales)
        hi = max(max(s) for s in scales)
        scale_txt = f"{lo:.0f}..{hi:.0f} (per stage)"
      elif meth in ("fp32", "fp16"):
        scale_txt = "-"
      else:
        scale_txt = ", ".join(f"{s[0]:.0f}" for s in scales)
      lines.append(
        f"| {meth} | {', '.join(str(s) for s in m[meth]['skipped_steps'])} | "
        f"{_mean_std(m[meth]['final_train_loss'])} | {_mean_std(m[meth]['eval_loss'])} | "
        f"{scale_txt} |"
      )

    def paired(key: str, t: dict = t) -> str:
      d = t[key]
      return ", ".join(f"{x:+.4f}" for x in d["per_seed"]) + f" (mean {d['mean']:+.4f})"

    lines += [
      "",
      f"- Layer-wise worst layer: {_fmt_pct(t['layerwise_max_layer_underflow'])}% "
      f"({_fmt_pct(t['layerwise_max_layer_underflow_below_range'])}% lost to the scale); "
      f"target <= {_fmt_pct(t['underflow_fraction'])}%: "
      f"{'met' if t['layerwise_every_layer_at_or_below_target'] else 'NOT met'} "
      f"({'met' if t['layerwise_every_layer_at_or_below_target_below_range'] else 'NOT met'} "
      "counting only values lost to the scale).",
      f"- No single scale meets the target: {t['no_single_scale_meets_target']}; "
      f"spread above fp16's range on every seed: {t['spread_exceeds_fp16_range']}.",
      f"- Final train loss, layer-wise minus fp32 (paired by seed): "
      f"{paired('final_train_loss_layerwise_minus_fp32')}; within noise: "
      f"{t['layerwise_matches_fp32_within_noise']}.",
      f"- Held-out loss, layer-wise minus fp32: {paired('eval_loss_layerwise_minus_fp32')}; "
      f"layer-wise minus dynamic: {paired('eval_loss_layerwise_minus_dynamic')}.\n",
    ]
  return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> bool:
  """Per task: underflow per layer per method, loss curves, per-stage scales.

  Returns False (and writes nothing) when matplotlib is not installed.
  """
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot (pip install matplotlib).", file=sys.stderr)
    return False
  tasks = results["tasks"]
  colors = {
    "fp32": "black",
    "fp16": "tab:red",
    "static": "tab:orange",
    "dynamic": "tab:blue",
    "layerwise": "tab:green",
  }
  fig, axes = plt.subplots(
    len(tasks), 3, figsize=(17, 4.3 * len(tasks)), squeeze=False, width_ratios=[1.3, 1, 1]
  )
  floor = 1e-6  # zero underflow is drawn at the bottom of the log axis
  fmt = jl.format_info("float16")
  for row, task in zip(axes, tasks, strict=True):
    names = task["layer_names"]
    x = np.arange(len(names))
    ticks = dict(rotation=90 if len(names) > 10 else 0, fontsize=7)

    ax = row[0]
    for meth in SCALED_METHODS:
      y = np.maximum(np.asarray(task["methods"][meth]["underflow_per_layer"]), floor) * 100
      ax.plot(x, y, "o-", ms=3, color=colors[meth], label=meth)
    target = task["targets"]["underflow_fraction"] * 100
    ax.axhline(target, ls="--", color="gray", lw=1, label=f"target {target:g}%")
    ax.set_yscale("log")
    ax.set_ylim(floor * 100 / 2, 150)
    ax.set_xticks(x, names, **ticks)
    ax.set_ylabel("underflow % (steady state)")
    ax.set_title(f"{task['task']}: underflow per layer (0 drawn at {floor * 100:g}%)", fontsize=10)
    ax.legend(fontsize=7)

    ax = row[1]
    for meth in METHODS:
      curve = np.asarray(task["methods"][meth]["loss_curve"])
      steps = np.linspace(0, results["config"]["steps"], len(curve))
      ax.plot(steps, curve, color=colors[meth], label=meth, lw=2.5 if meth == "fp32" else 1.2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (binned, mean over seeds)")
    ax.set_title(f"{task['task']}: training loss ({results['config']['optimizer']})", fontsize=10)
    ax.legend(fontsize=7)

    ax = row[2]
    # The largest scale that keeps a layer's largest gradient below fp16's max / 8.
    amax = np.asarray([s["log2_layer_amax_at_end"] for s in task["spread_bits"]]).mean(axis=0)
    ax.plot(x, np.log2(fmt.max / 8) - amax, "k:", label="log2(65504/8 / amax), fp32 ref")
    lw_scales = np.asarray(task["methods"]["layerwise"]["final_log2_scale"]).mean(axis=0)
    ax.plot(x, lw_scales, "o-", ms=3, color=colors["layerwise"], label="layerwise (per stage)")
    for meth in ("static", "dynamic"):
      value = np.mean([s[0] for s in task["methods"][meth]["final_log2_scale"]])
      ax.axhline(value, color=colors[meth], label=meth)
    ax.set_xticks(x, names, **ticks)
    ax.set_ylabel("log2 loss scale at the end (mean over seeds)")
    ax.set_title(f"{task['task']}: loss scales", fontsize=10)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def write_outputs(results: dict[str, Any], stem: str, with_plot: bool = True) -> None:
  """Writes ``stem``.md (the tables) and ``stem``.png from a results dict."""
  tables = markdown_tables(results)
  with open(stem + ".md", "w") as f:
    f.write(f"<!-- {results['config']['command']} -->\n\n{tables}")
  print("\n" + tables)
  if with_plot and plot(results, stem + ".png"):
    print(f"wrote {stem}.png")
