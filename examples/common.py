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
  # Which Dense layers run in fp8 (a jmp_lite.fp8.Fp8Placement); None: every one, the head
  # included. The library's default placement keeps the first and last layers in bf16 and
  # skips matmuls too small to pay, which at these CPU sizes is all of them, so the fp8
  # recipe would train as bf16 and measure nothing.
  fp8_placement: Any = None
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
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def step_compiler_options(fast_compile: bool = False) -> dict[str, Any] | None:
  """The compiler options of a training step that donates its state.

  On CPU, XLA's default copy insertion copies every donated array that a step reads in two
  places, e.g. a bf16 moment read as fp32 for the update and again to store its new value; on
  two cores the copies cost a 16-bit-state step 15-35% (docs/low-precision-params.md, "Step
  time"). Its region analysis proves the reads come first and copies nothing.
  """
  options = dict(FAST_COMPILE) if fast_compile else {}
  if jax.default_backend() == "cpu":
    options["xla_cpu_copy_insertion_use_region_analysis"] = True
  return options or None


def markdown_table(columns: list[tuple[str, Any]], rows: list[dict[str, Any]]) -> str:
  """A Markdown table: one column per (header, cell function of a row)."""
  lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows]
  return "\n".join(lines)


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


def _memory(compiled: Any) -> dict[str, int]:
  """The compiled step's ``memory_analysis()`` in bytes ({} where the backend has none)."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # some backends do not implement it
    stats = None
  if stats is None:
    return {}
  kinds = ("argument", "output", "alias", "temp", "generated_code")
  out = {f"{k}_size_in_bytes": int(getattr(stats, f"{k}_size_in_bytes", 0) or 0) for k in kinds}
  # Arguments and outputs that alias (donated buffers) are counted once.
  arguments, outputs, alias, temp = (out[f"{k}_size_in_bytes"] for k in kinds[:4])
  out["total_bytes"] = arguments + outputs - alias + temp
  return out


def stats_to_python(
  stats: dict[str, jl.diagnostics.GradientStats], *, histogram: bool = True
) -> dict[str, Any]:
  """Fetched ``jl.diagnostics.GradientStats`` per layer as JSON-ready dicts; without the
  exponent histogram (most of the size) and what every layer and step shares if
  ``histogram=False``."""
  drop = () if histogram else ("histogram", "min_exponent", "loss_scale", "size")
  return {
    layer: {f: np.asarray(v).tolist() for f, v in s._asdict().items() if f not in drop}
    for layer, s in stats.items()
  }


def stats_from_python(layers: dict[str, Any]) -> dict[str, jl.diagnostics.GradientStats]:
  """Inverse of the JSON form: ``GradientStats`` (numpy) for :mod:`jmp_lite.plotting`."""
  fields = jl.diagnostics.GradientStats._fields  # every field is stored
  as_stats = jl.diagnostics.GradientStats
  return {n: as_stats(**{f: np.asarray(d[f]) for f in fields}) for n, d in layers.items()}


# Called every stats_every steps on small trees: XLA's backend optimizations would cost more
# compile time (seconds, per model) than they save.
@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def _gradient_stats(grads: Any) -> dict[str, jl.diagnostics.GradientStats]:
  """Per-layer statistics of gradients that are already scaled, as fp16 would store them
  (no exponent histogram: the training loop keeps the fractions only)."""
  return jl.diagnostics.gradient_statistics(
    grads, loss_scale=1.0, format="float16", exponent_range=None
  )


@dataclasses.dataclass
class Setup:
  """One recipe's model, optimizer and initial state, as the training step needs them.

  Attributes:
    task, recipe, config: what is trained, how, for how long.
    policy: the recipe's :class:`jmp_lite.Policy`.
    apply_fn: ``jlf.policy_apply(task.model, policy)``.
    fp8_config: the :mod:`jmp_lite.fp8` recipe of the ``fp8`` recipe, else None.
    fp8_stateful: whether that fp8 recipe keeps a state (delayed scaling).
    tx: the whole optimizer (:func:`make_transform`).
    state: ``(params, model_state, fp8_state, opt_state)``, the step's carried state.
  """

  task: Task
  recipe: Recipe
  config: TrainConfig
  policy: jl.Policy
  apply_fn: Any
  fp8_config: Any
  fp8_stateful: bool
  tx: optax.GradientTransformation
  state: tuple[Any, Any, Any, Any]

  def fp8_scope(self, loss_scale: Any = None) -> Any:
    """The context the model runs in: ``config.fp8_placement``'s Dense layers in fp8 for the
    fp8 recipe (every one by default), else nothing.

    linen_fp8 goes outside the policy's interceptor (installed inside apply_fn), as
    docs/fp8.md asks.
    """
    if self.fp8_config is None:
      return contextlib.nullcontext()
    placement = fp8_placement(self.config)
    return flax_fp8.linen_fp8(self.fp8_config, loss_scale=loss_scale, placement=placement)

  def variables(self, params: Any, model_state: Any, fp8_state: Any, amax: Any = None) -> dict:
    """The linen variables of one forward pass (the split's view of the parameters)."""
    if self.recipe.high_half_view:
      params = jax.tree.map(bf16_high_half, params)
    variables = {"params": params, **model_state}
    if self.fp8_stateful:
      variables[flax_fp8.STATE_COLLECTION] = fp8_state
      if amax is not None:  # the probes whose gradients are the observed maxima
        variables[flax_fp8.AMAX_COLLECTION] = amax
    return variables


def init_variables(task: Task, fp8_config: Any, config: TrainConfig) -> dict[str, Any]:
  """The model's initial variables (fp32), computed once per task, fp8 recipe, placement and
  seed; a fresh copy each call, since the training step donates (consumes) them."""
  cache = task.__dict__.setdefault("_initial_variables", {})
  key = (config.seed, repr(fp8_config), repr(fp8_placement(config)))
  if key not in cache:
    init = _init_fn(task.model, fp8_config, config)
    cache[key] = init(jax.random.key(config.seed), *task.init_inputs())
  return dict(_copy(cache[key]))


_INIT_FNS: dict[tuple[Any, ...], Any] = {}


def _init_fn(model: nn.Module, fp8_config: Any, config: TrainConfig) -> Any:
  """``model.init`` under one jit, shared by the tasks of equal models (each run of a preset
  builds its own task): run eagerly, every initializer would be compiled on its own
  (seconds); it runs once, so XLA's optimizations are not worth their compile time either."""
  key = (model, repr(fp8_config), repr(fp8_placement(config)))
  if key not in _INIT_FNS:

    def init(rng, *inputs):
      with setup_scope(fp8_config, config):
        return model.init(rng, *inputs)

    _INIT_FNS[key] = jax.jit(init, compiler_options=FAST_COMPILE)
  return _INIT_FNS[key]


# Under jit, jnp.copy gives new buffers: an output that is an input would be the same one.
_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree), compiler_options=FAST_COMPILE)


