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
import numpy as np

from jmp_lite._autocast._interpret import Config, Interpreter, Value
from jmp_lite._autocast._table import AUTOCAST_TABLE

# The modules' own matmuls already run as their class decides (jmp_lite's kernels on 16-bit
# operands, the fp32 output layer): the table leaves them as written. So are the gradient sums
# of broadcasts: summed in fp32 they would reduce every bias gradient across devices in fp32
# and add fp32 tangents to the program, beyond what the class table's figures allow.
MODULE_TABLE = {
  name: "input" if rule in ("compute", "sum_grad_float32") else rule
  for name, rule in AUTOCAST_TABLE.items()
}


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


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
    from jax._src import source_info_util  # the caller's name stack, kept

    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
    out_tree = []

    def flat(*values):
      full = list(leaves)
      for i, v in zip(dynamic, values, strict=True):
        full[i] = v
      a, k = jax.tree_util.tree_unflatten(treedef, full)
      out, tree = jax.tree_util.tree_flatten(fun(*a, **k))
      arrays = [isinstance(o, jax.Array) for o in out]
      static = [None if is_array else o for o, is_array in zip(out, arrays, strict=True)]
      out_tree.append((tree, arrays, static))
      return [o for o, is_array in zip(out, arrays, strict=True) if is_array]

    closed = jax.make_jaxpr(flat)(*(leaves[i] for i in dynamic))
    prefix = source_info_util.current_name_stack()
    ins = [Value(leaves[i]) for i in dynamic]
    outs = iter(v.narrow for v in Interpreter(config).run(closed.jaxpr, closed.consts, ins, prefix))
    tree, arrays, static = out_tree[0]
    full = [next(outs) if is_array else s for is_array, s in zip(arrays, static, strict=True)]
    return jax.tree_util.tree_unflatten(tree, full)

  return wrapped
