"""An Equinox MLP on scikit-learn's digits, trained in fp16 with ``jl.autocast`` and loss scaling.

The model is an ``eqx.nn.MLP`` with fp32 parameters and no dtypes in it. Each step calls it
through ``jl.autocast`` (the policy applied op by op: its matmuls on fp16 operands, the
rest at the dtypes the program gives them, the logits returned in fp32), differentiates the
loss with ``jl.scaled_value_and_grad(..., value_and_grad=eqx.filter_value_and_grad)`` (the
module's floating arrays only; its activation functions are left alone), and updates it with
``jl.loss_scaling(optax.adam(...), jl.DynamicLossScale(...))`` and ``eqx.apply_updates``.

The loss scale starts at 2^24 on purpose: the first steps' fp16 gradients overflow, those
steps are skipped (zero updates, Adam's state untouched) and the scale halves until they
are finite; it then doubles after every ``--period`` finite steps. ``--precision fp32`` runs
the same script without 16-bit arithmetic (the reference), ``bf16`` with bf16 operands and no
loss scale. The data is scikit-learn's bundled 8x8 digits (nothing is downloaded): 1,437
training and 360 validation images.

Run: python -m examples.equinox_autocast                  (fp16, 100 steps, a few seconds)
     python -m examples.equinox_autocast --precision fp32
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl

POLICIES = {
  "fp32": "float32",
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


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m examples.equinox_autocast",
    description="Train an Equinox MLP on scikit-learn's digits with jl.autocast.",
  )
  parser.add_argument("--precision", choices=sorted(POLICIES), default="fp16")
  parser.add_argument("--steps", type=int, default=100)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=1e-2)
  parser.add_argument("--loss-scale", type=float, default=2.0**24, help="initial (fp16)")
  parser.add_argument("--period", type=int, default=20, help="finite steps between growths")
  parser.add_argument("--seed", type=int, default=0)
  return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = build_parser().parse_args(argv)
  policy = jl.get_policy(POLICIES[args.precision])
  x_train, y_train, x_val, y_val = load_digits()

  model = eqx.nn.MLP(64, 10, 64, 2, key=jax.random.key(args.seed))
  if args.precision == "fp16":
    loss_scale = jl.DynamicLossScale(jnp.float32(args.loss_scale), period=args.period)
  else:
    loss_scale = jl.NoOpLossScale()  # fp32 and bf16 need no loss scale
  tx = jl.loss_scaling(optax.adam(args.learning_rate), loss_scale)
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  # The forward pass under the policy: `model` is an argument, so its fp32 arrays are the
  # program's inputs (matmul operands in the compute dtype); its functions are constants.
  forward = jl.autocast(lambda model, x: jax.vmap(model)(x), policy)
  traces = []

  def loss_fn(model, x, y):
    logits = forward(model, x)  # fp32 (the policy's output dtype)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @eqx.filter_jit
  def train_step(model, opt_state, x, y):
    traces.append(None)  # runs once per trace: the loss scale moving must not retrace
    loss, grads = jl.scaled_value_and_grad(
      loss_fn, opt_state, value_and_grad=eqx.filter_value_and_grad
    )(model, x, y)
    dtypes = {g.dtype.name for g in jax.tree.leaves(grads)}  # the fp32 parameters' dtype
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    return eqx.apply_updates(model, updates), opt_state, loss, dtypes

  @eqx.filter_jit
  def accuracy(model, x, y):
    return jnp.mean(jnp.argmax(forward(model, x), -1) == y)

  losses, scales, skipped = [], [], []
  per_epoch = len(x_train) // args.batch_size
  order = np.random.default_rng(args.seed).permutation(len(x_train))
  for step in range(args.steps):
    if step and step % per_epoch == 0:
      order = np.random.default_rng([args.seed, step]).permutation(len(x_train))
    idx = order[(step % per_epoch) * args.batch_size :][: args.batch_size]
    scales.append(float(jl.get_loss_scale(opt_state).loss_scale))  # the scale this step uses
    model, opt_state, loss, dtypes = train_step(model, opt_state, x_train[idx], y_train[idx])
    losses.append(float(loss))
    if not bool(jl.get_loss_scaling_state(opt_state).last_finite):
      skipped.append(step)
  state = jl.get_loss_scaling_state(opt_state)
  arrays = eqx.filter(model, eqx.is_array)
  result = {
    "precision": args.precision,
    "train_loss": losses,
    "loss_scale": scales,
    "skipped": skipped,
    "skipped_steps": int(state.skipped_steps),
    "adam_count": int(state.inner_state[0].count),
    "grad_dtypes": sorted(dtypes),
    "param_dtypes": sorted({p.dtype.name for p in jax.tree.leaves(arrays)}),
    "val_accuracy": float(accuracy(model, x_val, y_val)),
    "traces": len(traces),
  }
  print(
    f"{args.precision}: loss {losses[0]:.3f} -> {np.mean(losses[-5:]):.3f}, "
    f"val accuracy {result['val_accuracy']:.3f}, skipped steps {skipped}, "
    f"final loss scale {scales[-1]:g}"
  )
  return result


if __name__ == "__main__":
  main()
