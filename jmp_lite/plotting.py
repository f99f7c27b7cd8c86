"""Matplotlib figures of gradient statistics and of the loss scale over training.

Three plots of what :mod:`jmp_lite.diagnostics` computes: the exponent
histogram of the gradients against a format's range, the fractions of values
lost per layer, and the loss scale over steps with the skipped steps marked.
Each draws on ``ax`` (default: a new figure's axes) and returns the axes.

Importing this module does not import matplotlib, and neither does
``import jmp_lite``: the first plot does. matplotlib is an optional dependency
(``pip install matplotlib``, or the ``examples`` extra of a clone); without it,
a plot raises ImportError.

::

  from jmp_lite import diagnostics, plotting

  # In the jitted step: stats = diagnostics.gradient_statistics(grads, loss_scale=scale)
  # and health = diagnostics.loss_scale_health(opt_state); on the host:
  stats = jax.device_get(stats)
  plotting.plot_gradient_histogram(stats, "float16", loss_scale=2.0**15)
  plotting.plot_underflow_by_layer(stats)
  # scales: health.loss_scale of every step; skipped: ~state.last_finite of every step.
  plotting.plot_loss_scale(scales, skipped=skipped, min_loss_scale=1.0)
"""

from jmp_lite._plotting import plot_gradient_histogram, plot_loss_scale, plot_underflow_by_layer

__all__ = (
  "plot_gradient_histogram",
  "plot_underflow_by_layer",
  "plot_loss_scale",
)

# The implementation lives in a private module (``jmp_lite._plotting``); use the names above.
