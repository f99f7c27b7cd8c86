"""The policy scope: a named scope whose name the jaxpr keeps through JAX's transforms."""

import jax
import jax.numpy as jnp
import pytest

import jmp_lite as jl
from jmp_lite._jaxpr import sub_jaxprs
from jmp_lite._policy_scope import innermost_policy, policy_scope, scope_name, without_marks

BF16 = jl.get_policy("p=f32,c=bf16,o=f32")
F16 = jl.get_policy("p=f32,c=f16,o=f16")
MARK = "jmp_lite.policy[params=float32,compute=bfloat16,output=float32]"


def policies_of_matmuls(jaxpr, outer=""):
  """The policy of each dot_general's name stack (nested jaxprs included), in program order."""
  out = []
  for eqn in jaxpr.eqns:
    name = "/".join(s for s in (outer, str(eqn.source_info.name_stack)) if s)
    if eqn.primitive.name == "dot_general":
      out.append((innermost_policy(name), "transpose(" in name))
    for sub in sub_jaxprs(eqn):
      out.extend(policies_of_matmuls(sub.jaxpr, name))
  return out


def layer(w, x):
  with policy_scope(BF16):
    return jnp.tanh(x @ w)


W, X = jnp.ones((4, 4)), jnp.ones((2, 4))


@pytest.mark.parametrize(
  "transform, backward",
  [
    (lambda f: f, 2),
    (jax.jit, 2),
    (jax.checkpoint, 3),  # the backward pass recomputes the forward matmul
    (lambda f: jax.vmap(f, in_axes=(None, 0)), 2),
    (lambda f: lambda w, x: jax.lax.scan(lambda c, _: (f(w, c), None), x, None, length=2)[0], 2),
  ],
  ids=["plain", "jit", "remat", "vmap", "scan"],
)
def test_the_mark_survives_transforms_and_grad(transform, backward):
  f = transform(layer)
  assert policies_of_matmuls(jax.make_jaxpr(f)(W, X).jaxpr) == [(BF16, False)]
  # Under grad: the forward matmul and the backward ones (the transposes for w and x) all
  # keep the mark.
  grad = jax.jit(jax.grad(lambda w, x: f(w, x).sum(), argnums=(0, 1)))
  found = policies_of_matmuls(jax.make_jaxpr(grad)(W, X).jaxpr)
  assert found == [(BF16, False)] + [(BF16, True)] * backward


def test_the_innermost_mark_wins_and_none_marks_nothing():
  def nested(w, x):
    with policy_scope(BF16):
      y = x @ w
      with policy_scope(F16):
        y = y @ w
    with policy_scope(None):
      return y @ w

  assert policies_of_matmuls(jax.make_jaxpr(nested)(W, X).jaxpr) == [
    (BF16, False),
    (F16, False),
    (None, False),
  ]


def test_names_and_marks_in_name_stacks():
  assert scope_name(BF16) == MARK
  assert innermost_policy(f"a/{MARK}/b") == BF16 and innermost_policy("a/b") is None
  for stack, shown in [
    (f"{MARK}/Model/Dense_0", "Model/Dense_0"),
    (f"jvp({MARK})/Model/Dense_0", "jvp(Model)/Dense_0"),
    (f"transpose(jvp({MARK}))/Model", "transpose(jvp(Model))"),
    (f"rematted_computation/{MARK}", "rematted_computation"),
    ("jvp(Model)/Dense_0", "jvp(Model)/Dense_0"),
  ]:
    assert without_marks(stack) == shown
