"""Memory of a transformer LM training step: fp32 vs a bf16 policy vs Flax ``dtype=bf16``.

One model definition (a pre-LayerNorm transformer LM of Flax linen layers),
three ways of running it:

* ``fp32``: ``model.apply`` as written (every layer fp32).
* ``jmp_lite``: :func:`jmp_lite.flax.policy_apply` with
  ``params=float32,compute=bfloat16,output=float32`` and the default overrides
  (LayerNorm fp32 and recomputed in the backward pass, embedding fp32,
  attention softmax fp32 with 16-bit residuals, fp32 accumulation).
* ``jmp_lite_stored``: the same, but the LayerNorm islands store their fp32
  intermediates (``ModuleOverride(compute_dtype="f32")``, no recompute), as the
  fp32 and Flax runs do: what the policy saves without trading compute.
* ``flax_bf16``: the same model built with ``dtype=jnp.bfloat16`` on every
  layer (Flax's own mixed precision; parameters stay fp32), logits cast to
  fp32 for the loss as the policy does.

For each batch size, from parameter-dominated (batch 1) to activation-dominated:

(a) **Residuals**: the arrays ``jax.vjp`` of the loss holds for the backward
    pass, read from the jaxpr (abstract: no FLOPs, the same on every platform),
    each distinct array counted once. ``residual`` is all of them;
    ``activations`` leaves out residuals that *are* the step's inputs (the
    fp32 parameters and the tokens, which exist anyway): it counts the
    activations plus, for 16-bit runs, the 16-bit parameter copies the
    backward matmuls need.
(b) **XLA memory analysis** of the compiled training step (gradients plus an
    Adam update): temporary and argument bytes. On CPU XLA computes 16-bit
    matmuls and elementwise work in fp32 internally, so (b) does not show the
    16-bit saving there; (a) is the honest CPU figure. On a GPU record both.

The persistent training state (params + Adam state) is also counted, with the
bytes of any 16-bit leaf in it (expected 0: no persistent 16-bit copy).

Run: python -m benchmarks.memory [--batches 1 4 16 64] [--no-compile] [--json out.json]
     python -m benchmarks.memory --quick   (a tiny model, for tests)
The tables of docs/benchmarks-memory.md: python -m benchmarks.memory --json memory.json
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jex_core

import jmp_lite.flax as jlf
from benchmarks._common import finish, nbytes
from benchmarks._models import TransformerLM, lm_loss

POLICY = "params=float32,compute=bfloat16,output=float32"
VARIANTS = ("fp32", "jmp_lite", "jmp_lite_stored", "flax_bf16")
COMPARED = VARIANTS[1:]


def loss_fns(config: dict[str, int]) -> dict[str, Callable[[Any, jax.Array], jax.Array]]:
  """The loss of each variant as a function of (params, tokens)."""
  fp32_model = TransformerLM(**config)
  flax_bf16_model = TransformerLM(**config, dtype=jnp.bfloat16)
  policy_fn = jlf.policy_apply(fp32_model, POLICY)
  stored_fn = jlf.policy_apply(fp32_model, jlf.ModulePolicies(POLICY, {nn.LayerNorm: jlf.FP32}))
  f32_reduction_fn = jlf.policy_apply(
    fp32_model, jlf.ModulePolicies(POLICY, grad_reduction_dtype=jnp.float32)
  )

  return {
    "fp32": lambda p, t: lm_loss(fp32_model.apply({"params": p}, t), t),
    "jmp_lite": lambda p, t: lm_loss(policy_fn({"params": p}, t), t),
    "jmp_lite_stored": lambda p, t: lm_loss(stored_fn({"params": p}, t), t),
    "jmp_lite_f32_reduction": lambda p, t: lm_loss(f32_reduction_fn({"params": p}, t), t),
    "flax_bf16": lambda p, t: lm_loss(flax_bf16_model.apply({"params": p}, t), t),
  }


def residuals(loss: Callable, params: Any, tokens: jax.Array) -> dict[str, Any]:
  """Bytes of the distinct arrays ``jax.vjp(loss)`` keeps for the backward pass."""
  closed, (_, vjp_shape) = jax.make_jaxpr(
    lambda p, t: jax.vjp(lambda q: loss(q, t), p), return_shape=True
  )(params, tokens)
  jaxpr = closed.jaxpr
  num = len(jax.tree.leaves(vjp_shape))
  inputs = set(jaxpr.invars) | set(jaxpr.constvars)
  seen, total, from_inputs, by_dtype = set(), 0, 0, {}
  for var in jaxpr.outvars[len(jaxpr.outvars) - num :]:
    if isinstance(var, jex_core.Literal) or var in seen:
      continue
    seen.add(var)
    size = nbytes(var.aval)
    total += size
    if var in inputs:
      from_inputs += size
    name = np.dtype(var.aval.dtype).name
    by_dtype[name] = by_dtype.get(name, 0) + size
  return {
    "residual": total,
    "activations": total - from_inputs,
    "count": len(seen),
    "by_dtype": by_dtype,
  }


def compiled(loss: Callable, params: Any, tokens: jax.Array) -> dict[str, int]:
  """XLA's memory analysis of the jitted training step (grad + Adam update)."""
  tx = optax.adam(1e-3)

  def step(params, opt_state, tokens):
    grads = jax.grad(loss)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  stats = jax.jit(step).lower(params, tx.init(params), tokens).compile().memory_analysis()
  if stats is None:
    return {}
  return {
    "temp": int(stats.temp_size_in_bytes),
    "argument": int(stats.argument_size_in_bytes),
    "output": int(stats.output_size_in_bytes),
    "alias": int(stats.alias_size_in_bytes),
  }


