"""Kept so that imports from ``jmp_lite.flax.module_policy`` keep working: the
implementation is private (``jmp_lite.flax._module_policy``); use ``jmp_lite.flax.<name>``.
"""

from jmp_lite.flax._module_policy import (
  DEFAULT_OVERRIDES as DEFAULT_OVERRIDES,
)
from jmp_lite.flax._module_policy import (
  FLAX_HOOKS as FLAX_HOOKS,
)
from jmp_lite.flax._module_policy import (
  FP32 as FP32,
)
from jmp_lite.flax._module_policy import (
  FP32_RECOMPUTED as FP32_RECOMPUTED,
)
from jmp_lite.flax._module_policy import (
  ExplicitDtypeWarning as ExplicitDtypeWarning,
)
from jmp_lite.flax._module_policy import (
  ModulePolicies as ModulePolicies,
)
from jmp_lite.flax._module_policy import (
  ModulePolicy as ModulePolicy,
)
