"""fp8 for Flax layers (linen and NNX), and agreement with flax.linen.fp8_ops."""

import concurrent.futures
import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import fp8_ops

import jmp_lite as jl
from jmp_lite import fp8
from jmp_lite.flax import fp8 as flax_fp8

CONFIG = fp8.Fp8Config(amax_history_length=4)
DENSE = (((1,), (0,)), ((), ()))


class Layers(nn.Module):
  """One of each layer, each applied to its own input, returning every output."""

  @nn.compact
  def __call__(self, x):
    return {
      "dense": nn.Dense(5, name="dense")(x),
      "general": nn.DenseGeneral((2, 3), name="general")(x),
      "einsum": nn.Einsum((4, 2, 3), "bd,dhf->bhf", name="einsum")(x),
      # A user-chosen matmul is left alone.
      "own": nn.Dense(5, dot_general=jax.lax.dot_general, name="own")(x),
    }


def inputs(seed=0, shape=(6, 4)):
  # NumPy, not jax.random: eager jax.random compiles op by op, seconds on a busy CPU.
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * 2, jnp.float32)


def linen_init(model, x, fp8_spec=CONFIG):
  def init(x):
    with flax_fp8.linen_fp8(fp8_spec, placement=fp8.ALL_LAYERS):
      return model.init(jax.random.key(0), x)

  return jax.jit(init)(x)  # one compiled program: faster than op-by-op on CPU


def linen_init_shapes(model, x, fp8_spec=CONFIG):
  """The variables' shapes only (nothing is compiled)."""

  def init(x):
    with flax_fp8.linen_fp8(fp8_spec, placement=fp8.ALL_LAYERS):
      return model.init(jax.random.key(0), x)

  return jax.eval_shape(init, x)


def materialize(shapes, seed=0):
  """Variables for the shapes of an init (nothing compiled): random parameters (biases
  too, so the tests see them added) and the initial fp8 state (scale 1, zero history)."""
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    key = jax.tree_util.keystr(path)
    if "amax_history" in key:
      return jnp.zeros(leaf.shape, leaf.dtype)
    if "scale" in key:
      return jnp.ones(leaf.shape, leaf.dtype)
    return jnp.asarray(rng.standard_normal(leaf.shape) * 0.3, leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, shapes)


@functools.cache
def layers_variables():
  """Variables of the Layers model on inputs(), made once for the file."""
  return materialize(linen_init_shapes(Layers(), inputs()))


# linen ---------------------------------------------------------------------------------


def test_linen_interception_creates_state_and_keeps_params():
  x = inputs()

  @jax.jit
  def both(x):
    with flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS):
      ours = Layers().init(jax.random.key(0), x)
    return ours, Layers().init(jax.random.key(0), x)

  variables, plain = both(x)
  # The same parameters (names, shapes, initial values) as the plain model.
  assert jax.tree.structure(variables["params"]) == jax.tree.structure(plain["params"])
  jax.tree.map(np.testing.assert_array_equal, variables["params"], plain["params"])
  state = variables[flax_fp8.STATE_COLLECTION]
  assert set(state) == {"dense", "general", "einsum"}  # not the layer with its own matmul
  for layer in state.values():
    assert isinstance(layer[flax_fp8.VARIABLE_NAME], fp8.Fp8DotState)
    assert layer[flax_fp8.VARIABLE_NAME].input.amax_history.shape == (4,)


@jax.jit
def linen_outputs_and_observations(variables, x):
  params, state = variables["params"], variables[flax_fp8.STATE_COLLECTION]

  def loss(params, amax):
    with flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS):
      out = Layers().apply({"params": params, "fp8_state": state, "fp8_amax": amax}, x)
    return sum(jnp.sum(v * (i + 1)) for i, v in enumerate(out.values())), out

  (grads, amax), out = jax.grad(loss, argnums=(0, 1), has_aux=True)(params, fp8.zeros_amax(state))
  return out, grads, amax


def test_linen_layers_compute_the_fp8_matmul():
  x = inputs()
  variables = dict(layers_variables())  # a copy: the cached one is shared
  # Non-trivial scales, as after some training.
  state = jax.tree.map(lambda s: s, variables["fp8_state"])
  amax = jax.tree.map(lambda z: z + 3.0, fp8.zeros_amax(state))
  variables["fp8_state"] = state = fp8.update(state, amax, CONFIG)
  out, grads, observed = linen_outputs_and_observations(variables, x)
  p = variables["params"]

  def layer_state(name):
    return state[name][flax_fp8.VARIABLE_NAME]

  expected = {
    "dense": fp8.dot_general(x, p["dense"]["kernel"], DENSE, layer_state("dense"))
    + p["dense"]["bias"],
    "general": fp8.dot_general(x, p["general"]["kernel"], DENSE, layer_state("general"))
    + p["general"]["bias"],
    "einsum": fp8.einsum("bd,dhf->bhf", x, p["einsum"]["kernel"], layer_state("einsum"))
    + p["einsum"]["bias"][None],
    "own": x @ p["own"]["kernel"] + p["own"]["bias"],
  }
  for name in expected:  # equal up to the last bit (XLA may fuse the rescale and bias add)
    np.testing.assert_allclose(out[name], expected[name], rtol=1e-6, atol=1e-6, err_msg=name)
  # Every fp8 layer observed its input and kernel amax and its output gradient (i + 1).
  for i, name in enumerate(["dense", "general", "einsum"]):
    obs = observed[name][flax_fp8.VARIABLE_NAME]
    assert float(obs.input) == float(jnp.abs(x).max())
    assert float(obs.kernel) == float(jnp.abs(p[name]["kernel"]).max())
    assert float(obs.output_grad) == i + 1
  assert set(grads) == set(p)


