"""One module call under a precision policy, the same for linen and NNX (private).

Both integrations run every module call alike: floating inputs are cast to the
module's compute dtype, the module runs with the attributes the policy sets on
it for the call (its kernels; under :func:`jax.checkpoint` for a recomputed
island, with the cast inside, so that the narrow inputs are what is saved), and
floating outputs are cast to its output dtype. :func:`cast_call`
is that wrapper: linen calls it from its method interceptor
(:func:`~jmp_lite.flax.policy_apply`), NNX from each
:class:`~jmp_lite.flax.PolicyModule` of a view.

Both also find the layers that compute the model's output the same way: they
trace the model once abstractly, :func:`cast_call` records every call
(:class:`CallRecord`), and :func:`output_chain` follows the model's output
down through the calls that returned it. What is found is a set of *calls*,
not of modules (:class:`CallKey`: the module's path, the method and how many
calls of it came before): a tied embedding's ``attend`` computes the logits
while its lookup, the same module, feeds the first block, and a module called
both inside the model and as its head returns the output dtype only from the
head call. Runs of one model make the same calls in the same order, so the
keys :class:`CallCounter` gives in the abstract trace name the same calls in
the run that follows.
"""

from __future__ import annotations

import collections
import contextlib
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


@contextlib.contextmanager
def _attributes_set(module: Any, updates: Mapping[str, Any]):
  """Sets attributes of a module for the duration of one call.

  Linen modules are frozen dataclasses, so ``object.__setattr__`` is the only
  way in; NNX refuses ``setattr`` below the trace a module was built at (a
  call inside ``vmap`` or ``scan``). The instance is the bound clone
  ``apply`` made for this call (linen) or the view's copy (NNX), never the
  user's module, and the old values come back on exit, so nothing outlives
  the call.
  """
  saved = {name: getattr(module, name) for name in updates}
  for name, value in updates.items():
    object.__setattr__(module, name, value)
  try:
    yield
  finally:
    for name, value in saved.items():
      object.__setattr__(module, name, value)


class CallKey(NamedTuple):
  """One call of a module method in one run of a model.

  Attributes:
    path: the module's path in the model.
    method: the method called (``"__call__"``, ``"attend"``...).
    number: how many calls of that method of that module came before it in
      the run.
  """

  path: tuple
  method: str
  number: int


class CallCounter:
  """Numbers the module calls of one run of a model (:class:`CallKey`)."""

  def __init__(self) -> None:
    self._seen: collections.Counter[tuple[tuple, str]] = collections.Counter()

  def key(self, path: tuple, method: str) -> CallKey:
    """Returns the key of the call of ``method`` of the module at ``path`` starting now.

    Args:
      path: the module's path in the model.
      method: the method's name.

    Returns:
      Its :class:`CallKey`; the next call of the same method gets the next number.
    """
    name = (tuple(path), method)
    number = self._seen[name]
    self._seen[name] = number + 1
    return CallKey(name[0], method, number)


class CallRecord(NamedTuple):
  """One module call seen while tracing a model to find its output layers.

  Attributes:
    call: which call it was.
    raw: the array leaves the module computed.
    returned: the array leaves it returned (after its output cast).
  """

  call: CallKey
  raw: list
  returned: list


def _arrays(tree: Any) -> list[jax.Array]:
  return [x for x in jax.tree_util.tree_leaves(tree) if isinstance(x, jax.Array)]


def cast_call(
  module: Any,
  attributes: Mapping[str, Any],
  fn: Callable[..., Any],
  args: tuple,
  kwargs: dict,
  compute_dtype: np.dtype,
  output_dtype: np.dtype,
  *,
  recompute: bool,
  record: list[CallRecord] | None,
  call: CallKey | None,
) -> Any:
  """Calls ``fn`` with floating inputs in ``compute_dtype``, returns outputs in ``output_dtype``.

  Args:
    module: the module called, whose ``attributes`` are set for the call.
    attributes: ``{name: value}`` of the module's attributes to set while ``fn``
      runs (its kernels), restored after it.
    fn: the module call (a linen method, an NNX module or bound method).
    args: its positional arguments.
    kwargs: its keyword arguments.
    compute_dtype: the dtype floating inputs are cast to.
    output_dtype: the dtype floating outputs are cast to.
    recompute: run ``fn`` under :func:`jax.checkpoint`, the input and output
      casts inside it, so that the backward pass keeps the (narrow) inputs and
      recomputes the rest.
    record: while the model's output layers are being found, the list to
      which a :class:`CallRecord` of this call is appended (in exit order).
    call: the key of this call, for the record (``None``: not recorded).

  Returns:
    ``fn``'s result with its floating array leaves in ``output_dtype``.
  """

  def narrow(*args, **kwargs):
    args, kwargs = cast_floating((args, kwargs), compute_dtype)
    return fn(*args, **kwargs)

  with _attributes_set(module, attributes):
    if recompute:
      # Both casts inside the checkpoint: what crosses it, in either direction,
      # is narrow (the inputs and the outputs' cotangents), so the backward pass
      # keeps no wide copy of either.
      out = _checkpointed(
        lambda *a, **k: cast_floating(narrow(*a, **k), output_dtype), args, kwargs
      )
    else:
      out = narrow(*args, **kwargs)
  returned = cast_floating(out, output_dtype)
  if record is not None and call is not None:
    record.append(CallRecord(call, _arrays(out), _arrays(returned)))
  return returned


def output_chain(records: list[CallRecord]) -> frozenset[CallKey]:
  """The calls whose output is (part of) the model's output, from the calls of one trace.

  Matched by identity, from the outermost call down: a call is in the chain
  if what it returned is part of the raw output of one already in it (the
  outermost call is), so the chain from the model down to the layer that
  computes its output is found. Other calls of the same modules (a tied
  embedding's lookup) are not in it. A module whose result is transformed before
  it is returned (``.astype``, a division, a lifted transform) ends the
  chain. The records hold the arrays, so their ids are not reused while this
  runs.

  Args:
    records: the calls of one trace in exit order, the outermost call last.

  Returns:
    The keys of the calls in the chain.
  """
  found: set[CallKey] = set()
  wanted: set[int] = set()
  for i, (call, raw, returned) in enumerate(reversed(records)):
    if i == 0 or wanted & {id(x) for x in returned}:
      found.add(call)
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
