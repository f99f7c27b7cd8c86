"""The opt-in recipe group ``low-precision-params`` of ``examples.compare``: its report.

Every recipe of the group (:data:`examples.common.LOW_PRECISION_RECIPES`) stores the
parameters in bf16 without an fp32 master copy, through :func:`jmp_lite.low_precision_params`,
except the two fp32 references. The report is one row per recipe (validation loss and
accuracy against ``fp32-master``, bytes per parameter, the share of bf16 parameter elements
whose update rounded away over the first, middle and last tenth of the steps) and how far
``bf16-split``'s fp32 values are from its references' (bit for bit equal to
``fp32-master-view``'s if the split loses no update). docs/examples.md shows a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from examples import charlm, common


def _tenths(values: Sequence[float]) -> dict[str, float]:
  """Means of ``values`` over their first, middle and last tenth."""
  n = len(values)
  k = max(1, n // 10)
  mid = max(0, (n - k) // 2)
  return {
    "start": float(np.mean(values[:k])),
    "middle": float(np.mean(values[mid : mid + k])),
    "end": float(np.mean(values[-k:])),
  }


def rounded_away_share(r: dict[str, Any]) -> list[float] | None:
  """Per step, the share of the 16-bit parameter elements whose update rounded away."""
  if r.get("rounded_away") is None:
    return None
  return [n / r["low_precision_size"] for n in r["rounded_away"]]


def low_precision_rows(example: str, results: dict[str, Any]) -> list[dict[str, Any]]:
  """One row per recipe of the low-precision-params group in ``results`` (JSON-ready dicts),
  relative to fp32-master's when it ran."""
  group = common.RECIPE_GROUPS["low-precision-params"]
  base = results.get("fp32-master")
  rows = []
  for name, r in results.items():
    if name not in group:
      continue
    recipe = common.get_recipe(name)
    f = r["final"]
    sizes = r["state_bytes"]
    row: dict[str, Any] = {
      "recipe": name,
      "method": recipe.params_method or ("bf16 view" if recipe.high_half_view else "fp32 master"),
      "param_dtype": "bfloat16" if recipe.params_method else "float32",
      "moment_dtype": recipe.moment_dtype,
      "val_loss": f["val_loss"],
      "val_accuracy": f["val_accuracy"],
      "bytes_per_param": (sizes["params"] + sizes["opt_state"]) / sizes["param_elements"],
    }
    if example == "charlm":
      row["val_bpc"] = charlm.bits_per_char(f["val_loss"])
    if base is not None:
      ref = base["final"]
      row["val_loss_rel"] = f["val_loss"] / ref["val_loss"] - 1
      row["val_accuracy_diff"] = f["val_accuracy"] - ref["val_accuracy"]
      ref_sizes = base["state_bytes"]
      row["bytes_vs_fp32_master"] = (sizes["params"] + sizes["opt_state"]) / (
        ref_sizes["params"] + ref_sizes["opt_state"]
      )
    share = rounded_away_share(r)
    row["rounded_away"] = _tenths(share) if share else None
    rows.append(row)
  return rows


def format_low_precision_table(example: str, rows: list[dict[str, Any]]) -> str:
  """The low-precision-params rows as a Markdown table; the columns relative to fp32-master
  only when it ran, the rounded-away shares only when a bf16-parameter recipe ran."""
  base = any("val_loss_rel" in row for row in rows)
  short = {"float32": "fp32", "bfloat16": "bf16"}

  def pct(x, points=False):
    return "-" if x is None else f"{100 * x:+.2f}{' pts' if points else '%'}"

  def away(row):
    shares = row["rounded_away"]
    if not shares:
      return "-"
    return " / ".join(f"{100 * shares[k]:.1f}%" for k in ("start", "middle", "end"))

  def params(row):
    method = f" ({row['method']})" if row["method"] != "fp32 master" else ""
    return short[row["param_dtype"]] + method

  columns: list[tuple[str, Any]] = [
    ("recipe", lambda row: row["recipe"]),
    ("params", params),
    ("moments", lambda row: short[row["moment_dtype"]]),
    ("val loss", lambda row: f"{row['val_loss']:.4f}"),
  ]
  if base:
    columns.append(("val loss vs fp32-master", lambda row: pct(row.get("val_loss_rel"))))
  if example == "charlm":
    columns.append(("val bpc", lambda row: f"{row['val_bpc']:.4f}"))
  columns.append(("val acc", lambda row: f"{row['val_accuracy']:.4f}"))
  if base:
    columns.append(
      ("val acc vs fp32-master", lambda row: pct(row.get("val_accuracy_diff"), points=True))
    )
  if any(row["rounded_away"] for row in rows):
    columns.append(("rounded away: start / middle / end", away))
  columns.append(("bytes/param", lambda row: f"{row['bytes_per_param']:.2f}"))
  if base:
    columns.append(
      (
        "bytes x fp32-master",
        lambda row: f"{row['bytes_vs_fp32_master']:.2f}" if "bytes_vs_fp32_master" in row else "-",
      )
    )
  return common.markdown_table(columns, rows)


SPLIT_REFERENCES = ("fp32-master", "fp32-master-view")
"""fp32-master runs whose final fp32 parameters bf16-split's (jl.master_params) are compared
to: bit for bit equal to fp32-master-view's if the split loses no update."""


def compare_masters(reference: Any, other: Any) -> dict[str, float]:
  """How far the fp32 values of two parameter trees are apart: the share of elements equal
  bit for bit, the largest and the root-mean-square difference relative to the reference's
  root mean square (per leaf, then over all elements)."""
  pairs = [
    (np.asarray(a, np.float32), np.asarray(b, np.float32))
    for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(other), strict=True)
  ]
  n = sum(a.size for a, _ in pairs)
  equal = sum(int(np.sum(a.view(np.int32) == b.view(np.int32))) for a, b in pairs)
  rel = [np.abs(a - b) / max(float(np.sqrt(np.mean(a**2))), 1e-30) for a, b in pairs]
  return {
    "elements": n,
    "bit_equal_share": equal / n,
    "max_rel_diff": float(max(float(np.max(x)) for x in rel)),
    "rms_rel_diff": float(np.sqrt(sum(float(np.sum(x**2)) for x in rel) / n)),
  }


def report(
  example: str, results: dict[str, common.RunResult], masters: dict[str, Any]
) -> dict[str, Any]:
  """The low-precision-params group's rows, how far bf16-split's fp32 values are from its
  references' (:data:`SPLIT_REFERENCES`), and its table (``"markdown"``); printed."""
  as_dicts = {n: r.as_dict() for n, r in results.items()}
  summary: dict[str, Any] = {"table": low_precision_rows(example, as_dicts)}
  summary["markdown"] = format_low_precision_table(example, summary["table"])
  print(f"\n{summary['markdown']}")
  for name in SPLIT_REFERENCES:
    if name not in masters or "bf16-split" not in masters:
      continue
    d = summary[f"split_vs_{name}"] = compare_masters(masters[name], masters["bf16-split"])
    print(
      f"bf16-split's fp32 parameters against {name}'s: {100 * d['bit_equal_share']:.2f}% of "
      f"{d['elements']:,} bit for bit equal, difference {d['rms_rel_diff']:.2e} rms, "
      f"{d['max_rel_diff']:.2e} at most (relative to each tensor's rms)"
    )
  return summary
