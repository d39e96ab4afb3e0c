"""The Triton repository generator and server helpers, without starting a server (fast)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

sys.path.insert(0, str(Path(__file__).parent))

from triton_hf_engine import make_engines, write_engine  # noqa: E402

from specdeploy.core.errors import RepoError, ServerError, StaleArtifactError  # noqa: E402
from specdeploy.deploy import backend_stages  # noqa: E402
from specdeploy.triton import (  # noqa: E402
    install,
    layout_models,
    model_config,
    repo_inputs,
    repository,
    server,
    server_state,
    tensors,
)
from specdeploy.triton import ports as triton_ports
from specdeploy.triton.models import (
    cancellation,
    common,  # noqa: E402
    optional_inputs,
    request_inputs,
    stub_safety,
    text_stream,
)

FACTORY = "triton_hf_engine:load_executor"
MODELS = ("preprocessing", "tensorrt_llm", "tensorrt_llm_draft", "postprocessing", "ensemble", "tensorrt_llm_bls")


@pytest.fixture
def setup(tmp_path, tiny_llama_dir, tiny_llama_draft_dir):
    return make_engines(tmp_path, tiny_llama_dir, tiny_llama_draft_dir)


def _parse(path: Path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_every_config_parses_with_tritons_schema(setup):
    recipe, layout = setup
    path, written = backend_stages.of(recipe).write_repository(recipe, layout, executor_factory=FACTORY)
    assert written and path == layout.repo
    for name in MODELS:
        config = _parse(path / name / "config.pbtxt")
        assert config.name == name
        if name != "ensemble":
            assert (path / name / "1" / "model.py").is_file()
    assert (path / "preprocessing" / "tokenizer" / "tokenizer_config.json").is_file()
    ens = _parse(path / "ensemble" / "config.pbtxt")
    assert ens.platform == "ensemble" and [s.model_name for s in ens.ensemble_scheduling.step] == [
        "preprocessing",
        "tensorrt_llm",
        "postprocessing",
    ]
    llm = _parse(path / "tensorrt_llm" / "config.pbtxt")
    names = {i.name: i for i in llm.input}
    assert names["draft_input_ids"].optional and names["input_ids"].data_type == model_config_pb2.TYPE_INT32
    assert llm.parameters["gpt_model_path"].string_value == str(layout.engine("target").resolve())
    assert llm.parameters["max_draft_len"].string_value == "4"
    draft = _parse(path / "tensorrt_llm_draft" / "config.pbtxt")
    assert draft.parameters["gpt_model_path"].string_value == str(layout.engine("draft").resolve())
    bls = _parse(path / "tensorrt_llm_bls" / "config.pbtxt")
    assert {"num_draft_tokens", "use_draft_logits", "text_input", "max_tokens"} <= {i.name for i in bls.input}
    assert {"acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens"} <= {o.name for o in bls.output}
    # the BLS streams each response's new text: NVIDIA's BLS calls that accumulate_tokens false (true: all text so far)
    assert bls.parameters["accumulate_tokens"].string_value == "false"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["stage"] == "repo" and manifest["inputs"] == {
        "target_engine": "test-target",
        "draft_engine": "test-draft",
    }


def test_decoupled_and_instances_follow_the_recipe(tmp_path, tiny_llama_dir, tiny_llama_draft_dir):
    recipe, layout = make_engines(
        tmp_path, tiny_llama_dir, tiny_llama_draft_dir, triton={"decoupled": True, "instance_count": 3}
    )
    path, _ = backend_stages.of(recipe).write_repository(recipe, layout, executor_factory=FACTORY)
    for name in ("tensorrt_llm", "tensorrt_llm_draft", "tensorrt_llm_bls"):
        config = _parse(path / name / "config.pbtxt")
        assert config.model_transaction_policy.decoupled
        assert config.instance_group[0].count == 3
    assert not _parse(path / "preprocessing" / "config.pbtxt").model_transaction_policy.decoupled


def test_up_to_date_repo_is_kept_and_stale_repo_refused(setup, tmp_path, tiny_llama_dir):
    recipe, layout = setup
    _, written = backend_stages.of(recipe).write_repository(recipe, layout, executor_factory=FACTORY)
    assert written
    _, written = backend_stages.of(recipe).write_repository(recipe, layout, executor_factory=FACTORY)
    assert not written
    repository.require_repository(recipe, layout)
    # a rebuilt engine (new fingerprint) makes the repository stale
    write_engine(layout.engine("target"), tiny_llama_dir, recipe, "target", 4, fingerprint="rebuilt")
    with pytest.raises(StaleArtifactError) as err:
        repository.require_repository(recipe, layout, "r.yaml")
    assert "specdeploy repo r.yaml" in err.value.hint
    _, written = backend_stages.of(recipe).write_repository(recipe, layout, executor_factory=FACTORY)
    assert written
    repository.require_repository(recipe, layout)


def test_missing_or_wrong_engines_are_refused_with_a_build_hint(setup):
    recipe, layout = setup
    (layout.engine("draft") / "manifest.json").unlink()
    with pytest.raises(StaleArtifactError) as err:
        backend_stages.of(recipe).write_repository(recipe, layout, "r.yaml", executor_factory=FACTORY)
    assert "specdeploy build r.yaml" in err.value.hint


def test_target_without_enough_max_draft_len_is_refused(tmp_path, tiny_llama_dir, tiny_llama_draft_dir):
    recipe, layout = make_engines(tmp_path, tiny_llama_dir, tiny_llama_draft_dir)
    write_engine(layout.engine("target"), tiny_llama_dir, recipe, "target", 2)
    with pytest.raises(RepoError, match="max_draft_len"):
        backend_stages.of(recipe).write_repository(recipe, layout, executor_factory=FACTORY)


def test_cpu_backend_writes_the_shared_layout(setup):
    recipe, layout = setup
    inp = repo_inputs.repo_inputs(recipe, layout, executor_factory=FACTORY)
    stages = backend_stages.of(recipe)
    specs = layout_models.model_specs(
        repo_inputs.RepoInputs(recipe, inp.engine_dirs, inp.engine_manifests, FACTORY), stages.engine_models
    )
    assert [s.name for s in specs] == list(MODELS)
    assert [s.name for s in stages.engine_models(inp)] == ["tensorrt_llm", "tensorrt_llm_draft"]


def test_render_refuses_a_parameter_without_value():
    spec = model_config.ModelSpec(
        "m", 1, tensors.POSTPROCESSING_INPUTS, tensors.POSTPROCESSING_OUTPUTS, parameters={"x": None}
    )
    with pytest.raises(RepoError, match="'x' has no value"):
        model_config.render(spec)


def test_check_config_reports_a_broken_config():
    with pytest.raises(RepoError, match="ModelConfig"):
        model_config.check_config('name: "x"\nmax_batch_size: "many"\n', "x")


def test_words_list_round_trip():
    words = [[5, 6], [7], [8, 9, 10]]
    arr = request_inputs.to_words_list(words)
    assert arr.shape == (2, 6) and arr[1].tolist() == [2, 3, 6, -1, -1, -1]
    assert request_inputs.from_words_list(arr[None], "x") == words
    assert request_inputs.from_words_list(request_inputs.to_words_list([]), "x") == []


def test_text_stream_holds_back_partial_characters(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    ids = tok("héllo wörld, ünïcode", add_special_tokens=False).input_ids
    stream = text_stream.TextStream(tok, True)
    text = "".join(stream.push([t]) for t in ids) + stream.flush()
    assert text == tok.decode(ids, skip_special_tokens=True) == "héllo wörld, ünïcode"


def test_ports_and_state(tmp_path):
    ports = triton_ports.Ports.pick()
    assert len({ports.grpc, ports.http, ports.metrics}) == 3
    state = server_state.ServerState(os.getpid(), 1, 2, 3, "log", "repo", 0.0)
    state.write(tmp_path)
    assert server_state.ServerState.read(tmp_path) == state
    assert server.status(tmp_path / "none")[0] is None
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ServerError, match="already in use"):
            triton_ports.Ports.pick(grpc=s.getsockname()[1])


def test_explicit_binary_must_exist(tmp_path):
    with pytest.raises(ServerError, match="not an executable"):
        install.find_binary(tmp_path / "nope")


def test_relevant_log_picks_errors(tmp_path):
    log = tmp_path / "log"
    log.write_text("I1 fine\nW1122 pinned memory CUDA driver\nE1122 00:00:00 x.cc] \"failed to load 'm'\"\nI2 more\n")
    text = server.relevant_log(log)
    assert "failed to load" in text and "pinned" not in text


def test_scalar_and_utf8_checks():
    assert request_inputs.scalar(np.array([[3]]), "x", int) == 3
    assert request_inputs.scalar(None, "x", int, 7) == 7
    with pytest.raises(request_inputs.RequestError, match="one value"):
        request_inputs.scalar(np.array([[1, 2]]), "x", int)
    with pytest.raises(request_inputs.RequestError, match="not valid UTF-8"):
        request_inputs.decode_utf8(b"ok \xff\xfe", "text_input")


def test_cli_repo_serve_status_stop_without_a_server(setup, tmp_path):
    import yaml
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    recipe, layout = setup
    recipe_file = tmp_path / "tiny.yaml"
    from specdeploy.recipe.config import to_plain

    recipe_file.write_text(yaml.safe_dump(to_plain(recipe)))
    runner = CliRunner()
    root = ["--root", str(layout.root)]
    result = runner.invoke(main, [*root, "serve", str(recipe_file)])
    assert result.exit_code != 0 and f"specdeploy repo {recipe_file}" in result.output
    result = runner.invoke(main, [*root, "repo", str(recipe_file)])
    assert result.exit_code == 0 and "wrote" in result.output, result.output
    result = runner.invoke(main, [*root, "repo", str(recipe_file)])
    assert "up to date" in result.output
    result = runner.invoke(main, [*root, "status", str(recipe_file)])
    assert "not running" in result.output and result.exit_code == 3  # LSB's "not running": scripts can tell
    assert "no server to stop" in runner.invoke(main, [*root, "stop", str(recipe_file)]).output
    (layout.engine("target") / "manifest.json").unlink()
    result = runner.invoke(main, [*root, "repo", str(recipe_file)])
    assert result.exit_code != 0 and f"specdeploy build {recipe_file}" in result.output


def test_tokenizer_found_through_the_engine_manifest(tmp_path, tiny_llama_dir):
    from specdeploy.core.artifacts import Manifest

    engine = tmp_path / "engine"
    engine.mkdir()
    manifest = Manifest(stage="build", recipe_name="x", fingerprint="f", extra={"model": str(tiny_llama_dir)})
    assert repo_inputs.find_tokenizer(engine, manifest) == Path(tiny_llama_dir)
    with pytest.raises(RepoError, match="no tokenizer"):
        repo_inputs.find_tokenizer(engine, Manifest(stage="build", recipe_name="x", fingerprint="f"))


REFERENCE = Path(__file__).parent / "data" / "trtllm_backend_c2e65b8_tensors.json"


# specdeploy's additions beyond NVIDIA's layout, per model (sent only on request)
EXTENSIONS = {
    "outputs": {
        "tensorrt_llm_bls": {t.name for t in tensors.OUTPUT_COUNT + tensors.BLS_EXTRA_OUTPUTS},
        "ensemble": {t.name for t in tensors.OUTPUT_COUNT},
    }
}


def _declared(config, kind, extensions: bool = False):
    """NVIDIA's tensors of a model's config (with `extensions`: only specdeploy's additions)."""
    items = config.input if kind == "inputs" else config.output
    ours = EXTENSIONS.get(kind, {}).get(config.name, set())
    return {
        t.name: (
            model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_"),
            list(t.dims),
            bool(getattr(t, "optional", False)),
        )
        for t in items
        if (t.name in ours) == extensions
    }


@pytest.mark.parametrize("backend", ["cpu", "trtllm-engine"])
def test_every_tensor_is_declared_as_nvidia_declares_it(setup, backend):
    """Name, data type, dims and optional flag of every tensor of NVIDIA's layout (tensorrtllm_backend
    c2e65b8, extracted by tests/data/extract_trtllm_reference.py), on the CPU and the GPU variants. The GPU
    variant's tensorrt_llm models and ensemble take the names of the backend release that built the engines
    (tests/test_trtllm_repo.py checks them against each release's config.pbtxt); the rest is c2e65b8's."""
    from dataclasses import replace

    recipe, layout = setup
    inp = repo_inputs.repo_inputs(recipe, layout, executor_factory=FACTORY)
    if backend != "cpu":
        inp = repo_inputs.RepoInputs(replace(recipe, backend=backend), inp.engine_dirs, inp.engine_manifests, FACTORY)
    configs = {
        s.name: model_config.check_config(model_config.render(s), s.name)
        for s in layout_models.model_specs(inp, backend_stages.of(inp.recipe).engine_models)
    }
    reference = json.loads(REFERENCE.read_text())
    counts = {}
    models = ("preprocessing", "tensorrt_llm", "tensorrt_llm_bls", "postprocessing", "ensemble")
    if backend != "cpu":
        models = ("preprocessing", "tensorrt_llm_bls", "postprocessing")
    for model in models:
        names = [model] + (["tensorrt_llm_draft"] if model == "tensorrt_llm" else [])
        for name in names:
            for kind in ("inputs", "outputs"):
                expected = {t["name"]: (t["dtype"], t["dims"], t["optional"]) for t in reference[model][kind]}
                assert _declared(configs[name], kind) == expected, (name, kind)
        counts[model] = len(_declared(configs[model], "inputs").keys() | _declared(configs[model], "outputs").keys())
    # the additions: the output count on the text-level models (as tensorrt_llm declares it), the rounds on the BLS
    count = {"sequence_length": ("INT32", [-1], False)}
    assert _declared(configs["tensorrt_llm_bls"], "outputs", extensions=True) == {
        **count,
        "speculative_k_history": ("INT32", [-1], False),
        "speculative_draft_seconds": ("FP32", [-1], False),
        "speculative_target_seconds": ("FP32", [-1], False),
    }
    if backend == "cpu":
        assert _declared(configs["ensemble"], "outputs", extensions=True) == count
    # the counts the issue names: 51 on ensemble, 78 on tensorrt_llm, 57 on tensorrt_llm_bls
    if backend == "cpu":
        assert (counts["ensemble"], counts["tensorrt_llm"], counts["tensorrt_llm_bls"]) == (51, 78, 57)
    assert counts["tensorrt_llm_bls"] == 57


def test_refused_inputs_name_the_tensor_and_accept_neutral_values():
    get = {"beam_width": np.array([[1]], np.int32), "lora_weights": np.zeros((1, 0, 0), np.float16)}.get
    optional_inputs.refuse_unsupported(get, ("beam_width", "lora_weights", "lookahead_window_size"))
    for name, value in (
        ("beam_width", np.array([[2]], np.int32)),
        ("lora_task_id", np.array([[7]], np.uint64)),
        ("guided_decoding_guide", np.array([[b"{}"]], object)),
    ):
        with pytest.raises(request_inputs.RequestError, match=f"'{name}'"):
            optional_inputs.refuse_unsupported({name: value}.get, (name,))


def test_an_empty_prompt_is_what_the_tokenizer_makes_of_it():
    """As NVIDIA's preprocessing: "" through a tokenizer that adds BOS is the prompt [BOS] (unconditional generation);
    through one that adds nothing it has no token, refused."""
    from types import SimpleNamespace

    def tokenizer(bos):
        return lambda text, add_special_tokens=True: SimpleNamespace(
            input_ids=([1] if bos and add_special_tokens else []) + [ord(c) for c in text]
        )

    assert request_inputs.encode_prompt(tokenizer(True), "", True, 16) == [1]
    with pytest.raises(request_inputs.RequestError, match="empty or tokenizes to no tokens"):
        request_inputs.encode_prompt(tokenizer(False), "", True, 16)


def test_embedding_bias_from_words(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    ids = tok("fox", add_special_tokens=False).input_ids
    bias = optional_inputs.embedding_bias_from_words(tok, ["fox", "fox"], np.array([1.5, -0.5], np.float32), 512)
    expected = np.zeros(512, np.float32)
    for t in ids:
        expected[t] += 1.0
    assert np.array_equal(bias, expected)
    assert optional_inputs.embedding_bias_from_words(tok, [], None, 512) is None
    with pytest.raises(request_inputs.RequestError, match="one weight per word"):
        optional_inputs.embedding_bias_from_words(tok, ["fox"], np.array([1.0, 2.0], np.float32), 512)
    # as NVIDIA's preprocessing: a batch item padded with "" and 0.0 (the shorter list of a batch) is its words alone,
    # and words without weights (or weights without words) are no bias (preprocessing/1/model.py:691-712 at c2e65b8)
    padded = optional_inputs.embedding_bias_from_words(
        tok, np.array([b"fox", b"fox", b""], object), np.array([1.5, -0.5, 0.0], np.float32), 512
    )
    assert np.array_equal(padded, expected)
    assert optional_inputs.embedding_bias_from_words(tok, ["fox"], None, 512) is None
    assert optional_inputs.embedding_bias_from_words(tok, None, np.array([1.0], np.float32), 512) is None


def test_cancel_check_polls_the_server_at_most_every_interval_and_honours_the_deadline():
    now = [0.0]
    calls = []

    def is_cancelled():
        calls.append(now[0])
        return now[0] >= 0.375

    check = cancellation.CancelCheck(is_cancelled, deadline_s=None, interval_s=0.125, clock=lambda: now[0])
    for step in range(1, 40):
        now[0] = step / 32  # binary fractions: exact sums
        if check():
            break
    assert check.reason == "cancelled" and now[0] == 0.375
    assert calls == [0.125, 0.25, 0.375]  # not once per step
    now[0] = 0.0
    timed = cancellation.CancelCheck(lambda: False, deadline_s=0.5, interval_s=0.1, clock=lambda: now[0])
    now[0] = 0.49
    assert not timed()
    now[0] = 0.51
    assert timed() and timed.reason == "timeout"
    assert (
        cancellation.deadline_s(250_000, 9.0) == 0.25
        and cancellation.deadline_s(0, 9.0) == 9.0
        and cancellation.deadline_s(0, 0.0) is None
    )


# ---------------------------------------------------------------- streaming whole characters (no server)

MULTI_BYTE = "Hé 😀 日本語 café, naïve ünïcode! 🎉"


def _whole_char_groups(tok, ids):
    """Reference grouping, computed with plain decode: a group ends where the text so far ends on a whole character."""
    groups, start = [], 0
    for i in range(1, len(ids) + 1):
        if not tok.decode(ids[:i], skip_special_tokens=True).endswith("\ufffd"):
            groups.append(ids[start:i])
            start = i
    return groups + ([ids[start:]] if start < len(ids) else [])


def test_hold_back_releases_tokens_only_when_they_complete_text(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    ids = tok(MULTI_BYTE, add_special_tokens=False).input_ids
    assert len(ids) > len(MULTI_BYTE) - 2  # byte-level BPE trained on ASCII: multi-byte characters are several tokens
    for step in (1, 2, 5):  # tokens arrive one, two or five at a time
        hold = text_stream.HoldBack(tok.backend_tokenizer, True)
        chunks = [hold.push(ids[i : i + step]) for i in range(0, len(ids), step)] + [hold.flush()]
        chunks = [c for c in chunks if c]
        assert [t for c in chunks for t in c] == ids  # nothing lost, nothing reordered
        texts = [tok.decode(c, skip_special_tokens=True) for c in chunks]  # postprocessing: each response on its own
        assert "".join(texts) == MULTI_BYTE
        assert not any("\ufffd" in t for t in texts)
        if step == 1:  # released exactly at the whole-character boundaries of the plain decode
            assert chunks == _whole_char_groups(tok, ids)
    hold = text_stream.HoldBack(tok.backend_tokenizer, True)
    emoji = tok("😀", add_special_tokens=False).input_ids
    assert len(emoji) == 4 and hold.push(emoji[:3]) == [] and hold.pending == 3
    assert hold.push(emoji[3:]) == emoji and hold.pending == 0
    assert hold.push(emoji[:2]) == [] and hold.flush() == emoji[:2]  # the end of the output: whatever is left


def test_per_chunk_decoding_is_exact_only_for_byte_level_tokenizers(tiny_tokenizer_dir, tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    assert text_stream.chunk_decoding_problem(AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))) is None
    # a SentencePiece-style tokenizer: a chunk decoded alone loses its leading space
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2}
    sp = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>")
    assert fast.decode([1, 2]) != fast.decode([1]) + fast.decode([2])  # the problem is real
    assert "Metaspace" in text_stream.chunk_decoding_problem(fast)
    fast.clean_up_tokenization_spaces = True
    assert "clean_up_tokenization_spaces" in text_stream.chunk_decoding_problem(fast)


def test_a_plain_runs_first_slice_covers_the_requests_in_flight():
    """An expired slice loses the run's tokens, so the first slice allows for the requests sharing the target
    (a token at concurrency 2 cost ~1.7x what one request measured) and for the prefill."""
    alone = cancellation.run_slice_s(64, 0.012, 1)
    assert alone == pytest.approx(2 * 64 * 0.012 + 1.0)
    shared = cancellation.run_slice_s(64, 0.012, 2)
    assert shared >= 1.7 * 64 * 0.012 * 2 and shared > alone  # twice the run at concurrency 2's per-token cost
    assert cancellation.run_slice_s(64, 0.012, 0) == alone  # the count is at least this request
    assert cancellation.run_slice_s(1, 0.012, 8) > 1.0  # a prefill's second, whatever the run


def test_bls_calls_run_in_slices_until_done_or_the_parent_stops():
    now, cancelled = [0.0], [False]
    check = cancellation.CancelCheck(lambda: cancelled[0], deadline_s=None, interval_s=0.0, clock=lambda: now[0])
    slices = []

    def attempt(slice_s, finish_at=3, tokens_before_expiry=0):
        slices.append(slice_s)
        now[0] += slice_s
        if len(slices) < finish_at:
            raise cancellation.SliceExpired(
                f"tensorrt_llm: the request ran past its server-side deadline of {slice_s} s after"
                f" {tokens_before_expiry} tokens"
            )
        return "done"

    assert cancellation.call_in_slices(attempt, check, 0.5) == "done" and slices == [
        0.5,
        0.5,
        0.5,
    ]  # prefill progress is kept: same slice
    slices.clear()
    assert cancellation.call_in_slices(lambda s: attempt(s, 4, 2), check, 0.5) == "done" and slices == [
        0.5,
        1.0,
        2.0,
        4.0,
    ]  # lost tokens: doubled
    slices.clear()
    cancelled[0] = True
    with pytest.raises(cancellation.ParentStopped, match="cancelled"):
        cancellation.call_in_slices(attempt, check, 0.5)
    assert slices == [0.5]  # stopped after the first expired slice
    assert cancellation.is_slice_expiry("Request timeout expired") and not cancellation.is_slice_expiry(
        "input_ids is empty"
    )


class _Tensor:  # a pb_utils.Tensor stand-in that can be weakly referenced
    def __init__(self, name):
        self.name = name


class _Response:  # a pb_utils.InferenceResponse stand-in: the response holds its tensors, as the stub's does
    def __init__(self, *names):
        self.tensors = [_Tensor(n) for n in names]

    def output_tensors(self):
        return list(self.tensors)

    def has_error(self):
        return False


def test_streamed_emit_drops_responses_of_a_cancelled_request_only():
    from specdeploy.triton.models import common

    class Sender:
        def __init__(self, error=None):
            self.sent, self.error = [], error

        def send(self, response, flags=0):
            if self.error:
                raise RuntimeError(self.error)
            self.sent.append((response, flags))

    open_sender = Sender()
    a, b = _Response("x"), _Response("x")
    emit = common.streamed_emit(open_sender, final_flag=1)
    emit(a, False)
    emit(b, True)
    assert open_sender.sent == [(a, 0), (b, 1)]
    common.streamed_emit(Sender("Unable to send response. Response sender has been closed."), 1)(_Response("x"), True)
    with pytest.raises(RuntimeError, match="out of memory"):
        common.streamed_emit(Sender("out of memory"), 1)(_Response("x"), True)


def test_send_leaves_the_stub_no_tensor_to_free():
    """tritonserver 2.51's ResponseSender::Send drops the tensors the request did not ask for with the GIL released,
    and a tensor freed there corrupts the stub's heap (stub_safety.send). Through `common.send` (used by
    streamed_emit and the batching path's emit), a tensor the sender drops stays alive until the send returned,
    and is freed then; errors and empty final flags pass through unchanged."""
    import gc
    import weakref

    from specdeploy.triton.models import stub_safety

    freed_inside = []

    class PruningSender:  # as the stub: keep only the requested outputs, inside send
        def __init__(self, requested):
            self.requested, self.sent = requested, []

        def send(self, response, flags=0):
            if isinstance(response, _Response):
                dropped = [weakref.ref(t) for t in response.tensors if t.name not in self.requested]
                response.tensors = [t for t in response.tensors if t.name in self.requested]
                gc.collect()
                freed_inside.extend(ref() is None for ref in dropped)
            self.sent.append((response, flags))

    response = _Response("output_ids", "generation_logits", "context_logits")
    refs = {t.name: weakref.ref(t) for t in response.tensors}
    sender = PruningSender({"output_ids"})
    stub_safety.send(sender, response, 1)
    assert freed_inside == [False, False]  # the sender dropped two and freed neither
    gc.collect()
    assert [refs[n]() is None for n in ("generation_logits", "context_logits")] == [True, True]  # freed after send
    assert refs["output_ids"]() is not None  # the response still holds what it sends
    # a bare final flag and an error response go to the sender as they are
    stub_safety.send(sender, None, 1)
    error = type("E", (), {"has_error": lambda self: True, "output_tensors": lambda self: 1 / 0})()
    stub_safety.send(sender, error, 1)
    assert sender.sent[-2:] == [(None, 1), (error, 1)]
    # without the hold, the same sender frees them inside send: the stand-in shows the hazard it guards against
    freed_inside.clear()
    PruningSender({"output_ids"}).send(_Response("output_ids", "generation_logits"), 1)
    assert freed_inside == [True]


def test_no_model_calls_a_response_sender_directly():
    """Every response sender call goes through stub_safety.send (see test_send_leaves_the_stub_no_tensor_to_free)."""
    import re

    models = Path(common.__file__).parent
    direct = [
        f"{p.name}:{i}"
        for p in sorted(models.glob("*.py"))
        if p.name != "stub_safety.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"(?<!stub_safety)\.send\(", line)
    ]
    assert direct == []


def test_stub_lock_is_held_except_while_waiting_for_the_engine():
    """The batching path's request threads hold the stub lock for their triton_python_backend_utils calls and let
    it go only while they wait for the next chunk; a cancellation poll from the scheduler thread takes it too."""
    import queue
    import threading

    lock = stub_safety.StubLock()
    chunks: queue.Queue = queue.Queue()
    seen = []

    def waiting_for_chunks():
        while (item := chunks.get()) is not None:
            yield item

    def request_thread():
        with lock:
            for item in lock.released_while(waiting_for_chunks()):
                seen.append((item, lock._lock._is_owned()))

    t = threading.Thread(target=request_thread)
    t.start()
    # while the request thread waits for its first chunk, another thread gets the lock (the scheduler's poll)
    request = type("R", (), {"is_cancelled": lambda self: lock._lock._is_owned(), "timeout": lambda self: 0})()
    check = cancellation.request_cancel_check(request, 0.0, lock)
    polled = []
    poller = threading.Thread(target=lambda: polled.append(check._is_cancelled()))
    poller.start()
    poller.join(5)
    assert polled == [True]  # it got the lock (not held by the waiting request thread) and called under it
    chunks.put("a")
    chunks.put("b")
    chunks.put(None)
    t.join(10)
    assert not t.is_alive() and seen == [("a", True), ("b", True)]  # each chunk handled with the lock held


def _bls_module(monkeypatch, request, **pb_utils):
    """The BLS calls' module (bls_calls.py) bound to a stand-in for triton_python_backend_utils (imported outside a
    stub)."""
    import importlib
    import types

    stand_in = types.SimpleNamespace(TRITONSERVER_RESPONSE_COMPLETE_FINAL=1, **pb_utils)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stand_in)
    name = "specdeploy.triton.models.bls_calls"
    monkeypatch.delitem(sys.modules, name, raising=False)
    request.addfinalizer(lambda: sys.modules.pop(name, None))  # not left bound to the stand-in
    return importlib.import_module(name)


def test_the_bls_sizes_a_plain_runs_slice_with_the_requests_in_flight(monkeypatch, request):
    """The BLS's verifier passes the measured per-token cost and the live active count to run_slice_s."""
    bls = _bls_module(monkeypatch, request)
    from specdeploy.speculation import costs as speculation_costs

    costs = speculation_costs.CostModel(plain_token_s=0.012)
    active = [2]
    verifier = bls.TritonVerifier(None, {}, None, costs, lambda: active[0])
    assert verifier._run_slice_s(64) == pytest.approx(cancellation.run_slice_s(64, 0.012, 2))
    active[0] = 4
    assert verifier._run_slice_s(64) == pytest.approx(cancellation.run_slice_s(64, 0.012, 4))
    assert verifier._run_slice_s(1) is None  # a one-token call keeps the cancel interval


def test_decoupled_bls_calls_keep_their_iterators_until_the_stubs_queue_is_past_their_cleanup(monkeypatch, request):
    """tritonserver 2.51's stub frees a dropped decoupled-call iterator on its own thread without the GIL (see
    common.HeldResponses): the BLS keeps each iterator until an `is_cancelled` answer came back through the stub's
    queue (False; True may be the stub's cached answer), asked before its next call, never after it."""
    import gc
    import types
    import weakref

    log, iterators = [], []

    class Iterator(list):  # a list subclass can be weakly referenced
        pass

    class InferenceRequest:
        def __init__(self, **kwargs):
            pass

        def exec(self, decoupled=False):
            assert decoupled
            log.append("exec")
            response = types.SimpleNamespace(
                has_error=lambda: False, outputs={"output_ids": np.array([[5, 6]]), "sequence_length": np.array([2])}
            )
            final = types.SimpleNamespace(has_error=lambda: False, outputs={})  # the empty final response
            iterator = Iterator([response, final])
            iterators.append(weakref.ref(iterator))
            return iterator

    output = lambda response, name: (
        types.SimpleNamespace(as_numpy=lambda: response.outputs[name]) if name in response.outputs else None
    )  # noqa: E731
    bls = _bls_module(
        monkeypatch,
        request,
        InferenceRequest=InferenceRequest,
        Tensor=lambda name, value: (name, value),
        get_output_tensor_by_name=output,
    )
    call = bls.LlmCall("tensorrt_llm", decoupled=True, slice_s=0.0, held=stub_safety.HeldResponses())
    sampling = types.SimpleNamespace(temperature=1.0, top_k=0, top_p=0.0, seed=None)

    def check(*answers):  # its own polls never come due: every question here is a barrier's
        pending = list(answers)
        return cancellation.CancelCheck(lambda: log.append("asked") or pending.pop(0), deadline_s=None, interval_s=1e9)

    def alive():
        gc.collect()
        return [ref() is not None for ref in iterators]

    assert call([1, 2, 3], 2, sampling, {}, False, stop_check=check())[0] == [5, 6]
    assert log == ["exec"] and alive() == [True]  # nothing held before: no question; kept after its call
    call([1, 2, 3, 5, 6], 2, sampling, {}, False, stop_check=check(False))
    assert log == ["exec", "asked", "exec"] and alive() == [False, True]  # released before the next call
    cancelled = check(True)
    call([1], 2, sampling, {}, False, stop_check=cancelled)
    assert cancelled.reason == "cancelled" and alive() == [False, True, True]  # no barrier: kept
    call([1], 2, sampling, {}, False, stop_check=check(False))
    assert alive() == [False, False, False, True] and len(call.held) == 1


def _verifier_job(logits: bool) -> dict:
    """A BLS request's job as TritonVerifier reads it: prompt [1, 2], no stop words, penalties neutral; `logits`: the
    client asked for context and generation logits."""
    return {
        "bad_words_list": np.zeros((2, 0), np.int32),
        "stop_words_list": np.zeros((2, 0), np.int32),
        "return_log_probs": False,
        "return_context_logits": logits,
        "return_generation_logits": logits,
        "penalties": dict(optional_inputs.PENALTY_NEUTRAL),
        "prompt_ids": [1, 2],
        "embedding_bias": None,
        "end_id": None,
        "stop_words": [],
    }


def _greedy():
    import types

    return types.SimpleNamespace(temperature=1.0, top_k=0, top_p=0.0, seed=None)


def test_a_streamed_decoupled_call_gets_tensorrt_llms_stop_once_its_request_ends(monkeypatch, request):
    """A decoupled BLS call is not sliced, so a plain run (or a fused request) that streams is ended from the BLS with
    TensorRT-LLM's `stop`: once the BLS request's check fires between two responses, a request with stop=true and the
    call's own request id follows (as NVIDIA's BLS sends it, triton_decoder.py:194-216 @c2e65b8), once; the call takes
    the responses that still come. A call that does not stream carries no id and gets no stop."""
    import types

    sent = []

    class InferenceRequest:
        def __init__(self, model_name, requested_output_names, inputs, request_id="", timeout=0):
            self.inputs, self.request_id = {name: value for name, value in inputs}, request_id
            sent.append(self)

        def exec(self, decoupled=False):
            assert decoupled
            if "stop" in self.inputs:
                return [types.SimpleNamespace(has_error=lambda: False, outputs={})]
            piece = lambda t: types.SimpleNamespace(
                has_error=lambda: False, outputs={"output_ids": np.array([[t]]), "sequence_length": np.array([1])}
            )  # noqa: E731
            return [piece(t) for t in (5, 6, 7)] + [types.SimpleNamespace(has_error=lambda: False, outputs={})]

    output = lambda response, name: (
        types.SimpleNamespace(as_numpy=lambda: response.outputs[name]) if name in response.outputs else None
    )  # noqa: E731
    bls = _bls_module(
        monkeypatch,
        request,
        InferenceRequest=InferenceRequest,
        Tensor=lambda name, value: (name, value),
        get_output_tensor_by_name=output,
    )
    call = bls.LlmCall("tensorrt_llm", decoupled=True, slice_s=0.0, held=stub_safety.HeldResponses())
    job, sampling = _verifier_job(logits=False), _greedy()
    polls = []

    def cancelled_after_first():  # False to the barrier before the call (HeldResponses.release), then cancelled:
        # the check fires as the first response arrives
        polls.append(len(polls))
        return len(polls) > 1

    for sink in (lambda ids: None, None):  # a streamed request's plain run streams; an unstreamed one does not
        sent.clear()
        job["stop_check"] = cancellation.CancelCheck(cancelled_after_first, deadline_s=None, interval_s=0.0)
        polls.clear()
        tokens = bls.TritonVerifier(call, job, bls.Record(), stream_sink=sink).verify(
            [1, 2], [], None, sampling, output_len=8
        )
        assert tokens == [5, 6, 7]  # the responses that came after the stop are kept
        if sink is None:
            assert len(sent) == 1 and not sent[0].request_id and "streaming" not in sent[0].inputs
            continue
        run, stop = sent
        assert run.inputs["streaming"].tolist() == [[True]] and len(run.request_id) == 32
        assert stop.request_id == run.request_id and stop.inputs["stop"].tolist() == [[True]]
        assert stop.inputs["request_output_len"].tolist() == [[0]]


def _recording_bls(monkeypatch, request, sent):
    """The BLS module with a stand-in pb_utils whose requests record (input names, requested outputs)."""
    import types

    class InferenceRequest:
        def __init__(self, model_name, requested_output_names, inputs, timeout=0, request_id=""):
            sent.append(({name: value for name, value in inputs}, list(requested_output_names)))

        def exec(self, decoupled=False):
            return types.SimpleNamespace(
                has_error=lambda: False,
                outputs={
                    "output_ids": np.array([[5, 6]]),
                    "sequence_length": np.array([2]),
                    "generation_logits": np.zeros((1, 1, 2, 4), np.float32),
                    "context_logits": np.zeros((1, 3, 4), np.float32),
                },
            )

    output = lambda response, name: (
        types.SimpleNamespace(as_numpy=lambda: response.outputs[name]) if name in response.outputs else None
    )  # noqa: E731
    return _bls_module(
        monkeypatch,
        request,
        InferenceRequest=InferenceRequest,
        Tensor=lambda name, value: (name, value),
        get_output_tensor_by_name=output,
    )


def test_bls_sends_the_tensor_names_of_the_engine_backend_release(monkeypatch, request):
    """With the 0.18 backend's names (gpu_models.follow_backend_names writes them into engine_tensor_names) the BLS
    sends min_length / random_seed and neither sends return_perf_metrics nor asks for first_token_time_ns, which
    that release does not declare (Triton refuses an undeclared input or output)."""
    import types

    sent = []
    bls = _recording_bls(monkeypatch, request, sent)
    names = {
        "min_tokens": "min_length",
        "seed": "random_seed",
        "return_perf_metrics": None,
        "first_token_time_ns": None,
    }
    sampling = types.SimpleNamespace(temperature=1.0, top_k=0, top_p=0.0, seed=7)
    extra = {"min_tokens": np.array([[3]], np.int32)}
    for call_names in (names, None):
        call = bls.LlmCall(
            "tensorrt_llm", decoupled=False, slice_s=0.0, held=stub_safety.HeldResponses(), names=call_names
        )
        assert call([1, 2, 3], 2, sampling, extra, False, ["first_token_time_ns", "kv_cache_reused_blocks"])[0] == [
            5,
            6,
        ]
    (old_inputs, old_outputs), (new_inputs, new_outputs) = sent
    assert {"min_length", "random_seed"} <= set(old_inputs) and not {"min_tokens", "seed", "return_perf_metrics"} & set(
        old_inputs
    )
    assert old_inputs["min_length"].tolist() == [[3]] and old_inputs["random_seed"].tolist() == [[7]]
    assert "first_token_time_ns" not in old_outputs and "kv_cache_reused_blocks" in old_outputs
    assert {"min_tokens", "seed", "return_perf_metrics"} <= set(new_inputs) and "first_token_time_ns" in new_outputs


def test_bls_target_calls_with_drafts_ask_for_no_logits(monkeypatch, request):
    """NVIDIA's BLS asks for context/generation logits only on calls without a draft (tensorrtllm_backend@c2e65b8
    tensorrt_llm_bls/1/lib/triton_decoder.py:495-508): the verifier's call with draft_input_ids sets neither flag,
    even when the client asked for logits; a call without drafts still passes the client's request on."""
    sent = []
    bls = _recording_bls(monkeypatch, request, sent)
    call = bls.LlmCall("tensorrt_llm", decoupled=False, slice_s=0.0, held=stub_safety.HeldResponses())
    job, sampling = _verifier_job(logits=True), _greedy()
    bls.TritonVerifier(call, job, bls.Record()).verify([1, 2, 3], [5], None, sampling)
    inputs, outputs = sent[-1]
    assert "draft_input_ids" in inputs
    assert not inputs["return_context_logits"].any() and not inputs["return_generation_logits"].any()
    assert "context_logits" not in outputs and "generation_logits" not in outputs
    bls.TritonVerifier(call, job, bls.Record()).verify([1, 2, 3], [], None, sampling, output_len=4)
    inputs, outputs = sent[-1]
    assert (
        "draft_input_ids" not in inputs
        and inputs["return_context_logits"].all()
        and inputs["return_generation_logits"].all()
    )
    assert "context_logits" in outputs and "generation_logits" in outputs
