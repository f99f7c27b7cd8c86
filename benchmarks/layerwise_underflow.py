"""Per-layer gradient underflow in fp16 training: one loss scale vs layer-wise scales.

For every layer and every method this measures the **underflow fraction**: of
the gradient values that are nonzero in an fp32 reference of the same step
(same parameters, same batch, fp32 compute), the fraction that are exactly zero
in the fp16 run's gradients after unscaling. Methods, all trained with the same
optimizer on the same batches through ``jl.loss_scaling``:

* ``fp32``: fp32 compute (the reference; loss curve only).
* ``fp16``: fp16 compute, no loss scaling (run as a static scale of 1: the
  same arithmetic as ``jl.NoOpLossScale``).
* ``static``: the best static scale: powers of two 2^0..2^40 are swept on
  checkpoints of the fp32 run (its parameters and batches at the measurement
  steps); the scale with the lowest total underflow that overflows on none of
  them is kept (ties: the smallest).
* ``dynamic``: ``jl.DynamicLossScale(2^15, period=--dynamic-period)``, trained
  long enough to settle (it grows until it overflows, then backs off).
* ``layerwise``: ``jl.LayerwiseLossScale`` with one stage per layer,
  ``update_period=1``, ``underflow_fraction=--underflow-fraction``.

Models (one ``jl.stage_boundary`` after every layer; the identity outside
layer-wise training, so every method runs the same model code):

* ``deep_tanh``: a deep tanh MLP (28 layers of width 64, weights
  N(0, 0.5^2/fan_in), biases N(0, 1)), regressing a random tanh teacher. It
  sits in the ordered phase of tanh networks: activations stay O(1) (the biases)
  while the backward gain is about 0.5 per layer, so the gradients of the first
  layer are about 2^-45 times those of the head: more than fp16's range
  (2^-24..65504, 40 powers of two) can hold with one scale. The spread is
  measured in the fp32 reference and reported.
* ``residual``: a residual MLP (embedding, 6 blocks ``h + W2 tanh(W1 h + b1)``,
  softmax head) classifying inputs labelled by a random teacher (10 classes).

Underflow is averaged over the measurement steps of the second half of training
(steady state; steps whose fp16 gradients were non-finite are left out), then
over seeds. It is also split: values whose true magnitude times the layer's
scale is below 2^-24 are lost *to the scale*; the others were representable and
are zeros made by fp16 rounding in the forward pass (which no scale recovers).
Losses: the training loss of every step, and a held-out loss of the final
parameters computed in fp32 (4096 fresh samples). The inner optimizer is Adam
by default; ``--optimizer lamb`` or ``lion`` (update sizes that do not depend on
the gradient's magnitude) show where the lost layers matter for training.

Outputs in ``--out`` (default ``docs/figures/``): ``layerwise_underflow.json``,
``layerwise_underflow.md`` (the tables) and ``layerwise_underflow.png``.

Run: python -m benchmarks.layerwise_underflow              (the defaults: ~3 min on 2 busy cores)
     python -m benchmarks.layerwise_underflow --tasks deep_tanh --optimizer lamb \
       --seeds 0 1 2 3 4 --prefix layerwise_underflow_lamb
     python -m benchmarks.layerwise_underflow --quick --out /tmp/lw   (seconds, for tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl

Params = list[dict[str, jax.Array]]
Batch = tuple[jax.Array, jax.Array]

METHODS = ("fp32", "fp16", "static", "dynamic", "layerwise")
SCALED_METHODS = ("fp16", "static", "dynamic", "layerwise")
STATIC_LOG2_SCALES = tuple(range(41))
DYNAMIC_INITIAL_SCALE = 2.0**15
IN_DIM = 32
EVAL_SIZE = 4096


# Models and data ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
  """A model: layer ``k`` is ``params[k]`` and stage ``k``.

  Attributes:
    name: short name (``deep_tanh`` or ``residual``).
    title: a one-line description for tables and plots.
    layer_names: one name per layer.
    init: ``init(seed) -> params``, a list with one dict of fp32 arrays per layer.
    loss: ``loss(params, x, y, dtype) -> scalar`` (fp32); computes in ``dtype``
      and calls ``jl.stage_boundary`` between consecutive layers.
    n_out: 1 for a regression, else the number of classes.
  """

  name: str
  title: str
  layer_names: tuple[str, ...]
  init: Callable[[int], Params]
  loss: Callable[[Params, jax.Array, jax.Array, Any], jax.Array]
  n_out: int


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> jax.Array:
  return jnp.asarray(rng.standard_normal(shape, np.float32) * np.float32(std))


@functools.cache
def deep_tanh_model(
  depth: int = 28, width: int = 64, w_std: float = 0.5, b_std: float = 1.0
) -> Model:
  """The deep tanh MLP with vanishing gradients (see the module docstring).

  Cached, so that every seed reuses the same functions and their compiled steps.
  """

  def init(seed):
    rng = np.random.default_rng([1, seed])
    params, n_in = [], IN_DIM
    for _ in range(depth):
      params.append(
        {
          "w": _normal(rng, (n_in, width), w_std / math.sqrt(n_in)),
          "b": _normal(rng, (width,), b_std),
        }
      )
      n_in = width
    params.append({"w": _normal(rng, (width, 1), 1 / math.sqrt(width)), "b": jnp.zeros((1,))})
    return params

  def loss(params, x, y, dtype):
    h = x.astype(dtype)
    for k, layer in enumerate(params[:-1]):
      h = jnp.tanh(h @ layer["w"].astype(dtype) + layer["b"].astype(dtype))
      h = jl.stage_boundary(h, k)
    head = params[-1]
    out = h @ head["w"].astype(dtype) + head["b"].astype(dtype)
    return jnp.mean((out.astype(jnp.float32)[:, 0] - y) ** 2)

  return Model(
    name="deep_tanh",
    title=f"deep tanh MLP ({depth} x {width}, w_std {w_std}, b_std {b_std}), teacher regression",
    layer_names=(*(f"layer{k}" for k in range(depth)), "head"),
    init=init,
    loss=loss,
    n_out=1,
  )


@functools.cache
def residual_model(blocks: int = 6, width: int = 64, hidden: int = 128, classes: int = 10) -> Model:
  """A residual MLP classifier: embedding, residual blocks, softmax head."""

  def init(seed):
    rng = np.random.default_rng([2, seed])
    params = [{"w": _normal(rng, (IN_DIM, width), 1 / math.sqrt(IN_DIM))}]
    for _ in range(blocks):
      params.append(
        {
          "w1": _normal(rng, (width, hidden), 1 / math.sqrt(width)),
          "b1": jnp.zeros((hidden,)),
          "w2": _normal(rng, (hidden, width), 1 / math.sqrt(hidden * blocks)),
        }
      )
    params.append(
      {"w": _normal(rng, (width, classes), 1 / math.sqrt(width)), "b": jnp.zeros((classes,))}
    )
    return params

  def loss(params, x, y, dtype):
    c = lambda a: a.astype(dtype)
    h = jl.stage_boundary(c(x) @ c(params[0]["w"]), 0)
    for k, block in enumerate(params[1:-1], start=1):
      # The branch merges with the skip path inside the stage: one scale for both.
      h = h + jnp.tanh(h @ c(block["w1"]) + c(block["b1"])) @ c(block["w2"])
      h = jl.stage_boundary(h, k)
    logits = (h @ c(params[-1]["w"]) + c(params[-1]["b"])).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  return Model(
    name="residual",
    title=f"residual MLP ({blocks} blocks, width {width}, hidden {hidden}), "
    f"teacher classification ({classes} classes)",
    layer_names=("embed", *(f"block{k}" for k in range(blocks)), "head"),
    init=init,
    loss=loss,
    n_out=classes,
  )


@dataclasses.dataclass(frozen=True)
class Data:
  """Batches labelled by a random two-layer tanh teacher (drawn on the host with numpy:
  ``jax.random`` inside the jitted step would dominate its compile time on CPU)."""

  seed: int
  n_out: int
  batch: int = 128

  def _teacher(self, x: np.ndarray) -> np.ndarray:
    rng = np.random.default_rng([10_000, self.seed])
    a = rng.standard_normal((IN_DIM, 64), np.float32) * np.float32(2.0 / math.sqrt(IN_DIM))
    b = rng.standard_normal((64, self.n_out), np.float32) * np.float32(1.0 / 8)
    out = np.tanh(x @ a) @ b
    return out[:, 0] if self.n_out == 1 else np.argmax(out, axis=-1).astype(np.int32)

  def _inputs(self, step: int, size: int, held_out: bool) -> np.ndarray:
    rng = np.random.default_rng([20_000 + held_out, self.seed, step])
    return rng.standard_normal((size, IN_DIM), np.float32)

  def sample(self, step: int) -> Batch:
    """The training batch of ``step``."""
    x = self._inputs(step, self.batch, False)
    return x, self._teacher(x)

  def eval_batch(self) -> Batch:
    """A fixed held-out batch of EVAL_SIZE samples."""
    x = self._inputs(0, EVAL_SIZE, True)
    return x, self._teacher(x)


def make_model(name: str, args: argparse.Namespace) -> Model:
  if name == "deep_tanh":
    return deep_tanh_model(args.depth)
  if name == "residual":
    return residual_model(args.blocks)
  raise ValueError(f"Unknown task {name!r}.")


TASKS = ("deep_tanh", "residual")


# Measurement -------------------------------------------------------------------------------------


def layer_counts(ref: Params, got: Params, layer_scales: jax.Array) -> dict[str, jax.Array]:
  """Per-layer counts comparing unscaled fp16 gradients ``got`` with the fp32 ``ref``.

  Returns, per layer: ``nonzero`` (reference values that are nonzero), ``lost``
  (of those, the ones that are zero in ``got``: the underflow count),
  ``lost_below_range`` (of the lost ones, those whose true value times the
  layer's loss scale is below fp16's smallest subnormal 2^-24: lost to the
  scale; the rest were representable at that scale and come from fp16 rounding
  in the forward pass, e.g. a pre-activation ``h @ w + b`` that cancels to
  exactly 0 in fp16 where fp32 keeps 8e-4, so the weight gradients that
  multiply it are 0 at any scale), ``ref_amax``; and ``finite`` (all of ``got``).
  """
  nonzero, lost, below, amax = [], [], [], []
  tiny = float(jl.format_info("float16").min_subnormal)
  for k, (ref_layer, got_layer) in enumerate(zip(ref, got, strict=True)):
    r = jnp.concatenate([a.ravel() for a in jax.tree.leaves(ref_layer)])
    g = jnp.concatenate([a.ravel() for a in jax.tree.leaves(got_layer)])
    is_lost = (r != 0) & (g == 0)
    nonzero.append(jnp.sum(r != 0))
    lost.append(jnp.sum(is_lost))
    below.append(jnp.sum(is_lost & (jnp.abs(r) * layer_scales[k] < tiny)))
    amax.append(jnp.max(jnp.abs(r)))
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(got)]))
  return {
    "nonzero": jnp.stack(nonzero),
    "lost": jnp.stack(lost),
    "lost_below_range": jnp.stack(below),
    "ref_amax": jnp.stack(amax),
    "finite": finite,
  }


def _layer_scales(scale: Any, num_layers: int) -> jax.Array:
  """The loss scale each layer's gradients were computed at."""
  if not scale.uniform:
    return scale.scales
  return jnp.broadcast_to(jnp.asarray(scale.loss_scale, jnp.float32), (num_layers,))


