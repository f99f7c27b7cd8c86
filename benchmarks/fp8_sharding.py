r"""What each fp8 recipe sends between devices under FSDP on explicit mesh axes (CPU, seconds).

One layer :math:`y = x w` and its two gradients, jitted (compiled, never run) on 8 host devices
with explicit mesh axes in FSDP's layout: the tokens of ``x`` ``[T, D]`` and the input axis of
the kernel ``w`` ``[D, F]`` sharded over the one mesh axis. Both operands arrive in bf16 (what
the layer receives under a bf16 policy). The baseline, ``bf16``, gathers the kernel
(``jax.sharding.reshard``) and runs JAX's bf16 matmul, as a Flax ``dtype=bfloat16`` layer under
FSDP does; each recipe runs ``jmp_lite.fp8.dot_general`` on the same operands.

Per recipe: the result bytes of every collective in the HLO right after SPMD partitioning, by
kind and dtype (later XLA:CPU passes widen bf16 collectives to f32, so the compiled module would
not show what a GPU sends), a collective in a loop body once per iteration (the block recipe
sums its weight gradient per row tile of 1024), and XLA:CPU's per-device temp memory of the
compiled step (a CPU figure: the GPU's differs, the ratios are indicative).

Run from the repository root::

  python -m benchmarks.fp8_sharding --out docs/figures/fp8_sharding   # ~1 minute, 2 cores
  python -m benchmarks.fp8_sharding --smoke --out /tmp/fp8_sharding  # seconds

Writes ``fp8_sharding.json`` and ``fp8_sharding.md`` to ``--out``. The compiles run in a
subprocess, which needs its own ``XLA_FLAGS`` (8 host devices, an HLO dump).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks import _hlo
from jmp_lite import fp8

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEVICES = 8
AXIS = "fsdp"
# The LM of benchmarks/gpu.py at d=1024: its MLP's up-projection, 8 x 1024 tokens.
SHAPE = {"tokens": 8192, "d": 1024, "f": 4096}
SMOKE_SHAPE = {"tokens": 1024, "d": 128, "f": 2048}  # two row tiles of the block recipe
RECIPES: dict[str, Any] = {
  "bf16": None,
  "current": fp8.CurrentScaling(),
  "delayed": fp8.DelayedScaling(),
  "rowwise": fp8.RowwiseScaling(),
  "rowwise_gw_hp": fp8.RowwiseScaling(weight_grad="compute_dtype"),
  "block": fp8.BlockScaling(),
  "mxfp8": fp8.Mxfp8Scaling(),
}
SMOKE_RECIPES = ("bf16", "current", "block")
_MATMUL = (((1,), (0,)), ((), ()))


def _loss(name: str, mesh: Any) -> Any:
  recipe = RECIPES[name]

  def loss(x, w, g):
    if recipe is None:
      gathered = jax.sharding.reshard(w, jax.sharding.NamedSharding(mesh, jax.P(None, None)))
      y = jnp.dot(x, gathered)
    else:
      y = fp8.dot_general(x, w, _MATMUL, recipe.init_state(), config=recipe)
    return jnp.sum(y.astype(jnp.float32) * g)

  return loss


def _compile_all(shape: dict[str, int], names: Sequence[str]) -> dict[str, float]:
  """Compiles each recipe's gradient (in the subprocess); returns the temp MiB per device."""
  mesh = jax.make_mesh((DEVICES,), (AXIS,), axis_types=(jax.sharding.AxisType.Explicit,))
  sharded = jax.sharding.NamedSharding(mesh, jax.P(AXIS, None))
  t, d, f = shape["tokens"], shape["d"], shape["f"]
  x = jax.ShapeDtypeStruct((t, d), jnp.bfloat16, sharding=sharded)
  w = jax.ShapeDtypeStruct((d, f), jnp.bfloat16, sharding=sharded)
  g = jax.ShapeDtypeStruct((t, f), jnp.float32, sharding=sharded)
  temp = {}
  for name in names:
    grad = jax.grad(_loss(name, mesh), argnums=(0, 1))
    grad.__name__ = f"fp8_sharding_{name}"  # names the HLO module, hence its dump files
    with jax.set_mesh(mesh):
      compiled = jax.jit(grad).lower(x, w, g).compile()
    temp[name] = compiled.memory_analysis().temp_size_in_bytes / 2**20
  return temp


