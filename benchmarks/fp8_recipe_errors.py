r"""Per-recipe fp8 matmul error on matrices said to break per-tensor scaling (CPU, minutes).

For each distribution, contraction length K and recipe of ``jmp_lite.fp8``, one
``[M, K] x [K, N]`` matmul :math:`y = x w` and its two gradients :math:`\partial x = g w^\top`,
:math:`\partial w = x^\top g` are computed from bf16 operands (what the ops receive under a
bf16 policy) and compared with the float64 products of the same fp32 data ("fp32": an fp32
matmul's own error, about :math:`10^{-6}` here, is far below every figure) and with the bf16
matmul's result (bf16 operands, fp32 sums, a bf16 result). The error is the relative Frobenius
norm :math:`\lVert \hat{y} - y \rVert / \lVert y \rVert`; ``row_median`` in the JSON is the
median over rows of the same ratio per row, which shows rows flushed by a coarse scale that the
Frobenius norm, dominated by the largest rows, hides.

Distributions (:func:`data`), each with :math:`w \sim N(0, 1/K)`:

* ``outliers``: :math:`x \sim N(0, 1)` with :func:`outlier_channels` channels (columns) 100x the
  median channel; :math:`g \sim N(0, 1)\, 2^{-10}`.
* ``student_t``: heavy-tailed activations, :math:`x \sim t_3` (Student-t, 3 degrees of freedom);
  :math:`g \sim N(0, 1)\, 2^{-10}`.
* ``wide_gradients``: :math:`x \sim N(0, 1)`; each row (token) of :math:`g` is
  :math:`N(0, 1)\, 2^{u}` with :math:`u \sim U(-20, 4)`, so the gradient spans
  :math:`2^{-20} .. 2^{4}`.

Recipes: :data:`RECIPES` (the library's), and three **models of Hopper's fp8 accumulator**
(:func:`accumulator_model`), forward only. XLA:CPU computes an fp8 dot by converting the
operands and summing in fp32, so the ~14-bit accumulator of Hopper's fp8 tensor cores (DeepSeek-V3,
section 3.3.2) is invisible in the library's rows; the models sum each group of 32 products (one
WGMMA k-step) exactly and add it to an accumulator kept at 14 significant bits, truncated toward
zero, either over all of K ("no promotion") or over each 128-element chunk, whose sum is then
scaled and added in fp32 ("promoted every 128", as ``fp8.BlockScaling`` expresses it with one
fp8 dot per chunk); ``vs_fp32_sums`` in the JSON is a model's error against fp32 sums of the
same fp8 products, the accumulator's own. The gradients of those rows are not modelled: their
contractions here are over N and M, one 128-element chunk each.

Run from the repository root::

  python -m benchmarks.fp8_recipe_errors --out docs/figures/fp8_numerics   # ~3 minutes, 2 cores
  python -m benchmarks.fp8_recipe_errors --smoke --out /tmp/fp8_numerics  # seconds

Writes ``fp8_numerics.json`` and ``fp8_numerics.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite as jl
from jmp_lite import fp8

MATMUL = (((1,), (0,)), ((), ()))
BF16 = jnp.bfloat16
E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
TILE = 128  # block scaling's tile, and the chunk its sums are promoted after
WGMMA_K = 32  # products summed per fp8 tensor-core step (Hopper's WGMMA k for 8-bit types)
ACCUMULATOR_BITS = 14  # DeepSeek-V3: "limited to retaining around 14 bits"

KS = (128, 1024, 4096, 16384)
M = N = 128
DISTRIBUTIONS = ("outliers", "student_t", "wide_gradients")
RECIPES: dict[str, Any] = {
  "bf16": None,
  "current": fp8.CurrentScaling(),
  "current_power_of_2": fp8.CurrentScaling(power_of_2=True),
  "delayed (another batch's scales)": fp8.DelayedScaling(amax_history_length=1),
  "rowwise": fp8.RowwiseScaling(),
  "rowwise, weight grad in bf16": fp8.RowwiseScaling(weight_grad="compute_dtype"),
  "block (DeepSeek-V3)": fp8.BlockScaling(),
  "mxfp8 (emulated)": fp8.Mxfp8Scaling(),
}
# (name, per-tensor or 1 x 128 / 128 x 128 block scales, promote every 128 of K?)
MODELS = (
  ("current, 14-bit accumulator (model)", "tensor", False),
  ("block, 14-bit accumulator, promoted every 128 (model)", "block", True),
  ("block, 14-bit accumulator, no promotion (model)", "block", False),
)


def outlier_channels(k: int) -> int:
  """How many of the K channels are outliers: 1 in 256, at least 2."""
  return max(2, k // 256)


def data(distribution: str, m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
  """``(x [m, k], w [k, n], g [m, n])`` in float32, drawn for ``distribution``."""
  rng = np.random.default_rng([seed, k, DISTRIBUTIONS.index(distribution)])
  w = rng.standard_normal((k, n)) / np.sqrt(k)
  g = rng.standard_normal((m, n)) * 2.0**-10
  if distribution == "outliers":
    x = rng.standard_normal((m, k))
    x[:, rng.choice(k, outlier_channels(k), replace=False)] *= 100.0
  elif distribution == "student_t":
    x = rng.standard_t(3, (m, k))
  elif distribution == "wide_gradients":
    x = rng.standard_normal((m, k))
    g = rng.standard_normal((m, n)) * 2.0 ** rng.uniform(-20, 4, (m, 1))
  else:
    raise ValueError(f"Unknown distribution {distribution!r}; accepted: {DISTRIBUTIONS}.")
  return tuple(np.float32(v) for v in (x, w, g))


def _bf16_matmul(x, w):
  out = jax.lax.dot_general(x, w, MATMUL, preferred_element_type=jnp.float32)
  return out.astype(BF16)


@functools.cache
def _products(name: str) -> Callable:
  """jit of ``(x, w, g[, state]) -> (y, dx, dw)`` for the recipe ``name``, bf16 operands."""
  recipe = RECIPES[name]

  def run(x, w, g, state):
    x, w, g = x.astype(BF16), w.astype(BF16), g.astype(BF16)
    if recipe is None:
      matmul = _bf16_matmul
    else:
      matmul = lambda x, w: fp8.dot_general(x, w, MATMUL, state, config=recipe)
    y, vjp = jax.vjp(matmul, x, w)
    return (y, *vjp(g))

  return jax.jit(run)


@functools.cache
def _delayed_state(k: int) -> Callable:
  """jit of ``(x, w, g) -> state``: delayed scaling's state calibrated on that batch."""
  recipe = RECIPES["delayed (another batch's scales)"]

  def calibrated(x, w, g):
    x, w, g = x.astype(BF16), w.astype(BF16), g.astype(BF16)
    state = recipe.init_state()

    def loss(amax):
      y = fp8.dot_general(x, w, MATMUL, state, amax, config=recipe)
      return jnp.sum(y.astype(jnp.float32) * g.astype(jnp.float32))

    return fp8.calibrate(loss, state, recipe)

  return jax.jit(calibrated)


