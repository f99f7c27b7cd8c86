"""fp8 delayed scaling (jmp_lite/fp8/_scaling.py): scale updates and state round trips."""

import pickle

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_lite import fp8

from .fp8_testing import (
  CONFIG,
  E4M3,
  E5M2,
  init_mlp_state,
)

# Scale updates -------------------------------------------------------------------------


@pytest.mark.parametrize(
  "amax, previous, dtype, margin, expected",
  [
    (896.0, 1.0, E4M3, 0, 2.0),  # 896 / 448
    (896.0, 1.0, E4M3, 1, 4.0),  # one power of two of headroom
    (896.0, 1.0, E4M3, 2.5, 2.0 * 2.0**2.5),
    (57344.0 / 8, 1.0, E5M2, 0, 0.125),
    (0.0, 0.3, E4M3, 0, 0.3),  # all-zero tensor: keep the previous scale
    (np.inf, 0.3, E4M3, 0, 0.3),
    (np.nan, 0.3, E5M2, 0, 0.3),
    (-5.0, 0.3, E4M3, 0, 0.3),
    (1e-45, 0.3, E4M3, 0, 0.3),  # the new scale would underflow to 0
  ],
)
def test_compute_scale(amax, previous, dtype, margin, expected):
  scale = fp8.compute_scale(amax, previous, dtype, margin)
  assert scale.dtype == jnp.float32
  np.testing.assert_allclose(float(scale), expected, rtol=1e-7)


A = 448.0  # e4m3 max: amaxes as multiples of it give round scales
#: (observed amax, history after, scale after) for L = 3, by hand.
MAX_RULE = [
  (A, [A, 0, 0], 1.0),
  (4 * A, [4 * A, A, 0], 4.0),
  (2 * A, [2 * A, 4 * A, A], 4.0),
  (A / 2, [A / 2, 2 * A, 4 * A], 4.0),
  (A / 4, [A / 4, A / 2, 2 * A], 2.0),  # 4A has left the window
  (np.inf, [A / 4, A / 2, 2 * A], 2.0),  # an overflow is not recorded
  (np.nan, [A / 4, A / 2, 2 * A], 2.0),
  (0.0, [0, A / 4, A / 2], 0.5),
  (8 * A, [8 * A, 0, A / 4], 8.0),
]
MOST_RECENT_RULE = [
  (A, [A, 0, 0], 1.0),
  (4 * A, [4 * A, A, 0], 4.0),
  (2 * A, [2 * A, 4 * A, A], 2.0),
  (A / 2, [A / 2, 2 * A, 4 * A], 0.5),
  (A / 4, [A / 4, A / 2, 2 * A], 0.25),
  (np.inf, [A / 4, A / 2, 2 * A], 0.25),
  (np.nan, [A / 4, A / 2, 2 * A], 0.25),
  (0.0, [0, A / 4, A / 2], 0.25),  # zero amax keeps the previous scale
  (8 * A, [8 * A, 0, A / 4], 8.0),
]


@pytest.mark.parametrize("algo, trajectory", [("max", MAX_RULE), ("most_recent", MOST_RECENT_RULE)])
@pytest.mark.parametrize("use_jit", [False, True])
def test_update_scale_hand_worked_histories(algo, trajectory, use_jit):
  def step(state, amax):
    return fp8.update_scale(state, amax, E4M3, amax_compute_algo=algo)

  step = jax.jit(step) if use_jit else step
  state = fp8.init_scale_state(3)
  for amax, history, scale in trajectory:
    state = step(state, jnp.float32(amax))
    np.testing.assert_array_equal(state.amax_history, np.array(history, np.float32))
    assert float(state.scale) == scale, (amax, history)


def test_update_scale_history_of_one_and_stacked_states():
  state = fp8.update_scale(fp8.init_scale_state(1), 2 * A, E4M3)
  assert float(state.scale) == 2.0 and state.amax_history.tolist() == [2 * A]
  # Stacked (e.g. nn.scan layers): shape [layers] scales, [layers, L] histories.
  stacked = fp8.Fp8ScaleState(jnp.ones((2,)), jnp.zeros((2, 4)))
  new = fp8.update_scale(stacked, jnp.array([A, 4 * A]), E4M3)
  np.testing.assert_array_equal(new.scale, [1.0, 4.0])
  np.testing.assert_array_equal(new.amax_history[:, 0], [A, 4 * A])
  with pytest.raises(ValueError, match="amax must have the scale's shape"):
    fp8.update_scale(stacked, jnp.float32(1), E4M3)
  with pytest.raises(ValueError, match="amax_history must have shape"):
    fp8.update_scale(fp8.Fp8ScaleState(jnp.ones(()), jnp.zeros(())), 1.0, E4M3)


def test_update_uses_forward_format_for_operands_and_backward_format_for_gradients():
  config = fp8.Fp8Config(amax_history_length=2, margin=1)
  state = {"a": fp8.init_dot_state(config), "b": [fp8.init_dot_state(config)]}
  amax = jax.tree.map(lambda z: z + 57344.0, fp8.zeros_amax(state))
  new = fp8.update(state, amax, config)
  assert jax.tree.structure(new) == jax.tree.structure(state)
  for dot in (new["a"], new["b"][0]):
    assert float(dot.input.scale) == float(dot.kernel.scale) == 57344.0 / 448 * 2
    assert float(dot.output_grad.scale) == 2.0
  with pytest.raises(ValueError, match="zeros_amax"):
    fp8.update(state, {"a": amax["a"]}, config)
  with pytest.raises(TypeError, match="Fp8DotAmax"):
    fp8.update(state, {"a": 1.0, "b": [2.0]}, config)


# State round trips ---------------------------------------------------------------------


def test_state_round_trips():
  state = init_mlp_state()
  state = fp8.update(state, jax.tree.map(lambda z: z + 3.0, fp8.zeros_amax(state)), CONFIG)
  tree = {"fp8": state, "step": jnp.int32(3)}

  def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)

  assert_same(pickle.loads(pickle.dumps(tree)), tree)
  target = jax.tree.map(jnp.zeros_like, tree)
  assert_same(flax.serialization.from_bytes(target, flax.serialization.to_bytes(tree)), tree)
  leaves, treedef = jax.tree.flatten(tree)
  assert_same(jax.tree.unflatten(treedef, leaves), tree)
  assert_same(jax.jit(lambda t: t)(tree), tree)
  # Paths name the fields, for checkpoint inspection.
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)]
  assert "['l1'].input.amax_history" in paths
  assert "['l2'].output_grad.scale" in paths


def test_state_round_trips_through_orbax(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  state = fp8.update(
    init_mlp_state(), jax.tree.map(lambda z: z + 3.0, fp8.zeros_amax(init_mlp_state())), CONFIG
  )
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "fp8", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "fp8", jax.tree.map(jnp.zeros_like, state))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  jax.tree.map(np.testing.assert_array_equal, restored, state)
