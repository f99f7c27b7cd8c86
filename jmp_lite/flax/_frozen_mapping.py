"""A read-only, hashable mapping: the tables of frozen configuration objects (private).

:class:`~jmp_lite.flax.ModuleOverride` keeps its ``attributes`` and
:class:`~jmp_lite.flax.ModulePolicies` its ``overrides`` in one, so that their
generated ``__eq__`` and ``__hash__`` compare and hash the tables by content (keys
that are classes by identity), and so that both can be static arguments of ``jax.jit``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class FrozenMapping(Mapping[K, V]):
  """A mapping that cannot change, equal to any mapping with the same items.

  Its hash (of the items, in any order) is computed once; the values must be hashable.

  Args:
    items: the mapping to copy (default: empty).

  >>> table = FrozenMapping({"a": 1})
  >>> table == {"a": 1}, hash(table) == hash(FrozenMapping({"a": 1}))
  (True, True)
  """

  __slots__ = ("_hash", "_items")

  def __init__(self, items: Mapping[K, V] | None = None):
    self._items: dict[K, V] = dict(items or {})
    self._hash: int | None = None

  def __getitem__(self, key: K) -> V:
    return self._items[key]

  def __contains__(self, key: object) -> bool:  # a dict lookup, not Mapping's try/except
    return key in self._items

  def __iter__(self) -> Iterator[K]:
    return iter(self._items)

  def __len__(self) -> int:
    return len(self._items)

  def __hash__(self) -> int:
    if self._hash is None:
      self._hash = hash(frozenset(self._items.items()))
    return self._hash

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, Mapping):
      return NotImplemented
    return self._items == dict(other.items())

  def __repr__(self) -> str:
    return repr(self._items)
