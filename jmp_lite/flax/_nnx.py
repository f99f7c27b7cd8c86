"""A low-precision view of a Flax NNX model, for the forward pass.

NNX models are stateful objects, so instead of intercepting ``apply`` the
policy builds a *view*::

  policy = jl.get_policy("params=float32,compute=bfloat16,output=float32")

  def loss_fn(model):
    logits = jl.flax.policy_view(model, policy)(tokens)  # fp32 logits, bf16 inside
    return cross_entropy(logits, tokens)

  grads = nnx.grad(loss_fn)(model)  # fp32, shaped like the model's Params

:func:`policy_view` does not modify ``model``. It builds a copy of the module
graph (:func:`flax.nnx.split`, :func:`flax.nnx.merge` without copying
Variables, :func:`flax.nnx.recursive_map`) in which

* every :class:`~flax.nnx.Param` is a new Variable holding the parameter cast
  to the compute dtype of the module that owns it (the cast is differentiable,
  so gradients reach the fp32 parameters);
* every other Variable (``BatchStat``, RNG counters, caches) *is* the model's
  own, so a forward pass in training mode updates the model's batch
  statistics exactly as calling the model would;
* every submodule is wrapped so that its calls (``__call__`` and any public
  method reached through the parent, e.g. ``self.embed.attend``) cast floating
  inputs to its compute dtype and outputs to its output dtype, with the same
  per-class overrides as linen (:class:`~jmp_lite.flax.ModulePolicies`);
* 16-bit Flax layers get jmp_lite's matmul kernels and attention the fp32
  softmax, set as attributes on the copies.

The view is cheap (no arrays are copied but the cast parameters) and meant to
be rebuilt inside each traced step; it holds no global state: what its
wrappers share while it runs (the numbering of the calls inside a call of its
root, the layers found to compute its output) is one plain Python object,
static in NNX's graph, so that the copies NNX makes of the view share it too. Build it at the
trace level of the model (inside the function ``nnx.jit``/``nnx.grad``
transforms) and call it anywhere below, ``jax.vmap``/``jax.lax.scan`` bodies
included: NNX does not let an inner trace split a model from an outer one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_lite._autocast import rewrite
from jmp_lite._policy import Policy, cast_floating
from jmp_lite._policy_scope import policy_scope
from jmp_lite._tree_util import is_array, split_leaves
from jmp_lite.flax import _explicit_dtypes as explicit_dtypes
from jmp_lite.flax import _module_call as module_call
from jmp_lite.flax import _module_policy as module_policy
from jmp_lite.flax import _resolved_precision as precision
from jmp_lite.flax._compat import is_graph_node
from jmp_lite.flax._module_policy import ModulePolicies

M = TypeVar("M", bound=nnx.Module)
_F32 = np.dtype(jnp.float32)


class _WideCalls(NamedTuple):
  """The calls of one module that compute a view's output, and how they run."""

  calls: frozenset[module_call.CallKey]
  output_dtype: np.dtype  # the policy's output dtype
  attributes: tuple[tuple[str, Any], ...]  # the module's kernels returning it


_NOT_WIDE = _WideCalls(frozenset(), _F32, ())


class _ViewCalls:
  """What the wrappers of one view share while it runs.

  A plain object, so an attribute of every wrapper that NNX keeps as static:
  the copies NNX makes of the view (``nnx.split``/``merge``, its transforms)
  share it, and updating it writes into no NNX object.

  Attributes:
    counter: the numbering of the calls inside the call of the view's root in
      progress, which names the calls of its output chain; ``None`` outside one
      (a call such as ``view.embed.attend(x)`` made from outside is in no chain).
    records: while the output chain is being found, the list receiving a
      :class:`CallRecord` of every wrapped call, in exit order.
    pending: until the view's first call, what finding the chain needs: the
      policies and ``{path: (module, its ResolvedPrecision)}``.
    wide: once found, the calls in the output chain by module path.
  """

  def __init__(self) -> None:
    self.counter: module_call.CallCounter | None = None
    self.records: list[module_call.CallRecord] | None = None
    self.pending: (
      tuple[ModulePolicies, dict[tuple, tuple[Any, precision.ResolvedPrecision]]] | None
    ) = None
    self.wide: Mapping[tuple, _WideCalls] = {}

  @contextlib.contextmanager
  def numbering(self) -> Iterator[None]:
    """Numbers the calls inside the ``with`` block (one call of the view's root)."""
    outer, self.counter = self.counter, module_call.CallCounter()
    try:
      yield
    finally:
      self.counter = outer


