"""``benchmarks/memory.py``'s transformer LM written in Flax NNX, for the NNX recipes of
``benchmarks/gpu.py`` (the same layers, shapes and initializers' kinds; its own parameters)."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx


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
