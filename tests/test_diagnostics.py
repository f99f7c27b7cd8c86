"""The diagnostics together: a train step that logs all three, as jmp_lite.diagnostics shows."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import jmp_lite as jl
from jmp_lite import _jaxpr, loss_scaling, scaled_value_and_grad
from jmp_lite import diagnostics as diag

from .diagnostics_testing import jit

# --------------------------------------------------------------------------------------------
# The whole loop: a NaN source is reported as a collapse, with the layer that causes it.


@jax.custom_vjp
def nan_in_backward(x, on):
  return x


nan_in_backward.defvjp(lambda x, on: (x, on), lambda on, g: (jnp.where(on, jnp.nan, g), None))


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x, poison):
    for i, width in enumerate([16, 16, 16, 1]):
      x = nn.Dense(width, name=f"layer_{i}")(x)
      if i == 2:  # the NaN source: layer_2's backward pass
        x = nan_in_backward(x, poison)
      if i < 3:
        x = nn.relu(x)
    return x


@functools.cache
def trainer():
  model = MLP()

  @jit
  def init():  # compiled: eagerly, each initializer compiles at XLA's default optimization level
    x = jax.random.normal(jax.random.key(0), (8, 4))
    return x, jnp.sum(x, axis=1, keepdims=True), model.init(jax.random.key(1), x, False)

  x, y, params = init()
  tx = loss_scaling(optax.adam(1e-2), jl.DynamicLossScale(jnp.float32(2.0**8), min_loss_scale=16.0))

  def loss_fn(p, poison):
    return jnp.mean((model.apply(p, x, poison) - y) ** 2)

  def step(params, opt_state, monitor, poison, i):
    _, grads = scaled_value_and_grad(loss_fn, opt_state)(params, poison)
    stats = diag.every_n_steps(i, 1, diag.gradient_statistics, grads, format="float16")
    updates, opt_state = tx.update(grads, opt_state, params)
    monitor = monitor.update(opt_state)
    health = diag.loss_scale_health(opt_state, monitor, max_steps_at_minimum=5)
    return optax.apply_updates(params, updates), opt_state, monitor, stats, health

  first_args = (params, tx.init(params), diag.LossScaleMonitor.create(window=10), False, 0)
  order = diag.parameter_order(lambda p: loss_fn(p, False), params)
  return step, jit(step), first_args, order


def train(poison_from: int, steps: int = 14):
  step, compiled, first_args, order = trainer()
  params, opt_state, monitor, _, _ = first_args
  for i in range(steps):
    params, opt_state, monitor, stats, health = compiled(
      params, opt_state, monitor, jnp.asarray(i >= poison_from), i
    )
  return jax.device_get(health), jax.device_get(stats), order, (step, first_args)


def test_injected_nan_source_reports_collapse_and_culprit_layer():
  health, stats, order, (step, args) = train(poison_from=3)
  assert bool(health.collapsed) and bool(health.unhealthy)
  # Steps 3-13 are skipped; the scale halves from 2^8 to its minimum 16 by step 6, and the
  # 8 updates from step 6 on leave it there (docs/troubleshooting.md prints this run).
  assert float(health.loss_scale) == 16.0 and int(health.steps_at_minimum) == 8
  assert int(health.skipped_steps) == int(health.consecutive_skips) == 11
  culprits = diag.likely_culprits(stats, order=order)
  assert culprits[0].name == "params/layer_2" and culprits[0].problem == "non-finite"
  # The step stays free of host callbacks: diagnostics add no sync to the hot path.
  jaxpr = jax.make_jaxpr(jax.jit(step))(*args)  # the step as a user compiles it
  primitives = {e.primitive.name for e in _all_eqns(jaxpr.jaxpr)}
  # The walk sees inside the jit and every_n_steps' cond (the histogram's scatter-add).
  assert [e.primitive.name for e in jaxpr.jaxpr.eqns] == ["jit"]
  assert {"cond", "scatter-add", "dot_general"} <= primitives
  assert not [name for name in primitives if "callback" in name]


def test_clean_run_is_healthy_with_no_culprit():
  health, stats, order, _ = train(poison_from=10**6)
  assert not bool(health.unhealthy)
  assert diag.likely_culprits(stats, order=order) == ()


def _all_eqns(jaxpr):
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in _jaxpr.sub_jaxprs(eqn):
      yield from _all_eqns(sub.jaxpr)
