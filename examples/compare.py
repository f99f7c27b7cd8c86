"""Mixed precision recipes side by side: one example, every recipe, the same seed.

Trains one example (default: the character-level transformer LM of :mod:`examples.charlm`;
``--example digits``) under each recipe of :data:`examples.common.RECIPES` from the same
initialization on the same batches, through :func:`examples.common.train` (the training step
of ``examples/optax_fp16.py``, with the policy applied by ``jlf.policy_apply``). It prints a
table and writes to ``--out``: ``<example>_compare.json`` (everything measured),
``<example>_compare.md`` (the table) and the figures of :data:`FIGURES`; with the opt-in group
``--recipes low-precision-params`` (bf16 parameters without an fp32 master copy) also
``<example>_low_precision.md`` and its figure. For the LM the loss is one replica's share of
a data-parallel global batch of 2^19 tokens (``--replicas``), where fp16 without loss scaling
flushes most activation gradients to zero. docs/examples.md explains every output.

Run: python -m examples.compare                      (3-4 minutes on 2 busy CPU cores)
     python -m examples.compare --example digits
     python -m examples.compare --recipes fp32,fp16,fp16-dynamic --steps 1000
     python -m examples.compare --replicas 1          (no underflow scenario)
     python -m examples.compare --recipes low-precision-params --steps 1000   (~12 minutes)
     python -m examples.compare --quick --out /tmp/c  (small, for tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform as platform_lib
import statistics
import sys
import textwrap
import time
from collections.abc import Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl
from examples import charlm, common, digits, low_precision

EXAMPLES = {"charlm": charlm, "digits": digits}
DEFAULT_RECIPES = {
  "charlm": tuple(common.RECIPES),
  "digits": tuple(r for r in common.RECIPES if not common.RECIPES[r].fp8),
}
MIB = 2.0**20
TIMING = {"cpu": (15, 2), "quick": (1, 3), "accelerator": (25, 4)}
"""(rounds, steps per round) of the interleaved step timing: many short rounds, so that a
change in the machine's load lands on every recipe alike."""
COMPARE_DEFAULTS = {"cpu": {"steps": 200, "eval_every": 25}}
"""Where the comparison's defaults differ from the example's preset (flags given win): seven
recipes of 200 steps fit the Quickstart's few minutes on 2 CPU cores."""


def scenario_replicas(example: str, model_config: Any) -> int:
  """R for the underflow scenario: a global batch of charlm.GLOBAL_BATCH_TOKENS tokens."""
  if example != "charlm":
    return 1
  local = model_config.batch_size * model_config.seq_len
  return max(1, charlm.GLOBAL_BATCH_TOKENS // local)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m examples.compare",
    description="Train one example under every mixed precision recipe from the same seed; "
    "print a table, write plots and JSON.",
  )
  parser.add_argument("--example", choices=sorted(EXAMPLES), default="charlm")
  parser.add_argument(
    "--recipes",
    default=None,
    help="comma-separated recipes or groups (default: all of the first list below; fp8 only "
    "for charlm). Group low-precision-params (opt-in): "
    + ", ".join(common.RECIPE_GROUPS["low-precision-params"])
    + ", bf16 parameters without an fp32 master copy, run it with --steps 1000 on CPU. "
    + common.recipe_help(),
  )
  common.add_preset_arguments(parser, charlm.PRESETS)
  parser.add_argument("--out", default="out/examples", help="output directory (%(default)s)")
  parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
  common.add_train_arguments(
    parser,
    charlm.PRESETS["cpu"][1],
    shown={
      "steps": f"{COMPARE_DEFAULTS['cpu']['steps']} on CPU",
      "eval_every": f"{COMPARE_DEFAULTS['cpu']['eval_every']} on CPU",
      "replicas": "charlm: the underflow scenario, 2^19 tokens / tokens per step; digits: 1",
    },
  )
  return parser


# ---------------------------------------------------------------------------------------------
# Table


def _fmt_scale(x: float | None) -> str:
  if x is None:
    return "-"
  if x == 1.0:
    return "1"
  e = math.log2(x)
  return f"2^{e:.0f}" if e == round(e) else f"{x:g}"


def baseline(names: Sequence[str]) -> str | None:
  """The recipe the table's ratios are relative to: fp32, else fp32-master, else none."""
  return next((n for n in ("fp32", "fp32-master") if n in names), None)


