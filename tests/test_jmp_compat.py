"""A jmp 0.0.4 user's code runs unchanged with `import jmp_lite as jmp`."""

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np

import jmp_lite as jmp

JMP_ALL = (
  "all_finite",
  "DynamicLossScale",
  "LossScale",
  "NoOpLossScale",
  "select_tree",
  "StaticLossScale",
  "cast_to_full",
  "cast_to_half",
  "get_policy",
  "half_dtype",
  "Policy",
)


def test_every_jmp_name_exists():
  for name in JMP_ALL:
    assert name in jmp.__all__ and hasattr(jmp, name)


def test_constructor_argument_order_matches_jmp():
  params = list(inspect.signature(jmp.DynamicLossScale).parameters)
  assert params[:5] == ["loss_scale", "counter", "period", "factor", "min_loss_scale"]
  assert list(inspect.signature(jmp.StaticLossScale).parameters) == ["loss_scale"]
  assert list(inspect.signature(jmp.Policy).parameters) == [
    "param_dtype",
    "compute_dtype",
    "output_dtype",
  ]


def test_jmp_readme_training_loop():
  # The loop from jmp's README and DynamicLossScale docstring, positional arguments included.
  policy = jmp.get_policy("params=float32,compute=float16,output=float32")
  assert policy == jmp.Policy(
    param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=jnp.float32
  )
  loss_scale = jmp.DynamicLossScale(
    jnp.asarray(2.0**10), np.zeros([], np.int32), 2, 2, np.ones([], np.float32)
  )
  params = {"w": jnp.full((3,), 0.5)}
  x = jnp.ones((4, 3))

  @jax.jit
  def step(params, loss_scale):
    def loss_fn(p):
      p, xc = policy.cast_to_compute((p, x))
      loss = policy.cast_to_output(jnp.sum(xc @ p["w"]))
      return loss_scale.scale(loss)

    grads = loss_scale.unscale(jax.grad(loss_fn)(params))
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    new = jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
    return jmp.select_tree(grads_finite, new, params), loss_scale, grads

  params, loss_scale, grads = step(params, loss_scale)
  np.testing.assert_array_equal(grads["w"], np.full(3, 4.0))  # exact: scale is 2^10
  assert grads["w"].dtype == jnp.float32
  params, loss_scale, _ = step(params, loss_scale)
  assert float(loss_scale.loss_scale) == 2.0**11 and int(loss_scale.counter) == 0
  np.testing.assert_allclose(params["w"], 0.5 - 2 * 0.01 * 4.0)


def test_policy_is_a_frozen_dataclass_like_jmp():
  policy = jmp.get_policy("c=bf16")
  assert dataclasses.is_dataclass(policy)
  assert str(policy) == "p=f32,c=bf16,o=bf16"  # jmp's key=value format
  assert policy.compute_dtype == jnp.bfloat16 and jnp.bfloat16 == policy.compute_dtype


def test_loss_scale_attribute_and_adjust_on_all_kinds():
  for scale in (
    jmp.NoOpLossScale(),
    jmp.StaticLossScale(jnp.float32(4.0)),
    jmp.DynamicLossScale(jnp.float32(4.0)),
  ):
    assert float(scale.loss_scale) in (1.0, 4.0)
    assert isinstance(scale.adjust(jnp.array(True)), type(scale))
    assert isinstance(scale, jmp.LossScale)
