"""The fp8 matmul (jmp_lite/fp8/_matmul.py): exactness, error bounds, dtypes, loss scaling."""

import concurrent.futures
import functools
import inspect
import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jmp_lite as jl
from jmp_lite import fp8
from jmp_lite.fp8._matmul import DotOptions, DotSpec, scale_for

from .fp8_testing import (
  CONFIG,
  E4M3,
  E5M2,
  MATMUL,
  assert_close,
  init_mlp_state,
  mlp_data,
  mlp_init,
  mlp_loss,
  quantization_error,
  small_integers,
  unit_state,
  value_and_vjp,
)

# The matmul ----------------------------------------------------------------------------

DIMENSION_NUMBERS = [
  ((3, 4), (4, 5), MATMUL),
  ((4, 3), (4, 5), (((0,), (0,)), ((), ()))),  # lhs transposed
  ((2, 3, 4), (2, 4, 5), (((2,), (1,)), ((0,), (0,)))),  # batched
  ((3, 2, 4, 6), (6, 5, 4), (((2, 3), (2, 0)), ((), ()))),  # two contractions, permuted
  ((3, 2, 4), (5, 2, 3), (((0,), (2,)), ((1,), (1,)))),  # batch axes not leading
  ((3,), (4,), (((), ()), ((), ()))),  # outer product
]


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", DIMENSION_NUMBERS)
def test_dot_general_is_exact_on_representable_values(lhs_shape, rhs_shape, dims):
  """With exactly representable data the fp8 matmul and its VJP equal fp32's bit for bit."""
  x, k = small_integers(lhs_shape, 0, 4), small_integers(rhs_shape, 1, 4)
  state = unit_state()
  g = small_integers(jax.eval_shape(lambda: lax.dot_general(x, k, dims)).shape, 2, 4)
  got = value_and_vjp(lambda x, k: fp8.dot_general(x, k, dims, state), x, k, g)
  want = value_and_vjp(lambda x, k: lax.dot_general(x, k, dims), x, k, g)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def scaled_state(x, k, g, config):
  """The state delayed scaling reaches after one step that saw x, k and g."""
  state = fp8.init_dot_state(config)
  amax = fp8.Fp8DotAmax(*(fp8.compute_amax(t) for t in (x, k, g)))
  return fp8.update(state, amax, config)


@pytest.mark.parametrize("recipe", ["hybrid", "e4m3", "e5m2"])
def test_dot_general_error_within_format_bounds(recipe):
  """Forward and gradients are within the elementwise bound the formats imply.

  For y = x @ k with e_x, e_k the per-element quantization errors,
  |y_fp8 - y| <= e_x @ (|k| + e_k) + |x| @ e_k; the same for dx = g @ k.T, dk = x.T @ g.
  """
  config = fp8.get_fp8_policy(f"fp8=delayed:{recipe}", amax_history_length=4).config
  fwd, bwd = config.fwd_dtype, config.bwd_dtype
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((16, 32)) * 3, jnp.float32)
  k = jnp.asarray(rng.standard_normal((32, 8)) * 0.05, jnp.float32)
  g = jnp.asarray(rng.standard_normal((16, 8)) * 1e-3, jnp.float32)
  state = scaled_state(x, k, g, config)
  s_x, s_k, s_g = (float(t.scale) for t in state)
  y, (dx, dk) = value_and_vjp(
    lambda x, k: fp8.dot_general(x, k, MATMUL, state, config=config), x, k, g
  )
  xs, ks, gs = (np.asarray(t, np.float64) for t in (x, k, g))
  ex, ek = quantization_error(xs, s_x, fwd), quantization_error(ks, s_k, fwd)
  eg = quantization_error(gs, s_g, bwd)
  xq, kq, gq = dequantized(x, s_x, fwd), dequantized(k, s_k, fwd), dequantized(g, s_g, bwd)
  slack = 1e-5  # fp32 accumulation and the final rescale

  def check(got, a, b, aq, bq, bound):
    got, want = np.asarray(got, np.float64), a @ b
    err = np.abs(got - want)
    assert np.all(err <= bound + slack * np.abs(want).max()), np.max(err - bound)
    # The error is the quantization's: the result is the product of the quantized operands
    # (exact products, an fp32 sum of K terms, two fp32 scalings), which is not the exact one.
    fp32_error = (a.shape[1] + 2) * 2.0**-24 * (np.abs(aq) @ np.abs(bq))
    assert np.all(np.abs(got - aq @ bq) <= fp32_error), np.max(np.abs(got - aq @ bq) - fp32_error)
    assert not np.all(err <= fp32_error)

  check(y, xs, ks, xq, kq, ex @ (np.abs(ks) + ek) + np.abs(xs) @ ek)
  check(dx, gs, ks.T, gq, kq.T, eg @ (np.abs(ks) + ek).T + np.abs(gs) @ ek.T)
  check(dk, xs.T, gs, xq.T, gq, ex.T @ (np.abs(gs) + eg) + np.abs(xs).T @ eg)


