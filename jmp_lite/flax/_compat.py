"""Every Flax API jmp_lite uses that Flax does not promise to keep (private).

Each entry stands in for one internal or unstable Flax API, names the public API it would be
if Flax had one, and the Flax versions it was checked on (tests/test_compat.py checks each on
the installed one). Nothing else in jmp_lite imports ``flax.nnx.graph`` (tests/test_layout.py
enforces it). JAX's are in :mod:`jmp_lite._compat`.
"""

from __future__ import annotations

from typing import Any

from flax.nnx import graph


def is_graph_node(x: Any) -> bool:
  """Whether ``x`` is a node of an NNX object graph (an ``nnx.Module``, an ``nnx.Variable``)
  that ``nnx.split`` takes apart, rather than a pytree: ``flax.nnx.graph.is_graph_node``,
  which ``flax.nnx`` does not export. Checked on Flax 0.12.8.

  Args:
    x: anything.

  Returns:
    True for a graph node; False for an array, a number, or a list or dict (of graph nodes
    too).
  """
  return graph.is_graph_node(x)
