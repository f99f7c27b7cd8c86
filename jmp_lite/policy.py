"""Kept so that imports from ``jmp_lite.policy`` keep working; use ``jmp_lite.<name>``."""

from jmp_lite._policy import *  # noqa: F403
from jmp_lite._policy import __all__ as __all__
