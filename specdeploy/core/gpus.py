"""What GPUs this machine has: probed with `nvidia-smi`, else `torch.cuda`, else none.

Every probe degrades to "no GPU" (an empty list) instead of raising: development machines and CI
have no GPU, and the GPU backends still dry-run, generate configs and print commands there.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

# nvidia-smi --query-gpu fields (see `nvidia-smi --help-query-gpu`); compute_cap needs driver >= 510.
_SMI_FIELDS = "index,name,memory.total,compute_cap"


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None  # None when the probe could not tell

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30

    def summary(self) -> str:
        cc = "cc ?" if self.compute_capability is None else "cc {}.{}".format(*self.compute_capability)
        return f"GPU {self.index}: {self.name}, {self.memory_gib:.1f} GiB, {cc}"


def probe(timeout_s: float = 10.0) -> list[GpuInfo]:
    """The GPUs of this machine, or [] when there are none (or no way to ask)."""
    gpus = _probe_nvidia_smi(timeout_s)
    if gpus:
        return gpus
    return _probe_torch()


def _probe_nvidia_smi(timeout_s: float) -> list[GpuInfo]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return parse_nvidia_smi(out.stdout)


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    """Parse `nvidia-smi --query-gpu=index,name,memory.total,compute_cap --format=csv,noheader,nounits`."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            index, name, mem_mib = int(parts[0]), parts[1], float(parts[2])
        except ValueError:
            continue
        cc = None
        if len(parts) >= 4 and "." in parts[3]:
            major, minor = parts[3].split(".", 1)
            if major.isdigit() and minor.isdigit():
                cc = (int(major), int(minor))
        gpus.append(GpuInfo(index, name, int(mem_mib * 2**20), cc))
    return gpus


def _probe_torch() -> list[GpuInfo]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        gpus = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(GpuInfo(i, props.name, int(props.total_memory), (props.major, props.minor)))
        return gpus
    except Exception:  # noqa: BLE001 - any CUDA/driver failure means "no usable GPU" here
        return []


def tensorrt_llm_version() -> str | None:
    """The installed tensorrt_llm distribution's version, without importing it (importing needs CUDA)."""
    from importlib import metadata

    for dist in ("tensorrt_llm", "tensorrt-llm"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def describe(gpus: list[GpuInfo]) -> str:
    return "; ".join(g.summary() for g in gpus) if gpus else "no GPU"
