"""Training with fp8 (jmp_lite.fp8): gradients and scales against a bf16 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_lite as jl
from jmp_lite import fp8

from .fp8_testing import (
  CONFIG,
  E4M3,
  E5M2,
  FMT,
  init_mlp_state,
  mlp_data,
  mlp_init,
  mlp_loss,
)

# Training with fp8 ---------------------------------------------------------------------


@jax.jit
def fp8_grads(params, fp8_state, x, y):
  grads, amax = jax.grad(mlp_loss, argnums=(0, 2))(
    params, fp8_state, fp8.zeros_amax(fp8_state), x, y
  )
  return grads, fp8.update(fp8_state, amax, CONFIG)


def test_gradients_close_to_bf16_reference():
  params, (x, y) = mlp_init(), mlp_data()
  state = init_mlp_state()
  _, state = fp8_grads(params, state, x, y)  # one step to calibrate the scales
  grads, _ = fp8_grads(params, state, x, y)
  bf16 = jl.get_policy("p=f32,c=bf16,o=f32")
  ref_loss = lambda p: mlp_loss(bf16.cast_to_compute(p), None, None, bf16.cast_to_compute(x), y)
  ref = jax.jit(jax.grad(ref_loss))(params)
  ref = bf16.cast_to_param(ref)
  # Per-element errors are below eps/2 per quantized operand: e4m3 (fwd) and e5m2 (bwd);
  # in norm they average down. Bound by one e4m3 epsilon, well above bf16's own error.
  tol = jl.FORMATS["float8_e4m3fn"].epsilon
  # And the operands were quantized: e4m3's epsilon is 16x bf16's, so fp8's error is some 16x
  # bf16's own (against fp32; measured 13x); at least 4x.
  fp32 = jax.jit(jax.grad(lambda p: mlp_loss(p, None, None, x, y)))(params)
  eps_ratio = tol / jl.FORMATS["bfloat16"].epsilon
  rel_error = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  for name in params:
    rel = rel_error(grads[name], ref[name])
    assert eps_ratio / 4 * rel_error(ref[name], fp32[name]) < rel < tol, (name, rel)


def test_training_adapts_scales_and_tracks_bf16():
  params, (x, y) = mlp_init(), mlp_data()
  state = init_mlp_state()
  ref = params
  opt = optax.adam(0.02)
  opt_state, ref_state = opt.init(params), opt.init(params)

  @jax.jit
  def ref_step(p, s):
    bf16 = jl.get_policy("p=f32,c=bf16,o=f32")
    g = jax.grad(
      lambda p: mlp_loss(bf16.cast_to_compute(p), None, None, bf16.cast_to_compute(x), y)
    )(p)
    u, s = opt.update(bf16.cast_to_param(g), s)
    return optax.apply_updates(p, u), s

  scales = []
  for _ in range(40):
    grads, state = fp8_grads(params, state, x, y)
    updates, opt_state = opt.update(grads, opt_state)
    params = optax.apply_updates(params, updates)
    ref, ref_state = ref_step(ref, ref_state)
    scales.append([float(t.scale) for dot in state.values() for t in dot])
  # Scales start at 1 and move to amax / fp8_max: input ~ 3/448, gradients far smaller.
  assert all(s != 1.0 for s in scales[-1])
  assert scales[-1][2] < 1e-3 and scales[-1][0] < 0.05
  assert len({tuple(s) for s in scales}) > 2  # they keep adapting as the weights move
  for dot in state.values():  # each is its history's max over the format's largest value
    for tensor, dtype in zip(dot, (E4M3, E4M3, E5M2), strict=True):
      want = np.float32(np.max(tensor.amax_history)) / np.float32(FMT[dtype].max)
      assert float(tensor.scale) == pytest.approx(float(want), rel=1e-6)
  # Evaluated in float32: the fp8-trained and bf16-trained weights reach similar losses.
  loss, ref_loss = (float(mlp_loss(p, None, None, x, y)) for p in (params, ref))
  start = float(mlp_loss(mlp_init(), None, None, x, y))
  assert loss < 0.3 * start
  assert abs(loss - ref_loss) < 0.05 * start
