"""Run a Flax linen model under a precision policy, without editing it.

:func:`policy_apply` returns a function with the signature of
``module.apply`` that runs the model in mixed precision::

  policy = jl.get_policy("params=float32,compute=bfloat16,output=float32")
  apply_fn = jl.flax.policy_apply(model, policy)
  logits = apply_fn({"params": params}, tokens)  # fp32 logits, bf16 inside
  grads = jax.grad(lambda p: loss(apply_fn({"params": p}, tokens)))(params)  # fp32 grads

Inside, every module method call (``__call__``, ``setup``-defined methods,
``method=`` targets) is intercepted with :func:`flax.linen.intercept_methods`,
Flax's own interception mechanism, for the duration of that ``apply`` only.
Per call it casts inputs to the module's compute dtype, casts outputs to its
output dtype, and swaps Flax's default matmul/attention kernels for jmp_lite's
while the module runs (see :class:`~jmp_lite.flax.ModulePolicies`). Parameters are
cast to the compute dtype of the module that owns them before the model runs;
which module owns which parameter, and which layers compute the model's
output, is found by tracing the model once abstractly (``jax.eval_shape``, no
FLOPs, once per ``jit`` trace), since linen creates submodules lazily.
The stored parameters, and those ``init`` creates, stay in the param dtype.

Nothing is registered globally: the interceptor is installed in a ``with``
block around one ``apply`` and holds only that call's state, so two models
applied one after the other cannot see each other's policy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx, traverse_util
from flax.core import FrozenDict, meta

from jmp_lite._autocast import rewrite
from jmp_lite._policy import Policy, cast_floating
from jmp_lite._policy_scope import policy_scope
from jmp_lite._tree_util import is_array
from jmp_lite.flax import _explicit_dtypes as explicit_dtypes
from jmp_lite.flax import _module_call as module_call
from jmp_lite.flax import _module_policy as module_policy
from jmp_lite.flax import _resolved_precision as precision
from jmp_lite.flax._module_policy import ModulePolicies

_PARAMS = "params"


def _creates_variables(module: nn.Module) -> bool:
  """Whether ``module`` may create parameters or record intermediates in this call.

  Such a module must not run under :func:`jax.checkpoint`: the variables it
  stores would be tracers of the checkpoint's trace, leaking out of it (under
  ``init``, as values of the returned parameters).
  """
  return (
    module.is_initializing()
    or module.is_mutable_collection(_PARAMS)
    or module.is_mutable_collection("intermediates")
  )


class _Interceptor:
  """The method interceptor of one ``apply`` call (its state dies with it)."""

  def __init__(
    self,
    policies: ModulePolicies,
    owners: dict[tuple, np.dtype] | None,
    found: dict[str, explicit_dtypes.ExplicitDtype] | None = None,
    wide_calls: frozenset[module_call.CallKey] = frozenset(),
  ):
    self.policies = policies
    # While discovering: the compute dtype each module (scope path) reads its params in.
    self.owners = owners
    # Modules whose own dtype= differs from the policy's, by path.
    self.found = found
    # The calls whose output is the model's output (found while discovering): they
    # return the policy's output dtype, and a matmul among them produces it directly.
    # Other calls of the same modules (a tied embedding's lookup) do not.
    self.wide_calls = wide_calls
    self.counter = module_call.CallCounter()  # the same numbering while discovering and running
    self.calls: list[module_call.CallRecord] = []  # while discovering, in exit order
    # The enclosing module calls, outermost first.
    self.stack: list[precision.ResolvedPrecision] = []

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    parent = self.stack[-1] if self.stack else None
    resolved = precision.resolve_module(self.policies, module, parent)
    if self.owners is not None:
      self.owners.setdefault(tuple(module.path), resolved.compute_dtype)
    if self.found is not None and resolved.explicit_dtype is not None:
      name = "/".join(module.path)
      if name not in self.found:
        self.found[name] = explicit_dtypes.describe(module, resolved)
    if context.method_name == "setup":
      return next_fun(*args, **kwargs)
    call = self.counter.key(tuple(module.path), context.method_name)
    is_output = call in self.wide_calls
    # The outermost call, and the chain of calls returning the model's output, return
    # the policy's output dtype.
    wide = not self.stack or is_output
    # Not while discovering (nothing is differentiated), nor where variables are stored.
    recompute = resolved.recompute and self.owners is None and not _creates_variables(module)
    updates = precision.attribute_updates(self.policies, module, resolved, wide_output=is_output)
    self.stack.append(resolved)
    try:
      return module_call.cast_call(
        module,
        updates,
        next_fun,
        args,
        kwargs,
        resolved.compute_dtype,
        resolved.root_output_dtype if wide else resolved.output_dtype,
        recompute=recompute,
        record=self.calls if self.owners is not None else None,
        call=call,
      )
    finally:
      self.stack.pop()


def _map_params(params: Any, fn: Callable[[tuple, Any], Any]) -> Any:
  """Applies ``fn(path, value)`` to every parameter (unboxing Flax metadata)."""
  was_frozen = isinstance(params, FrozenDict)
  flat = traverse_util.flatten_dict(
    params.unfreeze() if was_frozen else dict(params), keep_empty_nodes=True
  )

  def apply(path, leaf):
    if leaf is traverse_util.empty_node:
      return leaf
    if isinstance(leaf, meta.AxisMetadata):  # e.g. nn.Partitioned: keep the box
      return leaf.replace_boxed(fn(path, leaf.unbox()))
    return fn(path, leaf)

  out = traverse_util.unflatten_dict({path: apply(path, v) for path, v in flat.items()})
  return FrozenDict(out) if was_frozen else out


def _check_module(module: Any, caller: str) -> None:
  if not isinstance(module, nn.Module):
    raise TypeError(
      f"{caller} expects a flax.linen Module, got {module!r} of type {type(module).__name__}"
      + (
        " (for NNX models use jmp_lite.flax.policy_view)."
        if isinstance(module, nnx.Module)
        else "."
      )
    )
  if module.scope is not None:
    raise TypeError(
      f"{caller} expects an unbound module (the one you call .apply on); got a bound "
      f"{type(module).__name__}."
    )


@module_policy.options_on_the_policy
def policy_apply(module: nn.Module, policy: ModulePolicies | Policy | str) -> Callable[..., Any]:
  """Returns ``module.apply`` running under ``policy``.

  * Parameters (the ``"params"`` collection) are cast to the compute dtype of
    the module that owns them; other collections (``batch_stats``, caches) are
    left alone. Gradients with respect to ``variables`` therefore come back in
    the param dtype.
  * Each module call casts floating inputs to its compute dtype and floating
    outputs to its output dtype; the outermost call returns the policy's
    output dtype.
  * Normalization layers and embeddings keep fp32 by default
    (:data:`~jmp_lite.flax.DEFAULT_OVERRIDES`); attention softmax runs in fp32;
    16-bit dense/conv/einsum layers run 16-bit matmuls as with Flax's
    ``dtype=`` (accumulated in fp32 by the hardware), and the layer computing
    the model's output (the logits) returns the output dtype straight from
    its matmul (see :class:`~jmp_lite.flax.ModulePolicies`).
  * If ``"params"`` is mutable, new parameters come back in the param dtype
    and existing ones unchanged.

  Works under ``jax.jit``, ``jax.grad``, ``jax.vmap`` and ``jax.lax.scan``, and
  with lifted transforms (``nn.scan``, ``nn.remat``, ``nn.vmap``) inside the
  model. Forward-mode differentiation (``jax.jvp``) does not go through the
  fp32 softmax, the fp32 output layer or ``grad_reduction_dtype`` (reverse-mode
  rules); use ``ModulePolicies(policy, fp32_accumulation=False,
  fp32_softmax=False)`` for it.

  Args:
    module: an unbound linen module, written with default dtypes (a module
      built with another ``dtype=`` than the policy gives it keeps that dtype
      and is named in an :class:`~jmp_lite.flax.ExplicitDtypeWarning`, once
      per trace; see ``explicit_dtypes`` of :class:`~jmp_lite.flax.ModulePolicies`).
    policy: a :class:`~jmp_lite.flax.ModulePolicies` (the policy with its
      overrides and options), or a :class:`~jmp_lite.Policy` or policy string
      (``ModulePolicies(policy)``: the default overrides and options).

  Returns:
    A function taking exactly ``module.apply``'s arguments (``variables,
    *args, rngs=None, method=None, mutable=False, capture_intermediates=False,
    **kwargs``) and returning what it returns.

  Raises:
    TypeError: if ``module`` is not an unbound linen module, ``policy`` is not
      a policy, or an option keyword (``overrides=``...) is passed: options
      are set on the ``ModulePolicies``.

  Example::

    policies = jl.flax.ModulePolicies("p=f32,c=bf16,o=f32", {MyAttention: "f32"})
    apply_fn = jl.flax.policy_apply(model, policies)
    logits = apply_fn(variables, x, train=True, rngs={"dropout": key})

  A model written with default dtypes, run in bf16 with fp32 LayerNorm:

  >>> import flax.linen as nn
  >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
  >>> x = jnp.ones((4, 3))
  >>> variables = model.init(jax.random.key(0), x)
  >>> apply_fn = jl.flax.policy_apply(model, "p=f32,c=bf16,o=f32")
  >>> apply_fn(variables, x).dtype.name
  'float32'
  >>> grads = jax.grad(lambda v: apply_fn(v, x).sum())(variables)
  >>> grads["params"]["layers_0"]["kernel"].dtype.name  # gradients of the fp32 masters
  'float32'
  """
  _check_module(module, "policy_apply")
  return _make_apply(module, module_policy.as_module_policies(policy, "policy_apply"))


def _discover(
  policies: ModulePolicies, run: Callable[..., Any], variables: Mapping[str, Any]
) -> tuple[dict[tuple, np.dtype], frozenset[module_call.CallKey]]:
  """Traces ``run(variables)`` abstractly: which module owns each parameter, and the calls
  that compute the model's output.

  Returns:
    The compute dtype each module (by scope path) reads its parameters in, and the
    keys of the calls in the model's output chain.
  """
  owners: dict[tuple, np.dtype] = {}
  discover = _Interceptor(policies, owners)
  output_calls: frozenset[module_call.CallKey] = frozenset()

  def trace(v):
    nonlocal output_calls
    run(v)
    output_calls = module_call.output_chain(discover.calls)
    discover.calls.clear()  # the records hold tracers of this trace only

  with nn.intercept_methods(discover):
    jax.eval_shape(trace, variables)
  return owners, output_calls


# Discoveries an apply function keeps, by the abstract signature of its arguments.
_DISCOVERIES_KEPT = 16


def _abstract_signature(tree: Any) -> Hashable | None:
  """What a discovery depends on: the tree's structure, each array's type (shape, dtype,
  sharding) and every other leaf's value; ``None`` if a leaf is unhashable."""
  leaves, treedef = jax.tree.flatten(tree)
  key = [treedef]
  for leaf in leaves:
    entry = jax.typeof(leaf) if is_array(leaf) else (type(leaf), leaf)
    try:
      hash(entry)
    except TypeError:
      return None
    key.append(entry)
  return tuple(key)


