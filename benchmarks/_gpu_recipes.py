"""benchmarks/gpu.py's recipes: one train step per way of running the transformer LM.

A :class:`Recipe` builds a :class:`Step` (the state's ``init`` and the jitted ``step``) for a
model configuration of ``benchmarks/_models.py``'s ``TransformerLM``; :data:`RECIPES` is issue
14's table, in its order: fp32 (``highest`` and default precision), Flax layers with
``dtype=bfloat16``, ``jmp_lite.flax.policy_apply`` in bf16 and fp16 (with and without loss
scaling), Flax's ``DynamicScale``, diagnostics (no accumulation preset, a ``lax.cond`` skip),
fp8 (``linen_fp8`` over the bf16 policy: delayed scaling, and each stateless recipe of
:data:`FP8_RECIPES`), and the same LM in NNX (``benchmarks/_models.py``) with
``dtype=bfloat16`` and under ``jmp_lite.flax.policy_view``. Every recipe trains with AdamW on the
next-token loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import flax.training.dynamic_scale
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

import jmp_lite as jl
import jmp_lite.flax as jlf
from benchmarks._models import TransformerLM, lm_loss, split_lm
from jmp_lite.flax import fp8 as flax_fp8

LEARNING_RATE = 1e-4
INITIAL_LOSS_SCALE = 2.0**15
FP8_HISTORY = 16  # the examples' amax history length
BF16_POLICY = "params=float32,compute=bfloat16,output=float32"
FP16_POLICY = "params=float32,compute=float16,output=float32"
FUSED = jlf.ModuleOverride(
  attributes={"attention_fn": functools.partial(jlf.dot_product_attention, implementation="cudnn")}
)


class Step(NamedTuple):
  """A recipe's train step on one model.

  ``init(params, tokens)`` builds the state (with whatever runs once before training, e.g. fp8
  calibration), traceable, so that ``jax.jit`` runs it and ``jax.eval_shape`` gives the state's
  shapes without computing it; ``step(state, tokens)`` returns the next state and the step's
  loss; it is traced under ``jax.default_matmul_precision(precision)`` when that is set.
  """

  init: Callable[[Any, jax.Array], Any]
  step: Callable[[Any, jax.Array], tuple[Any, jax.Array]]
  precision: str | None = None


class Recipe(NamedTuple):
  label: str
  build: Callable[[dict[str, int]], Step]  # model config -> Step


def fast_compile_options() -> dict[str, Any]:
  """XLA options for programs whose speed does not matter (run once, or a smoke run): the slow
  optimizations and the gemm autotuning would cost more compile time than they save."""
  if jax.default_backend() == "cpu":
    return {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
  return {"xla_gpu_autotune_level": 0}


def compile_with(lowered: Any, options: dict[str, Any] | None) -> Any:
  if options:
    try:
      return lowered.compile(options)
    except Exception:  # an option this jaxlib does not know; a real error comes again below
      pass
  return lowered.compile()


def run_once(fn: Callable, *args: Any) -> Any:
  """``jax.jit(fn)(*args)``, compiled with :func:`fast_compile_options`."""
  return compile_with(jax.jit(fn).lower(*args), fast_compile_options())(*args)


def with_flax_dtype(dtype: Any = None) -> Callable[[dict[str, int]], Callable]:
  """The model as written; with ``dtype``, every layer built with Flax's ``dtype=``."""

  def make(config):
    model = TransformerLM(**config, dtype=dtype)
    return lambda params, tokens: model.apply({"params": params}, tokens)

  return make


def with_policy(spec: str, **options: Any) -> Callable[[dict[str, int]], Callable]:
  """The model as written, run by :func:`jmp_lite.flax.policy_apply` under ``spec`` (and the
  :class:`~jmp_lite.flax.ModulePolicies` ``options``)."""

  def make(config):
    apply = jlf.policy_apply(TransformerLM(**config), jlf.ModulePolicies(spec, **options))
    return lambda params, tokens: apply({"params": params}, tokens)

  return make


def adamw_step(make_apply: Callable, precision: str | None = None) -> Callable[[dict], Step]:
  def build(config):
    apply, tx = make_apply(config), optax.adamw(LEARNING_RATE)
    loss_fn = lambda params, tokens: lm_loss(apply(params, tokens), tokens)

    def step(state, tokens):
      params, opt_state = state
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    return Step(lambda params, tokens: (params, tx.init(params)), step, precision)

  return build


