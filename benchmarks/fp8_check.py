"""fp8 against bf16 and fp32, layer by layer, on whatever backend runs it (issue 14, item 3).

On an H200 a decoder LM trained with jmp_lite fp8 (``linen_fp8`` over the bf16 policy) reached
a loss of 0.71 after 37 steps on one fixed batch of random tokens, where bf16, fp16 and fp32
reached 2.5-2.9; on CPU fp8 trails bf16 slightly. :func:`diagnose` runs, on the default backend,
the checks that tell the candidate causes apart, for the model of that run
(``benchmarks.memory.TransformerLM``: pre-LN decoder, Flax ``MultiHeadDotProductAttention`` with
a causal mask, GELU MLP 4x, learned positions) on one fixed batch of random tokens:

* **probes** (no model): ``convert`` to E4M3/E5M2 and :func:`jmp_lite.fp8.quantize` of
  special values (ties, subnormals, beyond the largest value, inf, NaN) against ``ml_dtypes``
  (what XLA:CPU does); and fp8 matmuls of small integers, exact in every path, against float64,
  forward and both gradients, for the layer shapes of the model (Dense, the q/k/v
  ``DenseGeneral`` and the attention output's two-axis contraction), bf16 and fp32 results.
* per recipe (:data:`RECIPES`), one compiled program that trains like the GPU run (AdamW 1e-4,
  fp8 state updated every step) and, from the same parameters, also reports

  - **causality**: the logits at positions ``< t`` after tokens ``>= t`` were replaced (must
    not move), and ``d logits[:, t] / d pos[t']`` for ``t' > t`` (must be 0), both computed in
    a forward-and-backward program, as training compiles it (XLA lays out and fuses a training
    program differently from an inference one);
  - **every intermediate** (``capture_intermediates``: each layer's output, q/k/v, attention
    weights, logits) and every parameter gradient, compared with fp32 (``precision=highest``)
    on the same parameters and batch, as ``||x - x_fp32|| / ||x_fp32||``;

  at step 0 (all recipes from the same parameters and calibrated fp8 state) and after
  ``steps`` steps (every recipe at the parameters the ``fp8`` recipe reached).
* the **loss** of every step per recipe; the **fp8 state** after training (scales non-finite,
  zero or never moved; amax 0);
* the compiled program's **fp8 GEMMs** (custom-call targets, result types, epilogues, whether
  the fast accumulator is allowed) and kernel count;
* on a non-CPU backend, the **same forward on the CPU** (first sequence of the batch) for bf16
  and fp8: where the fp8 path computes different math on the device, its device-vs-CPU
  difference jumps at that layer while bf16's stays small.

Recipes: ``fp32``, ``bf16`` (the policy), ``fp8`` (this version: fp8 operands, an fp32
result scaled and cast, fp32 accumulation), ``fp8_fast`` (the same with
``fast_accumulation="all"``), ``fp8_legacy`` (the code that produced the anomaly: the same form
with ``DEFAULT`` precision, i.e. XLA:GPU's fast fp8 accumulator in all three GEMMs, and the
kernel gradient transposed after its matmul; traced by substituting a copy of that code for
jmp_lite's matmul while the recipe is traced, through the package-internal
``jmp_lite.fp8._matmul.DOT_KERNEL`` scope: this script's only reach into the library's
internals). All fp8 recipes start from the same calibrated fp8 state.

How to read it, per candidate cause (most likely first):

1. **A GPU-only causal leak** (a loss far below bf16's on memorized random tokens is what
   reading the next token gives): ``causal_leak_<recipe>``; ``step0.causal`` and
   ``trained_own_causal`` hold the raw maxima (exactly 0 on a causal, deterministic backend).
2. **An fp8 GEMM that computes something else on the device** (a layout, transpose, batching
   or epilogue error in XLA's fp8 rewrite; the bias or GELU folded into the GEMM): the gemm probe
   is not ``exact``; an intermediate's error against fp32 jumps from a few per cent to O(1) at
   one layer (``step0.intermediates``), or its device-vs-CPU difference does while bf16's stays
   small (``device_vs_cpu``). The layer names say which matmul.
3. **The legacy formulation only** (fp32 GEMM result, scale multiply, cast; fast accumulation
   everywhere): ``fp8_legacy`` shows 1. or 2. and ``fp8``/``fp8_fast`` do not; ``fp8_fast`` against
   ``fp8`` separates the accumulator from the form.
4. **Fast accumulation** (Hopper's fp8 accumulator keeps fewer bits of the sum;
   ``precision=DEFAULT``): ``fp8_fast`` errors above ``fp8``'s, most in weight gradients (sums
   over every token). Makes training worse, not faster.
5. **fp8 conversions on the device** (a saturating or flushing convert, inf becoming the
   largest finite value): ``convert_probe`` mismatches.
6. **Scales** (inf, 0 or NaN; an amax of 0, a tensor never observed): ``fp8_state_calibrated``
   and ``fp8_state_final`` counts.

The attention logits and their ``finfo.min`` mask never pass through an fp8 matmul here (only
Dense/DenseGeneral/Einsum layers are fp8, not the attention einsums), which the fp8 GEMM count
of the gemm probe and of each program reflects.

Default sizes: the GPU table's layer shapes (d=1024, 16 heads, seq 1024, batch 8, vocab 256)
with 2 layers and 20 steps, about a minute on an H200 including compilation; ``budget_s``
skips the later recipes and the CPU comparison once exceeded.

Run: PYTHONPATH=. python benchmarks/fp8_check.py [--d-model 1024 --layers 2 ...] [--json out.json]
     PYTHONPATH=. python benchmarks/fp8_check.py --tiny     (seconds, any backend)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
from jax import lax

import jmp_lite.flax as jlf
from benchmarks.memory import TransformerLM
from jmp_lite import fp8
from jmp_lite.flax import fp8 as flax_fp8
from jmp_lite.fp8._matmul import DOT_KERNEL

RECIPES = ("fp32", "bf16", "fp8", "fp8_legacy", "fp8_fast")
CPU_CHECKED = ("bf16", "fp8", "fp8_legacy")  # recipes whose forward is also run on the CPU
BF16_POLICY = "params=float32,compute=bfloat16,output=float32"
LEARNING_RATE = 1e-4
FP8_HISTORY = 16  # the examples' and benchmarks/gpu.py's amax history length
TINY = {"d_model": 32, "layers": 2, "heads": 2, "seq": 16, "batch": 2, "vocab": 32, "steps": 3}
# Thresholds of the verdicts (relative RMS errors against fp32). fp8 rounding alone gives a few
# per cent on activations (E4M3: eps/2 = 6%, ~2-4% RMS after a matmul) and 5-15% on gradients
# (E5M2: eps/2 = 12.5%); a mis-computed layer is off by O(1).
ACTIVATION_SUSPECT = 0.25
GRADIENT_SUSPECT = 0.5
DEVICE_VS_CPU_SUSPECT = 0.1
FUSION_SUSPECT = 0.1  # the same logits from differently fused programs: rounding-level apart
_E4M3, _E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
_F32 = np.dtype(jnp.float32)

# ---------------------------------------------------------------------------------------------
# The formulation that produced the anomaly (for the fp8_legacy recipe)


def _legacy_cotangent(g, operand, other, dims, operand_is_lhs):
  """The pre-issue-14 cotangent: ``g`` first, an fp32 result, then a transpose."""
  (lc, rc), (lb, rb) = dims
  if not operand_is_lhs:
    lc, rc, lb, rb = rc, lc, rb, lb
  op_free = tuple(i for i in range(operand.ndim) if i not in lc and i not in lb)
  other_free = tuple(i for i in range(other.ndim) if i not in rc and i not in rb)
  nb, nf = len(lb), len(op_free)
  first_other = nb + nf if operand_is_lhs else nb
  g_other = tuple(range(first_other, first_other + len(other_free)))
  order = [*lb, *op_free, *(lc[rc.index(a)] for a in sorted(rc))]
  dims = ((g_other, other_free), (tuple(range(nb)), rb))
  out = lax.dot_general(g, other, dims, preferred_element_type=_F32)
  return lax.transpose(out, tuple(int(i) for i in np.argsort(order)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _legacy_fp8_dot(lhs, rhs, scales, probe, loss_scale, spec):
  return _legacy_fwd(lhs, rhs, scales, probe, loss_scale, spec)[0]


def _legacy_fwd(lhs, rhs, scales, probe, loss_scale, spec):
  del probe
  input_scale, kernel_scale, grad_scale = scales
  lhs_amax, rhs_amax = fp8.compute_amax(lhs), fp8.compute_amax(rhs)
  if spec.current_scaling:
    input_scale = fp8.compute_scale(lhs_amax, input_scale, spec.fwd_dtype, spec.margin)
    kernel_scale = fp8.compute_scale(rhs_amax, kernel_scale, spec.fwd_dtype, spec.margin)
  q_lhs = fp8.quantize(lhs, input_scale, spec.fwd_dtype)
  q_rhs = fp8.quantize(rhs, kernel_scale, spec.fwd_dtype)
  out = lax.dot_general(q_lhs, q_rhs, spec.dims, preferred_element_type=_F32)
  out = (out * (input_scale * kernel_scale)).astype(spec.out_dtype)
  residuals = (
    q_lhs,
    q_rhs,
    (input_scale, kernel_scale, grad_scale),
    loss_scale,
    lhs_amax,
    rhs_amax,
  )
  return out, residuals


def _legacy_bwd(spec, residuals, g):
  q_lhs, q_rhs, (input_scale, kernel_scale, grad_scale), loss_scale, lhs_amax, rhs_amax = residuals
  grad_amax = fp8.compute_amax(g) / loss_scale
  if spec.current_scaling:
    grad_scale = fp8.compute_scale(grad_amax, grad_scale, spec.bwd_dtype, spec.margin)
  scale = grad_scale * loss_scale
  q_g = fp8.quantize(g, scale, spec.bwd_dtype)
  d_lhs = _legacy_cotangent(q_g, q_lhs, q_rhs, spec.dims, True) * (scale * kernel_scale)
  d_rhs = _legacy_cotangent(q_g, q_rhs, q_lhs, spec.dims, False) * (scale * input_scale)
  observed = fp8.Fp8DotAmax(lhs_amax, rhs_amax, grad_amax)
  return d_lhs.astype(spec.lhs_dtype), d_rhs.astype(spec.rhs_dtype), None, observed, None


_legacy_fp8_dot.defvjp(_legacy_fwd, _legacy_bwd)


@contextlib.contextmanager
def legacy_fp8_dots() -> Iterator[None]:
  """fp8 matmuls traced inside use the legacy formulation (read while tracing)."""
  with DOT_KERNEL.scope(_legacy_fp8_dot):
    yield


# ---------------------------------------------------------------------------------------------
# Recipes


class Recipe(NamedTuple):
  name: str
  policy: str | None  # None: the model as written (fp32)
  fp8_config: fp8.Fp8Config | None
  legacy: bool = False


def make_recipe(name: str) -> Recipe:
  if name == "fp32":
    return Recipe(name, None, None)
  if name == "bf16":
    return Recipe(name, BF16_POLICY, None)
  if name in ("fp8", "fp8_legacy"):
    return Recipe(name, BF16_POLICY, fp8.Fp8Config(amax_history_length=FP8_HISTORY), name != "fp8")
  if name == "fp8_fast":
    config = fp8.Fp8Config(amax_history_length=FP8_HISTORY, fast_accumulation="all")
    return Recipe(name, BF16_POLICY, config)
  raise ValueError(f"Unknown recipe {name!r}; choose from {', '.join(RECIPES)}.")


def _sow_attention_weights(next_fun, args, kwargs, context):
  if isinstance(context.module, nn.MultiHeadDotProductAttention) and (
    context.method_name == "__call__"
  ):
    kwargs = {**kwargs, "sow_weights": True}
  return next_fun(*args, **kwargs)


def _short(path: tuple[str, ...]) -> str:
  names = [p for p in path if p != "__call__"] or ["logits"]
  return "/".join(n.replace("MultiHeadDotProductAttention_0", "attn") for n in names)


def _flatten_intermediates(tree: Any) -> dict[str, jax.Array]:
  """{path: the module's last recorded output, fp32}, in forward order.

  A layer that runs in fp8 records its output twice (the fp8 copy and the layer itself);
  the last record is the layer's own, as in the other recipes.
  """
  out = {}

  def walk(node, path):
    for key, value in node.items():
      if isinstance(value, dict):
        walk(value, (*path, key))
      else:
        out[_short((*path, key))] = value[-1].astype(jnp.float32)

  walk(tree, ())
  return out


class Forward:
  """``recipe``'s forward pass: logits and (optionally) every intermediate, fp32."""

  def __init__(self, model: nn.Module, recipe: Recipe):
    self.recipe = recipe
    self.apply = model.apply if recipe.policy is None else jlf.policy_apply(model, recipe.policy)
    self.order: list[str] = []  # intermediate names in forward order (recorded when traced)

  @contextlib.contextmanager
  def scope(self, capture: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
      if self.recipe.policy is None:  # the fp32 reference: no TF32 on a GPU
        stack.enter_context(jax.default_matmul_precision("highest"))
      if self.recipe.legacy:
        stack.enter_context(legacy_fp8_dots())
      if self.recipe.fp8_config is not None:
        # Every Dense in fp8: the checks are layer by layer.
        stack.enter_context(flax_fp8.linen_fp8(self.recipe.fp8_config, placement=fp8.ALL_LAYERS))
      if capture:
        stack.enter_context(nn.intercept_methods(_sow_attention_weights))
      yield

  def __call__(self, params, fp8_state, amax, tokens, capture=False):
    variables: dict[str, Any] = {"params": params}
    if self.recipe.fp8_config is not None:
      variables[flax_fp8.STATE_COLLECTION] = fp8_state
      if amax is not None:
        variables[flax_fp8.AMAX_COLLECTION] = amax
    with self.scope(capture):
      if not capture:
        return self.apply(variables, tokens), {}
      logits, state = self.apply(
        variables, tokens, capture_intermediates=True, mutable=["intermediates"]
      )
    inter = _flatten_intermediates(state["intermediates"])
    self.order = list(inter)
    return logits, inter


def lm_loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def make_program(forward: Forward, tx: optax.GradientTransformation, t: int) -> Callable:
  """One training step of the recipe plus what it computes from the step's parameters.

  Returns ``(params, fp8_state, opt_state), report``. The step is the GPU run's, with no
  intermediates captured (extra users of a layer's output change what XLA fuses, e.g. a bias
  or GELU into an fp8 GEMM's epilogue); ``report`` holds its loss and parameter gradients.
  Every intermediate comes from a forward pass that captures them. Causality is measured by
  two forward-and-backward passes of the same structure (the batch, and the batch with the
  tokens from ``t`` on replaced; cotangent at position ``t``), so that XLA compiles both
  alike and a causal model gives bit-identical logits before ``t``. ``step_moved`` and
  ``capture_moved`` compare the step's logits with those of the check pass and of the
  capturing pass: the same math, differently fused (rounding-level differences expected).
  """
  config = forward.recipe.fp8_config

  def program(params, fp8_state, opt_state, tokens, perturbed, direction):
    def loss_fn(params, amax):
      logits, _ = forward(params, fp8_state, amax, tokens)
      return lm_loss(logits, tokens), logits

    probes = None if config is None else fp8.zeros_amax(fp8_state)
    (loss, logits), (grads, amax) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
      params, probes
    )
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    new_fp8_state = None if config is None else fp8.update(fp8_state, amax, config)

    _, inter = forward(params, fp8_state, None, tokens, capture=True)

    def check_pass(batch):
      """Logits, and the gradient of <logits[:, t], direction> with respect to the positions."""
      out, vjp = jax.vjp(lambda pos: forward({**params, "pos": pos}, fp8_state, None, batch)[0],
                         params["pos"])  # fmt: skip
      (d_pos,) = vjp(jnp.zeros_like(out).at[:, t].set(direction))
      return out.astype(jnp.float32), d_pos.astype(jnp.float32)

    base, d_base = check_pass(tokens)
    moved, d_moved = check_pass(perturbed)
    logits = logits.astype(jnp.float32)
    report = {
      "loss": loss,
      "intermediates": inter,
      "grads": grads,
      "causal": {
        "past_logits_moved": jnp.max(jnp.abs(moved[:, :t] - base[:, :t])),
        "past_logits_max": jnp.max(jnp.abs(base[:, :t])),
        "future_logits_moved": jnp.max(jnp.abs(moved[:, t:] - base[:, t:])),
        "future_grad_max": jnp.maximum(
          jnp.max(jnp.abs(d_base[t + 1 :])), jnp.max(jnp.abs(d_moved[t + 1 :]))
        ),
        "past_grad_max": jnp.max(jnp.abs(d_base[: t + 1])),
        "step_moved": jnp.max(jnp.abs(base - logits)),
        "capture_moved": jnp.max(jnp.abs(inter["logits"] - logits)),
      },
    }
    return (new_params, new_fp8_state, new_opt_state), report

  return program


@jax.jit
def _norms(tree: Any, reference: Any) -> Any:
  """``(||x - ref||, ||ref||)`` per leaf, in fp32."""

  def norms(x, ref):
    x, ref = x.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(jnp.square(x - ref))), jnp.sqrt(jnp.sum(jnp.square(ref)))

  return jax.tree.map(norms, tree, reference)


