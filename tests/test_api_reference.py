"""The API reference (docs/api/*.md) lists every public name exactly once, grouped by concept.

Each page groups names with one ``jmp-lite-api`` directive per concept; this test keeps the
pages and the namespaces' ``__all__`` in step, so a new export cannot go undocumented.
"""

import collections
import importlib
import pathlib
import re

import pytest

from .package_testing import NAMESPACES

API = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api"
DIRECTIVE = re.compile(r"```\{jmp-lite-api\} (\S+)\n(.*?)```", re.S)


def _listed() -> dict[str, list[str]]:
  listed = collections.defaultdict(list)
  for page in sorted(API.glob("*.md")):
    for module, body in DIRECTIVE.findall(page.read_text()):
      listed[module] += body.split()
  return listed


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_public_name_is_listed_once(namespace):
  names = _listed()[namespace]
  exported = importlib.import_module(namespace).__all__
  duplicated = sorted(n for n, k in collections.Counter(names).items() if k > 1)
  assert duplicated == [], f"listed twice: {duplicated}"
  assert sorted(set(exported) - set(names)) == [], "missing from docs/api"
  assert sorted(set(names) - set(exported)) == [], "listed but not exported"


def test_only_public_namespaces_are_documented():
  assert set(_listed()) == set(NAMESPACES)
