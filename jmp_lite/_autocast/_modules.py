"""Per-class dtypes for callable pytree nodes (Equinox modules): ``autocast(..., modules=)``.

When the autocast function is called, every instance of a named class found in its
arguments (or in ``fun`` itself, when ``fun`` is such an instance) is replaced, for the trace
only, by a :class:`Scoped` view: a pytree node whose one child is the instance (so its
parameters stay the same leaves) and whose calls run under a named scope that names the
dtype (:func:`scope_name`). The interpreter reads the innermost such scope of each equation
(``_interpret.module_dtype``). The views never leave the trace: outputs are unwrapped, and
the caller's arguments (what ``jax.grad`` differentiates) are not touched.

Instances nested in a named instance are replaced too, so a call of a nested instance opens
its own scope inside its parent's: the innermost named instance decides. An instance of a
subclass of a named class takes the dtype of its most specific named class (first in its
method resolution order).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jmp_lite import _dtypes

MODULE_SCOPE = "jmp_lite_module"
"""The prefix of the named scope a :class:`Scoped` call opens: ``jmp_lite_module[Class=dtype]``."""
_SCOPE_RE = re.compile(re.escape(MODULE_SCOPE) + r"\[[^=\]]*=(\w+)\]")

_STRIP_RE = re.compile(_SCOPE_RE.pattern + "/?")

Rules = tuple[tuple[type, np.dtype], ...]


def dtype_rules(value: Any, argument: str, keys: str, check_key: Callable[[Any], Any]) -> tuple:
  """A mapping of keys to dtypes as ``((check_key(key), dtype), ...)``, in its order, checked.

  Args:
    value: the mapping, or None (no rules).
    argument: the argument's name, for the errors.
    keys: what the keys are, for the errors (``"module classes"``).
    check_key: returns the key's rule form, or raises naming the key.

  Returns:
    The pairs, each dtype a ``np.dtype``.

  Raises:
    TypeError: for something not a mapping, or a dtype of a kind no policy takes.
    ValueError: for a dtype name that is not one.
  """
  if value is None:
    return ()
  if not isinstance(value, Mapping):
    raise TypeError(f"{argument} must map {keys} to dtypes, got {value!r}.")
  out = []
  for key, dtype in value.items():
    checked = check_key(key)
    try:
      parsed = np.dtype(_dtypes.parse_dtype(dtype))
    except (TypeError, ValueError) as e:
      label = key.__qualname__ if isinstance(key, type) else repr(key)
      raise type(e)(f"{argument}[{label}]: {e}") from None
    out.append((checked, parsed))
  return tuple(out)


def _module_class(cls: Any) -> type:
  if not isinstance(cls, type):
    raise TypeError(
      f"modules: keys are module classes (such as eqx.nn.LayerNorm), got {cls!r}; "
      "for module names (Flax, Haiku) use scopes=."
    )
  return cls


def check_modules(modules: Any) -> Rules:
  """``modules`` (a mapping of classes to dtypes, or None) as ``((class, dtype), ...)``."""
  return dtype_rules(modules, "modules", "module classes", _module_class)


def scope_name(cls: type, dtype: np.dtype) -> str:
  """The named scope the calls of a ``cls`` instance run under, marking ``dtype``."""
  return f"{MODULE_SCOPE}[{cls.__qualname__}={dtype.name}]"


def strip_module_scopes(name_stack: str) -> str:
  """``name_stack`` without its module scopes (what ``scopes=`` patterns are matched against)."""
  return _STRIP_RE.sub("", name_stack)


def module_dtype(name_stack: str) -> np.dtype | None:
  """The dtype of the innermost module scope in ``name_stack``, else None."""
  found = _SCOPE_RE.findall(name_stack)
  return np.dtype(found[-1]) if found else None


@jax.tree_util.register_pytree_node_class
class Scoped:
  """A module whose calls (and method calls) run under a named scope; attributes forwarded.

  Args:
    module: the instance.
    scope: the named scope (:func:`scope_name`).
  """

  __slots__ = ("_jl_module", "_jl_scope")

  def __init__(self, module: Any, scope: str):
    object.__setattr__(self, "_jl_module", module)
    object.__setattr__(self, "_jl_scope", scope)

  @property  # type: ignore[misc]
  def __class__(self) -> type:
    # ``isinstance(view, Block)`` holds in the user's code (Equinox's Sequential checks its
    # layers' classes); the pytree registry goes by ``type(view)``, which is Scoped.
    return type(object.__getattribute__(self, "_jl_module"))

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    with jax.named_scope(self._jl_scope):
      return self._jl_module(*args, **kwargs)

  def __getattr__(self, name: str) -> Any:
    module = object.__getattribute__(self, "_jl_module")
    value = getattr(module, name)
    # A method (an attribute the class defines, not a field of the instance) runs in the
    # module's scope too; fields (parameters, submodules) are returned as they are.
    if callable(value) and name not in getattr(module, "__dict__", {}):
      scope = object.__getattribute__(self, "_jl_scope")

      def method(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(scope):
          return value(*args, **kwargs)

      return method
    return value

  def __repr__(self) -> str:
    return f"Scoped({self._jl_module!r}, {self._jl_scope!r})"

  def tree_flatten(self) -> tuple[tuple[Any], str]:
    return (self._jl_module,), self._jl_scope

  @classmethod
  def tree_unflatten(cls, scope: str, children: tuple[Any]) -> Scoped:
    return cls(children[0], scope)


def _rule_of(x: Any, rules: Rules) -> tuple[type, np.dtype] | None:
  for base in type(x).__mro__:
    for cls, dtype in rules:
      if base is cls:
        return cls, dtype
  return None


def scope_instances(tree: Any, rules: Rules) -> tuple[Any, set[type]]:
  """``tree`` with every instance of a class in ``rules`` (nested ones too) made :class:`Scoped`.

  Args:
    tree: any pytree.
    rules: from :func:`check_modules`.

  Returns:
    The new tree and the set of named classes that some instance is an instance of.
  """
  classes = tuple(cls for cls, _ in rules)
  found: set[type] = set()

  def replace(node: Any) -> Any:
    if isinstance(node, Scoped) or not isinstance(node, classes):
      return node
    cls, dtype = _rule_of(node, rules)  # type: ignore[misc]
    found.update(c for c in classes if isinstance(node, c))  # a shadowed base matched too
    inner = jax.tree_util.tree_map(
      replace, node, is_leaf=lambda x: x is not node and isinstance(x, classes)
    )
    return Scoped(inner, scope_name(cls, dtype))

  if not classes:
    return tree, found
  return jax.tree_util.tree_map(replace, tree, is_leaf=lambda x: isinstance(x, classes)), found


def unscope(tree: Any) -> Any:
  """``tree`` with every :class:`Scoped` view replaced by its module (nested ones too)."""

  def strip(node: Any) -> Any:
    if not isinstance(node, Scoped):
      return node
    return jax.tree_util.tree_map(strip, node._jl_module, is_leaf=lambda x: isinstance(x, Scoped))

  return jax.tree_util.tree_map(strip, tree, is_leaf=lambda x: isinstance(x, Scoped))


def check_found(rules: Rules, found: set[type]) -> None:
  """Warns for each named class with no instance in the arguments (its rule does nothing)."""
  for cls, _ in rules:
    if cls not in found:
      warnings.warn(
        f"autocast(modules=...): no instance of {cls.__module__}.{cls.__qualname__} in the "
        "function's arguments, so its dtype applies to nothing; modules= applies to module "
        "instances passed as arguments (or to the function itself).",
        stacklevel=3,
      )
