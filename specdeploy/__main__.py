"""`python -m specdeploy ...`: the `specdeploy` command where its script is not installed (a copied tree)."""

from specdeploy.cli.main import main

main(prog_name="specdeploy")
