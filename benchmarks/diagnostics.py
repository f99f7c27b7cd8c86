"""Cost of jmp_lite's diagnostics inside a jitted train step, side by side in one process.

Variants, all ``jl.loss_scaling(adam)`` on the same MLP and data (fp32 compute):

* ``plain``: the train step alone.
* ``health``: plus ``LossScaleMonitor.update`` and ``loss_scale_health`` every step.
* ``stats_every_step``: plus ``gradient_statistics`` (histogram included) every step.
* ``stats_no_histogram``: the same with ``exponent_range=None``.
* ``stats_every_100``: ``every_n_steps(step, 100, gradient_statistics, ...)``: the
  realistic setting; the statistics run on 1 step in 100, the others pay a ``cond``.

Each round times every variant on ``--steps`` steps, in a rotating order; the reported
ratio is the median over rounds of (variant time / plain time) of the same round. Also
reported: the time ``jl.audit`` takes on a traced train step (host-side, once per run).

Run: python -m benchmarks.diagnostics [--rounds 7] [--steps 20] [--width 512]
(the defaults give the table of docs/benchmarks.md, "Gradient statistics").
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import optax

import jmp_lite as jl
from benchmarks._common import init_mlp, median_ratio, time_interleaved

diag = jl.diagnostics
VARIANTS = ("plain", "health", "stats_every_step", "stats_no_histogram", "stats_every_100")


def mlp(params, x):
  for i, layer in enumerate(params):
    x = x @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x


def make_step(tx, variant):
  def loss_fn(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)

  def step(params, opt_state, monitor, x, y, i):
    loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, x, y)
    extra = ()
    if variant == "stats_every_step":
      extra = diag.gradient_statistics(grads)
    elif variant == "stats_no_histogram":
      extra = diag.gradient_statistics(grads, exponent_range=None)
    elif variant == "stats_every_100":
      extra = diag.every_n_steps(i, 100, diag.gradient_statistics, grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    if variant == "health":
      monitor = monitor.update(opt_state)
      extra = diag.loss_scale_health(opt_state, monitor)
    return optax.apply_updates(params, updates), opt_state, monitor, loss, extra

  return jax.jit(step)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--width", type=int, default=512)
  parser.add_argument("--batch", type=int, default=128)
  args = parser.parse_args()

  widths = (args.width,) * 5 + (1,)
  x = jax.random.normal(jax.random.key(1), (args.batch, args.width))
  y = jnp.sum(x, axis=1, keepdims=True)
  tx = jl.loss_scaling(optax.adam(1e-3), jl.DynamicLossScale(jnp.float32(2.0**15)))
  n_params = sum(p.size for p in jax.tree.leaves(init_mlp(jax.random.key(0), widths)))

  steps = {v: make_step(tx, v) for v in VARIANTS}
  states = {}  # (params, opt_state, monitor, the step's diagnostics)
  for v in VARIANTS:  # compile and warm up
    params = init_mlp(jax.random.key(0), widths)
    out = steps[v](params, tx.init(params), diag.LossScaleMonitor.create(), x, y, 0)
    states[v] = jax.block_until_ready((*out[:3], out[4]))

  def advance(step):
    def run(state, i):  # the step index counts from 1 in every round
      params, opt_state, monitor, _, extra = step(*state[:3], x, y, i + 1)
      return params, opt_state, monitor, extra

    return run

  times, _ = time_interleaved(
    {v: advance(steps[v]) for v in VARIANTS}, states, args.rounds, args.steps
  )

  params = init_mlp(jax.random.key(0), widths)
  start = time.perf_counter()
  report = jl.audit(
    make_step(tx, "plain"), params, tx.init(params), diag.LossScaleMonitor.create(), x, y, 0
  )
  audit_s = time.perf_counter() - start

  result = {
    "backend": jax.default_backend(),
    "devices": str(jax.devices()[0]),
    "params": int(n_params),
    "plain_step_ms_last_round": round(times["plain"][-1] * 1e3, 3),
    "median_ratio_to_plain": {
      v: round(median_ratio(times[v], times["plain"]), 3) for v in VARIANTS
    },
    "audit_seconds": round(audit_s, 3),
    "audit_operations": report.num_operations,
  }
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
