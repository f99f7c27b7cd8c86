"""The memory benchmark (benchmarks/memory.py) in its tiny --quick mode."""

import importlib.util
import pathlib
import sys

import jax.numpy as jnp
import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "memory.py"


# One worker runs this module under pytest-xdist, so its module fixture runs once.
pytestmark = pytest.mark.xdist_group("memory_benchmark")


@pytest.fixture(scope="module")
def memory():
  name = "jmp_lite_benchmarks_memory"
  spec = importlib.util.spec_from_file_location(name, _PATH)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # dataclasses (flax modules) look their module up
  try:
    spec.loader.exec_module(module)
    yield module
  finally:
    del sys.modules[name]


def test_quick_run_reports_residual_ratios(memory, capsys):
  result = memory.main(["--quick", "--no-compile", "--batches", "2"])
  assert "| batch |" in capsys.readouterr().out
  # Params and Adam's two moments, all fp32, and Adam's int32 step count; no 16-bit copy.
  assert result["persistent"] == {"bytes": 3 * result["param_bytes"] + 4, "bytes_16bit": 0}
  for row in result["rows"]:
    for name in memory.COMPARED:
      assert 0.2 < row[f"{name}/fp32 residual"] < 1.0, (name, row)
    # Storing the LayerNorm islands costs memory; the default recomputes them.
    assert row["jmp_lite"]["residual"] < row["jmp_lite_stored"]["residual"]
    assert row["fp32"]["by_dtype"].keys() <= {"float32", "int32", "bool"}
    assert "bfloat16" in row["jmp_lite"]["by_dtype"]


def test_residuals_separate_the_step_inputs(memory):
  w, x = jnp.ones((4, 4)), jnp.ones((3, 4))

  def loss(w, x):  # differentiated w.r.t. w only
    h = x @ w  # keeps x, an input of the step
    return jnp.sum(jnp.sin(h))  # keeps cos(h), computed

  stats = memory.residuals(loss, w, x)
  assert stats["count"] == 2
  assert stats["residual"] == 4 * (12 + 12)
  assert stats["activations"] == 4 * 12  # cos(h) only
  assert stats["by_dtype"] == {"float32": stats["residual"]}
  # A bf16 cast of w is not an input: its residual counts as an activation.
  half = memory.residuals(lambda w, x: loss(w.astype(jnp.bfloat16), x.astype(jnp.bfloat16)), w, x)
  assert half["activations"] == half["residual"] == 2 * (12 + 12)


def test_compiled_memory_analysis(memory):
  params, tokens = {"w": jnp.ones((64, 64))}, jnp.ones((8, 64))
  stats = memory.compiled(lambda p, t: jnp.sum(jnp.tanh(t @ p["w"])), params, tokens)
  if stats:  # empty on backends without a memory analysis
    # Arguments: params, two Adam moments, the int32 count and the tokens, nothing else.
    assert stats["argument"] == 3 * 64 * 64 * 4 + 4 + 8 * 64 * 4
    # Outputs: the new params, moments and count (plus the tuple's own buffers, if any).
    assert 3 * 64 * 64 * 4 + 4 <= stats["output"] < stats["argument"]
    # Nothing is donated, so nothing aliases; the temporaries (the gradient, at most) stay
    # below one more copy of the state.
    assert stats["alias"] == 0
    assert 0 <= stats["temp"] <= 3 * 64 * 64 * 4
