"""The first fp8 step: calibration (jmp_lite/fp8/_current_scaling.py)."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jmp_lite as jl
from jmp_lite import fp8

from .fp8_testing import (
  CONFIG,
  E4M3,
  E5M2,
  FMT,
  MATMUL,
  init_mlp_state,
  mlp_data,
  mlp_init,
  mlp_loss,
  normal,
  quantization_error,
)

# The first step: calibration -----------------------------------------------------------

TINY = 2.0**-20  # a loss this small gives output gradients under E5M2's 2^-16 at scale 1
FIRST_STEP_CASES = {
  # (input factor, loss factor, loss scale): the loss scale passed as docs/fp8.md says
  "tiny_gradients": (1.0, TINY, 2.0**12),
  "large_inputs": (2.0**10, 1.0, 1.0),  # |x| up to ~3000: saturates E4M3 (448) at scale 1
}


def matmul_data(x_factor):
  rng = np.random.default_rng(11)
  x = normal(rng, (16, 32), x_factor)
  return x, normal(rng, (32, 8), 0.2), normal(rng, (16, 8))


def matmul_loss(x, k, t, state, amax, loss_scale, factor):
  y = fp8.dot_general(x, k, MATMUL, state, amax, config=CONFIG, loss_scale=loss_scale)
  return loss_scale * factor * jnp.sum(y * t), y


@jax.jit
def calibrate_matmul(x, k, t, state, loss_scale, factor):
  loss = lambda amax: matmul_loss(x, k, t, state, amax, loss_scale, factor)
  return fp8.calibrate(loss, state, CONFIG, has_aux=True)


@functools.partial(jax.jit, static_argnames="current")
def matmul_step(x, k, t, state, loss_scale, factor, current=False):
  """y, the (loss-scaled) gradients and the observations of one fp8 matmul step."""
  grad = jax.grad(matmul_loss, argnums=(0, 1, 4), has_aux=True)
  with fp8.current_scaling() if current else contextlib.nullcontext():
    (dx, dk, amax), y = grad(x, k, t, state, fp8.zeros_amax(state), loss_scale, factor)
  return y, dx, dk, amax


@pytest.mark.parametrize("case", FIRST_STEP_CASES)
def test_first_step_after_calibration_has_only_rounding_error(case):
  """From a fresh state, calibrate, then step 0: its error is fp8 rounding, not a flush/saturation.

  With the initial scales of 1 the gradients of "tiny_gradients" are 100% zeros, and
  "large_inputs" saturates. Calibrated, each scale is amax / fp8_max, and every output and
  gradient is within the bound of E4M3 (forward) and E5M2 (gradient) rounding used in
  test_dot_general_error_within_format_bounds: e_v <= eps/2 |v| + min_subnormal/2 s_v.
  """
  x_factor, factor, loss_scale = FIRST_STEP_CASES[case]
  x, k, t = matmul_data(x_factor)
  fresh = fp8.init_dot_state(CONFIG)
  args = (jnp.float32(loss_scale), jnp.float32(factor))
  state = calibrate_matmul(x, k, t, fresh, *args)
  xs, ks, gs = (np.asarray(v, np.float64) for v in (x, k, factor * t))
  amaxes = (np.abs(x).max(), np.abs(k).max(), np.float32(factor) * np.abs(t).max())
  fp8_max = (FMT[E4M3].max, FMT[E4M3].max, FMT[E5M2].max)
  for tensor, amax, top in zip(state, amaxes, fp8_max, strict=True):
    assert float(tensor.scale) == np.float32(amax) / np.float32(top)  # exact: fp32 division
    assert float(tensor.amax_history[0]) == amax
  s_x, s_k, s_g = (float(t.scale) for t in state)
  y, dx, dk, _ = matmul_step(x, k, t, state, *args)
  dx, dk = dx / loss_scale, dk / loss_scale  # exact: a power of two
  ex, ek = quantization_error(xs, s_x, E4M3), quantization_error(ks, s_k, E4M3)
  eg = quantization_error(gs, s_g, E5M2)
  for got, want, bound in (
    (y, xs @ ks, ex @ (np.abs(ks) + ek) + np.abs(xs) @ ek),
    (dx, gs @ ks.T, eg @ (np.abs(ks) + ek).T + np.abs(gs) @ ek.T),
    (dk, xs.T @ gs, ex.T @ (np.abs(gs) + eg) + np.abs(xs).T @ eg),
  ):
    got = np.asarray(got, np.float64)
    err = np.abs(got - want)
    assert np.all(err <= bound + 1e-5 * np.abs(want).max()), np.max(err - bound)
    assert np.all((got != 0) | (want == 0))  # nothing flushed
    assert np.linalg.norm(got - want) <= 0.15 * np.linalg.norm(want)
  # The calibration pass quantized exactly as this step did: the same values, bit for bit.
  current = matmul_step(x, k, t, fresh, *args, current=True)
  jax.tree.map(np.testing.assert_array_equal, current, matmul_step(x, k, t, state, *args))


@jax.jit
def delayed_scaling_reference(x, k, t, state, loss_scale):
  """The module docstring's math with the state's scales, from public pieces."""
  s_x, s_k, s_g = (t.scale for t in state)
  f32 = jnp.float32
  q_x, q_k = fp8.quantize(x, s_x, E4M3), fp8.quantize(k, s_k, E4M3)
  y = lax.dot_general(q_x, q_k, MATMUL, preferred_element_type=f32) * (s_x * s_k)
  s = s_g * loss_scale
  q_g = fp8.quantize(loss_scale * t, s, E5M2)
  dx = lax.dot_general(q_g, q_k, (((1,), (1,)), ((), ())), preferred_element_type=f32) * (s * s_k)
  dk = lax.dot_general(q_g, q_x, (((0,), (0,)), ((), ())), preferred_element_type=f32).T
  return y, dx, dk * (s * s_x)


def test_steady_state_is_delayed_scaling_bit_for_bit():
  """With a history (every step but a fresh state's first), nothing changed: each tensor is
  quantized with its state's scale, not its own amax, and the results are the documented
  delayed-scaling math bit for bit."""
  x, k, t = matmul_data(1.0)
  state = fp8.init_dot_state(CONFIG)
  for amax in ((5.0, 0.3, 0.7), (2.0, 0.5, 3.0)):  # scales unrelated to this batch's amaxes
    state = fp8.update(state, fp8.Fp8DotAmax(*map(jnp.float32, amax)), CONFIG)
  loss_scale = jnp.float32(2.0**12)
  y, dx, dk, amax = matmul_step(x, k, t, state, loss_scale, jnp.float32(1))
  jax.tree.map(
    np.testing.assert_array_equal,
    (y, dx, dk),
    delayed_scaling_reference(x, k, t, state, loss_scale),
  )
  observed = [float(np.abs(v).max()) for v in (x, k, t)]
  assert [float(a) for a in amax] == observed
  # Under current_scaling the same step quantizes differently (its own amaxes).
  current = matmul_step(x, k, t, state, loss_scale, jnp.float32(1), current=True)
  assert not np.array_equal(current[0], y)


def test_calibrated_fp8_training_keeps_up_with_bf16_from_the_first_step():
  """Adam on a loss times 2^-20: calibrated fp8 makes the same progress as bf16 from step 1.

  Uncalibrated, step 0's gradients are all zero (scales of 1 flush them) and the first layer's
  stay zero until its output-gradient scale is set a step later: after 1 and 2 steps fp8 has
  made 0% and ~31% of bf16's progress. Calibrated, each step's gradients differ from bf16's by
  E4M3/E5M2 rounding (per-leaf error ~5%, see test_first_step_after_calibration_has_only_
  rounding_error), so the loss decrease agrees to a few per cent of bf16's; 10% allows twice
  that, and a step of lag is a 100% miss.
  """
  params, (x, y) = mlp_init(), mlp_data()
  opt = optax.adam(0.02)
  bf16, fp32 = jl.get_policy("p=f32,c=bf16,o=f32"), jl.get_policy("p=f32,c=f32,o=f32")

  @jax.jit
  def fp8_step(p, state, opt_state):
    grads, amax = jax.grad(lambda p, a: TINY * mlp_loss(p, state, a, x, y), argnums=(0, 1))(
      p, fp8.zeros_amax(state)
    )
    updates, opt_state = opt.update(grads, opt_state)
    return optax.apply_updates(p, updates), fp8.update(state, amax, CONFIG), opt_state

  @functools.partial(jax.jit, static_argnums=2)
  def reference_step(p, opt_state, policy):  # bf16, or fp32 to check the bf16 run against
    loss = lambda p: (
      TINY * mlp_loss(policy.cast_to_compute(p), None, None, policy.cast_to_compute(x), y)
    )
    updates, opt_state = opt.update(policy.cast_to_param(jax.grad(loss)(p)), opt_state)
    return optax.apply_updates(p, updates), opt_state

  calibrate = jax.jit(
    lambda p, state: fp8.calibrate(lambda a: TINY * mlp_loss(p, state, a, x, y), state, CONFIG)
  )
  evaluate = jax.jit(lambda p: mlp_loss(p, None, None, x, y))  # float32, for both
  state = calibrate(params, init_mlp_state())
  fp8_run = (params, state, opt.init(params))
  bf16_run = fp32_run = (params, opt.init(params))
  start = float(evaluate(params))
  for step in range(10):
    fp8_run, bf16_run = fp8_step(*fp8_run), reference_step(*bf16_run, bf16)
    fp32_run = reference_step(*fp32_run, fp32)
    fp8_progress, bf16_progress, fp32_progress = (
      start - float(evaluate(run[0])) for run in (fp8_run, bf16_run, fp32_run)
    )
    # The reference makes fp32's progress to bf16 rounding (measured: within 0.04%).
    assert abs(bf16_progress - fp32_progress) <= 2**-8 * fp32_progress, (step, bf16_progress)
    assert abs(fp8_progress - bf16_progress) <= 0.1 * bf16_progress, (step, fp8_progress)


def test_calibrate_rejects_what_would_calibrate_nothing():
  x, k, t = matmul_data(1.0)
  state = fp8.init_dot_state(CONFIG)
  no_probe = lambda amax: matmul_loss(x, k, t, state, None, 1.0, 1.0)[0]
  with pytest.raises(ValueError, match="traced no fp8 matmul with an amax probe"):
    jax.eval_shape(lambda: fp8.calibrate(no_probe, state, CONFIG))
  # A jitted loss traced before keeps its compiled delayed-scaling program.
  traced_before = jax.jit(lambda amax: matmul_loss(x, k, t, state, amax, 1.0, 1.0)[0])
  jax.eval_shape(traced_before, fp8.zeros_amax(state))
  with pytest.raises(ValueError, match=r"not a jax\.jit function compiled before"):
    jax.eval_shape(lambda: fp8.calibrate(traced_before, state, CONFIG))
  with pytest.raises(ValueError, match="holds no Fp8DotState"):
    fp8.calibrate(no_probe, {}, CONFIG)
  with pytest.raises(TypeError, match="fun must be a function"):
    fp8.calibrate(state, state, CONFIG)
  with pytest.raises(TypeError, match="Expected Fp8DotState nodes"):
    fp8.calibrate(no_probe, {"scale": 1.0}, CONFIG)