def _unscaled(scale: Any, scaled_grads: Any) -> Any:
  if isinstance(scaled_grads, jl.LayerwiseGrads):
    return scale.unscale(scaled_grads.grads)
  return scale.unscale(scaled_grads)


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


def _train_step(config: RunConfig):
  """(tx, jitted step), shared by every seed (one compilation per configuration).

  The step also returns its unscaled gradients and the scale of every layer, for
  :func:`_measure_fn`. ``fp16`` runs as a static scale of 1 (the same arithmetic as
  no scaling), so it shares the compiled step of ``static``.
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


@functools.cache
def _measure_fn(model: Model):
  """Jitted ``(params, x, y, fp16 grads, layer scales) -> counts`` against fp32 grads."""

  @jax.jit
  def measure(params, x, y, got, layer_scales):
    ref = jax.grad(model.loss)(params, x, y, jnp.float32)
    return layer_counts(ref, got, layer_scales)

  return measure


@functools.cache
def _fp16_grads_fn(model: Model):
  """Jitted ``(params, x, y, scale) -> unscaled fp16 gradients`` at a static scale."""

  @jax.jit
  def grads(params, x, y, scale):
    g = jax.grad(lambda p: model.loss(p, x, y, jnp.float16) * scale)(params)
    return jax.tree.map(lambda a: a / scale, g)

  return grads


def _log2_scales(scale: Any) -> list[float]:
  if not scale.uniform:
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
  measure_fn = _measure_fn(config.model)
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
      measurements.append(measure_fn(old_params, x, y, grads, layer_scales))
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


def sweep_static(
  model: Model,
  data: Data,
  checkpoints: Sequence[Params],
  steps: Sequence[int],
  log2_scales: tuple[int, ...],
) -> dict[str, Any]:
  """Underflow and overflow of every static scale on checkpoints of the fp32 run."""
  grads_fn, measure_fn = _fp16_grads_fn(model), _measure_fn(model)
  num_layers = len(model.layer_names)
  per_scale = []  # [scales][checkpoints] of layer counts
  for e in log2_scales:
    scale = jnp.float32(2.0**e)
    layer_scales = jnp.full((num_layers,), scale)
    row = []
    for params, step in zip(checkpoints, steps, strict=True):
      x, y = data.sample(step)
      row.append(measure_fn(params, x, y, grads_fn(params, x, y, scale), layer_scales))
    per_scale.append(row)
  per_scale = jax.device_get(per_scale)
  results = [
    {key: np.stack([row[c][key] for row in per_scale]) for key in per_scale[0][0]}
    for c in range(len(checkpoints))
  ]
  nonzero = sum(r["nonzero"].astype(np.float64) for r in results)  # [scales, layers]
  lost = sum(r["lost"].astype(np.float64) for r in results)
  overflow = np.any(np.stack([~r["finite"] for r in results]), axis=0)
  per_layer = lost / np.maximum(nonzero, 1)
  total = lost.sum(axis=1) / np.maximum(nonzero.sum(axis=1), 1)
  candidates = [i for i in range(len(log2_scales)) if not overflow[i]]
  if not candidates:
    raise RuntimeError("Every static scale overflowed on the fp32 checkpoints.")
  best = min(candidates, key=lambda i: (total[i], log2_scales[i]))
  best_max = min(candidates, key=lambda i: (per_layer[i].max(), log2_scales[i]))
  return {
    "log2_scales": list(log2_scales),
    "overflow": overflow.tolist(),
    "total_underflow": total.tolist(),
    "max_layer_underflow": per_layer.max(axis=1).tolist(),
    "best_log2_scale": int(log2_scales[best]),
    "best_total_underflow": float(total[best]),
    # The best any single scale does for its worst layer (without overflowing).
    "min_over_scales_of_max_layer_underflow": float(per_layer[best_max].max()),
    "min_max_log2_scale": int(log2_scales[best_max]),
  }


# Reporting ---------------------------------------------------------------------------------------


def steady_state_underflow(
  run: RunResult, steps: int, below_range: bool = False
) -> tuple[np.ndarray, np.ndarray]:
  """Mean and worst per-layer underflow over the finite measurements of the second half.

  With ``below_range``, only the values lost to the scale (see :func:`layer_counts`).
  """
  keep = np.asarray([s >= steps // 2 for s in run.measure_steps]) & run.finite
  if not keep.any():
    nan = np.full(run.lost.shape[1], np.nan)
    return nan, nan
  lost = run.lost_below_range if below_range else run.lost
  fraction = lost[keep] / np.maximum(run.nonzero[keep], 1)
  return fraction.mean(axis=0), fraction.max(axis=0)


def spread_bits(ref_amax: np.ndarray) -> dict[str, float]:
  """log2 of (last layer amax / first layer amax), and of (largest / smallest layer amax)."""
  amax = np.maximum(ref_amax, np.finfo(np.float64).tiny)
  first_last = np.log2(amax[:, -1] / amax[:, 0])
  max_min = np.log2(amax.max(axis=1) / amax.min(axis=1))
  return {
    "first_to_last_at_start": float(first_last[0]),
    "first_to_last_at_end": float(first_last[-1]),
    "first_to_last_min": float(first_last.min()),
    "max_to_min_at_start": float(max_min[0]),
    "max_to_min_at_end": float(max_min[-1]),
    "max_to_min_min": float(max_min.min()),
    "log2_layer_amax_at_start": np.log2(amax[0]).tolist(),
    "log2_layer_amax_at_end": np.log2(amax[-1]).tolist(),
  }


def downsample(curve: np.ndarray, points: int) -> list[float]:
  """Means of ``points`` equal bins (a smoothed curve for the JSON and the plot)."""
  bins = np.array_split(curve, min(points, len(curve)))
  return [float(b.mean()) for b in bins]


def _paired(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
  """Per-seed differences a - b, their mean, standard deviation and standard error."""
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  std = float(d.std(ddof=1)) if len(d) > 1 else 0.0
  return {
    "per_seed": d.tolist(),
    "mean": float(d.mean()),
    "std": std,
    "stderr": std / math.sqrt(len(d)),
  }


def summarize_task(
  model: Model, runs: dict[str, list[RunResult]], sweeps: list[dict], args: argparse.Namespace
) -> dict[str, Any]:
  """Aggregates the runs of every seed into the JSON record of one task."""
  tail = max(1, args.steps // 10)
  methods: dict[str, Any] = {}
  for method in METHODS:
    seed_runs = runs[method]
    record: dict[str, Any] = {
      "final_train_loss": [float(r.losses[-tail:].mean()) for r in seed_runs],
      "eval_loss": [r.eval_loss for r in seed_runs],
      "skipped_steps": [r.skipped_steps for r in seed_runs],
      "final_log2_scale": [r.final_log2_scale for r in seed_runs],
      "loss_curve": np.mean(
        [downsample(r.losses, args.curve_points) for r in seed_runs], axis=0
      ).tolist(),
      "seconds": [r.seconds for r in seed_runs],
    }
    if method in SCALED_METHODS:
      for below, key in ((False, "underflow"), (True, "underflow_below_range")):
        means, worsts = zip(
          *(steady_state_underflow(r, args.steps, below) for r in seed_runs), strict=True
        )
        mean = np.nanmean(np.stack(means), axis=0)
        record[f"{key}_per_layer"] = mean.tolist()
        record[f"{key}_per_layer_worst"] = np.nanmax(np.stack(worsts), axis=0).tolist()
        record[f"{key}_max_layer"] = float(np.nanmax(mean))
      total = [float(r.lost[r.finite].sum() / max(r.nonzero[r.finite].sum(), 1)) for r in seed_runs]
      record["underflow_total_all_steps"] = total
      record["underflow_curve_max_layer"] = np.mean(
        [(r.lost / np.maximum(r.nonzero, 1)).max(axis=1) for r in seed_runs], axis=0
      ).tolist()
    methods[method] = record
  fp32_ref = runs["fp32"]
  spreads = [spread_bits(r.ref_amax) for r in fp32_ref]
  lw = methods["layerwise"]
  fp32_eval = np.asarray(methods["fp32"]["eval_loss"])
  fp32_train = np.asarray(methods["fp32"]["final_train_loss"])
  lw_train = np.asarray(lw["final_train_loss"])
  no_single_scale = [
    s["min_over_scales_of_max_layer_underflow"] > args.underflow_fraction for s in sweeps
  ]
  targets = {
    "underflow_fraction": args.underflow_fraction,
    "layerwise_every_layer_at_or_below_target": bool(
      lw["underflow_max_layer"] <= args.underflow_fraction
    ),
    "layerwise_max_layer_underflow": lw["underflow_max_layer"],
    # Counting only the values lost to the scale (below 2^-24 at the stage's scale).
    "layerwise_every_layer_at_or_below_target_below_range": bool(
      lw["underflow_below_range_max_layer"] <= args.underflow_fraction
    ),
    "layerwise_max_layer_underflow_below_range": lw["underflow_below_range_max_layer"],
    "no_single_scale_meets_target": bool(all(no_single_scale)),
    "best_single_scale_max_layer_underflow": [
      s["min_over_scales_of_max_layer_underflow"] for s in sweeps
    ],
    "spread_exceeds_fp16_range": bool(
      all(s["first_to_last_min"] > math.log2(65504 / 2.0**-24) for s in spreads)
    ),
    "final_train_loss_layerwise_minus_fp32": _paired(lw_train, fp32_train),
    "eval_loss_layerwise_minus_fp32": _paired(np.asarray(lw["eval_loss"]), fp32_eval),
    "eval_loss_layerwise_minus_dynamic": _paired(
      np.asarray(lw["eval_loss"]), np.asarray(methods["dynamic"]["eval_loss"])
    ),
  }
  # "Within noise": the mean paired difference (same seeds, same batches) of the final training
  # loss is within 2 standard errors of the paired differences, or below 0.5% of the loss.
  d = targets["final_train_loss_layerwise_minus_fp32"]
  targets["layerwise_matches_fp32_within_noise"] = (
    bool(abs(d["mean"]) <= max(2 * d["stderr"], 0.005 * float(fp32_train.mean())))
    if len(fp32_train) > 1
    else None  # one seed: no noise estimate
  )
  return {
    "task": model.name,
    "title": model.title,
    "layer_names": list(model.layer_names),
    "spread_bits": spreads,
    "static_sweeps": sweeps,
    "static_log2_scale": [s["best_log2_scale"] for s in sweeps],
    "methods": methods,
    "targets": targets,
  }


def _fmt_pct(x: float) -> str:
  if x is None or not np.isfinite(x):
    return "n/a"
  if x == 0:
    return "0"
  if x < 1e-3:
    return f"{100 * x:.3f}"
  return f"{100 * x:.2f}" if x < 0.1 else f"{100 * x:.1f}"


def _mean_std(values: Sequence[float], digits: int = 4) -> str:
  v = np.asarray(values, np.float64)
  if len(v) == 1:
    return f"{v[0]:.{digits}f}"
  return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


def markdown_tables(results: dict[str, Any]) -> str:
  """The per-layer underflow table and the loss summary of every task, in Markdown."""
  lines = []
  seeds = results["config"]["seeds"]
  for task in results["tasks"]:
    m, t = task["methods"], task["targets"]
    lines.append(f"### {task['task']}: {task['title']}\n")
    lines.append(
      "Gradient spread in the fp32 reference, log2(amax of the last layer's gradients / amax "
      "of the first layer's), at step 0 and the smallest over training: "
      + ", ".join(
        f"seed {seed}: {s['first_to_last_at_start']:.1f} and {s['first_to_last_min']:.1f}"
        for seed, s in zip(seeds, task["spread_bits"], strict=True)
      )
      + " (fp16 spans about 40 powers of two, 2^-24..65504).\n"
    )
    lines.append(
      "Best static scale per seed: "
      + ", ".join(f"2^{e}" for e in task["static_log2_scale"])
      + ". The best any single scale does for its worst layer (on the fp32 checkpoints): "
      + ", ".join(_fmt_pct(x) + "%" for x in t["best_single_scale_max_layer_underflow"])
      + ".\n"
    )
    lines += [
      "Underflow % per layer (mean over the measurements of the second half of training and "
      "over seeds). The last column counts only the values lost to the scale (true value times "
      "the stage's scale below 2^-24); the rest are zeros of fp16 rounding in the forward pass, "
      "which no loss scale recovers.\n",
      "| layer | " + " | ".join(SCALED_METHODS) + " | layerwise, below range |",
      "|" + "---|" * (len(SCALED_METHODS) + 2),
    ]
    for i, name in enumerate(task["layer_names"]):
      cells = [_fmt_pct(m[meth]["underflow_per_layer"][i]) for meth in SCALED_METHODS]
      cells.append(_fmt_pct(m["layerwise"]["underflow_below_range_per_layer"][i]))
      lines.append(f"| {name} | " + " | ".join(cells) + " |")
    worst = [f"**{_fmt_pct(m[meth]['underflow_max_layer'])}**" for meth in SCALED_METHODS]
    worst.append(f"**{_fmt_pct(m['layerwise']['underflow_below_range_max_layer'])}**")
    lines.append("| **worst layer** | " + " | ".join(worst) + " |")
    lines += [
      "",
      "| method | steps skipped (per seed) | final train loss | held-out loss (fp32) "
      "| final log2 scale |",
      "|---|---|---|---|---|",
    ]
    for meth in METHODS:
      scales = m[meth]["final_log2_scale"]
      if meth == "layerwise":
        lo = min(min(s) for s in scales)
        hi = max(max(s) for s in scales)
        scale_txt = f"{lo:.0f}..{hi:.0f} (per stage)"
      elif meth in ("fp32", "fp16"):
        scale_txt = "-"
      else:
        scale_txt = ", ".join(f"{s[0]:.0f}" for s in scales)
      lines.append(
        f"| {meth} | {', '.join(str(s) for s in m[meth]['skipped_steps'])} | "
        f"{_mean_std(m[meth]['final_train_loss'])} | {_mean_std(m[meth]['eval_loss'])} | "
        f"{scale_txt} |"
      )

    def paired(key: str, t: dict = t) -> str:
      d = t[key]
      return ", ".join(f"{x:+.4f}" for x in d["per_seed"]) + f" (mean {d['mean']:+.4f})"

    lines += [
      "",
      f"- Layer-wise worst layer: {_fmt_pct(t['layerwise_max_layer_underflow'])}% "
      f"({_fmt_pct(t['layerwise_max_layer_underflow_below_range'])}% lost to the scale); "
      f"target <= {_fmt_pct(t['underflow_fraction'])}%: "
      f"{'met' if t['layerwise_every_layer_at_or_below_target'] else 'NOT met'} "
      f"({'met' if t['layerwise_every_layer_at_or_below_target_below_range'] else 'NOT met'} "
      "counting only values lost to the scale).",
      f"- No single scale meets the target: {t['no_single_scale_meets_target']}; "
      f"spread above fp16's range on every seed: {t['spread_exceeds_fp16_range']}.",
      f"- Final train loss, layer-wise minus fp32 (paired by seed): "
      f"{paired('final_train_loss_layerwise_minus_fp32')}; within noise: "
      f"{t['layerwise_matches_fp32_within_noise']}.",
      f"- Held-out loss, layer-wise minus fp32: {paired('eval_loss_layerwise_minus_fp32')}; "
      f"layer-wise minus dynamic: {paired('eval_loss_layerwise_minus_dynamic')}.\n",
    ]
  return "\n".join(lines)


def plot(results: dict[str, Any], path: str) -> bool:
  """Per task: underflow per layer per method, loss curves, per-stage scales.

  Returns False (and writes nothing) when matplotlib is not installed.
  """
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot (pip install matplotlib).", file=sys.stderr)
    return False
  tasks = results["tasks"]
  colors = {
    "fp32": "black",
    "fp16": "tab:red",
    "static": "tab:orange",
    "dynamic": "tab:blue",
    "layerwise": "tab:green",
  }
  fig, axes = plt.subplots(
    len(tasks), 3, figsize=(17, 4.3 * len(tasks)), squeeze=False, width_ratios=[1.3, 1, 1]
  )
  floor = 1e-6  # zero underflow is drawn at the bottom of the log axis
  fmt = jl.format_info("float16")
  for row, task in zip(axes, tasks, strict=True):
    names = task["layer_names"]
    x = np.arange(len(names))
    ticks = dict(rotation=90 if len(names) > 10 else 0, fontsize=7)

    ax = row[0]
    for meth in SCALED_METHODS:
      y = np.maximum(np.asarray(task["methods"][meth]["underflow_per_layer"]), floor) * 100
      ax.plot(x, y, "o-", ms=3, color=colors[meth], label=meth)
    target = task["targets"]["underflow_fraction"] * 100
    ax.axhline(target, ls="--", color="gray", lw=1, label=f"target {target:g}%")
    ax.set_yscale("log")
    ax.set_ylim(floor * 100 / 2, 150)
    ax.set_xticks(x, names, **ticks)
    ax.set_ylabel("underflow % (steady state)")
    ax.set_title(f"{task['task']}: underflow per layer (0 drawn at {floor * 100:g}%)", fontsize=10)
    ax.legend(fontsize=7)

    ax = row[1]
    for meth in METHODS:
      curve = np.asarray(task["methods"][meth]["loss_curve"])
      steps = np.linspace(0, results["config"]["steps"], len(curve))
      ax.plot(steps, curve, color=colors[meth], label=meth, lw=2.5 if meth == "fp32" else 1.2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (binned, mean over seeds)")
    ax.set_title(f"{task['task']}: training loss ({results['config']['optimizer']})", fontsize=10)
    ax.legend(fontsize=7)

    ax = row[2]
    # The largest scale that keeps a layer's largest gradient below fp16's max / 8.
    amax = np.asarray([s["log2_layer_amax_at_end"] for s in task["spread_bits"]]).mean(axis=0)
    ax.plot(x, np.log2(fmt.max / 8) - amax, "k:", label="log2(65504/8 / amax), fp32 ref")
    lw_scales = np.asarray(task["methods"]["layerwise"]["final_log2_scale"]).mean(axis=0)
    ax.plot(x, lw_scales, "o-", ms=3, color=colors["layerwise"], label="layerwise (per stage)")
    for meth in ("static", "dynamic"):
      value = np.mean([s[0] for s in task["methods"][meth]["final_log2_scale"]])
      ax.axhline(value, color=colors[meth], label=meth)
    ax.set_xticks(x, names, **ticks)
    ax.set_ylabel("log2 loss scale at the end (mean over seeds)")
    ax.set_title(f"{task['task']}: loss scales", fontsize=10)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


# Main --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m benchmarks.layerwise_underflow",
    description=__doc__.split("\n")[0],
    epilog="See docs/layerwise.md for the recorded results.",
  )
  parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--steps", type=int, default=1000, help="training steps per run")
  parser.add_argument("--measure-every", type=int, default=50, help="steps between measurements")
  parser.add_argument(
    "--optimizer", choices=list(DEFAULT_LR), help="default: adam (sgd with --quick)"
  )
  parser.add_argument("--lr", type=float, help="learning rate (default: per optimizer)")
  parser.add_argument("--dynamic-period", type=int, default=50, help="DynamicLossScale period")
  parser.add_argument("--underflow-fraction", type=float, default=1e-3)
  parser.add_argument(
    "--margin-bits", type=int, help="LayerwiseLossScale margin_bits (default: the library's)"
  )
  parser.add_argument(
    "--amax-history-length",
    type=int,
    help="LayerwiseLossScale amax_history_length (default: the library's)",
  )
  parser.add_argument("--depth", type=int, default=28, help="deep_tanh: hidden layers")
  parser.add_argument("--blocks", type=int, default=6, help="residual: residual blocks")
  parser.add_argument("--curve-points", type=int, default=100, help="loss curve points in the JSON")
  parser.add_argument("--out", default="docs/figures", help="output directory")
  parser.add_argument("--prefix", default="layerwise_underflow", help="output file name stem")
  parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
  parser.add_argument("--quick", action="store_true", help="tiny run for tests (seconds)")
  parser.add_argument(
    "--render", metavar="JSON", help="only redraw the .md and .png of a recorded run's JSON"
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.seeds, args.steps, args.measure_every = args.seeds[:1], 8, 4
    args.depth, args.blocks, args.dynamic_period = 3, 1, 2
  if args.optimizer is None:  # SGD compiles about twice as fast as Adam: --quick is for tests
    args.optimizer = "sgd" if args.quick else "adam"
  if args.lr is None:
    args.lr = DEFAULT_LR[args.optimizer]
  if args.steps < 2 or args.measure_every < 1:
    parser.error("--steps must be >= 2 and --measure-every >= 1.")
  return args


def run_task(task_name: str, args: argparse.Namespace) -> dict[str, Any]:
  """All methods and seeds of one task."""
  model = make_model(task_name, args)
  runs: dict[str, list[RunResult]] = {m: [] for m in METHODS}
  sweeps = []

  def run(method: str, data: Data, **kwargs) -> RunResult:
    config = RunConfig(
      model,
      method,
      args.optimizer,
      args.lr,
      args.dynamic_period,
      args.underflow_fraction,
      args.margin_bits,
      args.amax_history_length,
    )
    return train(config, data, args.steps, args.measure_every, **kwargs)

  for seed in args.seeds:
    data = Data(seed, model.n_out)
    ref = run("fp32", data, keep_checkpoints=True)
    runs["fp32"].append(ref)
    # At most 8 of the fp32 run's measurement steps are the sweep's checkpoints.
    picks = np.unique(np.linspace(0, len(ref.measure_steps) - 1, 8).round().astype(int))
    sweep = sweep_static(
      model,
      data,
      [ref.checkpoints[i] for i in picks],
      [ref.measure_steps[i] for i in picks],
      STATIC_LOG2_SCALES,
    )
    ref.checkpoints = []
    sweeps.append(sweep)
    for method in SCALED_METHODS:
      runs[method].append(run(method, data, static_log2=sweep["best_log2_scale"]))
    line = ", ".join(
      f"{m} {runs[m][-1].seconds:.1f}s ({runs[m][-1].skipped_steps} skipped)" for m in METHODS
    )
    print(f"  {task_name} seed {seed}: static 2^{sweep['best_log2_scale']}; {line}", flush=True)
  return summarize_task(model, runs, sweeps, args)


def _core_version() -> str:
  """sha256 (12 hex digits) of jmp_lite/layerwise.py: which implementation ran."""
  with open(jl.layerwise.__file__, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()[:12]


def write_outputs(results: dict[str, Any], stem: str, with_plot: bool = True) -> None:
  """Writes ``stem``.md (the tables) and ``stem``.png from a results dict."""
  tables = markdown_tables(results)
  with open(stem + ".md", "w") as f:
    f.write(f"<!-- {results['config']['command']} -->\n\n{tables}")
  print("\n" + tables)
  if with_plot and plot(results, stem + ".png"):
    print(f"wrote {stem}.png")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the experiment, writes JSON, Markdown and PNG to ``--out``; returns the results."""
  args = parse_args(argv)
  if args.render:  # only redraw the tables and the plot of a recorded run
    with open(args.render) as f:
      results = json.load(f)
    write_outputs(results, args.render.removesuffix(".json"), not args.no_plot)
    return results
  start = time.perf_counter()
  print(
    f"backend={jax.default_backend()} jax={jax.__version__} optax={optax.__version__} "
    f"optimizer={args.optimizer} lr={args.lr} steps={args.steps} seeds={args.seeds}",
    flush=True,
  )
  results: dict[str, Any] = {
    "config": {
      k: v for k, v in vars(args).items() if k not in ("out", "prefix", "no_plot", "render")
    }
    | {
      "methods": list(METHODS),
      "static_log2_scales": list(STATIC_LOG2_SCALES),
      "dynamic_initial_scale": DYNAMIC_INITIAL_SCALE,
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "layerwise_py_sha256": _core_version(),
      "command": "python -m benchmarks.layerwise_underflow "
      + " ".join(sys.argv[1:] if argv is None else argv),
    },
    "tasks": [],
  }
  for task_name in args.tasks:
    results["tasks"].append(run_task(task_name, args))
  results["seconds"] = time.perf_counter() - start
  os.makedirs(args.out, exist_ok=True)
  stem = os.path.join(args.out, args.prefix)
  with open(stem + ".json", "w") as f:
    json.dump(results, f, indent=1)
  write_outputs(results, stem, not args.no_plot)
  print(f"wrote {stem}.json, {stem}.md ({results['seconds']:.0f} s)")
  return results


if __name__ == "__main__":
  main()
