"""A precision policy applied op by op to any JAX function (``jl.autocast``).

``_table`` (the op table and its rules), ``_interpret`` (the jaxpr interpreter
that applies it, higher-order primitives included), ``_from_output`` and ``_broadcast``
(lean fp32 rules), ``_modules`` (per-class dtypes), ``_program`` (trace and evaluate; the
table applied to a program whose dtypes are chosen: the Flax entry points), ``_api``
(``autocast``, ``full_precision``).
"""

from jmp_lite._autocast._api import autocast, full_precision
from jmp_lite._autocast._program import rewrite
from jmp_lite._autocast._table import AUTOCAST_TABLE

__all__ = ["AUTOCAST_TABLE", "autocast", "full_precision", "rewrite"]
