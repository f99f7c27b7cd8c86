"""Kept so that imports from ``jmp_lite.transform`` keep working; use ``jmp_lite.<name>``."""

from jmp_lite._transform import *  # noqa: F403
from jmp_lite._transform import __all__ as __all__
