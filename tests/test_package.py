"""Packaging: the public API, the README's Quickstart and CI agree."""

import pathlib
import re
import subprocess
import sys
import types

import pytest

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


def test_moved_names_keep_working_at_their_old_place():
  for name, namespace in jl._MOVED.items():
    assert getattr(jl, name) is getattr(getattr(jl, namespace), name), name
    assert name in getattr(jl, namespace).__all__, name
    assert name not in jl.__all__ and name in dir(jl)
  assert jl.fp8.Fp8Config is jl.Fp8Config and jl.diagnostics.every_n_steps is jl.every_n_steps
  with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
    jl.not_a_name  # noqa: B018


def test_old_flax_modules_are_attributes_of_jmp_lite_flax():
  # In a fresh process: here earlier tests may have imported the submodules already.
  code = (
    "import jmp_lite as jl\n"
    "assert jl.flax.accumulate.dot_general is jl.flax.dot_general\n"
    "assert jl.flax.train_state.TrainState is jl.flax.TrainState\n"
    "from jmp_lite.dtypes import DTypeLike, ScalarType\n"
    "from jmp_lite.flax.accumulate import is_16bit_float\n"
    "try:\n  jl.flax.not_a_module\nexcept AttributeError as e:\n  print(e)\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "module 'jmp_lite.flax' has no attribute 'not_a_module'"


def test_old_module_paths_are_aliases_of_the_private_modules():
  import jmp_lite._policy
  import jmp_lite.dtypes
  import jmp_lite.flax._linen
  import jmp_lite.flax.linen
  import jmp_lite.loss_scale
  import jmp_lite.policy
  import jmp_lite.transform

  assert jmp_lite.policy.get_policy is jmp_lite._policy.get_policy is jl.get_policy
  assert jmp_lite.loss_scale.DynamicLossScale is jl.DynamicLossScale
  assert jmp_lite.transform.loss_scaling is jl.loss_scaling
  assert jmp_lite.dtypes.FORMATS is jl.FORMATS
  assert jmp_lite.flax.linen.policy_apply is jmp_lite.flax._linen.policy_apply
  assert jl.transform.loss_scaling is jl.loss_scaling and jl.policy.Policy is jl.Policy
