"""jl.audit: every check fires on a model built to trigger it and stays quiet on the correct one.

Lines that must be reported carry a ``# <marker>`` comment; ``line_of`` finds them, so the
tests check that findings point at the user's source line, not at JAX or Flax internals.
"""

import functools
import importlib.util
import inspect
import json
import pathlib
import sys

import flax.linen as nn
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jmp_lite as jl
from jmp_lite import (
  AUDIT_CHECKS,
  AuditConfig,
  audit,
  audit_jaxpr,
  loss_scaling,
  scaled_value_and_grad,
)

from .audit_testing import checks, line_finder

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
E4M3 = jnp.float8_e4m3fn
line_of = line_finder(__file__)


def count_equations(jaxpr) -> int:
  """The equations of a jaxpr and of every jaxpr nested in their params: what the audit walks."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's Jaxpr

  def nested(value):
    if isinstance(value, (jex.core.Jaxpr, jex.core.ClosedJaxpr)):
      return count_equations(value)
    if isinstance(value, (tuple, list)):
      return sum(nested(v) for v in value)
    return 0

  return sum(1 + sum(nested(v) for v in eqn.params.values()) for eqn in jaxpr.eqns)


# --------------------------------------------------------------------------------------------
# A small pre-LN transformer. `softmax_dtype` is the knob: float32 is the correct policy,
# the compute dtype reproduces the classic bug.


class Attention(nn.Module):
  heads: int
  dtype: jnp.dtype
  softmax_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    qkv = nn.Dense(3 * d, dtype=self.dtype)(x).reshape(b, t, 3, self.heads, d // self.heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // self.heads).astype(self.dtype)
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(self.softmax_dtype), axis=-1)  # <softmax>
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(self.dtype), v).reshape(b, t, d)
    return nn.Dense(d, dtype=self.dtype)(out)


class Block(nn.Module):
  heads: int
  dtype: jnp.dtype
  softmax_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(dtype=self.dtype)(x)  # statistics in float32: flax's default
    x = x + Attention(self.heads, self.dtype, self.softmax_dtype)(h)
    h = nn.Dense(4 * x.shape[-1], dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
    return x + nn.Dense(x.shape[-1], dtype=self.dtype)(nn.gelu(h))


class Transformer(nn.Module):
  vocab: int = 32
  dim: int = 32
  heads: int = 4
  layers: int = 2
  dtype: jnp.dtype = F16
  softmax_dtype: jnp.dtype = F32

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.dim, dtype=self.dtype)(tokens)
    for _ in range(self.layers):
      x = Block(self.heads, self.dtype, self.softmax_dtype)(x)
    return nn.Dense(self.vocab, dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))


TOKENS = jnp.zeros((2, 16), jnp.int32)


@functools.cache
def transformer(compute, softmax_dtype):
  model = Transformer(dtype=compute, softmax_dtype=softmax_dtype)
  # The audit only traces: abstract parameters (shapes and dtypes) are enough and cost nothing.
  params = jax.eval_shape(model.init, jax.random.key(0), TOKENS)
  policy = jl.get_policy(f"p=f32,c={jnp.dtype(compute).name},o=f32")
  return model, params, policy


def train_step_of(model, policy):
  tx = loss_scaling(optax.adam(1e-3), jl.DynamicLossScale(jnp.float32(2**15)))

  def loss_fn(params, tokens):
    logits = policy.cast_to_output(model.apply(policy.cast_to_compute(params), tokens))
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()

  def train_step(params, opt_state, tokens):
    loss, grads = scaled_value_and_grad(loss_fn, opt_state)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return tx, train_step


@pytest.mark.parametrize("compute", [F16, BF16])
def test_softmax_in_16_bits_points_at_the_softmax_line(compute):
  model, params, policy = transformer(compute, softmax_dtype=compute)
  report = audit(lambda p, t: model.apply(policy.cast_to_compute(p), t), params, TOKENS)
  assert checks(report) == ["softmax", "softmax"], str(report)  # one per block
  for finding in report:
    assert finding.location.file == __file__
    assert finding.location.line == line_of("softmax")
    assert finding.location.function == "Attention.__call__"
    assert finding.primitive == "exp" and finding.dtype == jnp.dtype(compute).name
    assert finding.size == 16  # the softmax axis
    assert not finding.backward
  assert {f.scope for f in report} == {
    "Transformer/Block_0/Attention_0",
    "Transformer/Block_1/Attention_0",
  }
  text = str(report)
  assert f"test_audit.py:{line_of('softmax')} in Attention.__call__" in text
  assert "and 1 more at this line" in text  # grouped by source line


@pytest.mark.parametrize("compute", [F16, BF16])
def test_correct_policy_reports_nothing(compute):
  model, params, policy = transformer(compute, softmax_dtype=F32)
  fn = lambda p, t: model.apply(policy.cast_to_compute(p), t)
  report = audit(fn, params, TOKENS)
  assert not report, str(report)
  # Every equation was walked, those of nested jaxprs (jnp.var's jit...) included.
  assert report.ok and report.num_operations == count_equations(jax.make_jaxpr(fn)(params, TOKENS))
  assert "no precision-sensitive operation" in str(report)


def test_train_step_audit_both_ways():
  # The whole step (loss scaling, grad, adam) is traced; only forward-pass ops are judged.
  for softmax_dtype, expected in [(F32, []), (F16, ["softmax", "softmax"])]:
    model, params, policy = transformer(F16, softmax_dtype)
    tx, train_step = train_step_of(model, policy)
    report = audit(train_step, params, jax.eval_shape(tx.init, params), TOKENS)
    assert checks(report) == expected, str(report)
    assert all(f.location.line == line_of("softmax") for f in report)


def test_flax_attention_module_points_at_the_users_call():
  class Model(nn.Module):
    force_fp32: bool

    @nn.compact
    def __call__(self, x):
      attention = nn.MultiHeadDotProductAttention(
        num_heads=2, dtype=F16, force_fp32_for_softmax=self.force_fp32
      )
      return attention(x)  # <flax-attention>

  x = jnp.ones((2, 8, 16), F16)
  params = jax.eval_shape(Model(False).init, jax.random.key(0), x)
  for force_fp32, expected in [(False, ["softmax"]), (True, [])]:
    report = audit(Model(force_fp32).apply, params, x)
    assert checks(report) == expected, str(report)
  (finding,) = audit(Model(False).apply, params, x)
  assert finding.location.line == line_of("flax-attention")
  # The line inside Flax that computes the softmax is kept as well.
  assert pathlib.Path(finding.library_location.file).parts[-3:] == ("flax", "linen", "attention.py")


# --------------------------------------------------------------------------------------------
# A small convnet: flax's BatchNorm (statistics in float32) is correct, a hand-written one in the
# compute dtype is not.


class ConvNet(nn.Module):
  dtype: jnp.dtype
  flax_norm: bool = True

  @nn.compact
  def __call__(self, x, train: bool):
    for features in (8, 16):
      x = nn.Conv(features, (3, 3), dtype=self.dtype)(x)
      if self.flax_norm:
        x = nn.BatchNorm(use_running_average=not train, dtype=self.dtype)(x)
      else:
        mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))  # <batchnorm-stats>
        x = (x - mean) / jnp.sqrt(var + 1e-5)  # <batchnorm>
      x = nn.avg_pool(nn.relu(x), (2, 2), (2, 2))
    x = nn.RMSNorm(dtype=self.dtype)(x.mean(axis=(1, 2)))
    x = nn.Dropout(0.1, deterministic=not train)(jax.nn.silu(x))
    return nn.Dense(10, dtype=self.dtype)(x)


@pytest.mark.parametrize("compute", [F16, BF16])
def test_convnet_train_step_both_ways(compute):
  x, labels = jnp.ones((4, 16, 16, 3)), jnp.zeros(4, jnp.int32)
  policy = jl.get_policy(f"p=f32,c={jnp.dtype(compute).name},o=f32")
  tx = loss_scaling(optax.adamw(1e-3), jl.DynamicLossScale(jnp.float32(2**15)))
  # jnp.var of float16 values computes in float32 and casts the variance back to float16, which
  # overflows from |x - mean| > 256 on: a cast finding per layer (float16 only: bfloat16 has the
  # range).
  wrong = ["normalization"] * 2 + (["cast"] * 2 if compute == F16 else [])
  for flax_norm, expected in [(True, []), (False, wrong)]:
    model = ConvNet(compute, flax_norm)
    variables = jax.eval_shape(
      lambda key, model=model: model.init(key, x, False), jax.random.key(0)
    )

    def loss_fn(params, batch_stats, key, model=model):
      logits, updates = model.apply(
        {"params": policy.cast_to_compute(params), "batch_stats": batch_stats},
        policy.cast_to_compute(x),
        True,
        mutable=["batch_stats"],
        rngs={"dropout": key},
      )
      loss = optax.softmax_cross_entropy_with_integer_labels(policy.cast_to_output(logits), labels)
      return loss.mean(), updates

    def step(params, batch_stats, opt_state, key, loss_fn=loss_fn):
      (loss, updates), grads = scaled_value_and_grad(loss_fn, opt_state, has_aux=True)(
        params, batch_stats, key
      )
      new, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, new), updates, opt_state, loss

    params, stats = variables["params"], variables.get("batch_stats", {})
    report = audit(step, params, stats, jax.eval_shape(tx.init, params), jax.random.key(1))
    assert sorted(checks(report)) == sorted(expected), str(report)
    assert {(f.check, f.location.line) for f in report} <= {
      ("normalization", line_of("batchnorm")),
      ("cast", line_of("batchnorm-stats")),
    }


# --------------------------------------------------------------------------------------------
# One check at a time: (function that triggers it, correct counterpart, inputs).

X16 = jnp.linspace(-4, 4, 64, dtype=F16).reshape(4, 16)
X32 = X16.astype(F32)


def _manual_layer_norm(x):
  mean = jnp.mean(x, -1, keepdims=True)
  var = jnp.var(x, -1, keepdims=True)  # <layernorm-var>
  return (x - mean) * lax.rsqrt(var + 1e-5)  # <layernorm>


def _rms_norm(x):
  return x * lax.rsqrt(jnp.mean(jnp.square(x), -1, keepdims=True) + 1e-6)  # <rmsnorm>


def _ln_flax(x):
  module = nn.LayerNorm(dtype=x.dtype)
  return module.apply(module.init(jax.random.key(0), x), x)


CASES = {
  "logsumexp": (
    lambda x: jax.nn.log_softmax(x),  # <logsumexp>
    lambda x: jax.nn.log_softmax(x.astype(F32)),
    X16,
  ),
  "cross-entropy": (
    lambda x: optax.softmax_cross_entropy_with_integer_labels(x, jnp.zeros(4, int)),  # <xent>
    lambda x: optax.softmax_cross_entropy_with_integer_labels(x.astype(F32), jnp.zeros(4, int)),
    X16,
  ),
  "exp": (lambda x: jnp.exp(x), lambda x: jnp.exp(x.astype(F32)), X16),  # <exp>
  "log": (lambda x: jnp.log1p(x * x), lambda x: jnp.log1p(x.astype(F32) ** 2), X16),  # <log>
  "logistic": (
    lambda x: jnp.log(jax.nn.sigmoid(x)),  # <logistic>
    lambda x: x * jax.nn.sigmoid(x),  # SiLU: a sigmoid gate in 16 bits is fine
    X16,
  ),
  "reduction": (
    lambda x: lax.cumsum(x, axis=0),  # <cumsum>
    lambda x: lax.cumsum(x.astype(F32), axis=0),
    jnp.ones(2048, F16),
  ),
  "reduction-bf16": (
    lambda x: lax.reduce_sum(x, (0,)),  # <reduce-sum>
    lambda x: jnp.sum(x),  # jnp.sum accumulates 16-bit inputs in float32 itself
    jnp.ones(256, BF16),
  ),
  "normalization": (_manual_layer_norm, _ln_flax, X16),
  "rms-normalization": (_rms_norm, lambda x: _rms_norm(x.astype(F32)).astype(F16), X16),
  "division": (
    lambda x: x / jnp.sum(jnp.abs(x), -1, keepdims=True),  # <division>
    lambda x: (x.astype(F32) / jnp.sum(jnp.abs(x.astype(F32)), -1, keepdims=True)).astype(F16),
    X16,
  ),
  "matmul": (
    lambda x: jnp.dot(x, x.T),  # <matmul-fp8>
    lambda x: jnp.dot(x, x.T, preferred_element_type=F32),
    X16.astype(E4M3),
  ),
  "cast-mask": (
    lambda x: jnp.where(x > 0, x, -1e9),  # <mask>
    lambda x: jnp.where(x > 0, x, jnp.finfo(x.dtype).min),
    X16,
  ),
  "cast-exp": (
    lambda x: jnp.exp(x.astype(F32)).astype(F16),  # <cast-exp>
    lambda x: jax.nn.softmax(x.astype(F32)).astype(F16),  # bounded by 1: fine
    X16,
  ),
  "cast-fp8": (
    lambda x: x.astype(E4M3),  # <cast-fp8>
    lambda x: jnp.clip(x, -448, 448).astype(E4M3),
    X32 * 100,
  ),
  "overflowed-constant": (
    lambda x: x + 1e5,  # <constant>
    lambda x: x + 1e4,
    X16,
  ),
}
EXPECTED = {
  "logsumexp": (["logsumexp"], "logsumexp"),
  "cross-entropy": (["logsumexp"], "xent"),
  "exp": (["exp"], "exp"),
  "log": (["log"], "log"),
  "logistic": (["logistic"], "logistic"),
  "reduction": (["reduction"], "cumsum"),
  "reduction-bf16": (["reduction"], "reduce-sum"),
  # jnp.var of float16 values returns a float32 variance cast to float16: it overflows from
  # |x - mean| > 256 on.
  "normalization": (["cast", "normalization"], ("layernorm-var", "layernorm")),
  "rms-normalization": (["normalization", "normalization"], "rmsnorm"),  # x**2 and rsqrt
  "division": (["division"], "division"),
  "matmul": (["matmul"], "matmul-fp8"),
  "cast-mask": (["cast"], "mask"),
  "cast-exp": (["cast"], "cast-exp"),
  "cast-fp8": (["cast"], "cast-fp8"),
  "overflowed-constant": (["cast"], "constant"),
}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("case", list(CASES))
def test_each_check_fires_and_its_fix_is_quiet(case):
  bad, good, x = CASES[case]
  expected, marker = EXPECTED[case]
  report = audit(bad, x)
  assert checks(report) == expected, str(report)
  markers = (marker,) if isinstance(marker, str) else marker
  assert {f.location.line for f in report} == {line_of(m) for m in markers}
  assert all(f.dtype in f.message for f in report)  # the message gives the format's numbers
  assert not any(f.autodiff or f.backward for f in report)  # no grad here: the user wrote them
  quiet = audit(good, x)
  assert not quiet, str(quiet)


def test_every_check_has_a_case():
  covered = {c for expected, _ in EXPECTED.values() for c in expected}
  # softmax: the transformer tests above; fp32_matmul needs a compute dtype: its own tests below.
  assert covered | {"softmax", "fp32_matmul"} == set(AUDIT_CHECKS)


def test_reduction_threshold_is_one_over_epsilon():
  # float16: 1/eps = 1024 values; bfloat16: 128.
  assert not audit(lambda x: lax.cumsum(x), jnp.ones(1023, F16))
  assert checks(audit(lambda x: lax.cumsum(x), jnp.ones(1024, F16))) == ["reduction"]
  assert not audit(lambda x: lax.reduce_sum(x, (0,)), jnp.ones(127, BF16))
  assert checks(audit(lambda x: lax.reduce_sum(x, (0,)), jnp.ones(128, BF16))) == ["reduction"]
  config = AuditConfig(long_reduction=10)
  assert checks(audit(lambda x: lax.cumsum(x), jnp.ones(10, F16), audit_config=config)) == [
    "reduction"
  ]


def test_long_reduction_is_only_the_reduction_threshold():
  # long_reduction says when a 16/8-bit reduction is long (the reduction check). Which float32
  # sums can overflow float16 once cast (the cast check) is a property of their range, the same
  # under any long_reduction.
  cast_sum = lambda x: jnp.sum(x).astype(F16)
  for config in (AuditConfig(), AuditConfig(long_reduction=8), AuditConfig(long_reduction=4096)):
    (finding,) = audit(cast_sum, jnp.ones(2048, F32), audit_config=config)
    assert finding.check == "cast" and "the result of reduce_sum of 2048 values" in finding.message
    assert not audit(cast_sum, jnp.ones(512, F32), audit_config=config)
  sum16 = lambda x: lax.reduce_sum(x, (0,))
  assert checks(audit(sum16, jnp.ones(512, F16), audit_config=AuditConfig(long_reduction=512))) == [
    "reduction"
  ]
  assert not audit(sum16, jnp.ones(2048, F16), audit_config=AuditConfig(long_reduction=4096))
  assert "long_reduction" in AUDIT_CHECKS["reduction"]


def test_matmul_accumulation_modes():
  a, b = jnp.ones((4, 2048), F16), jnp.ones((2048, 4), F16)
  # XLA accumulates 16-bit dots in float32 on CPU, GPU and TPU: quiet by default.
  assert not audit(jnp.dot, a, b)
  strict = AuditConfig(matmul_accumulation="as_written")
  (finding,) = audit(jnp.dot, a, b, audit_config=strict)
  assert finding.check == "matmul" and finding.size == 2048
  assert not audit(
    lambda a, b: jnp.dot(a, b, preferred_element_type=F32), a, b, audit_config=strict
  )
  assert not audit(jnp.dot, a[:, :64], b[:64], audit_config=strict)  # short contraction
  # An algorithm preset states the fp32 accumulator (jmp_lite's kernels on GPU/TPU).
  stated = lambda a, b: lax.dot(a, b, precision=lax.DotAlgorithmPreset.F16_F16_F32)
  assert not audit(stated, a, b, audit_config=strict)
  bf16 = lambda a, b: lax.dot(a, b, precision=lax.DotAlgorithmPreset.BF16_BF16_BF16)
  (finding,) = audit(bf16, a.astype(BF16), b.astype(BF16), audit_config=strict)
  assert finding.check == "matmul"
  kernel = jnp.ones((4, 3, 3, 3), E4M3)  # OIHW: 27 products per output
  conv = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME")
  (finding,) = audit(conv, jnp.ones((1, 3, 8, 8), E4M3), kernel)
  assert finding.primitive == "conv_general_dilated" and finding.size == 27


def test_bfloat16_casts_lose_no_range():
  # bfloat16 has float32's exponent: casting exp() results to it cannot overflow.
  assert not audit(lambda x: jnp.exp(x).astype(BF16), X32)
  assert checks(audit(lambda x: jnp.exp(x).astype(F16), X32)) == ["cast"]


# A mean is a sum divided by a count: it overflows float16 when what it averages can.
OVERFLOWING_MEANS = {
  "mean-of-square": lambda x: jnp.mean(x**2, -1).astype(F16),  # <mean-of-square>
  "var": lambda x: jnp.var(x).astype(F16),  # <var>
  "mean-of-exp": lambda x: jnp.mean(jnp.exp(x)).astype(F16),  # <mean-of-exp>
  "sum-of-square": lambda x: jnp.sum(x**2, -1).astype(F16),  # <sum-of-square>
  "mean-of-x-times-x": lambda x: jnp.mean(x * x, -1).astype(F16),  # <mean-of-x-times-x>
}


@pytest.mark.parametrize("case", list(OVERFLOWING_MEANS))
def test_casts_after_a_mean_are_reported(case):
  (finding,) = audit(OVERFLOWING_MEANS[case], X32)
  assert (finding.check, finding.primitive) == ("cast", "convert_element_type"), str(finding)
  assert finding.dtype == "float16" and finding.operands[0].startswith("float32[")
  assert finding.location.line == line_of(case)
  assert "can exceed float16's max 65504" in finding.message


def test_means_that_fit_are_not_reported():
  # float32 statistics kept in float32, or cast to bfloat16 (float32's range): correct policies.
  assert not audit(lambda x: jnp.mean(x**2, -1).astype(F32), X32)
  assert not audit(lambda x: jnp.mean(x**2, -1).astype(BF16), X32)
  assert not audit(lambda x: jnp.var(x).astype(BF16), X32)
  # A mean of 2048 values lies within their range: the long sum's growth is divided away.
  assert not audit(lambda x: jnp.mean(x).astype(F16), jnp.ones(2048, F32))
  assert not audit(lambda x: (jnp.sum(x) * (1 / 2048)).astype(F16), jnp.ones(2048, F32))
  assert checks(audit(lambda x: (jnp.sum(x) / 2).astype(F16), jnp.ones(2048, F32))) == ["cast"]
  # Squares computed in float16 are at most 65504 (or already inf, reported as normalization):
  # their float32 mean cast back fits.
  assert checks(audit(lambda x: jnp.mean(jnp.square(x), -1), X16)) == ["normalization"]
  # Bounded values: a mean of tanh, a clipped square.
  assert not audit(lambda x: jnp.mean(jnp.tanh(x), -1).astype(F16), X32)
  assert not audit(lambda x: jnp.mean(jnp.minimum(x**2, 100.0), -1).astype(F16), X32)
  assert not audit(lambda x: jnp.clip(jnp.mean(jnp.exp(x)), 0, 1e4).astype(F16), X32)


def test_ranges_flow_through_branches_clamps_and_updates():
  # A cond's result is one of its branches'; a clamp with an unknown bound keeps the exp's
  # growth; a dynamic_update_slice writes the update, not the (traced) indices.
  branch = lambda x: lax.cond(x[0, 0] > 0, jnp.exp, lambda y: y, x).astype(F16)
  clamp = lambda x: lax.clamp(0.0, jnp.exp(x), x).astype(F16)
  mask = jnp.full((1, 4), -1e9, F32)
  update = lambda x: lax.dynamic_update_slice(x * 0, mask, (0, jnp.argmax(x[0]))).astype(F16)
  for fn in (branch, clamp, update):
    (finding,) = audit(fn, X32)
    assert finding.check == "cast", str(finding)
  assert "magnitude 1e+09" in audit(update, X32).findings[0].message
  assert not audit(lambda x: lax.cond(x[0, 0] > 0, jnp.tanh, jnp.sin, x).astype(F16), X32)


# --------------------------------------------------------------------------------------------
# Nested jaxprs


def _softmax16(x):
  return jax.nn.softmax(x)  # <nested>


def _custom_vjp_softmax():
  @jax.custom_vjp
  def f(x):
    return _softmax16(x)

  f.defvjp(lambda x: (_softmax16(x), x), lambda x, g: (g,))
  return f


def _custom_jvp_softmax():
  f = jax.custom_jvp(_softmax16)
  f.defjvp(lambda primals, tangents: (_softmax16(*primals), tangents[0]))
  return f


NESTED = {
  "jit": lambda x: jax.jit(_softmax16)(x),
  "scan": lambda x: lax.scan(lambda c, row: (c, _softmax16(row)), 0.0, x)[1],
  "cond": lambda x: lax.cond(x[0, 0] > 0, _softmax16, lambda y: y, x),
  "while": lambda x: lax.while_loop(
    lambda c: c[0] < 2, lambda c: (c[0] + 1, _softmax16(c[1])), (0, x)
  )[1],
  "remat": lambda x: jax.checkpoint(_softmax16)(x),
  "custom_vjp": lambda x: _custom_vjp_softmax()(x),
  "custom_jvp": lambda x: _custom_jvp_softmax()(x),
  "vmap": jax.vmap(_softmax16),
  "grad-of-remat": jax.grad(lambda x: jax.checkpoint(_softmax16)(x).astype(F32).sum()),
  "grad-of-custom_vjp": jax.grad(lambda x: _custom_vjp_softmax()(x).astype(F32).sum()),
}


@pytest.mark.parametrize("kind", list(NESTED))
def test_nested_jaxprs_are_walked(kind):
  report = audit(NESTED[kind], X16)
  assert checks(report) == ["softmax"], str(report)  # written once, reported once
  assert {f.location.line for f in report} == {line_of("nested")}
  assert not audit(NESTED[kind], X32)


def test_backward_pass_only_on_request():
  grad_fn = jax.grad(lambda x: _softmax16(x).astype(F32).sum())
  forward_only = audit(grad_fn, X16)
  assert not any(f.backward for f in forward_only) and checks(forward_only) == ["softmax"]
  both = audit(grad_fn, X16, audit_config=AuditConfig(include_backward=True))
  backward = [f for f in both if f.backward]
  assert backward and all("transpose" in f.scope for f in backward)
  assert {f.location.line for f in both} == {line_of("nested")}
  # Every operation of the backward pass is autodiff's; the forward softmax is the user's.
  assert all(f.autodiff for f in backward) and not forward_only.findings[0].autodiff


@pytest.mark.parametrize("wrap", ["plain", "jit", "scan"])
def test_autodiff_created_operations_are_labelled(wrap):
  # rsqrt's derivative, -0.5 * rsqrt(x) / x, divides by the 16-bit statistics: a division the
  # user's line did not write. Inside jit/scan JAX gives it the rsqrt's traceback.
  norm = {
    "plain": _rms_norm,
    "jit": jax.jit(_rms_norm),
    "scan": lambda x: lax.scan(lambda c, row: (c, _rms_norm(row)), 0.0, x)[1],
  }[wrap]
  grad_fn = jax.grad(lambda x: norm(x).astype(F32).sum())
  for config in (None, AuditConfig(include_backward=True)):
    report = audit(grad_fn, X16, audit_config=config)
    forward = [f for f in report if not f.backward]
    assert [(f.check, f.primitive, f.autodiff, f.derivative_of) for f in forward] == [
      ("normalization", "square", False, None),  # written by the user
      ("normalization", "rsqrt", False, None),
      ("division", "div", True, "rsqrt"),  # created by autodiff
    ], str(report)
    assert {f.location.line for f in report} == {line_of("rmsnorm")}
    assert all(f.autodiff for f in report if f.backward)
  created = forward[2]
  assert f"[division] created by autodiff: the derivative of rsqrt at {created.location}" in str(
    report
  )
  assert "derivative of rsqrt: computing rsqrt in float32" in created.message
  assert created.to_dict()["autodiff"] is True and created.to_dict()["derivative_of"] == "rsqrt"


# --------------------------------------------------------------------------------------------
# Configuration and results


def test_allow_lists_and_selection():
  model, params, policy = transformer(F16, softmax_dtype=F16)
  fn = lambda p, t: model.apply(policy.cast_to_compute(p), t)
  assert len(audit(fn, params, TOKENS)) == 2

  def run(**kwargs):
    return audit(fn, params, TOKENS, audit_config=AuditConfig(**kwargs))

  assert not run(allow_primitives=["exp"])
  assert not run(allow_locations=[f"*{pathlib.Path(__file__).name}:{line_of('softmax')}"])
  assert not run(allow_locations=[f"test_audit.py:{line_of('softmax')}"])  # basename form
  assert len(run(allow_locations=["*/no_such_file.py"])) == 2
  assert [f.scope for f in run(allow_scopes=["*Block_0*"])] == ["Transformer/Block_1/Attention_0"]
  assert not run(allow=lambda f: f.check == "softmax")
  assert not run(checks=["cast", "matmul"])
  assert not run(formats=["bfloat16"])  # only bf16 audited: the fp16 softmax is out of scope
  assert len(run(formats=["f16"])) == 2


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    ({"checks": ["softmax", "sofmax"]}, ValueError, "sofmax"),
    ({"formats": ["float32"]}, ValueError, "float32"),
    ({"formats": "float16"}, TypeError, "formats"),
    ({"formats": ["int8"]}, TypeError, "int8"),
    ({"long_reduction": 0}, ValueError, "long_reduction"),
    ({"long_contraction": 1.5}, TypeError, "long_contraction"),
    ({"matmul_accumulation": "fp32"}, ValueError, "fp32"),
    ({"include_backward": 1}, TypeError, "include_backward"),
    ({"allow_primitives": "exp"}, TypeError, "allow_primitives"),
    ({"allow_locations": [3]}, TypeError, "3"),
    ({"allow": "exp"}, TypeError, "allow"),
    ({"compute_dtype": "int8"}, TypeError, "compute_dtype='int8'"),
    ({"compute_dtype": "float17"}, ValueError, "compute_dtype='float17'"),
  ],
)
def test_config_validation(kwargs, error, match):
  with pytest.raises(error, match=match):
    AuditConfig(**kwargs)


def test_bad_arguments():
  with pytest.raises(TypeError, match="callable"):
    audit("model", X16)
  with pytest.raises(TypeError, match="AuditConfig"):
    audit(jnp.exp, X16, audit_config={"checks": ["exp"]})
  with pytest.raises(TypeError, match="jaxpr"):
    audit_jaxpr(lambda x: x)


def test_structured_result_and_report():
  report = audit(lambda x: (jnp.exp(x), jnp.log(x * x)), X16)
  assert len(report) == 2 and not report.ok
  assert list(report.by_check()) == ["exp", "log"]
  records = report.to_dicts()
  json.dumps(records)  # serializable, e.g. as a CI artifact
  assert records[0]["check"] == "exp" and records[0]["operands"] == ["float16[4,16]"]
  assert records[0]["location"]["line"] == report.findings[0].location.line
  text = str(report)
  assert text.startswith("jmp_lite audit: 2 findings at 2 sites")
  assert "[exp]" in text and "[log]" in text and "float16" in text
  # ln(65504) = 11.09, from the format table.
  assert "overflows to inf for inputs above 11.1" in report.findings[0].message


def test_abstract_arguments_and_static_flags():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
      x = nn.Dropout(0.1, deterministic=not train)(x)
      return jax.nn.softmax(x)  # <static-flag>

  x = jax.ShapeDtypeStruct((2, 16), F16)  # nothing is allocated or run
  params = {}
  report = audit(lambda p, x, train: Net().apply(p, x, train=train), params, x, train=False)
  assert checks(report) == ["softmax"] and report.findings[0].location.line == line_of(
    "static-flag"
  )


def test_audit_jaxpr_of_a_traced_function():
  closed = jax.make_jaxpr(_softmax16)(X16)
  assert checks(audit_jaxpr(closed)) == ["softmax"]


def test_audit_is_the_function_and_no_module_is_shadowed():
  # jl.audit is the function; its implementation lives in the private jmp_lite._audit.
  assert inspect.isfunction(jl.audit) and jl.audit is audit
  assert importlib.util.find_spec("jmp_lite.audit") is None
  assert jl.AUDIT_CHECKS is AUDIT_CHECKS and "fp32_matmul" in jl.AUDIT_CHECKS
  # A public submodule of jmp_lite is reachable as the attribute of its name, not hidden by a
  # function or class of the same name.
  for name, module in list(sys.modules.items()):
    parent, _, child = name.rpartition(".")
    if parent == "jmp_lite" and not child.startswith("_") and module is not None:
      assert getattr(jl, child, module) is module, f"jmp_lite.{child} hides the module {name}"
  for name in dir(jl):
    if not name.startswith("_") and inspect.ismodule(getattr(jl, name)):
      assert getattr(jl, name).__name__ == f"jmp_lite.{name}", name