def test_dot_general_observes_amax_through_the_probe():
  x = jnp.array([[1.0, -7.0], [2.0, 3.0]])
  k = jnp.array([[0.5], [-0.25]])
  state = unit_state()

  def loss(x, k, amax):
    return jnp.sum(fp8.dot_general(x, k, MATMUL, state, amax) * jnp.array([[3.0], [-5.0]]))

  observed = jax.jit(jax.grad(loss, argnums=2))(x, k, fp8.zeros_amax(state))
  # max |x|, max |k| and max |g| for the output gradient g = (3, -5)^T.
  expected = {"input": 7.0, "kernel": 0.5, "output_grad": 5.0}
  assert type(observed) is fp8.Fp8DotAmax and jax.tree.map(float, observed)._asdict() == expected
  # Without a probe nothing is observed, and the gradients are unchanged.
  with_probe = jax.grad(loss, argnums=(0, 1))(x, k, fp8.zeros_amax(state))
  without = jax.grad(lambda x, k: loss(x, k, None), argnums=(0, 1))(x, k)
  jax.tree.map(np.testing.assert_array_equal, with_probe, without)


def test_dot_general_dtypes_and_fp32_accumulation():
  state = unit_state()
  x = jnp.ones((2, 4096), jnp.bfloat16)
  k = jnp.full((4096, 1), 2.0**-8, jnp.bfloat16)

  @jax.jit
  def run(x, k):
    y = fp8.dot_general(x, k, MATMUL, state)
    y32 = fp8.dot_general(x, k, MATMUL, state, preferred_element_type=jnp.float32)
    grads = jax.grad(lambda x, k: fp8.dot_general(x, k, MATMUL, state).sum(), (0, 1))(x, k)
    return y, y32, grads

  y, y32, (dx, dk) = run(x, k)
  assert y.dtype == jnp.bfloat16 and float(y[0, 0]) == 16.0  # fp32 sum of 2^-8s: exact
  assert y32.dtype == jnp.float32
  assert dx.dtype == dk.dtype == jnp.bfloat16


def dequantized(v, scale, dtype):
  return np.asarray(fp8.quantize(v, scale, dtype), np.float64) * np.float64(scale)


@pytest.mark.parametrize("recipe", ["hybrid", "e4m3", "e5m2"])
def test_bf16_results_are_the_scaled_fp32_sum_rounded_once(recipe):
  """A bf16 result is the product of the quantized operands (exact products, an fp32 sum,
  scaled in fp32) rounded once to bf16, forward and both gradients."""
  config = fp8.get_fp8_policy(f"fp8=delayed:{recipe}", amax_history_length=4).config
  fwd, bwd = config.fwd_dtype, config.bwd_dtype
  rng = np.random.default_rng(7)
  bf16 = jnp.bfloat16
  x = jnp.asarray(rng.standard_normal((16, 64)) * 3, bf16)
  k = jnp.asarray(rng.standard_normal((64, 8)) * 0.05, bf16)
  g = jnp.asarray(rng.standard_normal((16, 8)) * 1e-3, bf16)
  state = scaled_state(x, k, g, config)  # amax / fp8_max: no short binary expansion
  y, (dx, dk) = value_and_vjp(
    lambda x, k: fp8.dot_general(x, k, MATMUL, state, config=config), x, k, g
  )
  assert y.dtype == dx.dtype == dk.dtype == bf16
  s_x, s_k, s_g = (float(t.scale) for t in state)
  xq, kq, gq = dequantized(x, s_x, fwd), dequantized(k, s_k, fwd), dequantized(g, s_g, bwd)
  for got, a, b in ((y, xq, kq), (dx, gq, kq.T), (dk, xq.T, gq)):
    want = a @ b  # float64
    got = np.asarray(got, np.float64)
    half_ulp = np.exp2(np.floor(np.log2(np.abs(want))) - 8)  # bf16: 8 significant bits
    fp32_error = (a.shape[1] + 2) * 2.0**-24 * (np.abs(a) @ np.abs(b))  # sum, then 2 scalings
    assert np.all(np.abs(got - want) <= half_ulp + fp32_error)


