"""The audit's checks: one registered function each (see :mod:`jmp_lite._audit._registry`).

Importing this package registers them; the import order below is the order of
:data:`AUDIT_CHECKS` and of the findings on one equation. A new check is one
function decorated with ``register`` in one of these modules (or in a new one
imported here).
"""

# isort: off
from jmp_lite._audit._checks import _exp_log  # noqa: F401 - softmax, logsumexp, exp, log, logistic
from jmp_lite._audit._checks import _statistics  # noqa: F401 - reduction, normalization, division
from jmp_lite._audit._checks import _matmul  # noqa: F401 - matmul
from jmp_lite._audit._checks import _cast  # noqa: F401 - cast
from jmp_lite._audit._checks import _compute_dtype  # noqa: F401 - fp32_matmul

# isort: on
from jmp_lite._audit._registry import registered

AUDIT_CHECKS: dict[str, str] = {check.name: check.description for check in registered()}
"""The checks :func:`~jmp_lite.audit` runs, by name, with a one-line description each (all are
enabled by default; :class:`~jmp_lite.AuditConfig` ``checks`` selects some)."""
