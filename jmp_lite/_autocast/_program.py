"""The op table applied to a program whose dtypes are already chosen (the Flax entry points).

:func:`~jmp_lite.autocast` chooses the dtypes itself: it casts the arguments to the compute
dtype and the results to the output dtype. The Flax entry points choose them per module class
(a 16-bit dense layer, an fp32 LayerNorm); what their class table cannot see is the code a
model writes itself (``jax.nn.softmax`` in an attention function, ``jnp.var`` in a hand-written
norm). :func:`rewrite` evaluates such a program under the op table and changes nothing else:
arguments and results keep their dtypes, and matmuls keep the operands the modules gave them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _compat
from jmp_lite._autocast._interpret import Config, Interpreter, Value
from jmp_lite._autocast._table import AUTOCAST_TABLE

_F32 = np.dtype(np.float32)

# The modules' own matmuls already run as their class decides (jmp_lite's kernels on 16-bit
# operands, the fp32 output layer): the table leaves them as written. A product with a
# broadcast 16-bit value (a hand-written norm's scale, a ``keepdims`` statistic) has its
# gradient summed in fp32, as under autocast: under the default overrides the class table's
# modules multiply by none (their norms are fp32, their attention scales by a division).
# Other broadcasts keep JAX's 16-bit sum: a bias add is a Flax module's (Dense, Conv), whose
# gradient Flax's own ``dtype=bfloat16`` sums, and reduces across devices, in bf16.
MODULE_TABLE = {
  **{
    name: "input" if rule in ("compute", "sum_grad_float32") else rule
    for name, rule in AUTOCAST_TABLE.items()
  },
  "mul": "sum_grad_float32",
}


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _is_jax_type(x: Any) -> bool:
  return _is_array(x) or isinstance(x, (bool, int, float, complex))


def evaluate(
  call: Callable[[Any], Any], tree: Any, config: Config, trace_as: Callable[[Any], Any]
) -> tuple[list[Value], Callable[[list[Any]], Any]]:
  """Traces ``call(tree)`` and evaluates its program under ``config``.

  Args:
    call: a function of one pytree.
    tree: its argument; its array leaves are the program's inputs, the other leaves constants.
    config: the compute dtype, table and scopes the interpreter applies.
    trace_as: maps each array leaf to the value it is traced at (e.g. cast to the compute
      dtype); the leaf itself is the unrounded fp32 value where it is fp32 and that is not.

  Returns:
    The :class:`Value` of each array output, and a function that takes one value per array
    output and returns the output tree (its other leaves as the call returned them).
  """
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
  given = [leaves[i] for i in dynamic]
  traced = [trace_as(x) for x in given]
  out_tree = []

  def flat(*values):
    full = list(leaves)
    for i, v in zip(dynamic, values, strict=True):
      full[i] = v
    out, out_def = jax.tree_util.tree_flatten(call(jax.tree_util.tree_unflatten(treedef, full)))
    # Leaves that are not arrays (strings, None...) are returned as they are.
    out_tree.append((out_def, [None if _is_jax_type(o) else o for o in out]))
    return [o for o in out if _is_jax_type(o)]

  closed = jax.make_jaxpr(flat)(*traced)
  ins = [
    Value(t, g if _is_float(g) and g.dtype == _F32 and t.dtype != _F32 else None)
    for t, g in zip(traced, given, strict=True)
  ]
  prefix = _compat.current_name_stack()  # the caller's name stack, kept
  outs = Interpreter(config).run(closed.jaxpr, closed.consts, ins, prefix)
  out_def, static = out_tree[0]

  def rebuild(values: list[Any]) -> Any:
    it = iter(values)
    return jax.tree_util.tree_unflatten(out_def, [next(it) if s is None else s for s in static])

  return outs, rebuild


def _is_float(x: Any) -> bool:
  return _is_array(x) and bool(jnp.issubdtype(x.dtype, jnp.floating))


def rewrite(fun: Callable[..., Any], compute_dtype: Any) -> Callable[..., Any]:
  """``fun`` with :data:`MODULE_TABLE` applied to its traced program, dtypes unchanged.

  Args:
    fun: a function of pytrees of arrays (other leaves are constants of the trace).
    compute_dtype: the policy's compute dtype (what a 16-bit operation is).

  Returns:
    A function with ``fun``'s signature: the same results at the same dtypes, its 16-bit
    ``exp``/``log``/``rsqrt``/long sums computed in fp32.
  """
  config = Config(np.dtype(compute_dtype), MODULE_TABLE, ())

  @functools.wraps(fun)
  def wrapped(*args: Any, **kwargs: Any) -> Any:
    call = lambda tree: fun(*tree[0], **tree[1])
    outs, rebuild = evaluate(call, (args, kwargs), config, lambda x: x)
    return rebuild([v.narrow for v in outs])

  return wrapped
