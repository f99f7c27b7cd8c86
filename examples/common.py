"""What the examples share: the precision recipes, the training loop and its results.

An example (``examples.digits``, ``examples.charlm``) describes its data and
model as a :class:`Task`; :func:`train` trains a task under one
:class:`Recipe` and returns a :class:`RunResult` of plain Python values (loss
curves, loss-scale trajectory, skipped steps, timings, compiled memory,
gradient statistics) that ``examples.compare`` turns into its table, plots
and JSON.

Every recipe runs the same model code and the same optimizer; only the
precision policy, the loss scale and (for ``fp8``) the matmuls differ:

* the policy is applied from outside the model with
  :func:`jmp_lite.flax.policy_apply` (fp32 master weights, 16-bit compute,
  fp32 normalization statistics, softmax and loss);
* the optimizer is wrapped in :func:`jmp_lite.loss_scaling` for every recipe,
  with a :class:`jmp_lite.NoOpLossScale` where no scaling is wanted, so every
  recipe skips a step whose gradients are not finite and the counters are
  comparable;
* ``fp8`` runs every Dense/attention projection through
  :func:`jmp_lite.flax.fp8.linen_fp8` on top of the bf16 policy, with the
  library's default fp8 recipe (:class:`jmp_lite.fp8.CurrentScaling`) unless
  ``--fp8-scaling delayed`` asks for calibrated delayed scaling.

The opt-in group ``low-precision-params`` (:data:`LOW_PRECISION_RECIPES`)
stores the parameters themselves in bf16, with no fp32 master copy: the same
optimizer is wrapped in :func:`jmp_lite.low_precision_params` (inside
:func:`jmp_lite.loss_scaling`), which rounds each updated parameter back to
bf16 by one of its methods, against ``fp32-master`` (fp32 parameters, bf16
compute: the same forward and backward pass).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import time
from collections.abc import Iterable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_lite as jl
import jmp_lite.flax as jlf
from jmp_lite import fp8
from jmp_lite.flax import fp8 as flax_fp8

# ---------------------------------------------------------------------------------------------
# Recipes


@dataclasses.dataclass(frozen=True)
class Recipe:
  """One way to train: a precision policy, a kind of loss scale and fp8 on or off.

  Attributes:
    name: the short name used on the command line and in tables.
    policy: a :func:`jmp_lite.get_policy` string.
    loss_scale: ``"none"``, ``"static"``, ``"dynamic"`` or ``"layerwise"``.
    fp8: whether Dense layers compute their matmuls in fp8 (E4M3 forward,
      E5M2 backward, scaled by :attr:`TrainConfig.fp8_scaling`'s recipe).
    summary: one line for ``--help`` and the docs.
    params_method: for 16-bit parameters (the policy's param dtype), the
      :func:`jmp_lite.low_precision_params` method that stores their updates;
      ``None`` for fp32 parameters.
    moment_dtype: with ``params_method``, the dtype of the optimizer's
      moments (``state_dtype``); fp32 otherwise.
    high_half_view: fp32 parameters, initialized to the bf16 parameters'
      values, whose forward pass reads, for every parameter, the bf16 value
      :func:`bf16_high_half` (what ``bf16-split`` stores), with the gradient
      passed straight through.
  """

  name: str
  policy: str
  loss_scale: str = "none"
  fp8: bool = False
  summary: str = ""
  params_method: str | None = None
  moment_dtype: str = "float32"
  high_half_view: bool = False


RECIPES: dict[str, Recipe] = {
  r.name: r
  for r in (
    Recipe("fp32", "params=float32,compute=float32,output=float32", summary="the reference"),
    Recipe(
      "bf16",
      "params=float32,compute=bfloat16,output=float32",
      summary="bf16 compute, fp32 master weights, no loss scaling (bf16 has fp32's range)",
    ),
    Recipe(
      "fp16",
      "params=float32,compute=float16,output=float32",
      summary="fp16 compute without loss scaling: small gradients flush to zero",
    ),
    Recipe(
      "fp16-static",
      "params=float32,compute=float16,output=float32",
      "static",
      summary="fp16 with a fixed loss scale (--static-scale)",
    ),
    Recipe(
      "fp16-dynamic",
      "params=float32,compute=float16,output=float32",
      "dynamic",
      summary="fp16 with jl.DynamicLossScale: backs off on overflow, grows after clean steps",
    ),
    Recipe(
      "fp16-layerwise",
      "params=float32,compute=float16,output=float32",
      "layerwise",
      summary="fp16 with jl.LayerwiseLossScale: one adaptive scale per stage of the model",
    ),
    Recipe(
      "fp8",
      "params=float32,compute=bfloat16,output=float32",
      fp8=True,
      summary="fp8 matmuls in every Dense (E4M3 fwd / E5M2 bwd, per-tensor current scaling "
      "unless --fp8-scaling delayed), bf16 elsewhere",
    ),
  )
}


_BF16_PARAMS = "params=bfloat16,compute=bfloat16,output=float32"

LOW_PRECISION_RECIPES: dict[str, Recipe] = {
  r.name: r
  for r in (
    Recipe(
      "fp32-master",
      "params=float32,compute=bfloat16,output=float32",
      summary="the bf16 recipe under the low-precision-params group's name: fp32 parameters "
      "and moments, bf16 compute",
    ),
    Recipe(
      "fp32-master-view",
      _BF16_PARAMS,
      high_half_view=True,
      summary="fp32 parameters and moments whose forward pass reads the bf16 value bf16-split "
      "stores for each (nearest, ties away): the split's exact reference",
    ),
    Recipe(
      "bf16-nearest",
      _BF16_PARAMS,
      params_method="nearest",
      summary="bf16 parameters rounded to nearest after each update (updates under half a "
      "bf16 ulp are lost); fp32 moments",
    ),
    Recipe(
      "bf16-stochastic",
      _BF16_PARAMS,
      params_method="stochastic",
      moment_dtype="bfloat16",
      summary="bf16 parameters and bf16 moments, both stochastically rounded",
    ),
    Recipe(
      "bf16-kahan",
      _BF16_PARAMS,
      params_method="kahan",
      summary="bf16 parameters with a bf16 Kahan compensation buffer; fp32 moments",
    ),
    Recipe(
      "bf16-split",
      _BF16_PARAMS,
      params_method="split",
      summary="bf16 parameters as the high half of an exact fp32 value whose low 16 bits the "
      "optimizer keeps; fp32 moments",
    ),
  )
}
"""Opt-in recipes (not in a default comparison): parameters stored in bf16 without an fp32
master copy, by each method of :func:`jmp_lite.low_precision_params`, and the fp32-master
reference they are measured against."""

RECIPE_GROUPS: dict[str, tuple[str, ...]] = {
  "low-precision-params": tuple(LOW_PRECISION_RECIPES),
}
"""Names that stand for several recipes in ``examples.compare --recipes``."""


@jax.custom_vjp
def bf16_high_half(x: jax.Array) -> jax.Array:
  """fp32 ``x`` rounded to bf16 to nearest, ties away from zero (as the ``split`` method of
  :func:`jmp_lite.low_precision_params` keeps it); the gradient passes through in fp32."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  # Adding half of the dropped 16 bits to the bit pattern rounds the magnitude to nearest.
  high = ((bits + 0x8000) >> 16).astype(jnp.int16)
  return jax.lax.bitcast_convert_type(high, jnp.bfloat16)


bf16_high_half.defvjp(lambda x: (bf16_high_half(x), None), lambda _, g: (g.astype(jnp.float32),))


def half_recipe() -> Recipe:
  """The recipe for this platform's native 16-bit format (:func:`jmp_lite.half_dtype`):
  bf16 without loss scaling where the hardware has bf16, else fp16 with a dynamic scale."""
  if jl.half_dtype() == jnp.bfloat16:
    return RECIPES["bf16"]
  return RECIPES["fp16-dynamic"]


def get_recipe(name: str) -> Recipe:
  """A recipe by name; ``"half"`` is :func:`half_recipe`."""
  if name == "half":
    return half_recipe()
  recipe = RECIPES.get(name) or LOW_PRECISION_RECIPES.get(name)
  if recipe is None:
    known = ", ".join([*RECIPES, *LOW_PRECISION_RECIPES])
    raise ValueError(f"Unknown recipe {name!r}; choose from half, {known}.")
  return recipe


def recipe_help() -> str:
  lines = ["half: this platform's native 16-bit format (bf16 on CPU/TPU/Ampere+, else fp16)"]
  lines += [f"{r.name}: {r.summary}" for r in RECIPES.values()]
  lines += [f"{r.name} (opt-in): {r.summary}" for r in LOW_PRECISION_RECIPES.values()]
  return "; ".join(lines)


# ---------------------------------------------------------------------------------------------
# Tasks


Batch = dict[str, np.ndarray]


class Task:
  """A dataset and a linen model, as :func:`train` needs them. Subclasses fill in:

  Attributes:
    name: the example's name.
    model: the linen module (no dtypes in it: the policy is applied from outside).
    mutable: collections ``apply`` updates in training (``("batch_stats",)``).
    metric: ``"accuracy"`` or ``"bpc"`` (bits per character), the headline metric.
    stages: the model's layer-wise stages in order, in words (``"embedding, each block,
      head"``), for the tables.
  """

  name: str
  model: nn.Module
  mutable: tuple[str, ...] = ()
  metric: str = "accuracy"
  stages: str

  def init_inputs(self) -> tuple[Any, ...]:
    """Example positional inputs for ``model.init``."""
    raise NotImplementedError

  def train_batch(self, step: int) -> Batch:
    """The training batch of ``step``; a function of the task's seed and ``step`` only,
    so every recipe sees the same batches."""
    raise NotImplementedError

  def eval_batches(self) -> list[Batch]:
    """The validation set, in batches."""
    raise NotImplementedError

  def model_args(self, batch: Batch, train: bool) -> tuple[tuple, dict]:
    """Positional and keyword arguments of ``model.apply`` for ``batch``."""
    raise NotImplementedError

  def loss_terms(self, outputs: jax.Array, batch: Batch) -> dict[str, jax.Array]:
    """fp32 sums over the batch: ``loss`` (summed per-example loss), ``count`` (examples or
    tokens) and ``correct`` (right predictions)."""
    raise NotImplementedError

  def param_stages(self, params: Any) -> Any:
    """For :class:`jmp_lite.LayerwiseLossScale`: a prefix tree of ``params`` whose leaves are
    stage indices, matching the ``jl.stage_boundary`` calls in the model."""
    raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass
class TrainConfig:
  """Everything about a run that is not the task or the recipe.

  The loss the gradients are taken of is the sum of the batch's per-example
  losses divided by ``replicas * count``: with ``replicas = R > 1`` this
  process plays one of R data-parallel replicas of a global batch R times
  larger, as each device's backward pass sees it under a sharded global mean
  (see docs/examples.md). The gradients are multiplied by R before the
  optimizer, standing in for the all-reduce sum over replicas, so in fp32 the
  run is the same as with R = 1 (R is a power of two: the factor is exact).
  """

  steps: int = 300
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  weight_decay: float = 1e-4
  clip_norm: float = 1.0
  replicas: int = 1
  seed: int = 0
  eval_every: int = 50
  stats_every: int = 50
  static_scale: float = 2.0**10
  dynamic_scale: float = 2.0**15
  dynamic_period: int = 100
  layerwise_period: int = 10
  # How the fp8 recipe scales its tensors when fp8_recipe is None: "current" is the library's
  # default recipe (fp8.as_recipe(None)); "delayed" is DelayedScaling with fp8_history steps
  # of amax history, calibrated on the first batch.
  fp8_scaling: str = "current"
  fp8_history: int = 16
  # An explicit jmp_lite.fp8 recipe for the fp8 recipe (wins over fp8_scaling).
  fp8_recipe: Any = None
  progress: bool = True
  # XLA's backend optimizations off: compiles ~2x faster, runs ~3x slower. Only for the
  # quick preset, whose tiny steps cost less than their compilation on 2 cores.
  fast_compile: bool = False

  def __post_init__(self):
    if self.replicas < 1 or self.replicas & (self.replicas - 1):
      raise ValueError(f"replicas must be a power of two >= 1, got {self.replicas}.")
    if self.steps < 1:
      raise ValueError(f"steps must be >= 1, got {self.steps}.")
    if self.fp8_scaling not in FP8_SCALINGS:
      raise ValueError(
        f"fp8_scaling must be one of {', '.join(FP8_SCALINGS)}, got {self.fp8_scaling!r}."
      )


FP8_SCALINGS = ("current", "delayed")
"""The values of :attr:`TrainConfig.fp8_scaling` (``--fp8-scaling``)."""


def fp8_recipe(config: TrainConfig) -> Any:
  """The :mod:`jmp_lite.fp8` recipe the ``fp8`` recipe trains with under ``config``.

  Args:
    config: the run's configuration.

  Returns:
    ``config.fp8_recipe`` if set; else the library's default recipe
    (:class:`jmp_lite.fp8.CurrentScaling`) for ``fp8_scaling="current"``, or
    :class:`jmp_lite.fp8.DelayedScaling` with ``fp8_history`` steps of history
    for ``"delayed"``.
  """
  if config.fp8_recipe is not None:
    return config.fp8_recipe
  if config.fp8_scaling == "delayed":
    return fp8.DelayedScaling(amax_history_length=config.fp8_history)
  return fp8.as_recipe(None)


_TRAIN_FLAGS: tuple[tuple[str, type, str], ...] = (
  ("steps", int, "optimizer steps"),
  ("learning_rate", float, "peak AdamW learning rate (warmup, then cosine decay to 10%%)"),
  ("seed", int, "seed of the initialization and the batch order"),
  (
    "replicas",
    int,
    "emulate one of R data-parallel replicas: the loss is divided by R times this batch's size "
    "and the gradients are multiplied back by R (a power of two)",
  ),
  ("eval_every", int, "validation every this many steps"),
  ("stats_every", int, "gradient statistics every this many steps"),
  ("static_scale", float, "loss scale of fp16-static"),
  ("dynamic_scale", float, "initial loss scale of fp16-dynamic and fp16-layerwise"),
  ("dynamic_period", int, "fp16-dynamic doubles its scale after this many finite steps"),
  ("layerwise_period", int, "fp16-layerwise refreshes its scales every this many steps"),
)


def add_train_arguments(
  parser: argparse.ArgumentParser,
  defaults: TrainConfig,
  shown: dict[str, str] | None = None,
) -> None:
  """The flags of :class:`TrainConfig`. They default to None (= the preset's value), so that
  only the flags given override the preset; ``defaults`` (the CPU preset) is shown in --help,
  or the text in ``shown`` for a flag whose default is decided otherwise."""
  g = parser.add_argument_group("training (defaults: the CPU preset's)")
  shown = shown or {}
  for name, kind, text in _TRAIN_FLAGS:
    g.add_argument(
      f"--{name.replace('_', '-')}",
      type=kind,
      default=None,
      help=f"{text} ({shown.get(name, format(getattr(defaults, name), 'g'))})",
    )
  g.add_argument(
    "--fp8-scaling",
    choices=FP8_SCALINGS,
    default=None,
    help="the fp8 recipe's scaling: current (the library's default, per-tensor, just in time) "
    f"or delayed (a {defaults.fp8_history}-step amax history, calibrated on the first batch) "
    f"({defaults.fp8_scaling})",
  )
  g.add_argument("--no-progress", action="store_true", help="no progress bars")
  g.add_argument(
    "--fast-compile",
    action="store_true",
    help="compile with XLA's backend optimizations off (the quick preset's setting): faster "
    "to compile, slower to run, and no fused multiply-adds, so two programs that compute the "
    "same fp32 arithmetic agree bit for bit",
  )
  g.add_argument(
    "--platform",
    choices=("auto", "cpu", "gpu", "tpu"),
    default="auto",
    help="JAX platform (default: the best one present)",
  )


def train_config_from_args(args: argparse.Namespace, defaults: TrainConfig) -> TrainConfig:
  """``defaults`` (a preset) with the flags that were given."""
  given = {name: getattr(args, name) for name, _, _ in _TRAIN_FLAGS}
  given = {k: v for k, v in given.items() if v is not None}
  if getattr(args, "fast_compile", False):
    given["fast_compile"] = True
  if getattr(args, "fp8_scaling", None) is not None:
    given["fp8_scaling"] = args.fp8_scaling
  return dataclasses.replace(defaults, progress=not args.no_progress, **given)


def add_preset_arguments(parser: argparse.ArgumentParser, presets: dict[str, Any]) -> None:
  parser.add_argument(
    "--preset",
    choices=sorted(presets),
    default=None,
    help="model size and run length (default: cpu on CPU, accelerator on GPU/TPU); the other "
    "flags override it",
  )
  parser.add_argument("--quick", action="store_true", help="same as --preset quick (for tests)")


def preset_name(args: argparse.Namespace, platform: str) -> str:
  """``--preset``, or ``quick`` with ``--quick``, else ``cpu`` on a CPU and ``accelerator``."""
  if args.preset:
    return args.preset
  if args.quick:
    return "quick"
  return "cpu" if platform == "cpu" else "accelerator"


def resolve_configs(args: argparse.Namespace, presets: dict[str, Any], platform: str):
  """(model config, TrainConfig): the preset, overridden by the flags given.

  The preset is :func:`preset_name`'s. Model flags are named like the fields
  of the preset's model config dataclass.
  """
  model_config, train_defaults = presets[preset_name(args, platform)]
  given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(model_config)}
  model_config = dataclasses.replace(
    model_config, **{k: v for k, v in given.items() if v is not None}
  )
  return model_config, train_config_from_args(args, train_defaults)


def select_platform(platform: str) -> str:
  """Pins JAX to ``platform`` (unless ``"auto"``) and returns the platform in use.

  Must run before the first JAX computation of the process.
  """
  if platform != "auto":
    jax.config.update("jax_platforms", platform)
  return jax.default_backend()


def describe_platform() -> str:
  device = jax.devices()[0]
  kind = getattr(device, "device_kind", device.platform)
  cores = os.cpu_count()
  extra = f", {cores} host cores" if device.platform == "cpu" else ""
  return f"{device.platform} ({kind}{extra}); half = {jnp.dtype(jl.half_dtype()).name}"


# ---------------------------------------------------------------------------------------------
# Results


@dataclasses.dataclass
class RunResult:
  """What one training run measured, as plain Python values (JSON-ready via ``asdict``)."""

  recipe: str
  policy: str
  loss_scale_kind: str
  steps: int
  train_loss: list[float]  # per step, the batch's mean loss (unaffected by replicas)
  loss_scale: list[float]  # per step, the scale the step's gradients were computed at
  stage_scales: list[list[float]] | None  # layer-wise only: per step, one scale per stage
  skipped: list[int]  # steps whose update was skipped (non-finite gradients)
  eval_steps: list[int]
  val_loss: list[float]
  val_accuracy: list[float]
  final: dict[str, float]  # train/val loss and accuracy (train: mean over the last 10%)
  # Wall time of a step after compilation (host loop included): the 10th percentile of the
  # training loop's steps, which other processes on a shared machine inflate least; more
  # percentiles in step_time_spread. examples.compare replaces it with interleaved timings.
  step_time_ms: float
  compile_s: float
  memory: dict[str, int]  # compiled train step's memory_analysis(), bytes
  grad_stats: dict[str, Any]  # step -> layer -> fractions of the parameter gradients
  step_time_spread: dict[str, float] = dataclasses.field(default_factory=dict)
  fp8_scales: dict[str, list[float]] | None = None  # fp8 only: final scale per layer/tensor
  # Bytes of the parameters and of the optimizer state (loss scaling's included), from the
  # trees, and the number of parameter elements.
  state_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
  # 16-bit parameters only: per step, how many 16-bit parameter elements the step meant to
  # change but left as they were (jl.LowPrecisionParamsState.rounded_away), and how many
  # 16-bit parameter elements there are.
  rounded_away: list[int] | None = None
  low_precision_size: int | None = None
  # Not in the JSON: (params, model_state) after training, with train(..., keep_state=True)
  # (16-bit parameters: the fp32 values the optimizer reads, jl.master_params);
  # and run_more(n), which runs n more steps and returns their wall times in seconds (it
  # donates the final state, so take `state` first).
  state: Any = dataclasses.field(default=None, repr=False)
  run_more: Any = dataclasses.field(default=None, repr=False)

  def as_dict(self) -> dict[str, Any]:
    return {
      f.name: getattr(self, f.name)
      for f in dataclasses.fields(self)
      if f.name not in ("state", "run_more")
    }


# ---------------------------------------------------------------------------------------------
# The training loop

# XLA's backend optimizations off, for programs that run once or on tiny inputs.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def step_compiler_options(fast_compile: bool = False) -> dict[str, Any] | None:
  """The compiler options of a training step that donates its state.

  On CPU, XLA's default copy insertion copies every donated array that a step reads in two
  places, e.g. a bf16 moment read as fp32 for the update and again to store its new value; on
  two cores the copies cost a 16-bit-state step 15-35% (docs/low-precision-params.md, "Step
  time"). Its region analysis proves the reads come first and copies nothing.
  """
  options = dict(_FAST_COMPILE) if fast_compile else {}
  if jax.default_backend() == "cpu":
    options["xla_cpu_copy_insertion_use_region_analysis"] = True
  return options or None


def progress(iterable: Iterable, enabled: bool, **kwargs: Any):
  """``iterable`` with a tqdm progress bar on stderr (if ``enabled``)."""
  if not enabled:
    return iterable
  from tqdm.auto import tqdm  # optional dependency of the examples only

  return tqdm(iterable, leave=False, dynamic_ncols=True, file=sys.stderr, **kwargs)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """AdamW with warmup and cosine decay, global-norm clipping, and the replica factor.

  This is the *inner* optimizer: it goes inside :func:`jmp_lite.loss_scaling`,
  so clipping sees the true (unscaled) gradients.
  """
  return optax.chain(
    # Stands in for the all-reduce sum over replicas (exact: a power of two).
    optax.scale(float(config.replicas)),
    optax.clip_by_global_norm(config.clip_norm),
    optax.adamw(make_schedule(config), weight_decay=config.weight_decay),
  )


def make_schedule(config: TrainConfig) -> optax.Schedule:
  """The learning rate per step: linear warmup, then cosine decay to 10% of the peak."""
  return optax.warmup_cosine_decay_schedule(
    0.0,
    config.learning_rate,
    warmup_steps=min(config.warmup_steps, max(config.steps - 1, 1)),
    decay_steps=max(config.steps, 2),
    end_value=config.learning_rate * 0.1,
  )


def make_transform(
  recipe: Recipe, task: Task, params: Any, config: TrainConfig
) -> optax.GradientTransformation:
  """The whole optimizer of ``recipe``: :func:`make_optimizer` in :func:`jmp_lite.loss_scaling`,
  and for 16-bit parameters in :func:`jmp_lite.low_precision_params` in between (it must see
  the unscaled fp32 gradients, and nothing may change the updates it has rounded)."""
  inner = make_optimizer(config)
  if recipe.params_method is not None:
    inner = jl.low_precision_params(
      inner,
      recipe.params_method,
      seed=config.seed,
      state_dtype=None if recipe.moment_dtype == "float32" else jnp.dtype(recipe.moment_dtype),
    )
  return jl.loss_scaling(inner, make_loss_scale(recipe, task, params, config))


def low_precision_state(opt_state: Any) -> jl.LowPrecisionParamsState | None:
  """The :class:`jmp_lite.LowPrecisionParamsState` inside ``opt_state``, if there is one."""
  is_state = lambda x: isinstance(x, jl.LowPrecisionParamsState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(x)]
  return found[0] if found else None


def low_precision_size(params: Any) -> int:
  """How many elements of ``params`` are 16-bit floats (what ``rounded_away`` counts in)."""
  return sum(
    int(np.size(p))
    for p in jax.tree.leaves(params)
    if jnp.issubdtype(p.dtype, jnp.floating) and jnp.dtype(p.dtype).itemsize == 2
  )


def tree_bytes(tree: Any) -> int:
  """Bytes of the arrays in ``tree``."""
  return sum(int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def make_loss_scale(recipe: Recipe, task: Task, params: Any, config: TrainConfig) -> Any:
  """The initial loss scale of ``recipe``."""
  if recipe.loss_scale == "none":
    return jl.NoOpLossScale()
  if recipe.loss_scale == "static":
    return jl.StaticLossScale(jnp.float32(config.static_scale))
  if recipe.loss_scale == "dynamic":
    return jl.DynamicLossScale(jnp.float32(config.dynamic_scale), period=config.dynamic_period)
  if recipe.loss_scale == "layerwise":
    return jl.LayerwiseLossScale(
      task.param_stages(params),
      initial_scale=config.dynamic_scale,
      update_period=config.layerwise_period,
    )
  raise ValueError(f"Unknown loss scale kind {recipe.loss_scale!r}.")


def _scale_values(loss_scale: Any) -> tuple[jax.Array, jax.Array | None]:
  """(the scale the loss is multiplied by, per-stage scales or None)."""
  value = jnp.asarray(loss_scale.loss_scale, jnp.float32)
  return value, (None if loss_scale.gradient_scale is not None else loss_scale.scales)


def _memory(compiled: Any) -> dict[str, int]:
  try:
    stats = compiled.memory_analysis()
  except Exception:  # some backends do not implement it
    return {}
  if stats is None:
    return {}
  fields = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
  )
  out = {f: int(getattr(stats, f, 0) or 0) for f in fields}
  # Arguments and outputs that alias (donated buffers) are counted once.
  out["total_bytes"] = (
    out["argument_size_in_bytes"]
    + out["output_size_in_bytes"]
    - out["alias_size_in_bytes"]
    + out["temp_size_in_bytes"]
  )
  return out


def stats_to_python(
  stats: dict[str, jl.diagnostics.GradientStats], *, histogram: bool = True
) -> dict[str, Any]:
  """Fetched ``jl.diagnostics.GradientStats`` per layer as JSON-ready dicts (without the exponent
  histogram if ``histogram=False``: it is most of the size)."""
  out = {}
  for layer, s in stats.items():
    out[layer] = {
      "size": int(s.size),
      "zero_fraction": float(s.zero_fraction),
      "nonfinite_fraction": float(s.nonfinite_fraction),
      "underflow_fraction": float(s.underflow_fraction),
      "subnormal_fraction": float(s.subnormal_fraction),
      "overflow_fraction": float(s.overflow_fraction),
      "max_abs": float(s.max_abs),
      "histogram": [int(v) for v in np.asarray(s.histogram)],
      "min_exponent": int(s.min_exponent),
      "loss_scale": float(s.loss_scale),
    }
    if not histogram:  # also drop what is the same for every layer and step
      for field in ("histogram", "min_exponent", "loss_scale", "size"):
        del out[layer][field]
  return out


def stats_from_python(layers: dict[str, Any]) -> dict[str, jl.diagnostics.GradientStats]:
  """Inverse of the JSON form: ``GradientStats`` (numpy) for :mod:`jmp_lite.plotting`."""
  return {
    name: jl.diagnostics.GradientStats(
      **{
        f: np.asarray(d[f])
        for f in jl.diagnostics.GradientStats._fields  # every field is stored
      }
    )
    for name, d in layers.items()
  }


# Called every stats_every steps on small trees: XLA's backend optimizations would cost more
# compile time (seconds, per model) than they save.
@functools.partial(jax.jit, compiler_options=_FAST_COMPILE)
def _gradient_stats(grads: Any) -> dict[str, jl.diagnostics.GradientStats]:
  """Per-layer statistics of gradients that are already scaled, as fp16 would store them."""
  return jl.diagnostics.gradient_statistics(grads, loss_scale=1.0, format="float16")


def train(
  task: Task,
  recipe: Recipe,
  config: TrainConfig,
  *,
  keep_state: bool = False,
) -> RunResult:
  """Trains ``task`` under ``recipe`` from ``config.seed`` and measures the run.

  The step is compiled ahead of time (``jax.jit(...).lower(...).compile()``)
  so its compile time and ``memory_analysis()`` are measured separately from
  the step time.
  """
  policy = jl.get_policy(recipe.policy)
  fp8_config = fp8_recipe(config) if recipe.fp8 else None
  # Delayed scaling keeps a state (calibrated, read and updated); the other recipes none.
  fp8_stateful = fp8_config is not None and fp8.as_recipe(fp8_config).init_state() is not None
  apply_fn = jlf.policy_apply(task.model, policy)

  def fp8_scope(loss_scale=None):
    # linen_fp8 goes outside the policy's interceptor (installed inside apply_fn), as
    # docs/fp8.md asks, so the fp8 matmul replaces Flax's default dot_general.
    if fp8_config is None:
      return contextlib.nullcontext()
    # Every Dense in fp8, the head included: the default placement keeps the first and last
    # layers in bf16 and skips matmuls too small to pay, which at these CPU sizes is all of
    # them, so the fp8 recipe would train as bf16 and measure nothing.
    return flax_fp8.linen_fp8(fp8_config, loss_scale=loss_scale, placement=fp8.ALL_LAYERS)

  def init(key):
    with fp8_scope():
      return task.model.init(key, *task.init_inputs())

  # Under one jit: run eagerly, every initializer would be compiled on its own (seconds);
  # it runs once, so XLA's optimizations are not worth their compile time either.
  variables = jax.jit(init, compiler_options=_FAST_COMPILE)(jax.random.key(config.seed))
  variables = dict(variables)
  params = variables.pop("params")
  fp8_state = variables.pop(flax_fp8.STATE_COLLECTION, None)
  model_state = variables  # e.g. batch_stats

  if recipe.params_method is not None:
    params = policy.cast_to_param(params)  # stored in 16 bits: no fp32 master copy
  if recipe.high_half_view:  # the split's starting point: the bf16 values, exact in fp32
    params = jl.cast_to_full(policy.cast_to_param(params))
  tx = make_transform(recipe, task, params, config)
  opt_state = tx.init(params)
  state_bytes = {
    "params": tree_bytes(params),
    "opt_state": tree_bytes(opt_state),
    "param_elements": sum(int(np.size(p)) for p in jax.tree.leaves(params)),
  }
  denominator_factor = float(config.replicas)

  def loss_fn(params, amax, model_state, fp8_state, batch, loss_scale):
    if recipe.high_half_view:
      params = jax.tree.map(bf16_high_half, params)
    variables = {"params": params, **model_state}
    if fp8_stateful:
      variables[flax_fp8.STATE_COLLECTION] = fp8_state
      variables[flax_fp8.AMAX_COLLECTION] = amax
    args, kwargs = task.model_args(batch, train=True)
    with fp8_scope(loss_scale):
      if task.mutable:
        outputs, updates = apply_fn(variables, *args, mutable=list(task.mutable), **kwargs)
      else:
        outputs, updates = apply_fn(variables, *args, **kwargs), {}
    terms = task.loss_terms(outputs, batch)
    # The loss the gradients are taken of: this replica's share of a global mean.
    loss = terms["loss"] / (terms["count"] * denominator_factor)
    return loss, (updates, terms)

  if fp8_stateful:
    # Step 0's fp8 scales from the first batch's own maxima (docs/fp8.md): otherwise they
    # start at 1 and the first steps flush small gradients to zero.
    fp8_state = jax.jit(
      lambda p, ms, fs, b: fp8.calibrate(
        lambda amax: loss_fn(p, amax, ms, fs, b, None), fs, fp8_config, has_aux=True
      ),
      compiler_options=_FAST_COMPILE,
    )(params, model_state, fp8_state, task.train_batch(0))

  def train_step(params, model_state, fp8_state, opt_state, batch, step):
    loss_scale = jl.get_loss_scale(opt_state)
    if not fp8_stateful:
      (_, (updates, terms)), grads = jl.scaled_value_and_grad(loss_fn, loss_scale, has_aux=True)(
        params, None, model_state, fp8_state, batch, loss_scale
      )
      amax = None
    else:
      # Gradients for the parameters and the fp8 amax probes (docs/fp8.md).
      (_, (updates, terms)), (grads, amax) = jl.scaled_value_and_grad(
        loss_fn, loss_scale, has_aux=True, argnums=(0, 1)
      )(params, fp8.zeros_amax(fp8_state), model_state, fp8_state, batch, loss_scale)

    # The parameter gradients as computed (scaled), for the statistics (outside the step:
    # one small compilation shared by all recipes instead of a bigger step per recipe).
    param_grads = jl.ScaledGrads.of(grads).grads
    scale_used, stage_scales = _scale_values(loss_scale)
    new_updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, new_updates)
    finite = jl.get_loss_scaling_state(opt_state).last_finite
    # Batch statistics of a skipped step (non-finite activations) are dropped too.
    model_state = jl.select_tree(finite, {**model_state, **updates}, model_state)
    if fp8_stateful:
      fp8_state = fp8.update(fp8_state, amax, fp8_config)  # drops non-finite observations
    metrics = {
      "loss": terms["loss"] / terms["count"],
      "accuracy": terms["correct"] / terms["count"],
      "finite": finite,
      "loss_scale": scale_used,
      "grads": param_grads,
    }
    if stage_scales is not None:
      metrics["stage_scales"] = stage_scales
    if recipe.params_method is not None:
      metrics["rounded_away"] = low_precision_state(opt_state).rounded_away
    return params, model_state, fp8_state, opt_state, metrics

  def eval_step(params, model_state, fp8_state, batch):
    if recipe.high_half_view:
      params = jax.tree.map(bf16_high_half, params)
    variables = {"params": params, **model_state}
    if fp8_stateful:
      variables[flax_fp8.STATE_COLLECTION] = fp8_state  # no probes: nothing observed
    args, kwargs = task.model_args(batch, train=False)
    with fp8_scope():
      outputs = apply_fn(variables, *args, **kwargs)
    return task.loss_terms(outputs, batch)

  compiler_options = _FAST_COMPILE if config.fast_compile else None
  step0 = jnp.asarray(0, jnp.int32)
  t0 = time.perf_counter()
  lowered = jax.jit(
    train_step,
    donate_argnums=(0, 1, 2, 3),
    compiler_options=step_compiler_options(config.fast_compile),
  ).lower(params, model_state, fp8_state, opt_state, task.train_batch(0), step0)
  compiled = lowered.compile()
  compile_s = time.perf_counter() - t0
  memory = _memory(compiled)
  eval_compiled = jax.jit(eval_step, compiler_options=compiler_options)

  eval_batches = task.eval_batches()

  def evaluate() -> tuple[float, float]:
    totals = {"loss": 0.0, "count": 0.0, "correct": 0.0}
    for batch in eval_batches:
      terms = jax.device_get(eval_compiled(params, model_state, fp8_state, batch))
      for k in totals:
        totals[k] += float(terms[k])
    return totals["loss"] / totals["count"], totals["correct"] / totals["count"]

  def run_step(step: int):
    nonlocal params, model_state, fp8_state, opt_state
    batch = task.train_batch(step)
    t = time.perf_counter()
    params, model_state, fp8_state, opt_state, metrics = compiled(
      params, model_state, fp8_state, opt_state, batch, jnp.asarray(step, jnp.int32)
    )
    loss = float(metrics["loss"])  # waits for the step
    return metrics, loss, time.perf_counter() - t

  def run_more(n: int) -> list[float]:
    start = config.steps + len(extra_times)
    times = [run_step(start + i)[2] for i in range(n)]
    extra_times.extend(times)
    return times

  extra_times: list[float] = []
  train_loss, train_acc, scales, stage_scales, skipped, times = [], [], [], [], [], []
  rounded_away: list[int] = []
  eval_steps, val_loss, val_acc = [], [], []
  grad_stats: dict[str, Any] = {}
  bar = progress(range(config.steps), config.progress, desc=f"{task.name}/{recipe.name}")
  for step in bar:
    metrics, loss, seconds = run_step(step)
    times.append(seconds)
    train_loss.append(loss)
    train_acc.append(float(metrics["accuracy"]))
    scales.append(float(metrics["loss_scale"]))
    if "stage_scales" in metrics:
      stage_scales.append([float(s) for s in np.asarray(metrics["stage_scales"])])
    if "rounded_away" in metrics:
      rounded_away.append(int(metrics["rounded_away"]))
    if not bool(metrics["finite"]):
      skipped.append(step)
    if step % config.stats_every == 0 or step == config.steps - 1:
      stats = jax.device_get(_gradient_stats(metrics["grads"]))
      grad_stats[str(step)] = stats_to_python(stats, histogram=False)
    if (step + 1) % config.eval_every == 0 or step == config.steps - 1 or step == 0:
      vl, va = evaluate()
      eval_steps.append(step + 1)
      val_loss.append(vl)
      val_acc.append(va)
    if hasattr(bar, "set_postfix"):
      bar.set_postfix(loss=f"{loss:.3f}", scale=f"{scales[-1]:g}", refresh=False)

  # Final training metrics: the whole training set would cost a pass per recipe,
  # so the train loss is the mean over the last 10% of steps (same batches for all).
  tail = max(1, config.steps // 10)
  final_train_loss = float(np.mean(train_loss[-tail:]))
  final_train_acc = float(np.mean(train_acc[-tail:]))
  final = {
    "train_loss": final_train_loss,
    "train_accuracy": final_train_acc,
    "val_loss": val_loss[-1],
    "val_accuracy": val_acc[-1],
  }
  fp8_scales = None
  if fp8_state is not None:
    fp8_scales = _fp8_scales(fp8_state)
  warm = times[min(2, len(times) - 1) :]  # the first calls include dispatch warm-up
  return RunResult(
    recipe=recipe.name,
    policy=recipe.policy,
    loss_scale_kind=recipe.loss_scale,
    steps=config.steps,
    train_loss=train_loss,
    loss_scale=scales,
    stage_scales=stage_scales or None,
    skipped=skipped,
    eval_steps=eval_steps,
    val_loss=val_loss,
    val_accuracy=val_acc,
    final=final,
    step_time_ms=1e3 * float(np.percentile(warm, 10)),
    step_time_spread={
      "training_loop_p10_ms": 1e3 * float(np.percentile(warm, 10)),
      "training_loop_median_ms": 1e3 * statistics.median(warm),
      "training_loop_p90_ms": 1e3 * float(np.percentile(warm, 90)),
    },
    compile_s=compile_s,
    memory=memory,
    grad_stats=grad_stats,
    fp8_scales=fp8_scales,
    state_bytes=state_bytes,
    rounded_away=rounded_away if recipe.params_method is not None else None,
    low_precision_size=low_precision_size(params) if recipe.params_method is not None else None,
    state=(_master(params, opt_state, recipe), model_state) if keep_state else None,
    run_more=run_more,
  )


def _master(params: Any, opt_state: Any, recipe: Recipe) -> Any:
  """The fp32 values the optimizer reads (:func:`jmp_lite.master_params`) for 16-bit
  parameters, else the parameters."""
  if recipe.params_method is None:
    return params
  return jl.master_params(params, opt_state)


def _module_name(module: nn.Module) -> str:
  return "/".join(module.path) or "output"


def activation_gradients(
  task: Task, params: Any, model_state: Any, batch: Batch, config: TrainConfig
) -> dict[str, jax.Array]:
  """The gradients of the training loss with respect to every module's output, in fp32.

  These are the values a 16-bit backward pass stores between layers (the
  activation gradients of Micikevicius et al. 2018), as opposed to the
  parameter gradients accumulated from them. Each module call's output gets
  a zero "probe" added (by an ``nn.intercept_methods`` interceptor, so the
  model is unchanged); the gradient with respect to the probe is the
  gradient with respect to that output. A module called twice shares one
  probe, so its entry is the sum of its calls' output gradients (no module
  of the examples is called twice). Runs the model in fp32 (the true values)
  with the same loss reduction as training (``config.replicas``).
  """
  apply_fn = jlf.policy_apply(task.model, jl.get_policy("float32"))
  args, kwargs = task.model_args(batch, train=True)
  variables = {"params": params, **model_state}
  mutable = list(task.mutable) or False

  def run(interceptor):
    with nn.intercept_methods(interceptor):
      out = apply_fn(variables, *args, mutable=mutable, **kwargs)
    return out[0] if mutable else out

  shapes: dict[str, jax.ShapeDtypeStruct] = {}

  def record(next_fun, a, kw, context):
    out = next_fun(*a, **kw)
    if context.method_name == "__call__" and isinstance(out, jax.Array):
      if jnp.issubdtype(out.dtype, jnp.floating):
        shapes[_module_name(context.module)] = jax.ShapeDtypeStruct(out.shape, jnp.float32)
    return out

  jax.eval_shape(lambda: run(record))

  def loss_fn(probes):
    def add_probe(next_fun, a, kw, context):
      out = next_fun(*a, **kw)
      name = _module_name(context.module)
      if context.method_name == "__call__" and name in probes:
        out = out + probes[name].astype(out.dtype)
      return out

    terms = task.loss_terms(run(add_probe), batch)
    return terms["loss"] / (terms["count"] * config.replicas)

  zeros = {name: jnp.zeros(s.shape, s.dtype) for name, s in shapes.items()}
  return jax.jit(jax.grad(loss_fn), compiler_options=_FAST_COMPILE)(zeros)  # runs once


def _fp8_scales(fp8_state: Any) -> dict[str, list[float]]:
  """Final fp8 scales per layer: [input, kernel, output gradient]."""
  out = {}
  flat = jax.tree_util.tree_flatten_with_path(
    fp8_state, is_leaf=lambda x: isinstance(x, fp8.Fp8DotState)
  )[0]
  for path, dot_state in flat:
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    out[name] = [float(t.scale) for t in dot_state]
  return out