def test_linen_apply_needs_the_state_but_not_the_probes():
  x = inputs()
  variables = layers_variables()
  with flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS):
    out = Layers().apply(variables, x)  # evaluation: no probes, nothing observed
    with pytest.raises(ValueError, match="dense runs in fp8 but has no 'fp8_state'"):
      Layers().apply({"params": variables["params"]}, x)
    # With a mutable collection, apply creates the state (e.g. for a model built later).
    _, created = Layers().apply({"params": variables["params"]}, x, mutable=["fp8_state"])
  p, state = variables["params"]["dense"], variables["fp8_state"]["dense"]["fp8_dot"]
  want = fp8.dot_general(x, p["kernel"], DENSE, state) + p["bias"]
  np.testing.assert_allclose(out["dense"], want, rtol=1e-6, atol=1e-6)
  assert set(created["fp8_state"]) == {"dense", "general", "einsum"}
  fresh = fp8.init_dot_state(CONFIG)
  for layer in created["fp8_state"].values():
    jax.tree.map(np.testing.assert_array_equal, layer[flax_fp8.VARIABLE_NAME], fresh)


def test_linen_interceptor_composes_with_an_inner_interceptor():
  """An interceptor registered inside (e.g. a precision policy's casts) sees every call."""
  seen = []

  def double_inputs(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and context.module.path:
      seen.append((context.module.path[-1], type(context.module).__name__))
      args = jax.tree.map(lambda a: a * 2, args)
    return next_fun(*args, **kwargs)

  @jax.jit
  def apply_both(variables, x):
    with flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS):
      plain = Layers().apply(variables, x)
      with nn.intercept_methods(double_inputs):
        return Layers().apply(variables, x), plain

  out, plain = apply_both(layers_variables(), inputs())
  assert sorted(seen) == [
    ("dense", "Dense"),
    ("einsum", "_LinenFp8Einsum"),
    ("general", "DenseGeneral"),
    ("own", "Dense"),
  ]
  p = layers_variables()["params"]
  for name in ("dense", "general", "einsum"):  # the doubled inputs reached the fp8 matmuls
    bias = p[name]["bias"]
    np.testing.assert_allclose(out[name] - bias, 2 * (plain[name] - bias), rtol=0.2, atol=0.05)


def test_linen_einsum_bias_shapes_and_errors_match_flax():
  def ours(layer, x):
    with flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS):
      variables = layer.init(jax.random.key(0), x)
      return variables, layer.apply(variables, x)

  for eq, kernel_shape, x_shape in [
    ("bhd,hdf->bhf", (2, 4, 3), (5, 2, 4)),
    ("...d,df->...f", (4, 3), (2, 5, 4)),
    ("btd,dnh->btnh", (4, 2, 3), (2, 5, 4)),
  ]:
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32)  # shapes only: nothing is compiled
    layer = nn.Einsum(kernel_shape, eq)
    plain = jax.eval_shape(layer.init, jax.random.key(0), x)
    variables, y = jax.eval_shape(functools.partial(ours, layer), x)
    assert variables["params"] == plain["params"]
    assert y == jax.eval_shape(layer.apply, plain, x)
  with (
    flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS),
    pytest.raises(ValueError, match="must be explicit"),
  ):
    nn.Einsum((4, 3), "bd,df").init(jax.random.key(0), inputs())


def test_linen_scan_over_layers_stacks_state_and_probes():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return jnp.tanh(nn.Dense(4)(h)), None

  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      axes = {"params": 0, flax_fp8.STATE_COLLECTION: 0, flax_fp8.AMAX_COLLECTION: 0}
      scan = nn.scan(Block, variable_axes=axes, split_rngs={"params": True}, length=3)
      return scan()(x, None)[0]

  x = inputs()
  variables = linen_init(Stack(), x)
  state = variables["fp8_state"]
  dot = jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, fp8.Fp8DotState))[0]
  assert dot.input.scale.shape == (3,) and dot.input.amax_history.shape == (3, 4)

  @jax.jit
  def step(params, state):
    def loss(params, amax):
      with flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS):
        out = Stack().apply({"params": params, "fp8_state": state, "fp8_amax": amax}, x)
      return jnp.sum(out)

    amax = jax.grad(loss, argnums=1)(params, fp8.zeros_amax(state))
    return amax, fp8.update(state, amax, CONFIG)

  amax, new_state = step(variables["params"], state)
  obs = jax.tree.leaves(amax, is_leaf=lambda s: isinstance(s, fp8.Fp8DotAmax))[0]
  assert obs.input.shape == (3,)
  assert float(obs.input[0]) == float(jnp.abs(x).max())  # layer 0 saw x, the others tanh(...)
  assert float(obs.input[1]) <= 1.0 and float(obs.input[2]) <= 1.0
  new = jax.tree.leaves(new_state, is_leaf=lambda s: isinstance(s, fp8.Fp8DotState))[0]
  np.testing.assert_allclose(new.input.scale, obs.input / 448, rtol=1e-6)


def test_linen_explicit_dot_general_injection_equals_interception():
  x = inputs()
  dense = nn.Dense(5, dot_general_cls=functools.partial(flax_fp8.LinenFp8DotGeneral, config=CONFIG))
  injected = dense.init(jax.random.key(0), x)
  (state,) = jax.tree.leaves(
    injected["fp8_state"], is_leaf=lambda s: isinstance(s, fp8.Fp8DotState)
  )
  assert "LinenFp8DotGeneral_0" in injected["fp8_state"]
  state = fp8.update(state, fp8.Fp8DotAmax(*[jnp.float32(5.0)] * 3), CONFIG)
  injected["fp8_state"] = {"LinenFp8DotGeneral_0": {"fp8_dot": state}}
  with flax_fp8.linen_fp8(
    CONFIG, placement=fp8.ALL_LAYERS
  ):  # interception leaves a layer with its own matmul alone
    y = dense.apply(injected, x)
  p = injected["params"]
  np.testing.assert_array_equal(y, fp8.dot_general(x, p["kernel"], DENSE, state) + p["bias"])


POLICY_RECIPES = {
  "current": fp8.CurrentScaling(),
  "delayed": fp8.DelayedScaling(),
  "rowwise": fp8.RowwiseScaling(),
  "block": fp8.BlockScaling(),
  "mxfp8": fp8.Mxfp8Scaling(),
}


