"""The CPU engine: compile TensorRT-LLM checkpoints (`compile`) and run them (`model.CpuEngine`, see model.py for
the parity rules); `build` is the cpu backend's build stage.

Import the module you use: this package imports none of them, so that loading one part (say `native` from
`kernels`) never loads the others (docs/architecture.md).
"""