def hlo_instructions(fun, *args):
  """name -> (result type, opcode, operand names, attributes) of a lowered program's HLO."""
  text = jax.jit(fun).lower(*args).as_text(dialect="hlo")
  pattern = re.compile(r"^\s*(?:ROOT )?([\w.-]+) = (\S+?)(?:\{[\d,]*\})? ([\w-]+)\(([^)]*)\)(.*)$")
  out = {}
  for line in text.splitlines():
    if m := pattern.match(line):
      name, result, opcode, operands, rest = m.groups()
      out[name] = (result, opcode, [o.strip() for o in operands.split(",") if o.strip()], rest)
  return out


@pytest.mark.parametrize(
  "fast, forward, backward",
  [
    ("none", "highest", "highest"),
    ("forward", "default", "highest"),
    ("all", "default", "default"),
  ],
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matmuls_are_in_the_form_xla_gpu_fuses_into_fp8_gemms(fast, forward, backward, dtype):
  """The HLO form XLA:GPU turns into one cuBLASLt fp8 GEMM, its scale included.

  Every dot takes the fp8 arrays themselves (not ``convert(fp8) * scale``: XLA:GPU removes
  that round trip and runs a bf16 GEMM on unquantized values) and its f32 result is multiplied
  by a scalar broadcast (the GEMM's output scale); the kernel gradient comes out in the
  kernel's layout (no transpose). The precision selects fast accumulation.
  """
  config = fp8.Fp8Config(amax_history_length=2, fast_accumulation=fast)
  state = fp8.init_dot_state(config)
  dense = (((2,), (0,)), ((), ()))
  x, k, g = jnp.ones((2, 8, 16), dtype), jnp.ones((16, 32), dtype), jnp.ones((2, 8, 32), dtype)
  fun = lambda x, k, g, s: value_and_vjp(
    lambda x, k: fp8.dot_general(x, k, dense, s, config=config), x, k, g
  )
  instructions = hlo_instructions(fun, x, k, g, state)
  dots = {n: i for n, i in instructions.items() if i[1] == "dot"}
  assert len(dots) == 3
  # HLO prints no operand_precision for DEFAULT.
  precisions = sorted(
    (re.findall(r"operand_precision=\{(\w+),", i[3]) or ["default"])[0] for i in dots.values()
  )
  assert precisions == sorted([forward, backward, backward])
  formats = []
  for dot, (result, _, operands, _) in dots.items():
    assert result.startswith("f32[")
    formats.append(sorted(instructions[o][0].split("[")[0] for o in operands))
    users = [i for i in instructions.values() if dot in i[2]]
    assert [u[1] for u in users] == ["multiply"]
    assert [instructions[o][1] for o in users[0][2] if o != dot] == ["broadcast"]
  both = ["f8e4m3fn", "f8e5m2"]
  assert sorted(formats) == [["f8e4m3fn", "f8e4m3fn"], both, both]
  assert not [i for i in instructions.values() if i[1] == "transpose" and i[0].startswith("f32")]


def test_dot_general_rejects_bad_arguments():
  state = unit_state()
  x = jnp.ones((2, 3))
  with pytest.raises(TypeError, match="floating-point array, got dtype int32"):
    fp8.dot_general(jnp.ones((2, 3), jnp.int32), x.T, MATMUL, state)
  with pytest.raises(ValueError, match=r"16 or 32 bits .* float8_e4m3fn"):
    fp8.dot_general(x.astype(E4M3), x.T, MATMUL, state)
  with pytest.raises(TypeError, match="state must be an Fp8DotState"):
    fp8.dot_general(x, x.T, MATMUL, {"scale": 1.0})
  with pytest.raises(TypeError, match="amax must be an Fp8DotAmax"):
    fp8.dot_general(x, x.T, MATMUL, state, (0.0, 0.0, 0.0))
  with pytest.raises(ValueError, match="Invalid rhs dimensions"):
    fp8.dot_general(x, x.T, (((1,), (2,)), ((), ())), state)
  with pytest.raises(ValueError, match="dimension_numbers must be"):
    fp8.dot_general(x, x.T, ((1, 0),), state)
  with pytest.raises(TypeError, match="config must be an fp8 recipe"):
    fp8.dot_general(x, x.T, MATMUL, state, config="hybrid")
  with pytest.raises(ValueError, match=r"loss_scale must be a scalar, got shape \(2,\)"):
    fp8.dot_general(x, x.T, MATMUL, state, loss_scale=jnp.ones(2))
  bad = state._replace(input=fp8.Fp8ScaleState(jnp.ones(3), jnp.zeros(2)))
  with pytest.raises(ValueError, match=r"state\.input\.scale must be a scalar"):
    fp8.dot_general(x, x.T, MATMUL, bad)


def test_dot_general_under_vmap_and_jit():
  state = unit_state()
  xs, k = small_integers((5, 3, 4), 4, 3), small_integers((4, 2), 5, 3)
  f = jax.jit(jax.vmap(lambda x: fp8.dot_general(x, k, MATMUL, state)))
  np.testing.assert_array_equal(f(xs), jnp.einsum("bij,jk->bik", xs, k))


def test_einsum_takes_exactly_the_keyword_options_of_dot_general():
  """einsum passes its options on to dot_general: the two keyword lists cannot drift apart."""
  keyword_only = [
    name
    for name, p in inspect.signature(fp8.dot_general).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
  ]
  assert list(DotOptions.__annotations__) == keyword_only
  state = unit_state()
  x = jnp.ones((2, 3))
  with pytest.raises(TypeError, match="unexpected keyword argument 'precison'"):
    fp8.einsum("ij,jk->ik", x, x.T, state, precison=None)
  y = fp8.einsum("ij,jk->ik", x, x.T, state, preferred_element_type=jnp.bfloat16)
  assert y.dtype == jnp.bfloat16 and y.tolist() == [[3.0, 3.0], [3.0, 3.0]]


def test_current_scaling_scopes_nest_and_stay_in_their_thread():
  """Every open scope counts an op traced inside; another thread sees none of them."""
  state = unit_state()
  x, k = jnp.full((1, 1), 896.0), jnp.full((1, 1), 448.0)  # 896 saturates E4M3 at scale 1
  exact, saturated = 896.0 * 448.0, 448.0 * 448.0

  def traced(probe):
    return float(fp8.dot_general(x, k, MATMUL, state, probe)[0, 0])

  probe = fp8.zeros_amax(state)
  with fp8.current_scaling() as outer:
    assert traced(probe) == exact  # its own scale: exact
    with fp8.current_scaling() as inner:
      assert traced(probe) == exact
      assert traced(None) == exact  # current scaling without a probe, counted by neither
      with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(traced, probe).result() == saturated  # delayed: saturated
  assert (outer.probed_ops, inner.probed_ops) == (2, 1)
  assert traced(probe) == saturated


def _depends_on_input(jaxpr):
  """Whether the closed jaxpr's (only) output is computed from its (only) input."""
  reached = set(jaxpr.jaxpr.invars)
  for eqn in jaxpr.jaxpr.eqns:
    if any(v in reached for v in eqn.invars if not isinstance(v, jax.extend.core.Literal)):
      reached.update(eqn.outvars)
  return jaxpr.jaxpr.outvars[0] in reached


@pytest.mark.parametrize("first_step", ["own_amax", "calibrated"])
def test_calibrated_delayed_scale_reads_nothing_of_the_tensor(first_step):
  """The quantization's scale depends on the tensor's amax only under the default first step
  (a select in every step); a calibrated state's scale is the state's."""
  spec = DotSpec(
    MATMUL, E4M3, E5M2, *(np.dtype(jnp.float32),) * 3, None, frozenset(), False, 0.0,
    lax.Precision.HIGHEST, lax.Precision.HIGHEST, trust_state=first_step == "calibrated",
  )  # fmt: skip
  jaxpr = jax.make_jaxpr(lambda amax: scale_for(jnp.float32(0.5), amax, E4M3, spec))(1.0)
  assert _depends_on_input(jaxpr) == (first_step == "own_amax")


# Interaction with loss scaling ---------------------------------------------------------


TX = jl.loss_scaling(optax.sgd(0.05), jl.NoOpLossScale())  # the loss scale is set per run


@functools.partial(jax.jit, static_argnames="tell_fp8")
def loss_scaled_step(params, state, opt_state, x, y, tell_fp8):
  scale = jl.get_loss_scale(opt_state)

  def loss_fn(p, amax):
    loss = mlp_loss(p, state, amax, x, y, loss_scale=scale if tell_fp8 else None)
    return scale.scale(loss)

  grads, amax = jax.grad(loss_fn, argnums=(0, 1))(params, fp8.zeros_amax(state))
  updates, opt_state = TX.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), fp8.update(state, amax, CONFIG), opt_state, amax