@pytest.mark.parametrize("name", POLICY_RECIPES)
def test_linen_and_nnx_run_a_policy_recipe_as_the_recipe_itself(name):
  """``fp8=<name>`` through linen_fp8 and nnx_fp8: the program (so the loss and the gradients,
  bit for bit) of the recipe passed directly, and not the fp32 layer's."""
  x = inputs(shape=(8, 64))
  model = nn.Dense(16)

  def linen_step(spec, variables):
    def loss(params):
      with flax_fp8.linen_fp8(spec, placement=fp8.ALL_LAYERS):
        return jnp.sum(model.apply({**variables, "params": params}, x) ** 2)

    return jax.value_and_grad(loss)(variables["params"])

  def nnx_out(spec):
    layer = nnx.Linear(64, 16, rngs=nnx.Rngs(0))
    return flax_fp8.nnx_fp8(layer, spec, placement=fp8.ALL_LAYERS)(x)

  recipe, spelled = POLICY_RECIPES[name], f"p=f32,c=f32,o=f32,fp8={name}"
  variables = materialize(linen_init_shapes(model, x, recipe))  # delayed: a state of scales 1
  assert variables.keys() == ({"params", "fp8_state"} if name == "delayed" else {"params"})
  # The same program, equation for equation, computes the same values bit for bit: comparing
  # the traced programs checks that without compiling each spelling (seconds per recipe).
  program = lambda fn, *args: str(jax.make_jaxpr(fn, static_argnums=0)(*args))
  assert program(linen_step, spelled, variables) == program(linen_step, recipe, variables)
  assert program(nnx_out, spelled) == program(nnx_out, recipe)

  @jax.jit
  def loss_and_fp32_loss(variables):
    fp32_loss = jnp.sum(model.apply({"params": variables["params"]}, x) ** 2)
    return linen_step(recipe, variables)[0], fp32_loss

  loss, fp32_loss = loss_and_fp32_loss(variables)
  assert float(loss) != float(fp32_loss)


def test_linen_fp8_policy_spellings():
  x = inputs()
  off = linen_init_shapes(Layers(), x, "p=f32,c=f32,o=f32,fp8=none")
  assert "fp8_state" not in off
  policy = fp8.get_fp8_policy("p=f32,c=f32,o=f32,fp8=delayed", amax_history_length=3)
  on = linen_init_shapes(Layers(), x, policy)
  assert set(on["fp8_state"]) == {"dense", "general", "einsum"}
  history = on["fp8_state"]["dense"][flax_fp8.VARIABLE_NAME].output_grad.amax_history
  assert history.shape == (3,)  # the policy's config made the state
  # The fp8 compute dtype spelling, which jmp_lite.get_policy parses, is the default recipe,
  # current scaling, which keeps no state.
  spelled = linen_init_shapes(Layers(), x, "p=f32,c=f8e4m3")
  assert spelled == linen_init_shapes(Layers(), x, fp8.CurrentScaling())
  assert "fp8_state" not in spelled
  with pytest.raises(TypeError, match="Expected an fp8 recipe"):
    flax_fp8.linen_interceptor(3)


def test_linen_ops_take_the_loss_scale_linen_fp8_is_given():
  """Each interceptor gives the ops it runs its own loss scale."""
  x = inputs()
  dense = nn.Dense(3)
  variables = linen_init(dense, x)

  def observed_grad_amax(*loss_scales, direct=False):
    def loss(amax):
      with contextlib.ExitStack() as stack:
        for loss_scale in loss_scales:  # nested, outermost first
          if direct:
            interceptor = flax_fp8.linen_interceptor(
              CONFIG, placement=fp8.ALL_LAYERS, loss_scale=loss_scale
            )
            stack.enter_context(nn.intercept_methods(interceptor))
          else:
            stack.enter_context(
              flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS, loss_scale=loss_scale)
            )
        y = dense.apply({**variables, flax_fp8.AMAX_COLLECTION: amax}, x)
      return jnp.sum(y) * 8.0  # output gradients of 8: a loss scaled by 8

    probes = fp8.zeros_amax(variables[flax_fp8.STATE_COLLECTION])
    return float(jax.grad(loss)(probes)[flax_fp8.VARIABLE_NAME].output_grad)

  assert observed_grad_amax(None) == 8.0  # loss scale 1
  assert observed_grad_amax(8.0) == 1.0  # recorded unscaled
  assert observed_grad_amax(8.0, direct=True) == 1.0  # the raw interceptor takes it too
  assert observed_grad_amax(jl.StaticLossScale(jnp.float32(8.0))) == 1.0
  # Nested, the outer linen_fp8 runs the layers (Flax calls it first), with its own loss scale.
  assert observed_grad_amax(2.0, jl.StaticLossScale(jnp.float32(8.0))) == 4.0
  assert observed_grad_amax(None, 8.0) == 8.0
  with flax_fp8.linen_fp8(CONFIG, loss_scale=4.0):  # registered in this thread only
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      assert pool.submit(observed_grad_amax, None).result() == 8.0


# The Dense of the explicit-injection tests: kernel, bias, the state (scales 1), the input, and
# output-gradient weights whose products with a loss scale of 3 divide back exactly.
INJECTED_S = 3.0


def injected_dense_case():
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.choice([-1.0, -0.5, 0.25, 0.75, 1.0], (6, 3)), jnp.float32)
  kernel = jnp.asarray(np.random.default_rng(2).standard_normal((4, 3)) * 0.3, jnp.float32)
  bias = jnp.asarray(np.random.default_rng(3).standard_normal((3,)) * 0.3, jnp.float32)
  one = fp8.init_scale_state(4)._replace(scale=jnp.float32(1.0))
  return {"kernel": kernel, "bias": bias}, fp8.Fp8DotState(one, one, one), w


def injected_grads(loss_scale):
  """Gradients (params, probe) of a Dense with an injected LinenFp8DotGeneral."""
  x = inputs()
  params, state, w = injected_dense_case()
  op = functools.partial(flax_fp8.LinenFp8DotGeneral, config=CONFIG, loss_scale=loss_scale)
  dense = nn.Dense(3, dot_general_cls=op)
  child = "LinenFp8DotGeneral_0"

  def loss(params, amax):
    variables = {
      "params": params,
      flax_fp8.STATE_COLLECTION: {child: {flax_fp8.VARIABLE_NAME: state}},
      flax_fp8.AMAX_COLLECTION: {child: {flax_fp8.VARIABLE_NAME: amax}},
    }
    return jnp.sum(dense.apply(variables, x) * w) * INJECTED_S

  return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, fp8.zeros_amax(state))


