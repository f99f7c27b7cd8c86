"""One case of ``tests/flax/test_sharding.py``, run in a process of its own.

Usage: ``python sharding_worker.py CASE`` with 8 host devices (``XLA_FLAGS``). A small causal
language model (``nn.Embed``, ``nn.LayerNorm``, ``nn.MultiHeadDotProductAttention``, a GELU MLP,
a vocabulary head) is trained one step (``jax.value_and_grad`` and an AdamW update, jitted)
under ``policy_apply`` with its parameters sharded on their first axis over the mesh axis of the
batch (FSDP), and the same step runs on one device as the reference. Prints one JSON line.
"""

import json
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_lite as jl

VOCAB, WIDTH, LENGTH = 32, 16, 8
POLICY = "p=f32,c=bf16,o=f32"


class ExplicitEmbed(nn.Embed):
  """``nn.Embed`` whose lookup states its output sharding (explicit axes need it)."""

  def __call__(self, inputs):
    (table,) = self.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
    spec = jax.typeof(inputs).sharding.spec
    return table.at[inputs].get(out_sharding=P(*spec, None))


class LM(nn.Module):
  embed: type = nn.Embed

  @nn.compact
  def __call__(self, tokens):
    x = self.embed(VOCAB, WIDTH, name="embed")(tokens)
    y = nn.LayerNorm()(x)
    mask = nn.make_causal_mask(tokens)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2)(y, y, mask=mask)
    x = x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))))
    return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def train_step(apply_fn, gather=None):
  """A jitted step: loss, gradients and an AdamW update; ``gather`` maps the params first."""
  tx = optax.adamw(1e-3)

  def loss_fn(params, tokens):
    if gather is not None:
      params = gather(params)
    logits = apply_fn({"params": params}, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

  @jax.jit
  def step(params, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, _ = tx.update(grads, tx.init(params), params)
    return loss, grads, optax.apply_updates(params, updates)  # the update runs sharded too

  return step


def relative_error(tree, reference) -> float:
  """``max|a - b|`` over all leaves, relative to the largest ``|b|`` of the reference tree.

  One scale for the whole tree: a leaf whose exact gradient is 0 (the key bias, which the
  softmax ignores) has only rounding noise, whatever the partitioning.
  """
  pairs = [
    (np.asarray(a, np.float64), np.asarray(b, np.float64))
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(reference), strict=True)
  ]
  scale = max(float(np.max(np.abs(b))) for _, b in pairs)
  return max(float(np.max(np.abs(a - b))) for a, b in pairs) / scale


def main(case: str) -> dict:
  axis_type = AxisType.Auto if case.startswith("auto") else AxisType.Explicit
  mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
  batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  tokens_host = (np.arange(8 * LENGTH).reshape(8, LENGTH) * 7) % VOCAB
  model = LM(embed=ExplicitEmbed if case == "explicit_gathered" else nn.Embed)
  reference_model = LM()  # the same parameters, on one device with Flax's own nn.Embed
  # Compiled: eagerly, every initializer compiles on its own (seconds on 2 cores).
  params_host = jax.jit(reference_model.init)(jax.random.key(0), tokens_host)["params"]

  def fsdp(leaf):
    return batch if leaf.shape[0] % 8 == 0 else replicated

  gather = None
  if case == "explicit_auto_axes":  # docs/multi-device.md: the model under auto axes
    apply_fn = jax.sharding.auto_axes(jl.flax.policy_apply(model, POLICY), out_sharding=batch)
  elif case == "explicit_gathered":  # explicit axes inside the model: the user gathers
    apply_fn = jl.flax.policy_apply(model, POLICY)
    gather = lambda params: jax.tree.map(lambda p: jax.sharding.reshard(p, replicated), params)
  elif case == "auto":
    apply_fn = jl.flax.policy_apply(model, POLICY)
  else:
    raise ValueError(f"unknown case {case!r}")

  reference = train_step(jl.flax.policy_apply(reference_model, POLICY))(params_host, tokens_host)

  params = jax.device_put(params_host, jax.tree.map(fsdp, params_host))
  tokens = jax.device_put(tokens_host, batch)
  with jax.set_mesh(mesh):
    loss, grads, new_params = train_step(apply_fn, gather)(params, tokens)

  def layout(tree):  # how each leaf is split over the devices
    return jax.tree.map(lambda a: list(a.sharding.shard_shape(a.shape)), tree)

  return {
    "loss": float(loss),
    "reference_loss": float(reference[0]),
    "grad_error": relative_error(grads, reference[1]),
    "param_dtypes": sorted({str(a.dtype) for a in jax.tree.leaves(new_params)}),
    "layout_kept": layout(new_params) == layout(params) == layout(grads),
    "sharded_leaves": sum(fsdp(a) is batch for a in jax.tree.leaves(params_host)),
  }


if __name__ == "__main__":
  print(json.dumps(main(sys.argv[1])))
