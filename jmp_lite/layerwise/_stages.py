"""Which stage each parameter belongs to: ``param_stages`` and its leaves.

``param_stages`` is a pytree with the structure of the parameters (or a
prefix of it) whose leaves are stage indices: an int, or a
:class:`StackedStages` for a parameter whose leading axis is a scanned stack
of layers. The helpers here map gradient leaves to their stages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class StackedStages(tuple):
  """Stage indices of a stacked parameter, one per index of its leading axis.

  For a scanned stack of layers whose parameters have a leading layer axis:
  ``StackedStages(range(1, 5))`` puts layer i of the stack in stage i + 1.

  Args:
    stages: the stage of each slice along the leading axis (ints).
  """

  def __new__(cls, stages):
    return super().__new__(cls, (int(i) for i in stages))


Spec = int | StackedStages
"""A leaf of ``param_stages``."""


def stages_from_paths(params: Any, assign: Callable[[tuple], int]) -> Any:
  """Builds ``param_stages`` by calling ``assign(path)`` for every parameter leaf.

  Args:
    params: the parameters (or anything with their structure).
    assign: maps a leaf's key path (a tuple of JAX keys) to its stage index
      (or a :class:`StackedStages`).

  Returns:
    A pytree with ``params``' structure whose leaves are ``assign``'s answers.

  >>> stages_from_paths({"enc": {"w": 0}, "dec": {"w": 0}},
  ...                   lambda path: 0 if path[0].key == "enc" else 1)
  {'dec': {'w': 1}, 'enc': {'w': 0}}
  """
  return jax.tree_util.tree_map_with_path(lambda path, _: assign(path), params)


def is_spec(x: Any) -> bool:
  """Whether ``x`` is a leaf of ``param_stages``."""
  return isinstance(x, (int, np.integer, StackedStages)) and not isinstance(x, bool)


def flatten_stages(param_stages: Any) -> tuple[Any, tuple[Spec, ...], int]:
  """``(treedef, specs, largest stage index)`` of a user's ``param_stages``, checked.

  Raises:
    ValueError: if there are no stage indices.
    TypeError: if a leaf is neither an int nor a non-empty :class:`StackedStages`.
  """
  specs, treedef = jax.tree.flatten(param_stages, is_leaf=is_spec)
  if not specs:
    raise ValueError("param_stages is empty: give a stage index for the parameters.")
  for spec in specs:
    if not is_spec(spec) or (isinstance(spec, StackedStages) and not spec):
      raise TypeError(
        "param_stages leaves must be int stage indices or StackedStages, got "
        f"{spec!r} ({type(spec).__name__})."
      )
  specs = [x if isinstance(x, StackedStages) else int(x) for x in specs]
  largest = max(max(spec) if isinstance(spec, StackedStages) else spec for spec in specs)
  return treedef, tuple(specs), largest


class StageTree:
  """A checked ``param_stages``, as static pytree data: hashable, and equal to its tree.

  A loss scale's configuration is part of its treedef, so it must be hashable;
  a user's ``param_stages`` (dicts, lists) is not. This holds its treedef and
  stage specs, compares equal to any ``param_stages`` with the same ones, and
  prints as the tree.
  """

  __slots__ = ("specs", "treedef")

  def __init__(self, param_stages: Any):
    treedef, specs, _ = flatten_stages(param_stages)
    self.treedef, self.specs = treedef, specs

  @property
  def tree(self) -> Any:
    """The stages as a pytree: the user's containers, stage indices as leaves."""
    return jax.tree.unflatten(self.treedef, self.specs)

  @property
  def largest(self) -> int:
    """The largest stage index."""
    return max(max(spec) if isinstance(spec, StackedStages) else spec for spec in self.specs)

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, StageTree):
      try:
        other = StageTree(other)
      except (TypeError, ValueError):
        return NotImplemented
    return (self.treedef, self.specs) == (other.treedef, other.specs)

  def __hash__(self) -> int:
    return hash((self.treedef, self.specs))

  def __repr__(self) -> str:
    return repr(self.tree)


def check_in_range(specs: Sequence[Spec], num_stages: int) -> None:
  """Raises ValueError if a stage index is outside ``[0, num_stages)``."""
  for spec in specs:
    ids = spec if isinstance(spec, StackedStages) else (spec,)
    if min(ids) < 0 or max(ids) >= num_stages:
      raise ValueError(f"Stage index in {spec!r} is outside [0, {num_stages}).")


def leaf_specs(param_stages: Any, grads: Any) -> list[Spec]:
  """The stage spec of every leaf of ``grads`` (``param_stages`` may be a prefix).

  Args:
    param_stages: the stage of every parameter (a :class:`StageTree`, or a
      checked ``param_stages``).
    grads: a pytree with the parameters' structure.

  Returns:
    One spec per leaf of ``grads``, in ``jax.tree.leaves`` order.
  """
  if isinstance(param_stages, StageTree):
    param_stages = param_stages.tree
  try:
    per_leaf = jax.tree.map(
      lambda spec, subtree: jax.tree.map(lambda _: spec, subtree),
      param_stages,
      grads,
      is_leaf=is_spec,
    )
  except ValueError as e:
    raise ValueError(
      "param_stages must have the structure of the gradients (or be a prefix of it); "
      f"param_stages: {jax.tree.structure(param_stages, is_leaf=is_spec)}, "
      f"gradients: {jax.tree.structure(grads)}."
    ) from e
  return jax.tree.leaves(per_leaf, is_leaf=is_spec)


def check_stacked(shape: tuple[int, ...], spec: StackedStages) -> None:
  """Raises ValueError unless a leaf of ``shape`` has one leading index per stage."""
  if not shape or shape[0] != len(spec):
    raise ValueError(
      f"A stacked parameter of shape {shape} was given {len(spec)} stage indices; "
      "its leading axis must have one per index."
    )


def leaf_scale(scales: jax.Array, g: jax.Array, spec: Spec) -> jax.Array:
  """The scale a gradient leaf carries, broadcastable against it."""
  if not isinstance(spec, StackedStages):
    return scales[spec]
  check_stacked(g.shape, spec)
  return scales[jnp.asarray(spec)].reshape((-1,) + (1,) * (g.ndim - 1))


def per_stage(
  out: jax.Array,
  leaves: Sequence[jax.Array],
  specs: Sequence[Spec],
  reduce_leaf: Callable[[jax.Array], jax.Array],
  combine: Callable[[Any, jax.Array], jax.Array],
) -> jax.Array:
  """Combines a per-leaf (or per-slice) reduction into one row of ``out`` per stage.

  Args:
    out: the initial value, one row per stage.
    leaves: gradient leaves.
    specs: their stage specs.
    reduce_leaf: reduces a leaf (a slice of a stacked leaf) to one row.
    combine: ``combine(out.at[stages], rows)``, e.g. ``lambda ref, v: ref.max(v)``.

  Returns:
    ``out`` with every leaf's row combined into its stage's.
  """
  for g, spec in zip(leaves, specs, strict=True):
    if not isinstance(spec, StackedStages):
      out = combine(out.at[spec], reduce_leaf(g))
    else:
      out = combine(out.at[jnp.asarray(spec)], jax.vmap(reduce_leaf)(g))
  return out