def table_rows(example: str, results: dict[str, common.RunResult]) -> list[dict[str, Any]]:
  """One row per recipe, in plain values (also stored in the JSON). The ``*_vs_fp32`` ratios
  are relative to :func:`baseline`'s recipe (fp32-master in a low-precision-params run)."""
  base_name = baseline(list(results))
  base = results[base_name] if base_name else None
  rows = []
  for name, r in results.items():
    f = r.final
    row: dict[str, Any] = {
      "recipe": name,
      "train_loss": f["train_loss"],
      "val_loss": f["val_loss"],
      "val_accuracy": f["val_accuracy"],
      "skipped_steps": len(r.skipped),
      "final_loss_scale": r.loss_scale[-1] if r.loss_scale_kind != "none" else None,
      "final_stage_scales": r.stage_scales[-1] if r.stage_scales else None,
      "step_time_ms": r.step_time_ms,
      "compile_s": r.compile_s,
      "memory_mib": r.memory.get("total_bytes", 0) / MIB if r.memory else None,
      "temp_mib": r.memory.get("temp_size_in_bytes", 0) / MIB if r.memory else None,
    }
    if example == "charlm":
      row["train_bpc"] = charlm.bits_per_char(f["train_loss"])
      row["val_bpc"] = charlm.bits_per_char(f["val_loss"])
    if base is not None:
      row["step_time_vs_fp32"] = r.step_time_ms / base.step_time_ms
      if row["memory_mib"] and base.memory:
        row["memory_vs_fp32"] = r.memory["total_bytes"] / base.memory["total_bytes"]
      row["val_loss_vs_fp32"] = f["val_loss"] - base.final["val_loss"]
    rows.append(row)
  return rows


def format_table(example: str, rows: list[dict[str, Any]]) -> str:
  """A Markdown table (also readable as plain text), with only the columns the recipes in
  ``rows`` fill: no loss-scale column without a loss-scaled recipe, no ratio columns without
  a baseline (:func:`baseline`), whose name the ratio headers carry."""
  base = baseline([row["recipe"] for row in rows])
  scaled = any(row["final_loss_scale"] is not None for row in rows)

  def ratio(x):
    return "-" if x is None else f"{x:.2f}"

  columns: list[tuple[str, Any]] = [
    ("recipe", lambda row: row["recipe"]),
    ("train loss", lambda row: f"{row['train_loss']:.3f}"),
    ("val loss", lambda row: f"{row['val_loss']:.3f}"),
  ]
  if example == "charlm":
    columns.append(("val bpc", lambda row: f"{row['val_bpc']:.3f}"))
  columns += [
    ("val acc", lambda row: f"{row['val_accuracy']:.3f}"),
    ("skipped steps", lambda row: str(row["skipped_steps"])),
  ]
  if scaled:
    columns.append(("final loss scale", _scale_cell))
  columns.append(("median step ms", lambda row: f"{row['step_time_ms']:.1f}"))
  if base:
    columns.append((f"step time x {base}", lambda row: ratio(row.get("step_time_vs_fp32"))))
  columns.append(
    ("memory MiB", lambda row: "-" if row["memory_mib"] is None else f"{row['memory_mib']:.1f}")
  )
  if base:
    columns.append((f"memory x {base}", lambda row: ratio(row.get("memory_vs_fp32"))))
  return common.markdown_table(columns, rows)


def _scale_cell(row: dict[str, Any]) -> str:
  if row["final_stage_scales"]:
    return "/".join(_fmt_scale(s) for s in row["final_stage_scales"])
  return _fmt_scale(row["final_loss_scale"])


def table_notes(rows: list[dict[str, Any]], rounds: int, per_round: int, stages: str) -> str:
  """What the table's less obvious columns mean (printed under it); ``stages`` names the
  layer-wise stages in order (the task's ``stages``)."""
  base = baseline([row["recipe"] for row in rows])
  notes = [
    f"median step ms: median wall time of one training step after compilation, {rounds} x "
    f"{per_round} steps per recipe timed after training with the recipes interleaved round by "
    "round, so that other processes' load falls on all alike (the 'training loop' times above "
    "ran one recipe after another and follow the load).",
  ]
  if base:
    notes.append(f"x {base}: that recipe's value divided by {base}'s.")
  notes.append(
    "memory MiB: the compiled training step's arguments + outputs - donated buffers + "
    "temporaries (memory_analysis())."
  )
  if any(row["final_stage_scales"] for row in rows):
    notes.append(f"final loss scale of fp16-layerwise: one per stage, in order: {stages}.")
  return "\n".join(textwrap.fill(note, 100, subsequent_indent="  ") for note in notes)


