"""GPU and TPU cost of ``benchmarks/gpu.py``'s recipes, compiled on a CPU with no accelerator.

XLA compiles a JAX program for a device that is not there ("deviceless"): the CUDA plugin and
libtpu provide compile-only devices (``jax.experimental.topologies``), ``jax.jit(step).lower(...)``
on abstract inputs placed on them runs the target's whole XLA pipeline, and the executable's
memory analysis and optimized HLO can be read (it cannot run). For each target and recipe this
reports:

* compiled memory (``memory_analysis()``): temp, argument, output and alias bytes;
* kernels launched, by opcode and fusion kind (kLoop, kInput, kCustom...), and collectives
  (``benchmarks/_hlo.py``);
* buffers of at least 64 MiB that a kernel writes, by dtype and shape;
* HBM bytes: XLA's cost analysis on TPU (``bytes accessed``); on the GPU, where the deviceless
  executable has no cost analysis, the roofline estimate of ``benchmarks/_hlo.py`` (each
  kernel's operands and result, once).

Targets: ``h200`` (sm_90a, the hardware numbers of an H200 SXM), ``v5e`` and ``v6e`` (one chip).
Without a device there is no GPU autotuning: every gemm gets XLA's default Triton tiling (memory
figures change little with the kernel choice; they matched a real H200's within 2.4%). Nothing
here measures time.

The recipes are built as ``benchmarks/gpu.py`` builds them, with every state abstract
(``jax.eval_shape``: nothing is computed, fp8 calibration included) and the step compiled with
its state donated. The program is traced with JAX's default backend (the CPU): jmp_lite picks
its platform-specific branches when the program is lowered and reads no platform while it
traces, so this is the program a GPU or TPU host compiles.

Run from the repository root, with the ``aot`` extra installed (docs/benchmarks.md, "Deviceless
GPU and TPU cost")::

  python -m benchmarks.deviceless --out out/deviceless        # every recipe, target and size
  python -m benchmarks.deviceless --targets h200 --recipes flax_bf16,policy_bf16 --widths 1024
  python -m benchmarks.deviceless --smoke --out /tmp/deviceless   # tiny model, seconds

Writes ``deviceless.json`` and ``deviceless.md`` to ``--out`` after every compile.
"""

from __future__ import annotations

import os

# Before JAX is imported: the CPU is the only runtime; the targets are compile-only.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # keeps libtpu off the GCE metadata server
# Compile-only: no chip to share, so several processes may load libtpu at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import argparse
import contextlib
import json
import pathlib
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
from jax.experimental import topologies

import jmp_lite as jl
from benchmarks import _hlo
from benchmarks._gpu_recipes import RECIPES
from benchmarks._models import TransformerLM

