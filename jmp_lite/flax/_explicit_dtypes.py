"""What jmp_lite tells about modules that keep a dtype of their own (private).

A module whose ``dtype`` differs from the compute dtype the policy gives it
keeps that dtype under ``explicit_dtypes="warn"`` (the default of
:class:`~jmp_lite.flax.ModulePolicies`), and one
:class:`~jmp_lite.flax.ExplicitDtypeWarning` per trace names every such
module: whether it was built with that ``dtype=`` or has its class's default
(Flax's examples declare ``dtype: Any = jnp.float32`` on the model), and, as
its location, the user's call, not the JAX or Flax frames between that call
and the entry point (``jax.jit`` and ``jax.eval_shape`` trace through
several).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from jmp_lite import _frames
from jmp_lite.flax._module_policy import ModulePolicies
from jmp_lite.flax._resolved_precision import ResolvedPrecision


class ExplicitDtypeWarning(UserWarning):
  """Modules built with an explicit ``dtype=`` compute in it, not in the policy's dtype.

  Issued once per trace by :func:`~jmp_lite.flax.policy_apply`,
  :func:`~jmp_lite.flax.policy_init` and :func:`~jmp_lite.flax.policy_view`
  (with ``explicit_dtypes="warn"``, the default), naming every such module.
  """


class ExplicitDtype(NamedTuple):
  """A module whose own ``dtype`` differs from the compute dtype the policy gives it.

  Attributes:
    cls: the module's class.
    dtype: its ``dtype``.
    policy_dtype: the compute dtype the policy gives it.
    origin: where its ``dtype`` comes from: ``"passed"`` (it was built with
      one other than its class's default), ``"default"`` (its class's
      default, the dataclass field's or ``__init__``'s), or ``"attribute"``
      (an NNX module's attribute, where its class's ``__init__`` may have set
      it: Flax's ``nnx.Embed`` takes its ``param_dtype``).
  """

  cls: type
  dtype: np.dtype
  policy_dtype: np.dtype
  origin: str


def _as_dtype(value: Any) -> np.dtype | None:
  """``value`` as an ``np.dtype``; ``None`` for ``None``, a sentinel or a non-dtype."""
  if value is None:  # np.dtype(None) is float64
    return None
  try:
    return np.dtype(value)
  except (TypeError, ValueError):
    return None


def describe(module: Any, precision: ResolvedPrecision) -> ExplicitDtype:
  """Describes a module whose ``dtype`` the policy keeps (``precision.explicit_dtype``).

  Args:
    module: a linen or NNX module.
    precision: its :class:`ResolvedPrecision`, with an ``explicit_dtype``.

  Returns:
    Its :class:`ExplicitDtype`, for :func:`warn`.
  """
  cls = type(module)
  dtype = np.dtype(precision.explicit_dtype)
  if dataclasses.is_dataclass(cls):  # linen: the constructor is the dataclass's
    field = next((f for f in dataclasses.fields(cls) if f.name == "dtype"), None)
    default = None if field is None else field.default
    known = True
  else:  # NNX: __init__ may set self.dtype from something else
    try:
      parameter = inspect.signature(cls.__init__).parameters.get("dtype")
    except (TypeError, ValueError):  # no signature to read
      parameter = None
    default = None if parameter is None else parameter.default
    known = False
  if _as_dtype(default) == dtype:
    origin = "default"
  else:
    origin = "passed" if known else "attribute"
  return ExplicitDtype(cls, dtype, np.dtype(precision.policy_dtype), origin)


# Sorts the frames between the user's call and the warning as the audit does: JAX, Flax,
# Equinox, the standard library and jmp_lite are skipped.
_FILES = _frames.SourceFiles()


_DESCRIBED = {
  "passed": "built with dtype={}",
  "default": "its class default dtype={}",
  "attribute": "dtype={}",
}


def warn(
  policies: ModulePolicies,
  found: Mapping[str, ExplicitDtype],
  caller: str,
  stacklevel: int,
) -> None:
  """Issues one :class:`ExplicitDtypeWarning` naming every module in ``found``.

  Nothing is issued unless ``policies.explicit_dtypes`` is ``"warn"``. The
  warning names the user's call: the frame ``stacklevel`` names, or the first
  one above it in the user's code, found as the audit finds source lines
  (:class:`jmp_lite._frames.SourceFiles`: under ``jax.jit``, ``jax.eval_shape``
  or ``eqx.filter_jit``, the call of the transformed function).

  Args:
    policies: what the model runs under.
    found: ``{path: ExplicitDtype}`` (:func:`describe`).
    caller: the public function the user called, for the message.
    stacklevel: as for :func:`warnings.warn`, counted from the caller of this function.
  """
  if policies.explicit_dtypes != "warn":
    return
  if not found:
    return
  names = "; ".join(
    f"{path or '(the model)'} ({e.cls.__name__}: {_DESCRIBED[e.origin].format(e.dtype.name)}, "
    f"policy: {e.policy_dtype.name})"
    for path, e in found.items()
  )
  origins = {e.origin for e in found.values()}
  fixes = []
  if origins - {"default"}:
    fixes.append("drop dtype= where these modules are built")
  if "default" in origins:
    fixes.append("make dtype=None the class default where a class default is named")
  warnings.warn(
    f"{caller}: {len(found)} module(s) have a dtype other than the compute dtype the policy "
    f"gives them, and compute in their own dtype (so do the modules inside them without a "
    f"dtype of their own): {names}. To train in the policy's dtype, {' and '.join(fixes)} "
    "(Flax's default dtype=None follows the policy), or run it under "
    "jl.flax.ModulePolicies(policy, explicit_dtypes='policy'); if the dtypes are deliberate, "
    "explicit_dtypes='keep' silences this warning.",
    ExplicitDtypeWarning,
    stacklevel=_FILES.user_stacklevel(stacklevel + 1),
  )