# ---------------------------------------------------------------------------------------------
# Plots


def _ema(values: Sequence[float], alpha: float = 0.1) -> np.ndarray:
  out, acc = [], None
  for v in values:
    acc = v if acc is None else (1 - alpha) * acc + alpha * v
    out.append(acc)
  return np.asarray(out)


STYLES: dict[str, tuple[str, Any]] = {
  "fp32": ("black", "-"),
  "bf16": ("tab:blue", "--"),
  "fp16": ("tab:red", "-"),
  "fp16-static": ("tab:orange", ":"),
  "fp16-dynamic": ("tab:green", "-."),
  "fp16-layerwise": ("tab:purple", (0, (6, 2))),
  "fp8": ("tab:brown", (0, (3, 1, 1, 1, 1, 1))),
  "fp32-master": ("dimgray", "-"),
  "fp32-master-view": ("tab:olive", "--"),
  "bf16-nearest": ("tab:red", "--"),
  "bf16-stochastic": ("tab:green", ":"),
  "bf16-kahan": ("tab:cyan", "-."),
  "bf16-split": ("tab:pink", (0, (6, 2))),
}
"""(colour, line style) per recipe, the same in every figure and run: distinct colours
within each recipe list (the default one, the low-precision-params group), and a distinct
pair across both; the line styles keep curves drawn on top of each other visible."""
_FALLBACK = ("tab:gray", "tab:olive", "tab:cyan", "tab:pink", "gold")
OVERLAP = 0.01
"""Curves closer than this share of the axis's height at every point are drawn on top of
each other: the legend says so."""


def _style(name: str) -> dict[str, Any]:
  """``color`` and ``linestyle`` keywords for ``name``'s curves."""
  color, linestyle = STYLES.get(name) or (_FALLBACK[sum(map(ord, name)) % len(_FALLBACK)], "-")
  return {"color": color, "linestyle": linestyle}


def overlapping(curves: dict[str, Sequence[float]], tolerance: float) -> list[list[str]]:
  """Groups (two or more, in ``curves``' order) of curves that stay within ``tolerance`` of
  each other at every point, joined when one curve is close to two others."""
  names = list(curves)
  group = {n: i for i, n in enumerate(names)}
  for i, a in enumerate(names):
    for b in names[i + 1 :]:
      ya, yb = np.asarray(curves[a], float), np.asarray(curves[b], float)
      if ya.shape == yb.shape and np.all(np.abs(ya - yb) <= tolerance):
        old, new = group[b], group[a]
        group = {n: new if g == old else g for n, g in group.items()}
  members: dict[int, list[str]] = {}
  for n in names:
    members.setdefault(group[n], []).append(n)
  return [m for m in members.values() if len(m) > 1]


def _overlap_note(ax: Any, curves: dict[str, Sequence[float]], log2: bool = False) -> str:
  """Which of ``curves`` the eye cannot tell apart on ``ax`` (compared within its y-limits,
  in log2 on a log2 axis), as a sentence per group: "a, b and c overlap"."""
  low, high = ax.get_ylim()
  clipped = {n: np.clip(np.asarray(y, float), low, high) for n, y in curves.items()}
  if log2:
    clipped = {n: np.log2(y) for n, y in clipped.items()}
  span = math.log2(high / low) if log2 else high - low
  groups = overlapping(clipped, OVERLAP * span)
  return _wrap(
    "\n".join(
      (", ".join(g[:-1]) + " and " + g[-1] if len(g) > 2 else " and ".join(g)) + " overlap"
      for g in groups
    )
  )


def _wrap(text: str, width: int = 34) -> str:
  return "\n".join(
    "\n".join(textwrap.wrap(line, width, break_on_hyphens=False)) for line in text.splitlines()
  )


def _leaf_layers(names: Sequence[str]) -> list[str]:
  """Module outputs that are not containers of other listed modules (and not the root)."""
  return [
    n for n in names if n != "output" and not any(m.startswith(n + "/") for m in names if m != n)
  ]