def test_linen_injected_op_takes_the_loss_scale_as_a_field():
  """Bit for bit fp8.dot_general with the loss scale, and the old loss-scale scope's values."""
  x = inputs()
  params, state, w = injected_dense_case()

  def reference(params, amax):
    y = fp8.dot_general(
      x, params["kernel"], DENSE, state, amax, config=CONFIG, loss_scale=INJECTED_S
    )
    return jnp.sum((y + params["bias"]) * w) * INJECTED_S

  want = jax.jit(jax.grad(reference, argnums=(0, 1)))(params, fp8.zeros_amax(state))
  got = injected_grads(INJECTED_S)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  grads, amax = got
  # What the Dense gave inside flax_fp8.loss_scale_scope(3.0), the scope this field replaces.
  assert [float(a) for a in amax] == [4.65006160736084, 0.7324402332305908, 1.0]
  np.testing.assert_array_equal(
    grads["kernel"],
    [
      [0.9375, -18.0, 4.125],
      [-1.78125, -6.9375, 3.609375],
      [6.1875, -18.46875, -6.9375],
      [5.80078125, -2.16796875, -8.90625],
    ],
  )
  # Without it the output gradient is taken as unscaled: its amax is recorded times 3.
  assert float(injected_grads(None)[1].output_grad) == 3.0
  with pytest.raises(TypeError, match=r"loss_scale must be .*LossScale, got str\."):
    injected_grads("3")


# NNX -----------------------------------------------------------------------------------


class NnxLayers(nnx.Module):
  def __init__(self, rngs):
    self.dense = nnx.Linear(4, 5, rngs=rngs)
    self.general = nnx.LinearGeneral(4, (2, 3), rngs=rngs)
    self.einsum = nnx.Einsum("bd,dhf->bhf", (4, 2, 3), (2, 3), rngs=rngs)
    self.own = nnx.Linear(4, 5, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k), rngs=rngs)

  def __call__(self, x):
    return {name: getattr(self, name)(x) for name in ("dense", "general", "einsum", "own")}


@functools.cache
def nnx_abstract():
  """The fp8 NnxLayers model's shapes (nothing is computed: eager initializers compile op by
  op, seconds on a busy CPU)."""
  return nnx.eval_shape(
    lambda: flax_fp8.nnx_fp8(NnxLayers(nnx.Rngs(0)), CONFIG, placement=fp8.ALL_LAYERS)
  )


def nnx_like_linen(variables):
  """An fp8 NNX model with the linen model's parameters and a fresh fp8 state."""
  graphdef, state = nnx.split(nnx_abstract())

  def fill(path, leaf):
    layer, *_, name = (k.key for k in path)
    if name in ("kernel", "bias"):
      return variables["params"][layer][name]
    return jnp.asarray((np.ones if name.endswith("_scale") else np.zeros)(leaf.shape, leaf.dtype))

  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state)))
  return nnx.merge(graphdef, state)


def nnx_loss(model, x):
  return sum(jnp.sum(v * (i + 1)) for i, v in enumerate(model(x).values()))


def test_nnx_fp8_installs_ops_and_matches_linen():
  x = inputs()
  variables = layers_variables()
  model = nnx_like_linen(variables)
  assert isinstance(model.dense.dot_general, flax_fp8.NnxFp8DotGeneral)
  assert isinstance(model.general.dot_general, flax_fp8.NnxFp8DotGeneral)
  assert isinstance(model.einsum.einsum_op, flax_fp8.NnxFp8Einsum)
  assert not isinstance(model.own.dot_general, flax_fp8.NnxFp8DotGeneral)
  assert flax_fp8.nnx_fp8(model, CONFIG, placement=fp8.ALL_LAYERS) is model  # idempotent
  assert isinstance(model.dense.dot_general, flax_fp8.NnxFp8DotGeneral)
  linen_out, linen_grads, linen_amax = linen_outputs_and_observations(variables, x)
  nnx_out = model(x)
  for name in linen_out:
    np.testing.assert_array_equal(nnx_out[name], linen_out[name], err_msg=name)

  @nnx.jit
  def step(model, x):
    return flax_fp8.nnx_value_and_grad(nnx_loss)(model, x)

  _, grads = step(model, x)
  assert not nnx.state(grads, flax_fp8.Fp8Amax)  # only parameter gradients come back
  for name in ("dense", "general", "einsum", "own"):
    for param in ("kernel", "bias"):
      np.testing.assert_array_equal(
        grads[name][param].get_value(), linen_grads[name][param], err_msg=f"{name}.{param}"
      )
  # The observations were folded into the state in place, like fp8.update on linen's.
  expected = fp8.update(variables["fp8_state"], linen_amax, CONFIG)
  for name, op in (("dense", model.dense.dot_general), ("einsum", model.einsum.einsum_op)):
    jax.tree.map(  # computed by two programs: equal up to the last bit
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
      op.dot_state,
      expected[name][flax_fp8.VARIABLE_NAME],
    )
    assert all(float(a) == 0 for a in op.amax)  # probes reset


def test_nnx_value_and_grad_with_loss_scale():
  x = inputs()
  plain, scaled = (nnx_like_linen(layers_variables()) for _ in range(2))

  @nnx.jit(static_argnums=2)
  def step(model, x, loss_scale):
    fn = flax_fp8.nnx_value_and_grad(
      nnx_loss, has_aux=False, loss_scale=None if loss_scale is None else 2.0**loss_scale
    )
    return fn(model, x)

  value, grads = step(plain, x, None)
  scaled_value, scaled_grads = step(scaled, x, 12)
  assert float(scaled_value) == float(value)  # the value comes back unscaled
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a * 2.0**12, b), grads, scaled_grads)
  # The fp8 state is the same: the output-gradient amax was recorded unscaled.
  jax.tree.map(
    np.testing.assert_array_equal,
    nnx.state(plain, flax_fp8.Fp8State),
    nnx.state(scaled, flax_fp8.Fp8State),
  )


