r"""The char-LM example trained under each fp8 recipe against bf16 (CPU, minutes per recipe).

``examples.charlm``'s model and data (the CPU preset's model: width 64, 2 blocks, 4 heads,
64-character windows, 32 per step), trained from the same seed on the same batches by
``examples.common.train`` under fp32, bf16 (the bf16 policy) and the ``fp8`` recipe (the bf16
policy with every Dense matmul in fp8 through ``linen_fp8``; with ``--keep-first-last`` the
first and last matmul layers, the first block's q/k/v and the head, stay in bf16 as DeepSeek-V3
keeps its head) once per fp8 recipe of :data:`FP8_RECIPES`. Reported per run: the final
validation loss, its relative difference from
bf16's, :math:`(L - L_{\text{bf16}}) / L_{\text{bf16}}` (DeepSeek-V3 reports under 0.25% for its
block recipe at scale), and the mean over the last 10% of steps of the training loss. fp32's
difference from bf16 is the yardstick: the size of a difference that is only rounding noise at
this scale.

Run from the repository root::

  python -m benchmarks.fp8_training --out docs/figures/fp8_training   # minutes a recipe, 2 cores
  python -m benchmarks.fp8_training --keep-first-last --out docs/figures/fp8_training_first_last
  python -m benchmarks.fp8_training --smoke --out /tmp/fp8_training    # seconds

Writes ``fp8_training.json`` and ``fp8_training.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax

import jmp_lite as jl
from examples import charlm, common
from jmp_lite import fp8

STEPS = 1000  # the CPU preset's own
# Named as benchmarks/gpu.py's recipes (whose "fp8" is delayed scaling).
FP8_RECIPES: dict[str, Any] = {
  "fp8_delayed": fp8.DelayedScaling(amax_history_length=16),  # calibrated on the first batch
  "fp8_current": fp8.CurrentScaling(),
  "fp8_rowwise": fp8.RowwiseScaling(),
  "fp8_rowwise_gw_hp": fp8.RowwiseScaling(weight_grad="compute_dtype"),  # weight grad in bf16
  "fp8_block": fp8.BlockScaling(),  # DeepSeek-V3's
  "fp8_mxfp8": fp8.Mxfp8Scaling(),  # emulated
}


# Every matmul layer in fp8 but the first and the last, whatever its shape.
FIRST_LAST_IN_BF16 = fp8.Fp8Placement(keep_first_last=True, shape_rule=None)


def runs(
  steps: int, smoke: bool, keep_first_last: bool = False
) -> tuple[dict[str, tuple[Any, Any]], Any]:
  """The runs by name, each (the example's recipe, its training configuration), and the model
  configuration."""
  model, train = charlm.PRESETS["quick" if smoke else "cpu"]
  base = dataclasses.replace(train, steps=steps, eval_every=steps, stats_every=steps)
  base = dataclasses.replace(base, progress=False)
  out = {
    "fp32": (common.RECIPES["fp32"], base),
    "bf16": (common.RECIPES["bf16"], base),
  }
  for name, recipe in FP8_RECIPES.items():
    placement = FIRST_LAST_IN_BF16 if keep_first_last else None  # None: every Dense
    config = dataclasses.replace(base, fp8_recipe=recipe, fp8_placement=placement)
    out[name] = (common.RECIPES["fp8"], config)
  return out, model


def markdown(result: dict[str, Any]) -> str:
  lines = [
    "# char-LM: fp8 recipes against bf16",
    "",
    f"`{result['command']}`; jax {result['jax']}, jmp_lite {result['jmp_lite']}; "
    f"model {result['model']}, {result['steps']} steps; fp8 layers: {result['fp8_layers']}. "
    "Relative difference: "
    "(val loss - bf16's) / bf16's.",
    "",
    "| run | val loss | vs bf16 | train loss (last 10%) | ms/step | skipped steps |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for name, row in result["runs"].items():
    lines.append(
      f"| {name} | {row['val_loss']:.4f} | {100 * row['vs_bf16']:+.2f}% | "
      f"{row['train_loss']:.4f} | {row['step_ms']:.1f} | {row['skipped']} |"
    )
  return "\n".join(lines) + "\n"


def run(
  steps: int,
  smoke: bool,
  out: pathlib.Path,
  command: str,
  only: Sequence[str] | None = None,
  keep_first_last: bool = False,
) -> dict[str, Any]:
  """Trains every run (or those named in ``only``) in turn; writes the report after each."""
  plan, model = runs(steps, smoke, keep_first_last)
  if only is not None:
    unknown = sorted(set(only) - set(plan))
    if unknown:
      raise SystemExit(f"Unknown runs {unknown}; accepted: {', '.join(plan)}.")
    plan = {name: plan[name] for name in plan if name in only}
  task = charlm.CharLMTask(model, seed=0)
  result: dict[str, Any] = {
    "command": command,
    "jax": jax.__version__,
    "jmp_lite": jl.__version__,
    "model": dataclasses.asdict(model),
    "steps": steps,
    "fp8_layers": "all but the first and last" if keep_first_last else "all",
    "runs": {},
  }
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  for name, (recipe, config) in plan.items():
    trained = common.train(task, recipe, config)
    result["runs"][name] = {
      "val_loss": trained.final["val_loss"],
      "train_loss": trained.final["train_loss"],
      "step_ms": trained.step_time_ms,
      "compile_s": trained.compile_s,
      "skipped": len(trained.skipped),
    }
    bf16 = result["runs"].get("bf16")
    for row in result["runs"].values():
      row["vs_bf16"] = (row["val_loss"] - bf16["val_loss"]) / bf16["val_loss"] if bf16 else 0.0
    print(f"[{time.perf_counter() - start:6.1f} s] {name}: {trained.final['val_loss']:.4f}")
    (out / "fp8_training.json").write_text(json.dumps(result, indent=1))
    (out / "fp8_training.md").write_text(markdown(result))
  return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=None, help=f"steps per run ({STEPS})")
  parser.add_argument("--smoke", action="store_true", help="the quick preset's model, 4 steps")
  parser.add_argument("--out", default="out/fp8_training", help="where the report goes")
  parser.add_argument("--runs", help="comma-separated run names (default: all)")
  parser.add_argument(
    "--keep-first-last", action="store_true", help="the first and last matmul layers in bf16"
  )
  args = parser.parse_args(argv)
  steps = args.steps or (4 if args.smoke else STEPS)
  words = argv if argv is not None else sys.argv[1:]
  command = "python -m benchmarks.fp8_training " + " ".join(words)
  only = [r.strip() for r in args.runs.split(",")] if args.runs else None
  result = run(steps, args.smoke, pathlib.Path(args.out), command, only, args.keep_first_last)
  print(markdown(result))
  return result


if __name__ == "__main__":
  main()