# The hardware numbers of an H200 SXM (141 GB HBM3e) as XLA's GpuTargetConfigProto text.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32
  shared_memory_per_block: 49152 shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 151397597184
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
runtime_version { major: 12 minor: 9 patch: 0 }
device_description_str: "NVIDIA H200"
"""
TARGETS = ("h200", "v5e", "v6e")
# The LM of benchmarks/gpu.py (d=1024, 8 layers) and the large case (d=4096, 2 layers).
SIZES = {1024: 8, 4096: 2}
MODEL = {"vocab": 256, "heads_dim": 64, "length": 1024}
BATCH = 8
SMOKE_MODEL = {"vocab": 32, "width": 32, "heads": 2, "layers": 1, "length": 16}
SMOKE_BATCH = 2


def target_device(target: str, target_config: str | None = None) -> Any:
  """One compile-only device of ``target`` (``"h200"``, ``"v5e"``, ``"v6e"``).

  Raises:
    ValueError: for another target name.
    RuntimeError: when the target's compiler (the CUDA plugin, libtpu) is not installed.
  """
  if target not in TARGETS:
    raise ValueError(f"Unknown target {target!r}; accepted: {', '.join(TARGETS)}.")
  try:
    if target == "h200":
      topology = topologies.get_topology_desc(
        platform="cuda", target_config=target_config or H200_TARGET_CONFIG, topology="1x1x1"
      )
    else:
      topology = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{target}:1x1", chips_per_host_bounds=(1, 1, 1)
      )
  except Exception as e:  # the plugin is missing or does not load: say which extra brings it
    raise RuntimeError(
      f"No compiler for {target}: install the aot extra (pip install -e '.[aot]'): {e}"
    ) from e
  return topology.devices[0]


def model_config(width: int, layers: int) -> dict[str, int]:
  """The ``TransformerLM`` fields of the LM at ``width``, ``layers`` (64-wide heads)."""
  return {
    "vocab": MODEL["vocab"],
    "width": width,
    "heads": width // MODEL["heads_dim"],
    "layers": layers,
    "length": MODEL["length"],
  }


def lower_recipe(name: str, config: dict[str, int], batch: int, device: Any) -> Any:
  """``benchmarks/gpu.py``'s recipe ``name`` lowered for ``device``, with an abstract state."""
  spec = RECIPES[name].build(config)
  tokens = jax.ShapeDtypeStruct((batch, config["length"]), jnp.int32)
  params = jax.eval_shape(
    lambda t: TransformerLM(**config).init(jax.random.key(0), t)["params"], tokens
  )
  state = jax.eval_shape(spec.init, params, tokens)
  sharding = jax.sharding.SingleDeviceSharding(device)
  place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  state, tokens = jax.tree.map(place, state), place(tokens)
  precision = jax.default_matmul_precision(spec.precision) if spec.precision else None
  with precision or contextlib.nullcontext():
    return jax.jit(spec.step, donate_argnums=0).lower(state, tokens)


def measure(compiled: Any, tpu: bool) -> dict[str, Any]:
  """Memory, kernels, large buffers and HBM bytes of one compiled step."""
  memory = compiled.memory_analysis()
  row: dict[str, Any] = {
    "temp_mib": memory.temp_size_in_bytes / 2**20,
    "argument_mib": memory.argument_size_in_bytes / 2**20,
    "output_mib": memory.output_size_in_bytes / 2**20,
    "alias_mib": memory.alias_size_in_bytes / 2**20,
  }
  summary = _hlo.kernel_summary(compiled.as_text())
  row.update(summary)
  row["hbm_bytes"], row["hbm_bytes_source"] = summary["bytes_moved"], "kernel roofline"
  if tpu:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    if cost and "bytes accessed" in cost:
      row["hbm_bytes"], row["hbm_bytes_source"] = cost["bytes accessed"], "XLA cost analysis"
  return row


def fusions(row: dict[str, Any]) -> str:
  """``kLoop/kInput/kCustom`` fusion counts of a row, as the tables show them."""
  kinds = row.get("kernels", {})
  return "/".join(str(kinds.get(f"fusion:{k}", 0)) for k in ("kLoop", "kInput", "kCustom"))


def markdown(result: dict[str, Any]) -> str:
  """The report: one table per target and size, ratios to the hand-written Flax bf16 step."""
  lines = [
    "# Deviceless GPU/TPU cost of benchmarks/gpu.py's recipes",
    "",
    f"`{result['command']}`; jax {result['versions']['jax']}, jmp_lite "
    f"{result['versions']['jmp_lite']}. Fusions: kLoop/kInput/kCustom kernels launched. HBM: "
    "TPU from XLA's cost analysis, GPU a kernel roofline (operands + result of each kernel).",
  ]
  for key, rows in result["tables"].items():
    reference = rows.get("flax_bf16", {})
    lines += [
      "",
      f"## {key}",
      "",
      "| recipe | temp MiB | x flax_bf16 | HBM GB | x flax_bf16 | fusions | collectives | "
      "buffers >= 64 MiB |",
      "|---|---:|---:|---:|---:|---|---|---|",
    ]
    for name, row in rows.items():
      if "error" in row:
        lines.append(f"| {name} | error: {row['error'][:80]} | | | | | | |")
        continue
      ratio = lambda field, row=row, reference=reference: (
        f"{row[field] / reference[field]:.3f}" if reference.get(field) else "-"
      )
      large = ", ".join(f"{n}x {shape}" for shape, n in row["large_buffers"].items()) or "-"
      collectives = ", ".join(f"{n}x {op}" for op, n in row["collectives"].items()) or "-"
      lines.append(
        f"| {name} | {row['temp_mib']:.1f} | {ratio('temp_mib')} | {row['hbm_bytes'] / 1e9:.2f} "
        f"| {ratio('hbm_bytes')} | {fusions(row)} | {collectives} | {large} |"
      )
  return "\n".join(lines) + "\n"


