"""The Triton stage: the model repository (`repository`) and the server process (`server`).

The python-backend model sources that run inside the server live in `specdeploy.triton.models`.
"""
