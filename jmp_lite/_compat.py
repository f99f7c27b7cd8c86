"""Every JAX API jmp_lite uses that JAX does not promise to keep (private).

Each entry stands in for one internal or unstable JAX API, names the public API it would be
if JAX had one, and the JAX versions it was checked on (tests/test_compat.py checks each on the
installed one). Nothing else in jmp_lite imports ``jax._src``, ``jax.extend`` or ``jax.core``,
binds a primitive or reads JAX's file layout (tests/test_layout.py enforces it), so a JAX
release that moves one of them is fixed here.

``jax.extend`` is imported on first use: ``import jax.extend`` also imports Pallas (about
0.13 s, a quarter of ``import jax``), which ``import jmp_lite`` should not pay for before a
jaxpr is walked. ``jax._src.source_info_util`` is loaded by ``import jax`` already.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import source_info_util


def extend_core() -> Any:
  """``jax.extend.core``: the jaxpr types (``Jaxpr``, ``ClosedJaxpr``, ``Literal``, ``DropVar``,
  ``Primitive``), imported on first use. Checked on JAX 0.10.2.

  Returns:
    The ``jax.extend.core`` module.
  """
  import jax.extend.core

  return jax.extend.core


def primitive_names() -> frozenset[str]:
  """The names of JAX's own primitives (``jax.extend.core.primitives``). Checked on JAX 0.10.2.

  Returns:
    Every primitive name the installed JAX defines there (``"exp"``, ``"dot_general"``...).
  """
  import jax.extend.core.primitives

  core = extend_core()
  primitives = vars(jax.extend.core.primitives).values()
  return frozenset(p.name for p in primitives if isinstance(p, core.Primitive))


def is_tracer(x: Any) -> bool:
  """Whether ``x`` is traced (inside ``jit``, ``grad``, ``vmap``...): ``jax.core.Tracer``,
  which JAX has no public replacement for. Checked on JAX 0.10.2.

  Args:
    x: anything.

  Returns:
    True for a tracer, False for a concrete array, a number or any other object.
  """
  return isinstance(x, jax.core.Tracer)


def bind(primitive: Any, params: dict, *args: Any) -> list[Any]:
  """Binds ``primitive`` to ``args`` with the ``params`` of a jaxpr equation, as
  ``jax.core.eval_jaxpr`` replays it (``Primitive.get_bind_params`` turns a call primitive's
  sub-jaxpr into the functions its ``bind`` takes). Checked on JAX 0.10.2.

  Args:
    primitive: an equation's ``primitive``.
    params: its ``params`` (or a copy with some replaced).
    *args: its operands.

  Returns:
    The results, as a list even for a primitive with one result.
  """
  outs = primitive.bind(*args, **primitive.get_bind_params(params))
  return list(outs) if primitive.multiple_results else [outs]


def current_name_stack() -> Any:
  """The name stack being traced under (``jax.named_scope``'s and the enclosing modules'),
  which a replayed jaxpr's name stacks are relative to: ``source_info_util``'s, which JAX
  does not export. Checked on JAX 0.10.2.

  Returns:
    JAX's ``NameStack``.
  """
  return source_info_util.current_name_stack()


def new_name_stack() -> Any:
  """An empty name stack (``source_info_util.new_name_stack``). Checked on JAX 0.10.2.

  Returns:
    JAX's empty ``NameStack``.
  """
  return source_info_util.new_name_stack()


@contextlib.contextmanager
def replaying(eqn: Any, name_stack: Any) -> Iterator[None]:
  """The context a jaxpr equation was traced in, for binding it again: its traceback and
  ``name_stack`` (``source_info_util.user_context``) and its mesh, ``compute_on`` and XLA
  metadata (``eqn.ctx.manager``), as ``jax.core.eval_jaxpr`` replays it. Checked on JAX 0.10.2.

  Args:
    eqn: the equation.
    name_stack: the name stack its results are recorded under.

  Yields:
    Nothing; binds inside the ``with`` block record ``eqn``'s source and context.
  """
  traceback = eqn.source_info.traceback
  with source_info_util.user_context(traceback, name_stack=name_stack), eqn.ctx.manager:
    yield


def varying_axes(x: Any) -> frozenset:
  """The ``shard_map`` mesh axes ``x`` varies over (empty outside ``shard_map``): the
  ``manual_axis_type.varying`` of ``jax.typeof(x)`` (``vma`` before JAX 0.9). Checked on
  JAX 0.10.2.

  Args:
    x: an array or tracer.

  Returns:
    The axis names.
  """
  return frozenset(jax.typeof(x).manual_axis_type.varying)


def shape_dtype_struct(x: Any) -> jax.ShapeDtypeStruct:
  """The ``jax.ShapeDtypeStruct`` of ``x`` with its sharding and, inside ``shard_map``, the
  mesh axes it varies over (``manual_axis_type``, which a ``jax.linear_transpose`` needs to
  type its cotangent). Checked on JAX 0.10.2.

  Args:
    x: an array or tracer (its unbatched shape under ``vmap``).

  Returns:
    The struct.
  """
  aval = jax.typeof(x)
  return jax.ShapeDtypeStruct(
    np.shape(x), jnp.result_type(x), sharding=aval.sharding, manual_axis_type=aval.manual_axis_type
  )


# JAX's source layout: the audit names the operation a derivative rule differentiates, and
# autocast recognises jax.nn's rules, from the files in an equation's traceback. Paths are
# relative to the jax package, as jax_file returns them. Checked on JAX 0.10.2.
_JAX_ROOT = os.path.join(os.path.realpath(os.path.dirname(str(jax.__file__))), "")
# Files that only bind, trace or call functions: frames in them say nothing about who created
# an operation.
JAX_PLUMBING = frozenset(
  {
    "_src/api.py",
    "_src/api_util.py",
    "_src/core.py",
    "_src/dispatch.py",
    "_src/linear_util.py",
    "_src/pjit.py",
    "_src/source_info_util.py",
    "_src/traceback_util.py",
    "_src/tree_util.py",
    "_src/util.py",
  }
)
JAX_AD = "_src/interpreters/ad.py"
"""The JVP/linearize trace, which runs derivative rules."""
JAX_CUSTOM_RULES = "_src/custom_derivatives.py"
"""``custom_jvp``/``custom_vjp``: the rules users write."""


def jax_file(filename: str) -> str | None:
  """The path of a JAX source file relative to the jax package (``"_src/core.py"``).

  Args:
    filename: a traceback frame's file name.

  Returns:
    The relative path, with ``/`` separators; None for a file outside JAX.
  """
  path = os.path.realpath(filename)
  return path[len(_JAX_ROOT) :].replace(os.sep, "/") if path.startswith(_JAX_ROOT) else None


def is_jax_plumbing(rel: str) -> bool:
  """Whether a JAX file (:func:`jax_file`'s path) only binds, traces or calls functions: the
  files of :data:`JAX_PLUMBING` and the interpreters other than :data:`JAX_AD`."""
  return rel in JAX_PLUMBING or (rel.startswith("_src/interpreters/") and rel != JAX_AD)


def is_jax_lax(rel: str) -> bool:
  """Whether a JAX file (:func:`jax_file`'s path) defines ``jax.lax`` operations."""
  return rel.startswith("_src/lax/")


def is_jax_nn(filename: str) -> bool:
  """Whether a source file defines ``jax.nn`` functions (``softmax``, ``log_softmax``...).

  Args:
    filename: a file name, e.g. from a jaxpr's ``debug_info.func_src_info``.

  Returns:
    True for a file under ``jax/_src/nn/``.
  """
  return "/jax/_src/nn/" in filename.replace("\\", "/")