def train_with_loss_scaling(loss_scale, steps, x, y, *, tell_fp8=True):
  params, state = mlp_init(), init_mlp_state()
  opt_state = TX.init(params)._replace(loss_scale=loss_scale)
  history = []
  for _ in range(steps):
    params, state, opt_state, amax = loss_scaled_step(params, state, opt_state, x, y, tell_fp8)
    history.append(amax)
  return params, state, opt_state, history


def test_fp8_scales_and_loss_scale_compose_exactly():
  """A power-of-two loss scale changes no fp8 value: same params and fp8 state as without."""
  x, y = mlp_data(32)
  plain = train_with_loss_scaling(jl.StaticLossScale(jnp.float32(1)), 4, x, y)
  scaled = train_with_loss_scaling(jl.StaticLossScale(jnp.float32(2.0**14)), 4, x, y)
  for a, b in zip(plain[:2], scaled[:2], strict=True):
    jax.tree.map(np.testing.assert_array_equal, a, b)
  assert float(plain[1]["l2"].output_grad.scale) != 1.0  # the gradient scale did adapt
  # Told nothing, the ops would record the scaled gradients' amax: 2^14 times larger.
  unaware = train_with_loss_scaling(
    jl.StaticLossScale(jnp.float32(2.0**14)), 1, x, y, tell_fp8=False
  )
  np.testing.assert_allclose(
    unaware[3][0]["l2"].output_grad, plain[3][0]["l2"].output_grad * 2.0**14, rtol=1e-6
  )


