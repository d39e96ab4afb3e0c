"""The `specdeploy` command line: the `main` group and its commands, one module per command group
(`cli_setup`, `cli_build`, `cli_serve`, `cli_generate`, `cli_validate`, `cli_ops`; what they share is `cli_common`,
the only place that turns SpecDeployError into exit codes)."""

from __future__ import annotations

import click

from specdeploy.cli import (
    build as cli_build,
)
from specdeploy.cli import (
    generate as cli_generate,
)
from specdeploy.cli import (
    ops as cli_ops,
)
from specdeploy.cli import (
    serve as cli_serve,
)
from specdeploy.cli import (
    setup as cli_setup,
)
from specdeploy.cli import (
    validate as cli_validate,
)
from specdeploy.cli.common import Context
from specdeploy.core.lock import LOCK_TIMEOUT_S


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--verbose", "-v", is_flag=True, help="Show tracebacks and debug output.")
@click.option(
    "--root",
    type=click.Path(file_okay=False),
    default=None,
    help="Project root holding engines/ and triton_repo/ (default: $SPECDEPLOY_ROOT or the current directory).",
)
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0),
    default=LOCK_TIMEOUT_S,
    show_default=True,
    help="Seconds to wait while another specdeploy run holds the recipe (engines/<recipe>/.lock); 0: fail at once.",
)
@click.version_option(package_name="specdeploy")
@click.pass_context
def main(ctx, verbose, root, lock_timeout):
    """Quantize, build, serve and validate speculative-decoding deployments on Triton."""
    ctx.obj = Context(verbose, root, lock_timeout)


# Every command, in pipeline order (`--help` lists them sorted).
COMMANDS = (
    cli_setup.check,
    cli_setup.doctor,
    cli_setup.models,  # recipe and environment
    cli_build.quantize,
    cli_build.draft_group,
    cli_build.build,
    cli_build.repo,  # the stages that write artifacts
    cli_serve.serve,
    cli_serve.stop,
    cli_serve.status,
    cli_generate.generate,  # serving, in-process generation
    cli_validate.validate,
    cli_validate.run_all,  # validation, every stage in one go
    cli_ops.monitor,
    cli_ops.canary,  # operations on a running deployment
)
for _command in COMMANDS:
    main.add_command(_command)
