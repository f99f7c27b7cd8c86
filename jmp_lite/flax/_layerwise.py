"""Layer-wise loss scaling for linen models: stage boundaries from the outside.

:func:`layerwise_stages` finds the stages of a linen model without editing it:
every call of a *stage module* (instances of the given classes, or the children
of an ``nn.Sequential``) ends a stage, and a :func:`jmp_lite.stage_boundary` is
inserted on its output. With ``n`` stage-module calls there are ``n + 1``
stages: stage 0 is everything up to and including the first stage module
(e.g. an embedding and the first block), stage ``n`` everything after the last
(e.g. the head). Each parameter belongs to the stage in which its module runs::

  stages = jlf.layerwise_stages(model, variables, x, stage_modules=(Block,))
  tx = jl.loss_scaling(optax.adam(1e-3), stages.loss_scale())
  apply_fn = stages.wrap(model.apply)          # or wrap jlf.policy_apply(model, policy)

  def loss_fn(params, x, y):
    return cross_entropy(apply_fn({"params": params}, x), y)

  loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, x, y)

The boundaries are installed with :func:`flax.linen.intercept_methods` around
each call of the wrapped function; nothing is registered globally. Outside
:func:`jmp_lite.scaled_value_and_grad` with a layer-wise loss scale they are
identities, so the wrapped function can serve evaluation too.

Limits: a module whose parameters are used in two stages (weights tied
across stages, e.g. an embedding reused as the output layer) is rejected,
since its gradient would mix two scales; a stage module inside ``nn.scan``
runs once per trace, so a scanned stack is one stage (for one stage per layer,
pass the layer index through the scan and call ``jl.stage_boundary(h, i)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util
from flax.core import FrozenDict

from jmp_lite.layerwise import LayerwiseLossScale, stage_boundary


@dataclasses.dataclass(frozen=True)
class _StagePredicate:
  stage_modules: tuple[type, ...]
  sequential_children: bool

  def __call__(self, module: nn.Module) -> bool:
    return isinstance(module, self.stage_modules) or (
      self.sequential_children and isinstance(module.parent, nn.Sequential)
    )


class _BoundaryInterceptor:
  """Puts a stage boundary on the output of each outermost stage-module call."""

  def __init__(self, is_stage: _StagePredicate, segments: dict[tuple, set[int]] | None = None):
    self.is_stage = is_stage
    # While planning: module path -> the stages it ran in (more than one if it
    # contains stage modules, or runs again in another stage: tied weights).
    self.segments = segments
    self.stage_calls: list[tuple[str, ...]] = []
    self.depth = 0  # enclosing intercepted calls
    self.stage_depth = 0  # enclosing stage-module calls
    self.count = 0  # boundaries passed in this model call

  def __call__(self, next_fun, args, kwargs, context):
    if context.method_name == "setup":
      return next_fun(*args, **kwargs)
    module = context.module
    if self.depth == 0:  # a new call of the model (policy_apply traces it twice)
      self.count = 0
      self.stage_calls = []
    is_stage = self.stage_depth == 0 and self.is_stage(module)
    entry = self.count
    self.depth += 1
    self.stage_depth += is_stage
    try:
      out = next_fun(*args, **kwargs)
    finally:
      self.depth -= 1
      self.stage_depth -= is_stage
    if self.segments is not None:
      self.segments.setdefault(tuple(module.path), set()).update({entry, self.count})
    if not is_stage:
      return out
    self.stage_calls.append(tuple(module.path))
    index = self.count
    self.count += 1
    return jax.tree.map(
      lambda x: (
        stage_boundary(x, index)
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
        else x
      ),
      out,
    )


@dataclasses.dataclass(frozen=True)
class LayerwiseStages:
  """The stages of a linen model, found by :func:`layerwise_stages`.

  Attributes:
    param_stages: the stage of every parameter, shaped like ``variables["params"]``.
    num_stages: number of stages (stage-module calls + 1).
    stage_paths: the module path of each stage-module call, in call order.
  """

  param_stages: Any
  num_stages: int
  stage_paths: tuple[tuple[str, ...], ...]
  is_stage: _StagePredicate

  def wrap(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Puts a stage boundary on the output of every stage-module call of ``apply_fn``.

    Args:
      apply_fn: ``model.apply``, or a policy's apply (``jlf.policy_apply``).

    Returns:
      ``apply_fn`` with the boundaries installed around each call.
    """

    def apply_with_boundaries(*args: Any, **kwargs: Any) -> Any:
      with nn.intercept_methods(_BoundaryInterceptor(self.is_stage)):
        return apply_fn(*args, **kwargs)

    return apply_with_boundaries

  def loss_scale(self, **kwargs: Any) -> LayerwiseLossScale:
    """A :class:`~jmp_lite.LayerwiseLossScale` for these stages.

    Args:
      **kwargs: the loss scale's other arguments (``update_period=...``).

    Returns:
      The loss scale, with these ``param_stages`` and ``num_stages``.
    """
    return LayerwiseLossScale(self.param_stages, self.num_stages, **kwargs)