def test_nnx_ops_read_the_loss_scale_nnx_value_and_grad_sets_in_their_variable():
  """Bit for bit linen_fp8 with the same loss scale (3: a visible one), set only meanwhile."""
  x = inputs()
  variables = layers_variables()
  model = nnx_like_linen(variables)
  ops = (model.dense.dot_general, model.general.dot_general, model.einsum.einsum_op)
  assert [float(op.loss_scale.get_value()) for op in ops] == [1.0, 1.0, 1.0]
  assert len(jax.tree.leaves(nnx.state(model, flax_fp8.Fp8LossScale))) == 3

  def loss_fn(model, x):  # returns the loss scale the dense op holds while differentiated
    return nnx_loss(model, x), model.dense.dot_general.loss_scale.get_value()

  @nnx.jit
  def step(model, x):
    grad_fn = flax_fp8.nnx_value_and_grad(loss_fn, has_aux=True, loss_scale=3.0)
    return grad_fn(model, x)

  (_, held), grads = step(model, x)
  assert float(held) == 3.0
  assert [float(op.loss_scale.get_value()) for op in ops] == [1.0, 1.0, 1.0]  # reset after

  @jax.jit  # the loss scale an argument, as NNX's variable is: a constant 3 would be folded
  def linen_grads(params, state, loss_scale):
    def loss(params, amax):
      with flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS, loss_scale=loss_scale):
        out = Layers().apply({"params": params, "fp8_state": state, "fp8_amax": amax}, x)
      return loss_scale * sum(jnp.sum(v * (i + 1)) for i, v in enumerate(out.values()))

    return jax.grad(loss, argnums=(0, 1))(params, fp8.zeros_amax(state))

  want, amax = linen_grads(variables["params"], variables["fp8_state"], jnp.float32(3.0))
  for name in ("dense", "general", "einsum", "own"):
    for param in ("kernel", "bias"):
      np.testing.assert_array_equal(
        grads[name][param].get_value(), want[name][param], err_msg=f"{name}.{param}"
      )
  expected = fp8.update(variables["fp8_state"], amax, CONFIG)
  for name, op in zip(("dense", "general", "einsum"), ops, strict=True):
    jax.tree.map(  # computed by two programs: equal up to the last bit
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
      op.dot_state,
      expected[name][flax_fp8.VARIABLE_NAME],
    )
  with pytest.raises(TypeError, match=r"loss_scale must be .*, got str\."):
    flax_fp8.nnx_value_and_grad(nnx_loss, loss_scale="3")(model, x)
  assert [float(op.loss_scale.get_value()) for op in ops] == [1.0, 1.0, 1.0]


def test_nnx_fp8_leaves_other_models_and_optimizers_alone():
  with pytest.raises(ValueError, match=r"no nnx\.Linear, nnx\.LinearGeneral or nnx\.Einsum"):
    flax_fp8.nnx_fp8(nnx.Sequential(nnx.BatchNorm(3, rngs=nnx.Rngs(0))), CONFIG)
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  assert flax_fp8.nnx_fp8(model, "p=f32,fp8=none") is model
  assert model.dot_general is jax.lax.dot_general
  flax_fp8.nnx_fp8(model, CONFIG, placement=fp8.ALL_LAYERS)
  # fp8 state is not a parameter: optimizers built on nnx.Param ignore it.
  assert len(jax.tree.leaves(nnx.state(model, nnx.Param))) == 2
  assert len(jax.tree.leaves(nnx.state(model, flax_fp8.Fp8State))) == 6
  assert len(jax.tree.leaves(nnx.state(model, flax_fp8.Fp8Amax))) == 3


# The first step: calibration -------------------------------------------------------------

# Both ways the initial scales of 1 fail at once: inputs up to ~2^13 saturate E4M3 (448), and
# a loss times 2^-20 gives output gradients under E5M2's smallest subnormal, 2^-16.
BIG_INPUTS, TINY_LOSS = 2.0**10, 2.0**-20


def first_step_data():
  x = inputs() * BIG_INPUTS
  shapes = jax.eval_shape(Layers().apply, {"params": layers_variables()["params"]}, x)
  rng = np.random.default_rng(5)
  return x, {name: jnp.asarray(rng.standard_normal(s.shape), s.dtype) for name, s in shapes.items()}


def first_step_loss(out, targets):
  return TINY_LOSS * sum(jnp.sum(out[name] * targets[name]) for name in out)


@jax.jit
def reference_grads(params, x, targets):
  """float32 gradients of the plain model (no fp8)."""
  return jax.grad(lambda p: first_step_loss(Layers().apply({"params": p}, x), targets))(params)


def assert_rounding_error_only(grads, reference):
  """Each gradient is nonzero wherever the reference is, and close to it in norm."""
  for (path, want), got in zip(
    jax.tree_util.tree_leaves_with_path(reference), jax.tree.leaves(grads), strict=True
  ):
    name = jax.tree_util.keystr(path)
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all((got != 0) | (want == 0)), f"{name}: {np.mean(got == 0):.0%} flushed to zero"
    # Rounding x to E4M3 and g to E5M2 moves each product x*g by at most (1 + 2^-4)(1 + 2^-3)
    # - 1 = 0.195 of itself; independent roundings partly cancel in the sums, so 0.15 in norm
    # is loose (test_fp8.py's single matmul measures about 0.05). A flush would be 1.0.
    assert np.linalg.norm(got - want) <= 0.15 * np.linalg.norm(want), name


def test_linen_calibrate_then_first_step_has_only_rounding_error():
  """fp8.calibrate applies to linen's "fp8_state" as is; step 0 then has rounding error only
  (with the initial scales of 1 every kernel gradient here is zero)."""
  x, targets = first_step_data()
  variables = layers_variables()
  params = variables["params"]

  def loss(params, state, amax):
    with flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS):
      collections = {"params": params, flax_fp8.STATE_COLLECTION: state}
      if amax is not None:
        collections[flax_fp8.AMAX_COLLECTION] = amax
      return first_step_loss(Layers().apply(collections, x), targets)

  @jax.jit
  def calibrate_then_grads(params, state):
    state = fp8.calibrate(lambda amax: loss(params, state, amax), state, CONFIG)
    return state, jax.grad(loss)(params, state, None)

  state, grads = calibrate_then_grads(params, variables[flax_fp8.STATE_COLLECTION])
  assert_rounding_error_only(grads, reference_grads(params, x, targets))
  dense = state["dense"][flax_fp8.VARIABLE_NAME]
  assert float(dense.input.scale) == np.float32(np.abs(x).max()) / np.float32(448)


