"""The quantize stage: ModelOpt calibration and export into TensorRT-LLM checkpoints, formats, quality."""
