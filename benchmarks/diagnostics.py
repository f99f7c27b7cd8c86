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
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_lite import audit
from jmp_lite import diagnostics as diag
from jmp_lite._loss_scale import DynamicLossScale
from jmp_lite._transform import loss_scaling, scaled_value_and_grad


def init_mlp(key, widths):
  params = {}
  for i, (n_in, n_out) in enumerate(itertools.pairwise(widths)):
    key, sub = jax.random.split(key)
    params[f"layer_{i}"] = {
      "w": jax.random.normal(sub, (n_in, n_out)) / np.sqrt(n_in),
      "b": jnp.zeros((n_out,)),
    }
  return params


def mlp(params, x):
  for i in range(len(params)):
    layer = params[f"layer_{i}"]
    x = x @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x


def make_step(tx, variant):
  def loss_fn(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)

  def step(params, opt_state, monitor, x, y, i):
    loss, grads = scaled_value_and_grad(loss_fn, opt_state)(params, x, y)
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


VARIANTS = ("plain", "health", "stats_every_step", "stats_no_histogram", "stats_every_100")


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
  tx = loss_scaling(optax.adam(1e-3), DynamicLossScale(jnp.float32(2.0**15)))
  n_params = sum(p.size for p in jax.tree.leaves(init_mlp(jax.random.key(0), widths)))

  steps = {v: make_step(tx, v) for v in VARIANTS}
  states = {}
  for v in VARIANTS:  # compile and warm up
    params = init_mlp(jax.random.key(0), widths)
    state = (params, tx.init(params), diag.LossScaleMonitor.create())
    out = steps[v](*state, x, y, 0)
    jax.block_until_ready(out)
    states[v] = out[:3]

  ratios = {v: [] for v in VARIANTS}
  for r in range(args.rounds):
    times = {}
    for v in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
      params, opt_state, monitor = states[v]
      start = time.perf_counter()
      for i in range(args.steps):
        params, opt_state, monitor, _, extra = steps[v](params, opt_state, monitor, x, y, i + 1)
      jax.block_until_ready((params, extra))
      times[v] = (time.perf_counter() - start) / args.steps
      states[v] = (params, opt_state, monitor)
    for v in VARIANTS:
      ratios[v].append(times[v] / times["plain"])
    plain_ms = times["plain"] * 1e3

  params = init_mlp(jax.random.key(0), widths)
  start = time.perf_counter()
  report = audit(
    make_step(tx, "plain"), params, tx.init(params), diag.LossScaleMonitor.create(), x, y, 0
  )
  audit_s = time.perf_counter() - start

  result = {
    "backend": jax.default_backend(),
    "devices": str(jax.devices()[0]),
    "params": int(n_params),
    "plain_step_ms_last_round": round(plain_ms, 3),
    "median_ratio_to_plain": {v: round(statistics.median(ratios[v]), 3) for v in VARIANTS},
    "audit_seconds": round(audit_s, 3),
    "audit_operations": report.num_operations,
  }
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