def fp8_placement(config: TrainConfig) -> Any:
  """``config.fp8_placement``, or every Dense layer (:data:`jmp_lite.fp8.ALL_LAYERS`)."""
  return fp8.ALL_LAYERS if config.fp8_placement is None else config.fp8_placement


def setup_scope(fp8_config: Any, config: TrainConfig) -> Any:
  """The fp8 context of initialization (a fresh one: a context manager is used once)."""
  if fp8_config is None:
    return contextlib.nullcontext()
  return flax_fp8.linen_fp8(fp8_config, placement=fp8_placement(config))


def make_setup(task: Task, recipe: Recipe, config: TrainConfig) -> Setup:
  """The recipe's policy, optimizer and initial state for ``task``."""
  policy = jl.get_policy(recipe.policy)
  fp8_config = fp8_recipe(config) if recipe.fp8 else None
  variables = init_variables(task, fp8_config, config)
  params = variables.pop("params")
  fp8_state = variables.pop(flax_fp8.STATE_COLLECTION, None)
  if recipe.params_method is not None:
    params = policy.cast_to_param(params)  # stored in 16 bits: no fp32 master copy
  if recipe.high_half_view:  # the split's starting point: the bf16 values, exact in fp32
    params = jl.cast_to_full(policy.cast_to_param(params))
  tx = make_transform(recipe, task, params, config)
  return Setup(
    task=task,
    recipe=recipe,
    config=config,
    policy=policy,
    apply_fn=jlf.policy_apply(task.model, policy),
    fp8_config=fp8_config,
    fp8_stateful=fp8_config is not None and fp8.as_recipe(fp8_config).init_state() is not None,
    tx=tx,
    state=(params, variables, fp8_state, jax.jit(tx.init)(params)),  # variables: batch_stats
  )


