"""The package's layout rules (docs/development.md), checked on the source.

Sizes: no module over 500 lines, no class over 200, no function over 60 lines of code (its
docstring not counted). Privacy: the public
modules are the namespaces, and no module imports another module's ``_name``. Layers: imports
flow one way (dtypes -> policy -> loss scales -> transform -> layer-wise/fp8/checks -> flax),
and only ``jmp_lite/flax`` imports Flax. Weight: ``import jmp_lite`` imports nothing that
``import jax, optax`` does not. Scripts: benchmarks and examples never assign into jmp_lite.
Tests: each test file is named after the module it tests, or is a listed topic.
Unstable APIs: only the compatibility modules use JAX's and Flax's internals.
"""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

from .package_testing import NAMESPACES

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "jmp_lite"
SOURCES = sorted(PACKAGE.rglob("*.py"))
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 500, 200, 60

# The lowest layer first; a module may import its own layer or a lower one.
LAYERS = (
  ("_compat", "_validation", "_tree_util", "_context", "_jaxpr", "_dtypes", "_frames"),
  ("_matmul_precision",),
  ("_finite", "_fp8_config", "_policy", "_policy_scope"),
  ("_autocast",),
  ("_loss_scale",),
  ("_transform", "_rounding", "_low_precision_params"),
  ("layerwise", "fp8", "_audit", "_step_check", "diagnostics", "_plotting", "plotting"),
  ("flax",),
  ("__init__",),
)


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
  if module == "jmp_lite":
    return len(LAYERS) - 1
  first = module.split(".")[1]
  for rank, names in enumerate(LAYERS):
    if first in names:
      return rank
  raise AssertionError(f"{module} is in no layer of LAYERS: add it")


