"""specdeploy: validated speculative-decoding deployments on Triton."""