def persistent(params: Any) -> dict[str, int]:
  """Bytes of params + Adam state, and of any 16-bit leaf among them."""
  state = (params, optax.adam(1e-3).init(params))
  leaves = [x for x in jax.tree.leaves(state) if hasattr(x, "dtype")]
  return {
    "bytes": sum(x.nbytes for x in leaves),
    "bytes_16bit": sum(x.nbytes for x in leaves if x.dtype.itemsize == 2),
  }


def run(config: dict[str, int], batches: list[int], compile_step: bool) -> dict[str, Any]:
  model = TransformerLM(**config)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, config["length"]), jnp.int32))[
    "params"
  ]
  losses = loss_fns(config)
  rows = []
  for batch in batches:
    tokens = jax.random.randint(
      jax.random.key(batch), (batch, config["length"]), 0, config["vocab"]
    )
    row: dict[str, Any] = {"batch": batch}
    for name in VARIANTS:
      row[name] = residuals(losses[name], params, tokens)
      if compile_step:
        row[name]["xla"] = compiled(losses[name], params, tokens)
    for name in COMPARED:
      for key in ("residual", "activations"):
        row[f"{name}/fp32 {key}"] = row[name][key] / row["fp32"][key]
      if compile_step and row[name]["xla"] and row["fp32"]["xla"]:
        row[f"{name}/fp32 xla temp"] = row[name]["xla"]["temp"] / row["fp32"]["xla"]["temp"]
    rows.append(row)
  return {
    "config": config,
    "policy": POLICY,
    "platform": jax.devices()[0].platform,
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "param_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
    "persistent": persistent(params),
    "rows": rows,
  }


def _mib(n: float) -> str:
  return f"{n / 2**20:8.2f}"


def report(result: dict[str, Any]) -> str:
  """Markdown tables of the figures."""
  c = result["config"]
  names = {"jmp_lite": "jmp_lite", "jmp_lite_stored": "jmp_lite stored", "flax_bf16": "Flax bf16"}
  lines = [
    f"Model: {c['layers']} layers, width {c['width']}, {c['heads']} heads, MLP x4, vocab "
    f"{c['vocab']}, length {c['length']}; params {_mib(result['param_bytes']).strip()} MiB; "
    f"platform {result['platform']} ({result['device']}), jax {result['jax']}.",
    f"Persistent state (params + Adam): {_mib(result['persistent']['bytes']).strip()} MiB, "
    f"of which 16-bit: {result['persistent']['bytes_16bit']} bytes.",
  ]
  for key, title in (
    ("residual", "(a) all residuals saved for the backward pass"),
    ("activations", "(a') residuals other than the step's inputs (fp32 params, tokens)"),
  ):
    lines += [
      "",
      f"{title}, MiB (ratio to fp32):",
      "",
      "| batch | fp32 | " + " | ".join(names[n] for n in COMPARED) + " |",
      "|---:|---:|" + "---:|" * len(COMPARED),
    ]
    for r in result["rows"]:
      cells = [str(r["batch"]), _mib(r["fp32"][key]).strip()]
      cells += [f"{_mib(r[n][key]).strip()} ({r[f'{n}/fp32 {key}']:.3f})" for n in COMPARED]
      lines.append("| " + " | ".join(cells) + " |")
  if any(r["fp32"].get("xla") for r in result["rows"]):
    lines += [
      "",
      "(b) XLA memory analysis of the compiled step: temp MiB (ratio to fp32); args MiB:",
      "",
      "| batch | fp32 temp | "
      + " | ".join(f"{names[n]} temp" for n in COMPARED)
      + " | args fp32 | args jmp_lite |",
      "|---:|---:|" + "---:|" * (len(COMPARED) + 2),
    ]
    for r in result["rows"]:
      x = {name: r[name]["xla"] for name in VARIANTS}
      cells = [str(r["batch"]), _mib(x["fp32"]["temp"]).strip()]
      cells += [f"{_mib(x[n]['temp']).strip()} ({r[f'{n}/fp32 xla temp']:.3f})" for n in COMPARED]
      cells += [_mib(x["fp32"]["argument"]).strip(), _mib(x["jmp_lite"]["argument"]).strip()]
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


FULL = {"vocab": 256, "width": 256, "heads": 4, "layers": 4, "length": 128}
QUICK = {"vocab": 32, "width": 32, "heads": 2, "layers": 1, "length": 16}


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="tiny model and batches (for tests)")
  parser.add_argument("--batches", type=int, nargs="+", default=None)
  parser.add_argument("--no-compile", action="store_true", help="skip (b), the compiled step")
  parser.add_argument("--json", default=None, help="also write the figures to this file")
  args = parser.parse_args(argv)
  config = QUICK if args.quick else FULL
  batches = args.batches or ([1, 4] if args.quick else [1, 4, 16, 64])
  result = run(config, batches, compile_step=not args.no_compile)
  return finish(report(result), result, args.json, indent=2)


if __name__ == "__main__":
  main()
