"""A Haiku convnet on scikit-learn's digits, trained in bf16 with ``jl.autocast`` on its apply.

The model is a function transformed by ``hk.transform`` (a conv, a LayerNorm, dropout and a
linear head, no dtypes in it); its parameters are fp32. Each step runs
``jl.autocast(model.apply, policy)(params, rng, images)``: the conv and the head take bf16
operands, the LayerNorm's statistics (``reduce_sum``, ``rsqrt``) run in fp32, the dropout key
passes through, and the logits come back in fp32. The gradients are those of the fp32
parameters (fp32); ``jl.loss_scaling(optax.adam(...), jl.NoOpLossScale())`` applies them and
would skip a step whose gradients are not finite (bf16 needs no loss scale; ``--precision
fp16`` uses a dynamic one). ``--precision fp32`` is the reference run of the same script. The
data is ``examples.digits.load_data`` (bundled with scikit-learn, no download).

Run: python -m examples.haiku_autocast                    (bf16, 40 steps, a few seconds)
     python -m examples.haiku_autocast --precision fp32
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl
from examples.digits import load_data

POLICIES = {
  "fp32": "float32",
  "bf16": "params=float32,compute=bfloat16,output=float32",
  "fp16": "params=float32,compute=float16,output=float32",
}


def forward(images: jax.Array, is_training: bool) -> jax.Array:
  """conv 3x3 (8 channels) -> LayerNorm -> ReLU -> dropout -> linear head (10 classes)."""
  x = hk.Conv2D(8, 3)(images)  # NHWC
  x = jax.nn.relu(hk.LayerNorm(axis=-1, create_scale=True, create_offset=True)(x))
  x = hk.Flatten()(x)
  if is_training:
    x = hk.dropout(hk.next_rng_key(), 0.1, x)
  return hk.Linear(10)(x)


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="python -m examples.haiku_autocast",
    description="Train a Haiku convnet on scikit-learn's digits with jl.autocast.",
  )
  parser.add_argument("--precision", choices=sorted(POLICIES), default="bf16")
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=1e-2)
  parser.add_argument("--seed", type=int, default=0)
  return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  args = build_parser().parse_args(argv)
  policy = jl.get_policy(POLICIES[args.precision])
  x_train, y_train, x_val, y_val = load_data()

  model = hk.transform(forward)
  key, init_key = jax.random.split(jax.random.key(args.seed))
  params = jax.jit(model.init, static_argnums=2)(init_key, x_train[:1], True)
  if args.precision == "fp16":
    loss_scale = jl.DynamicLossScale(jnp.float32(2.0**15))
  else:
    loss_scale = jl.NoOpLossScale()
  tx = jl.loss_scaling(optax.adam(args.learning_rate), loss_scale)
  opt_state = tx.init(params)
  apply = jl.autocast(model.apply, policy)  # apply's signature: (params, rng, images, ...)

  def loss_fn(params, rng, x, y):
    logits = apply(params, rng, x, True)  # fp32 (the policy's output dtype)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def train_step(params, opt_state, rng, x, y):
    loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, rng, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(apply(params, None, x, False), -1) == y)

  losses = []
  per_epoch = len(x_train) // args.batch_size
  order = np.random.default_rng(args.seed).permutation(len(x_train))
  for step in range(args.steps):
    if step and step % per_epoch == 0:
      order = np.random.default_rng([args.seed, step]).permutation(len(x_train))
    idx = order[(step % per_epoch) * args.batch_size :][: args.batch_size]
    key, rng = jax.random.split(key)
    params, opt_state, loss = train_step(params, opt_state, rng, x_train[idx], y_train[idx])
    losses.append(float(loss))
  state = jl.get_loss_scaling_state(opt_state)
  grads = jax.eval_shape(jax.grad(loss_fn), params, rng, x_train[idx], y_train[idx])
  result = {
    "precision": args.precision,
    "train_loss": losses,
    "skipped_steps": int(state.skipped_steps),
    "grad_dtypes": sorted({g.dtype.name for g in jax.tree.leaves(grads)}),
    "param_dtypes": sorted({p.dtype.name for p in jax.tree.leaves(params)}),
    "val_accuracy": float(accuracy(params, x_val, y_val)),
  }
  print(
    f"{args.precision}: loss {losses[0]:.3f} -> {np.mean(losses[-5:]):.3f}, "
    f"val accuracy {result['val_accuracy']:.3f}, skipped {result['skipped_steps']} steps"
  )
  return result


if __name__ == "__main__":
  main()
