"""Kept so that imports from ``jmp_lite.loss_scale`` keep working: the
implementation is private (``jmp_lite._loss_scale``); use ``jmp_lite.<name>``.
"""

from jmp_lite._loss_scale import (
  DynamicLossScale as DynamicLossScale,
)
from jmp_lite._loss_scale import (
  LossScale as LossScale,
)
from jmp_lite._loss_scale import (
  NoOpLossScale as NoOpLossScale,
)
from jmp_lite._loss_scale import (
  StaticLossScale as StaticLossScale,
)
from jmp_lite._loss_scale import (
  all_finite as all_finite,
)
from jmp_lite._loss_scale import (
  select_tree as select_tree,
)
