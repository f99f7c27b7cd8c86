"""benchmarks/gpu.py's report: ``gpu.md``, rendered from the result that ``gpu.json`` holds.

:func:`markdown` writes the environment, then one part per section that ran: the matmul probe,
the recipes table with its loss curves, the fp8 check, and fp8 against bf16 by width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from benchmarks._gpu_recipes import CURVES, LEARNING_RATE, SIZE_RECIPES

NA = "-"  # a figure not measured


def fmt(x: Any, spec: str) -> str:
  """``format(x, spec)``, or :data:`NA` for a figure not measured (``None`` or NaN)."""
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
  at = lambda c, i: fmt(c[i] if i < len(c) else None, ".4f")
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
      fmt(e.get("ones_error_eps"), ".3f"),
      fmt(e.get("random_error_eps"), ".3f"),
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
    fmt(row["ms"], ".2f"),
    fmt(row.get("x_fp32_highest"), ".2f"),
    fmt(row.get("x_flax_bf16"), ".3f"),
    fmt(row["temp_mib"], ".0f"),
    *(str(g[k]) for k in ("cublas", "cublaslt", "cublaslt_fp8", "triton_gemm", "cudnn")),
    str(row["control_flow"]["conditionals"]),
    fmt(row["final_loss"], ".3f"),
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
  cost = fmt(section.get("loss_scaling_cost"), ".3f")
  lines += ["", f"Loss scaling cost (policy fp16 + `loss_scaling`, over policy fp16): {cost}."]
  if "cond_skip_cost" in section:
    cond = fmt(section["cond_skip_cost"], ".3f")
    lines += ["", f"The same with a `lax.cond` skip (candidate), over policy fp16: {cond}."]
  curves = loss_curves(section["rows"], CURVES)
  if curves:
    lines += ["", "Loss curves (the loss each step computed, warm-up included):", "", curves]
  return lines


def _size_cells(row: dict[str, Any]) -> list[str]:
  c = row["config"]
  bf16, f8, fast = (row["recipes"].get(n, {}) for n in SIZE_RECIPES)
  ms = lambda r: fmt(r["ms"], ".2f") if "ms" in r else _status(r)
  return [
    str(c["width"]),
    str(c["layers"]),
    str(c["heads"]),
    ms(bf16),
    ms(f8),
    ms(fast),
    fmt(row.get("fp8_over_bf16"), ".3f"),
    fmt(row.get("fp8_fast_over_bf16"), ".3f"),
    fmt(bf16.get("temp_mib"), ".0f"),
    fmt(f8.get("temp_mib"), ".0f"),
    str(f8.get("gemms", {}).get("cublaslt_fp8", NA)),
    fmt(bf16.get("final_loss"), ".3f"),
    fmt(f8.get("final_loss"), ".3f"),
    fmt(fast.get("final_loss"), ".3f"),
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


RENDERERS: dict[str, Callable[[dict], list[str]]] = {
  "probe": _md_probe,
  "recipes": _md_recipes,
  "sizes": _md_sizes,
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