def relative_errors(tree: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
  """``||x - ref|| / ||ref||`` per entry (NaN where x is not finite; 0 where both are 0)."""
  out = {}
  for name, (diff, norm) in jax.device_get(_norms(tree, reference)).items():
    out[name] = float(diff / norm) if norm > 0 else float(diff)
  return out


def gradient_errors(grads: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
  """``||g - ref|| / max(||ref||, ||REF|| sqrt(n / N))`` per leaf of n of the N parameters.

  A leaf whose true gradient is far below its share of the whole gradient's norm ``||REF||``
  (e.g. attention's key bias, whose gradient is 0: softmax ignores a shift shared by all keys)
  is measured against that share, not against its own near-zero norm.
  """
  norms = jax.device_get(_norms(grads, reference))
  sizes = {name: np.size(leaf) for name, leaf in reference.items()}
  total = math.sqrt(sum(float(norm) ** 2 for _, norm in norms.values()))
  count = sum(sizes.values())
  out = {}
  for name, (diff, norm) in norms.items():
    floor = total * math.sqrt(sizes[name] / count)
    out[name] = float(diff / max(norm, floor)) if max(norm, floor) > 0 else float(diff)
  return out


# ---------------------------------------------------------------------------------------------
# Probes


def _bits_equal(got: np.ndarray, want: np.ndarray) -> np.ndarray:
  got, want = np.asarray(got), np.asarray(want)
  same = got.view(np.uint8) == want.view(np.uint8)
  nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
  return same | nan


def convert_probe_values(dtype: np.dtype) -> np.ndarray:
  """float32 values where conversions can differ: ties, subnormals, overflow, inf, NaN."""
  grid = np.unique(np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64))
  grid = grid[np.isfinite(grid)]
  positive = grid[grid > 0]
  fmax = float(positive.max())
  ties = (positive[:-1] + positive[1:]) / 2  # round-half-to-even decides
  beyond = [fmax * f for f in (1.01, 1.0625, 1.07, 1.125, 1.5, 2.0, 1e3)]
  tiny = [float(positive.min()) * f for f in (0.25, 0.5, 0.75)] + [1e-30, 0.0]
  values = np.concatenate([positive, ties, beyond, tiny, [np.inf, np.nan]])
  return np.concatenate([values, -values]).astype(np.float32)


def convert_probe() -> dict[str, Any]:
  """``astype`` and :func:`jmp_lite.fp8.quantize` (scale 1) of special values vs ml_dtypes.

  ml_dtypes is what XLA:CPU implements: round to nearest even; beyond the largest value,
  E4M3FN gives NaN (it has no inf) and E5M2 inf. ``quantize`` clips finite values first and
  keeps inf/NaN non-finite, so a backend whose convert saturates (e.g. a ``satfinite``
  conversion instruction) shows up here, and in ``quantize`` only for inf (an overflow that
  loss scaling would then not see).
  """
  out = {}
  for dtype in (_E4M3, _E5M2):
    values = convert_probe_values(dtype)
    fmax = float(ml_dtypes.finfo(dtype).max)
    want_convert = values.astype(dtype)
    clipped = np.where(np.isfinite(values), np.clip(values, -fmax, fmax), values)
    want_quantize = clipped.astype(np.float32).astype(dtype)
    got_convert = np.asarray(jax.jit(lambda v, d=dtype: v.astype(d))(values))
    got_quantize = np.asarray(jax.jit(lambda v, d=dtype: fp8.quantize(v, 1.0, d))(values))
    entry = {}
    for what, got, want in (
      ("convert", got_convert, want_convert),
      ("quantize", got_quantize, want_quantize),
    ):
      bad = np.flatnonzero(~_bits_equal(got, want))
      entry[what] = {
        "values": int(values.size),
        "mismatches": int(bad.size),
        "examples": [
          [float(values[i]), float(got[i].astype(np.float32)), float(want[i].astype(np.float32))]
          for i in bad[:8]
        ],
      }
    out[dtype.name] = entry
  return out


def gemm_probe_cases(d: int, heads: int, rows: int) -> dict[str, tuple]:
  """(lhs shape, rhs shape, dimension numbers) of the model's fp8 matmuls, at small sizes."""
  head_dim = d // heads
  return {
    "dense": ((2, rows, d), (d, 4 * d), (((2,), (0,)), ((), ()))),
    "qkv": ((2, rows, d), (d, heads, head_dim), (((2,), (0,)), ((), ()))),
    "attn_out": ((2, rows, heads, head_dim), (heads, head_dim, d), (((2, 3), (0, 1)), ((), ()))),
  }


def gemm_probe(recipes: list[Recipe], d: int, heads: int, rows: int) -> dict[str, Any]:
  """fp8 matmuls of values in {-1, 0, 1}, forward and both gradients, against the exact result
  rounded once to the result dtype.

  fp8 holds the values exactly and every product and partial sum is a small integer, so each
  path (bf16 or fp32 results, fast or fp32 accumulation) must give the exact result rounded
  once; a layout, transpose or batching error in a backend's fp8 GEMM path shows as a mismatch.
  """
  rng = np.random.default_rng(5)
  cases = gemm_probe_cases(d, heads, rows)
  data, exact = {}, {}
  for name, (lhs_shape, rhs_shape, ((lc, rc), _)) in cases.items():
    # einsum subscripts: contracted axes share letters; the output is lhs free + rhs free.
    lhs = [chr(ord("a") + i) for i in range(len(lhs_shape))]
    rhs = [chr(ord("n") + i) for i in range(len(rhs_shape))]
    for i, j in zip(lc, rc, strict=True):
      rhs[j] = lhs[i]
    out = [c for c in lhs if c not in rhs] + [c for c in rhs if c not in lhs]
    lhs, rhs, out = "".join(lhs), "".join(rhs), "".join(out)
    x = rng.integers(-1, 2, lhs_shape).astype(np.float64)
    k = rng.integers(-1, 2, rhs_shape).astype(np.float64)
    sizes = dict(zip(lhs + rhs, lhs_shape + rhs_shape, strict=True))
    g = rng.integers(-1, 2, [sizes[c] for c in out]).astype(np.float64)
    data[name] = (x, k, g)
    exact[name] = [
      np.einsum(f"{lhs},{rhs}->{out}", x, k),
      np.einsum(f"{out},{rhs}->{lhs}", g, k),
      np.einsum(f"{lhs},{out}->{rhs}", x, g),
    ]
  out: dict[str, Any] = {}
  # Powers of two (bf16-exact as they are): x / 2^-3 and g / 2^-2 are still exact in fp8, and a
  # scale dropped or inverted in the GEMM would be off by a factor of 8 or more. An argument,
  # not a constant, so that XLA cannot fold the scales away.
  scales = (2.0**-3, 2.0**-3, 2.0**-2)
  state = fp8.Fp8DotState(
    *(fp8.Fp8ScaleState(np.float32(s), np.zeros(2, np.float32)) for s in scales)
  )
  for recipe in recipes:
    for dtype in (np.dtype(jnp.bfloat16), np.dtype(jnp.float32)):

      def run_all(arrays, state, config=recipe.fp8_config):
        results = {}
        for name, (x, k, g) in arrays.items():
          dims = cases[name][2]
          y, vjp = jax.vjp(
            lambda lhs, rhs, d=dims: fp8.dot_general(lhs, rhs, d, state, config=config), x, k
          )
          results[name] = (y, *vjp(g))
        return results

      as_dtype = lambda a, dtype=dtype: np.asarray(a).astype(dtype)  # no eager jax ops
      arrays = {n: tuple(jnp.asarray(as_dtype(a)) for a in data[n]) for n in cases}
      # Small programs run once: fast compilation (the HLO passes, fp8 rewrite included, run).
      with legacy_fp8_dots() if recipe.legacy else contextlib.nullcontext():
        compiled = jax.jit(run_all, compiler_options=_compile_options())
        compiled = compiled.lower(arrays, state).compile()
      got = compiled(arrays, state)
      errors = {}
      for name in cases:
        want = [as_dtype(v).astype(np.float64) for v in exact[name]]  # rounded once
        errors[name] = {
          what: float(np.max(np.abs(np.asarray(a, np.float64) - b)))
          for what, a, b in zip(("y", "dx", "dk"), got[name], want, strict=True)
        }
      out[f"{recipe.name}/{np.dtype(dtype).name}"] = {
        "max_abs_error": errors,
        "exact": all(e == 0 for r in errors.values() for e in r.values()),
        "hlo": hlo_summary(compiled.as_text()),
      }
  return out


# ---------------------------------------------------------------------------------------------
# Compiled programs and fp8 state


def hlo_summary(text: str) -> dict[str, Any]:
  """Custom calls, fp8 GEMMs (result type, epilogue, precision) and kernels of optimized HLO."""
  targets = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
  gemms = [
    line
    for line in text.splitlines()
    if (m := re.search(r'custom_call_target="([^"]+)"', line))
    and "f8" in m.group(1)
    and ("matmul" in m.group(1) or "gemm" in m.group(1))
  ]
  result_types = collections.Counter(
    m.group(1) for line in gemms if (m := re.search(r"= \(?(\w+)\[", line))
  )
  epilogues = collections.Counter(
    m.group(1) for line in gemms if (m := re.search(r'"epilogue":"(\w+)"', line))
  )
  precisions = collections.Counter(
    m.group(1).replace('"', "")
    for line in gemms
    if (m := re.search(r'"operand_precision":\[([^\]]*)\]', line))
  )
  return {
    "custom_calls": dict(targets),
    "fp8_gemms": len(gemms),
    "fp8_gemm_result_types": dict(result_types),
    "fp8_gemm_epilogues": dict(epilogues),
    "fp8_gemm_precisions": dict(precisions),  # DEFAULT: fast fp8 accumulation on Hopper
    "fusions": len(re.findall(r" fusion\(", text)),
    "dots": len(re.findall(r" dot\(", text)),
  }


def fp8_state_health(state: Any) -> dict[str, Any]:
  """Counts over every fp8 matmul's scales and latest amaxes, and the extreme scales."""
  nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, fp8.Fp8DotState))
  out: dict[str, Any] = {"matmuls": len(nodes)}
  for field in fp8.Fp8DotState._fields:
    scales = np.array([float(getattr(n, field).scale) for n in nodes], np.float64)
    latest = np.array([float(getattr(n, field).amax_history[0]) for n in nodes], np.float64)
    finite = scales[np.isfinite(scales)]
    out[field] = {
      "nonfinite_scales": int(np.sum(~np.isfinite(scales))),
      "zero_scales": int(np.sum(scales == 0)),
      "unit_scales": int(np.sum(scales == 1)),  # never set (fresh state) or coincidence
      "zero_latest_amax": int(np.sum(latest == 0)),
      "nonfinite_latest_amax": int(np.sum(~np.isfinite(latest))),
      "min_scale": float(finite.min()) if finite.size else math.nan,
      "max_scale": float(finite.max()) if finite.size else math.nan,
    }
  return out


