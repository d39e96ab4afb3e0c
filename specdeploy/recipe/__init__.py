"""The recipe: frozen dataclasses (config), the YAML loader (load) and the checks across keys (checks)."""