def truncate(x: jax.Array, bits: int) -> jax.Array:
  """``x`` with ``bits`` significant bits, truncated toward zero (the accumulator's rounding)."""
  mantissa, exponent = jnp.frexp(x)  # x = mantissa * 2**exponent, |mantissa| in [0.5, 1)
  return jnp.ldexp(jnp.trunc(mantissa * 2.0**bits) / 2.0**bits, exponent)


def _scales(x: jax.Array, rows: int, per_tensor: bool) -> jax.Array:
  """fp32 scales of ``[R, K]`` (R, K multiples of the tile): per ``rows x 128`` tile, or one
  per tensor, broadcast to ``[R, K / 128]``; an all-zero tile gets 1."""
  r, k = x.shape
  if per_tensor:
    amax = jnp.max(jnp.abs(x))[None, None]
  else:
    amax = jnp.max(jnp.abs(x).reshape(r // rows, rows, k // TILE, TILE), axis=(1, 3))
    amax = jnp.repeat(amax, rows, axis=0)
  scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
  return jnp.broadcast_to(scale, (r, k // TILE))


@functools.partial(jax.jit, static_argnames=("per_tensor", "promote", "bits"))
def accumulator_model(
  x, w, *, per_tensor: bool, promote: bool, bits: int | None = ACCUMULATOR_BITS
) -> jax.Array:
  r"""``x [M, K] @ w [K, N]`` in E4M3 with a model of a limited-precision fp8 accumulator.

  Each operand is quantized per tensor or in DeepSeek-V3's tiles (1 x 128 for ``x``, 128 x 128
  for ``w``), with fp32 scales :math:`\text{amax} / 448`. Each group of 32 products is summed
  exactly and added to an accumulator :func:`truncate`-d to ``bits`` significant bits (``None``:
  fp32) after every add. ``promote``: the accumulator holds one 128-element chunk of K, whose
  sum is then multiplied by the chunk's scales and added in fp32; otherwise it runs over all of
  K on scaled values. M, N and K must be multiples of 128.

  Returns:
    The float32 product.
  """
  x, w = x.astype(BF16).astype(jnp.float32), w.astype(BF16).astype(jnp.float32)
  wt = w.T  # [N, K]: both operands with the contraction last
  s_x, s_w = _scales(x, 1, per_tensor), _scales(wt, TILE, per_tensor)
  q_x = (x / jnp.repeat(s_x, TILE, axis=1)).astype(E4M3).astype(jnp.float32)
  q_w = (wt / jnp.repeat(s_w, TILE, axis=1)).astype(E4M3).astype(jnp.float32)
  (m, k), n = x.shape, wt.shape[0]
  groups = k // WGMMA_K
  # [G, M, N]: each group's 32 products, summed exactly (fp8 products are exact in fp32).
  partial = jnp.einsum(
    "mgk,ngk->gmn",
    q_x.reshape(m, groups, WGMMA_K),
    q_w.reshape(n, groups, WGMMA_K),
    precision=jax.lax.Precision.HIGHEST,
  )
  per_chunk = TILE // WGMMA_K
  chunk_scale = lambda g: s_x[:, g // per_chunk, None] * s_w[None, :, g // per_chunk]
  keep = (lambda v: v) if bits is None else (lambda v: truncate(v, bits))

  def add(carry, group):
    acc, out = carry
    g, p = group
    if not promote:
      return (keep(acc + p * chunk_scale(g)), out), None
    acc = keep(acc + p)
    last = (g + 1) % per_chunk == 0  # the chunk's sum leaves the accumulator, scaled, in fp32
    out = jnp.where(last, out + acc * chunk_scale(g), out)
    return (jnp.where(last, 0.0, acc), out), None

  zero = jnp.zeros((m, n), jnp.float32)
  (acc, out), _ = jax.lax.scan(add, (zero, zero), (jnp.arange(groups), partial))
  return acc if not promote else out


def relative_errors(got: np.ndarray, want: np.ndarray) -> dict[str, float]:
  """Relative Frobenius error and the median over rows of the per-row relative error."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  rows = np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-300)
  return {
    "frobenius": float(np.linalg.norm(got - want) / np.linalg.norm(want)),
    "row_median": float(np.median(rows)),
  }


PRODUCTS = ("y", "dx", "dw")


def measure(distribution: str, k: int, m: int = M, n: int = N, seed: int = 0) -> dict[str, Any]:
  """Errors of every recipe and model on one ``(distribution, K)`` case: ``{recipe: {product:
  {"vs_fp32": ..., "vs_bf16": ...}}}``."""
  x, w, g = data(distribution, m, k, n, seed)
  x64, w64, g64 = (v.astype(np.float64) for v in (x, w, g))
  exact = dict(zip(PRODUCTS, (x64 @ w64, g64 @ w64.T, x64.T @ g64), strict=True))
  bf16 = dict(zip(PRODUCTS, _products("bf16")(x, w, g, None), strict=True))
  other_batch = data(distribution, m, k, n, seed + 1)
  rows: dict[str, Any] = {}

  def record(name, products):
    rows[name] = {
      p: {
        "vs_fp32": relative_errors(v, exact[p]),
        "vs_bf16": relative_errors(v, np.asarray(bf16[p], np.float64)),
      }
      for p, v in products.items()
    }

  for name, recipe in RECIPES.items():
    state = None
    if isinstance(recipe, fp8.DelayedScaling):
      state = _delayed_state(k)(*other_batch)
    record(name, dict(zip(PRODUCTS, _products(name)(x, w, g, state), strict=True)))
  for name, scales, promote in MODELS:
    per_tensor = scales == "tensor"
    y = accumulator_model(x, w, per_tensor=per_tensor, promote=promote)
    record(name, {"y": y})
    # The accumulator's own error: against fp32 sums of the same fp8 products.
    exact_sums = accumulator_model(x, w, per_tensor=per_tensor, promote=True, bits=None)
    rows[name]["y"]["vs_fp32_sums"] = relative_errors(y, exact_sums)
  return rows


def cell(row: dict[str, Any], reference: str) -> str:
  return " / ".join(f"{row[p][reference]['frobenius']:.4f}" if p in row else "-" for p in PRODUCTS)


def markdown(result: dict[str, Any]) -> str:
  """One table per distribution: ``y / dx / dw`` errors against fp32 for each K; then the same
  against the bf16 result at the largest K."""
  ks = result["ks"]
  lines = [
    "# fp8 matmul error by recipe",
    "",
    f"`{result['command']}`; jax {result['jax']}, jmp_lite {result['jmp_lite']}, "
    f"M = N = {result['m']}. Each cell: relative Frobenius error of y / dx / dw.",
  ]
  for dist in result["distributions"]:
    cases = result["errors"][dist]
    lines += ["", f"## {dist}, against fp32", ""]
    lines += ["| recipe | " + " | ".join(f"K={k}" for k in ks) + " |"]
    lines += ["|---|" + "---|" * len(ks)]
    for name in cases[str(ks[0])]:
      lines.append(
        f"| {name} | " + " | ".join(cell(cases[str(k)][name], "vs_fp32") for k in ks) + " |"
      )
  lines += ["", "## The 14-bit accumulator's own error (model)", ""]
  lines += [
    "Relative Frobenius error of y against fp32 sums of the same fp8 products, "
    + ", ".join(result["distributions"])
    + ".",
    "",
    "| model | " + " | ".join(f"K={k}" for k in ks) + " |",
    "|---|" + "---|" * len(ks),
  ]
  for name, _, _ in MODELS:
    cells = [
      " / ".join(
        f"{result['errors'][d][str(k)][name]['y']['vs_fp32_sums']['frobenius']:.4f}"
        for d in result["distributions"]
      )
      for k in ks
    ]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  k = ks[-1]
  lines += ["", f"## Against the bf16 result, K={k}", ""]
  lines += ["| recipe | " + " | ".join(result["distributions"]) + " |"]
  lines += ["|---|" + "---|" * len(result["distributions"])]
  for name in result["errors"][result["distributions"][0]][str(k)]:
    if name == "bf16":
      continue
    cells = [cell(result["errors"][d][str(k)][name], "vs_bf16") for d in result["distributions"]]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def run(ks: Sequence[int], m: int, n: int, out: pathlib.Path, command: str) -> dict[str, Any]:
  """Measures every case and writes ``fp8_numerics.json``/``.md`` to ``out``."""
  result: dict[str, Any] = {
    "command": command,
    "jax": jax.__version__,
    "jmp_lite": jl.__version__,
    "m": m,
    "n": n,
    "ks": list(ks),
    "distributions": list(DISTRIBUTIONS),
    "errors": {},
  }
  start = time.perf_counter()
  for dist in DISTRIBUTIONS:
    for k in ks:
      result["errors"].setdefault(dist, {})[str(k)] = measure(dist, k, m, n)
      print(f"[{time.perf_counter() - start:6.1f} s] {dist} K={k}", flush=True)
  out.mkdir(parents=True, exist_ok=True)
  (out / "fp8_numerics.json").write_text(json.dumps(result, indent=1))
  (out / "fp8_numerics.md").write_text(markdown(result))
  return result


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="K in {128, 512}, M = N = 128")
  parser.add_argument("--out", default="out/fp8_numerics", help="where the report goes")
  args = parser.parse_args(argv)
  ks = (128, 512) if args.smoke else KS
  words = argv if argv is not None else sys.argv[1:]
  command = "python -m benchmarks.fp8_recipe_errors " + " ".join(words)
  result = run(ks, M, N, pathlib.Path(args.out), command)
  print(markdown(result))
  return result


if __name__ == "__main__":
  main()