def _compile_options() -> dict[str, Any]:
  """Fast compilation for programs that run once (init, calibration)."""
  options: dict[str, Any] = {"xla_backend_optimization_level": 0}
  if jax.default_backend() == "gpu":
    options["xla_gpu_autotune_level"] = 0
  return options


# ---------------------------------------------------------------------------------------------
# The diagnosis


class _Clock:
  def __init__(self, budget_s: float):
    self.start, self.budget_s = time.perf_counter(), budget_s
    self.skipped: list[str] = []

  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  def allows(self, what: str) -> bool:
    if self.elapsed() < self.budget_s:
      return True
    self.skipped.append(what)
    return False


def _floats(tree: Any) -> Any:
  return jax.tree.map(float, jax.device_get(tree))


def _ordered(errors: dict[str, float], order: list[str]) -> dict[str, float]:
  return {name: errors[name] for name in order if name in errors}


def _first_suspect(errors: dict[str, float], threshold: float) -> str | None:
  for name, value in errors.items():
    if not value <= threshold:  # NaN counts
      return name
  return None


def _grad_names(grads: Any) -> dict[str, Any]:
  flat = jax.tree_util.tree_flatten_with_path(grads)[0]
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf for path, leaf in flat}


def diagnose(
  d_model: int = 1024,
  layers: int = 2,
  heads: int = 16,
  seq: int = 1024,
  batch: int = 8,
  vocab: int = 256,
  steps: int = 20,
  seed: int = 0,
  recipes: tuple[str, ...] = RECIPES,
  budget_s: float = 60.0,
  cpu_check: bool | None = None,
) -> dict[str, Any]:
  """Runs the checks in the module docstring on the default backend.

  Args:
    d_model, layers, heads, seq, batch, vocab: the model and the fixed batch.
    steps: training steps per recipe (AdamW, learning rate 1e-4).
    seed: parameters and tokens.
    recipes: names from :data:`RECIPES`; ``fp32`` (the reference) is always run first.
    budget_s: the recipes after fp32 and the CPU comparisons are skipped once this many
      seconds have passed (a compilation already started runs to its end).
    cpu_check: run the forward pass on the CPU as well and compare (default: when the
      default backend is not the CPU).

  Returns:
    A JSON-ready dict: ``summary`` (markdown), ``verdict`` and other scalars at the top level,
    and the details per part.
  """
  clock = _Clock(budget_s)
  backend = jax.default_backend()
  if cpu_check is None:
    cpu_check = backend != "cpu"
  names = ["fp32", *(r for r in recipes if r != "fp32")]
  recipe_list = [make_recipe(r) for r in names]
  result: dict[str, Any] = {
    "backend": backend,
    "device": str(jax.devices()[0].device_kind),
    "jax": jax.__version__,
    "config": {
      "d_model": d_model, "layers": layers, "heads": heads, "seq": seq, "batch": batch,
      "vocab": vocab, "steps": steps, "seed": seed, "recipes": names,
    },
  }  # fmt: skip

  # Probes ------------------------------------------------------------------------------------
  result["convert_probe"] = convert_probe()
  probe_recipes = [r for r in recipe_list if r.fp8_config is not None]
  rows = min(seq, 128)
  result["gemm_probe"] = gemm_probe(probe_recipes, min(d_model, 256), min(heads, 4), rows)

  # Model, batch, fp8 state ---------------------------------------------------------------------
  model = TransformerLM(vocab=vocab, width=d_model, heads=heads, layers=layers, length=seq)
  # NumPy, not jax.random or jnp ops: each eager op is a compilation of its own.
  rng = np.random.default_rng(seed)
  tokens_np = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
  t = seq // 2  # tokens from t on are replaced; the logits before t must not move
  perturbed_np = tokens_np.copy()
  perturbed_np[:, t:] = (tokens_np[:, t:] + rng.integers(1, vocab, (batch, seq - t))) % vocab
  tokens, perturbed = jnp.asarray(tokens_np), jnp.asarray(perturbed_np)
  # At most half the largest loss gradient a logit can get, 1 / (batch (seq - 1)), which the
  # output-gradient scales of the fp8 head were calibrated for: a larger cotangent would
  # saturate E5M2.
  direction = rng.standard_normal(vocab)
  direction *= 0.5 / (np.abs(direction).max() * batch * (seq - 1))
  direction = jnp.asarray(direction.astype(np.float32))
  one_off = _compile_options()
  init = lambda tokens: model.init(jax.random.key(seed), tokens)["params"]
  params = jax.jit(init, compiler_options=one_off)(tokens)
  fp8_state = None
  if probe_recipes:  # one calibrated state for every fp8 recipe: the same scales at step 0
    config = make_recipe("fp8").fp8_config

    def calibrated(params, tokens):
      with flax_fp8.linen_fp8(config, placement=fp8.ALL_LAYERS):
        fresh = model.init(jax.random.key(seed), tokens)[flax_fp8.STATE_COLLECTION]
      fwd = Forward(model, make_recipe("fp8"))
      loss = lambda amax: lm_loss(fwd(params, fresh, amax, tokens)[0], tokens)
      return fp8.calibrate(loss, fresh, config)

    fp8_state = jax.jit(calibrated, compiler_options=one_off)(params, tokens)
    result["fp8_state_calibrated"] = fp8_state_health(fp8_state)

  # One program per recipe: step 0 -------------------------------------------------------------
  tx = optax.adamw(LEARNING_RATE)
  opt_state = tx.init(params)
  programs, forwards, reports0, compile_s, hlo = {}, {}, {}, {}, {}
  device_vs_cpu: dict[str, Any] = {}
  cpu = _cpu_device() if cpu_check else None
  for recipe in recipe_list:
    if recipe.name != "fp32" and not clock.allows(f"recipe {recipe.name}"):
      continue
    forward = Forward(model, recipe)
    state = fp8_state if recipe.fp8_config is not None else None
    args = (params, state, opt_state, tokens, perturbed, direction)
    start = time.perf_counter()
    # On a CPU (tests, development) compile fast; elsewhere as training would.
    options = one_off if backend == "cpu" else None
    with legacy_fp8_dots() if recipe.legacy else contextlib.nullcontext():
      compiled = jax.jit(make_program(forward, tx, t), compiler_options=options)
      compiled = compiled.lower(*args).compile()
    compile_s[recipe.name] = time.perf_counter() - start
    hlo[recipe.name] = hlo_summary(compiled.as_text())
    programs[recipe.name], forwards[recipe.name] = compiled, forward
    reports0[recipe.name] = compiled(*args)[1]
    if cpu is not None and recipe.name in CPU_CHECKED and clock.allows(f"CPU {recipe.name}"):
      inter = reports0[recipe.name]["intermediates"]
      device_vs_cpu[recipe.name] = _device_vs_cpu(
        cpu, forward, params, state, tokens_np[:1], inter, forwards["fp32"].order
      )
  result["compile_s"] = compile_s
  result["hlo"] = hlo
  if cpu_check:
    result["device_vs_cpu"] = device_vs_cpu if cpu is not None else {"error": "no CPU backend"}
  order = forwards["fp32"].order
  result["step0"] = _compare(reports0, order)
  del reports0  # gigabytes of intermediates at the default sizes

  # Training ----------------------------------------------------------------------------------
  losses, final = {}, {}
  for name, compiled in programs.items():
    recipe = make_recipe(name)
    state = (params, fp8_state if recipe.fp8_config is not None else None, opt_state)
    curve = []
    for _ in range(steps):
      state, report = compiled(*state, tokens, perturbed, direction)
      curve.append(report["loss"])
    losses[name] = [float(v) for v in jax.device_get(curve)]
    final[name] = state
  result["losses"] = losses
  for name, state in final.items():
    if state[1] is not None:
      result.setdefault("fp8_state_final", {})[name] = fp8_state_health(state[1])

  # Every recipe at the fp8-trained parameters ------------------------------------------------
  # (Compiled already: a few more runs of each program, no budget check needed.)
  anchor = "fp8" if "fp8" in final else next(iter(final))
  trained_params, reports = final[anchor][0], {}
  for name, compiled in programs.items():
    state = final[name][1]
    reports[name] = compiled(trained_params, state, opt_state, tokens, perturbed, direction)[1]
  result["trained"] = {"params_from": anchor, **_compare(reports, order)}
  del reports
  # Causality of each recipe at its own trained parameters and fp8 state.
  result["trained_own_causal"] = {
    name: _floats(compiled(*final[name][:2], opt_state, tokens, perturbed, direction)[1]["causal"])
    for name, compiled in programs.items()
  }

  result["skipped"] = clock.skipped
  result["seconds"] = clock.elapsed()
  result.update(_verdicts(result))
  result["summary"] = markdown(result)
  return result


