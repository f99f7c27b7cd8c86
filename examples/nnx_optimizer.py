"""A Flax NNX MLP with BatchNorm, trained in fp16 through ``jl.flax.Optimizer``.

The model is an ``nnx.Module`` with fp32 parameters and no dtypes in it. Each step builds
``jlf.policy_view(model, policy)`` inside the jitted function: a view of the model whose
parameters are fp16 casts of the model's own (the gradients reach the fp32 parameters),
whose ``BatchNorm`` computes in fp32 and whose output comes back in fp32. ``jlf.Optimizer``
is ``nnx.Optimizer`` with a loss scale: ``optimizer.value_and_grad`` differentiates the loss
times the current scale, ``optimizer.update`` unscales in fp32, skips a step whose gradients
are not finite (the forward pass's batch statistics are then restored too) and moves the
scale. It starts at 2^24 on purpose: the first steps overflow and are skipped until it has
halved enough; it doubles after ``--period`` finite steps. The data is scikit-learn's
bundled 8x8 digits (nothing is downloaded).

Run: python examples/nnx_optimizer.py                    (fp16, 120 steps)
     python examples/nnx_optimizer.py --precision fp32   (the reference)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_lite as jl
import jmp_lite.flax as jlf

POLICIES = {
  "fp32": "params=float32,compute=float32,output=float32",
  "bf16": "params=float32,compute=bfloat16,output=float32",
  "fp16": "params=float32,compute=float16,output=float32",
}


def load_digits() -> tuple[np.ndarray, ...]:
  """(train images, train labels, validation images, validation labels): 1,437 / 360."""
  from sklearn.datasets import load_digits as sklearn_digits
  from sklearn.model_selection import train_test_split

  digits = sklearn_digits()
  x = (digits.data / 16.0).astype(np.float32)  # 64 pixels in [0, 1]
  y = digits.target.astype(np.int32)
  x_train, x_val, y_train, y_val = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
  return x_train, y_train, x_val, y_val


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs, hidden: int = 128):
    self.hidden = nnx.Linear(64, hidden, rngs=rngs)
    self.norm = nnx.BatchNorm(hidden, momentum=0.9, rngs=rngs)
    self.out = nnx.Linear(hidden, 10, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(nnx.relu(self.norm(self.hidden(x))))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--precision", choices=sorted(POLICIES), default="fp16")
  parser.add_argument("--steps", type=int, default=120)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--loss-scale", type=float, default=2.0**24, help="initial (fp16)")
  parser.add_argument("--period", type=int, default=20, help="finite steps before growing")
  args = parser.parse_args(argv)

  policy = jl.get_policy(POLICIES[args.precision])
  fp16 = args.precision == "fp16"
  model = MLP(nnx.Rngs(0))
  optimizer = jlf.Optimizer(
    model,
    optax.adamw(args.learning_rate),  # wrapped in jl.loss_scaling by the Optimizer
    wrt=nnx.Param,
    loss_scale=jl.DynamicLossScale(jnp.float32(args.loss_scale), period=args.period)
    if fp16
    else None,  # no scaling; non-finite steps are still skipped
  )

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      logits = jlf.policy_view(model, policy)(x)  # fp16 inside, fp32 logits
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = optimizer.value_and_grad(loss_fn)(model)  # grads of the scaled loss
    optimizer.update(model, grads)  # unscale; skip if inf/NaN; adjust the scale
    return loss

  @nnx.jit
  def accuracy(model, x, y):
    return jnp.mean(jnp.argmax(jlf.policy_view(model, policy)(x), -1) == y)

  x_train, y_train, x_val, y_val = load_digits()
  rng = np.random.default_rng(0)
  losses, scales, skipped = [], [], []
  model.train()  # BatchNorm: batch statistics, running averages updated
  for step in range(args.steps):
    idx = rng.choice(len(x_train), args.batch_size, replace=False)
    scales.append(float(optimizer.loss_scale.loss_scale))  # the scale this step uses
    losses.append(float(train_step(model, optimizer, x_train[idx], y_train[idx])))
    if not bool(optimizer.loss_scaling_state.last_finite):
      skipped.append(step)
  model.eval()  # BatchNorm: the running averages

  state = optimizer.loss_scaling_state
  params = nnx.state(model, nnx.Param)
  result = {
    "precision": args.precision,
    "train_loss": losses,
    "loss_scale": scales,
    "skipped": skipped,
    "skipped_steps": int(state.skipped_steps),
    "adam_count": int(state.inner_state[0].count),  # advances on applied steps only
    "param_dtypes": sorted({p.dtype.name for p in jax.tree.leaves(params)}),
    "val_accuracy": float(accuracy(model, x_val, y_val)),
  }
  print(
    f"{args.precision}: val accuracy {result['val_accuracy']:.3f}, skipped {len(skipped)} of "
    f"{args.steps} steps, final loss scale {scales[-1]:g}"
  )
  return result


if __name__ == "__main__":
  main()
