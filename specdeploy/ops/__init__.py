"""Operating a deployment: doctor, monitor, canary and the OpenAI-compatible front."""
