"""benchmarks/layerwise_underflow.py's models and data: the deep tanh MLP and the residual MLP.

Both call ``jl.stage_boundary`` after every layer (the identity outside layer-wise training, so
every method runs the same model code); layer ``k`` is ``params[k]`` and stage ``k``. The data
are batches labelled by a random two-layer tanh teacher, drawn on the host.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl

Params = list[dict[str, jax.Array]]
Batch = tuple[jax.Array, jax.Array]

IN_DIM = 32
EVAL_SIZE = 4096
TASKS = ("deep_tanh", "residual")


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
  """The model of task ``name`` at the sizes of ``args`` (``--depth``, ``--blocks``)."""
  if name == "deep_tanh":
    return deep_tanh_model(args.depth)
  if name == "residual":
    return residual_model(args.blocks)
  raise ValueError(f"Unknown task {name!r}.")
