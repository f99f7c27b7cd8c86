"""Flax's ``flax.training.dynamic_scale`` names, so it can be imported as ``dynamic_scale_lib``."""

from jmp_lite.flax._dynamic_scale import DynamicScale, DynamicScaleResult

__all__ = ["DynamicScale", "DynamicScaleResult"]