def _compare(reports: dict[str, Any], order: list[str]) -> dict[str, Any]:
  """Losses, causality, and per-intermediate / per-gradient errors against fp32."""
  ref = reports["fp32"]
  out: dict[str, Any] = {"loss": {}, "causal": {}, "intermediates": {}, "grads": {}}
  for name, report in reports.items():
    out["loss"][name] = float(report["loss"])
    out["causal"][name] = _floats(report["causal"])
    if name == "fp32":
      continue
    inter = relative_errors(report["intermediates"], ref["intermediates"])
    out["intermediates"][name] = _ordered(inter, order)
    grads = gradient_errors(_grad_names(report["grads"]), _grad_names(ref["grads"]))
    out["grads"][name] = grads
  return out


def _cpu_device() -> jax.Device | None:
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:  # JAX started without its CPU backend
    return None


def _device_vs_cpu(cpu, forward, params, fp8_state, tokens, on_device, order):
  """The intermediates of the first sequence, from this backend's training program at step 0
  and from a forward pass on the CPU: relative difference per intermediate."""
  args = jax.device_put((params, fp8_state, tokens), cpu)
  fn = jax.jit(
    lambda p, s, x: forward(p, s, None, x, capture=True)[1],
    compiler_options={"xla_backend_optimization_level": 0},  # runs once
  )
  with legacy_fp8_dots() if forward.recipe.legacy else contextlib.nullcontext():
    on_cpu = jax.device_get(fn(*args))
  first = {name: np.asarray(x)[:1] for name, x in jax.device_get(on_device).items()}
  return _ordered(relative_errors(first, on_cpu), order)


