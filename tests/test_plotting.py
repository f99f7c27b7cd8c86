"""Plots: run only where matplotlib (the `examples` extra) is installed."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jl
from jmp_lite import diagnostics as diag

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
plt = pytest.importorskip("matplotlib.pyplot")

from jmp_lite import plotting  # noqa: E402 (after the skip)


@pytest.fixture
def ax():
  fig, ax = plt.subplots()
  yield ax
  plt.close(fig)


def stats():
  grads = {
    "params": {
      "Dense_0": {"kernel": jnp.array([2.0**-40, 2.0**-30, 2.0**-10, 1.0])},
      "Dense_1": {"kernel": jnp.array([0.0, 2.0**-3, 2.0**5, 2.0**5])},
    }
  }
  return jax.device_get(diag.gradient_statistics(grads, loss_scale=2.0**10))


def test_gradient_histogram_against_the_format_range(ax, tmp_path):
  s = stats()
  out = plotting.plot_gradient_histogram(s, "float16", ax=ax)
  assert out is ax
  (bars,) = ax.containers
  assert len(bars) == len(s["params/Dense_0"].histogram)
  heights = {round(b.get_x()): b.get_height() for b in bars if b.get_height() > 0}
  # Both layers summed, one bar per exponent.
  assert heights == {-40: 1, -30: 1, -10: 1, 0: 1, -3: 1, 5: 2}
  labels = ax.get_legend_handles_labels()[1]
  assert "float16 normal range" in labels and "float16 subnormal" in labels
  (underflow_line,) = [line for line in ax.lines if line.get_label() == "underflow below"]
  # At S = 2^10, float16 keeps |g| from 2^-24 / 2^10 = 2^-34 up.
  assert underflow_line.get_xdata()[0] == pytest.approx(-34)
  fig = ax.figure
  fig.savefig(tmp_path / "hist.png")
  # The file holds the figure: the pixels the canvas renders (RGBA, 8 bits per channel).
  fig.canvas.draw()
  rendered = np.asarray(fig.canvas.buffer_rgba())
  width, height = np.round(fig.get_size_inches() * fig.dpi).astype(int)
  assert rendered.shape == (height, width, 4)
  png = plt.imread(tmp_path / "hist.png")
  np.testing.assert_array_equal(np.round(png * 255).astype(np.uint8), rendered)


def test_histogram_with_another_scale_and_single_layer(ax):
  s = stats()["params/Dense_1"]
  plotting.plot_gradient_histogram(s, "bfloat16", loss_scale=1.0, ax=ax)
  (line,) = [line for line in ax.lines if line.get_label() == "underflow below"]
  assert line.get_xdata()[0] == pytest.approx(np.log2(jl.format_info("bf16").min_subnormal))


def test_underflow_by_layer(ax):
  s = stats()
  plotting.plot_underflow_by_layer(s, ax=ax)
  assert [t.get_text() for t in ax.get_yticklabels()] == ["params/Dense_0", "params/Dense_1"]
  underflow, subnormal, zero = ([b.get_width() for b in c] for c in ax.containers)
  # At S = 2^10: 2^-40 -> 2^-30 rounds to 0 in float16, 2^-30 -> 2^-20 is subnormal.
  assert underflow == [0.25, 0.0]
  assert subnormal == [0.25, 0.0]
  assert zero == [0.0, 0.25]


def test_loss_scale_over_time(ax):
  scales = [2.0**15, 2.0**14, 2.0**13, 2.0**13, 2.0**14]
  skipped = [True, True, False, False, False]
  plotting.plot_loss_scale(scales, skipped=skipped, min_loss_scale=1.0, ax=ax)
  curve = next(line for line in ax.lines if line.get_label() == "loss scale")
  np.testing.assert_array_equal(curve.get_ydata(), scales)
  marks = next(line for line in ax.lines if line.get_label() == "skipped step")
  np.testing.assert_array_equal(marks.get_xdata(), [0, 1])
  assert ax.get_yscale() == "log"


def test_loss_scale_legend_has_the_curves_colour(ax):
  from matplotlib.colors import same_color

  plotting.plot_loss_scale([2.0**15, 2.0**14], ax=ax, color="tab:orange")
  (curve,) = ax.lines
  (entry,) = ax.get_legend().legend_handles
  assert same_color(curve.get_color(), "tab:orange")
  assert same_color(entry.get_color(), "tab:orange")


def test_no_skipped_steps_no_skip_legend(ax):
  plotting.plot_loss_scale([2.0**15] * 3, skipped=[False] * 3, ax=ax)
  assert [t.get_text() for t in ax.get_legend().get_texts()] == ["loss scale"]


def test_plot_argument_errors(ax):
  with pytest.raises(ValueError, match="skipped"):
    plotting.plot_loss_scale([1.0, 2.0], skipped=[True], ax=ax)
  with pytest.raises(ValueError, match="positive"):
    plotting.plot_loss_scale([1.0, 0.0], ax=ax)
  no_hist = diag.gradient_statistics({"w": jnp.ones(2)}, exponent_range=None)
  with pytest.raises(ValueError, match="histogram"):
    plotting.plot_gradient_histogram(no_hist, ax=ax)
  with pytest.raises(TypeError, match="GradientStats"):
    plotting.plot_gradient_histogram({"w": 1.0}, ax=ax)
  with pytest.raises(ValueError, match="fields"):
    plotting.plot_underflow_by_layer(stats(), fields=["bogus"], ax=ax)


def test_missing_matplotlib_gives_a_clear_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # makes the import fail
  with pytest.raises(ImportError, match="pip install matplotlib"):
    plotting.plot_loss_scale([1.0])


def test_core_never_imports_matplotlib():
  code = (
    "import sys, jmp_lite, jmp_lite._audit, jmp_lite.diagnostics, jmp_lite.plotting; "
    "assert 'matplotlib' not in sys.modules, 'imported'"
  )
  subprocess.run(
    [sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
  )
