"""Kept so that imports from ``jmp_lite.policy`` keep working: the
implementation is private (``jmp_lite._policy``); use ``jmp_lite.<name>``.
"""

from jmp_lite._policy import (
  Policy as Policy,
)
from jmp_lite._policy import (
  cast_to_full as cast_to_full,
)
from jmp_lite._policy import (
  cast_to_half as cast_to_half,
)
from jmp_lite._policy import (
  get_policy as get_policy,
)
