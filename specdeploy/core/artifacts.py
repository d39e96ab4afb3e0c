"""Where each stage writes, and how: atomically (temporary directory, then rename) with a manifest.

A later stage reads the manifest of its input and refuses a mismatch with a hint naming the
command to re-run; an unchanged output is not rebuilt.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdeploy.core.errors import StaleArtifactError
from specdeploy.recipe.config import EAGLE3_HEAD_TRAINED, EAGLE3_VOCAB_COUNTS, Recipe, stable_hash

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"


def home() -> Path:
    """The cache for bundled models and server files: $SPECDEPLOY_HOME or ~/.cache/specdeploy."""
    return Path(os.environ.get("SPECDEPLOY_HOME", Path.home() / ".cache" / "specdeploy"))


# EAGLE-3 heads shipped with specdeploy, each trained by `specdeploy draft train` (its README says how)
BUNDLED_HEADS = Path(__file__).resolve().parents[1] / "data" / "heads"


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
    def draft_data(self) -> Path:
        """draft.kind eagle3: the head's training data (`specdeploy draft data`): train.jsonl, heldout.jsonl,
        manifest."""
        return self.engines / "draft-data"

    def train_data(self, data_dir: str) -> Path:
        """The folder a head trains on: draft.train.data_dir (another recipe's draft data), or this recipe's own."""
        return Path(data_dir).expanduser() if data_dir else self.draft_data

    @property
    def eagle3_head(self) -> Path:
        """draft.kind eagle3: the head `specdeploy draft train` exports (EAGLE-3 checkpoint layout + manifest)."""
        return self.engines / "eagle3-head"

    def eagle3_head_source(self, head: str) -> Path:
        """The folder draft.head names: 'trained' (the head `specdeploy draft train` exports for this recipe), the
        name of a head shipped with specdeploy (specdeploy/data/heads/<name>), or a path."""
        if head == EAGLE3_HEAD_TRAINED:
            return self.eagle3_head
        if "/" not in head and (BUNDLED_HEADS / head / "config.json").is_file():
            return BUNDLED_HEADS / head
        return Path(head).expanduser()

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
        try:  # an artifact whose writer was killed mid-swap is put back first (see atomic_output)
            recover(Path(directory))
        except OSError:  # a read-only location: read what is there
            pass
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


def dir_hash(directory: Path, patterns=("*.json", "*.safetensors", "*.bin", "*.model", "*.txt"), exclude=()) -> str:
    """Hash of the files in a model directory that define it (weights, configs, tokenizer), less the names in
    `exclude`."""
    h = hashlib.sha256()
    files = sorted(
        {p for pat in patterns for p in Path(directory).glob(pat) if p.name != MANIFEST and p.name not in exclude}
    )
    for path in files:
        h.update(path.name.encode())
        h.update(file_hash(path).encode())
    return h.hexdigest()[:16]


def head_hash(directory: Path) -> str:
    """dir_hash of an EAGLE-3 head folder as training (`draft.train.init_head`) and the GPU backends read it: without
    its counts file (EAGLE3_VOCAB_COUNTS), which only the CPU engine's `draft.serve_vocab_size` reads (the CPU
    repository hashes it on its own where it cuts), so that counting a head's answers does not make a head trained
    from it, or a GPU engine built with it, stale."""
    return dir_hash(directory, exclude=(EAGLE3_VOCAB_COUNTS,))


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
    stage never loses an earlier good artifact, even when the process is killed (SIGKILL, power loss)
    between the two renames of the swap. The swap, with the folders beside `dest` it passes through:

        write  .NAME.tmp-PID-START-N    (the new artifact; removed if its writer died)
        rename NAME -> .NAME.old-...    (the previous artifact, always complete)
        rename .NAME.tmp-... -> NAME
        rename .NAME.old-... -> .NAME.trash-...  then delete it (a half-deleted folder is never an .old)

    A writer killed after the second step leaves no NAME: the next atomic_output or Manifest.read of
    `dest` renames the dead writer's .old back (`recover`). PID-START identifies the writer, so a
    reused PID does not make a dead writer's folders look alive.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    recover(dest)
    tmp = _scratch(dest, "tmp")
    try:
        tmp.mkdir()
        yield tmp
        _swap_in(tmp, dest)
    except BaseException as exc:
        written = tree_bytes(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        reason = disk_full_reason(exc)
        if reason:
            raise _disk_full(dest, written, reason) from exc
        raise


# How writers other than Python's own file objects report a full disk: safetensors raises SafetensorError("Error while
# serializing: I/O error: No space left on device (os error 28)") (Rust's io::Error text; seen on a full tmpfs,
# tests/test_faults.py), torch.save a RuntimeError that names no errno ("PytorchStreamWriter failed writing file ..." or
# "[enforce fail at inline_container.cc:672] . unexpected pos 56640 vs 56592", tests/test_draft_train.py).
_DISK_FULL_TEXT = (
    os.strerror(errno.ENOSPC),
    os.strerror(errno.EDQUOT),
    f"os error {errno.ENOSPC}",
    f"os error {errno.EDQUOT}",
)


def disk_full_reason(exc: BaseException, folder: Path | None = None) -> str | None:
    """The reason text when `exc` (or an exception it was raised from) is a full disk or quota, else None. An error
    that names no errno (torch.save's RuntimeError) counts when `folder` is given and its filesystem has less than 1 MiB
    free."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return exc.strerror or os.strerror(exc.errno)
        text = str(exc)
        for needle in _DISK_FULL_TEXT:
            if needle in text:
                return os.strerror(errno.ENOSPC) if needle.startswith("os error") else needle
        if folder is not None and isinstance(exc, (OSError, RuntimeError)) and free_bytes(folder) < 2**20:
            return f"{os.strerror(errno.ENOSPC)}: {text.splitlines()[0] if text else type(exc).__name__}"
        exc = exc.__cause__ or exc.__context__
    return None


def free_bytes(folder: Path) -> int:
    """Free bytes on the filesystem of `folder`, or of its nearest existing parent."""
    folder = Path(folder).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 2**63


@contextlib.contextmanager
def disk_full_as_error(folder: Path, what: str, kept: str):
    """Inside the block, a full disk (disk_full_reason) becomes a DiskFullError naming `folder`, what was being
    written there and what the stage keeps (`kept`: e.g. "the journal of the answers done so far; the next run
    resumes from it"). For a stage's work outside atomic_output: a resume journal, a training checkpoint."""
    from specdeploy.core.errors import DiskFullError

    folder = Path(folder)
    try:
        yield
    except DiskFullError:
        raise
    except Exception as exc:
        reason = disk_full_reason(exc, folder)
        if reason is None:
            raise
        free = free_bytes(folder)
        raise DiskFullError(
            f"no space left writing {what} in {folder} ({reason}); {_size(free)} free on its filesystem; {kept}",
            "make more space free there (or point --root at a larger disk) and run the command again",
        ) from exc


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it is gone)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _disk_full(dest: Path, written: int, reason: str):
    """The DiskFullError of a stage that ran out of space writing `dest` (its temporary folder already removed): it
    used up all the free space, so it needs more than what is free now; the previous output's size is an estimate."""
    from specdeploy.core.errors import DiskFullError

    free = shutil.disk_usage(dest.parent).free
    previous = tree_bytes(dest) if dest.is_dir() else 0
    need = max(free, written, previous)
    return DiskFullError(
        f"no space left writing {dest} ({reason}): it ran out after writing {_size(written)}, so it needs more than the"
        f" {_size(free)} free on the filesystem of {dest.parent}"
        + (f" (the previous one takes {_size(previous)}, and is unchanged)" if previous else "")
        + "; nothing was left half-written",
        f"make more than {_size(need)} free there, or point --root at a larger disk, and run the command again",
    )


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