def layerwise_stages(
  module: nn.Module,
  variables: Mapping[str, Any],
  *args: Any,
  stage_modules: type | tuple[type, ...] = (),
  sequential_children: bool = False,
  overrides: Mapping[str, int] | None = None,
  **kwargs: Any,
) -> LayerwiseStages:
  """Finds the stages of ``module`` by tracing one call abstractly (no FLOPs).

  Args:
    module: an unbound linen module.
    variables: its variables (``{"params": ...}``, plus e.g. ``batch_stats``).
    *args: example positional arguments for ``module.apply`` (e.g. a batch).
    **kwargs: example keyword arguments for ``module.apply`` (e.g. ``train=False``).
    stage_modules: module classes whose (outermost) calls end a stage.
    sequential_children: also end a stage after each child of an
      ``nn.Sequential``.
    overrides: stages for parameters (or whole modules) by ``/``-joined path,
      e.g. ``{"pos_embedding": 0}`` for a parameter the root module creates
      itself (the root spans every stage, so its own parameters need one).

  Returns:
    The stages: their parameters' assignment, and :meth:`LayerwiseStages.wrap`
    to install the boundaries.

  Raises:
    ValueError: if no stage module runs, or a parameter's module runs in more
      than one stage and no override says which.
  """
  if isinstance(stage_modules, type):
    stage_modules = (stage_modules,)
  if not all(isinstance(t, type) and issubclass(t, nn.Module) for t in stage_modules):
    raise TypeError(f"stage_modules must be linen Module classes, got {stage_modules!r}.")
  if not stage_modules and not sequential_children:
    raise ValueError("Give stage_modules=(SomeBlock, ...) and/or sequential_children=True.")
  if not isinstance(variables, Mapping) or "params" not in variables:
    raise TypeError("variables must be a mapping with a 'params' collection.")
  is_stage = _StagePredicate(tuple(stage_modules), sequential_children)
  segments: dict[tuple, set[int]] = {}
  recorder = _BoundaryInterceptor(is_stage, segments)
  kwargs.pop("mutable", None)
  with nn.intercept_methods(recorder):
    jax.eval_shape(lambda v: (module.apply(v, *args, **kwargs), None)[1], variables)
  if not recorder.stage_calls:
    raise ValueError(
      f"No stage module ran: none of {[t.__name__ for t in stage_modules]} was called"
      + (" and no nn.Sequential child ran." if sequential_children else ".")
    )
  by_path = {tuple(k.split("/")): v for k, v in (overrides or {}).items()}

  def stage_of(path: tuple) -> int:
    for n in range(len(path), 0, -1):
      if path[:n] in by_path:
        return by_path[path[:n]]
    used = segments.get(path[:-1])
    if used is None:  # its module never ran: the gradient is zero
      return 0
    if len(used) > 1:
      raise ValueError(
        f"Parameter {'/'.join(path)} belongs to module {'/'.join(path[:-1]) or '<root>'}, "
        f"which runs in stages {sorted(used)} (it contains stage modules, or its weights "
        "are tied across stages). Assign it with overrides={'" + "/".join(path) + "': k}, "
        "or move it into a submodule."
      )
    return next(iter(used))

  params = variables["params"]
  flat = traverse_util.flatten_dict(params.unfreeze() if isinstance(params, FrozenDict) else params)
  param_stages = traverse_util.unflatten_dict({path: stage_of(path) for path in flat})
  num_stages = len(recorder.stage_calls) + 1
  bad = {k: v for k, v in by_path.items() if not 0 <= v < num_stages}
  if bad:
    raise ValueError(f"overrides {bad} name stages outside [0, {num_stages}).")
  return LayerwiseStages(param_stages, num_stages, tuple(recorder.stage_calls), is_stage)
