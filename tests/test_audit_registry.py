"""The audit's check registry: one registered function per check, and the walk dispatches
through it (it knows no check by name)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_lite as jl
from jmp_lite._audit import _registry
from jmp_lite._audit._checks import AUDIT_CHECKS
from jmp_lite._audit._ranges import Range

X16 = jnp.ones((2, 8), jnp.float16)


def test_audit_checks_is_derived_from_the_registry():
  checks = _registry.registered()
  assert AUDIT_CHECKS == {check.name: check.description for check in checks}
  assert jl.AUDIT_CHECKS is AUDIT_CHECKS
  assert list(AUDIT_CHECKS) == [
    "softmax",
    "logsumexp",
    "exp",
    "log",
    "logistic",
    "reduction",
    "normalization",
    "division",
    "matmul",
    "cast",
    "fp32_matmul",
  ]
  assert jl.AuditConfig().checks == frozenset(AUDIT_CHECKS)  # all enabled by default
  for check in checks:
    assert check.description and check.run.__doc__, check.name
    assert check.primitives and all(check in _registry.checks_for(p) for p in check.primitives)


def test_checks_of_a_primitive_come_in_registration_order():
  by_primitive = lambda p: [check.name for check in _registry.checks_for(p)]
  assert by_primitive("exp") == ["softmax", "logsumexp", "exp"]
  assert by_primitive("mul") == ["normalization", "cast"]
  assert by_primitive("div") == ["division", "cast"]
  assert by_primitive("dot_general") == ["matmul", "fp32_matmul"]
  assert by_primitive("tanh") == []


def test_a_name_is_registered_once():
  with pytest.raises(ValueError, match="'softmax'"):
    _registry.register("softmax", "again", {"exp"})(lambda site: None)
  assert [check.name for check in _registry.checks_for("exp")] == ["softmax", "logsumexp", "exp"]


def test_the_walk_calls_the_registered_check_and_applies_the_configuration(monkeypatch):
  seen = []

  def on_tanh(site):
    seen.append((site.eqn.primitive.name, site.ranges[0], site.origin.backward))
    return _registry.Hit(np.dtype("float16"), "a tanh in float16", size=7)

  # Registered under an existing name, so that configurations accept it.
  check = _registry.Check("exp", "test", frozenset({"tanh"}), on_tanh)
  monkeypatch.setitem(_registry._BY_PRIMITIVE, "tanh", (check,))
  report = jl.audit(lambda x: jnp.tanh(jnp.clip(x, -2.0, 3.0)), X16)
  assert seen == [("tanh", Range(-2.0, 3.0), False)]
  assert [(f.check, f.primitive, f.dtype, f.message, f.size) for f in report] == [
    ("exp", "tanh", "float16", "a tanh in float16", 7)
  ]
  assert not jl.audit(jnp.tanh, X16, audit_config=jl.AuditConfig(checks=["log"]))
  assert not jl.audit(jnp.tanh, X16, audit_config=jl.AuditConfig(allow_primitives=["tanh"]))
  # Under jax.grad the forward tanh is reported once, as the user's.
  grad = jax.grad(lambda x: jnp.tanh(x).astype(jnp.float32).sum())
  assert [(f.check, f.backward, f.autodiff) for f in jl.audit(grad, X16)] == [("exp", False, False)]


def test_covered_equations_are_not_checked_again():
  # A softmax's division and sum belong to its finding: even with the softmax check off, its
  # division is no "division by a reduction".
  assert [f.check for f in jl.audit(jax.nn.softmax, X16)] == ["softmax"]
  config = jl.AuditConfig(checks=["division", "reduction"], long_reduction=2)
  assert not jl.audit(jax.nn.softmax, X16, audit_config=config)
  assert [f.check for f in jl.audit(lambda x: x / x.sum(), X16, audit_config=config)] == [
    "division"
  ]