def _cast_params(
  variables: Mapping[str, Any], owners: Mapping[tuple, np.dtype], policies: ModulePolicies
) -> Mapping[str, Any]:
  """``variables`` with each parameter in the compute dtype of the module owning it."""

  def cast_param(path, value):
    dtype = module_call.enclosing_entry(owners, path[:-1])
    return cast_floating(value, dtype if dtype is not None else policies.policy.compute_dtype)

  cast: Mapping[str, Any] = {**variables, _PARAMS: _map_params(variables[_PARAMS], cast_param)}
  return FrozenDict(cast) if isinstance(variables, FrozenDict) else cast


def _restore_params(out: Any, params: Any, param_dtype: Any) -> Any:
  """The output of a call with mutable ``"params"``: the caller's own parameters (not
  their compute-dtype copies) and new ones in the param dtype."""
  result, updated = out
  if _PARAMS not in updated:
    return out
  original = traverse_util.flatten_dict(
    params.unfreeze() if isinstance(params, FrozenDict) else dict(params)
  )
  fixed = _map_params(
    updated[_PARAMS],
    lambda path, v: (
      meta.unbox(original[path]) if path in original else cast_floating(v, param_dtype)
    ),
  )
  updated_params = {**updated, _PARAMS: fixed}
  return (result, FrozenDict(updated_params) if isinstance(updated, FrozenDict) else updated_params)


