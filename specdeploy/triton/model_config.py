"""A Triton model's config as typed objects: `ModelSpec` (tensors, parameters, ensemble steps) -> `render` ->
`config.pbtxt` text, checked by parsing it with Triton's own `ModelConfig` protobuf (`check_config`).

Which models and tensors the repository holds is elsewhere (`triton.tensors`, `triton.layout_models`); this module
knows config.pbtxt only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdeploy.core.errors import RepoError


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # Triton's data type without the TYPE_ prefix: INT32, FP32, BOOL, STRING, UINT64, INT64
    dims: tuple[int, ...]  # per batch item
    optional: bool = False
    ragged: bool = False  # allow_ragged_batch


@dataclass(frozen=True)
class EnsembleStep:
    model: str
    input_map: tuple[tuple[str, str], ...]  # (step model's input, ensemble tensor)
    output_map: tuple[tuple[str, str], ...]  # (step model's output, ensemble tensor)


@dataclass(frozen=True)
class ModelSpec:
    """Everything a config.pbtxt says, plus which model.py source (if any) goes into version 1/."""

    name: str
    max_batch_size: int
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    backend: str | None = "python"
    platform: str | None = None  # "ensemble"
    parameters: dict[str, str] = field(default_factory=dict)
    instance_count: int = 1
    decoupled: bool = False
    dynamic_batching_delay_us: int | None = None  # None: no dynamic_batching block
    steps: tuple[EnsembleStep, ...] = ()
    source: str | None = None  # file name in specdeploy/triton/models/, copied as <name>/1/model.py


def _t(name, dtype, dims, optional=False, ragged=False) -> Tensor:
    return Tensor(name, dtype, tuple(dims), optional, ragged)


def _tensor_block(tensors: tuple[Tensor, ...]) -> str:
    items = []
    for t in tensors:
        lines = [
            f'    name: "{t.name}"',
            f"    data_type: TYPE_{t.dtype}",
            f"    dims: [ {', '.join(map(str, t.dims))} ]",
        ]
        if t.optional:
            lines.append("    optional: true")
        if t.ragged:
            lines.append("    allow_ragged_batch: true")
        items.append("  {\n" + "\n".join(lines) + "\n  }")
    return "[\n" + ",\n".join(items) + "\n]"


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render(spec: ModelSpec) -> str:
    """The config.pbtxt text of one model. A parameter without a value is an error, never a default."""
    out = [f"name: {_quote(spec.name)}"]
    if spec.platform:
        out.append(f"platform: {_quote(spec.platform)}")
    else:
        out.append(f"backend: {_quote(spec.backend)}")
    out.append(f"max_batch_size: {spec.max_batch_size}")
    if spec.decoupled:
        out.append("model_transaction_policy {\n  decoupled: true\n}")
    if spec.dynamic_batching_delay_us is not None:
        out.append(f"dynamic_batching {{\n  max_queue_delay_microseconds: {spec.dynamic_batching_delay_us}\n}}")
    out.append("input " + _tensor_block(spec.inputs))
    out.append("output " + _tensor_block(spec.outputs))
    if spec.steps:
        steps = []
        for step in spec.steps:
            maps = [f'      model_name: "{step.model}"', "      model_version: -1"]
            for key, value in step.input_map:
                maps.append(f"      input_map {{ key: {_quote(key)} value: {_quote(value)} }}")
            for key, value in step.output_map:
                maps.append(f"      output_map {{ key: {_quote(key)} value: {_quote(value)} }}")
            steps.append("    {\n" + "\n".join(maps) + "\n    }")
        out.append("ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}")
    if not spec.platform:
        out.append(f"instance_group [\n  {{\n    count: {spec.instance_count}\n    kind: KIND_CPU\n  }}\n]")
    for key, value in spec.parameters.items():
        if value is None:
            raise RepoError(
                f"model {spec.name}: parameter '{key}' has no value", "this is a bug in the repository generator"
            )
        out.append(f"parameters: {{\n  key: {_quote(key)}\n  value: {{ string_value: {_quote(str(value))} }}\n}}")
    return "\n".join(out) + "\n"


def check_config(text: str, expected_name: str | None = None):
    """Parse config.pbtxt text with Triton's ModelConfig protobuf; RepoError naming the problem otherwise."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise RepoError(
            f"config of model {expected_name or '?'} does not parse as Triton's ModelConfig: {exc}"
        ) from exc
    if expected_name is not None and config.name != expected_name:
        raise RepoError(f"config names model {config.name!r}, expected {expected_name!r}")
    return config


def _check_ensemble(spec: ModelSpec, specs: dict[str, ModelSpec]) -> None:
    """Every step mapping names a real tensor of the step model; every ensemble output is produced."""
    produced = {t.name for t in spec.inputs}
    for step in spec.steps:
        model = specs[step.model]
        model_inputs = {t.name for t in model.inputs}
        model_outputs = {t.name for t in model.outputs}
        for key, value in step.input_map:
            if key not in model_inputs or value not in produced:
                raise RepoError(f"ensemble step {step.model}: input {key} <- {value} maps an unknown tensor")
        for key, value in step.output_map:
            if key not in model_outputs:
                raise RepoError(f"ensemble step {step.model}: output {key} is not an output of {step.model}")
            produced.add(value)
    missing = [t.name for t in spec.outputs if t.name not in produced]
    if missing:
        raise RepoError(f"ensemble outputs {missing} are not produced by any step")
