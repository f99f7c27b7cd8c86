"""Packaging: the public API, the README's Quickstart and CI agree."""

import pathlib
import re
import subprocess
import sys
import types

import jmp_lite as jl

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_public_api_is_exported_once_and_defined_here():
  assert len(jl.__all__) == len(set(jl.__all__))
  for name in jl.__all__:
    obj = getattr(jl, name)
    if callable(obj):
      assert obj.__module__.startswith("jmp_lite."), (name, obj.__module__)
      assert obj.__doc__ and obj.__doc__.strip(), f"{name} has no docstring"
  assert re.fullmatch(r"\d+\.\d+\.\d+([a-z]+\d+)?", jl.__version__)
  assert (ROOT / "jmp_lite" / "py.typed").exists()


def _quickstart_commands():
  text = (ROOT / "README.md").read_text()
  block = re.search(r"## Quickstart\n.*?```bash\n(.*?)```", text, re.S).group(1)
  return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_quickstart_has_two_commands_and_ci_runs_the_second():
  commands = _quickstart_commands()
  assert len(commands) == 2
  assert "pytest" in commands[1]
  out = subprocess.run(
    ["bash", "-c", "sed -n '/^test_command=/p' .ci/run"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  assert "Quickstart" in out and "sed -n 2p" in out


def test_quickstart_first_line_runs_the_quick_comparison():
  # A newcomer's first run takes about a minute; the comparison itself runs in --quick mode in
  # tests/test_examples.py.
  assert _quickstart_commands()[0].endswith("python3 -m examples.compare --quick")


def test_quickstart_tour_runs():
  out = subprocess.run(
    [sys.executable, str(ROOT / "examples" / "quickstart.py")],
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  ).stdout
  assert "skipped (overflow)" in out and "applied" in out and "compiled 1 time(s)" in out


def test_star_import_binds_no_modules():
  # `from jmp_lite import *` once rebound a user's `flax` to jmp_lite.flax.
  namespace: dict = {}
  exec("from jmp_lite import *", namespace)
  modules = sorted(k for k, v in namespace.items() if isinstance(v, types.ModuleType))
  assert modules == []
  assert set(namespace) - {"__builtins__"} == set(jl.__all__)
  assert jl.flax.__name__ == "jmp_lite.flax" and jl.fp8.__name__ == "jmp_lite.fp8"


def test_star_import_keeps_the_users_flax():
  import flax

  user_module = types.ModuleType("user_module")
  exec("import flax\nfrom jmp_lite import *", user_module.__dict__)
  assert user_module.flax is flax and user_module.flax.linen.Dense is flax.linen.Dense
  assert user_module.get_policy is jl.get_policy


def test_namespaces_are_attributes_and_other_names_are_not():
  # In a fresh process, so that no earlier test has imported jmp_lite.flax or jmp_lite.plotting.
  code = (
    "import sys, jmp_lite as jl\n"
    "assert 'jmp_lite.flax' not in sys.modules and 'jmp_lite.plotting' not in sys.modules\n"
    "assert jl.flax.__name__ == 'jmp_lite.flax' and jl.plotting.__name__ == 'jmp_lite.plotting'\n"
    "assert {'flax', 'plotting', 'fp8', 'layerwise', 'diagnostics'} <= set(dir(jl))\n"
    "for name in ('Fp8Config', 'check_stages', 'gradient_statistics', 'policy', 'dtypes'):\n"
    "  try:\n    getattr(jl, name)\n  except AttributeError as e:\n    print(e)\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.splitlines() == [
    f"module 'jmp_lite' has no attribute {name!r}"
    for name in ("Fp8Config", "check_stages", "gradient_statistics", "policy", "dtypes")
  ]
