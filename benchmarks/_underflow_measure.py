"""benchmarks/layerwise_underflow.py's measurement: fp16 gradients against an fp32 reference.

:func:`layer_counts` compares one step's unscaled fp16 gradients with the fp32 gradients of the
same parameters and batch, layer by layer (the underflow counts); :func:`measure_fn` jits it
with the reference; :func:`sweep_static` measures every static scale on checkpoints of the
fp32 run, to pick the best one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite as jl
from benchmarks._underflow_models import Data, Model, Params


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


@functools.cache
def measure_fn(model: Model):
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


def sweep_static(
  model: Model,
  data: Data,
  checkpoints: Sequence[Params],
  steps: Sequence[int],
  log2_scales: tuple[int, ...],
) -> dict[str, Any]:
  """Underflow and overflow of every static scale on checkpoints of the fp32 run."""
  grads_fn, measure = _fp16_grads_fn(model), measure_fn(model)
  num_layers = len(model.layer_names)
  per_scale = []  # [scales][checkpoints] of layer counts
  for e in log2_scales:
    scale = jnp.float32(2.0**e)
    layer_scales = jnp.full((num_layers,), scale)
    row = []
    for params, step in zip(checkpoints, steps, strict=True):
      x, y = data.sample(step)
      row.append(measure(params, x, y, grads_fn(params, x, y, scale), layer_scales))
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