def validation_top(results: dict[str, Any]) -> float:
  """The top of the validation panel's y axis.

  It zooms in on the trained part (the untrained first points dwarf the rest) but keeps the
  last half of every curve's points, and at least three, in view: a quick run has only three.
  """
  keep = max(3, min(len(r["val_loss"]) for r in results.values()) // 2)
  return max(
    1.5 * max(r["val_loss"][-1] for r in results.values()),
    1.05 * max(max(r["val_loss"][-keep:]) for r in results.values()),
  )


def write_plots(example: str, summary: dict[str, Any], out: str) -> list[str]:
  """The figures of :data:`FIGURES` that the run has data for; returns their paths."""
  import matplotlib

  matplotlib.use("Agg")  # files only, no display needed
  import matplotlib.pyplot as plt

  paths = []
  for name, figure in FIGURES.items():
    fig = figure(plt, summary)
    if fig is None:
      continue
    paths.append(os.path.join(out, f"{example}_{name}.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=80, bbox_inches="tight")  # with legends outside the axes
    plt.close(fig)
  return paths


def _loss_figure(plt: Any, summary: dict[str, Any]) -> Any:
  """Smoothed training loss and the validation points, per recipe."""
  results = summary["results"]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  train = {name: _ema(r["train_loss"]) for name, r in results.items()}
  for name, r in results.items():
    ax1.plot(train[name], label=name, linewidth=1.4, **_style(name))
    ax2.plot(r["eval_steps"], r["val_loss"], marker="o", label=name, markersize=3, **_style(name))
  ax1.set_title("training loss (EMA 0.1)")
  ax2.set_title("validation loss")
  ax2.set_ylim(top=min(ax2.get_ylim()[1], validation_top(results)))
  val = {name: r["val_loss"] for name, r in results.items()}
  for ax, curves in ((ax1, train), (ax2, val)):
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    # Curves that lie on each other look like one: say which (top right, where the falling
    # curves leave room).
    note = _overlap_note(ax, curves)
    if note:
      box = {"facecolor": "white", "edgecolor": "lightgray", "alpha": 0.9}
      ax.text(0.98, 0.97, note, transform=ax.transAxes, ha="right", va="top", bbox=box)
  # One legend for both panels, right of them.
  fig.legend(*ax1.get_legend_handles_labels(), loc="center left", bbox_to_anchor=(1.0, 0.5))
  return fig


def _fp8_figure(plt: Any, summary: dict[str, Any]) -> Any:
  """fp8 against bf16: the same bf16 policy, only the Dense matmuls differ."""
  results = summary["results"]
  if "fp8" not in results or "bf16" not in results:
    return None
  fp8_run, bf16 = results["fp8"], results["bf16"]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for name, r in (("bf16", bf16), ("fp8", fp8_run)):
    color = _style(name)["color"]
    ax1.plot(_ema(r["train_loss"]), label=f"{name} train (EMA)", color=color)
    ax1.plot(r["eval_steps"], r["val_loss"], "o--", color=color, label=f"{name} val")
  ax1.set_ylim(top=1.3 * max(fp8_run["val_loss"][-1], bf16["val_loss"][-1]))
  ax1.set(xlabel="step", ylabel="cross-entropy (nats)", title="fp8 matmuls vs bf16")
  ax1.legend(fontsize="small")
  diff = np.asarray(fp8_run["train_loss"]) - np.asarray(bf16["train_loss"])
  ax2.plot(diff, color="lightgray", linewidth=0.8, label="per step")
  ax2.plot(_ema(diff), color=_style("fp8")["color"], label="EMA 0.1")
  val_diff = np.asarray(fp8_run["val_loss"]) - np.asarray(bf16["val_loss"])
  ax2.plot(fp8_run["eval_steps"], val_diff, "o", color="black", label="validation")
  ax2.axhline(0, color="gray", linewidth=0.8)
  ax2.set(xlabel="step", ylabel="fp8 loss - bf16 loss (nats)")
  ax2.set_title("difference (same batches, same initialization)")
  ax2.legend(fontsize="small")
  return fig


def _low_precision_or_none(plt: Any, summary: dict[str, Any]) -> Any:
  if all(r.get("rounded_away") is None for r in summary["results"].values()):
    return None
  return _low_precision_figure(plt, summary)


def _loss_scale_figure(plt: Any, summary: dict[str, Any]) -> Any:
  """fp16-dynamic with jmp_lite.plotting's own plot (skips marked), then the other scaled
  recipes (layer-wise: one line per stage)."""
  from jmp_lite import plotting

  results = summary["results"]
  dynamic = results.get("fp16-dynamic")
  others = {n: r for n, r in results.items() if r["loss_scale_kind"] in ("static", "layerwise")}
  if not dynamic and not others:
    return None
  panels = int(dynamic is not None) + int(bool(others))
  fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), sharey=True, squeeze=False)
  axes = list(axes[0])
  if dynamic:
    skipped = np.zeros(len(dynamic["loss_scale"]), bool)
    skipped[dynamic["skipped"]] = True
    color = _style("fp16-dynamic")["color"]
    plotting.plot_loss_scale(
      dynamic["loss_scale"], skipped=skipped, ax=axes.pop(0), title="fp16-dynamic", color=color
    )
  if others:
    _stage_scales_panel(axes.pop(0), others)
  return fig


def _stage_scales_panel(ax: Any, runs: dict[str, Any]) -> None:
  curves = {}
  for name, r in runs.items():
    stages = np.asarray(r["stage_scales"] or [[s] for s in r["loss_scale"]])
    for k in range(stages.shape[1]):
      label = f"{name} stage {k}" if stages.shape[1] > 1 else name
      # Stages in the recipe's colour, told apart (and seen when equal) by line style.
      style = _style(name) | {"linestyle": ("-", "--", ":", "-.")[k % 4]}
      ax.step(np.arange(len(stages)), stages[:, k], where="post", label=label, **style)
      curves[label] = stages[:, k]
  ax.set_yscale("log", base=2)
  ax.set_xlabel("step")
  layerwise = any(r["stage_scales"] for r in runs.values())
  ax.set_title(" and ".join(runs) + (" (one scale per stage)" if layerwise else ""))
  note = _overlap_note(ax, curves, log2=True)
  ax.legend(fontsize="small", title=note or None, title_fontsize="small")


def _histogram_figure(plt: Any, summary: dict[str, Any]) -> Any:
  """Activation-gradient exponents against fp16's range (Micikevicius et al., Fig. 3)."""
  from jmp_lite import plotting

  act = summary.get("activation_gradients")
  if not act:
    return None
  layers = common.stats_from_python(act["stats"])
  pooled = {n: s for n, s in layers.items() if n in _leaf_layers(list(layers))}
  scale = act["dynamic_scale"]
  fig, axes = plt.subplots(1, 2 if scale else 1, figsize=(12 if scale else 6.5, 4))
  axes = np.atleast_1d(axes)
  title = f"activation gradients (fp32 run, step {act['step']}), no loss scale"
  plotting.plot_gradient_histogram(pooled, "float16", loss_scale=1.0, ax=axes[0], title=title)
  if scale:
    title = f"same values, loss scale {_fmt_scale(scale)} (fp16-dynamic's final)"
    plotting.plot_gradient_histogram(pooled, "float16", loss_scale=scale, ax=axes[1], title=title)
  return fig


def _underflow_figure(plt: Any, summary: dict[str, Any]) -> Any:
  """Underflow per layer: unscaled, at the dynamic scale, and what the fp16 run lost."""
  from jmp_lite import plotting

  act, results = summary.get("activation_gradients"), summary["results"]
  if not act:
    return None
  layers = common.stats_from_python(act["stats"])
  names = _leaf_layers(list(layers))
  scale = act["dynamic_scale"]
  panels = [("activation gradients in fp16, no scale", layers)]
  if scale:
    at_scale = common.stats_from_python(act["stats_at_dynamic_scale"])
    panels.append((f"... at loss scale {_fmt_scale(scale)}", at_scale))
  fp16 = "fp16" in results
  height = 0.3 * len(names) + 1.8
  fig, axes = plt.subplots(1, len(panels) + fp16, figsize=(5.2 * (len(panels) + fp16), height))
  axes = np.atleast_1d(axes)
  fields = ("underflow_fraction", "subnormal_fraction")
  for ax, (title, stats) in zip(axes, panels, strict=False):
    by_layer = {n: stats[n] for n in names}
    plotting.plot_underflow_by_layer(by_layer, fields=fields, ax=ax, title=title)
  if fp16:
    _zero_gradients_panel(axes[-1], results)
  return fig


def _zero_gradients_panel(ax: Any, results: dict[str, Any]) -> None:
  """Parameter gradients that came out exactly zero at the last step, fp16 next to fp32:
  fp32 has zeros too (embedding rows of characters absent from the batch)."""
  runs = [(n, results[n]) for n in ("fp32", "fp16") if n in results]
  fp16 = results["fp16"]
  param_layers = list(fp16["grad_stats"][max(fp16["grad_stats"], key=int)])
  y = np.arange(len(param_layers))
  for j, (name, r) in enumerate(runs):
    last = r["grad_stats"][max(r["grad_stats"], key=int)]
    values = [last[n]["zero_fraction"] for n in param_layers]
    ax.barh(y + 0.4 * j, values, height=0.4, color=_style(name)["color"], label=name)
  ax.set_yticks(y + 0.2 * (len(runs) - 1))
  ax.set_yticklabels([n.removeprefix("params/") for n in param_layers])
  ax.invert_yaxis()
  ax.set_xlim(0, 1)
  ax.set_xlabel("fraction of parameter-gradient values")
  ax.set_title("parameter gradients exactly zero\n(last step of each run)")
  ax.legend(fontsize="small", loc="lower right")


def _low_precision_figure(plt: Any, summary: dict[str, Any]) -> Any:
  """Left: per step, the share of 16-bit parameter elements whose update rounded away, with
  the learning rate. Right: each recipe's validation loss minus fp32-master's."""
  results = summary["results"]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 5))
  for name, r in results.items():
    share = low_precision.rounded_away_share(r)
    if share is None:
      continue
    color = _style(name)["color"]
    nearest = common.get_recipe(name).params_method == "nearest"
    ax1.plot(share, color=color, linewidth=0.5, alpha=0.3)
    ax1.plot(_ema(share), linewidth=2.0 if nearest else 1.2, label=name, **_style(name))
  ax1.set_ylim(0, 1)
  ax1.set_xlabel("step")
  ax1.set_ylabel("share of bf16 parameter elements")
  lost = "lost for bf16-nearest; " if "bf16-nearest" in results else ""
  ax1.set_title(f"updates that left the bf16 value unchanged\n({lost}EMA 0.1)")
  lr_axis = ax1.twinx()
  config = common.TrainConfig(**summary["train"])
  schedule = common.make_schedule(config)
  lr_axis.plot(
    jax.jit(jax.vmap(schedule))(np.arange(config.steps)),
    color="gray",
    linestyle="--",
    linewidth=0.8,
    label="learning rate",
  )
  lr_axis.set_ylim(bottom=0)
  lr_axis.set_ylabel("learning rate", color="gray")
  lines, labels = ax1.get_legend_handles_labels()
  more, more_labels = lr_axis.get_legend_handles_labels()
  # Below the axes: the curves fill different corners in different runs.
  ax1.legend(
    lines + more,
    labels + more_labels,
    fontsize="small",
    loc="upper center",
    bbox_to_anchor=(0.5, -0.15),
    ncol=3,
  )
  base = results.get("fp32-master")
  if base is not None:
    for name, r in results.items():
      if name == "fp32-master" or name not in common.LOW_PRECISION_RECIPES:
        continue
      diff = np.asarray(r["val_loss"]) - np.asarray(base["val_loss"])
      ax2.plot(r["eval_steps"], diff, marker="o", markersize=3, label=name, **_style(name))
    ax2.axhline(0, color=_style("fp32-master")["color"], linewidth=0.8)
    ax2.set_xlabel("step")
    ax2.set_ylabel("val loss - fp32-master's (nats)")
    ax2.set_title("validation loss against fp32 master weights\n(same seed, same batches)")
    ax2.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=3)
  else:
    ax2.set_axis_off()
  return fig


