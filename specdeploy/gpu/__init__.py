"""The GPU backends: TensorRT-LLM engines and LLM-API options per release, their Triton models, the launch, the
Kubernetes manifests and the container image."""
