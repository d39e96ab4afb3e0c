"""The stages chained per backend: the CPU engine build, pre-flight checks, each backend's stages, the run pipeline,
the plan of `check`, the recipe's deployment for validation."""
