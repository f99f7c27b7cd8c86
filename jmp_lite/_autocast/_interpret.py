"""The autocast interpreter: evaluates a jaxpr equation by equation under an op table.

Every variable keeps the dtype the traced program gives it (its *program dtype*);
the table only changes the dtype an equation computes in. An equation run in
fp32 keeps its unrounded fp32 result next to the program-dtype one: fp32
consumers (another fp32 operation, the user's widening cast, an fp32 output)
read the unrounded value, 16-bit consumers the value rounded once. Since the
program dtypes are kept, a rewritten sub-jaxpr (``scan``, ``while``, ``cond``)
has its original signature: carries keep the dtype they enter with.

Lean residuals: an fp32 operation whose derivative needs its operands (``exp``,
``rsqrt``...) runs under :func:`jax.checkpoint` saving nothing, so the backward
pass keeps its 16-bit operand and recomputes the fp32 value instead of storing
an fp32 activation. Linear ones (``reduce_sum``, ``cumsum``) need no operand.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite import _compat, _jaxpr
from jmp_lite._autocast._broadcast import (
  ELEMENTWISE,
  broadcast_summing_in_fp32,
  elementwise_summing_in_fp32,
)
from jmp_lite._autocast._from_output import DERIVATIVES, wide_and_narrow
from jmp_lite._autocast._modules import module_dtype, strip_module_scopes
from jmp_lite._autocast._table import LINEAR
from jmp_lite._matmul_precision import bind_wide, is_16bit_float

_F32 = np.dtype(np.float32)
FULL_PRECISION_SCOPE = "jmp_lite_full_precision"
"""The named scope :func:`full_precision` marks its operations with."""
# jax.nn.softmax's custom_jvp (under jax_softmax_custom_jvp), by its function's name.
_SOFTMAX_RULES = frozenset({"_softmax", "_log_softmax"})
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
_USER_RULES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
# Operations that only move values: an unrounded fp32 value moves along with the rounded one.
_MOVES = frozenset(
  {"reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "copy", "copy_p",
   "sharding_constraint", "slice", "rev"}
)  # fmt: skip
_CHECKPOINTS = frozenset({"checkpoint", "remat", "remat2"})  # jax.checkpoint's primitive
_REWRITTEN_SUBJAXPRS = frozenset({"scan", "while", "cond"})


class Value(NamedTuple):
  """A variable's value in the program dtype, and its unrounded fp32 value (or None)."""

  narrow: Any
  wide: Any = None


def _is_float(dtype: Any) -> bool:
  try:
    return bool(jnp.issubdtype(np.dtype(dtype), jnp.floating))
  except TypeError:  # extended dtypes (PRNG keys)
    return False


def _cast(x: Any, dtype: Any) -> Any:
  return x if np.dtype(jnp.result_type(x)) == dtype else jnp.asarray(x).astype(dtype)


class Config(NamedTuple):
  """What an autocast applies: the compute dtype, the op table, the scope overrides."""

  compute: np.dtype
  table: Mapping[str, str]
  scopes: tuple[tuple[re.Pattern, np.dtype], ...]


class _NestedPrograms:
  """The higher-order primitives whose bodies are rewritten and bound again as they were:
  ``jax.checkpoint``, ``shard_map``, and the closed sub-jaxprs of ``scan``/``while``/``cond``.

  A mixin of :class:`Interpreter`, which provides ``run``.
  """

  def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Value], prefix: Any) -> list:
    raise NotImplementedError

  def _checkpoint(self, eqn: Any, ins: list[Value]) -> list[Value]:
    """``jax.checkpoint``/``remat``: its body rewritten, under the same checkpoint policy."""
    params = eqn.params
    jaxpr = params["jaxpr"]

    def body(*args):
      outs = self.run(jaxpr, (), [Value(a) for a in args], _compat.current_name_stack())
      return [v.narrow for v in outs]

    fn = jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])
    return [Value(o) for o in fn(*[v.narrow for v in ins])]

  def _shard_map(self, eqn: Any, ins: list[Value]) -> list[Value]:
    """``shard_map``: its body rewritten, over the same mesh and specs."""
    params = eqn.params
    jaxpr = params["jaxpr"]

    def body(*args):
      prefix = _compat.current_name_stack()
      outs = self.run(jaxpr, (), [Value(a) for a in args], prefix)
      return tuple(_match(o.narrow, v.aval) for o, v in zip(outs, jaxpr.outvars, strict=True))

    fn = jax.shard_map(
      body,
      mesh=params["mesh"],
      in_specs=params["in_specs"],
      out_specs=params["out_specs"],
      check_vma=params["check_vma"],
      axis_names=params["newly_manual_axes"],
    )
    return [Value(o) for o in fn(*[v.narrow for v in ins])]

  def _rewrite_params(self, params: Mapping[str, Any]) -> dict:
    """``params`` with every closed sub-jaxpr rewritten (same signature: program dtypes)."""
    return {k: self._rewrite_value(v) for k, v in params.items()}

  def _rewrite_value(self, value: Any) -> Any:
    core = _compat.extend_core()
    if isinstance(value, core.ClosedJaxpr):
      return self._rewrite_closed(value)
    if isinstance(value, tuple) and any(isinstance(v, core.ClosedJaxpr) for v in value):
      return tuple(self._rewrite_value(v) for v in value)
    return value

  def _rewrite_closed(self, closed: Any) -> Any:
    specs = [
      jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
      for v in closed.jaxpr.invars
    ]

    def body(*args):
      outs = self.run(
        closed.jaxpr, closed.consts, [Value(a) for a in args], _compat.new_name_stack()
      )
      return [_match(o.narrow, v.aval) for o, v in zip(outs, closed.jaxpr.outvars, strict=True)]

    return jax.make_jaxpr(body)(*specs)


