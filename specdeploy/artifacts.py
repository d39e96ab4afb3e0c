"""Where each stage writes, and how: atomically (temporary directory, then rename) with a manifest.

A later stage reads the manifest of its input and refuses a mismatch with a hint naming the
command to re-run; an unchanged output is not rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdeploy.config import Recipe, stable_hash
from specdeploy.errors import StaleArtifactError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


def home() -> Path:
    """The cache for bundled models and server files: $SPECDEPLOY_HOME or ~/.cache/specdeploy."""
    return Path(os.environ.get("SPECDEPLOY_HOME", Path.home() / ".cache" / "specdeploy"))


@dataclass(frozen=True)
class Layout:
    """Output folders of one recipe under a project root (the current directory by default)."""

    root: Path
    recipe_name: str

    @classmethod
    def of(cls, recipe: Recipe, root: str | Path | None = None) -> "Layout":
        root = root or os.environ.get("SPECDEPLOY_ROOT") or Path.cwd()
        return cls(Path(root), recipe.name)

    @property
    def engines(self) -> Path:
        return self.root / "engines" / self.recipe_name

    def checkpoint(self, role: str) -> Path:
        return self.engines / "checkpoints" / role

    def engine(self, role: str) -> Path:
        return self.engines / role

    @property
    def repo(self) -> Path:
        return self.root / "triton_repo" / self.recipe_name

    @property
    def report(self) -> Path:
        return self.engines / "report"

    @property
    def server_state(self) -> Path:
        return self.engines / "server"


@dataclass
class Manifest:
    stage: str
    recipe_name: str
    fingerprint: str  # hash of everything the output depends on; equal fingerprint => up to date
    settings: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)  # input name -> fingerprint or file hash
    tool_versions: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # stage-specific results (e.g. the quality report)
    schema_version: int = SCHEMA_VERSION
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    def write(self, directory: Path) -> None:
        (directory / MANIFEST).write_text(json.dumps(asdict(self), indent=2, sort_keys=True, default=str) + "\n")

    @classmethod
    def read(cls, directory: Path) -> "Manifest | None":
        path = Path(directory) / MANIFEST
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (ValueError, TypeError):
            return None


def fingerprint(**parts) -> str:
    return stable_hash(parts)


def tool_versions(*modules: str) -> dict:
    """Versions of the named distributions (missing ones as null), plus specdeploy's own."""
    from importlib import metadata

    versions = {}
    for name in ("specdeploy", *modules):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def file_hash(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def dir_hash(directory: Path, patterns=("*.json", "*.safetensors", "*.bin", "*.model", "*.txt")) -> str:
    """Hash of the files in a model directory that define it (weights, configs, tokenizer)."""
    h = hashlib.sha256()
    files = sorted({p for pat in patterns for p in Path(directory).glob(pat) if p.name != MANIFEST})
    for path in files:
        h.update(path.name.encode())
        h.update(file_hash(path).encode())
    return h.hexdigest()[:16]


def is_up_to_date(directory: Path, expected_fingerprint: str) -> bool:
    manifest = Manifest.read(directory)
    return manifest is not None and manifest.fingerprint == expected_fingerprint


def require(directory: Path, stage: str, rerun: str, expected_fingerprint: str | None = None) -> Manifest:
    """The manifest of an input artifact, or a StaleArtifactError naming the command to re-run."""
    manifest = Manifest.read(directory)
    if manifest is None:
        raise StaleArtifactError(f"{directory} has no {stage} output (no {MANIFEST})", f"run: {rerun}")
    if manifest.stage != stage or manifest.schema_version != SCHEMA_VERSION:
        raise StaleArtifactError(
            f"{directory} holds a '{manifest.stage}' artifact (schema {manifest.schema_version}), "
            f"expected '{stage}' (schema {SCHEMA_VERSION})",
            f"run: {rerun}",
        )
    if expected_fingerprint is not None and manifest.fingerprint != expected_fingerprint:
        raise StaleArtifactError(
            f"{directory} was made from different inputs or settings than the recipe asks for now", f"run: {rerun}"
        )
    return manifest


@contextlib.contextmanager
def atomic_output(dest: Path):
    """Yield a temporary directory beside `dest`; on success it replaces `dest`, on failure it vanishes.

    The previous `dest` is kept intact until the new one is complete, so an interrupted or failed
    stage never loses an earlier good artifact.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_orphans(dest)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = dest.parent / f".{dest.name}.old-{os.getpid()}-{time.monotonic_ns()}"
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)


def _remove_orphans(dest: Path) -> None:
    """Delete temporary folders left beside `dest` by a process that was killed (SIGKILL leaves them)."""
    for leftover in dest.parent.glob(f".{dest.name}.*-*-*"):
        pid = leftover.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie of ours counts as gone
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True
