"""The fp32_matmul check (jmp_lite/_audit/_checks/_compute_dtype.py): a matmul the policy does
not reach, named with its float32 operand and the line that made it float32.

Lines that must be reported carry a ``# <marker>`` comment; ``line_of`` finds them.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_lite as jl
from jmp_lite import AuditConfig, audit

from .audit_testing import line_finder

BF16, F32 = jnp.bfloat16, jnp.float32
line_of = line_finder(__file__)


class FlaxExamplesCNN(nn.Module):
  """The Flax examples' idiom: every layer built with ``dtype=self.dtype``, float32 by default."""

  dtype: jnp.dtype | None = F32

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(4, (3, 3), dtype=self.dtype)(x))  # <fp32-conv>
    x = nn.relu(nn.Dense(8, dtype=self.dtype)(x.reshape(x.shape[0], -1)))  # <fp32-dense>
    return nn.Dense(2, dtype=self.dtype)(x)  # <fp32-head>


@pytest.mark.filterwarnings("ignore::jmp_lite.flax.ExplicitDtypeWarning")
def test_fp32_matmuls_under_a_16_bit_policy():
  x = jnp.ones((2, 4, 4, 1))
  expected = [
    ("conv_general_dilated", "FlaxExamplesCNN/Conv_0", line_of("fp32-conv"), 9),
    ("dot_general", "FlaxExamplesCNN/Dense_0", line_of("fp32-dense"), 64),
    ("dot_general", "FlaxExamplesCNN/Dense_1", line_of("fp32-head"), 8),
  ]
  # No config: the audit reads the compute dtype from the function policy_apply returns.
  config = AuditConfig()
  for dtype, wanted in [(F32, expected), (None, [])]:  # None: Flax's default follows the policy
    model = FlaxExamplesCNN(dtype)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    apply_fn = jl.flax.policy_apply(model, "p=f32,c=bf16,o=f32")
    report = audit(apply_fn, variables, x, audit_config=config)
    assert [(f.primitive, f.scope, f.location.line, f.size) for f in report] == wanted, str(report)
    assert all((f.check, f.dtype) == ("fp32_matmul", "bfloat16") for f in report)
    # In a training step, the forward matmuls are reported (their transposes mirror them).
    grad_fn = jax.grad(lambda v, x, apply_fn=apply_fn: apply_fn(v, x).sum())
    both = AuditConfig(compute_dtype="bfloat16", include_backward=True)
    assert [
      (f.primitive, f.location.line) for f in audit(grad_fn, variables, x, audit_config=both)
    ] == [(primitive, line) for primitive, _, line, _ in wanted]


def test_fp32_matmul_needs_a_16_bit_compute_dtype():
  x, w = jnp.ones((2, 8), F32), jnp.ones((8, 4), F32)
  assert not audit(jnp.dot, x, w)  # pure float32 code: no compute dtype, no check
  assert not audit(jnp.dot, x, w, audit_config=AuditConfig(compute_dtype="float32"))
  (finding,) = audit(jnp.dot, x, w, audit_config=AuditConfig(compute_dtype="f16"))
  assert (finding.check, finding.dtype, finding.size) == ("fp32_matmul", "float16", 8)
  # 16-bit operands with a float32 result are what a 16-bit policy asks for.
  dot32 = lambda a, b: jnp.dot(a, b, preferred_element_type=F32)
  bf16 = AuditConfig(compute_dtype="bf16")
  assert not audit(dot32, x.astype(BF16), w.astype(BF16), audit_config=bf16)
  # Only the audited formats: a float16 compute dtype with formats=("bfloat16",) is out of scope.
  assert not audit(jnp.dot, x, w, audit_config=AuditConfig(compute_dtype="f16", formats=["bf16"]))


def scaled_attention(q, k, v, scale):
  q = q * scale  # <promoting-scale>
  scores = jnp.einsum("qd,kd->qk", q, k)  # <scores-einsum>
  probs = jax.nn.softmax(scores.astype(F32)).astype(scores.dtype)  # <fp32-softmax>
  return jnp.einsum("qk,kd->qd", probs, v)  # <values-einsum>


