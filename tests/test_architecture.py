"""Imports flow one way (docs/architecture.md): every module of specdeploy sits in one layer of LAYER_OF and
imports only modules of the layers MAY_IMPORT allows it; nothing imports in a cycle.

Every import statement counts, those inside functions too (a function-level import is still a dependency, only a
later one), read with `ast` from the sources; nothing is imported to find them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specdeploy"

# Bottom to top. A layer imports its own modules and those of the layers listed for it, nothing else.
MAY_IMPORT = {
    "core": {"core"},
    "math": {"core", "math"},
    "runtime": {"core", "math", "runtime"},
    "triton-models": {"core", "math", "runtime", "triton-models"},
    "stages": {"core", "math", "runtime", "stages"},
    "client": {"core", "math", "client"},
    "backend-stages": {"core", "math", "runtime", "stages", "backend-stages"},
    "commands": {"core", "math", "runtime", "stages", "client", "backend-stages", "commands"},
    "cli": {"core", "math", "runtime", "stages", "client", "backend-stages", "commands", "cli"},
}

# Every module (package __init__ files aside: they import nothing, see test_packages_are_namespaces).
LAYER_OF = {
    # core: the recipe and what every layer shares; imports no stage
    "core.errors": "core",
    "core.backends": "core",  # facts about each backend (pure data); what a backend does is backend_stages
    "recipe.config": "core",  # the recipe's sections as frozen dataclasses, every default and choice
    "recipe.checks": "core",  # the checks across a recipe's keys
    "recipe.load": "core",  # YAML -> Recipe: unknown keys, types, then config_checks
    "core.trtllm_images": "core",  # which TensorRT-LLM each NGC Triton image carries; the image a GPU recipe runs in
    "core.artifacts": "core",
    "core.cost": "core",
    "core.durations": "core",  # how long something takes, for a person
    "core.gpus": "core",
    "core.lock": "core",
    "core.metrics.names": "core",  # the metrics a deployment exports, written once
    "core.metrics.sinks": "core",  # where updates go: Triton's MetricFamily, a prometheus_client registry
    "core.metrics.recorder": "core",  # the recorder the BLS writes through, BlsOps (metrics and the canary's arms)
    "core.metrics.reader": "core",  # the reader of the metrics endpoint: Snapshot, arm_stats
    "core.metrics.dashboard": "core",  # the Grafana dashboard
    "core.model_store": "core",  # where a recipe's model comes from (bundled or a local folder)
    "core.text_rules": "core",  # the one boundary every request text crosses (the front and the python-backend models)
    "core.sharegpt": "core",  # ShareGPT conversations (an optional wheel) and their fixed held-out split
    # math: pure and transport-free
    "speculation.loop": "math",
    "speculation.sampling": "math",
    "speculation.verify": "math",
    "speculation.policy": "math",
    "speculation.costs": "math",
    "speculation.schedule": "math",
    "speculation.sharing": "math",  # files shared by the BLS instances of one server
    "speculation.ngram": "math",
    # runtime: the CPU engine and in-process generation
    "engine.spec": "runtime",
    "engine.kv_cache": "runtime",
    "engine.kernels": "runtime",
    "engine.native": "runtime",
    "engine.lm_screen": "runtime",  # the greedy rows' LM head: an int8 screen, then the bf16 rows that can win
    "engine.model": "runtime",
    "engine.eagle3": "runtime",
    "engine.logits": "runtime",
    "engine.request": "runtime",  # what crosses the executor's seam: EngineRequest, GenerationChunk, GenerationStats
    "engine.kv_pool": "runtime",  # the pool of finished sequences' KV caches (prefix reuse)
    "engine.draft_cost": "runtime",  # speculative.policy cost inside the fused EAGLE-3 loop
    "engine.executor": "runtime",
    "engine.batching": "runtime",  # BatchScheduler: in-flight batching over one Executor
    "engine.generate": "runtime",
    # the python-backend models that run inside tritonserver: they import only what they run
    "triton.models.request_inputs": "triton-models",  # RequestError; a request's tensors read and checked
    "triton.models.optional_inputs": "triton-models",  # NVIDIA's optional inputs: honoured, or refused unless neutral
    "triton.models.text_stream": "triton-models",  # detokenizing a stream: TextStream, HoldBack
    "triton.models.cancellation": "triton-models",  # deadlines, cancellation, stop; BLS calls in time slices
    "triton.models.stub_safety": "triton-models",  # HeldResponses, StubLock: the python stub's hazards
    "triton.models.common": "triton-models",  # parameters, loading, execute_all; every part's names importable
    "triton.models.preprocessing": "triton-models",
    "triton.models.postprocessing": "triton-models",
    "triton.models.tensorrt_llm": "triton-models",
    "triton.models.bls_calls": "triton-models",  # the BLS's draft and target calls as the loop's Proposer / Verifier
    "triton.models.tensorrt_llm_bls": "triton-models",
    "triton.models.ngram_draft": "triton-models",
    "triton.models.llmapi": "triton-models",
    # stages: quantize, build, repository, serve/launch, and the checks before them
    "quantize.calibration": "stages",
    "quantize.stage": "stages",
    "quantize.formats": "stages",
    "quantize.calibration_text": "stages",
    "quantize.quality": "stages",
    "quantize.export": "stages",
    "quantize.modelopt": "stages",
    "deploy.cpu_compile": "stages",
    "deploy.cpu_build": "stages",
    "deploy.preflight": "stages",
    "gpu.trtllm_build": "stages",  # backend trtllm-engine: trtllm-build
    "gpu.llmapi_versions": "stages",  # each TensorRT-LLM release's LLM-API option names
    "gpu.llmapi_options": "stages",  # the recipe as LLM-API options
    "gpu.trtllm": "stages",
    "triton.model_config": "stages",  # ModelSpec -> config.pbtxt, checked with Triton's ModelConfig
    "triton.tensors": "stages",  # the inflight_batcher_llm layout's model names and tensors
    "triton.repo_inputs": "stages",  # the engines, tokenizer and head a repository is generated from
    "triton.layout_models": "stages",  # the layout's models as ModelSpecs
    "triton.repository": "stages",
    "gpu.triton_models": "stages",
    "gpu.llmapi_upstream": "stages",  # TensorRT-LLM's llmapi model.py/helpers.py: from the image or a checkout
    "gpu.llmapi_repository": "stages",
    "triton.shm": "stages",
    "triton.install": "stages",
    "triton.ports": "stages",  # the server's loopback ports
    "triton.server_state": "stages",  # what serve --detach records for status and stop
    "triton.stubs": "stages",  # the python-backend stubs under a server, and what a dead one left
    "triton.server": "stages",
    "gpu.image": "stages",
    "eagle3.samples": "stages",  # the head's training samples as draft train reads them, checked
    "eagle3.train_plan": "stages",  # a training run's steps, time and memory, refused up front
    "eagle3.modelopt": "stages",  # the head through ModelOpt: vocabulary, config, build, export
    "eagle3.train_loop": "stages",  # training the head: batches, held-out acceptance, resumable train_head
    "eagle3.train": "stages",  # specdeploy draft train: the EAGLE-3 head (ModelOpt)
    "eagle3.features": (
        "stages"
    ),  # draft.train.features engine: the target's side of a training step from the CPU engine
    # draft.train.feature_cache: the engine's features and labels kept for later epochs
    "eagle3.feature_cache": "stages",
    "gpu.launch_command": "stages",  # the tritonserver launch plan and its docker equivalent
    "gpu.k8s": "stages",  # the Kubernetes manifests
    "gpu.launch": "stages",
    "eagle3.generation": "stages",  # the target answering: chat template, generations in flight, the journal
    "eagle3.decode_torch": (
        "stages"
    ),  # the target answering from its weights with torch (a GPU), batch-invariant sampling
    "eagle3.prompts": "stages",  # the training prompts' sources, the validation exclusion, self-instruct
    "eagle3.data": "stages",  # draft.kind eagle3: the head's training data, written by the target engine
    "eagle3.head": "stages",  # the head a recipe drafts with: its folder and files, refused before any work
    # client: validation over the transport-free protocol and its adapters; never a stage
    "client.protocol": "client",
    "client.prompts": "client",
    "client.parity": "client",
    "client.latency": "client",
    "client.report_markdown": "client",
    "client.report_plots": "client",
    "client.report": "client",
    "client.gate": "client",
    "client.metrics_check": "client",
    "client.options": "client",
    "client.hf_codec": "client",
    "client.parity_phases": "client",
    "client.speed_phases": "client",
    "client.summary": "client",
    "client.validate": "client",
    "client.triton_adapter": "client",
    "client.openai_adapter": "client",
    "client.runtime_counters": "client",  # acceptance from a serving runtime's own counters (llama.cpp, vLLM, ...)
    "client.acceptance": "client",  # acceptance over every prompt served speculatively, with its interval
    "client.llmapi_adapter": "client",
    "client.deployment": "client",
    # the stages composed per backend
    "deploy.backend_stages": "backend-stages",
    # what one command runs
    "deploy.pipeline": "commands",
    "deploy.recipe_deployment": "commands",
    "deploy.plan": "commands",
    "ops.doctor": "commands",
    "ops.monitor": "commands",
    "ops.canary": "commands",
    "ops.openai.requests": "commands",
    "ops.openai.app": "commands",
    "ops.openai.api": "commands",
    "cli.common": "cli",  # RECIPE, the context, SpecDeployError -> exit codes
    "cli.setup": "cli",  # check, doctor, models
    "cli.build": "cli",  # quantize, draft data/train, build, repo
    "cli.serve": "cli",  # serve, stop, status
    "cli.generate": "cli",  # generate
    "cli.validate": "cli",  # validate, run
    "cli.ops": "cli",  # monitor, canary
    "cli.main": "cli",
    "__main__": "cli",  # python -m specdeploy
}

# The stages of the stages layer in the order `specdeploy run` chains them (the EAGLE-3 head is made before the build
# that serves it); a name ending in "." is a whole package. A stage module imports its own stage's modules and earlier
# ones: what a later stage needs from an earlier one is handed down, and a check before any work asks the stage that
# makes an artifact, never the one that consumes it. The pre-flight checks are asked by every stage, of every stage.
STAGES = {
    "quantize": ("quantize.",),
    "eagle3": ("eagle3.",),
    "build": (
        "deploy.cpu_build",
        "deploy.cpu_compile",
        "gpu.trtllm_build",
        "gpu.trtllm",
        "gpu.llmapi_options",
        "gpu.llmapi_versions",
    ),
    "repository": (
        "triton.model_config",
        "triton.tensors",
        "triton.repo_inputs",
        "triton.layout_models",
        "triton.repository",
        "gpu.triton_models",
        "gpu.llmapi_upstream",
        "gpu.llmapi_repository",
    ),
    "serve": (
        "triton.shm",
        "triton.install",
        "triton.ports",
        "triton.server_state",
        "triton.stubs",
        "triton.server",
        "gpu.launch_command",
        "gpu.k8s",
        "gpu.launch",
        "gpu.image",
    ),
}
STAGE_CHECKS = {"deploy.preflight"}


def stage_of(module: str) -> str | None:
    for stage, names in STAGES.items():
        if any(module == n or (n.endswith(".") and module.startswith(n)) for n in names):
            return stage
    return None


# ---------------------------------------------------------------- reading the imports


def modules(package: Path) -> dict[str, Path]:
    """Dotted names relative to the package ("engine.model"; a package's __init__ is its own name) -> file."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imported(node, importer: str, is_package: bool, root: str) -> list[str]:
    """Dotted names (relative to the package) that one import statement may load, before checking they exist."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif node.level:  # relative: from . import x, from ..y import z
        base = importer.split(".") if importer else []
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        module = ".".join([root, *base, *([node.module] if node.module else [])])
        names = [module, *(f"{module}.{a.name}" for a in node.names)]
    else:
        names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    inside = []
    for n in names:
        if n == root:
            inside.append("")  # the package's own __init__
        elif n.startswith(root + "."):
            inside.append(n[len(root) + 1 :])
    return inside


def import_graph(package: Path) -> dict[str, set[str]]:
    """importer -> the package's modules it imports, anywhere in its source. `from a import b` counts `a` and, when
    it is a module, `a.b`; a name that is no module counts its closest enclosing module."""
    found = modules(package)
    graph = {name: set() for name in found}
    for name, path in found.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, name, path.name == "__init__.py", package.name):
                while target not in found and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in found and target != name:
                    graph[name].add(target)
    return graph


def is_package(package: Path, name: str) -> bool:
    return (package / Path(*name.split(".")) / "__init__.py").is_file() if name else True


def layer_violations(graph, layer_of, may_import, package: Path = PACKAGE) -> list[str]:
    """Each import of a module of a layer its importer may not import (a package's __init__ is a namespace)."""
    found = []
    for importer, targets in sorted(graph.items()):
        for target in sorted(targets):
            if is_package(package, target):
                continue
            if layer_of[target] not in may_import[layer_of[importer]]:
                found.append(f"{importer} ({layer_of[importer]}) imports {target} ({layer_of[target]})")
    return found


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# ---------------------------------------------------------------- specdeploy


def test_every_module_has_a_layer():
    names = {n for n in modules(PACKAGE) if not is_package(PACKAGE, n)}
    missing, stale = sorted(names - set(LAYER_OF)), sorted(set(LAYER_OF) - names)
    assert not missing, f"add {missing} to LAYER_OF in tests/test_architecture.py (and to docs/architecture.md)"
    assert not stale, f"remove {stale} from LAYER_OF in tests/test_architecture.py: no such module"
    assert set(LAYER_OF.values()) == set(MAY_IMPORT)


def test_packages_are_namespaces():
    """A package's __init__ imports nothing: importing `engine.kernels` then loads no other part of `engine`."""
    graph = import_graph(PACKAGE)
    loaded = {n: sorted(graph[n]) for n in modules(PACKAGE) if is_package(PACKAGE, n) and graph[n]}
    assert loaded == {}, f"these package __init__ files import modules; import them where they are used: {loaded}"


def test_no_import_against_the_direction():
    found = layer_violations(import_graph(PACKAGE), LAYER_OF, MAY_IMPORT)
    assert found == [], "imports against the layers of docs/architecture.md:\n  " + "\n  ".join(found)


def test_no_stage_imports_a_later_stage():
    stages = {m for m, layer in LAYER_OF.items() if layer == "stages"} - STAGE_CHECKS
    unplaced = sorted(m for m in stages if stage_of(m) is None)
    assert not unplaced, f"give {unplaced} a stage in STAGES (tests/test_architecture.py)"
    order = list(STAGES)
    found = [
        f"{importer} ({stage_of(importer)}) imports {target} ({stage_of(target)})"
        for importer, targets in sorted(import_graph(PACKAGE).items())
        for target in sorted(targets)
        if importer in stages and target in stages and order.index(stage_of(target)) > order.index(stage_of(importer))
    ]
    assert found == [], "stages that ask a later stage (hand the value down instead):\n  " + "\n  ".join(found)


def test_no_import_cycles():
    found = cycles(import_graph(PACKAGE))
    assert found == [], "modules that import each other:\n  " + "\n  ".join(
        f"cycle of {len(c)}: {' '.join(c)}" for c in found
    )


# ---------------------------------------------------------------- the checker itself, on a package written here


def test_the_checker_sees_function_level_relative_and_plain_imports(tmp_path):
    toy = tmp_path / "toy"
    (toy / "sub").mkdir(parents=True)
    (toy / "__init__.py").write_text("")
    (toy / "sub" / "__init__.py").write_text("")
    (toy / "base.py").write_text("def f():\n    from toy.sub import top  # a late, upward import\n    return top\n")
    (toy / "mid.py").write_text("from . import base\n")
    (toy / "sub" / "top.py").write_text("import toy.mid\nfrom ..base import f\n")
    graph = import_graph(toy)
    assert graph == {
        "": set(),
        "sub": set(),
        "base": {"sub", "sub.top"},
        "mid": {"", "base"},
        "sub.top": {"mid", "base"},
    }
    layer_of = {"base": "core", "mid": "stages", "sub.top": "cli"}
    may_import = {"core": {"core"}, "stages": {"core", "stages"}, "cli": {"core", "stages", "cli"}}
    assert layer_violations(graph, layer_of, may_import, package=toy) == ["base (core) imports sub.top (cli)"]
    assert cycles(graph) == [["base", "mid", "sub.top"]]
