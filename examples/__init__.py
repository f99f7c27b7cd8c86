"""Runnable training scripts for jmp_lite (see docs/examples.md).

* ``python -m examples.compare``: one example under every mixed precision recipe,
  side by side (table, plots, JSON); the Quickstart's first line.
* ``python -m examples.charlm``: a character-level transformer LM on Python's own
  standard library sources.
* ``python -m examples.digits``: a BatchNorm convnet on scikit-learn's bundled digits.
* ``examples/quickstart.py``: a dynamic loss scale backing off, narrated.
"""
