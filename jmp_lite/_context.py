"""Ambient values: set for the duration of a ``with`` block, read while tracing.

A value is passed explicitly wherever its holder calls the code that needs it.
It is ambient only where the code is called by someone who cannot pass it: a
Flax interceptor or an NNX layer, which call with their own fixed arguments,
or the user's own loss function, which the holder receives as a closure (e.g.
the open :func:`jmp_lite.fp8.current_scaling` scopes, the layer-wise stage
boundaries' context); each module that defines one says why in its docstring.
They are read when the code is traced, as :func:`jax.named_scope` is read. One
:class:`Ambient` per such value; scopes nest, and each thread (and each
``contextvars`` context) sees its own.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Ambient(Generic[T]):
  """A stack of values, the innermost of which is the current one."""

  def __init__(self, name: str):
    self._stack: contextvars.ContextVar[tuple[T, ...]] = contextvars.ContextVar(name, default=())

  @contextlib.contextmanager
  def scope(self, value: T) -> Iterator[T]:
    """Makes ``value`` the current value inside the ``with`` block."""
    token = self._stack.set((*self._stack.get(), value))
    try:
      yield value
    finally:
      self._stack.reset(token)

  def current(self) -> T | None:
    """The innermost value set, or None outside every scope."""
    stack = self._stack.get()
    return stack[-1] if stack else None

  def all(self) -> tuple[T, ...]:
    """Every value set, outermost first."""
    return self._stack.get()