def _imports(tree: ast.Module):
  """(imported module, imported names) for every import in the file, lazy ones too."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, ()
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      yield node.module, tuple(alias.name for alias in node.names)


def test_public_modules_are_the_namespaces():
  # Code lives in private modules; a public module is a curated namespace, never a second path
  # to names another namespace exports. Flax's module name `dynamic_scale` is kept so that
  # `from jmp_lite.flax import dynamic_scale as dynamic_scale_lib` replaces Flax's import.
  public = {
    module
    for module in map(_module_name, SOURCES)
    if not any(part.startswith("_") for part in module.split("."))
  }
  assert public == {*NAMESPACES, "jmp_lite.flax.dynamic_scale"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_sizes(path):
  source = path.read_text()
  lines = len(source.splitlines())
  assert lines <= MAX_MODULE, f"{lines} lines, over {MAX_MODULE}"
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ClassDef):
      lines = node.end_lineno - node.lineno + 1
      assert lines <= MAX_CLASS, f"class {node.name}: {lines} lines, over {MAX_CLASS}"
    elif isinstance(node, ast.FunctionDef):
      # A public function's docstring (Args, Returns, Raises, an example) is not its size.
      first = node.body[0]
      doc = ast.get_docstring(node) is not None
      lines = node.end_lineno - node.lineno + 1 - (first.end_lineno - first.lineno + 1) * doc
      assert lines <= MAX_FUNCTION, f"{node.name}: {lines} lines of code, over {MAX_FUNCTION}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_respect_privacy_and_layers(path):
  module = _module_name(path)
  rank = _layer(module) if module != "jmp_lite" else len(LAYERS) - 1
  in_flax = module == "jmp_lite.flax" or module.startswith("jmp_lite.flax.")
  for imported, names in _imports(ast.parse(path.read_text())):
    if imported.split(".")[0] == "flax":
      assert in_flax, f"{module} imports {imported}: only jmp_lite.flax may"
    if imported.split(".")[0] != "jmp_lite":
      continue
    for name in names:
      if (
        name.startswith("_")
        and not name.startswith("__")
        and not (PACKAGE.parent / imported.replace(".", "/")).is_dir()
      ):
        raise AssertionError(f"{module} imports {name} from {imported}: a private name")
    targets = [f"{imported}.{n}" for n in names] if imported == "jmp_lite" else [imported]
    for target in targets:
      if target in ("jmp_lite", "jmp_lite.flax"):
        continue
      assert _layer(target) <= rank, f"{module} (layer {rank}) imports {target} from above"


def test_import_jmp_lite_adds_no_package_to_jax_and_optax():
  code = (
    "import sys; import jax, optax; before = set(sys.modules); import jmp_lite; "
    "print(' '.join(sorted(set(sys.modules) - before)))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  added = out.stdout.split()
  assert {name.split(".")[0] for name in added} == {"jmp_lite"}
  # Nor the parts of JAX that `import jax` leaves out: jax.extend alone imports Pallas.
  assert [name for name in added if name.startswith(("jax.", "optax."))] == []


SCRIPTS = sorted(
  path for folder in ("benchmarks", "examples") for path in (PACKAGE.parent / folder).glob("*.py")
)


def _jmp_lite_bindings(tree: ast.Module) -> set[str]:
  """The names a script binds to jmp_lite or something imported from it."""
  bound = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "jmp_lite":
          bound.add(alias.asname or "jmp_lite")
    elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "jmp_lite":
      bound.update(alias.asname or alias.name for alias in node.names)
  return bound


def _root(node: ast.expr) -> str | None:
  while isinstance(node, ast.Attribute):
    node = node.value
  return node.id if isinstance(node, ast.Name) else None


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_scripts_pass_what_they_need_instead_of_patching_jmp_lite(path):
  # A benchmark that swaps a library function or sets a library hook measures a variant the
  # library does not offer, and the hook stays in the library for that one script.
  tree = ast.parse(path.read_text())
  bound = _jmp_lite_bindings(tree)
  for node in ast.walk(tree):
    targets = []
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
      targets = [node.target]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
      if node.func.id in ("setattr", "delattr"):
        targets = [ast.Attribute(node.args[0], "?")]
    for target in targets:
      if isinstance(target, ast.Attribute) and _root(target) in bound:
        raise AssertionError(f"line {node.lineno}: assigns into jmp_lite ({ast.unparse(target)})")
    if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
      name = node.args[0] if node.args else None
      if isinstance(name, ast.Constant) and str(name.value).startswith("jmp_lite"):
        raise AssertionError(f"line {node.lineno}: imports {name.value} by name")


# Tests mirror modules: tests/test_X.py tests jmp_lite/_X.py (or the package jmp_lite/_X/),
# tests/flax/test_X.py tests jmp_lite/flax/_X.py, and tests/test_P_X.py the module X of the
# package P (tests/test_fp8_recipes.py for jmp_lite/fp8/_recipes.py). A test file named after no
# module is a topic, listed here with what it covers (docs/development.md, "The layout").
TESTS = pathlib.Path(__file__).resolve().parent
TOPICS = {
  "test_api_reference.py": "the API reference pages list every public name once",
  "test_autocast_frameworks.py": "autocast on Flax linen and NNX, Equinox and Haiku models",
  "test_autocast_models.py": "autocast on whole models against hand-written 16-bit versions",
  "test_autocast_overrides.py": "autocast's per-class overrides (Equinox, Haiku)",
  "test_deviceless_benchmark.py": "benchmarks/deviceless.py",
  "test_docs.py": "the guides' code blocks run",
  "test_docstrings.py": "the docstrings' examples run",
  "test_examples.py": "the scripts of examples/",
  "test_fp8_benchmarks.py": "benchmarks/fp8_recipe_errors.py and benchmarks/fp8_training.py",
  "test_gpu_benchmark.py": "benchmarks/gpu.py",
  "test_jmp_compat.py": "a jmp user's code runs unchanged",
  "test_layerwise_experiment.py": "the layer-wise experiment and benchmark scripts",
  "test_layout.py": "the package's and the tests' layout",
  "test_low_precision_params_benchmark.py": "benchmarks/low_precision_params.py",
  "test_mpx_compat.py": "the same results as mixed-precision-for-jax",
  "test_multiprocess.py": "two processes under jax.distributed",
  "test_package.py": "the public API, the README's Quickstart and CI agree",
  "test_packaging.py": "the sdist and the wheel",
  "test_static_checks.py": "ruff, mypy, the docs build and the test tiers",
  "flax/test_data_parallel.py": "axis_name on TrainState and Optimizer, on 8 devices",
  "flax/test_differential.py": "every op the Flax policy substitutes, against Flax's own",
  "flax/test_fp8_decoder.py": "a causal decoder trained in fp8",
  "flax/test_lifted.py": "Flax's lifted transforms inside a model",
  "flax/test_low_precision_params.py": "bf16 parameters through TrainState, Optimizer and orbax",
  "flax/test_memory_benchmark.py": "benchmarks/memory.py",
  "flax/test_model_ops.py": "the op table on the ops a model writes itself",
  "flax/test_proxies_benchmark.py": "benchmarks/proxies.py",
  "flax/test_sharding.py": "policy_apply with FSDP-sharded parameters, on 8 devices",
}
# Files under tests/ that hold no tests: helpers that tests import, and scripts run by path.
HELPER = re.compile(r"__init__|conftest|\w+_testing|\w+_worker")
TEST_FILES = sorted(p.relative_to(TESTS).as_posix() for p in TESTS.rglob("*.py"))


def _modules(package: pathlib.Path) -> dict[str, pathlib.Path]:
  """The modules and subpackages of ``package`` by name, without the leading underscore."""
  return {
    path.stem.removeprefix("_"): path
    for path in package.iterdir()
    if not path.name.startswith("__") and (path.suffix == ".py" or (path / "__init__.py").exists())
  }


def _module_tested_by(path: str) -> pathlib.Path | None:
  """The module or package that the test file ``path`` (relative to tests/) is named after."""
  *folders, file = path.split("/")
  package, name = PACKAGE.joinpath(*folders), file.removeprefix("test_").removesuffix(".py")
  while package.is_dir():
    modules = _modules(package)
    if name in modules:
      return modules[name]
    prefix = next((p for p in modules if name.startswith(f"{p}_") and modules[p].is_dir()), None)
    if prefix is None:
      return None
    package, name = modules[prefix], name.removeprefix(f"{prefix}_")
  return None


def test_test_files_are_named_after_a_module_or_a_listed_topic():
  tests = [p for p in TEST_FILES if not HELPER.fullmatch(p.split("/")[-1].removesuffix(".py"))]
  assert [p for p in tests if not p.split("/")[-1].startswith("test_")] == []  # never collected
  assert [p for p in tests if p not in TOPICS and _module_tested_by(p) is None] == []
  # A topic that is a module's name belongs to the module; a topic without a file is stale.
  assert [p for p in TOPICS if _module_tested_by(p) is not None or p not in TEST_FILES] == []


def test_test_folders_mirror_packages_without_stutter():
  paths = map(pathlib.PurePosixPath, TEST_FILES)
  folders = sorted({path.parent for path in paths} - {pathlib.PurePosixPath(".")})
  assert [str(f) for f in folders if not PACKAGE.joinpath(f).is_dir()] == []
  # tests/flax/test_linen.py, not tests/flax/test_flax_linen.py.
  stutters = [p for p in TEST_FILES if any(p.startswith(f"{f}/test_{f.name}_") for f in folders)]
  assert stutters == []
  assert sorted(p.name for p in (TESTS / "flax").glob("test_flax_*")) == []


# The only modules that use JAX's or Flax's internal or unstable APIs: each entry there names
# the public API it stands in for and the versions it was checked on (tests/test_compat.py).
COMPAT = (PACKAGE / "_compat.py", PACKAGE / "flax" / "_compat.py")
_INTERNAL_MODULES = ("jax._src", "jax.extend", "jax.core", "flax.nnx.graph")
_INTERNAL_PREFIXES = ("jax._src.", "jax.extend.", "jax.core.", "nnx.graph.", "flax.nnx.graph.")
# Primitive binding, jit's cache counter, the aval's shard_map axes, an equation's context.
_INTERNAL_ATTRIBUTES = frozenset({"bind", "get_bind_params", "_cache_size", "manual_axis_type"})
# pyproject's lowest versions have every API used: no hasattr(jax..., ...) version branches.
_JAX_AND_FLAX = frozenset({"jax", "lax", "jnp", "flax", "nn", "nnx"})


def _dotted(node: ast.expr) -> str:
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    parts.append(node.id)
  return ".".join(reversed(parts))


def _unstable_uses(tree: ast.Module, path: pathlib.Path):
  """What in ``tree`` reaches JAX's or Flax's internals (docstrings and comments aside)."""
  for imported, names in _imports(tree):
    for module in (imported, *(f"{imported}.{name}" for name in names)):
      if module.startswith(_INTERNAL_MODULES):
        yield f"imports {module}"
  docstrings = {
    id(node.value)
    for node in ast.walk(tree)
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
  }
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute):
      name = _dotted(node)
      if f"{name}.".startswith(_INTERNAL_PREFIXES):
        yield f"uses {name}"
      if node.attr in _INTERNAL_ATTRIBUTES and _root(node) != "_compat":
        yield f"uses .{node.attr}"
      if node.attr == "manager" and isinstance(node.value, ast.Attribute):
        if node.value.attr == "ctx":
          yield "uses an equation's .ctx.manager"
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2:
      target, attr = node.args[:2]
      if node.func.id in ("getattr", "hasattr") and isinstance(attr, ast.Constant):
        if attr.value in _INTERNAL_ATTRIBUTES:
          yield f"uses .{attr.value}"
        if node.func.id == "hasattr" and _root(target) in _JAX_AND_FLAX:
          yield f"checks for {_dotted(target)}.{attr.value} (a version branch)"
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      if "_src/" in node.value and id(node) not in docstrings:
        yield f"names JAX's file layout ({node.value!r})"


@pytest.mark.parametrize(
  "path", [p for p in SOURCES if p not in COMPAT], ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_only_the_compat_modules_use_unstable_apis(path):
  found = sorted(set(_unstable_uses(ast.parse(path.read_text()), path)))
  assert found == [], f"{path.name}: go through jmp_lite._compat (or jmp_lite.flax._compat)"


# The one trace-time platform read: Mxfp8Scaling(implementation="scaled_dot_general") refuses
# loudly where the backend does not compile it; a choice made at lowering could only fall back.
TRACE_TIME_PLATFORM = (PACKAGE / "fp8" / "_mx.py",)


@pytest.mark.parametrize(
  "path",
  [p for p in SOURCES if p not in TRACE_TIME_PLATFORM],
  ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_the_platform_is_chosen_at_lowering(path):
  # jax.default_backend() at trace time names the host's platform, not the one the program is
  # lowered for (a deviceless compile, jit(...).lower(lowering_platforms=...)); platform choices
  # go through lax.platform_dependent.
  tree = ast.parse(path.read_text())
  reads = [
    n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "default_backend"
  ]
  assert reads == [], f"{path.name}:{reads} reads the platform while tracing"


TEST_AND_BENCHMARK_FILES = sorted(
  path
  for folder in ("tests", "benchmarks")
  for path in (PACKAGE.parent / folder).rglob("*.py")
  if path != pathlib.Path(__file__).resolve()
)


def test_traces_are_counted_without_jit_s_private_counter():
  # jit's compilation counter (`_cache_size`) is private: tests, benchmarks, examples and the
  # guides count traces with a Python counter in the traced function (it runs once per trace).
  scripts = [*TEST_AND_BENCHMARK_FILES, *sorted((PACKAGE.parent / "examples").rglob("*.py"))]
  users = [
    str(path.relative_to(PACKAGE.parent))
    for path in scripts
    if any(
      isinstance(node, ast.Attribute) and node.attr == "_cache_size"
      for node in ast.walk(ast.parse(path.read_text()))
    )
  ]
  guides = sorted((PACKAGE.parent / "docs").rglob("*.md"))
  users += [str(p.relative_to(PACKAGE.parent)) for p in guides if "._cache_size(" in p.read_text()]
  assert users == []
