"""Sphinx directives that generate the parts of the docs that must not drift from the code.

* ``jmp-lite-formats``: the table of floating-point formats, from :data:`jmp_lite.FORMATS`.
* ``jmp-lite-api``: autodoc entries for the names of a module's ``__all__`` it lists.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pkgutil
import re
from typing import Any

import numpy as np
from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


def _small(x: float) -> str:
  """``2^-24`` for a power of two below 1, else the number."""
  e = math.log2(x)
  return f"2^{int(e)}" if e == int(e) and e < 0 else f"{x:g}"


def _large(x: float) -> str:
  """``65504`` or ``3.40e38``."""
  return f"{x:.2e}".replace("e+", "e") if x >= 1e6 else f"{x:g}"


def _has_inf(dtype: np.dtype) -> bool:
  with np.errstate(over="ignore", invalid="ignore"):
    return bool(np.isinf(np.array(np.inf, np.float32).astype(dtype)))


def formats_table(names: list[str] | None = None) -> list[str]:
  """A reStructuredText list-table of :data:`jmp_lite.FORMATS` (or of the named formats)."""
  import jmp_lite

  if names:
    infos = [jmp_lite.format_info(n) for n in names]
  else:
    infos = list(jmp_lite.FORMATS.values())
  header = [
    "format",
    "bits (s/e/m)",
    "max",
    "min normal",
    "min subnormal",
    "epsilon",
    "digits",
    "inf",
  ]
  rows = []
  for f in infos:
    rows.append(
      [
        f"``{f.name}``",
        f"{f.bits} (1/{f.exponent_bits}/{f.mantissa_bits})",
        _large(f.max),
        _small(f.min_normal),
        _small(f.min_subnormal),
        _small(f.epsilon),
        f"{(f.mantissa_bits + 1) * math.log10(2):.1f}",
        "yes" if _has_inf(f.dtype) else "no",
      ]
    )
  lines = [".. list-table::", "   :header-rows: 1", ""]
  for row in [header, *rows]:
    lines.append(f"   * - {row[0]}")
    lines.extend(f"     - {cell}" for cell in row[1:])
  return lines


def _parse_rst(directive: SphinxDirective, lines: list[str], source: str) -> list[nodes.Node]:
  """Parses generated reStructuredText, also from inside a MyST (Markdown) page."""
  if "myst" in type(directive.state).__module__:
    fence = "`" * 6
    lines = [f"{fence}{{eval-rst}}", *lines, fence]
  container = nodes.section()
  container.document = directive.state.document
  directive.state.nested_parse(StringList(lines, source=source), 0, container)
  return list(container.children)


class FormatsDirective(SphinxDirective):
  """``jmp-lite-formats [name ...]``: the formats table, generated from ``jmp_lite.FORMATS``."""

  optional_arguments = 20
  has_content = False

  def run(self) -> list[nodes.Node]:
    return _parse_rst(self, formats_table(list(self.arguments)), "jmp_lite.FORMATS")


def api_entries(module_name: str, names: list[str]) -> list[str]:
  """autodoc directives for ``names`` of the module (submodules excluded)."""
  import jmp_lite

  module = importlib.import_module(module_name)
  lines = []
  for name in names:
    obj = getattr(module, name)
    target = f"{module_name}.{name}"
    # Also exported at the top level (jl.LayerwiseLossScale): documented there for the index.
    also_top_level = module is not jmp_lite and getattr(jmp_lite, name, None) is obj
    no_index = ["   :no-index:"] if also_top_level and name in jmp_lite.__all__ else []
    if inspect.ismodule(obj):
      continue
    if inspect.isclass(obj):
      lines += [f".. autoclass:: {target}", "   :members:", *no_index]
      if any(base.__module__.startswith("jmp_lite.") for base in obj.__mro__[1:]):
        lines += ["   :inherited-members:"]  # e.g. scale/unscale from the shared base
      if _is_namedtuple(obj) or obj.__doc__ is None:
        lines += ["   :undoc-members:"]
    elif callable(obj) and not isinstance(obj, (dict, tuple, list)):
      lines += [f".. autofunction:: {target}", *no_index]
    else:
      lines += _data_entry(target, name, obj)
    lines.append("")
  return lines


def _data_entry(target: str, name: str, obj: Any) -> list[str]:
  """A ``py:data`` entry with the doc comment from the module that defines ``obj``.

  (autodoc looks for an attribute's docstring only in the module it is documented under, and
  the package's ``__init__`` merely re-exports it.)
  """
  from sphinx.pycode import ModuleAnalyzer

  import jmp_lite

  modules = ["jmp_lite"] + [
    m.name for m in pkgutil.walk_packages(jmp_lite.__path__, prefix="jmp_lite.")
  ]
  for module_name in modules:
    module = importlib.import_module(module_name)
    if getattr(module, name, None) is not obj:
      continue
    doc = ModuleAnalyzer.for_module(module_name).find_attr_docs().get(("", name))
    if doc:
      return [f".. py:data:: {target}", f"   :type: {type(obj).__name__}", ""] + [
        f"   {line}" if line else "" for line in doc
      ]
  return [f".. autodata:: {target}", "   :no-value:"]


def _is_namedtuple(cls: Any) -> bool:
  return issubclass(cls, tuple) and hasattr(cls, "_fields")


class ApiDirective(SphinxDirective):
  """``jmp-lite-api module``: autodoc entries for the names listed in its content.

  The names (whitespace separated) must be in ``module.__all__``; a page groups them by
  concept with one directive per group. ``tests/test_api_reference.py`` checks that the
  pages list every name of every public namespace exactly once.
  """

  required_arguments = 1
  has_content = True

  def run(self) -> list[nodes.Node]:
    module_name = self.arguments[0]
    names = " ".join(self.content).split()
    exported = set(importlib.import_module(module_name).__all__)
    unknown = [name for name in names if name not in exported]
    if unknown:
      raise self.error(f"not in {module_name}.__all__: {', '.join(unknown)}")
    return _parse_rst(self, api_entries(module_name, names), f"{module_name}.__all__")


def _drop_namedtuple_field_docs(app, what, name, obj, options, lines: list[str]) -> None:
  """NamedTuple fields without a docstring read "Alias for field number N": say nothing."""
  if (
    what in ("attribute", "property")
    and len(lines) <= 2
    and lines
    and lines[0].startswith("Alias for field number")
  ):
    lines.clear()


def _result_table_page(app, docname: str, source: list[str]) -> None:
  """Pages under ``figures/`` are benchmark output that guides link to, not navigation pages.

  They are written by the benchmark scripts and start at a ``###`` heading; give them a title,
  shift their headings to follow it, and mark them orphans (reachable by link only).
  """
  if not docname.startswith("figures/"):
    return
  text = source[0]
  levels = [len(m.group(1)) for m in re.finditer(r"^(#{1,6}) ", text, re.M)]
  if levels and min(levels) > 2:
    shift = min(levels) - 2
    text = re.sub(r"^(#{1,6}) ", lambda m: "#" * (len(m.group(1)) - shift) + " ", text, flags=re.M)
  title = docname.split("/", 1)[1].replace("_", " ")
  source[0] = f"---\norphan: true\n---\n\n# Results: {title}\n\n{text}"


def setup(app: Any) -> dict[str, Any]:
  app.connect("autodoc-process-docstring", _drop_namedtuple_field_docs)
  app.connect("source-read", _result_table_page)
  app.add_directive("jmp-lite-formats", FormatsDirective)
  app.add_directive("jmp-lite-api", ApiDirective)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
