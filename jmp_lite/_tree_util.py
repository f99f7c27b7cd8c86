"""Tree helpers shared by the loss scales (private)."""

from __future__ import annotations

import copy
from collections.abc import Callable
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


def register_dataclass(
  cls,
  data_fields: tuple[str, ...],
  meta_fields: tuple[str, ...],
  rebuild: Callable[[Any], None] | None = None,
):
  """Registers a frozen dataclass as a pytree whose unflatten skips __init__.

  JAX rebuilds pytrees from placeholders (tracers, ``object()``, None), which
  must not go through validation; jmp's custom unflatten also dropped
  ``min_loss_scale``. Here every field round-trips: data fields as leaves,
  meta fields as static aux data; ``rebuild(obj)`` then restores fields derived
  from them.
  """

  def flatten_with_keys(obj):
    children = [(jax.tree_util.GetAttrKey(f), getattr(obj, f)) for f in data_fields]
    return children, tuple(getattr(obj, f) for f in meta_fields)

  def flatten(obj):
    return ([getattr(obj, f) for f in data_fields], tuple(getattr(obj, f) for f in meta_fields))

  def unflatten(meta, children):
    obj = object.__new__(cls)
    for name, value in zip(data_fields + meta_fields, (*children, *meta), strict=True):
      object.__setattr__(obj, name, value)
    if rebuild is not None:
      rebuild(obj)
    return obj

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  return cls


def replace_fields(obj: T, **changes) -> T:
  """dataclasses.replace without re-running validation (for new state)."""
  new = copy.copy(obj)
  for name, value in changes.items():
    object.__setattr__(new, name, value)
  return new
