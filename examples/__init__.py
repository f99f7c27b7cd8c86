"""Runnable training scripts for jmp_lite (see docs/examples.md).

* ``python -m examples.compare``: one example under every mixed precision recipe,
  side by side (table, plots, JSON); the Quickstart's first line.
* ``python -m examples.charlm``: a character-level transformer LM on Python's own
  standard library sources.
* ``python -m examples.digits``: a BatchNorm convnet on scikit-learn's bundled digits.
* ``examples/quickstart.py``: a dynamic loss scale backing off, narrated.
* Single-file training scripts to copy, on scikit-learn's digits in fp16:
  ``examples/optax_fp16.py`` (plain Optax, README's step), ``examples/linen_train_state.py``
  (``jl.flax.TrainState``), ``examples/nnx_optimizer.py`` (``jl.flax.Optimizer``),
  ``examples/equinox_autocast.py`` (Equinox); ``examples/haiku_autocast.py`` (Haiku).
"""
