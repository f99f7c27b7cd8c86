"""A Flax linen convnet with BatchNorm, trained in fp16 through ``jl.flax.TrainState``.

The model is written as Flax models are, with no dtypes in it. ``jlf.TrainState.create``
takes the model's ``apply``, the plain optimizer, a ``jlf.ModulePolicies`` and a loss scale:
it runs the model through ``jlf.policy_apply`` (convolutions and the head in fp16 with fp32
accumulation; BatchNorm, the logits and the loss in fp32; the head kept in fp32 here by an
override) and wraps the optimizer in ``jl.loss_scaling``. The step is Flax's own, with
``state.value_and_grad`` (the gradients of the scaled loss) in place of ``jax.value_and_grad``;
``apply_gradients`` unscales, skips a non-finite step (its new batch statistics too) and
adjusts the scale. It starts at 2^24 on purpose: the first steps overflow and are skipped
until it has halved enough; it doubles after ``--period`` finite steps. The data is
scikit-learn's bundled 8x8 digits (nothing is downloaded).

Run: python examples/linen_train_state.py                    (fp16, 120 steps)
     python examples/linen_train_state.py --precision fp32   (the reference)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl
import jmp_lite.flax as jlf

POLICIES = {
  "fp32": "params=float32,compute=float32,output=float32",
  "bf16": "params=float32,compute=bfloat16,output=float32",
  "fp16": "params=float32,compute=float16,output=float32",
}


def load_digits() -> tuple[np.ndarray, ...]:
  """(train images, train labels, validation images, validation labels), images NHWC."""
  from sklearn.datasets import load_digits as sklearn_digits
  from sklearn.model_selection import train_test_split

  digits = sklearn_digits()
  x = (digits.images / 16.0).astype(np.float32)[..., None]
  y = digits.target.astype(np.int32)
  x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
  return x_train, y_train, x_val, y_val


class ConvNet(nn.Module):
  """Two conv-BatchNorm-ReLU blocks (8x8 -> 8x8 -> 4x4) and a dense head."""

  @nn.compact
  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    for features, stride in ((16, 1), (32, 2)):
      x = nn.Conv(features, (3, 3), strides=stride)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(x))
    return nn.Dense(10, name="head")(x.reshape(x.shape[0], -1))


class TrainState(jlf.TrainState):
  batch_stats: Any  # BatchNorm's running statistics, as in Flax's own examples


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--precision", choices=sorted(POLICIES), default="fp16")
  parser.add_argument("--steps", type=int, default=120)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--loss-scale", type=float, default=2.0**24, help="initial (fp16)")
  parser.add_argument("--period", type=int, default=20, help="finite steps before growing")
  args = parser.parse_args(argv)

  x_train, y_train, x_val, y_val = load_digits()
  model = ConvNet()
  variables = jax.jit(model.init, static_argnums=2)(jax.random.key(0), x_train[:1], False)
  # One override on top of the defaults (fp32 BatchNorm, LayerNorm, softmax...): the head too.
  policies = jlf.ModulePolicies(POLICIES[args.precision], {nn.Dense: "float32"})
  fp16 = args.precision == "fp16"
  state = TrainState.create(
    apply_fn=model.apply,  # replaced by jlf.policy_apply(model, policies)
    params=variables["params"],  # fp32 master weights
    batch_stats=variables["batch_stats"],
    tx=optax.adamw(args.learning_rate),  # wrapped in jl.loss_scaling by create
    policy=policies,
    loss_scale=jl.DynamicLossScale(jnp.float32(args.loss_scale), period=args.period)
    if fp16
    else None,  # no scaling; non-finite steps are still skipped
  )

  traces = []  # the step's Python body runs once per trace, never on a compiled call

  @jax.jit
  def train_step(state, x, y):
    traces.append(1)

    def loss_fn(params):
      variables = {"params": params, "batch_stats": state.batch_stats}
      logits, updates = state.apply_fn(variables, x, True, mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
      return loss, updates["batch_stats"]

    (loss, batch_stats), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss

  @jax.jit
  def accuracy(state, x, y):
    logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats}, x, False)
    return jnp.mean(jnp.argmax(logits, -1) == y)

  rng = np.random.default_rng(0)
  losses, scales, skipped = [], [], []
  for step in range(args.steps):
    idx = rng.choice(len(x_train), args.batch_size, replace=False)
    scales.append(float(state.loss_scale.loss_scale))  # the scale this step uses
    state, loss = train_step(state, x_train[idx], y_train[idx])
    losses.append(float(loss))
    if not bool(state.loss_scaling_state.last_finite):
      skipped.append(step)

  result = {
    "precision": args.precision,
    "train_loss": losses,
    "loss_scale": scales,
    "skipped": skipped,
    "steps": int(state.step),  # skipped steps included
    "skipped_steps": int(state.loss_scaling_state.skipped_steps),
    "adam_count": int(state.loss_scaling_state.inner_state[0].count),  # applied steps only
    "param_dtypes": sorted({p.dtype.name for p in jax.tree.leaves(state.params)}),
    "stats_dtypes": sorted({s.dtype.name for s in jax.tree.leaves(state.batch_stats)}),
    "traces": len(traces),
    "val_accuracy": float(accuracy(state, x_val, y_val)),
  }
  print(
    f"{args.precision}: val accuracy {result['val_accuracy']:.3f}, skipped {len(skipped)} of "
    f"{args.steps} steps, final loss scale {scales[-1]:g}"
  )
  return result


if __name__ == "__main__":
  main()