def make_loss_fn(setup: Setup):
  """``loss_fn(params, amax, model_state, fp8_state, batch, loss_scale) -> (loss, aux)``.

  The loss the gradients are taken of is this replica's share of a global mean (the sum
  over the batch divided by ``replicas * count``); ``aux`` is the model state's updates and
  the batch's loss terms.
  """
  task = setup.task

  def loss_fn(params, amax, model_state, fp8_state, batch, loss_scale):
    variables = setup.variables(params, model_state, fp8_state, amax)
    args, kwargs = task.model_args(batch, train=True)
    with setup.fp8_scope(loss_scale):
      if task.mutable:
        outputs, updates = setup.apply_fn(variables, *args, mutable=list(task.mutable), **kwargs)
      else:
        outputs, updates = setup.apply_fn(variables, *args, **kwargs), {}
    terms = task.loss_terms(outputs, batch)
    return terms["loss"] / (terms["count"] * setup.config.replicas), (updates, terms)

  return loss_fn


def make_train_step(setup: Setup):
  """The training step: the gradients of the scaled loss, ``tx.update`` (unscale, skip a
  non-finite step, adjust the scale), ``optax.apply_updates``; README's step, plus the model
  state (dropped on a skipped step), fp8's delayed scales and the metrics to record."""
  loss_fn, tx, recipe = make_loss_fn(setup), setup.tx, setup.recipe

  def train_step(params, model_state, fp8_state, opt_state, batch):
    loss_scale = jl.get_loss_scale(opt_state)
    amax = fp8.zeros_amax(fp8_state) if setup.fp8_stateful else None
    # With delayed fp8 scaling, also the gradients of the amax probes (docs/fp8.md).
    argnums = (0, 1) if setup.fp8_stateful else 0
    (_, (updates, terms)), grads = jl.scaled_value_and_grad(
      loss_fn, loss_scale, has_aux=True, argnums=argnums
    )(params, amax, model_state, fp8_state, batch, loss_scale)
    grads, amax = grads if setup.fp8_stateful else (grads, None)
    new_updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, new_updates)
    finite = jl.get_loss_scaling_state(opt_state).last_finite
    # Batch statistics of a skipped step (non-finite activations) are dropped too.
    model_state = jl.select_tree(finite, {**model_state, **updates}, model_state)
    if setup.fp8_stateful:
      fp8_state = fp8.update(fp8_state, amax, setup.fp8_config)  # drops non-finite maxima
    metrics = {
      "loss": terms["loss"] / terms["count"],
      "accuracy": terms["correct"] / terms["count"],
      "finite": finite,
      "loss_scale": jnp.asarray(loss_scale.loss_scale, jnp.float32),
      # The parameter gradients as computed (scaled), for the statistics.
      "grads": jl.ScaledGrads.of(grads).grads,
    }
    if loss_scale.gradient_scale is None:  # one scale per stage
      metrics["stage_scales"] = loss_scale.scales
    if recipe.params_method is not None:
      metrics["rounded_away"] = low_precision_state(opt_state).rounded_away
    return params, model_state, fp8_state, opt_state, metrics

  return train_step


def make_eval_step(setup: Setup):
  """``eval_step(params, model_state, fp8_state, batch) -> loss terms``, jitted; shared by the
  recipes that evaluate alike (same policy, view and fp8 recipe)."""
  task, recipe = setup.task, setup.recipe
  cache = task.__dict__.setdefault("_eval_steps", {})
  key = (recipe.policy, recipe.high_half_view, repr(setup.fp8_config), setup.config.fast_compile)
  if key in cache:
    return cache[key]

  def eval_step(params, model_state, fp8_state, batch):
    args, kwargs = task.model_args(batch, train=False)
    with setup.fp8_scope():  # no probes: nothing observed
      outputs = setup.apply_fn(setup.variables(params, model_state, fp8_state), *args, **kwargs)
    return task.loss_terms(outputs, batch)

  options = FAST_COMPILE if setup.config.fast_compile else None
  cache[key] = jax.jit(eval_step, compiler_options=options)
  return cache[key]