def test_nnx_calibrate_then_first_step_has_only_rounding_error():
  """nnx_calibrate sets the fp8 state in place; step 0 then has rounding error only."""
  x, targets = first_step_data()
  variables = layers_variables()
  model = nnx_like_linen(variables)
  loss = lambda model: first_step_loss(model(x), targets)

  @nnx.jit
  def calibrate_then_grads(model):
    flax_fp8.nnx_calibrate(loss)(model)
    return nnx.grad(loss)(model)

  grads = calibrate_then_grads(model)
  reference = reference_grads(variables["params"], x, targets)
  assert_rounding_error_only(nnx.to_pure_dict(grads), reference)
  # Each scale is its tensor's amax / 448 (the einsum's input and kernel); probes are reset.
  op = model.einsum.einsum_op
  assert float(op.input_scale.get_value()) == np.float32(np.abs(x).max()) / np.float32(448)
  kernel = np.abs(np.asarray(variables["params"]["einsum"]["kernel"])).max()
  assert float(op.kernel_scale.get_value()) == np.float32(kernel) / np.float32(448)
  assert all(float(a) == 0 for a in op.amax)
  no_fp8 = flax_fp8.nnx_calibrate(lambda model: jnp.sum(model.own(x)))  # its own matmul
  with pytest.raises(ValueError, match="traced no fp8 matmul of NnxLayers"):
    nnx.jit(no_fp8)(model)


# Agreement with flax.linen.fp8_ops -------------------------------------------------------

# Power-of-two scales: Flax stores a scale s and recomputes it as 1 / (1 / s) when its
# history holds no amax, which is exact only for powers of two.
SCALES = {"input": 2.0**-3, "kernel": 2.0**-9, "output_grad": 2.0**-6}


class FlaxDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    op = functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=4)
    return nn.Dense(8, dot_general_cls=op, name="dense")(x)


def flax_variables(x, scales):
  variables = materialize(jax.eval_shape(FlaxDense().init, jax.random.key(0), x))
  owg = variables[fp8_ops.OVERWRITE_WITH_GRADIENT]["dense"]["Fp8DirectDotGeneralOp_0"]
  for name, scale in scales.items():
    owg[f"{name}_scale"] = jnp.full((1,), scale, jnp.float32)
  return variables


def our_state(scales):
  state = fp8.init_dot_state(CONFIG)
  return fp8.Fp8DotState(
    *(
      t._replace(scale=jnp.float32(scales[name]))
      for name, t in zip(state._fields, state, strict=True)
    )
  )


def flax_step(variables, x, g):
  """Output, gradients (x, params) and Flax's new fp8 variables."""

  def f(x, params, owg):
    return FlaxDense().apply({"params": params, fp8_ops.OVERWRITE_WITH_GRADIENT: owg}, x)

  y, vjp = jax.vjp(f, x, variables["params"], variables[fp8_ops.OVERWRITE_WITH_GRADIENT])
  dx, dparams, new_owg = vjp(g)
  return y, dx, dparams, new_owg


def our_step(variables, state, x, g):
  params = variables["params"]["dense"]

  def f(x, kernel, bias, amax):
    return fp8.dot_general(x, kernel, DENSE, state, amax, config=CONFIG) + bias

  y, vjp = jax.vjp(f, x, params["kernel"], params["bias"], fp8.zeros_amax(state))
  dx, dk, db, amax = vjp(g)
  return y, dx, {"dense": {"kernel": dk, "bias": db}}, fp8.update(state, amax, CONFIG)


def test_same_scales_give_the_same_quantized_result_as_flax():
  x = inputs(1, (6, 16)) * 3
  g = inputs(2, (6, 8)) * 0.1
  variables = flax_variables(x, SCALES)
  state = our_state(SCALES)
  y_flax, dx_flax, dp_flax, _ = jax.jit(flax_step)(variables, x, g)
  y, dx, dp, _ = jax.jit(our_step)(variables, state, x, g)
  np.testing.assert_array_equal(y, y_flax)
  np.testing.assert_array_equal(dx, dx_flax)
  jax.tree.map(np.testing.assert_array_equal, dp, dp_flax)
  # And the result really is quantized: it differs from the float32 layer.
  p = variables["params"]["dense"]
  assert np.abs(y - (x @ p["kernel"] + p["bias"])).max() > 1e-3


def test_delayed_scaling_trajectory_matches_flax():
  """Same data each step: both libraries pick the same scales and outputs."""
  variables = flax_variables(inputs(1, (6, 16)), {})
  # Flax's initial state: scales of 1 (a fresh jmp_lite state has none, and its first step
  # quantizes each tensor with its own amax).
  state = our_state({name: 1.0 for name in fp8.Fp8DotState._fields})
  flax_jit, our_jit = jax.jit(flax_step), jax.jit(our_step)
  for step in range(4):
    x = inputs(10 + step, (6, 16)) * (step + 1)  # a growing input range
    g = inputs(20 + step, (6, 8)) * 10.0**-step  # a shrinking gradient range
    y_flax, dx_flax, _, owg = flax_jit(variables, x, g)
    y, dx, _, state = our_jit(variables, state, x, g)
    np.testing.assert_allclose(y, y_flax, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, dx_flax, rtol=1e-6, atol=1e-9)
    variables = {**variables, fp8_ops.OVERWRITE_WITH_GRADIENT: owg}
    ours = owg["dense"]["Fp8DirectDotGeneralOp_0"]
    # Flax's stored scale is the one it used this step; ours is the next step's. Compare
    # Flax's with the scale our state would derive from the same history one step later.
    for name, tensor in zip(state._fields, state, strict=True):
      flax_next = fp8_ops.compute_scale(
        jnp.max(ours[f"{name}_amax_history"]), ours[f"{name}_scale"], fp8_max(name)
      )
      np.testing.assert_allclose(tensor.scale, flax_next[0], rtol=1e-6, err_msg=name)
      np.testing.assert_array_equal(
        np.sort(tensor.amax_history), np.sort(ours[f"{name}_amax_history"])
      )


