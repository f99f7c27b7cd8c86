"""The models the benchmarks share: a pre-LN decoder LM in Flax linen and the same LM in NNX.

``TransformerLM``: token embedding and learned positions, Flax ``MultiHeadDotProductAttention``
with a causal mask, a GELU MLP 4x, a final LayerNorm and a head. ``NnxTransformerLM``: the same
layers, shapes and initializers' kinds in NNX, with its own parameters.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx


class Block(nn.Module):
  width: int
  heads: int
  dtype: Any = None

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm(dtype=self.dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(h, h, mask=mask)
    h = nn.Dense(4 * self.width, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
    return x + nn.Dense(self.width, dtype=self.dtype)(nn.gelu(h))


class TransformerLM(nn.Module):
  vocab: int
  width: int
  heads: int
  layers: int
  length: int
  dtype: Any = None  # None: Flax's defaults (what jmp_lite's policy runs)

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.width, dtype=self.dtype)(tokens)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.length, self.width))
    x = x + pos.astype(x.dtype)
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.layers):
      x = Block(self.width, self.heads, self.dtype)(x, mask)
    return nn.Dense(self.vocab, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


def lm_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Next-token cross-entropy; the loss is an fp32 island in every variant."""
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


class NnxBlock(nnx.Module):
  def __init__(self, width: int, heads: int, dtype: Any, rngs: nnx.Rngs):
    self.norm_attention = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
      heads, width, dtype=dtype, decode=False, deterministic=True, rngs=rngs
    )
    self.norm_mlp = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    h = self.norm_attention(x)
    x = x + self.attention(h, h, mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm_mlp(x))))


class NnxTransformerLM(nnx.Module):
  """``TransformerLM`` in NNX; ``dtype=None`` is Flax's default (what a policy runs)."""

  def __init__(
    self, vocab: int, width: int, heads: int, layers: int, length: int, *, dtype: Any = None
  ):
    rngs = nnx.Rngs(0)
    self.embed = nnx.Embed(vocab, width, dtype=dtype, rngs=rngs)
    self.pos = nnx.Param(jax.random.normal(rngs.params(), (length, width)) * 0.02)
    self.blocks = nnx.List([NnxBlock(width, heads, dtype, rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(width, dtype=dtype, rngs=rngs)
    self.head = nnx.Linear(width, vocab, dtype=dtype, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    x = x + self.pos[...].astype(x.dtype)
    mask = nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.head(self.norm(x))


def split_lm(config: dict[str, int], dtype: Any = None) -> tuple[nnx.GraphDef, Any]:
  """The model's graph definition (static) and a function building its parameters."""
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: NnxTransformerLM(**config, dtype=dtype)))
  return graphdef, lambda: nnx.split(NnxTransformerLM(**config, dtype=dtype))[1]


__all__ = ["NnxTransformerLM", "split_lm"]