def test_fp32_matmul_with_one_float32_operand_names_the_operand():
  q = k = v = jnp.ones((4, 8), BF16)
  config = AuditConfig(compute_dtype="bfloat16")
  # np.float32(0.25) is not weakly typed: it promotes the query, and both einsums then run
  # float32 x bfloat16 -> float32.
  report = audit(scaled_attention, q, k, v, np.float32(0.25), audit_config=config)
  assert [(f.check, f.dtype, f.location.line, f.operands, f.size) for f in report] == [
    ("fp32_matmul", "bfloat16", line_of("scores-einsum"), ("float32[4,8]", "bfloat16[4,8]"), 8),
    ("fp32_matmul", "bfloat16", line_of("values-einsum"), ("float32[4,4]", "bfloat16[4,8]"), 4),
  ], str(report)
  where = lambda marker: jl.SourceLocation(__file__, line_of(marker), "scaled_attention")
  promoted = (
    f"promoted from bfloat16 to float32 by mul at {where('promoting-scale')}: its other "
    "operand is float32"
  )
  scores, values = (f.message for f in report)
  assert scores.startswith(
    "dot_general of a float32 lhs (float32[4,8]) and a bfloat16 operand while the compute "
    "dtype is bfloat16: JAX promotes the bfloat16 operand, so this matmul runs in float32"
  )
  assert f"The lhs is {promoted}" in scores
  # The probabilities are float32 because the scores are: the same promotion is named.
  assert (
    f"The lhs comes from div at {where('fp32-softmax')}, computed from a value {promoted}"
  ) in values
  assert "dtype=" not in scores  # no layer's dtype= is to blame
  # A Python scalar is weakly typed and keeps the query in bfloat16: nothing to report.
  assert not audit(scaled_attention, q, k, v, 0.25, audit_config=config)


def flax_attention(q, k, v):
  q = q * np.float32(0.25)  # <flax-promoting-scale>
  return nn.dot_product_attention(q, k, v)  # <flax-dot-product-attention>


class RematAttention(nn.Module):
  @nn.compact
  def __call__(self, q, k, v):
    return nn.dot_product_attention(q, k, v)  # <remat-attention>


class ScaledRematAttention(nn.Module):
  @nn.compact
  def __call__(self, q, k, v):
    q = q * np.float32(0.25)  # <remat-promoting-scale>
    return nn.remat(RematAttention)()(q, k, v)


def test_fp32_matmul_names_the_promotion_behind_flaxs_cast_of_both_operands():
  q = k = v = jnp.ones((1, 4, 2, 8), BF16)
  config = AuditConfig(compute_dtype="bfloat16", checks=["fp32_matmul"])
  qkv = "float32[1,4,2,8]"
  # Flax's promote_dtype casts k and v to the promoted query's float32 before each einsum.
  report = audit(flax_attention, q, k, v, audit_config=config)
  assert [(f.location.line, f.operands) for f in report] == [
    (line_of("flax-dot-product-attention"), (qkv, qkv)),
    (line_of("flax-dot-product-attention"), (qkv, "float32[1,2,4,4]")),
  ], str(report)
  where = lambda marker, fn: jl.SourceLocation(__file__, line_of(marker), fn)
  promoted = (
    f"promoted from bfloat16 to float32 by mul at {where('flax-promoting-scale', 'flax_attention')}"
    ": its other operand is float32"
  )
  attention = where("flax-dot-product-attention", "flax_attention")
  scaled = f"comes from div at {attention}, computed from a value"
  scores, values = (f.message for f in report)
  assert scores.startswith(
    f"dot_general with float32 operands while the compute dtype is bfloat16: the rhs ({qkv}) is "
    f"cast up from bfloat16 to match the float32 lhs ({qkv}), as JAX and Flax promote mixed "
    "operands"
  ), scores
  assert f"The lhs {scaled} {promoted}" in scores
  # The probabilities are float32 because the scores are: the same multiply is named.
  assert f"the lhs ({qkv}) is cast up from bfloat16 to match the float32 rhs" in values
  assert f"The rhs {scaled} {promoted}" in values
  assert "dtype=" not in scores + values  # no layer's dtype= is to blame
  # Cast by hand, the operands have no promotion to name: the dtype= / explicit cast message.
  # So do operands cast by hand from a 16-bit value that an earlier promotion made (and a
  # cast narrowed back): the float32 chain begins at the cast.
  by_hand = lambda q, k, v: flax_attention(q.astype(F32), k.astype(F32), v.astype(F32))
  narrowed = lambda q, k, v: by_hand(flax_attention(q, k, v).astype(BF16), k, v)
  for fn in (by_hand, narrowed):
    last_two = audit(fn, q, k, v, audit_config=config).findings[-2:]
    assert [f.message.split(":")[0] for f in last_two] == [
      "dot_general with float32 operands while the compute dtype is bfloat16"
    ] * 2
    assert all(
      "A layer built with dtype=jnp.float32 (or an explicit" in f.message for f in last_two
    )
  # A Python scalar is weakly typed and keeps the query in bfloat16.
  assert not audit(
    lambda q, k, v: nn.dot_product_attention(q * 0.25, k, v), q, k, v, audit_config=config
  )


