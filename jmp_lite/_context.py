"""Ambient values: set for the duration of a ``with`` block, read while tracing.

Several ops need to know something their callers do not pass them: the loss
scale the gradients carry (fp8), the layer-wise stage context, whether fp8 ops
quantize with current scaling. They read it when they are traced, as
:func:`jax.named_scope` is read. One :class:`Ambient` per such value; scopes
nest, and each thread (and each ``contextvars`` context) sees its own.
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
