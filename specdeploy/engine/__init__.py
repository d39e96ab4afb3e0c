"""The CPU engine: compile TensorRT-LLM checkpoints and run them (see model.py for the parity rules)."""

from specdeploy.engine.build import build_recipe
from specdeploy.engine.compile import compile_checkpoint
from specdeploy.engine.kv_cache import KVCache
from specdeploy.engine.model import CpuEngine
from specdeploy.engine.spec import EngineSpec

__all__ = ["CpuEngine", "EngineSpec", "KVCache", "build_recipe", "compile_checkpoint"]