class Run:
  """A compiled training step and its state, stepped one batch at a time.

  The step is compiled ahead of time (``jax.jit(...).lower(...).compile()``) so that its
  compile time and ``memory_analysis()`` are measured apart from the step time.
  """

  def __init__(self, setup: Setup):
    self.setup, self.state, self.steps_done = setup, setup.state, 0
    step = jax.jit(
      make_train_step(setup),
      donate_argnums=(0, 1, 2, 3),
      compiler_options=step_compiler_options(setup.config.fast_compile),
    )
    t0 = time.perf_counter()
    self.compiled = step.lower(*self.state, setup.task.train_batch(0)).compile()
    self.compile_s = time.perf_counter() - t0
    self.memory = _memory(self.compiled)
    self.eval_step = make_eval_step(setup)
    self.eval_batches = setup.task.eval_batches()

  def step(self) -> tuple[dict[str, Any], float, float]:
    """Runs the next step: (its metrics, its loss, its wall time in seconds)."""
    batch = self.setup.task.train_batch(self.steps_done)
    t = time.perf_counter()
    *self.state, metrics = self.compiled(*self.state, batch)
    loss = float(metrics["loss"])  # waits for the step
    self.steps_done += 1
    return metrics, loss, time.perf_counter() - t

  def more(self, n: int) -> list[float]:
    """Wall times of ``n`` more steps (for the interleaved timing)."""
    return [self.step()[2] for _ in range(n)]

  def evaluate(self) -> tuple[float, float]:
    """(loss, accuracy) on the validation batches."""
    params, model_state, fp8_state, _ = self.state
    totals = {"loss": 0.0, "count": 0.0, "correct": 0.0}
    for batch in self.eval_batches:
      terms = jax.device_get(self.eval_step(params, model_state, fp8_state, batch))
      for k in totals:
        totals[k] += float(terms[k])
    return totals["loss"] / totals["count"], totals["correct"] / totals["count"]


@dataclasses.dataclass
class History:
  """What the training loop records, step by step."""

  train_loss: list[float] = dataclasses.field(default_factory=list)
  train_accuracy: list[float] = dataclasses.field(default_factory=list)
  loss_scale: list[float] = dataclasses.field(default_factory=list)
  stage_scales: list[list[float]] = dataclasses.field(default_factory=list)
  rounded_away: list[int] = dataclasses.field(default_factory=list)
  skipped: list[int] = dataclasses.field(default_factory=list)
  times: list[float] = dataclasses.field(default_factory=list)
  eval_steps: list[int] = dataclasses.field(default_factory=list)
  val_loss: list[float] = dataclasses.field(default_factory=list)
  val_accuracy: list[float] = dataclasses.field(default_factory=list)
  grad_stats: dict[str, Any] = dataclasses.field(default_factory=dict)

  def record(self, step: int, metrics: dict[str, Any], loss: float, seconds: float) -> None:
    self.times.append(seconds)
    self.train_loss.append(loss)
    self.train_accuracy.append(float(metrics["accuracy"]))
    self.loss_scale.append(float(metrics["loss_scale"]))
    if "stage_scales" in metrics:
      self.stage_scales.append([float(s) for s in np.asarray(metrics["stage_scales"])])
    if "rounded_away" in metrics:
      self.rounded_away.append(int(metrics["rounded_away"]))
    if not bool(metrics["finite"]):
      self.skipped.append(step)

  def record_stats(self, step: int, grads: Any) -> None:
    stats = jax.device_get(_gradient_stats(grads))
    self.grad_stats[str(step)] = stats_to_python(stats, histogram=False)

  def record_eval(self, step: int, loss_and_accuracy: tuple[float, float]) -> None:
    self.eval_steps.append(step + 1)
    self.val_loss.append(loss_and_accuracy[0])
    self.val_accuracy.append(loss_and_accuracy[1])