def _make_apply(module: nn.Module, policies: ModulePolicies) -> Callable[..., Any]:
  model_ops = module_policy.rewrites_model_ops(policies)
  # A discovery is one more trace of the model: repeated calls with arguments of the same
  # types (eager calls, a step and its gradient, each retrace of a jit) reuse it.
  discoveries: dict[Hashable, tuple[dict[tuple, np.dtype], frozenset]] = {}

  def discover(variables, args, kwargs):
    key = _abstract_signature((variables, args, kwargs))
    if key is not None and key in discoveries:
      return discoveries[key]
    found = _discover(policies, lambda v: run(v, args, kwargs), variables)
    if key is not None:
      if len(discoveries) >= _DISCOVERIES_KEPT:
        del discoveries[next(iter(discoveries))]
      discoveries[key] = found
    return found

  def run(v, args, kwargs):
    with policy_scope(policies.policy):  # marks the model's equations for jl.audit
      return module.apply(v, *args, **kwargs)

  def apply_fn(variables: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    if not isinstance(variables, Mapping):
      raise TypeError(
        f"variables must be a mapping of collections such as {{'params': ...}}, got "
        f"{type(variables).__name__}."
      )

    found: dict[str, explicit_dtypes.ExplicitDtype] = {}
    params = variables.get(_PARAMS)
    owners: dict[tuple, np.dtype] = {}
    output_calls: frozenset[module_call.CallKey] = frozenset()
    # Without parameters there is nothing to cast (e.g. a parameter-free model).
    if params is not None:
      owners, output_calls = discover(variables, args, kwargs)

    def call(v, args, kwargs):
      with nn.intercept_methods(_Interceptor(policies, None, found, output_calls)):
        return run(v, args, kwargs)

    cast = _cast_params(variables, owners, policies) if params is not None else variables
    out = (rewrite(call, policies.policy.compute_dtype) if model_ops else call)(cast, args, kwargs)
    explicit_dtypes.warn(policies, found, "policy_apply", stacklevel=2)
    mutable = kwargs.get("mutable", False)
    if params is not None and mutable is not False and isinstance(out, tuple) and len(out) == 2:
      out = _restore_params(out, params, policies.policy.param_dtype)
    return out

  apply_fn.policy = policies.policy  # type: ignore[attr-defined]  # read by jl.audit
  return apply_fn


@module_policy.options_on_the_policy
def policy_init(module: nn.Module, policy: ModulePolicies | Policy | str) -> Callable[..., Any]:
  """Returns ``module.init`` running under ``policy``, with params in the param dtype.

  Parameters are created by their initializers in the module's own
  ``param_dtype`` (fp32 for Flax's layers) and then cast to the policy's
  param dtype (a no-op for fp32 master weights). The forward pass ``init``
  runs casts inputs and outputs as :func:`policy_apply` does, and names
  modules with an explicit ``dtype=`` the same way. The parameters are those
  ``module.init`` creates from the same ``rngs``, with lifted transforms
  (``nn.scan``, ``nn.remat``, ``nn.vmap``) too.

  Args:
    module: an unbound linen module.
    policy: as for :func:`policy_apply`.

  Returns:
    A function taking ``module.init``'s arguments (``rngs, *args,
    method=None, mutable=..., **kwargs``) and returning its variables.

  Raises:
    TypeError, ValueError: as :func:`policy_apply`.
  """
  _check_module(module, "policy_init")
  policies = module_policy.as_module_policies(policy, "policy_init")

  def init_fn(rngs: Any, *args: Any, **kwargs: Any) -> Any:
    found: dict[str, explicit_dtypes.ExplicitDtype] = {}
    with nn.intercept_methods(_Interceptor(policies, None, found)):
      variables = module.init(rngs, *args, **kwargs)
    explicit_dtypes.warn(policies, found, "policy_init", stacklevel=2)
    if _PARAMS not in variables:
      return variables
    params = _map_params(
      variables[_PARAMS], lambda _, v: cast_floating(v, policies.policy.param_dtype)
    )
    out = {**variables, _PARAMS: params}
    return FrozenDict(out) if isinstance(variables, FrozenDict) else out

  return init_fn
