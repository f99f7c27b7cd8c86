"""CPU proxies of the GPU cost of a train step: a bf16 policy vs Flax ``dtype=bf16`` vs fp32.

A CPU computes 16-bit work in fp32, so its step time and compiled memory say
little about a GPU. What does carry over is what the program asks for: how many
bytes its matmuls write, how many bytes every operation writes, what it keeps
for the backward pass and what it sends between devices. This script counts
those for a train step of the transformer LM of ``benchmarks/_models.py``, run
four ways (``benchmarks/memory.py``'s variants):

* ``fp32``: ``model.apply`` as written.
* ``jmp_lite``: :func:`jmp_lite.flax.policy_apply` with
  ``params=float32,compute=bfloat16,output=float32`` and its default overrides.
* ``jmp_lite_f32_reduction``: the same with ``grad_reduction_dtype=float32``:
  kernel gradients leave their matmuls in fp32, so FSDP reduces them in fp32.
* ``flax_bf16``: the model built with ``dtype=jnp.bfloat16`` on every layer;
  logits cast to fp32 for the loss, as in every variant.

Proxies, each for the step ``jax.value_and_grad(loss)(params, tokens)``:

(1) **matmul outputs**: bytes written by every ``dot_general`` and
    ``conv_general_dilated`` of the step's jaxpr (on a GPU: what the gemms
    write, and whether they can run as 16-bit cuBLAS calls);
(2) **all intermediates**: bytes written by every equation of the jaxpr, an
    upper bound of the step's memory traffic before fusion;
(3) **residuals**: the distinct arrays ``jax.vjp`` keeps for the backward pass,
    as ``benchmarks/memory.py`` counts them;
(4) **collectives**: the step plus an AdamW update, jitted with FSDP on 8 host
    devices (each parameter, and its optimizer state, sharded on its first
    axis where 8 divides it; the batch sharded over the same mesh axis), the
    result bytes of every all-gather, reduce-scatter, all-reduce, all-to-all
    and collective-permute in the HLO *right after* SPMD partitioning, by kind
    and dtype. Later XLA:CPU passes widen bf16 collectives to f32, so the
    compiled module would not show what a GPU sends. Measured in a subprocess,
    which needs its own ``XLA_FLAGS`` (8 host devices, an HLO dump).

(1) and (2) walk nested jaxprs (``jit``, ``custom_vjp_call``,
``custom_jvp_call``, ``checkpoint``, ``closed_call``, ``scan``, ``cond``,
``while``) and count each equation once per execution: a ``scan`` body times
its length, the largest branch of a ``cond`` (of a ``lax.platform_dependent``,
the branch a GPU runs), a ``while`` body once. An equation that calls a nested
jaxpr is counted through that jaxpr's equations, not by its own outputs. (4)
counts each collective of the HLO text once.

Ratios are to ``flax_bf16``. Targets for ``jmp_lite``: matmul
outputs, residuals and collectives at most 1.0x, all intermediates at most
1.15x (the fp32 softmax and LayerNorm islands, no more), each judged after
taking out exactly what :func:`deliberate_fp32` names (fp32 logits from the
head; the fp32 embedding table and LayerNorm parameters under FSDP).

Run: python -m benchmarks.proxies [--batch 8] [--json out.json]
     python -m benchmarks.proxies --quick   (a tiny model, for tests)
The table of docs/benchmarks.md ("CPU proxies of GPU cost"):
python -m benchmarks.proxies --json proxies.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks import _models, memory
from benchmarks._common import finish, nbytes

VARIANTS = ("fp32", "jmp_lite", "jmp_lite_f32_reduction", "flax_bf16")
BASELINE = "flax_bf16"
METRICS = ("matmul_output", "intermediate", "residual", "collective")
TARGETS = {"matmul_output": 1.0, "intermediate": 1.15, "residual": 1.0, "collective": 1.0}
MATMULS = ("dot_general", "conv_general_dilated")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
DEVICES = 8
AXIS = "fsdp"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _subjaxprs(eqn: Any) -> list[tuple[int, list[jex_core.Jaxpr]]]:
  """The jaxprs ``eqn`` runs, as (times run, alternatives of which one runs)."""
  found = []
  for key, value in eqn.params.items():
    values = value if isinstance(value, tuple | list) else (value,)
    jaxprs = [v.jaxpr if isinstance(v, jex_core.ClosedJaxpr) else v for v in values]
    jaxprs = [j for j in jaxprs if isinstance(j, jex_core.Jaxpr)]
    if not jaxprs:
      continue
    if key == "branches":  # cond: one branch runs
      platforms = eqn.params.get("branches_platforms")
      if platforms:  # lax.platform_dependent: the proxies stand for the GPU, not XLA:CPU
        jaxprs = [j for j, p in zip(jaxprs, platforms, strict=True) if p is None or "cuda" in p]
      found.append((1, jaxprs))
    else:
      times = int(eqn.params.get("length", 1)) if eqn.primitive.name == "scan" else 1
      found.extend((times, [j]) for j in jaxprs)
  return found


def jaxpr_bytes(jaxpr: jex_core.Jaxpr | jex_core.ClosedJaxpr) -> dict[str, int]:
  r"""Bytes written by the matmuls and by all equations of ``jaxpr``.

  Args:
    jaxpr: a (closed) jaxpr.

  Returns:
    ``{"matmul_output": ..., "intermediate": ...}``: the output bytes of every
    ``dot_general``/``conv_general_dilated``, and of every equation, each
    counted once per execution (see the module docstring for nested jaxprs).
  """
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  totals = {"matmul_output": 0, "intermediate": 0}
  for eqn in jaxpr.eqns:
    nested = _subjaxprs(eqn)
    if nested:
      for times, alternatives in nested:
        counts = [jaxpr_bytes(j) for j in alternatives]
        for key in totals:
          totals[key] += times * max(c[key] for c in counts)
      continue
    size = sum(nbytes(v.aval) for v in eqn.outvars)
    totals["intermediate"] += size
    if eqn.primitive.name in MATMULS:
      totals["matmul_output"] += size
  return totals


_HLO_BYTES = {
  "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1,
  "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
  "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
# "  %name = TYPE kind(" or "  ROOT %name = TYPE kind(": TYPE may be a tuple.
_COLLECTIVE_RE = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s+(?P<kind>"
  + "|".join(COLLECTIVES)
  + r")(?P<suffix>-start|-done)?\(",
  re.M,
)
_SHAPE_RE = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")


def collective_bytes(hlo_text: str) -> dict[str, dict[str, int]]:
  r"""Result bytes of the collectives in an HLO module's text, by kind and dtype.

  Args:
    hlo_text: an HLO module as XLA prints it (synchronous collectives, as
      right after SPMD partitioning).

  Returns:
    ``{kind: {dtype: bytes}}`` over every ``all-gather``, ``reduce-scatter``,
    ``all-reduce``, ``all-to-all`` and ``collective-permute``; the bytes of a
    tuple-shaped (variadic) collective are the sum of its elements.
  """
  totals: dict[str, dict[str, int]] = {}
  for match in _COLLECTIVE_RE.finditer(hlo_text):
    if match.group("suffix"):
      # The async pairs come from later passes and have differently shaped results.
      raise ValueError(f"asynchronous collective in the HLO: {match.group(0).strip()!r}")
    shapes = _SHAPE_RE.findall(match.group("type"))
    if not shapes:
      raise ValueError(f"no result shape in {match.group(0).strip()!r}")
    for dtype, dims in shapes:
      if dtype not in _HLO_BYTES:
        raise ValueError(f"unknown HLO element type {dtype!r} in {match.group(0).strip()!r}")
      count = math.prod(int(d) for d in dims.split(",") if d)
      by_dtype = totals.setdefault(match.group("kind"), {})
      by_dtype[dtype] = by_dtype.get(dtype, 0) + count * _HLO_BYTES[dtype]
  return totals


def _abstract_setup(config: dict[str, int], batch: int) -> tuple[Any, jax.ShapeDtypeStruct]:
  """Abstract fp32 params of the model and a batch of tokens (no FLOPs)."""
  model = _models.TransformerLM(**config)
  length = config["length"]
  params = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
  )
  return params, jax.ShapeDtypeStruct((batch, length), jnp.int32)


def _losses(config: dict[str, int]) -> dict[str, Callable[[Any, jax.Array], jax.Array]]:
  losses = memory.loss_fns(config)
  return {name: losses[name] for name in VARIANTS}


def jaxpr_proxies(config: dict[str, int], batch: int) -> dict[str, dict[str, int]]:
  """Proxies (1)-(3) of each variant, read from jaxprs."""
  params, tokens = _abstract_setup(config, batch)
  out = {}
  for name, loss in _losses(config).items():
    step = jax.make_jaxpr(jax.value_and_grad(loss))(params, tokens)
    out[name] = {
      **jaxpr_bytes(step),
      "residual": memory.residuals(loss, params, tokens)["residual"],
    }
  return out


def fsdp_spec(shape: tuple[int, ...], devices: int = DEVICES) -> P:
  """Shard the first axis over the FSDP mesh axis where ``devices`` divides it."""
  return P(AXIS) if shape and shape[0] % devices == 0 else P()


def _lower_fsdp_steps(config: dict[str, int], batch: int, variants: tuple[str, ...]) -> None:
  """Compiles the FSDP train step of each variant (run in the subprocess; no FLOPs)."""
  mesh = jax.make_mesh((DEVICES,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,))
  params, tokens = _abstract_setup(config, batch)
  tx = optax.adamw(1e-4)
  opt_state = jax.eval_shape(tx.init, params)
  sharding = lambda x: NamedSharding(mesh, fsdp_spec(x.shape))
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x))
  shardings = (jax.tree.map(sharding, params), jax.tree.map(sharding, opt_state))
  args = (jax.tree.map(abstract, params), jax.tree.map(abstract, opt_state), abstract(tokens))
  losses = _losses(config)
  for name in variants:
    loss = losses[name]

    def step(params, opt_state, tokens, loss=loss):
      value, grads = jax.value_and_grad(loss)(params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, value

    step.__name__ = f"proxies_step_{name}"  # names the HLO module, hence its dump files
    out_shardings = (*shardings, NamedSharding(mesh, P()))
    jax.jit(step, out_shardings=out_shardings).lower(*args).compile()


def _read_dumps(dump_dir: str, variants: tuple[str, ...]) -> dict[str, dict[str, dict[str, int]]]:
  out = {}
  for name in variants:
    pattern = re.compile(rf"\.jit_proxies_step_{name}\..*after_spmd-partitioning.*\.txt$")
    files = sorted(f for f in os.listdir(dump_dir) if pattern.search(f))
    if len(files) != 1:
      raise RuntimeError(f"expected one HLO dump after spmd-partitioning for {name}, got {files}")
    with open(os.path.join(dump_dir, files[0])) as f:
      out[name] = collective_bytes(f.read())
  return out


def collective_proxies(
  config: dict[str, int],
  batch: int,
  variants: tuple[str, ...] = VARIANTS,
  timeout: float = 600,
) -> dict[str, dict[str, dict[str, int]]]:
  """Proxy (4) of each variant: ``{variant: {kind: {dtype: bytes}}}``.

  Runs one subprocess with 8 host CPU devices that compiles (and never runs)
  the FSDP step of each variant, dumping the HLO around SPMD partitioning.
  """
  if batch % DEVICES:
    raise ValueError(f"batch must be a multiple of {DEVICES} to shard it, got {batch}")
  with tempfile.TemporaryDirectory(prefix="jmp_lite_proxies_") as dump_dir:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"  # host devices, also on a machine with a GPU
    env["XLA_FLAGS"] = (
      f"--xla_force_host_platform_device_count={DEVICES} --xla_dump_to={dump_dir} "
      "--xla_dump_hlo_pass_re=spmd-partitioning --xla_dump_hlo_module_re=proxies_step_ "
      # The HLO is dumped before any code is generated: skip LLVM's optimizations.
      "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    spec = json.dumps({"config": config, "batch": batch, "variants": list(variants)})
    child = subprocess.run(
      [sys.executable, "-m", "benchmarks.proxies", "--lower-fsdp", spec],
      cwd=ROOT,
      env=env,
      timeout=timeout,
      capture_output=True,
      text=True,
    )
    if child.returncode:
      raise RuntimeError(
        f"the FSDP subprocess failed ({child.returncode}):\n{child.stderr[-4000:]}"
      )
    return _read_dumps(dump_dir, variants)


def _total(by_kind: dict[str, dict[str, int]]) -> int:
  return sum(sum(d.values()) for d in by_kind.values())


def deliberate_fp32(config: dict[str, int], batch: int) -> dict[str, int]:
  """Bytes the policy spends on purpose where Flax ``dtype=bf16`` rounds to 16 bits.

  * matmul outputs: the head writes the fp32 logits the loss reads (Flax
    writes bf16 logits and casts them to fp32 in a separate pass, which the
    intermediates count); the attention softmax's backward takes its row
    sums ``<dp, p>`` as dot products of the 16-bit arrays with fp32 results
    (Flax: a reduction), one value per query and head;
  * collectives: the embedding table and the LayerNorm scales and biases
    belong to fp32 islands (the embedding's backward scatter-add of many rows
    sums in fp32; normalization runs in fp32), so under FSDP the sharded ones
    are gathered, and their gradients reduced, in fp32: 2 more bytes per
    element, twice.
  """
  params, _ = _abstract_setup(config, batch)
  islands = sum(
    math.prod(leaf.shape)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    if any(str(getattr(k, "key", "")).startswith(("Embed", "LayerNorm")) for k in path)
    and fsdp_spec(leaf.shape) != P()
  )
  logits = batch * config["length"] * config["vocab"]
  row_sums = config["layers"] * batch * config["heads"] * config["length"]
  return {"matmul_output": logits * 2 + row_sums * 4, "collective": 2 * islands * 2}


def run(config: dict[str, int], batch: int, collectives: bool = True) -> dict[str, Any]:
  """All proxies of every variant, and the ratios to ``flax_bf16``.

  ``met`` compares ``jmp_lite``'s ratios with the targets as the issue states them;
  ``met_less_deliberate_fp32`` after taking out :func:`deliberate_fp32` (and only that much).
  """
  figures = jaxpr_proxies(config, batch)
  if collectives:
    for name, by_kind in collective_proxies(config, batch).items():
      figures[name]["collective"] = _total(by_kind)
      figures[name]["collectives"] = by_kind
  metrics = [m for m in METRICS if m in figures[BASELINE]]
  ratios = {
    name: {m: figures[name][m] / figures[BASELINE][m] for m in metrics} for name in VARIANTS
  }
  allowed = {m: deliberate_fp32(config, batch).get(m, 0) for m in metrics}
  judged = {m: (figures["jmp_lite"][m] - allowed[m]) / figures[BASELINE][m] for m in metrics}
  return {
    "config": config,
    "batch": batch,
    "devices": DEVICES if collectives else None,
    "policy": memory.POLICY,
    "jax": jax.__version__,
    "figures": figures,
    "ratios": ratios,
    "targets": {m: TARGETS[m] for m in metrics},
    "deliberate_fp32": allowed,
    "judged": judged,
    "met": {m: ratios["jmp_lite"][m] <= TARGETS[m] for m in metrics},
    "met_less_deliberate_fp32": {m: judged[m] <= TARGETS[m] for m in metrics},
  }


def _mib(n: float) -> str:
  return f"{n / 2**20:.3f}"


def report(result: dict[str, Any]) -> str:
  """Markdown tables of the figures."""
  c, figures, ratios = result["config"], result["figures"], result["ratios"]
  metrics = list(result["targets"])
  titles = {
    "matmul_output": "matmul outputs",
    "intermediate": "all intermediates",
    "residual": "residuals",
    "collective": f"collectives (FSDP, {result['devices']} devices)",
  }
  lines = [
    f"Model: {c['layers']} layers, width {c['width']}, {c['heads']} heads, MLP x4, vocab "
    f"{c['vocab']}, length {c['length']}, batch {result['batch']}; jax {result['jax']}. "
    f"MiB per step (ratio to Flax bf16):",
    "",
    "| variant | " + " | ".join(titles[m] for m in metrics) + " |",
    "|---|" + "---:|" * len(metrics),
  ]
  for name in VARIANTS:
    cells = [f"{_mib(figures[name][m])} ({ratios[name][m]:.3f})" for m in metrics]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  cells = [
    f"{_mib(figures['jmp_lite'][m] - result['deliberate_fp32'][m])} ({result['judged'][m]:.3f})"
    for m in metrics
  ]
  lines.append("| jmp_lite less its deliberate fp32 | " + " | ".join(cells) + " |")
  for key, label in (
    ("met", "target"),
    ("met_less_deliberate_fp32", "target less deliberate fp32"),
  ):
    cells = [
      f"<= {result['targets'][m]:.2f}: {'met' if result[key][m] else 'NOT met'}" for m in metrics
    ]
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  lines += [
    "",
    "Deliberate fp32 (not counted against the targets): the head writes fp32 logits for the loss "
    "(Flax writes bf16 and widens them in a separate pass), and the softmax backward's row sums "
    "are fp32-result dot products; the embedding table and the "
    "LayerNorm parameters belong to fp32 islands, gathered and reduced in fp32 under FSDP "
    "(`overrides={nn.Embed: None}` makes the table bf16, as in Flax).",
  ]
  if "collective" in metrics:
    keys = sorted(
      {(k, d) for n in VARIANTS for k, ds in figures[n]["collectives"].items() for d in ds}
    )
    lines += [
      "",
      "Collectives after SPMD partitioning, MiB by kind and dtype:",
      "",
      "| kind | dtype | " + " | ".join(VARIANTS) + " |",
      "|---|---|" + "---:|" * len(VARIANTS),
    ]
    for kind, dtype in keys:
      cells = [_mib(figures[n]["collectives"].get(kind, {}).get(dtype, 0)) for n in VARIANTS]
      lines.append(f"| {kind} | {dtype} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


FULL = memory.FULL
QUICK = memory.QUICK


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny model (for tests)")
  parser.add_argument("--batch", type=int, default=8, help="a multiple of 8 (default 8)")
  parser.add_argument("--no-collectives", action="store_true", help="skip (4), the FSDP HLO")
  parser.add_argument("--json", default=None, help="also write the figures to this file")
  parser.add_argument("--lower-fsdp", default=None, help=argparse.SUPPRESS)  # the subprocess
  args = parser.parse_args(argv)
  if args.lower_fsdp:
    spec = json.loads(args.lower_fsdp)
    _lower_fsdp_steps(spec["config"], spec["batch"], spec["variants"])
    return None
  result = run(QUICK if args.quick else FULL, args.batch, collectives=not args.no_collectives)
  return finish(report(result), result, args.json, indent=2)


if __name__ == "__main__":
  main()
