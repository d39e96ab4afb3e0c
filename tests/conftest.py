"""Shared fixtures: tiny random models built from transformers configs (fast, no downloads)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# grpc's fork handlers can block a fork (subprocess.Popen of tritonserver) forever while a channel's threads are
# busy (grpc/grpc#37259); every fork here is followed by exec, the case grpc documents this switch for
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest
import torch
from tiny_models import make_tiny_model, make_tokenizer

_running = {"test": None}


def pytest_runtest_logstart(nodeid, location):
    _running["test"] = nodeid


def pytest_sessionstart(session):
    """SPECDEPLOY_TEST_BUDGET_S (set by .ci/run): past it, print the test running and every thread's stack and exit,
    so a run that would outlive CI's time limit says where it was (pyproject.toml's per-test timeout catches a single
    hung test; this, many slow ones). Output capture is suspended first, or the stacks would go to pytest's capture."""
    budget = float(os.environ.get("SPECDEPLOY_TEST_BUDGET_S") or 0)
    if budget <= 0:
        return
    import faulthandler
    import sys
    import threading

    def out_of_time():
        capman = session.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            capman.suspend_global_capture(in_=True)
        sys.stderr.write(
            f"\nthe test suite outlived SPECDEPLOY_TEST_BUDGET_S={budget:g} s during {_running['test']}; "
            "every thread's stack:\n"
        )
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(3)

    timer = threading.Timer(budget, out_of_time)
    timer.daemon = True
    timer.start()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer (vocab 512) with <s>, </s>, <pad> special tokens."""
    path = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A random tiny LlamaForCausalLM (GQA, untied embeddings) saved as an HF folder with tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_model(path, tiny_tokenizer_dir, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_llama_draft_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A second, smaller random model with the same tokenizer (a draft for tiny_llama_dir)."""
    path = tmp_path_factory.mktemp("tiny-llama-draft")
    make_tiny_model(path, tiny_tokenizer_dir, seed=1, num_hidden_layers=1)
    return path


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test during which a tritonserver wrote its log gets the tail of that log (stub crashes,
    python model tracebacks), so a CI failure can be read without the machine."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    base = item.config._tmp_path_factory.getbasetemp()
    for log in base.rglob("tritonserver*.log"):
        if log.stat().st_mtime >= call.start - 1:
            lines = log.read_text(errors="replace").splitlines()[-60:]
            report.sections.append((f"server log {log.relative_to(base)} (last {len(lines)} lines)", "\n".join(lines)))


ROOM_LEFT = 64 * 1024  # what a full disk still has free: a stage writes a little, then runs out mid-write


@pytest.fixture
def full_disk(tmp_path):
    """full_disk(folder, keep=(), room=ROOM_LEFT) makes `folder` a small filesystem (a tmpfs; root only, else the test
    is skipped) holding copies of the entries named in `keep` (a stage's inputs, e.g. the checkpoints a build reads) and
    a filler file, so that only `room` bytes are free. Returns the names in the folder then; unmounted at the end (what
    was there before shows again)."""
    import shutil
    import subprocess
    from pathlib import Path

    mounted = []

    def mount(folder: Path, keep: tuple[str, ...] = (), room: int = ROOM_LEFT) -> list[str]:
        folder.mkdir(parents=True, exist_ok=True)
        held = Path(tmp_path) / f"held-{len(mounted)}"
        for name in keep:
            shutil.copytree(folder / name, held / name, symlinks=True)
        kept = sum(p.stat().st_size for p in held.rglob("*") if p.is_file()) if held.exists() else 0
        size = kept + 8 * ROOM_LEFT + 64 * 4096  # page rounding and inodes: the filler takes the slack
        got = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
        )
        if got.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({got.stderr.strip()}); needs root")
        mounted.append(folder)
        for name in keep:
            shutil.copytree(held / name, folder / name, symlinks=True)
        free = shutil.disk_usage(folder).free
        with open(folder / ".filler", "wb") as filler:
            filler.write(b"\0" * max(0, free - room))
        assert shutil.disk_usage(folder).free <= room + 4096
        return sorted(os.listdir(folder))

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture(scope="session")
def ops_decoupled(tmp_path_factory):
    """(recipe, layout, server) of the tiny decoupled CPU deployment (tests/ops_deploy.py) on a REAL tritonserver,
    shared by the OpenAI-front, front-security and fuzz tests; stopped at the end of the session, also on failure."""
    import ops_deploy

    model_dir = ops_deploy.make_model(tmp_path_factory.mktemp("ops-model"))
    root = tmp_path_factory.mktemp("openai-decoupled")
    recipe, layout, _ = ops_deploy.build(root, model_dir, "ops", triton={"decoupled": True})
    with ops_deploy.running(layout) as srv:
        yield recipe, layout, srv
