"""Tree helpers shared by the loss scales and the Flax wrappers (private)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

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
  """Casts unscaled gradients to at least fp32, and at least each parameter's dtype.

  16-bit parameters get fp32 gradients: the update is computed in fp32 (in fp16
  the small gradients that scaling rescued would underflow again), and the
  inner optimizer keeps its state's dtypes (see :func:`cast_like`).
  """
  if params is None:
    return jax.tree.map(lambda g: jnp.asarray(g, _wide(g.dtype)) if is_float(g) else g, grads)
  return jax.tree.map(
    lambda g, p: (
      g.astype(_wide(jnp.promote_types(g.dtype, p.dtype))) if is_float(g) and is_float(p) else g
    ),
    grads,
    params,
  )


def _wide(dtype: Any) -> Any:
  return jnp.promote_types(dtype, jnp.float32)


def cast_like(tree: T, like: T) -> T:
  """``tree`` with each floating leaf cast to the dtype of its counterpart in ``like``.

  An optimizer updating 16-bit state from fp32 gradients returns fp32 state;
  cast back, the state (and the jitted step's signature) keeps its dtypes.
  """
  return jax.tree.map(
    lambda x, y: x.astype(y.dtype) if is_float(x) and is_float(y) else x, tree, like
  )


def split_leaves(
  tree: Any, traced: Callable[[Any], bool], is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[Any], Callable[[list[Any]], Any]]:
  """Splits ``tree`` into the leaves a transform traces and a function rebuilding it.

  Args:
    tree: a pytree, e.g. ``(args, kwargs)`` of a call.
    traced: whether a leaf is passed through the transform (an array); the
      other leaves (a ``train`` flag, a mode string) stay what they are.
    is_leaf: as for :func:`jax.tree_util.tree_flatten`.

  Returns:
    ``(values, rebuild)``: the traced leaves in order, and a function that
    takes new values for them and returns ``tree`` with those in their place.
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_leaf)
  mask = [traced(x) for x in leaves]

  def rebuild(values: list[Any]) -> Any:
    it = iter(values)
    return jax.tree_util.tree_unflatten(
      treedef, [next(it) if t else x for x, t in zip(leaves, mask, strict=True)]
    )

  return [x for x, t in zip(leaves, mask, strict=True) if t], rebuild


def copy_arrays(tree: T) -> T:
  """``tree`` with every JAX array leaf copied into a buffer of its own.

  What an ``init`` builds from an object given at construction (a loss scale,
  a key) must not share that object's buffers: a step that donates one state
  would delete them for every other state built from it. The copies keep their
  shardings, dtypes (typed PRNG keys too) and weak types; under ``jit`` or
  ``eval_shape`` they are traced like any other op. Other leaves (NumPy
  arrays, which donation never deletes, and Python values) are kept as they are.

  Args:
    tree: any pytree.

  Returns:
    ``tree`` with each ``jax.Array`` leaf replaced by a copy.
  """
  return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x, tree)


_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def select_leaves(pred: Any, a: Any, b: Any) -> Any:
  """``lax.select(pred, ...)`` leaf by leaf; a non-array leaf both trees share is kept.

  Args:
    pred: a checked bool scalar.
    a: the tree taken where ``pred`` is True.
    b: the tree taken where it is False.

  Returns:
    The selected tree.

  Raises:
    TypeError: for non-array leaves that differ (named by their path).
  """

  def select(path, x, y):
    if isinstance(x, _ARRAY_LIKE) and isinstance(y, _ARRAY_LIKE):
      return jax.lax.select(pred, jnp.asarray(x), jnp.asarray(y))
    if x is y:
      return x
    raise TypeError(
      f"select_tree: the leaves at {jax.tree_util.keystr(path)} are not both arrays and are not "
      f"the same object ({x!r}, {y!r}); filter the trees first (e.g. with eqx.filter)."
    )

  return jax.tree_util.tree_map_with_path(select, a, b)


def is_array(x: Any) -> bool:
  """Whether ``x`` is a JAX or NumPy array (what a transform traces)."""
  return isinstance(x, (jax.Array, np.ndarray))
