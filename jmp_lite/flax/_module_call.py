"""One module call under a precision policy, the same for linen and NNX (private).

Both integrations run every module call alike: floating inputs are cast to the
module's compute dtype, the module runs (under :func:`jax.checkpoint` for a
recomputed island, with the cast inside, so that the narrow inputs are what is
saved), and floating outputs are cast to its output dtype. :func:`cast_call`
is that wrapper: linen calls it from its method interceptor
(:func:`~jmp_lite.flax.policy_apply`), NNX from each
:class:`~jmp_lite.flax.PolicyModule` of a view.

Both also find the layers that compute the model's output the same way: they
trace the model once abstractly, :func:`cast_call` records every call
(:class:`CallRecord`), and :func:`output_chain` follows the model's output
down through the calls that returned it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np

from jmp_lite._policy import cast_floating
from jmp_lite._tree_util import is_array, split_leaves

T = TypeVar("T")


def _checkpointed(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
  """``fn(*args, **kwargs)`` under :func:`jax.checkpoint` (non-array arguments static)."""
  arrays, rebuild = split_leaves((args, kwargs), is_array)

  def call(*arrays):
    a, k = rebuild(list(arrays))
    return fn(*a, **k)

  return jax.checkpoint(call)(*arrays)


class CallRecord(NamedTuple):
  """One module call seen while tracing a model to find its output layers.

  Attributes:
    path: the module's path in the model.
    raw: the array leaves the module computed.
    returned: the array leaves it returned (after its output cast).
  """

  path: tuple
  raw: list
  returned: list


def _arrays(tree: Any) -> list[jax.Array]:
  return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def cast_call(
  fn: Callable[..., Any],
  args: tuple,
  kwargs: dict,
  compute_dtype: np.dtype,
  output_dtype: np.dtype,
  *,
  recompute: bool,
  record: list[CallRecord] | None,
  path: tuple,
) -> Any:
  """Calls ``fn`` with floating inputs in ``compute_dtype``, returns outputs in ``output_dtype``.

  Args:
    fn: the module call (a linen method, an NNX module or bound method).
    args: its positional arguments.
    kwargs: its keyword arguments.
    compute_dtype: the dtype floating inputs are cast to.
    output_dtype: the dtype floating outputs are cast to.
    recompute: run ``fn`` under :func:`jax.checkpoint`, the input cast inside
      it, so that the backward pass keeps the (narrow) inputs and recomputes
      the rest.
    record: while the model's output layers are being found, the list to
      which a :class:`CallRecord` of this call is appended (in exit order).
    path: the module's path, for the record.

  Returns:
    ``fn``'s result with its floating array leaves in ``output_dtype``.
  """

  def call(*args, **kwargs):
    args, kwargs = cast_floating((args, kwargs), compute_dtype)
    return fn(*args, **kwargs)

  out = _checkpointed(call, args, kwargs) if recompute else call(*args, **kwargs)
  returned = cast_floating(out, output_dtype)
  if record is not None:
    record.append(CallRecord(tuple(path), _arrays(out), _arrays(returned)))
  return returned


def output_chain(records: list[CallRecord]) -> frozenset[tuple]:
  """The modules whose output is (part of) the model's output, from the calls of one trace.

  Matched by identity, from the outermost call down: a module is in the chain
  if what it returned is part of the raw output of one already in it (the
  outermost call is), so the chain from the model down to the layer that
  computes its output is found. A module whose result is transformed before
  it is returned (``.astype``, a division, a lifted transform) ends the
  chain. The records hold the arrays, so their ids are not reused while this
  runs.

  Args:
    records: the calls of one trace in exit order, the outermost call last.

  Returns:
    The paths of the modules in the chain.
  """
  found: set[tuple] = set()
  wanted: set[int] = set()
  for i, (path, raw, returned) in enumerate(reversed(records)):
    if i == 0 or wanted & {id(x) for x in returned}:
      found.add(path)
      wanted |= {id(x) for x in raw}
  return frozenset(found)


def enclosing_entry(table: Mapping[tuple, T], path: tuple) -> T | None:
  """The entry of ``table`` at ``path`` or at its closest ancestor.

  Args:
    table: entries keyed by module path.
    path: a module path (a tuple of names).

  Returns:
    The entry of the longest prefix of ``path`` in ``table`` (``()``, the
    model, included), or ``None`` if there is none.
  """
  for n in range(len(path), -1, -1):
    if path[:n] in table:
      return table[path[:n]]
  return None
