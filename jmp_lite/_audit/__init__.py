r"""Precision audit: find the operations mixed precision breaks, before a run does.

The implementation of :func:`jmp_lite.audit`; the public names are exported by
``jmp_lite`` (``jl.audit``, ``jl.AuditConfig``, ``jl.AUDIT_CHECKS``...).

:func:`audit` traces a function (a model's ``apply``, a loss, a whole train
step) to a jaxpr and walks every equation, including those of nested jaxprs
(``jit``, ``scan``, ``cond``, ``while``, ``custom_jvp``/``custom_vjp``,
``checkpoint``/``remat``, ``shard_map``). It reports each precision-sensitive
operation that runs in float16, bfloat16 or fp8, with the user's source line::

  report = jl.audit(model.apply, params16, x16)
  print(report)            # grouped, readable
  report.findings          # structured: Finding(check, primitive, dtype, location, ...)

What it looks for (the ``check`` of a :class:`Finding`):

========================  ==================================================================
``softmax``               ``exp(x - max) / sum(exp(x - max))`` with exp or the division in
                          16/8 bits (small probabilities flush to 0; ``log`` of them is -inf)
``logsumexp``             ``log(sum(exp(x)))`` in 16/8 bits (``log_softmax``, cross-entropy)
``exp``                   any other ``exp``/``exp2``/``expm1`` (fp16 overflows above
                          :math:`\ln 65504 \approx 11.1`)
``log``                   ``log``/``log1p`` (an input that underflowed to 0 gives -inf)
``logistic``              a sigmoid whose result reaches a ``log`` (log-sigmoid losses)
``reduction``             ``reduce_sum``/``reduce_prod``/``cumsum``/``cumprod``/
                          ``cumlogsumexp`` over a *long* axis: at least
                          :attr:`AuditConfig.long_reduction` values
``normalization``         normalization statistics: ``x**2`` feeding a reduction in a
                          narrow-range format, ``rsqrt``/``sqrt`` of a reduction
``division``              a division by a reduction (``x / sum(x)``, ``x / norm(x)``)
``matmul``                ``dot_general``/``conv`` whose result (the only accumulation type
                          a jaxpr states) is fp8, or 16-bit with ``matmul_accumulation=
                          "as_written"``
``cast``                  a cast to float16/fp8 of values that do not fit: finite constants
                          beyond the format's max (``-1e9`` masks), results of range-expanding
                          operations (``exp``, powers, sums of 1024 or more values of
                          unknown range, and means of them), unclipped casts to fp8
``fp32_matmul``           a forward-pass ``dot_general``/``conv`` with a float32 operand
                          while the compute dtype is 16/8-bit: both operands (a layer built
                          with ``dtype=jnp.float32`` under a bf16 policy), or one, which
                          JAX promotes the other to (``q * np.float32(0.25)``), naming it;
                          outside the policy a step's arguments carry, the step bypassing
                          it (``model.apply`` instead of ``state.apply_fn``). Only with a
                          known compute dtype (see below)
========================  ==================================================================

The compute dtype a matmul is judged by (:mod:`jmp_lite._audit._policies`):
:attr:`AuditConfig.compute_dtype` when given; else that of the policy in force
where the matmul was traced: ``jmp_lite.flax.policy_apply`` and ``policy_view``
run the model in a named scope naming its policy (:mod:`jmp_lite._policy_scope`),
which the jaxpr keeps through ``jit``, ``grad``, ``scan`` and ``remat``, so a
whole training step needs no configuration; outside such scopes, the policy of
the audited function (``policy_apply``'s ``policy`` attribute) or the first
:class:`~jmp_lite.Policy` among its arguments (a ``jmp_lite.flax.TrainState``'s
``policy`` field).

A reduction is *long* from :attr:`AuditConfig.long_reduction` values on, by
default :math:`1/\epsilon` of the format (128 for bfloat16, 1024 for float16):
from there on each added term is smaller than the rounding error of a running
sum, so a sequential accumulation starts dropping terms. That is the only
meaning of ``long_reduction``: which sums can overflow a narrow format once
cast (the ``cast`` check) is a property of their range, tracked in
:mod:`jmp_lite._audit._ranges` and independent of it. Range checks (``cast``, ``x**2`` overflow)
apply only to formats whose range is narrower than float32's (float16, fp8):
bfloat16 has float32's exponent.

A *correct* policy (softmax, losses and normalization statistics in float32,
matmuls and elementwise work in 16 bits) produces no finding; the audit is
meant to be run in a test so that regressions are caught.

Operations of the backward pass (``transpose`` in the name stack, created by
``jax.grad``) are skipped unless ``include_backward=True``: they mirror the
forward operations (fix the forward op and its transpose follows), and the
range of gradients is what :mod:`jmp_lite.diagnostics` and loss scaling cover.
Forward-pass operations that a derivative rule added (the division in
``rsqrt``'s derivative ``-0.5 * rsqrt(x) / x``) are reported, marked
:attr:`Finding.autodiff` with the operation they differentiate
(:attr:`Finding.derivative_of`): the user's line did not write them, and moving
that operation to float32 moves its derivative too.

The package, one concern per module (the walk knows no check by name):

=========================  =================================================================
``_report``                :class:`SourceLocation`, :class:`Finding`, :class:`AuditReport`
``_config``                :class:`AuditConfig`: validation, allow-lists
``_registry``              the contract of a check (``CheckFn``, ``Site``, ``Hit``) and the
                           registry the walk dispatches through
``_checks/``               the checks, one registered function each; ``AUDIT_CHECKS``
``_walk``                  the walk over nested jaxprs; findings from the checks' hits
``_ranges``                value ranges: the per-primitive transfer functions
``_graph``                 producers/consumers, what a statistic comes from
``_source``                source lines, scopes, operations autodiff created
``_policies``              the compute dtype each equation is judged by, and its source
``_api``                   :func:`audit` and :func:`audit_jaxpr`
=========================  =================================================================
"""

from jmp_lite._audit._api import audit, audit_jaxpr
from jmp_lite._audit._checks import AUDIT_CHECKS
from jmp_lite._audit._config import AuditConfig
from jmp_lite._audit._report import AuditReport, Finding, SourceLocation

__all__ = [
  "AUDIT_CHECKS",
  "AuditConfig",
  "AuditReport",
  "Finding",
  "SourceLocation",
  "audit",
  "audit_jaxpr",
]