def fp8_max(name):
  dtype = CONFIG.bwd_dtype if name == "output_grad" else CONFIG.fwd_dtype
  return jl.FORMATS[dtype.name].max


def test_einsum_agrees_with_flax_fp8_einsum():
  class FlaxEinsum(nn.Module):
    @nn.compact
    def __call__(self, x, k):
      return fp8_ops.Fp8Einsum(amax_history_length=4, name="op")("btd,dhf->bthf", x, k)

  x, k = inputs(3, (2, 3, 8)), inputs(4, (8, 2, 4)) * 0.1
  g = inputs(5, (2, 3, 2, 4))
  variables = materialize(jax.eval_shape(FlaxEinsum().init, jax.random.key(0), x, k))
  owg = variables[fp8_ops.OVERWRITE_WITH_GRADIENT]["op"]
  for name, scale in SCALES.items():
    owg[f"{name}_scale"] = jnp.full((1,), scale, jnp.float32)
  state = our_state(SCALES)

  @jax.jit
  def both(x, k, g):
    y_flax, vjp_flax = jax.vjp(lambda x, k: FlaxEinsum().apply(variables, x, k), x, k)
    y, vjp = jax.vjp(lambda x, k: fp8.einsum("btd,dhf->bthf", x, k, state, config=CONFIG), x, k)
    return (y, vjp(g)), (y_flax, vjp_flax(g))

  ours, flax = both(x, k, g)
  jax.tree.map(np.testing.assert_array_equal, ours, flax)


def test_documented_difference_overflow_stays_visible():
  """Flax clips inf to the fp8 maximum; jmp_lite keeps it, so loss scaling sees it."""
  x = inputs(1, (6, 16)).at[0, 0].set(jnp.inf)
  g = inputs(2, (6, 8))
  variables = flax_variables(x, SCALES)
  y_flax, *_ = jax.jit(flax_step)(variables, x, g)
  y, *_ = jax.jit(our_step)(variables, our_state(SCALES), x, g)
  assert np.isfinite(y_flax).all()
  assert not np.isfinite(y[0]).any() and np.isfinite(y[1:]).all()


# Donation --------------------------------------------------------------------------------


def test_fp8_states_initialized_after_a_donated_step_have_buffers_of_their_own():
  x = inputs(shape=(2, 4))

  def linen_variables():
    with flax_fp8.linen_fp8(CONFIG, placement=fp8.ALL_LAYERS):
      return nn.Dense(3).init(jax.random.key(0), x)

  @functools.partial(jax.jit, donate_argnums=0)
  def linen_step(state):
    observed = jax.tree.map(lambda a: a + 8.0, fp8.zeros_amax(state))
    return fp8.update(state, observed, CONFIG)

  @functools.partial(nnx.jit, donate_argnums=0)
  def nnx_step(model):
    flax_fp8.nnx_value_and_grad(lambda m: jnp.sum(m(x)))(model)

  linen_scales, nnx_scales = [], []
  for _ in range(2):  # a second run: a fresh init of each kind
    state = linen_variables()[flax_fp8.STATE_COLLECTION]
    assert float(state[flax_fp8.VARIABLE_NAME].input.scale) == 0.0  # none yet
    linen_scales.append(float(linen_step(state)[flax_fp8.VARIABLE_NAME].input.scale))
    assert state[flax_fp8.VARIABLE_NAME].input.scale.is_deleted()
    model = flax_fp8.nnx_fp8(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), CONFIG, placement=fp8.ALL_LAYERS)
    assert float(model.dot_general.input_scale.get_value()) == 0.0
    nnx_step(model)
    nnx_scales.append(float(model.dot_general.input_scale.get_value()))
  assert linen_scales == [float(np.float32(8.0) / np.float32(448.0))] * 2
  assert nnx_scales == [float(jnp.max(jnp.abs(x)) / np.float32(448.0))] * 2


# Recipes: the default (current scaling) and delayed scaling's first step ---------------


class RematScanStack(nn.Module):
  """Three remat'ed Dense+tanh blocks under nn.scan, fp8 collections stacked per layer."""

  @nn.compact
  def __call__(self, x):
    class Block(nn.Module):
      @nn.compact
      def __call__(self, h, _):
        return jnp.tanh(nn.Dense(4)(h)), None

    axes = {"params": 0, flax_fp8.STATE_COLLECTION: 0, flax_fp8.AMAX_COLLECTION: 0}
    block = nn.remat(Block, prevent_cse=False)
    scan = nn.scan(block, variable_axes=axes, split_rngs={"params": True}, length=3)
    return scan()(x, None)[0]


@functools.cache
def scan_stack_case():
  """RematScanStack's input and its plain (no fp8) parameters, initialised once for every
  recipe below: each recipe's check holds for any parameters that leave tanh off its tails."""
  x = inputs(7, (16, 4)) * 0.5  # tanh stays off its flat tails: the reference has no zero gradient
  return x, jax.jit(RematScanStack().init)(jax.random.key(0), x)["params"]


@functools.cache
def unrolled_layer(recipe):
  """One layer of the stack with the functional fp8 matmul, and its VJP, each compiled once and
  run for every layer (one compiled 3-layer program is three times the compile)."""
  layer = lambda x, kernel, bias: jnp.tanh(fp8.dot_general(x, kernel, DENSE, config=recipe) + bias)
  return jax.jit(layer), jax.jit(lambda x, kernel, bias, g: jax.vjp(layer, x, kernel, bias)[1](g))