def run(
  targets: Sequence[str],
  recipes: Sequence[str],
  sizes: Sequence[tuple[dict[str, int], int]],
  out: pathlib.Path,
  command: str,
) -> dict[str, Any]:
  """Compiles every recipe for every target and size; writes the report after each compile."""
  result: dict[str, Any] = {
    "command": command,
    "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    "versions": {
      "python": platform.python_version(),
      "jax": jax.__version__,
      "flax": flax.__version__,
      "jmp_lite": jl.__version__,
    },
    "tables": {},
  }
  out.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  for target in targets:
    device = target_device(target)
    for config, batch in sizes:
      key = f"{target} d={config['width']} layers={config['layers']} batch={batch}"
      rows = result["tables"].setdefault(key, {})
      for name in recipes:
        t0 = time.perf_counter()
        try:
          compiled = lower_recipe(name, config, batch, device).compile()
          rows[name] = measure(compiled, tpu=target != "h200")
        except Exception as e:  # recorded, and the run goes on
          rows[name] = {"error": f"{type(e).__name__}: {e}"}
        rows[name]["compile_s"] = time.perf_counter() - t0
        done = rows[name].get("temp_mib")
        what = f"temp {done:.1f} MiB" if done is not None else rows[name]["error"][:200]
        print(f"[{time.perf_counter() - start:7.1f} s] {key} {name}: {what}", flush=True)
        (out / "deviceless.json").write_text(json.dumps(result, indent=1))
        (out / "deviceless.md").write_text(markdown(result))
  return result


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", default=",".join(TARGETS), help="h200,v5e,v6e (default all)")
  parser.add_argument("--recipes", help="comma-separated names of benchmarks/gpu.py's recipes")
  parser.add_argument("--widths", help=f"model widths, of {sorted(SIZES)} (default all)")
  parser.add_argument("--smoke", action="store_true", help="a tiny model, for tests")
  parser.add_argument("--out", default="out/deviceless", help="where the report goes")
  return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = build_parser().parse_args(argv)
  targets = [t for t in args.targets.split(",") if t]
  recipes = args.recipes.split(",") if args.recipes else list(RECIPES)
  unknown = sorted(set(recipes) - set(RECIPES))
  if unknown:
    raise SystemExit(f"Unknown recipes {unknown}; accepted: {', '.join(RECIPES)}.")
  if args.smoke:
    sizes = [(SMOKE_MODEL, SMOKE_BATCH)]
  else:
    widths = [int(w) for w in args.widths.split(",")] if args.widths else sorted(SIZES)
    if set(widths) - set(SIZES):
      unknown = sorted(set(widths) - set(SIZES))
      raise SystemExit(f"Unknown widths {unknown}; accepted: {sorted(SIZES)}.")
    sizes = [(model_config(w, SIZES[w]), BATCH) for w in widths]
  words = argv if argv is not None else sys.argv[1:]
  command = "python -m benchmarks.deviceless " + " ".join(words)
  return run(targets, recipes, sizes, pathlib.Path(args.out), command)


if __name__ == "__main__":
  main()