def _verdicts(result: dict[str, Any]) -> dict[str, Any]:
  """Top-level scalars and the verdict lines (heuristics; the thresholds are above)."""
  lines, scalars = [], {}

  def causality(section: dict[str, Any], when: str) -> None:
    for name, causal in section.items():
      moved = causal["past_logits_moved"] / max(causal["past_logits_max"], 1e-30)
      grad = causal["future_grad_max"] / max(causal["past_grad_max"], 1e-30)
      leak = not (moved <= 1e-3 and grad <= 1e-3)
      scalars[f"causal_leak_{name}"] = leak or scalars.get(f"causal_leak_{name}", False)
      if leak:
        lines.append(
          f"CAUSAL LEAK in {name} ({when}): past logits moved by {moved:.3g} (relative), "
          f"future position gradients {grad:.3g} of the past ones."
        )
      elif moved > 0 or grad > 0:
        lines.append(f"{name} ({when}): causal, with noise (logits {moved:.2g}, grads {grad:.2g}).")
      scale = max(causal["past_logits_max"], 1e-30)
      for key, what in (("step_moved", "check pass"), ("capture_moved", "capturing pass")):
        if not causal[key] / scale <= FUSION_SUSPECT:
          lines.append(
            f"{name} ({when}): the training step's logits and the {what}'s (same math, fused "
            f"differently) differ by {causal[key] / scale:.3g} of the largest logit."
          )

  def errors_against_fp32(section: dict[str, Any], when: str) -> None:
    for name, errors in section["intermediates"].items():
      first = _first_suspect(errors, ACTIVATION_SUSPECT)
      worst = max(errors.values(), default=0.0)
      if when == "step 0":
        scalars[f"max_activation_error_{name}"] = worst
      if first is not None:
        lines.append(
          f"{name} ({when}): first intermediate off from fp32 by more than "
          f"{ACTIVATION_SUSPECT}: {first} ({errors[first]:.3g}); largest {worst:.3g}."
        )
    for name, errors in section["grads"].items():
      worst_name = max(errors, key=lambda k: errors[k] if math.isfinite(errors[k]) else math.inf)
      if when == "step 0":
        scalars[f"max_grad_error_{name}"] = errors[worst_name]
      if not errors[worst_name] <= GRADIENT_SUSPECT:
        lines.append(
          f"{name} ({when}): gradient of {worst_name} off from fp32 by "
          f"{errors[worst_name]:.3g} (> {GRADIENT_SUSPECT})."
        )

  causality(result["step0"]["causal"], "step 0")
  errors_against_fp32(result["step0"], "step 0")
  if "trained" in result:
    causality(result["trained_own_causal"], "trained")
    errors_against_fp32(result["trained"], f"at the {result['trained']['params_from']} weights")
  for name, curve in result.get("losses", {}).items():
    if curve:
      scalars[f"loss_{name}"] = curve[-1]
  if "loss_bf16" in scalars:
    for name in ("fp8", "fp8_legacy", "fp8_fast"):
      if f"loss_{name}" in scalars and scalars[f"loss_{name}"] < 0.8 * scalars["loss_bf16"]:
        lines.append(
          f"{name} trains faster than bf16 (loss {scalars[f'loss_{name}']:.3g} vs "
          f"{scalars['loss_bf16']:.3g}): the anomaly reproduces."
        )
  mismatches = sum(
    entry[what]["mismatches"] for entry in result["convert_probe"].values() for what in entry
  )
  scalars["convert_mismatches"] = mismatches
  if mismatches:
    lines.append(f"fp8 conversions differ from ml_dtypes (XLA:CPU) in {mismatches} cases.")
  inexact = [name for name, entry in result["gemm_probe"].items() if not entry["exact"]]
  scalars["gemm_probe_inexact"] = len(inexact)
  if inexact:
    lines.append(f"fp8 matmuls of small integers are not exact in: {', '.join(inexact)}.")
  for name, health in result.get("fp8_state_final", {}).items():
    bad = {
      f"{field}.{key}": n
      for field in fp8.Fp8DotState._fields
      for key, n in health[field].items()
      if key in ("nonfinite_scales", "zero_scales", "zero_latest_amax", "nonfinite_latest_amax")
      and n
    }
    if bad:
      lines.append(f"{name} fp8 state after training: {bad}.")
  for name, errors in result.get("device_vs_cpu", {}).items():
    if name == "error" or not isinstance(errors, dict):
      continue
    first = _first_suspect(errors, DEVICE_VS_CPU_SUSPECT)
    if first is not None:
      lines.append(
        f"{name}: this backend and the CPU differ by {errors[first]:.3g} at {first} (first "
        f"above {DEVICE_VS_CPU_SUSPECT})."
      )
  scalars["verdict"] = " ".join(lines) if lines else "No anomaly found by these checks."
  return scalars