def unrolled_reference_grads(params, x, recipe, loss_weight):
  """The gradients of ``loss_weight * sum(stack(x))``, the stack run layer by layer with the
  functional fp8 matmul: the chain rule through each layer's VJP, last layer first."""
  dense = params["ScanCheckpointBlock_0"]["Dense_0"]
  layer, layer_vjp = unrolled_layer(recipe)
  layer_inputs = [x]
  for i in range(2):  # the loss is linear in the last output: its cotangent is loss_weight
    layer_inputs.append(layer(layer_inputs[-1], dense["kernel"][i], dense["bias"][i]))
  g = jnp.full((x.shape[0], dense["kernel"].shape[-1]), loss_weight, jnp.float32)
  kernel_grads, bias_grads = [None] * 3, [None] * 3
  for i in reversed(range(3)):
    kernel, bias = dense["kernel"][i], dense["bias"][i]
    g, kernel_grads[i], bias_grads[i] = layer_vjp(layer_inputs[i], kernel, bias, g)
  stacked = {"kernel": jnp.stack(kernel_grads), "bias": jnp.stack(bias_grads)}
  return {"ScanCheckpointBlock_0": {"Dense_0": stacked}}


@pytest.mark.parametrize(
  "recipe",
  [
    None,
    fp8.CurrentScaling(power_of_2=True),
    fp8.DelayedScaling(amax_history_length=4),
    fp8.RowwiseScaling(),
    fp8.RowwiseScaling(weight_grad="compute_dtype"),
    fp8.BlockScaling(),
    fp8.Mxfp8Scaling(),
  ],
  ids=["default", "current_power_of_2", "delayed", "rowwise", "rowwise_gw_hp", "block", "mxfp8"],
)
def test_linen_recipes_compose_with_scan_and_remat(recipe, tmp_path):
  """Under nn.scan + nn.remat, each recipe's first step equals the functional matmul layer by
  layer, bit for bit (delayed: a fresh state, as current scaling); stateless recipes create no
  fp8 collection, and delayed scaling's stacked state round-trips through orbax."""
  x, params = scan_stack_case()
  stateful = isinstance(recipe, fp8.DelayedScaling)
  # Which collections linen_fp8's init creates: shapes only (nothing is compiled), except the
  # fresh state delayed scaling starts from.
  shapes = linen_init_shapes(RematScanStack(), x, recipe)
  assert (flax_fp8.STATE_COLLECTION in shapes) == stateful
  assert jax.tree.map(jnp.shape, shapes["params"]) == jax.tree.map(jnp.shape, params)
  state = linen_init(RematScanStack(), x, recipe)[flax_fp8.STATE_COLLECTION] if stateful else None
  current = fp8.CurrentScaling() if recipe is None or stateful else recipe

  @jax.jit
  def grads(params, state):
    def loss(params, amax):
      collections = {"params": params}
      if stateful:
        collections.update({flax_fp8.STATE_COLLECTION: state, flax_fp8.AMAX_COLLECTION: amax})
      with flax_fp8.linen_fp8(recipe, loss_scale=2.0**8, placement=fp8.ALL_LAYERS):
        return TINY_LOSS * 2.0**8 * jnp.sum(RematScanStack().apply(collections, x))

    return jax.grad(loss, argnums=(0, 1))(params, fp8.zeros_amax(state) if stateful else None)

  got, amax = grads(params, state)
  want = unrolled_reference_grads(params, x, current, TINY_LOSS * 2.0**8)
  jax.tree.map(np.testing.assert_array_equal, got, want)
  kernel_grad = np.asarray(got["ScanCheckpointBlock_0"]["Dense_0"]["kernel"])
  assert np.mean(kernel_grad == 0) == 0.0  # nothing flushed, in any layer
  if stateful:
    new_state = fp8.update(state, amax, recipe)
    ocp = pytest.importorskip("orbax.checkpoint")
    with ocp.StandardCheckpointer() as ckpt:
      ckpt.save(tmp_path / "fp8", new_state)
      ckpt.wait_until_finished()
      restored = ckpt.restore(tmp_path / "fp8", jax.tree.map(jnp.zeros_like, new_state))
    jax.tree.map(np.testing.assert_array_equal, restored, new_state)
    dot = jax.tree.leaves(restored, is_leaf=lambda s: isinstance(s, fp8.Fp8DotState))[0]
    np.testing.assert_allclose(dot.input.scale[0], np.abs(x).max() / 448, rtol=1e-6)


@pytest.mark.parametrize("recipe", [None, fp8.RowwiseScaling()], ids=["default", "rowwise"])
def test_nnx_stateless_recipes_keep_no_state_and_first_step_flushes_nothing(recipe):
  """nnx_fp8 without a recipe (current scaling) or row-wise: no fp8 variables; with a loss x
  2^-20 and the loss scale passed, the gradients equal linen's and none is zero."""
  x, targets = first_step_data()
  params = layers_variables()["params"]
  model = nnx.eval_shape(
    lambda: flax_fp8.nnx_fp8(NnxLayers(nnx.Rngs(0)), recipe, placement=fp8.ALL_LAYERS)
  )
  graphdef, state = nnx.split(model)
  assert not nnx.to_pure_dict(nnx.split_state(state, flax_fp8.Fp8State, ...)[0])
  pure = nnx.to_pure_dict(state)
  for layer, values in pure.items():
    for name in values:
      values[name] = params[layer][name]
  nnx.replace_by_pure_dict(state, pure)
  model = nnx.merge(graphdef, state)
  loss_scale = jl.StaticLossScale(jnp.float32(2.0**8))

  @nnx.jit
  def step(model):
    loss_fn = lambda model: first_step_loss(model(x), targets)
    _, grads = flax_fp8.nnx_value_and_grad(loss_fn, loss_scale=loss_scale)(model)
    return jax.tree.map(lambda g: g / 2.0**8, nnx.to_pure_dict(grads))

  @jax.jit
  def linen_grads(params):
    def loss(params):
      with flax_fp8.linen_fp8(recipe, placement=fp8.ALL_LAYERS):
        return first_step_loss(Layers().apply({"params": params}, x), targets)

    return jax.grad(loss)(params)

  grads, want = step(model), linen_grads(params)
  assert_rounding_error_only(grads, reference_grads(params, x, targets))
  for layer in grads:
    jax.tree.map(np.testing.assert_array_equal, grads[layer], want[layer])
