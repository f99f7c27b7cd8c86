"""A small convnet with BatchNorm classifying scikit-learn's bundled handwritten digits.

The data is ``sklearn.datasets.load_digits()``: 1,797 grayscale 8x8 images of
the digits 0-9 (the UCI "optical recognition of handwritten digits" test set),
shipped inside scikit-learn, so nothing is downloaded. Pixel values 0-16 are
divided by 16. The split is ``train_test_split(test_size=0.2, stratify=labels,
random_state=0)``: 1,437 training and 360 validation images, the same on every
machine. Each epoch visits the training images in the order of
``numpy.random.default_rng([seed, epoch]).permutation``, so every recipe sees
the same batches.

The model (Flax linen, no dtypes in it: the policy is applied from outside)
is three conv/BatchNorm/ReLU blocks and a dense head, with
:func:`jmp_lite.stage_boundary` between them for layer-wise loss scaling.
BatchNorm runs in fp32 under every policy (jmp_lite.flax's default override),
and its running statistics are not updated on a skipped step.

Run: python -m examples.digits                        (bf16 on CPU, ~15 s on 2 cores)
     python -m examples.digits --recipe fp16-dynamic --steps 1000
     python -m examples.digits --help
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl
from examples import common

CLASSES = 10


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """(train images, train labels, validation images, validation labels); images NHWC."""
  from sklearn.datasets import load_digits  # optional dependency of the examples only
  from sklearn.model_selection import train_test_split

  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  x_train, x_val, y_train, y_val = train_test_split(
    images, labels, test_size=0.2, stratify=labels, random_state=0
  )
  return x_train, y_train, x_val, y_val


class ConvNet(nn.Module):
  """conv-BN-ReLU x 3 (8x8 -> 8x8 -> 4x4 -> 2x2) and a dense head; stages 0-3."""

  width: int = 16

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
    for i, (features, stride) in enumerate(
      [(self.width, 1), (2 * self.width, 2), (4 * self.width, 2)]
    ):
      if i > 0:
        x = jl.stage_boundary(x, i - 1)  # identity unless layer-wise scaling
      x = nn.Conv(features, (3, 3), strides=stride, name=f"conv{i}")(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name=f"bn{i}")(x)
      x = nn.relu(x)
    x = jl.stage_boundary(x, 2)
    return nn.Dense(CLASSES, name="head")(x.reshape(x.shape[0], -1))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  width: int = 16
  batch_size: int = 64


PRESETS: dict[str, tuple[ModelConfig, common.TrainConfig]] = {
  "cpu": (ModelConfig(), common.TrainConfig(steps=300, learning_rate=3e-3, eval_every=50)),
  "quick": (
    ModelConfig(width=8, batch_size=32),
    common.TrainConfig(
      steps=30, learning_rate=3e-3, eval_every=15, stats_every=15, fast_compile=True
    ),
  ),
  "accelerator": (
    ModelConfig(width=64, batch_size=128),
    common.TrainConfig(steps=2000, learning_rate=2e-3, warmup_steps=100, eval_every=200),
  ),
}


class DigitsTask(common.Task):
  """10-class classification of the 8x8 digit images."""

  name = "digits"
  metric = "accuracy"
  stages = "each conv-BatchNorm-ReLU block, the dense head"
  mutable = ("batch_stats",)

  def __init__(self, model_config: ModelConfig, seed: int = 0):
    self.config = model_config
    self.seed = seed
    self.x_train, self.y_train, self.x_val, self.y_val = load_data()
    self.model = ConvNet(width=model_config.width)
    self._per_epoch = len(self.x_train) // model_config.batch_size  # drop the remainder
    self._order: dict[int, np.ndarray] = {}

  def init_inputs(self):
    return (jnp.zeros((1, 8, 8, 1), jnp.float32),)

  def train_batch(self, step: int) -> common.Batch:
    epoch, i = divmod(step, self._per_epoch)
    if epoch not in self._order:
      self._order = {
        epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.x_train))
      }
    size = self.config.batch_size
    idx = self._order[epoch][i * size : (i + 1) * size]
    return {"images": self.x_train[idx], "labels": self.y_train[idx]}

  def eval_batches(self) -> list[common.Batch]:
    return [{"images": self.x_val, "labels": self.y_val}]

  def model_args(self, batch, train):
    return (batch["images"],), {"train": train}

  def loss_terms(self, outputs, batch):
    logits = outputs.astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    return {
      "loss": jnp.sum(losses),
      "count": jnp.asarray(losses.size, jnp.float32),
      "correct": jnp.sum(jnp.argmax(logits, -1) == batch["labels"]).astype(jnp.float32),
    }

  def param_stages(self, params):
    stages = {"head": 3}
    stages.update({f"conv{i}": i for i in range(3)})
    stages.update({f"bn{i}": i for i in range(3)})
    return stages


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m examples.digits",
    description="Train a small BatchNorm convnet on scikit-learn's bundled digits under one "
    "mixed precision recipe.",
  )
  parser.add_argument("--recipe", default="half", help=common.recipe_help())
  common.add_preset_arguments(parser, PRESETS)
  g = parser.add_argument_group("model")
  g.add_argument("--width", type=int, default=None, help="channels of the first conv (16)")
  g.add_argument("--batch-size", type=int, default=None, help="images per step (64)")
  common.add_train_arguments(parser, PRESETS["cpu"][1])
  parser.add_argument("--json", help="write the run's results to this JSON file")
  return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = build_parser().parse_args(argv)
  platform = common.select_platform(args.platform)
  model_config, train_config = common.resolve_configs(args, PRESETS, platform)
  recipe = common.get_recipe(args.recipe)
  print(f"platform: {common.describe_platform()}")
  print(f"recipe: {recipe.name} ({recipe.summary})")
  task = DigitsTask(model_config, seed=train_config.seed)
  print(f"data: {len(task.x_train)} training / {len(task.x_val)} validation images")
  result = common.train(task, recipe, train_config)
  f = result.final
  print(
    f"train loss {f['train_loss']:.3f}, val loss {f['val_loss']:.3f}, "
    f"val accuracy {f['val_accuracy']:.3f}, skipped {len(result.skipped)} steps, "
    f"{result.step_time_ms:.1f} ms/step"
  )
  out = {"model": dataclasses.asdict(model_config), "result": result.as_dict()}
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(out, fh)
  return out


if __name__ == "__main__":
  main()