FIGURES = {
  "loss": _loss_figure,
  "fp8_vs_bf16": _fp8_figure,
  "low_precision": _low_precision_or_none,
  "loss_scale": _loss_scale_figure,
  "grad_histogram": _histogram_figure,
  "underflow": _underflow_figure,
}
"""Figure name -> a function of (pyplot, the summary) drawing it, or returning None when the
run has no data for it."""


# ---------------------------------------------------------------------------------------------
# Main


def recipe_names(spec: str | None, example: str) -> list[str]:
  """The recipe names of ``--recipes`` (groups expanded), or the example's default recipes."""
  if not spec:
    return list(DEFAULT_RECIPES[example])
  names = []
  for item in spec.split(","):
    item = item.strip()
    names += common.RECIPE_GROUPS.get(item, (item,))
  return names


def _rounded(obj: Any, digits: int = 6) -> Any:
  """``obj`` with floats rounded to ``digits`` significant digits (a JSON a third the size;
  the measurements are not more precise than that)."""
  if isinstance(obj, float):
    return float(f"{obj:.{digits}g}")
  if isinstance(obj, dict):
    return {k: _rounded(v, digits) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [_rounded(v, digits) for v in obj]
  return obj


def _load_average() -> float | None:
  try:
    return os.getloadavg()[0]
  except OSError:  # not available on this OS
    return None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = build_parser().parse_args(argv)
  platform = common.select_platform(args.platform)
  task, model_config, config = configure(args, platform)
  recipes = [common.get_recipe(n) for n in recipe_names(args.recipes, args.example)]
  if len({r.name for r in recipes}) != len(recipes):
    raise SystemExit(f"A recipe is listed twice in {args.recipes!r} (half is one of them).")
  print(f"platform: {common.describe_platform()}")
  local = "tokens" if args.example == "charlm" else "images"
  print(
    f"example: {args.example}, {config.steps} steps, seed {config.seed}, replicas "
    f"{config.replicas} (loss = sum over this batch / (replicas x batch {local}))"
  )
  load_before = _load_average()
  t0 = time.perf_counter()
  results, masters, act_grads = train_recipes(task, recipes, config)
  rounds, per_round = TIMING.get(common.preset_name(args, platform), TIMING["cpu"])
  time_interleaved(results, rounds, per_round, config.progress)
  activation = activation_summary(act_grads, results, config.steps)
  wall = time.perf_counter() - t0

  rows = table_rows(args.example, results)
  tables = {f"{args.example}_compare.md": format_table(args.example, rows)}
  print(f"\n{tables[f'{args.example}_compare.md']}")
  print(table_notes(rows, rounds, per_round, task.stages))
  bf16_params = None
  if any(r.name in common.LOW_PRECISION_RECIPES for r in recipes):
    bf16_params = low_precision.report(args.example, results, masters)
    tables[f"{args.example}_low_precision.md"] = bf16_params.pop("markdown")
  print(f"\n{len(recipes)} recipes in {wall:.0f} s")
  summary = {
    "example": args.example,
    "command": "python -m examples.compare " + " ".join(argv if argv is not None else sys.argv[1:]),
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "platform": common.describe_platform(),
    "model": dataclasses.asdict(model_config),
    "train": {k: v for k, v in dataclasses.asdict(config).items() if k != "progress"},
    "wall_s": wall,
    # Other processes on the machine make the step times noisy: this says how busy it was.
    "load_average_1min": {"before": load_before, "after": _load_average()},
    "versions": _versions(),
    "table": rows,
    "results": {n: r.as_dict() for n, r in results.items()},
    "activation_gradients": activation,
  }
  if bf16_params is not None:
    summary["low_precision"] = bf16_params
  written = write_outputs(args, summary, tables)
  print("wrote " + ", ".join(written))
  return summary


def configure(args: argparse.Namespace, platform: str) -> tuple[Any, Any, common.TrainConfig]:
  """(the task, its model configuration, the training configuration) of the command line:
  the example's preset, the comparison's defaults (:data:`COMPARE_DEFAULTS`, the underflow
  scenario's replicas), then the flags given."""
  module = EXAMPLES[args.example]
  model_config, config = common.resolve_configs(args, module.PRESETS, platform)
  defaults = COMPARE_DEFAULTS.get(common.preset_name(args, platform), {})
  config = dataclasses.replace(
    config, **{k: v for k, v in defaults.items() if getattr(args, k) is None}
  )
  if args.replicas is None:
    config = dataclasses.replace(config, replicas=scenario_replicas(args.example, model_config))
  if args.example == "charlm":
    task = charlm.CharLMTask(model_config, seed=config.seed)
  else:
    task = digits.DigitsTask(model_config, seed=config.seed)
  return task, model_config, config


def train_recipes(task: Any, recipes: Sequence[common.Recipe], config: common.TrainConfig):
  """Trains every recipe: (results by name, the fp32 values of the split's parameters and of
  its references, the trained fp32 model's activation gradients or None)."""
  results: dict[str, common.RunResult] = {}
  masters: dict[str, Any] = {}
  act_grads = None
  for recipe in recipes:
    keep = recipe.name in ("fp32", *low_precision.SPLIT_REFERENCES, "bf16-split")
    result = common.train(task, recipe, config, keep_state=keep)
    if recipe.name in (*low_precision.SPLIT_REFERENCES, "bf16-split"):
      # A copy: the timing donates the final state.
      masters[recipe.name] = jax.device_get(result.state[0])
    if recipe.name == "fp32":
      # Activation gradients of the trained fp32 model (the true values) on a fresh batch.
      params, model_state = result.state
      batch = task.train_batch(config.steps)
      act_grads = common.activation_gradients(task, params, model_state, batch, config)
    result.state = None
    results[recipe.name] = result
    print(
      f"  {recipe.name:15s} val loss {result.final['val_loss']:.3f}  "
      f"skipped {len(result.skipped):3d}  training loop {result.step_time_ms:6.1f} ms/step "
      f"(10th percentile)  compile {result.compile_s:.1f} s",
      flush=True,
    )
  return results, masters, act_grads


def time_interleaved(
  results: dict[str, common.RunResult], rounds: int, per_round: int, show: bool
) -> None:
  """Sets each result's step time to the median of more steps timed with the recipes
  interleaved, round by round: the training loops ran one after the other, so a change in
  the load from other processes landed on some recipes only; here it lands on all alike."""
  timed: dict[str, list[float]] = {name: [] for name in results}
  for _ in common.progress(range(rounds), show, desc="timing"):
    for name, result in results.items():
      timed[name] += result.run_more(per_round)
  for name, result in results.items():
    result.step_time_ms = 1e3 * statistics.median(timed[name])
    result.step_time_spread.update(
      interleaved_median_ms=result.step_time_ms,
      interleaved_p10_ms=1e3 * float(np.percentile(timed[name], 10)),
      interleaved_p90_ms=1e3 * float(np.percentile(timed[name], 90)),
      interleaved_steps=len(timed[name]),
    )
    result.run_more = None  # frees the compiled step and its state


def activation_summary(
  act_grads: Any, results: dict[str, common.RunResult], steps: int
) -> dict[str, Any] | None:
  """The activation gradients' statistics in fp16, unscaled and at fp16-dynamic's final
  scale (JSON-ready), or None without an fp32 run."""
  if act_grads is None:
    return None
  dynamic = results.get("fp16-dynamic")
  scale = dynamic.loss_scale[-1] if dynamic else None

  # One compilation for both scales (run eagerly, every operation would compile on its own).
  statistics_at = jax.jit(
    lambda grads, loss_scale: jl.diagnostics.gradient_statistics(
      grads, loss_scale=loss_scale, format="float16", group_by="leaf"
    ),
    compiler_options=common.FAST_COMPILE,
  )

  def stats(loss_scale):
    found = statistics_at(act_grads, jnp.float32(loss_scale))
    return common.stats_to_python(jax.device_get(found))

  return {
    "step": steps,
    "what": "gradient of the training loss w.r.t. each module's output, fp32 run, final params",
    "stats": stats(1.0),
    "dynamic_scale": scale,
    "stats_at_dynamic_scale": stats(scale) if scale else None,
  }


def _versions() -> dict[str, str]:
  return {
    "python": platform_lib.python_version(),
    "jax": jax.__version__,
    "flax": flax.__version__,
    "optax": optax.__version__,
    "jmp_lite": jl.__version__,
  }


def write_outputs(args: argparse.Namespace, summary: dict[str, Any], tables: dict) -> list[str]:
  """The JSON (floats to 6 digits), the tables and the figures; returns their paths."""
  os.makedirs(args.out, exist_ok=True)
  written = [os.path.join(args.out, f"{args.example}_compare.json")]
  with open(written[0], "w") as f:
    json.dump(_rounded(summary), f, separators=(",", ":"))
  for name, table in tables.items():
    with open(os.path.join(args.out, name), "w") as f:
      f.write(table + "\n")
    if name.endswith("_low_precision.md"):
      written.append(os.path.join(args.out, name))
  if not args.no_plots:
    written += write_plots(args.example, summary, args.out)
  return written


if __name__ == "__main__":
  main()
