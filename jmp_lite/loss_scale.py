"""Kept so that imports from ``jmp_lite.loss_scale`` keep working; use ``jmp_lite.<name>``."""

from jmp_lite._loss_scale import *  # noqa: F403
from jmp_lite._loss_scale import __all__ as __all__
