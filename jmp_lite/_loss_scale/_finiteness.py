"""Finiteness of gradients, combined across devices, and the leaf-wise select of a skipped step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from jax import lax

from jmp_lite import _finite, _tree_util, _validation

T = TypeVar("T")


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
  """Whether every floating-point value in ``tree`` is finite (a bool scalar).

  Non-floating leaves (integers, ``float0``) are ignored; an empty tree is
  finite. With ``axis_name`` (a name or tuple of names bound by ``shard_map``,
  ``pmap`` or ``vmap``) the answer is combined across that axis, so every
  device takes the same decision. Under sharded ``jit`` no axis name is needed:
  the reduction is already global.

  Args:
    tree: any pytree.
    axis_name: the mapped axis (or axes) to agree across, or None.

  Returns:
    A bool scalar: True if no floating leaf holds an inf or NaN.

  >>> all_finite({"w": jnp.ones(3), "step": jnp.array(7)}).item()
  True
  >>> all_finite([jnp.ones(3), jnp.array([1.0, jnp.inf], jnp.float16)]).item()
  False
  """
  leaves = _finite.inexact_leaves(tree)
  # Exact on every backend; a sum guarded by a conditional on XLA:CPU, one
  # fused all(isfinite) pass elsewhere (jmp_lite/_finite.py says why).
  finite = _finite.all_finite(lambda: leaves) if leaves else jnp.array(True)
  return combine_across(finite, axis_name)


def combine_across(finite: jax.Array, axis_name: Any) -> jax.Array:
  """Makes every device along ``axis_name`` take the same decision."""
  if axis_name is not None:
    finite = lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
  return finite


def unscaled_all_finite(
  unscaled: Callable[[], Any], scaled_grads: Any, grads: Any, loss_scale: Any
) -> jax.Array:
  """``all_finite(grads)`` for ``grads = unscaled()``, reading the gradients once.

  The check traces its own unscale (XLA merges the copies): XLA:GPU and TPU
  fuse it into the ``all(isfinite)`` reduction. XLA:CPU sums the scaled
  gradients instead, which vouch for the unscaled ones when ``1/S <= 1`` and
  the cast to the parameter dtype does not narrow (fp32 to fp16 can overflow a
  finite value: such leaves are summed after the cast); its exact fallback
  unscales inside the conditional, so the unscaled gradients are never
  materialised for it.
  """
  if not _finite.inexact_leaves(grads):
    return jnp.array(True)
  proxies = []
  for scaled, grad in zip(
    jax.tree_util.tree_leaves(scaled_grads), jax.tree_util.tree_leaves(grads), strict=True
  ):
    if _finite.is_inexact(grad):
      wide = jnp.promote_types(jnp.result_type(scaled), jnp.float32)
      proxies.append(scaled if jnp.promote_types(wide, grad.dtype) == grad.dtype else grad)
  return _finite.all_finite(
    lambda: _finite.inexact_leaves(unscaled()), proxies, jnp.asarray(loss_scale) >= 1
  )


def select_tree(pred: jax.Array, a: T, b: T) -> T:
  """Leaf-wise ``a if pred else b`` for two trees of the same structure.

  Args:
    pred: a bool scalar (checked at trace time).
    a: the tree taken where ``pred`` is True.
    b: the tree taken where ``pred`` is False; matching leaves must have the
      same shape and dtype as ``a``'s.

  Returns:
    A tree with their structure, each leaf selected with ``lax.select`` (no
    branch, so it costs the same either way under ``jit``); a non-array leaf
    (an Equinox module's function) the two trees share is taken as it is.

  Raises:
    TypeError: for non-array leaves that differ (named by their path).

  >>> select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})["w"].tolist()
  [0.0, 0.0]
  """
  return _tree_util.select_leaves(_validation.check_predicate(pred, "pred"), a, b)