def calibrate_fp8(setup: Setup) -> None:
  """Delayed fp8 scaling: step 0's scales from the first batch's own maxima (docs/fp8.md);
  otherwise they start at 1 and the first steps flush small gradients to zero."""
  params, model_state, fp8_state, opt_state = setup.state
  loss_fn = make_loss_fn(setup)
  calibrated = jax.jit(
    lambda p, ms, fs, b: fp8.calibrate(
      lambda amax: loss_fn(p, amax, ms, fs, b, None), fs, setup.fp8_config, has_aux=True
    ),
    compiler_options=FAST_COMPILE,
  )(params, model_state, fp8_state, setup.task.train_batch(0))
  setup.state = (params, model_state, calibrated, opt_state)


def train(
  task: Task, recipe: Recipe, config: TrainConfig, *, keep_state: bool = False
) -> RunResult:
  """Trains ``task`` under ``recipe`` from ``config.seed`` and measures the run."""
  setup = make_setup(task, recipe, config)
  state_bytes = {
    "params": tree_bytes(setup.state[0]),
    "opt_state": tree_bytes(setup.state[3]),
    "param_elements": sum(int(np.size(p)) for p in jax.tree.leaves(setup.state[0])),
  }
  if setup.fp8_stateful:
    calibrate_fp8(setup)
  run, history = Run(setup), History()
  last = config.steps - 1
  bar = progress(range(config.steps), config.progress, desc=f"{task.name}/{recipe.name}")
  for step in bar:
    metrics, loss, seconds = run.step()
    history.record(step, metrics, loss, seconds)
    if step % config.stats_every == 0 or step == last:
      history.record_stats(step, metrics["grads"])
    if (step + 1) % config.eval_every == 0 or step in (0, last):
      history.record_eval(step, run.evaluate())
    if hasattr(bar, "set_postfix"):
      bar.set_postfix(loss=f"{loss:.3f}", scale=f"{history.loss_scale[-1]:g}", refresh=False)
  return make_result(run, history, state_bytes, keep_state)


def make_result(run: Run, h: History, state_bytes: dict[str, int], keep_state: bool) -> RunResult:
  """The :class:`RunResult` of a finished run."""
  recipe, config = run.setup.recipe, run.setup.config
  params, model_state, fp8_state, opt_state = run.state
  # The train loss is the mean over the last 10% of steps (the same batches for every
  # recipe): the whole training set would cost a pass per recipe.
  tail = max(1, config.steps // 10)
  final = {
    "train_loss": float(np.mean(h.train_loss[-tail:])),
    "train_accuracy": float(np.mean(h.train_accuracy[-tail:])),
    "val_loss": h.val_loss[-1],
    "val_accuracy": h.val_accuracy[-1],
  }
  warm = h.times[min(2, len(h.times) - 1) :]  # the first calls include dispatch warm-up
  low_precision = recipe.params_method is not None
  return RunResult(
    recipe=recipe.name,
    policy=recipe.policy,
    loss_scale_kind=recipe.loss_scale,
    steps=config.steps,
    train_loss=h.train_loss,
    loss_scale=h.loss_scale,
    stage_scales=h.stage_scales or None,
    skipped=h.skipped,
    eval_steps=h.eval_steps,
    val_loss=h.val_loss,
    val_accuracy=h.val_accuracy,
    final=final,
    step_time_ms=1e3 * float(np.percentile(warm, 10)),
    step_time_spread={
      "training_loop_p10_ms": 1e3 * float(np.percentile(warm, 10)),
      "training_loop_median_ms": 1e3 * statistics.median(warm),
      "training_loop_p90_ms": 1e3 * float(np.percentile(warm, 90)),
    },
    compile_s=run.compile_s,
    memory=run.memory,
    grad_stats=h.grad_stats,
    fp8_scales=None if fp8_state is None else _fp8_scales(fp8_state),
    state_bytes=state_bytes,
    rounded_away=h.rounded_away if low_precision else None,
    low_precision_size=low_precision_size(params) if low_precision else None,
    state=(_master(params, opt_state, recipe), model_state) if keep_state else None,
    run_more=run.more,
  )


def _master(params: Any, opt_state: Any, recipe: Recipe) -> Any:
  """The fp32 values the optimizer reads (:func:`jmp_lite.master_params`) for 16-bit
  parameters, else the parameters."""
  if recipe.params_method is None:
    return params
  return jax.jit(jl.master_params, compiler_options=FAST_COMPILE)(params, opt_state)


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
  return jax.jit(jax.grad(loss_fn), compiler_options=FAST_COMPILE)(zeros)  # runs once


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
