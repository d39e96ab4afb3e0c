"""The `specdeploy` command: one module per group of commands; `main` assembles them."""
