r"""Train-step overhead of loss scaling, side by side in one process.

Variants, all Adam on the same MLP, same data, same fp32 compute (the cost of the
scaling machinery, not of 16-bit arithmetic, which CPUs do not speed up):

* ``plain``: no loss scaling.
* ``jmp_lite``: ``jl.loss_scaling(adam, jl.DynamicLossScale(...))``.
* ``jmp_recipe``: jmp's README recipe (unscale, ``all_finite``, ``adjust``,
  ``select_tree`` over params and optimizer state). Uses DeepMind's ``jmp`` if it
  is installed (``pip install jmp``), else jmp_lite's jmp-compatible functions.
* ``flax_dynamic_scale``: ``flax.training.dynamic_scale.DynamicScale``.
* ``optax_apply_if_finite``: ``optax.apply_if_finite(adam, ...)`` (skips
  non-finite steps, no scaling).
* ``check_zero_updates``, ``check_keep_state``: the floor of any method that
  skips non-finite steps, without scaling: ``jl.all_finite`` on the gradients and
  zero updates when it fails; the second also keeps the optimizer state.

Each round times every variant on ``--steps`` steps, in a rotating order; the
reported ratio is the median over rounds of (variant time / plain time) of the
same round. The compiled HLO of each step is summarised too: fusions,
conditionals and loops, and the passes over the hidden-layer weight-sized arrays
(``W reads``/``W writes``: weights, their gradients, Adam's moments).

Run: python -m benchmarks.overhead [--rounds 15] [--steps 20] [--config compute|optimizer]
[--variants jmp_recipe,flax_dynamic_scale] [--json out.json]

The figures of docs/benchmarks.md ("Loss scaling overhead"; the head-to-head runs are quoted
there too):

  python -m benchmarks.overhead --rounds 25 --steps 10 \
    --json docs/figures/loss_scaling_overhead.json
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
from typing import Any

import flax.training.dynamic_scale
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl
from benchmarks._common import (
  entry_computation,
  hlo_summary,
  init_mlp,
  median_ratio,
  time_interleaved,
  versions,
  write_json,
)

try:
  import jmp as jmp_recipe_lib

  JMP_SOURCE = f"jmp {jmp_recipe_lib.__version__}"
except ImportError:  # the recipe's operations are the same in jmp_lite
  jmp_recipe_lib = jl
  JMP_SOURCE = "jmp_lite's jmp-compatible API (jmp not installed)"

INITIAL_SCALE = 2.0**15


def loss_fn(params, x, y):
  h = x
  for layer in params[:-1]:
    h = jax.nn.gelu(h @ layer["w"] + layer["b"])
  logits = h @ params[-1]["w"] + params[-1]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_variants(adam):
  """Returns {name: (init_state_fn, step_fn)}; step(params, state, x, y)."""

  def plain_init(params):
    return adam.init(params)

  def plain_step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  tx = jl.loss_scaling(adam, jl.DynamicLossScale(INITIAL_SCALE))

  def jmp_lite_step(params, state, x, y):
    _, grads = jl.scaled_value_and_grad(loss_fn, state)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  jmp = jmp_recipe_lib

  def jmp_init(params):
    return adam.init(params), jmp.DynamicLossScale(jnp.float32(INITIAL_SCALE))

  def jmp_step(params, state, x, y):
    opt_state, loss_scale = state
    grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p, x, y)))(params)
    grads = loss_scale.unscale(grads)
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    updates, new_opt_state = adam.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(
      grads_finite, (new_params, new_opt_state), (params, opt_state)
    )
    return params, (opt_state, loss_scale)

  def flax_init(params):
    return adam.init(params), flax.training.dynamic_scale.DynamicScale()

  def flax_step(params, state, x, y):
    opt_state, dynamic_scale = state
    dynamic_scale, is_finite, _, grads = dynamic_scale.value_and_grad(loss_fn)(params, x, y)
    updates, new_opt_state = adam.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    select = functools.partial(optax.tree_utils.tree_where, is_finite)
    return select(new_params, params), (select(new_opt_state, opt_state), dynamic_scale)

  if_finite = optax.apply_if_finite(adam, max_consecutive_errors=5)

  def if_finite_step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = if_finite.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def check_step(params, state, x, y, keep_state):
    grads = jax.grad(loss_fn)(params, x, y)
    finite = jl.all_finite(grads)
    updates, new_state = adam.update(grads, state, params)
    updates = optax.tree_utils.tree_where(finite, updates, optax.tree.zeros_like(updates))
    if keep_state:
      new_state = optax.tree_utils.tree_where(finite, new_state, state)
    return optax.apply_updates(params, updates), new_state

  return {
    "plain": (plain_init, plain_step),
    "check_zero_updates": (plain_init, functools.partial(check_step, keep_state=False)),
    "check_keep_state": (plain_init, functools.partial(check_step, keep_state=True)),
    "jmp_lite": (tx.init, jmp_lite_step),
    "jmp_recipe": (jmp_init, jmp_step),
    "flax_dynamic_scale": (flax_init, flax_step),
    "optax_apply_if_finite": (if_finite.init, if_finite_step),
  }


def weight_passes(text: str, shape: str) -> dict[str, int]:
  """Reads and writes of arrays of type ``shape`` (e.g. ``"f32[1024,1024]"``) by the entry
  computation's instructions: how often a step passes over its largest gradients, weights and
  Adam moments. A read is an instruction with such an operand (a fusion reading the same array
  twice counts once per operand), a write an instruction with such a result; parameters,
  tuples, bitcasts and the conditional that only forwards its operands are not passes."""
  shapes, reads, writes = {}, 0, 0
  for line in entry_computation(text).split("\n")[1:]:
    match = re.match(r"\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([\w-]+)\((.*?)\)", line)
    if not match:
      continue
    name, result, opcode, operands = match.groups()
    shapes[name] = result
    if opcode in ("parameter", "constant", "tuple", "get-tuple-element", "bitcast", "conditional"):
      continue
    reads += sum(shapes.get(o, "").startswith(shape) for o in re.findall(r"%([\w.-]+)", operands))
    writes += result.count(shape)
  return {"reads": reads, "writes": writes}


def step_summary(compiled, weight_shape: str) -> dict[str, Any]:
  """:func:`~benchmarks._common.hlo_summary` and the passes over the weight-sized arrays."""
  passes = weight_passes(compiled.as_text(), weight_shape)
  return {
    **hlo_summary(compiled),
    "weight_reads": passes["reads"],
    "weight_writes": passes["writes"],
  }


def run_config(name, widths, batch, rounds, steps, only=None):
  key = jax.random.PRNGKey(0)
  params = init_mlp(key, widths)
  x = jax.random.normal(jax.random.fold_in(key, 1), (batch, widths[0]), jnp.float32)
  y = jax.random.randint(jax.random.fold_in(key, 2), (batch,), 0, widths[-1])
  adam = optax.adam(1e-4)
  variants = make_variants(adam)
  if only and set(only) - set(variants):
    raise ValueError(
      f"unknown variants {sorted(set(only) - set(variants))}; known: {list(variants)}"
    )
  if only:  # plain and jmp_lite always: the ratios are theirs
    variants = {k: v for k, v in variants.items() if k in {"plain", "jmp_lite", *only}}

  jitted, states, hlo = {}, {}, {}
  for vname, (init, step) in variants.items():
    state = init(params)
    # No buffer donation and no AOT .lower() for the timed calls: jmp 0.0.4's
    # DynamicLossScale breaks under both (its __post_init__ runs on the
    # placeholder leaves jax unflattens).
    jitted[vname] = jax.jit(step)
    try:
      hlo[vname] = step_summary(
        jitted[vname].lower(params, state, x, y).compile(), f"f32[{widths[1]},{widths[2]}]"
      )
    except TypeError:
      hlo[vname] = None
    states[vname] = (jax.tree.map(jnp.copy, params), state)
    for _ in range(3):  # warm up
      states[vname] = jitted[vname](*states[vname], x, y)
    jax.block_until_ready(states[vname])

  names = list(variants)
  advance = {v: lambda state, _, step=jitted[v]: step(*state, x, y) for v in names}
  times, _ = time_interleaved(advance, states, rounds, steps)
  plain = np.asarray(times["plain"])
  result = {
    "config": name,
    "widths": widths,
    "batch": batch,
    "params": sum(p.size for p in jax.tree.leaves(params)),
    "plain_ms": 1e3 * statistics.median(times["plain"]),
    "variants": {},
  }
  # The target: jmp_lite no slower than jmp's recipe or Flax's DynamicScale, paired per round.
  result["jmp_lite_over"] = {
    vname: median_ratio(times["jmp_lite"], times[vname])
    for vname in ("jmp_recipe", "flax_dynamic_scale", "check_keep_state")
    if vname in times
  }
  for vname in names:
    ratios = np.asarray(times[vname]) / plain
    result["variants"][vname] = {
      "median_ms": 1e3 * statistics.median(times[vname]),
      "ratio_vs_plain": median_ratio(times[vname], times["plain"]),
      "ratio_iqr": [float(np.percentile(ratios, 25)), float(np.percentile(ratios, 75))],
      "hlo": hlo[vname],
    }
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--json", help="also write the results to this file")
  parser.add_argument("--quick", action="store_true", help="tiny sizes, for tests")
  parser.add_argument(
    "--variants", help="comma-separated subset to time (plain and jmp_lite always run)"
  )
  parser.add_argument("--config", choices=["compute", "optimizer"], help="only this configuration")
  args = parser.parse_args()

  if args.quick:
    configs = [("quick", [32, 32, 10], 8)]
    args.rounds, args.steps = 2, 2
  else:
    configs = [
      ("compute-bound: MLP 1024x4, batch 256", [1024, 1024, 1024, 1024, 10], 256),
      ("optimizer-bound: MLP 1024x4, batch 8", [1024, 1024, 1024, 1024, 10], 8),
    ]
  if args.config and not args.quick:
    configs = [c for c in configs if c[0].startswith(f"{args.config}-bound")]
  only = args.variants.split(",") if args.variants else None
  print(f"{versions()} jmp recipe via {JMP_SOURCE}")
  results = []
  for name, widths, batch in configs:
    res = run_config(name, widths, batch, args.rounds, args.steps, only)
    results.append(res)
    print(
      f"\n{name}: {res['params']:,} params, plain step {res['plain_ms']:.2f} ms "
      f"(median of {args.rounds} rounds x {args.steps} steps)"
    )
    print(
      f"{'variant':24s} {'ms/step':>9s} {'ratio':>7s} {'IQR':>15s} {'fusions':>8s} "
      f"{'cond/while':>10s} {'W reads':>8s} {'W writes':>8s}"
    )
    for vname, v in res["variants"].items():
      lo, hi = v["ratio_iqr"]
      hlo = v["hlo"] or {}
      branching = hlo["conditionals"] + hlo["while_loops"] if hlo else "n/a"
      print(
        f"{vname:24s} {v['median_ms']:9.2f} {v['ratio_vs_plain']:7.3f} "
        f"{f'[{lo:.3f}, {hi:.3f}]':>15s} {hlo.get('fusions', 'n/a'):>8} "
        f"{branching:>10} {hlo.get('weight_reads', 'n/a'):>8} "
        f"{hlo.get('weight_writes', 'n/a'):>8}"
      )
    over = ", ".join(f"{k} {v:.3f}" for k, v in res["jmp_lite_over"].items())
    print(f"jmp_lite / alternative, median of per-round ratios: {over}")
  if args.json:
    write_json(args.json, results)


if __name__ == "__main__":
  main()