def test_overflow_skips_the_step_and_leaves_gradient_scales_alone():
  x, y = mlp_data(32)
  y = y + 1e4  # large errors, so the scaled output gradients overflow float32
  loss_scale = jl.DynamicLossScale(jnp.float32(2.0**126), period=1000)
  params, state, opt_state, history = train_with_loss_scaling(loss_scale, 1, x, y)
  ls_state = jl.get_loss_scaling_state(opt_state)
  assert not bool(ls_state.last_finite) and int(ls_state.skipped_steps) == 1
  assert float(ls_state.loss_scale.loss_scale) == 2.0**125
  jax.tree.map(np.testing.assert_array_equal, params, mlp_init())  # nothing applied
  fresh = init_mlp_state()
  for name in ("l1", "l2"):
    assert not np.isfinite(history[0][name].output_grad)  # inf stayed inf through fp8
    assert_close(state[name].output_grad, fresh[name].output_grad, rtol=0)  # ... not recorded
    # The forward pass was fine: its input amax was recorded as observed.
    assert float(state[name].input.amax_history[0]) == float(history[0][name].input)
  assert float(history[0]["l1"].input) == float(fp8.compute_amax(x))
  # With the scale backed off enough, the next steps are finite and train.
  params, state, opt_state, _ = train_with_loss_scaling(
    jl.DynamicLossScale(jnp.float32(2.0**10)), 2, x, y
  )
  assert bool(jl.get_loss_scaling_state(opt_state).last_finite)


@pytest.mark.parametrize(
  ("loss_scale", "error", "match"),
  [
    (jl.LayerwiseLossScale([0, 1]), TypeError, "gives each stage its own scale"),
    (0.0, ValueError, "positive"),
    (True, TypeError, "got bool"),
    (jnp.ones(2), ValueError, r"loss_scale must be a scalar, got shape \(2,\)"),
  ],
)
def test_dot_general_refuses_loss_scales_it_cannot_use(loss_scale, error, match):
  x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
  with pytest.raises(error, match=match):
    fp8.dot_general(x, w, MATMUL, fp8.init_dot_state(), loss_scale=loss_scale)


def test_an_fp8_state_initialized_after_a_donated_update_has_buffers_of_its_own():
  config = fp8.Fp8Config(amax_history_length=2)
  observed = fp8.Fp8DotAmax(jnp.float32(896.0), jnp.float32(0.0), jnp.float32(3584.0))
  update = jax.jit(lambda state: fp8.update(state, observed, config), donate_argnums=0)
  donated = fp8.init_dot_state(config)
  first = update(donated)
  assert donated.input.scale.is_deleted()  # the update consumed it
  fresh = fp8.init_dot_state(config)  # a second run
  assert [float(t.scale) for t in fresh] == [0.0, 0.0, 0.0]
  second = update(fresh)
  assert [float(t.scale) for t in second] == [2.0, 0.0, 0.0625]
  jax.tree.map(np.testing.assert_array_equal, second, first)