def measure(shape: dict[str, int], names: Sequence[str], timeout: float = 600) -> dict[str, Any]:
  """``{recipe: {"temp_mib": MiB, "collectives": {kind: {dtype: bytes}}}}``."""
  with tempfile.TemporaryDirectory(prefix="jmp_lite_fp8_sharding_") as dump_dir:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = (
      f"--xla_force_host_platform_device_count={DEVICES} --xla_dump_to={dump_dir} "
      "--xla_dump_hlo_pass_re=spmd-partitioning --xla_dump_hlo_module_re=fp8_sharding_ "
      "--xla_backend_optimization_level=0"
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    spec = json.dumps({"shape": shape, "names": list(names)})
    child = subprocess.run(
      [sys.executable, "-m", "benchmarks.fp8_sharding", "--compile", spec],
      cwd=ROOT, env=env, timeout=timeout, capture_output=True, text=True,
    )  # fmt: skip
    if child.returncode:
      raise RuntimeError(f"the compile subprocess failed:\n{child.stderr[-4000:]}")
    temp = json.loads(child.stdout.strip().splitlines()[-1])
    rows = {}
    for name in names:
      pattern = re.compile(rf"\.jit_fp8_sharding_{name}\..*after_spmd-partitioning.*\.txt$")
      (file,) = [f for f in os.listdir(dump_dir) if pattern.search(f)]
      text = (pathlib.Path(dump_dir) / file).read_text()
      rows[name] = {"temp_mib": temp[name], "collectives": _hlo.collective_bytes(text)}
  return rows


def total_bytes(row: dict[str, Any]) -> int:
  return sum(sum(by_dtype.values()) for by_dtype in row["collectives"].values())


def markdown(result: dict[str, Any]) -> str:
  shape, rows = result["shape"], result["rows"]
  base = rows["bf16"]
  mib = lambda b: f"{b / 2**20:.2f}"
  lines = [
    f"`{result['command']}` (jax {result['jax']}): x [{shape['tokens']}, {shape['d']}] x "
    f"w [{shape['d']}, {shape['f']}] on {DEVICES} devices, FSDP on explicit axes",
    "",
    "| recipe | collectives (MiB, after SPMD partitioning) | total MiB | x bf16 | "
    "temp MiB per device (XLA:CPU) | x bf16 |",
    "|---|---|---:|---:|---:|---:|",
  ]
  for name, row in rows.items():
    kinds = "; ".join(
      f"{kind} " + ", ".join(f"{dtype} {mib(b)}" for dtype, b in sorted(by.items()) if b >= 2**10)
      for kind, by in sorted(row["collectives"].items())
    )
    lines.append(
      f"| {name} | {kinds} | {mib(total_bytes(row))} | "
      f"{total_bytes(row) / total_bytes(base):.2f} | {row['temp_mib']:.1f} | "
      f"{row['temp_mib'] / base['temp_mib']:.2f} |"
    )
  return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a tiny layer, three recipes")
  parser.add_argument("--out", default="out/fp8_sharding", help="where the report goes")
  parser.add_argument("--compile", help=argparse.SUPPRESS)  # the subprocess's entry
  args = parser.parse_args(argv)
  if args.compile:
    spec = json.loads(args.compile)
    print(json.dumps(_compile_all(spec["shape"], spec["names"])))
    return {}
  shape, names = (SMOKE_SHAPE, SMOKE_RECIPES) if args.smoke else (SHAPE, tuple(RECIPES))
  words = argv if argv is not None else sys.argv[1:]
  result = {
    "command": "python -m benchmarks.fp8_sharding " + " ".join(words),
    "jax": jax.__version__,
    "shape": shape,
    "rows": measure(shape, names),
  }
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  (out / "fp8_sharding.json").write_text(json.dumps(result, indent=1))
  (out / "fp8_sharding.md").write_text(markdown(result))
  print(markdown(result))
  return result


if __name__ == "__main__":
  main()
