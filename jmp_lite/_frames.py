"""Which source files are the user's: JAX internals, other libraries, or user code (private).

Two places name a line of the user's code: the audit's findings (a jaxpr
equation's traceback) and the warnings jmp_lite issues while a model is traced
(``ExplicitDtypeWarning``), where ``jax.jit``, ``jax.eval_shape``,
``eqx.filter_jit``, Flax's lifted transforms and the standard library's
``functools``/``contextlib`` lie between the user's call and jmp_lite. Both
sort files the same way, with :class:`SourceFiles`: JAX, jaxlib and the
standard library are *internal*; installed packages (``site-packages``,
``dist-packages``), jmp_lite itself and any extra directories are *libraries*;
everything else (and ``<string>``, ``<stdin>``, notebook cells) is the user's.
"""

from __future__ import annotations

import os
import pathlib
import sys
import sysconfig
import types
from collections.abc import Collection

import jax
import jaxlib

# jmp_lite itself counts as a library: a finding or a warning names the line that called it.
_JMP_LITE = str(pathlib.Path(__file__).resolve().parent)


def _directory(path: str) -> str:
  return os.path.join(os.path.realpath(path), "")


class SourceFiles:
  """Classifies source files: JAX internals, other libraries, or the user's code.

  Args:
    library_paths: extra directories whose files count as library code.
  """

  def __init__(self, library_paths: Collection[str] = ()):
    self._internal = tuple(
      _directory(os.path.dirname(str(m.__file__)))
      for m in (jax, jaxlib)
      if getattr(m, "__file__", None)
    )
    stdlib = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")} - {None}
    self._stdlib = tuple(_directory(str(p)) for p in stdlib)
    self._libraries = (*(_directory(p) for p in library_paths), _directory(_JMP_LITE))
    self._cache: dict[str, str] = {}

  def kind(self, filename: str) -> str:
    """Classifies a source file.

    Args:
      filename: a frame's file name.

    Returns:
      ``"internal"`` (JAX, jaxlib, the standard library), ``"library"`` or ``"user"``.
    """
    kind = self._cache.get(filename)
    if kind is None:
      kind = self._cache[filename] = self._classify(filename)
    return kind

  def _classify(self, filename: str) -> str:
    if filename.startswith("<frozen"):
      return "internal"
    if filename.startswith("<"):  # <string>, <stdin>, notebooks: the user's code
      return "user"
    path = os.path.realpath(filename)
    if path.startswith(self._internal):
      return "internal"
    parts = path.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts or path.startswith(self._libraries):
      return "library"
    if path.startswith(self._stdlib):
      return "internal"
    return "user"

  def user_stacklevel(self, stacklevel: int) -> int:
    """``stacklevel`` for :func:`warnings.warn` in the caller, moved up to the user's frame.

    Counted as :func:`warnings.warn` counts, from the function calling this
    method: the frame ``stacklevel`` names if it is the user's, else the first
    frame above it in the user's code (under ``jax.jit``, ``jax.eval_shape``
    or ``eqx.filter_jit`` the entry point's caller is the tracing machinery;
    the frame that called the transformed function is the user's).

    Args:
      stacklevel: as for :func:`warnings.warn`, counted from the caller.

    Returns:
      The stack level of the user's frame, or ``stacklevel`` when no frame
      above it is the user's.
    """
    frame: types.FrameType | None = sys._getframe(stacklevel)  # 0: here, 1: the caller
    level = stacklevel
    while frame is not None and self.kind(frame.f_code.co_filename) != "user":
      frame, level = frame.f_back, level + 1
    return stacklevel if frame is None else level