# ---------------------------------------------------------------------------------------------
# Markdown


def _fmt(x: Any) -> str:
  if isinstance(x, bool):
    return "yes" if x else "no"
  if isinstance(x, float):
    return f"{x:.3g}"
  return str(x)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return lines + ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]


def markdown(result: dict[str, Any]) -> str:
  c = result["config"]
  lines = [
    f"fp8 check on {result['backend']} ({result['device']}, jax {result['jax']}): "
    f"d={c['d_model']}, {c['layers']} layers, {c['heads']} heads, seq {c['seq']}, "
    f"batch {c['batch']}, vocab {c['vocab']}, {c['steps']} steps; {result['seconds']:.0f} s.",
    "",
    f"**Verdict**: {result['verdict']}",
    "",
  ]
  step0, losses = result["step0"], result.get("losses", {})
  trained, own = result.get("trained", {}), result.get("trained_own_causal", {})
  rows = []
  for name in step0["loss"]:
    causal, curve = step0["causal"][name], losses.get(name, [])
    later = own.get(name, {})
    rows.append([
      name, step0["loss"][name], curve[-1] if curve else "-",
      causal["past_logits_moved"], causal["future_grad_max"],
      later.get("past_logits_moved", "-"), later.get("future_grad_max", "-"),
      f"{causal['step_moved']:.2g} / {causal['capture_moved']:.2g}",
      max(step0["intermediates"].get(name, {0: 0.0}).values()),
      max(step0["grads"].get(name, {0: 0.0}).values()),
      max(trained.get("intermediates", {}).get(name, {0: 0.0}).values()),
    ])  # fmt: skip
  lines += _table(
    ["recipe", "loss step 0", f"loss after {c['steps']}", "past logits moved",
     "future pos grad", "moved (trained)", "future grad (trained)", "step vs check / capture",
     "max act err",
     "max grad err", "max act err (trained)"],
    rows,
  )  # fmt: skip
  lines += [
    "",
    "Causality: the largest change of a logit before position t when the tokens from t on "
    "change, and the largest gradient of logits[t] with respect to a later position (both 0 "
    "when causal); the training step's logits against the check and capturing passes' (the "
    "same math, fused differently). Errors: relative RMS against fp32 at step 0, and with "
    "every recipe at the "
    f'weights {trained.get("params_from", "-")} reached ("trained").',
    "",
    "Compiled programs (one training step plus the checks, so two forward and backward passes):",
    "",
  ]
  lines += _table(
    ["recipe", "compile s", "fp8 gemms", "result types", "epilogues", "precision",
     "other custom calls", "fusions"],
    [
      [name, result["compile_s"][name], h["fp8_gemms"], h["fp8_gemm_result_types"],
       h["fp8_gemm_epilogues"], h["fp8_gemm_precisions"],
       sum(h["custom_calls"].values()) - h["fp8_gemms"], h["fusions"]]
      for name, h in result["hlo"].items()
    ],
  )  # fmt: skip
  inter = step0["intermediates"]
  if inter:
    names = list(next(iter(inter.values())))
    lines += ["", "Relative error against fp32 at step 0, per intermediate:", ""]
    lines += _table(["intermediate", *inter], [[n, *(inter[r][n] for r in inter)] for n in names])
  if "device_vs_cpu" in result and "error" not in result["device_vs_cpu"]:
    dvc = result["device_vs_cpu"]
    names = list(next(iter(dvc.values()))) if dvc else []
    lines += ["", "This backend against the CPU, same forward (first sequence):", ""]
    lines += _table(["intermediate", *dvc], [[n, *(dvc[r][n] for r in dvc)] for n in names])
  probe = result["gemm_probe"]
  lines += ["", "fp8 matmuls of small integers (exact expected), fp8 GEMMs in their HLO:", ""]
  lines += _table(
    ["path", "exact", "fp8 gemms", "result types", "precision"],
    [
      [n, e["exact"], e["hlo"]["fp8_gemms"], e["hlo"]["fp8_gemm_result_types"],
       e["hlo"]["fp8_gemm_precisions"]]
      for n, e in probe.items()
    ],
  )  # fmt: skip
  convert = result["convert_probe"]
  lines += ["", "Conversions against ml_dtypes: " + ", ".join(
    f"{d} {w} {e[w]['mismatches']}/{e[w]['values']}" for d, e in convert.items() for w in e
  ) + "."]  # fmt: skip
  if result.get("skipped"):
    lines += ["", f"Skipped (time budget): {', '.join(result['skipped'])}."]
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  for name, default in (("d_model", 1024), ("layers", 2), ("heads", 16), ("seq", 1024),
                        ("batch", 8), ("vocab", 256), ("steps", 20), ("seed", 0)):  # fmt: skip
    parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"({default})")
  parser.add_argument("--recipes", default=",".join(RECIPES))
  parser.add_argument("--budget-s", type=float, default=60.0)
  parser.add_argument("--tiny", action="store_true", help="tiny sizes (seconds, any backend)")
  parser.add_argument("--json", default=None, help="write the full result here")
  args = parser.parse_args(argv)
  kwargs = dict(TINY) if args.tiny else {}
  for name in ("d_model", "layers", "heads", "seq", "batch", "vocab", "steps", "seed"):
    if getattr(args, name) is not None:
      kwargs[name] = getattr(args, name)
  result = diagnose(**kwargs, recipes=tuple(args.recipes.split(",")), budget_s=args.budget_s)
  print(result["summary"])
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1, default=str)
  return result


if __name__ == "__main__":
  main(sys.argv[1:])
