"""One hierarchy for every error a user can cause; only the CLI turns them into exit codes."""


class SpecDeployError(Exception):
    """Base class: `message` says what is wrong, `hint` says what to do about it."""

    exit_code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}\n  hint: {self.hint}" if self.hint else self.message


class ConfigError(SpecDeployError):
    """A recipe, flag or input the user gave is invalid (usage error)."""

    exit_code = 2


class ModelError(SpecDeployError):
    pass


class QuantizeError(SpecDeployError):
    pass


class BuildError(SpecDeployError):
    pass


class RepoError(SpecDeployError):
    pass


class ServerError(SpecDeployError):
    pass


class ClientError(SpecDeployError):
    pass


class ParityError(SpecDeployError):
    exit_code = 3


class BusyError(SpecDeployError):
    """Another specdeploy run holds the recipe's lock (see specdeploy.core.lock)."""


class StaleArtifactError(SpecDeployError):
    """An input artifact does not match the recipe; the hint names the command to re-run."""


class DiskFullError(SpecDeployError):
    """A stage ran out of space (ENOSPC / EDQUOT) writing its output; nothing half-written was left in place."""
