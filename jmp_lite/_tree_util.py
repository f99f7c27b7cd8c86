"""Tree helpers shared by the loss scales (private)."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp

T = TypeVar("T")


def is_float(x: Any) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def scale_tree(tree: T, scale: jax.Array) -> T:
  """Multiplies the floating leaves by ``scale`` (JAX's type promotion)."""

  def scale_leaf(x):
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      return x
    return x * scale

  return jax.tree_util.tree_map(scale_leaf, tree)


def unscale_tree(tree: T, scale: jax.Array) -> T:
  """Divides the floating leaves by ``scale``, in at least fp32."""

  # Unscaling in 16 bits would push the small gradients that scaling rescued
  # straight back under fp16's range.
  def unscale_leaf(x):
    if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
      return x
    dtype = jnp.promote_types(jnp.result_type(x), jnp.float32)
    return jnp.asarray(x, dtype) * (1 / scale.astype(dtype))

  return jax.tree_util.tree_map(unscale_leaf, tree)


def cast_like_params(grads: Any, params: Any) -> Any:
  """Casts unscaled gradients to at least fp32, or to each parameter's dtype.

  The inner optimizer's state was created from the params, so gradients in the
  param dtype keep the state's dtypes (and the jitted step's signature) fixed.
  """
  if params is None:
    return jax.tree.map(
      lambda g: jnp.asarray(g, jnp.promote_types(g.dtype, jnp.float32)) if is_float(g) else g,
      grads,
    )
  return jax.tree.map(
    lambda g, p: g.astype(p.dtype) if is_float(g) and is_float(p) else g, grads, params
  )
