"""The OpenAI-compatible front: request parsing (requests), the FastAPI app (app), the process (api)."""
