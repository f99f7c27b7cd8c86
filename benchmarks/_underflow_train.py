"""benchmarks/layerwise_underflow.py's training: one method, one seed, measured as it trains.

:func:`train` runs the method's compiled step (one compilation per :class:`RunConfig`, shared
by every seed) and, every ``measure_every`` steps, compares that step's unscaled fp16 gradients
with an fp32 reference of the same step (``benchmarks/_underflow_measure.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl
from benchmarks._underflow_measure import measure_fn
from benchmarks._underflow_models import Data, Model, Params

METHODS = ("fp32", "fp16", "static", "dynamic", "layerwise")
SCALED_METHODS = ("fp16", "static", "dynamic", "layerwise")
DYNAMIC_INITIAL_SCALE = 2.0**15


def make_optimizer(name: str, lr: float) -> optax.GradientTransformation:
  """The inner optimizer every method shares."""
  if name == "adam":
    return optax.adam(lr)
  if name == "lion":
    return optax.lion(lr)
  if name == "lamb":
    return optax.lamb(lr)
  if name == "sgd":
    return optax.sgd(lr, momentum=0.9)
  raise ValueError(f"Unknown optimizer {name!r}.")


DEFAULT_LR = {"adam": 1e-3, "lion": 1e-4, "lamb": 1e-3, "sgd": 1e-2}


@dataclasses.dataclass
class RunResult:
  """What one training run records (host numpy arrays)."""

  losses: np.ndarray  # [steps]
  measure_steps: list[int]
  nonzero: np.ndarray  # [n_measure, layers]
  lost: np.ndarray  # [n_measure, layers]
  lost_below_range: np.ndarray  # [n_measure, layers]
  ref_amax: np.ndarray  # [n_measure, layers]
  finite: np.ndarray  # [n_measure]
  log2_scales: list[list[float]]  # [n_measure][stages or 1]: the scale used at that step
  skipped_steps: int
  final_log2_scale: list[float]
  eval_loss: float
  checkpoints: list[Params]
  seconds: float


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """Everything that shapes a compiled train step (the key of its cache)."""

  model: Model
  method: str
  optimizer: str
  lr: float
  dynamic_period: int
  underflow_fraction: float
  margin_bits: int | None
  amax_history_length: int | None = None


def make_loss_scale(config: RunConfig, static_log2: int = 0) -> Any:
  """The initial loss scale of a method."""
  method = config.method
  if method in ("fp32", "fp16"):
    return jl.NoOpLossScale()
  if method == "static":
    return jl.StaticLossScale(jnp.float32(2.0**static_log2))
  if method == "dynamic":
    return jl.DynamicLossScale(jnp.float32(DYNAMIC_INITIAL_SCALE), period=config.dynamic_period)
  if method == "layerwise":
    extra = {
      name: getattr(config, name)
      for name in ("margin_bits", "amax_history_length")
      if getattr(config, name) is not None
    }
    return jl.LayerwiseLossScale(
      list(range(len(config.model.layer_names))),
      initial_scale=DYNAMIC_INITIAL_SCALE,
      underflow_fraction=config.underflow_fraction,
      update_period=1,
      **extra,
    )
  raise ValueError(f"Unknown method {method!r}.")


def _layer_scales(scale: Any, num_layers: int) -> jax.Array:
  """The loss scale each layer's gradients were computed at."""
  if scale.gradient_scale is None:  # each stage its own (a layer-wise scale)
    return scale.scales
  return jnp.broadcast_to(jnp.asarray(scale.loss_scale, jnp.float32), (num_layers,))


def _unscaled(scale: Any, scaled_grads: Any) -> Any:
  return scale.unscale(scaled_grads)


def _train_step(config: RunConfig):
  """(tx, jitted step), shared by every seed (one compilation per configuration).

  The step also returns its unscaled gradients and the scale of every layer, for
  :func:`~benchmarks._underflow_measure.measure_fn`. ``fp16`` runs as a static scale of 1 (the
  same arithmetic as no scaling), so it shares the compiled step of ``static``.
  """
  if config.method == "fp16":
    config = dataclasses.replace(config, method="static")
  return _cached_train_step(config)


@functools.cache
def _cached_train_step(config: RunConfig):
  model = config.model
  dtype = jnp.float32 if config.method == "fp32" else jnp.float16
  tx = jl.loss_scaling(make_optimizer(config.optimizer, config.lr), make_loss_scale(config))

  def loss_fn(p, x, y):
    return model.loss(p, x, y, dtype)

  @jax.jit
  def step_fn(params, state, x, y):
    loss, scaled = jl.scaled_value_and_grad(loss_fn, state)(params, x, y)
    scale = jl.get_loss_scale(state)
    unscaled = _unscaled(scale, scaled)
    updates, state = tx.update(scaled, state, params)
    layer_scales = _layer_scales(scale, len(model.layer_names))
    return optax.apply_updates(params, updates), state, loss, unscaled, layer_scales

  return tx, step_fn


def _log2_scales(scale: Any) -> list[float]:
  if scale.gradient_scale is None:
    return np.log2(np.asarray(scale.scales, np.float64)).tolist()
  return [float(np.log2(np.asarray(scale.loss_scale, np.float64)))]


def train(
  config: RunConfig,
  data: Data,
  steps: int,
  measure_every: int,
  static_log2: int = 0,
  keep_checkpoints: bool = False,
) -> RunResult:
  """Trains one method, measuring per-layer underflow every ``measure_every`` steps."""
  start = time.perf_counter()
  tx, step_fn = _train_step(config)
  compare = measure_fn(config.model)
  params = config.model.init(data.seed)
  state = tx.init(params)
  if config.method in ("static", "fp16"):
    log2 = static_log2 if config.method == "static" else 0
    state = state._replace(loss_scale=jl.StaticLossScale(jnp.float32(2.0**log2)))

  losses, measurements, measure_steps, log2_scales, checkpoints = [], [], [], [], []
  for step in range(steps):
    x, y = data.sample(step)
    measure = step % measure_every == 0 or step == steps - 1
    if measure:
      measure_steps.append(step)
      log2_scales.append(_log2_scales(jl.get_loss_scale(state)))
      if keep_checkpoints:
        checkpoints.append(params)
    old_params = params
    params, state, loss, grads, layer_scales = step_fn(params, state, x, y)
    losses.append(loss)
    if measure:  # this step's fp16 gradients against an fp32 reference of the same step
      measurements.append(compare(old_params, x, y, grads, layer_scales))
  eval_fn = jax.jit(config.model.loss, static_argnums=3)
  eval_loss = float(eval_fn(params, *data.eval_batch(), jnp.float32))
  measurements = jax.device_get(measurements)
  return RunResult(
    losses=np.asarray(jax.device_get(losses), np.float64),
    measure_steps=measure_steps,
    nonzero=np.stack([m["nonzero"] for m in measurements]).astype(np.float64),
    lost=np.stack([m["lost"] for m in measurements]).astype(np.float64),
    lost_below_range=np.stack([m["lost_below_range"] for m in measurements]).astype(np.float64),
    ref_amax=np.stack([m["ref_amax"] for m in measurements]).astype(np.float64),
    finite=np.asarray([bool(m["finite"]) for m in measurements]),
    log2_scales=log2_scales,
    skipped_steps=int(jl.get_loss_scaling_state(state).skipped_steps),
    final_log2_scale=_log2_scales(jl.get_loss_scale(state)),
    eval_loss=eval_loss,
    checkpoints=checkpoints,
    seconds=time.perf_counter() - start,
  )