class PolicyModule(nnx.Module):
  """Wraps one module of a :func:`policy_view`: casts its calls' inputs and outputs.

  Attribute reads fall through to the wrapped module (``view.block.norm.scale``
  works as on the model); public methods reached that way are cast like
  ``__call__``. :func:`policy_view` builds these; ``module`` is the wrapped
  module.

  Args:
    module: the module to wrap (the view's copy).
    compute_dtype: the dtype its floating inputs are cast to.
    output_dtype: the dtype its floating outputs are cast to.
    recompute: run its calls under :func:`jax.checkpoint`, the input cast
      inside, so that the backward pass keeps only the narrow inputs.
    path: its path in the model (to find the model's output layers).
    policy: the view's policy, on the view's root: its calls run in a policy
      scope, which marks the model's equations for ``jl.audit``.
    model_ops: on the view's root: apply the op table to the model's own
      operations (``op_table`` of :class:`~jmp_lite.flax.ModulePolicies`).

  The calls of the module that compute the view's output (found on the view's
  first call) return the policy's output dtype; its other calls (a tied
  embedding's lookup) return ``output_dtype``.
  """

  def __init__(
    self,
    module: nnx.Module,
    compute_dtype: np.dtype,
    output_dtype: np.dtype,
    recompute: bool = False,
    path: tuple = (),
    policy: Policy | None = None,
    model_ops: bool = False,
  ):
    self.module = module
    self._compute_dtype = np.dtype(compute_dtype)
    self._output_dtype = np.dtype(output_dtype)
    self._recompute = bool(recompute)
    self._path = tuple(path)
    self._policy = policy
    self._model_ops = bool(model_ops)
    # policy_view gives every wrapper of a view the same one.
    self._calls = _ViewCalls()

  def _cast_call(self, method: str, fn, *args, **kwargs):
    if self._path:
      return self._numbered_call(method, fn, args, kwargs)
    if self._model_ops and self._calls.records is None:
      return self._rewritten_call(method, args, kwargs)
    with self._calls.numbering(), policy_scope(self._policy):
      return self._numbered_call(method, fn, args, kwargs)

  def _rewritten_call(self, method: str, args: tuple, kwargs: dict) -> Any:
    """The root's call with the op table applied to the model's own operations.

    The rewrite traces the call as a pure function: the view and the NNX objects among the
    arguments (``Rngs``) go in as their state and come out updated, and only the Variables
    whose value the call changed (batch statistics, RNG counts) are written back.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_graph_node)
    node_at = [i for i, x in enumerate(leaves) if is_graph_node(x)]
    array_at = [i for i, x in enumerate(leaves) if is_array(x)]
    graphdef, state = nnx.split((self, [leaves[i] for i in node_at]))

    def pure(state, arrays):
      root, nodes = nnx.merge(graphdef, state)
      full = list(leaves)
      for i, x in (*zip(node_at, nodes, strict=True), *zip(array_at, arrays, strict=True)):
        full[i] = x
      a, k = jax.tree_util.tree_unflatten(treedef, full)
      fn = root.module if method == "__call__" else getattr(root.module, method)
      with root._calls.numbering(), policy_scope(root._policy):
        out = root._numbered_call(method, fn, a, k)
      return out, nnx.state((root, nodes))

    out, updated = rewrite(pure, self._compute_dtype)(state, [leaves[i] for i in array_at])
    changed = [
      (path, new)
      for (path, old), (_, new) in zip(
        nnx.to_flat_state(state), nnx.to_flat_state(updated), strict=True
      )
      if not _same_leaves(new, old)
    ]
    if changed:
      nnx.update((self, [leaves[i] for i in node_at]), nnx.from_flat_state(changed))
    return out

  def _numbered_call(self, method: str, fn, args: tuple, kwargs: dict) -> Any:
    calls = self._calls
    call = calls.counter.key(self._path, method) if calls.counter is not None else None
    wide = calls.wide.get(self._path, _NOT_WIDE)
    in_chain = call in wide.calls
    return module_call.cast_call(
      self.module,
      dict(wide.attributes) if in_chain else {},
      fn,
      args,
      kwargs,
      self._compute_dtype,
      wide.output_dtype if in_chain else self._output_dtype,
      recompute=self._recompute,
      record=calls.records,
      call=call,
    )

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """Calls the wrapped module with its inputs and outputs cast.

    Args:
      *args: the module's positional arguments.
      **kwargs: its keyword arguments.

    Returns:
      The module's result, its floating leaves in this module's output dtype.
    """
    if not self._path and self._calls.pending is not None:
      self._widen_output_layers(args, kwargs)
    return self._cast_call("__call__", self.module, *args, **kwargs)

  def _widen_output_layers(self, args: tuple, kwargs: dict) -> None:
    """Lets the layers that compute the view's output produce the output dtype.

    Once, on the root's first call: an abstract trace (``nnx.eval_shape``, on
    a copy of the view) finds the chain of calls whose output is the view's
    output by identity (as in :func:`~jmp_lite.flax.policy_apply`); in those
    calls the modules' kernels then return the policy's output dtype (fp32
    logits) instead of a rounded one. Only static values are kept (the first
    call may be inside a transform below the trace the view was built at).
    """
    calls = self._calls
    assert calls.pending is not None
    (policies, modules), calls.pending = calls.pending, None
    # Arrays and NNX objects (Rngs) are traced; other arguments (a train flag,
    # a mode string) stay what they are.
    traced, rebuild = split_leaves(
      (args, kwargs), lambda x: is_array(x) or is_graph_node(x), is_leaf=is_graph_node
    )

    def call(view, values):
      a, k = rebuild(values)
      return view(*a, **k)

    records: list[module_call.CallRecord] = []
    calls.records = records
    try:
      nnx.eval_shape(call, self, traced)
    finally:
      calls.records = None
    chain = module_call.output_chain(records)
    wide = {}
    for path in {key.path for key in chain}:
      module, r = modules[path]
      updates = precision.attribute_updates(policies, module, r, wide_output=True)
      in_chain = frozenset(key for key in chain if key.path == path)
      wide[path] = _WideCalls(in_chain, np.dtype(r.root_output_dtype), tuple(updates.items()))
    calls.wide = wide

  def __getattr__(self, name: str) -> Any:
    # Only reached for names PolicyModule itself lacks. NNX reads private
    # attributes while it builds objects; those must not recurse into module.
    if name.startswith("_") or name == "module":
      raise AttributeError(name)
    value = getattr(self.module, name)
    if callable(value) and getattr(value, "__self__", None) is self.module:
      return functools.partial(self._cast_call, name, value)
    return value


def _same_leaves(a: Any, b: Any) -> bool:
  """Whether two Variables' values are the same objects (a call left it unchanged)."""
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _resolve_modules(
  model: nnx.Module, policies: ModulePolicies
) -> dict[tuple, precision.ResolvedPrecision]:
  """The precision of every module of ``model``, by path, parents before children."""
  modules = {
    tuple(path): module
    for path, module in nnx.iter_modules(model)
    # Containers are transparent: a module in an nnx.List belongs to the list's holder.
    if not isinstance(module, (nnx.List, nnx.Dict))
  }
  resolved: dict[tuple, precision.ResolvedPrecision] = {}
  for path in sorted(modules, key=len):
    parent = module_call.enclosing_entry(resolved, path[:-1]) if path else None
    resolved[path] = precision.resolve_module(policies, modules[path], parent)
  return resolved