class _Rules:
  """How each rule of the table computes an equation, given its operands' :class:`Value`.

  A mixin of :class:`Interpreter`, which provides ``config`` and ``region``.
  """

  config: Config
  region: bool

  def _eqn_as_input(self, eqn: Any, ins: list[Value]) -> list[Value]:
    """The equation at the dtypes of the program; a move carries the unrounded value along."""
    outs = self._bind(eqn, [v.narrow for v in ins])
    if eqn.primitive.name in _MOVES and len(ins) == 1 and ins[0].wide is not None:
      (wide,) = self._bind(eqn, [ins[0].wide])
      outs = [Value(outs[0].narrow, wide.narrow)]
    return outs

  def _bind(self, eqn: Any, args: list[Any], params: dict | None = None) -> list[Value]:
    outs = _compat.bind(eqn.primitive, eqn.params if params is None else params, *args)
    return [Value(o) for o in outs]

  def _summing_in_fp32(self, eqn: Any, ins: list[Value]) -> list[Value]:
    """A broadcast (explicit, or of an elementwise operation's size-1 axes) of 16-bit
    operands, whose gradient sums in fp32."""
    shape = eqn.outvars[0].aval.shape
    if eqn.primitive.name == "broadcast_in_dim":
      (value,), (var,) = ins, eqn.invars
      if not _broadcasts_16bit(var, shape):
        return self._eqn_as_input(eqn, ins)
      bind = lambda y: _compat.bind(eqn.primitive, eqn.params, y)[0]
      narrow = broadcast_summing_in_fp32(bind, value.narrow)
      wide = None if value.wide is None else self._bind(eqn, [value.wide])[0].narrow
      return [Value(narrow, wide)]
    if eqn.primitive.name not in ELEMENTWISE:
      return self._eqn_as_input(eqn, ins)
    if not any(_broadcasts_16bit(var, shape) for var in eqn.invars):
      return self._eqn_as_input(eqn, ins)
    bind = lambda *args: _compat.bind(eqn.primitive, eqn.params, *args)[0]
    out = elementwise_summing_in_fp32(bind, [v.narrow for v in ins], shape)
    return [Value(out)]

  def _compute(self, eqn: Any, ins: list[Value]) -> list[Value]:
    """A matmul or convolution on compute-dtype operands; the result in the program dtype."""
    compute = self.config.compute
    args = [_cast(v.narrow, compute) if _is_float(_dtype(v.narrow)) else v.narrow for v in ins]
    out_dtype = np.dtype(eqn.outvars[0].aval.dtype)
    params = dict(eqn.params)
    if not (_is_float(out_dtype) and all(_is_float(_dtype(a)) for a in args)):
      return self._bind(eqn, args, params)
    params["preferred_element_type"] = out_dtype
    if is_16bit_float(compute) and out_dtype.itemsize > compute.itemsize:
      # A wide result of 16-bit operands: bound in a form every backend runs.
      return [Value(bind_wide(eqn.primitive, params, out_dtype, *args))]
    return self._bind(eqn, args, params)

  def _at(self, eqn: Any, ins: list[Value], dtype: np.dtype, recompute: bool) -> list[Value]:
    """The equation computed at ``dtype``: floating operands cast, results rounded back."""
    floats = [a for a in (*eqn.invars, *eqn.outvars) if _is_float(_jaxpr.dtype_of(a))]
    if not floats or len({_jaxpr.dtype_of(a) for a in floats}) > 1:
      return self._bind(eqn, [v.narrow for v in ins])  # mixed dtypes: left as written
    program = _jaxpr.dtype_of(floats[0])
    if (
      program is None or program == dtype or (program.itemsize >= dtype.itemsize and dtype == _F32)
    ):
      return self._bind(eqn, [v.narrow for v in ins])
    args = [v.wide if v.wide is not None and dtype == _F32 else v.narrow for v in ins]
    if recompute and eqn.primitive.name in DERIVATIVES and is_16bit_float(_dtype(args[0])):
      wide, narrow = wide_and_narrow(eqn.primitive, eqn.params, args[0])
      return [Value(narrow, wide)]

    params = dict(eqn.params)
    if params.get("preferred_element_type") == program:
      # A matmul whose result the program states in its own dtype: the result at ``dtype``.
      params["preferred_element_type"] = dtype

    def run(*args):
      args = [_cast(a, dtype) if _is_float(_dtype(a)) else a for a in args]
      return [v.narrow for v in self._bind(eqn, args, params)]

    if recompute:
      run = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)
    outs = run(*args)
    return [
      Value(_cast(o, _jaxpr.dtype_of(v)), o if dtype == _F32 and _is_float(_dtype(o)) else None)
      for o, v in zip(outs, eqn.outvars, strict=True)
    ]

  def _convert(self, eqn: Any, ins: list[Value]) -> list[Value]:
    """A cast: to its ``new_dtype``, from the unrounded fp32 value where there is one.

    A cast of a value the program computes in fp32 to 16 bits (JAX's reductions of 16-bit
    arrays end with one) is what 16-bit consumers read; fp32 consumers and fp32 outputs
    keep reading the fp32 value.
    """
    (value,) = ins
    new = np.dtype(eqn.params["new_dtype"]) if _is_float(eqn.params["new_dtype"]) else None
    if new is not None and is_16bit_float(new) and np.dtype(_dtype(value.narrow)) == _F32:
      (rounded,) = self._bind(eqn, [value.narrow])
      return [Value(rounded.narrow, value.narrow)]
    if value.wide is None or new is None:
      return self._bind(eqn, [value.narrow])
    if new == _F32:
      return [Value(value.wide, value.wide)]
    (rounded,) = self._bind(eqn, [value.wide])
    return [Value(rounded.narrow, value.wide if self.region else None)]


