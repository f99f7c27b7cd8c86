"""What several test files need to know about the package's public surface."""

# The public namespaces: each re-exports a curated `__all__` (docs/development.md).
NAMESPACES = (
  "jmp_lite",
  "jmp_lite.fp8",
  "jmp_lite.layerwise",
  "jmp_lite.diagnostics",
  "jmp_lite.plotting",
  "jmp_lite.flax",
  "jmp_lite.flax.fp8",
)
