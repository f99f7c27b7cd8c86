r"""Per-recipe fp8 matmul error on a matrix that breaks per-tensor scaling (CPU, seconds).

One ``[256, 1024] x [1024, 256]`` matmul and its two gradients, for each recipe of
``jmp_lite.fp8`` and for bf16, against float64: relative error in the Frobenius norm,
:math:`\lVert \hat{y} - y \rVert / \lVert y \rVert`. The input has 8 outlier channels 100x the
others and rows whose ranges span :math:`e^{\pm 4}`; the output gradient's rows span
:math:`2^{-16} e^{-10} .. 2^{-16}`. ``python -m benchmarks.fp8_recipe_errors``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import fp8

MATMUL = (((1,), (0,)), ((), ()))
RECIPES = {
  "bf16": None,
  "current": fp8.CurrentScaling(),
  "current_power_of_2": fp8.CurrentScaling(power_of_2=True),
  "delayed (fresh state)": fp8.DelayedScaling(amax_history_length=4),
  "rowwise": fp8.RowwiseScaling(),
  "rowwise, weight grad in compute dtype": fp8.RowwiseScaling(weight_grad="compute_dtype"),
  "block (DeepSeek-V3)": fp8.BlockScaling(),
  "mxfp8 (emulated)": fp8.Mxfp8Scaling(),
}


def data(m: int = 256, k: int = 1024, n: int = 256, seed: int = 0):
  """x with outlier channels and rows of different ranges, w, and a wide-range gradient."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k))
  x[:, rng.choice(k, 8, replace=False)] *= 100
  x *= np.exp(rng.uniform(-4, 4, (m, 1)))
  w = rng.standard_normal((k, n)) / k**0.5
  g = rng.standard_normal((m, n)) * np.exp(rng.uniform(-10, 0, (m, 1))) * 2.0**-16
  return tuple(np.float32(v) for v in (x, w, g))


def errors(recipe, x, w, g) -> tuple[float, float, float]:
  """Relative errors of (y, dx, dw) against float64."""
  if recipe is None:
    bf16 = jnp.bfloat16
    matmul = lambda x, w: (x.astype(bf16) @ w.astype(bf16)).astype(jnp.float32)
  else:
    state = recipe.init_state()
    matmul = lambda x, w: fp8.dot_general(x, w, MATMUL, state, config=recipe)

  @jax.jit
  def run(x, w, g):
    y, vjp = jax.vjp(matmul, x, w)
    return y, *vjp(g)

  x64, w64, g64 = (v.astype(np.float64) for v in (x, w, g))
  exact = (x64 @ w64, g64 @ w64.T, x64.T @ g64)
  got = (np.asarray(v, np.float64) for v in run(x, w, g))
  return tuple(
    float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(got, exact, strict=True)
  )


def main() -> None:
  """Prints the table (markdown)."""
  x, w, g = data()
  print("| recipe | output | input gradient | weight gradient |")
  print("|---|---|---|---|")
  for name, recipe in RECIPES.items():
    print(f"| {name} | " + " | ".join(f"{e:.4f}" for e in errors(recipe, x, w, g)) + " |")


if __name__ == "__main__":
  main()