class Interpreter(_Rules, _NestedPrograms):
  """Evaluates jaxprs under a :class:`Config`: each equation dispatched to its rule
  (:class:`_Rules`) or, for a higher-order primitive, to the replay of its body
  (:class:`_NestedPrograms`).

  Args:
    config: the compute dtype, table and scope overrides.
    region: whether every floating operation runs in fp32 (a known rule replaced).
  """

  def __init__(self, config: Config, region: bool = False):
    self.config = config
    # In an fp32 region every floating operation runs in fp32, and a cast the region's code
    # writes to 16 bits keeps the unrounded value for the region's fp32 consumers.
    self.region = region

  def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Value], prefix: Any) -> list:
    """Evaluates ``jaxpr``; returns the :class:`Value` of each of its outputs.

    Args:
      jaxpr: a ``jax.extend.core.Jaxpr``.
      consts: the values of its constvars.
      args: the values of its invars.
      prefix: the name stack its equations' name stacks are relative to.
    """
    env: dict[Any, Value] = {}
    env.update((v, Value(c)) for v, c in zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(atom: Any) -> Value:
      return Value(atom.val) if _jaxpr.is_literal(atom) else env[atom]

    for eqn in jaxpr.eqns:
      info = eqn.source_info
      names = prefix + info.name_stack
      # Each equation in the context it was traced in (its mesh, compute_on, XLA metadata),
      # as jax.core.eval_jaxpr replays it.
      with _compat.replaying(eqn, names):
        outs = self._eqn(eqn, [read(a) for a in eqn.invars], names)
      for var, value in zip(eqn.outvars, outs, strict=True):
        if not isinstance(var, _compat.extend_core().DropVar):
          env[var] = value
    return [read(v) for v in jaxpr.outvars]

  def _rule(self, eqn: Any, names: Any) -> tuple[str, np.dtype | None]:
    if self.region:
      return ("cast", None) if eqn.primitive.name == "convert_element_type" else ("scope", _F32)
    scope = str(names)
    if FULL_PRECISION_SCOPE in scope:
      return "input", None  # full_precision's operations are fp32 in the program already
    table = self.config.table.get(eqn.primitive.name, "input")
    dtype = _scope_dtype(self.config, scope)
    if dtype is None:
      return table, None
    # Under a scope, the program's casts stay casts (from the unrounded value, as elsewhere).
    return ("cast", None) if table == "cast" else ("scope", dtype)

  def _eqn(self, eqn: Any, ins: list[Value], names: Any) -> list[Value]:
    name = eqn.primitive.name
    if name in _CALLS:
      closed = eqn.params["jaxpr"]
      return self.run(closed.jaxpr, closed.consts, ins, names)
    if name in _USER_RULES:
      if _jax_nn_rule(eqn) in _SOFTMAX_RULES:
        return self._fp32_region(eqn, ins)
      return self._bind(eqn, [v.narrow for v in ins])
    if name in _CHECKPOINTS:
      return self._checkpoint(eqn, ins)
    if name == "shard_map":
      return self._shard_map(eqn, ins)
    if name in _REWRITTEN_SUBJAXPRS:
      return self._bind(eqn, [v.narrow for v in ins], self._rewrite_params(eqn.params))
    rule, dtype = self._rule(eqn, names)
    if rule == "compute":
      return self._compute(eqn, ins)
    if rule == "float32":
      return self._at(eqn, ins, _F32, recompute=name not in LINEAR)
    if rule == "scope" and dtype is not None:
      return self._at(eqn, ins, dtype, recompute=False)
    if rule == "cast":
      return self._convert(eqn, ins)
    if rule == "sum_grad_float32":
      return self._summing_in_fp32(eqn, ins)
    return self._eqn_as_input(eqn, ins)

  def _fp32_region(self, eqn: Any, ins: list[Value]) -> list[Value]:
    """A known rule (softmax) replaced by its primal computed in fp32 from its operands,
    recomputed (not stored) for the backward pass, and rounded once to the program dtype."""
    closed = eqn.params["call_jaxpr"]
    region = Interpreter(self.config, region=True)

    def run(*args):
      prefix = _compat.current_name_stack()
      outs = region.run(closed.jaxpr, closed.consts, [Value(a) for a in args], prefix)
      return [v.narrow if v.wide is None else v.wide for v in outs]

    run = jax.checkpoint(run, policy=jax.checkpoint_policies.nothing_saveable)
    outs = run(*[v.narrow for v in ins])
    return [
      Value(_cast(o, _jaxpr.dtype_of(v)), o if _dtype(o) == _F32 else None)
      for o, v in zip(outs, eqn.outvars, strict=True)
    ]


def _broadcasts_16bit(var: Any, shape: tuple[int, ...]) -> bool:
  """Whether ``var`` is a 16-bit variable (not a constant) broadcast to more elements."""
  if _jaxpr.is_literal(var) or not hasattr(var.aval, "shape"):
    return False
  dtype = _jaxpr.dtype_of(var)
  grows = int(np.prod(shape)) > int(np.prod(var.aval.shape))
  return dtype is not None and is_16bit_float(dtype) and grows and len(var.aval.shape) <= len(shape)


def _scope_dtype(config: Config, scope: str) -> np.dtype | None:
  """The dtype of the first ``scopes`` pattern matching ``scope``, else the innermost module's."""
  if config.scopes:
    named = strip_module_scopes(scope)  # patterns see the model's own names
    for pattern, dtype in config.scopes:
      if pattern.search(named):
        return dtype
  return module_dtype(scope)


def _jax_nn_rule(eqn: Any) -> str | None:
  """The name of the ``jax.nn`` function whose custom rule ``eqn`` calls, else None."""
  closed = eqn.params.get("call_jaxpr")
  info = getattr(getattr(closed, "jaxpr", closed), "debug_info", None)
  source = getattr(info, "func_src_info", None) or ""
  name, _, path = source.partition(" at ")
  return name if _compat.is_jax_nn(path) else None


def _match(x: Any, aval: Any) -> Any:
  """``x`` with ``aval``'s dtype and weak type, so that a rewritten body keeps its signature."""
  x = jnp.asarray(x)
  if x.dtype != aval.dtype:
    x = x.astype(aval.dtype)
  return jax.lax.convert_element_type(x, aval.dtype) if aval.weak_type else x


def _dtype(x: Any) -> Any:
  return jnp.result_type(x)
