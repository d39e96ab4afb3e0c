"""The tritonserver binary and its python backend: found (`--server-binary PATH`, `$SPECDEPLOY_TRITONSERVER`, the
extracted wheel) or fetched (the `nvidia-pytriton` wheel, downloaded with `pip download --no-deps`, never installed:
it pins numpy<2 for its own package, extracted into `$SPECDEPLOY_HOME/tritonserver/`), the backend directory set up
with the python stub of this Python version, and what the models put on sys.path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdeploy.core.artifacts import home
from specdeploy.core.errors import ServerError

PYTRITON_WHEEL = "nvidia-pytriton==0.7.0"
BINARY_ENV = "SPECDEPLOY_TRITONSERVER"


def install_dir() -> Path:
    return home() / "tritonserver"


def _wheel_binary() -> Path:
    return install_dir() / "pytriton" / "tritonserver" / "bin" / "tritonserver"


# ---------------------------------------------------------------- finding the binary


def find_binary(explicit: str | os.PathLike | None = None, fetch: bool = True) -> Path | None:
    """The tritonserver binary: explicit path, $SPECDEPLOY_TRITONSERVER, the extracted wheel, or
    (fetch=True) the wheel downloaded now. None when not found and fetch=False."""
    for source, value in (("--server-binary", explicit), (f"${BINARY_ENV}", os.environ.get(BINARY_ENV))):
        if value:
            path = Path(value).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise ServerError(f"{source} {path} is not an executable file", "point it at a tritonserver binary")
            return path.resolve()
    if _wheel_binary().is_file():
        return _wheel_binary()
    if not fetch:
        return None
    fetch_wheel()
    return _wheel_binary()


def fetch_wheel() -> Path:
    """Download the nvidia-pytriton wheel (no dependencies) and extract the server into install_dir()."""
    dest = install_dir()
    with tempfile.TemporaryDirectory(prefix="specdeploy-pytriton-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PYTRITON_WHEEL, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ServerError(
                f"could not download {PYTRITON_WHEEL} (it holds the tritonserver binary): {proc.stderr.strip()[-500:]}",
                f"check network access to PyPI, or pass --server-binary PATH / set ${BINARY_ENV}",
            )
        wheels = list(Path(tmp).glob("nvidia_pytriton-*.whl"))
        if not wheels:
            raise ServerError(f"pip download {PYTRITON_WHEEL} produced no wheel", "pass --server-binary PATH")
        staging = Path(tempfile.mkdtemp(prefix=".tritonserver-", dir=dest.parent if dest.parent.exists() else None))
        try:
            with zipfile.ZipFile(wheels[0]) as zf:
                for info in zf.infolist():
                    if info.filename.startswith(("pytriton/tritonserver/", "nvidia_pytriton.libs/")):
                        zf.extract(info, staging)
                        mode = (info.external_attr >> 16) & 0o777
                        if mode:
                            os.chmod(staging / info.filename, mode)
            binary = staging / "pytriton" / "tritonserver" / "bin" / "tritonserver"
            if not binary.is_file():
                raise ServerError(
                    f"{wheels[0].name} has no pytriton/tritonserver/bin/tritonserver", "pass --server-binary PATH"
                )
            for path in [
                binary,
                *(staging / "pytriton" / "tritonserver" / "python_backend_stubs").glob("*/triton_python_backend_stub"),
            ]:
                path.chmod(0o755)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return dest


@dataclass(frozen=True)
class Install:
    """A usable server: binary, backend directory (with the python backend), library paths."""

    binary: Path
    backend_dir: Path
    lib_dirs: tuple[Path, ...]


def python_lib_dir() -> list[str]:
    """This interpreter's libpython folder, if it has one. The python stub links libpython3.X.so.1.0 and must
    load this interpreter's: the models import its lib-dynload modules (a pyenv 3.11.7 `_ssl` needs symbols a
    system libpython 3.11.2 lacks, and the loader would find the system copy first)."""
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    return [libdir] if libdir and soname and (Path(libdir) / soname).exists() else []


def prepare(binary: Path) -> Install:
    """Set up the backend directory for `binary` with the python stub of this Python version."""
    root = binary.parent.parent  # .../tritonserver
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stubs = root / "python_backend_stubs"
    libs = tuple(p for p in (root.parent.parent / "nvidia_pytriton.libs", root / "lib") if p.is_dir())
    if not stubs.is_dir():  # a regular install (/opt/tritonserver): its backends/ is ready as it is
        backend_dir = root / "backends"
        if not (backend_dir / "python").is_dir():
            raise ServerError(
                f"{backend_dir} has no python backend", "use a tritonserver build with the python backend"
            )
        return Install(binary, backend_dir, libs)
    stub = stubs / version / "triton_python_backend_stub"
    if not stub.is_file():
        have = ", ".join(sorted(p.name for p in stubs.iterdir()))
        raise ServerError(
            f"the server has no python backend stub for Python {version} (it has {have})",
            "run specdeploy with one of those Python versions",
        )
    backend_dir = install_dir() / "backends" if binary == _wheel_binary() else root.parent / f"backends-py{version}"
    python_dir = backend_dir / "python"
    marker = python_dir / ".stub-version"
    if not (marker.is_file() and marker.read_text() == f"{stub}\n"):
        if python_dir.exists():
            shutil.rmtree(python_dir)
        shutil.copytree(root / "backends" / "python", python_dir)
        shutil.copy2(stub, python_dir / "triton_python_backend_stub")
        (python_dir / "triton_python_backend_stub").chmod(0o755)
        marker.write_text(f"{stub}\n")
    return Install(binary, backend_dir, libs)


def site_paths(extra: tuple[str, ...] = ()) -> list[str]:
    """What the models put on sys.path: our source root, this interpreter's site-packages, extras."""
    import site

    source_root = str(Path(__file__).resolve().parents[2])
    paths = [*extra, source_root, *site.getsitepackages()]
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    if user and os.path.isdir(user):
        paths.append(user)
    return list(dict.fromkeys(paths))
