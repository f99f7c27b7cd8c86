"""Plain JAX and Optax in fp16 with a dynamic loss scale: README's training step, complete.

A two-layer MLP, written as a function of a dict of fp32 parameters, classifies
scikit-learn's bundled 8x8 digits (nothing is downloaded). The step is README's: the
policy casts the parameters and the images to fp16 for the forward and backward pass and
the logits back to fp32 for the loss; ``jl.scaled_value_and_grad`` differentiates the loss
times the current scale; ``jl.loss_scaling(optax.adamw(...), jl.DynamicLossScale(...))``
unscales the gradients in fp32, skips a step whose gradients are not finite and moves the
scale. The scale starts at 2^24 on purpose: the first steps overflow fp16, are skipped and
halve it; after ``--period`` finite steps in a row it doubles.

Run: python examples/optax_fp16.py                    (fp16, 150 steps, a few seconds)
     python examples/optax_fp16.py --precision fp32   (the reference)
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl

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


def init_params(key: jax.Array, hidden: int = 128) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  return {
    "w1": jax.random.normal(k1, (64, hidden)) / 8.0,
    "b1": jnp.zeros(hidden),
    "w2": jax.random.normal(k2, (hidden, 10)) / np.sqrt(hidden),
    "b2": jnp.zeros(10),
  }


def model(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--precision", choices=sorted(POLICIES), default="fp16")
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--loss-scale", type=float, default=2.0**24, help="initial (fp16)")
  parser.add_argument("--period", type=int, default=25, help="finite steps before growing")
  args = parser.parse_args(argv)

  policy = jl.get_policy(POLICIES[args.precision])
  if args.precision == "fp16":
    loss_scale = jl.DynamicLossScale(jnp.float32(args.loss_scale), period=args.period)
  else:
    loss_scale = jl.NoOpLossScale()  # fp32 and bf16 need no scale; non-finite steps still skip
  tx = jl.loss_scaling(optax.adamw(args.learning_rate), loss_scale)
  params = init_params(jax.random.key(0))  # fp32 master weights
  opt_state = tx.init(params)

  traces = []  # the step's Python body runs once per trace, never on a compiled call

  @jax.jit
  def train_step(params, opt_state, x, y):
    traces.append(1)

    def loss_fn(p):  # fp16 forward and backward pass, fp32 loss
      logits = model(policy.cast_to_compute(p), policy.cast_to_compute(x))
      return cross_entropy(policy.cast_to_output(logits), y)

    loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params)  # grads of scale * loss
    updates, opt_state = tx.update(grads, opt_state, params)  # unscale; skip if inf/NaN; adjust
    return optax.apply_updates(params, updates), opt_state, loss

  @jax.jit
  def accuracy(params, x, y):
    logits = model(policy.cast_to_compute(params), policy.cast_to_compute(x))
    return jnp.mean(jnp.argmax(logits, -1) == y)

  x_train, y_train, x_val, y_val = load_digits()
  rng = np.random.default_rng(0)
  losses, scales, skipped = [], [], []
  for step in range(args.steps):
    idx = rng.choice(len(x_train), args.batch_size, replace=False)
    scales.append(float(jl.get_loss_scale(opt_state).loss_scale))  # the scale this step uses
    params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
    losses.append(float(loss))
    if not bool(jl.get_loss_scaling_state(opt_state).last_finite):
      skipped.append(step)

  state = jl.get_loss_scaling_state(opt_state)
  result = {
    "precision": args.precision,
    "train_loss": losses,
    "loss_scale": scales,
    "skipped": skipped,
    "skipped_steps": int(state.skipped_steps),
    "adam_count": int(state.inner_state[0].count),  # advances on applied steps only
    "param_dtypes": sorted({p.dtype.name for p in jax.tree.leaves(params)}),
    "traces": len(traces),  # 1: the moving scale is state, not a constant
    "val_accuracy": float(accuracy(params, x_val, y_val)),
  }
  print(
    f"{args.precision}: val accuracy {result['val_accuracy']:.3f}, skipped {len(skipped)} of "
    f"{args.steps} steps, final loss scale {scales[-1]:g}"
  )
  return result


if __name__ == "__main__":
  main()
