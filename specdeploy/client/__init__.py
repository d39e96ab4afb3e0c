"""The validation client: parity and latency of the speculative path against the unaccelerated control.

`deployment` describes what is validated (addresses, protocol, layout, model names, tokenizer; built from a
recipe by `specdeploy.deploy.recipe_deployment` or from the CLI options) and opens its endpoint; `protocol` holds the
transport-free seam (request/response dataclasses and the `Endpoint` protocol); `parity`, `latency`, `report`
and `gate` are pure over it; `triton_adapter` is the only module that imports tritonclient (`llmapi_adapter`
builds on it, `openai_adapter` speaks HTTP); `validate` orchestrates one run. The client imports the core
(errors, config types, metrics names, cost) and nothing of the stages.
"""