def with_autocast(spec: str) -> Callable[[dict[str, int]], Callable]:
  """The model as written, its ``apply`` run by :func:`jmp_lite.autocast` under ``spec``."""

  def make(config):
    model = TransformerLM(**config)
    return jl.autocast(lambda params, tokens: model.apply({"params": params}, tokens), spec)

  return make


def with_nnx(dtype: Any = None, spec: str | None = None) -> Callable[[dict[str, int]], Callable]:
  """The NNX LM's forward, built with ``dtype=`` or run by :func:`jmp_lite.flax.policy_view`
  under ``spec``; ``params`` is its ``nnx.State``."""

  def make(config):
    graphdef, _ = split_lm(config, dtype)

    def apply(params, tokens):
      model = nnx.merge(graphdef, params)
      return (jlf.policy_view(model, spec) if spec else model)(tokens)

    return apply

  return make


def nnx_params(build_step: Callable[[dict], Step], dtype: Any = None) -> Callable[[dict], Step]:
  """``build_step`` with the NNX LM's own parameters in place of the linen ones it is given."""

  def build(config):
    step = build_step(config)
    _, make_params = split_lm(config, dtype)
    return step._replace(init=lambda params, tokens: step.init(make_params(), tokens))

  return build


def loss_scaled_step(make_apply: Callable) -> Callable[[dict], Step]:
  """``jl.loss_scaling(adamw, jl.DynamicLossScale)`` with ``jl.scaled_value_and_grad``."""

  def build(config):
    apply = make_apply(config)
    tx = jl.loss_scaling(
      optax.adamw(LEARNING_RATE), jl.DynamicLossScale(jnp.float32(INITIAL_LOSS_SCALE))
    )
    loss_fn = lambda params, tokens: lm_loss(apply(params, tokens), tokens)

    def step(state, tokens):
      params, opt_state = state
      loss, grads = jl.scaled_value_and_grad(loss_fn, opt_state)(params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    return Step(lambda params, tokens: (params, tx.init(params)), step)

  return build


def cond_skip_step(make_apply: Callable) -> Callable[[dict], Step]:
  """Loss scaling that skips a non-finite step with a ``lax.cond`` around the update.

  A candidate design (not the library's): the inner update and its application run only on a
  finite step, instead of being computed and then discarded by a select.
  """

  def build(config):
    apply, tx = make_apply(config), optax.adamw(LEARNING_RATE)
    loss_fn = lambda params, tokens: lm_loss(apply(params, tokens), tokens)

    def init(params, tokens):
      return params, tx.init(params), jl.DynamicLossScale(jnp.float32(INITIAL_LOSS_SCALE))

    def step(state, tokens):
      params, opt_state, scale = state
      loss, grads = scale.value_and_grad(loss_fn)(params, tokens)
      grads, finite, scale = scale.unscale_and_adjust(grads, params)

      def apply_update(params, opt_state):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

      params, opt_state = lax.cond(finite, apply_update, lambda p, o: (p, o), params, opt_state)
      return (params, opt_state, scale), loss

    return Step(init, step)

  return build


def flax_dynamic_scale_step(make_apply: Callable) -> Callable[[dict], Step]:
  """Flax's own recipe: ``DynamicScale.value_and_grad``, the update kept only when finite."""

  def build(config):
    apply, tx = make_apply(config), optax.adamw(LEARNING_RATE)
    loss_fn = lambda params, tokens: lm_loss(apply(params, tokens), tokens)

    def init(params, tokens):
      return params, tx.init(params), flax.training.dynamic_scale.DynamicScale()

    def step(state, tokens):
      params, opt_state, scale = state
      scale, finite, loss, grads = scale.value_and_grad(loss_fn)(params, tokens)
      updates, new_opt_state = tx.update(grads, opt_state, params)
      keep = lambda new, old: optax.tree_utils.tree_where(finite, new, old)
      new_params = keep(optax.apply_updates(params, updates), params)
      return (new_params, keep(new_opt_state, opt_state), scale), loss

    return Step(init, step)

  return build


def fp8_step(spec: str, **config_kwargs: Any) -> Callable[[dict], Step]:
  """``linen_fp8`` over ``policy_apply(model, spec)``, calibrated on the batch before step 0
  (docs/fp8.md), the fp8 state updated every step.

  ``config_kwargs`` go to :class:`~jmp_lite.fp8.DelayedScaling`.
  """
  return lambda config: _fp8_build(config, spec, config_kwargs)


def _fp8_build(config: dict, spec: str, config_kwargs: dict) -> Step:
  model = TransformerLM(**config)
  apply, tx = jlf.policy_apply(model, spec), optax.adamw(LEARNING_RATE)
  fp8_config = jl.fp8.DelayedScaling(amax_history_length=FP8_HISTORY, **config_kwargs)

  def loss_fn(params, amax, fp8_state, tokens):
    variables = {
      "params": params,
      flax_fp8.STATE_COLLECTION: fp8_state,
      flax_fp8.AMAX_COLLECTION: amax,
    }
    # Outside the policy's interceptor, as documented; every Dense in fp8, as recorded.
    with flax_fp8.linen_fp8(fp8_config, placement=jl.fp8.ALL_LAYERS):
      return lm_loss(apply(variables, tokens), tokens)

  def calibrated_state(params, tokens):
    # A fresh state (no scales yet), then calibrated.
    with flax_fp8.linen_fp8(fp8_config, placement=jl.fp8.ALL_LAYERS):
      fresh = model.init(jax.random.key(0), tokens)[flax_fp8.STATE_COLLECTION]
    fun = lambda amax: loss_fn(params, amax, fresh, tokens)
    return jl.fp8.calibrate(fun, fresh, fp8_config)

  def init(params, tokens):
    # Compiled: calibrating eagerly dispatches (and compiles) every op of a backward pass.
    return params, jax.jit(calibrated_state)(params, tokens), tx.init(params)

  def step(state, tokens):
    params, fp8_state, opt_state = state
    loss, (grads, amax) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
      params, jl.fp8.zeros_amax(fp8_state), fp8_state, tokens
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    new_fp8_state = jl.fp8.update(fp8_state, amax, fp8_config)
    return (optax.apply_updates(params, updates), new_fp8_state, opt_state), loss

  return Step(init, step)


def fp8_stateless_step(spec: str, recipe: Any) -> Callable[[dict], Step]:
  """``linen_fp8(recipe)`` over ``policy_apply(model, spec)`` for a recipe that keeps no state
  (``CurrentScaling``, ``RowwiseScaling``, ``BlockScaling``, ``Mxfp8Scaling``): no calibration,
  no probes, no ``fp8.update``; the step is the bf16 policy's AdamW step with fp8 matmuls."""

  def build(config):
    model = TransformerLM(**config)
    apply, tx = jlf.policy_apply(model, spec), optax.adamw(LEARNING_RATE)

    def loss_fn(params, tokens):
      # Outside the policy interceptor, as documented; every Dense in fp8, as the fp8 recipe.
      with flax_fp8.linen_fp8(recipe, placement=jl.fp8.ALL_LAYERS):
        return lm_loss(apply({"params": params}, tokens), tokens)

    def step(state, tokens):
      params, opt_state = state
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss

    return Step(lambda params, tokens: (params, tx.init(params)), step)

  return build


# The fp8 recipes of docs/fp8.md, each over the bf16 policy ("fp8" is delayed scaling).
FP8_RECIPES: dict[str, tuple[str, Any]] = {
  "fp8_current": ("fp8 current scaling (the default recipe)", jl.fp8.CurrentScaling()),
  "fp8_rowwise": ("fp8 row-wise scaling", jl.fp8.RowwiseScaling()),
  "fp8_rowwise_gw_hp": (
    "fp8 row-wise, weight gradient in bf16",
    jl.fp8.RowwiseScaling(weight_grad="compute_dtype"),
  ),
  "fp8_block": ("fp8 block scaling (DeepSeek-V3)", jl.fp8.BlockScaling()),
  "fp8_mxfp8": ("MXFP8, emulated (quantize, dequantize, fp32 dot)", jl.fp8.Mxfp8Scaling()),
}

# In the order of the table.
RECIPES: dict[str, Recipe] = {
  "fp32_highest": Recipe("fp32, precision highest", adamw_step(with_flax_dtype(), "highest")),
  "fp32_default": Recipe("fp32, default (TF32 on GPU)", adamw_step(with_flax_dtype())),
  "flax_bf16": Recipe(
    "Flax layers `dtype=bfloat16` (hand-written)", adamw_step(with_flax_dtype(jnp.bfloat16))
  ),
  "policy_bf16": Recipe("`jmp_lite.flax.policy_apply`, bf16", adamw_step(with_policy(BF16_POLICY))),
  "policy_fp16": Recipe("policy fp16, no loss scaling", adamw_step(with_policy(FP16_POLICY))),
  "policy_fp16_scaled": Recipe(
    "policy fp16 + `loss_scaling(DynamicLossScale)`", loss_scaled_step(with_policy(FP16_POLICY))
  ),
  "flax_fp16_dynamic_scale": Recipe(
    "Flax `dtype=float16` + Flax `DynamicScale`",
    flax_dynamic_scale_step(with_flax_dtype(jnp.float16)),
  ),
  "policy_fp16_cond_skip": Recipe(
    "policy fp16 + loss scaling, `lax.cond` skip (candidate)",
    cond_skip_step(with_policy(FP16_POLICY)),
  ),
  "fp8": Recipe(
    "jmp_lite fp8, delayed scaling (`linen_fp8` over the bf16 policy)", fp8_step(BF16_POLICY)
  ),
  "fp8_delayed_calibrated": Recipe(
    'fp8 delayed scaling, `first_step="calibrated"` (no per-step select)',
    fp8_step(BF16_POLICY, first_step="calibrated"),
  ),
  "fp8_fast": Recipe(
    "fp8, fast accumulation forward", fp8_step(BF16_POLICY, fast_accumulation="forward")
  ),
  "policy_bf16_layernorm_stored": Recipe(
    "policy bf16, LayerNorm islands stored (`jlf.FP32`)",
    adamw_step(with_policy(BF16_POLICY, overrides={nn.LayerNorm: jlf.FP32})),
  ),
  "policy_bf16_layernorm_bf16": Recipe(
    "policy bf16, no LayerNorm island (Flax's LayerNorm in bf16)",
    adamw_step(with_policy(BF16_POLICY, overrides={nn.LayerNorm: None})),
  ),
  "policy_bf16_bf16_softmax": Recipe(
    "policy bf16, Flax's bf16 softmax (`fp32_softmax=False`)",
    adamw_step(with_policy(BF16_POLICY, fp32_softmax=False)),
  ),
  "policy_bf16_fused_attention": Recipe(
    'policy bf16, `jlf.dot_product_attention(implementation="cudnn")`',
    adamw_step(with_policy(BF16_POLICY, overrides={nn.MultiHeadDotProductAttention: FUSED})),
  ),
  "autocast_bf16": Recipe(
    "`jl.autocast(model.apply)`, bf16", adamw_step(with_autocast(BF16_POLICY))
  ),
  **{
    name: Recipe(label, fp8_stateless_step(BF16_POLICY, recipe))
    for name, (label, recipe) in FP8_RECIPES.items()
  },
  "nnx_flax_bf16": Recipe(
    "NNX, every layer `dtype=bfloat16`",
    nnx_params(adamw_step(with_nnx(jnp.bfloat16)), jnp.bfloat16),
  ),
  "nnx_policy_bf16": Recipe(
    "NNX, `jmp_lite.flax.policy_view`, bf16",
    nnx_params(adamw_step(with_nnx(spec=BF16_POLICY))),
  ),
}
# Compiled in this order, so that a cut budget keeps the comparisons the targets need.
PRIORITY = (
  "flax_bf16",
  "policy_bf16",
  "fp8",
  "policy_fp16",
  "policy_fp16_scaled",
  "policy_fp16_cond_skip",
  "fp8_fast",
  "fp8_delayed_calibrated",
  *FP8_RECIPES,
  "fp32_highest",
  "fp32_default",
  "flax_fp16_dynamic_scale",
  "nnx_flax_bf16",
  "nnx_policy_bf16",
  "policy_bf16_layernorm_stored",
  "policy_bf16_layernorm_bf16",
  "policy_bf16_bf16_softmax",
  "policy_bf16_fused_attention",
  "autocast_bf16",
)
SIZE_RECIPES = ("policy_bf16", "fp8", "fp8_fast")
SAVED_HLO = ("flax_bf16", "policy_bf16", "fp8")  # with --save-hlo: their optimized HLO, gzipped
REFERENCES = ("fp32_highest", "flax_bf16", "policy_bf16")  # each row's x_<name> ratios
# Loss curves shown side by side.
CURVES = ("fp32_default", "flax_bf16", "policy_bf16", "fp8")


def init_params(config: dict[str, int], tokens: jax.Array) -> Any:
  """The fp32 parameters of the model of ``config`` (key 0), shared by every recipe."""
  model = TransformerLM(**config)
  return run_once(lambda t: model.init(jax.random.key(0), t)["params"], tokens)