@module_policy.options_on_the_policy
def policy_view(model: M, policy: ModulePolicies | Policy | str) -> M:
  """Returns a view of ``model`` that runs under ``policy`` (``model`` is untouched).

  Calling the view (``policy_view(model, policy)(x)``) casts ``x`` to the
  compute dtype and returns outputs in the policy's output dtype. Parameters
  are read in the compute dtype of the module owning them (fp32 for the
  :data:`~jmp_lite.flax.DEFAULT_OVERRIDES`: normalization and embeddings);
  non-parameter state is shared with ``model``. Build it inside the function
  you differentiate, so that gradients flow to ``model``'s parameters.

  Works under ``nnx.jit``/``jax.jit``, ``nnx.grad``/``jax.grad``, ``vmap`` and
  ``scan``, and with lifted transforms (``nnx.scan``, ``nnx.remat``,
  ``nnx.vmap``) inside the model. Forward-mode differentiation needs
  ``ModulePolicies(policy, fp32_accumulation=False, fp32_softmax=False)``
  (the fp32 softmax and the fp32 output layer have reverse-mode rules only).

  On its first call the view traces the model once more, abstractly, to find
  the layers that compute its output (as :func:`~jmp_lite.flax.policy_apply`
  does): they return the policy's output dtype straight from their matmuls.

  Args:
    model: an NNX module written with default dtypes (a module built with
      another ``dtype=`` than the policy gives it keeps that dtype and is
      named in an :class:`~jmp_lite.flax.ExplicitDtypeWarning` when the view
      is built; see ``explicit_dtypes`` of
      :class:`~jmp_lite.flax.ModulePolicies`).
    policy: a :class:`~jmp_lite.flax.ModulePolicies` (the policy with its
      overrides and options), or a :class:`~jmp_lite.Policy` or policy string
      (``ModulePolicies(policy)``: the default overrides and options).

  Returns:
    A :class:`PolicyModule` wrapping the low-precision copy of ``model``;
    typed as ``model``'s type since calls and attribute reads behave alike.

  Raises:
    TypeError: if ``model`` is not an NNX module (or a linen one: use
      :func:`~jmp_lite.flax.policy_apply`), ``policy`` is not a policy, or an
      option keyword (``overrides=``...) is passed: options are set on the
      ``ModulePolicies``.

  >>> from flax import nnx
  >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  >>> view = jl.flax.policy_view(model, "p=f32,c=bf16,o=f32")
  >>> view.kernel.dtype.name, model.kernel.dtype.name
  ('bfloat16', 'float32')
  >>> view(jnp.ones((4, 3))).dtype.name
  'float32'
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(
      f"policy_view expects a flax.nnx Module, got {model!r} of type {type(model).__name__}"
      " (for linen models use jmp_lite.flax.policy_apply)."
    )
  policies = module_policy.as_module_policies(policy, "policy_view")
  view, found = _view(model, policies)
  # Once per view, i.e. once per trace of the step that builds it.
  explicit_dtypes.warn(policies, found, "policy_view", stacklevel=2)
  return view


def _view(
  model: nnx.Module, policies: ModulePolicies
) -> tuple[Any, dict[str, explicit_dtypes.ExplicitDtype]]:
  """The view, and the modules whose own dtype differs from the policy's, by path."""
  resolved = _resolve_modules(model, policies)
  found = {
    "/".join(map(str, path)): explicit_dtypes.describe(module, r)
    for path, module in nnx.iter_modules(model)
    if (r := resolved.get(tuple(path))) is not None and r.explicit_dtype is not None
  }

  def cast_param(path: tuple, param: Any) -> Any:
    value = param.get_value()
    if not (hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating)):
      return param
    owner = module_call.enclosing_entry(resolved, tuple(path[:-1]))
    dtype = owner.compute_dtype if owner is not None else policies.policy.compute_dtype
    # A new Variable: the model's Param keeps its value and dtype.
    return param if value.dtype == dtype else param.replace(cast_floating(value, dtype))

  # split hands out the model's own Variable objects and merge(copy=False)
  # reuses them: the view gets new Params but shares all other state.
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)  # type: ignore[misc]
  view = nnx.merge(graphdef, nnx.map_state(cast_param, params), rest, copy=False)

  calls = _ViewCalls()  # shared by all the wrappers of this view
  modules: dict[tuple, tuple[Any, precision.ResolvedPrecision]] = {}

  def wrap(path: tuple, node: Any) -> Any:
    if tuple(path) in resolved and not isinstance(node, PolicyModule):
      r = resolved[tuple(path)]
      for name, value in precision.attribute_updates(policies, node, r).items():
        setattr(node, name, value)  # node belongs to the view, not to the model
      output = r.root_output_dtype if not path else r.output_dtype
      root_policy = None if path else policies.policy
      wrapper = PolicyModule(
        node, r.compute_dtype, output, r.recompute, path, root_policy,
        model_ops=not path and module_policy.rewrites_model_ops(policies),
      )  # fmt: skip
      wrapper._calls = calls
      modules[tuple(path)] = (node, r)
      return wrapper
    return node

  try:
    root = nnx.recursive_map(wrap, view, graph=True)
    if isinstance(root, PolicyModule) and np.dtype(policies.policy.output_dtype) == _F32:
      calls.pending = (policies, modules)
    return root, found
  except ValueError as e:
    if "does not support mutation" not in str(e):
      raise
    raise TypeError(
      "policy_view needs to wrap submodules inside their containers, but one is held in an "
      f"immutable container ({e}). Keep submodules in nnx.List / nnx.Dict or as attributes."
    ) from e