def test_fp32_matmul_follows_an_operand_out_of_nn_remat():
  q = k = v = jnp.ones((1, 4, 2, 8), BF16)
  model = ScaledRematAttention()
  variables = model.init(jax.random.key(0), q, k, v)
  config = AuditConfig(compute_dtype="bfloat16", checks=["fp32_matmul"])
  report = audit(model.apply, variables, q, k, v, audit_config=config)
  scope = "ScaledRematAttention/CheckpointRematAttention_0"
  assert [(f.location.line, f.scope.split("/...")[0]) for f in report] == [
    (line_of("remat-attention"), scope)
  ] * 2, str(report)
  # The query is an input of the checkpoint's jaxpr: followed out to the multiply before it.
  where = lambda marker, fn: jl.SourceLocation(__file__, line_of(marker), fn)
  scale = where("remat-promoting-scale", "ScaledRematAttention.__call__")
  attention = where("remat-attention", "RematAttention.__call__")
  for finding, side in zip(report, ("lhs", "rhs"), strict=True):
    assert (
      f"The {side} comes from div at {attention}, computed from a value promoted from bfloat16 "
      f"to float32 by mul at {scale}: its other operand is float32"
    ) in finding.message
  # An input of the audited function, under jax.checkpoint: named as such.
  x16, w32 = jnp.ones((2, 8), BF16), jnp.ones((8, 4), F32)
  (finding,) = audit(jax.checkpoint(lambda x, w: x @ w), x16, w32, audit_config=config)
  assert "The rhs is an input of the traced function. " in finding.message, finding.message


def test_fp32_matmul_names_a_float32_rhs_and_convolution_input():
  x16, w32 = jnp.ones((2, 8), BF16), jnp.ones((8, 4), F32)
  config = AuditConfig(compute_dtype="float16", formats=["float16"])
  (finding,) = audit(lambda x, w: x @ w, x16, w32, audit_config=config)
  assert (finding.check, finding.dtype, finding.operands) == (
    "fp32_matmul",
    "float16",
    ("bfloat16[2,8]", "float32[8,4]"),
  )
  assert "a float32 rhs (float32[8,4]) and a bfloat16 operand" in finding.message
  assert "The rhs is an input of the traced function" in finding.message
  # A convolution whose input was cast to float32 by hand.
  img, kernel = jnp.ones((1, 1, 6, 6), BF16), jnp.ones((2, 1, 3, 3), BF16)
  conv = lambda x, k: lax.conv(x.astype(F32), k.astype(F32) * 1, (1, 1), "VALID")  # <conv32>
  (finding,) = audit(conv, img, kernel, audit_config=AuditConfig(compute_dtype="bfloat16"))
  assert (finding.primitive, finding.location.line, finding.size) == (
    "conv_general_dilated",
    line_of("conv32"),
    9,
  )
  # Both operands float32: the dtype= message of a layer that keeps its float32 dtype.
  assert "with float32 operands while the compute dtype is bfloat16" in finding.message


def test_fp32_matmul_takes_the_compute_dtype_from_the_functions_policy():
  x, w = jnp.ones((2, 8), F32), jnp.ones((8, 4), F32)

  def apply_fn(x, w):
    return jnp.dot(x, w)

  apply_fn.policy = jl.get_policy("p=f32,c=bf16,o=f32")  # what a policy-wrapped function carries
  for fn, args in [
    (apply_fn, (x, w)),
    (jax.jit(apply_fn), (x, w)),
    (functools.partial(apply_fn, w=w), (x,)),
  ]:
    (finding,) = audit(fn, *args)
    assert (finding.check, finding.dtype) == ("fp32_matmul", "bfloat16")

  # The function's policy judges it, not one among the arguments (the step's model's policy).
  @functools.wraps(apply_fn)
  def with_a_policy_argument(x, w, policy):
    del policy
    return apply_fn(x, w)

  (finding,) = audit(with_a_policy_argument, x, w, jl.get_policy("p=f32,c=f16,o=f32"))
  assert finding.dtype == "bfloat16"
  assert finding.message.endswith(
    "It is judged by the audited function's policy p=f32,c=bf16,o=f32 (its policy attribute). "
    "A layer built with dtype=jnp.float32 (or an explicit cast to float32) keeps its dtype under "
    "a policy: build it with the default dtype=None so the policy decides. If it is meant to stay "
    "in float32 (an fp32 override, e.g. the default one of nn.Embed, whose attend() is a matmul), "
    "allow it (allow_scopes / allow_locations)."
  ), finding.message
  assert "arguments carry" not in finding.message
  # An explicit compute_dtype wins; a float32 policy asks for float32 matmuls.
  assert not audit(apply_fn, x, w, audit_config=AuditConfig(compute_dtype="float32"))
  apply_fn.policy = jl.get_policy("float32")
  assert not audit(apply_fn, x, w)
