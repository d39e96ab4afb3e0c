"""Python-backend model sources. Each model's `<name>.py` is copied as `<model>/1/model.py` into the
repository; it runs inside tritonserver's python stub (see `common.bootstrap` notes in each file). The helpers
they import (`common` and its parts, `bls_calls`) are not copied: the stub imports them from the installed package."""
