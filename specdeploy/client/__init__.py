"""The validation client: parity and latency of the speculative path against the unaccelerated control.

`protocol` holds the transport-free seam (request/response dataclasses and the `Endpoint`
protocol); `parity`, `latency`, `report` and `gate` are pure over it; `triton_adapter` is the
only module that imports tritonclient; `validate` orchestrates one run.
"""
