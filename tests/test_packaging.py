"""Release checks: the sdist, the wheel built from it, and the wheel installed in a fresh venv.

``python -m build`` runs without build isolation (``setuptools>=77`` and ``build`` come with the
``test`` extra), so nothing is downloaded. The wheel is installed with ``--no-deps --no-index``
into a new virtual environment; the environment sees the already-installed
dependencies (jax, flax, optax...) through a ``.pth`` file listing this interpreter's
site-packages, but not this checkout or its editable install, so the smoke test imports the
installed copy.
"""

import email
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile

import pytest
from packaging.requirements import Requirement

import jmp_lite

ROOT = pathlib.Path(__file__).resolve().parents[1]

SMOKE_TEST = """
import importlib.metadata, pathlib, sys
import jax, jax.numpy as jnp, optax
import jmp_lite as jl, jmp_lite.flax, jmp_lite.fp8

location = pathlib.Path(jl.__file__).resolve()
assert location.is_relative_to(pathlib.Path(sys.prefix).resolve()), location
assert importlib.metadata.version("jmp_lite") == jl.__version__ == sys.argv[1]
assert (location.parent / "py.typed").exists()
from packaging.requirements import Requirement
for line in importlib.metadata.requires("jmp_lite"):
  req = Requirement(line)
  if req.marker is None:  # the runtime dependencies (not the extras) are satisfied
    assert req.specifier.contains(importlib.metadata.version(req.name), prereleases=True), line

policy = jl.get_policy("p=f32,c=f16,o=f32")
tx = jl.loss_scaling(optax.sgd(0.1), jl.DynamicLossScale(jnp.float32(2.0**30)))
params = {"w": jnp.ones(3)}
opt_state = tx.init(params)

@jax.jit
def step(params, opt_state):
  loss_fn = lambda p: jnp.sum(policy.cast_to_compute(p["w"]) ** 2).astype(jnp.float32)
  loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state

params, opt_state = step(params, opt_state)  # 2^30 overflows fp16: skipped, scale halved
assert int(jl.get_loss_scaling_state(opt_state).skipped_steps) == 1
assert float(jl.get_loss_scale(opt_state).loss_scale) == 2.0**29
print("smoke test ok", jl.__version__)
"""


def _require(module: str) -> None:
  if importlib.util.find_spec(module) is None:
    message = f"{module} is not installed: pip install -e '.[test]'"
    if os.environ.get("CI"):
      pytest.fail(message)
    pytest.skip(message)


def _run(args: list[str], cwd: pathlib.Path, timeout: float = 300, stream: str = "stdout") -> str:
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
  if result.returncode != 0:
    pytest.fail(f"`{' '.join(args)}` failed:\n{result.stdout}\n{result.stderr}", pytrace=False)
  return getattr(result, stream)


# One worker runs this module under pytest-xdist, so its module fixture runs once.
pytestmark = pytest.mark.xdist_group("packaging")


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> pathlib.Path:
  """Runs ``python -m build`` (sdist, then the wheel from the sdist) once for the module."""
  _require("build")
  out = tmp_path_factory.mktemp("dist")
  build = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)]
  log = _run(build, out, stream="stderr")  # build's own progress lines
  # The wheel is built from the unpacked sdist, as pip installing the sdist would build it: a
  # file the sdist lacks is missing from the wheel too, so installing the wheel checks both.
  assert "Building wheel from sdist" in log, log
  return out


def _artifact(dist: pathlib.Path, pattern: str) -> pathlib.Path:
  (path,) = dist.glob(pattern)
  return path


def _fresh_venv(path: pathlib.Path) -> pathlib.Path:
  """A new venv that sees this interpreter's third-party packages but not this checkout."""
  import venv

  venv.EnvBuilder(with_pip=False).create(path)
  python = path / "bin" / "python"
  site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], path)
  ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
  pathlib.Path(site.strip(), "_system_site_packages.pth").write_text("\n".join(sorted(ours)))
  return python


def test_wheel_built_from_the_sdist_installs_in_a_fresh_venv_and_works(dist, tmp_path):
  artifact = _artifact(dist, "*.whl")
  python = _fresh_venv(tmp_path / "venv")
  _run(
    [
      sys.executable,
      "-m",
      "pip",
      "--python",
      str(python),
      "install",
      "--quiet",
      "--no-deps",
      "--no-index",
      "--no-build-isolation",
      str(artifact),
    ],
    tmp_path,
  )
  out = _run([str(python), "-c", SMOKE_TEST, jmp_lite.__version__], tmp_path)
  assert "smoke test ok" in out


def test_wheel_contents_and_metadata(dist):
  wheel = _artifact(dist, "*.whl")
  assert wheel.name == f"jmp_lite-{jmp_lite.__version__}-py3-none-any.whl"
  with zipfile.ZipFile(wheel) as zf:
    names = zf.namelist()
    info = f"jmp_lite-{jmp_lite.__version__}.dist-info"
    metadata = email.message_from_bytes(zf.read(f"{info}/METADATA"))
  assert "jmp_lite/py.typed" in names and "jmp_lite/flax/__init__.py" in names
  assert f"{info}/licenses/LICENSE" in names
  assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/", "docs/"))]
  assert metadata["Version"] == jmp_lite.__version__
  assert metadata["License-Expression"] == "Apache-2.0"
  assert metadata["Requires-Python"] == ">=3.11"
  # The runtime dependencies and the extras are pyproject.toml's.
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  runtime = [str(Requirement(r)) for r in metadata.get_all("Requires-Dist") if ";" not in r]
  assert runtime == [str(Requirement(r)) for r in project["dependencies"]]
  assert set(metadata.get_all("Provides-Extra")) == set(project["optional-dependencies"])


def test_sdist_contents(dist):
  sdist = _artifact(dist, "*.tar.gz")
  with tarfile.open(sdist) as tf:
    names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
  for required in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "jmp_lite/py.typed"):
    assert required in names, required
  assert "tests/test_packaging.py" in names and "docs/conf.py" in names


def test_version_is_defined_once():
  """``jmp_lite.__version__`` is the only place; pyproject.toml reads it, CHANGELOG has it."""
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "version" not in pyproject["project"] and pyproject["project"]["dynamic"] == ["version"]
  assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "jmp_lite.__version__"}
  changelog = (ROOT / "CHANGELOG.md").read_text()
  assert re.search(rf"^## {re.escape(jmp_lite.__version__)}\b", changelog, re.M)


def test_license_is_apache_2():
  text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert pyproject["project"]["license"] == "Apache-2.0"


OLDEST_JAX = "0.10.0"  # the floor in pyproject.toml: jax>=0.10
OLDEST_JAX_TESTS = ["tests/test_policy.py", "tests/test_loss_scale.py", "tests/test_transform.py"]


@pytest.mark.skipif(
  not os.environ.get("JMP_LITE_TEST_OLDEST_JAX"),
  reason="downloads jax/jaxlib " + OLDEST_JAX + "; set JMP_LITE_TEST_OLDEST_JAX=1 to run",
)
def test_oldest_supported_jax(tmp_path):
  """The core tests pass with the oldest JAX that pyproject.toml allows (opt-in: ~100 MB)."""
  python = _fresh_venv(tmp_path / "venv")
  pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps"]
  _run([*pip, f"jax=={OLDEST_JAX}", f"jaxlib=={OLDEST_JAX}"], tmp_path, timeout=600)
  version = _run([str(python), "-c", "import jax; print(jax.__version__)"], tmp_path)
  assert version.strip() == OLDEST_JAX
  _run(
    [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *OLDEST_JAX_TESTS],
    ROOT,
    timeout=900,
  )