_SCRATCH_KINDS = ("tmp", "old", "trash")


def _scratch(dest: Path, kind: str) -> Path:
    me = process_identity(os.getpid())
    start = me.start_ticks if me is not None else 0
    return dest.parent / f".{dest.name}.{kind}-{os.getpid()}-{start}-{time.monotonic_ns()}"


def _swap_in(tmp: Path, dest: Path) -> None:
    """Replace `dest` by `tmp` (the two renames of atomic_output), then delete the previous `dest`."""
    for _ in range(5):  # another process may publish its own `dest` between our two renames: retry
        old = _scratch(dest, "old")
        try:
            os.rename(dest, old)
        except FileNotFoundError:
            old = None
        try:
            os.rename(tmp, dest)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and dest.exists():
                if old is not None:  # someone else's newer `dest` is in place; ours goes in over it
                    _discard(old, dest)
                continue
            if old is not None and not os.path.lexists(dest):
                os.rename(old, dest)  # put the previous artifact back
            raise
        if old is not None:
            _discard(old, dest)
        return
    raise OSError(errno.EBUSY, f"could not replace {dest}: other processes keep writing it")


def _discard(old: Path, dest: Path) -> None:
    trash = _scratch(dest, "trash")
    os.rename(old, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _leftovers(dest: Path) -> list[tuple[Path, str, bool]]:
    """(folder, kind, writer alive) for the scratch folders beside `dest`."""
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.({'|'.join(_SCRATCH_KINDS)})-(\d+)-(?:(\d+)-)?\d+")
    found = []
    for path in dest.parent.glob(f".{glob.escape(dest.name)}.*-*"):
        match = pattern.fullmatch(path.name)
        if match:
            kind, pid, start = match.group(1), int(match.group(2)), match.group(3)
            found.append((path, kind, _writer_alive(pid, None if start is None else int(start))))
    return found


def _writer_alive(pid: int, start_ticks: int | None) -> bool:
    me = process_identity(pid)
    if me is None:
        return False
    # start 0: written where the start time was unknown; None: the older name without it
    return not start_ticks or me.start_ticks in (None, start_ticks)


def recover(dest: Path) -> None:
    """Repair what a killed atomic_output left beside `dest`: if `dest` is missing, put back the previous
    artifact its dead writer had set aside; delete the dead writers' other folders. Safe to run while
    other processes write `dest` (a live writer's folders are left alone)."""
    dest = Path(dest)
    if not dest.parent.is_dir():
        return
    leftovers = [(path, kind) for path, kind, alive in _leftovers(dest) if not alive]
    if not os.path.lexists(dest):
        for path, kind in sorted(
            leftovers, key=lambda item: item[0].stat().st_mtime if item[0].exists() else 0, reverse=True
        ):
            if kind == "old":
                try:
                    os.rename(path, dest)
                except OSError:  # another process restored or published first
                    pass
                break
    for path, kind in leftovers:
        if path.exists() and not (kind == "old" and not dest.exists()):
            shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as the kernel knows it: a PID alone can be reused, PID + start time cannot."""

    pid: int
    start_ticks: int | None  # clock ticks after boot (/proc/PID/stat field 22); None where unknown
    cmdline: tuple[str, ...]


def process_identity(pid: int) -> ProcessIdentity | None:
    """The identity of the running process `pid`, or None when it is gone (a zombie counts as gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        try:
            cmdline = tuple(proc.cmdline())
        except (psutil.AccessDenied, psutil.ZombieProcess):
            cmdline = ()
    except psutil.NoSuchProcess:
        return None
    except psutil.AccessDenied:
        return ProcessIdentity(pid, None, ()) if pid_alive(pid) else None
    return ProcessIdentity(pid, _start_ticks(pid, proc), cmdline)


def _start_ticks(pid: int, proc) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22; the name in (...) may hold spaces
    except (OSError, IndexError, ValueError):  # not Linux: psutil's start time, to 10 ms
        try:
            return round(proc.create_time() * 100)
        except Exception:  # noqa: BLE001 - psutil raises platform-specific errors here
            return None


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
