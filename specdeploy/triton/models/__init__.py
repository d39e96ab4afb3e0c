"""Python-backend model sources. Each `<name>.py` is copied as `<model>/1/model.py` into the
repository; it runs inside tritonserver's python stub (see `common.bootstrap` notes in each file)."""
