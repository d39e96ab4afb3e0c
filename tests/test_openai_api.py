"""The OpenAI-compatible front with the `openai` SDK as client, over a REAL tritonserver serving tiny CPU engines.

Greedy answers through the front must equal the Triton path's (tritonclient gRPC, the same prompt) for
the speculative and the control model, streamed and not.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import ops_deploy
import pytest

from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL, GenerateRequest
from specdeploy.client.triton_adapter import TritonEndpoint
from specdeploy.ops.openai import api as openai_api
from specdeploy.ops.openai import app, requests

openai = pytest.importorskip("openai", reason="the openai SDK is a test dependency (pip install -e '.[test]')")

MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "The quick brown fox"}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ops_deploy.make_model(tmp_path_factory.mktemp("ops-model"))


@pytest.fixture(scope="module")
def streaming_api(ops_decoupled):
    """(openai client, triton endpoint, recipe) over the session's decoupled deployment; the front always stopped."""
    recipe, layout, srv = ops_decoupled
    front = openai_api.build_front(recipe, layout, srv.state.grpc_url, timeout_s=60)
    from specdeploy.triton.ports import free_port

    with openai_api.ApiServer(app.create_app(front), free_port()) as api:
        client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=60)
        yield client, TritonEndpoint(srv.state.grpc_url), recipe, api


def _triton_text(endpoint, model, prompt, max_tokens=MAX_TOKENS):
    k = 3 if model == SPECULATIVE_MODEL else None
    return endpoint.generate(model, GenerateRequest(prompt, max_tokens, num_draft_tokens=k), 60).text


@pytest.mark.server
def test_models_lists_every_path(streaming_api):
    client, _, recipe, _ = streaming_api
    ids = {m.id for m in client.models.list().data}
    assert ids == {recipe.name, f"{recipe.name}-speculative", f"{recipe.name}-control"}  # no canary share set


@pytest.mark.server
def test_chat_greedy_equals_triton_path_streamed_and_not(streaming_api, model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    client, endpoint, recipe, _ = streaming_api
    prompt = ops_deploy.chat_text(MESSAGES)
    expected_spec = _triton_text(endpoint, SPECULATIVE_MODEL, prompt)
    expected_ctrl = _triton_text(endpoint, CONTROL_MODEL, prompt)
    assert expected_spec and expected_spec == expected_ctrl  # greedy parity of the deployment itself

    full = client.chat.completions.create(model=recipe.name, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS)
    assert full.choices[0].message.content == expected_spec
    assert full.choices[0].message.role == "assistant"
    ext = full.model_extra["specdeploy"]
    assert ext["path"] == "speculative" and ext["triton_model"] == SPECULATIVE_MODEL
    assert ext["draft_tokens"] > 0 and ext["accepted_draft_tokens"] == ext["draft_tokens"]  # the draft is the target
    assert ext["acceptance_rate"] == pytest.approx(1.0)

    # the server's own prompt length (preprocessing's REQUEST_INPUT_LEN) is what usage reports
    pre = endpoint._run(
        "preprocessing",
        {
            "QUERY": np.array([[prompt.encode()]], dtype=object),
            "REQUEST_OUTPUT_LEN": np.array([[MAX_TOKENS]], dtype=np.int32),
        },
        ["REQUEST_INPUT_LEN"],
        60,
    )[-1]
    assert full.usage.prompt_tokens == int(pre.as_numpy("REQUEST_INPUT_LEN").reshape(-1)[0])
    # NVIDIA's text interface returns no output_ids: the count is the server's (specdeploy's sequence_length output),
    # the tokens tensorrt_llm generated, which the target alone returns as ids; not the re-tokenized text's
    exact = len(endpoint.trace(prompt, MAX_TOKENS, 60, with_logits=False).output_ids)
    assert ext["completion_tokens_exact"] is True
    assert full.usage.completion_tokens == exact
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.choices[0].finish_reason == ("length" if exact == MAX_TOKENS else "stop")
    retokenized = len(tokenizer(expected_spec, add_special_tokens=False)["input_ids"])

    stream = client.chat.completions.create(
        model=f"{recipe.name}-control",
        messages=MESSAGES,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == expected_ctrl
    assert len(pieces) > 1  # decoupled: the answer arrives in several chunks
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == exact  # the streamed responses' counts, summed
    print(f"completion tokens {exact}, re-tokenized text {retokenized}")

    spec_stream = client.chat.completions.create(
        model=f"{recipe.name}-speculative", messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in spec_stream if c.choices) == expected_spec


@pytest.mark.server
def test_completions_and_stop_strings(streaming_api):
    client, endpoint, recipe, _ = streaming_api
    prompt = "Speculative decoding lets a small draft"
    expected = _triton_text(endpoint, SPECULATIVE_MODEL, prompt)
    out = client.completions.create(model=recipe.name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    assert out.choices[0].text == expected
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=recipe.name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stream=True
        )
    )
    assert streamed == expected
    stop = expected[len(expected) // 2 : len(expected) // 2 + 2]  # a string that occurs in the greedy answer
    cut = expected[: expected.index(stop)]
    out = client.completions.create(model=recipe.name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stop=[stop])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=recipe.name, prompt=prompt, temperature=0, max_tokens=MAX_TOKENS, stop=stop, stream=True
        )
    )
    assert streamed == cut


@pytest.mark.server
def test_errors_use_openai_format(streaming_api):
    client, _, recipe, api = streaming_api
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found" and recipe.name in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=recipe.name, messages=MESSAGES, n=2)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=recipe.name, prompt="x", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:  # longer than the engine's max_input_len: Triton refuses it
        client.completions.create(model=recipe.name, prompt="fox " * 400, max_tokens=4, temperature=0)
    assert info.value.body["type"] == "invalid_request_error" and "max_input_len" in info.value.body["message"]
    # the front and the server keep serving after errors
    assert (
        client.completions.create(model=recipe.name, prompt="x", max_tokens=2, temperature=0).choices[0].finish_reason
    )


@pytest.mark.server
def test_unary_deployment_streams_one_chunk(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("openai-unary")
    recipe, layout, _ = ops_deploy.build(root, model_dir, "ops")
    with ops_deploy.running(layout) as srv:
        front = openai_api.build_front(recipe, layout, srv.state.grpc_url, timeout_s=60)
        from specdeploy.triton.ports import free_port

        with openai_api.ApiServer(app.create_app(front), free_port()) as api:
            client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=60)
            expected = _triton_text(
                TritonEndpoint(srv.state.grpc_url), SPECULATIVE_MODEL, ops_deploy.chat_text(MESSAGES)
            )
            chunks = list(
                client.chat.completions.create(
                    model=recipe.name, messages=MESSAGES, temperature=0, max_tokens=MAX_TOKENS, stream=True
                )
            )
            pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
            assert pieces == [expected]


@pytest.mark.server
def test_validate_and_canary_drive_the_openai_front(tmp_path_factory, model_dir, tmp_path):
    """`validate --protocol openai` and `canary --drive openai` send their requests through the front; the metrics
    endpoint agrees with validate's counts, and the canary gets a verdict from the traffic it drove."""
    import json

    from click.testing import CliRunner

    from specdeploy.cli.main import main
    from specdeploy.client import gate
    from specdeploy.deploy.recipe_deployment import validate_recipe
    from specdeploy.triton.ports import free_port

    root = tmp_path_factory.mktemp("openai-validate")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": p, "category": c}) + "\n"
            for p, c in [
                ("The quick brown fox", "chat"),
                ("def add(a, b):", "code"),
                ("Triton serves models", "summarization"),
            ]
        )
    )
    # the canary drives the recipe's validation prompts: these short ones (the built-in summaries are longer than this
    # tiny engine's max_input_len, so how many requests failed depended on how far the driver got before the verdict)
    recipe, layout, recipe_path = ops_deploy.build(
        root, model_dir, "ops", canary={"control_percent": 50}, validation={"prompt_set": str(prompts)}
    )
    with ops_deploy.running(layout) as srv:
        front = openai_api.build_front(
            recipe, layout, srv.state.grpc_url, timeout_s=300
        )  # a loaded CI machine: a slow request is not a failed one
        with openai_api.ApiServer(app.create_app(front), free_port()) as api:
            report, _, verdict = validate_recipe(
                recipe,
                layout,
                url=srv.state.grpc_url,
                protocol="openai",
                openai_url=api.url,
                metrics_url=srv.state.metrics_url,
                report_dir=tmp_path / "report",
                progress=False,
                prompt_set=str(prompts),
                concurrency=(1,),
                repeats=1,
                min_compared_tokens=4,
                chat_template="none",
                min_speedup=0.0,
            )
            assert report["complete"], report["errors"]
            assert report["url"] == api.url  # the requests went through the front
            assert report["parity"]["summary"]["all"]["exact"] == 3, report["parity"]["summary"]
            samples = [s for r in report["latency"]["runs"] for s in r["samples"]]
            assert samples and all(
                s["ttft_source"] == "server" and s["ttft_s"] > 0 for s in samples
            )  # from the extension field
            check = report["metrics_check"]
            assert check["checked"] and not check["mismatches"] and len(check["rows"]) >= 4, check
            assert verdict.exit_code == 0 and "metrics endpoint agrees" in verdict.line, verdict.line
            assert gate.EXIT_METRICS not in [c["exit_code"] for c in verdict.to_dict()["checks"] if not c["ok"]]

            result = CliRunner().invoke(
                main,
                [
                    "--root",
                    str(root),
                    "canary",
                    str(recipe_path),
                    "--url",
                    srv.state.metrics_url,
                    "--window",
                    "240",
                    "--until-enough",
                    "--min-requests",
                    "2",
                    "--drive",
                    "openai",
                    "--openai-url",
                    api.url,
                    "--concurrency",
                    "2",
                ],
            )
    assert result.exit_code in (0, 3), result.output  # a verdict from the traffic it drove, not "inconclusive"
    assert "over openai (0 failed)" in result.output, result.output  # the whole output: a failure names its first error
    rows = {
        line.split()[0]: line.split()
        for line in result.output.splitlines()
        if line.startswith(("speculative", "control"))
    }
    assert int(rows["speculative"][1]) >= 2 and int(rows["control"][1]) >= 2


@pytest.mark.server
def test_serve_detach_with_openai_port_and_stop(tmp_path_factory, model_dir):
    """`specdeploy serve RECIPE --detach --openai-port N` starts both; `specdeploy stop RECIPE` stops both."""
    import socket

    from click.testing import CliRunner

    from specdeploy.cli.main import main
    from specdeploy.triton.ports import free_port

    root = tmp_path_factory.mktemp("openai-cli")
    recipe, layout, recipe_path = ops_deploy.build(root, model_dir, "ops")
    port = free_port()
    runner = CliRunner()
    with socket.socket() as holder:  # another process listens there: refused before tritonserver starts
        holder.bind(("127.0.0.1", port))
        holder.listen()
        result = runner.invoke(
            main, ["--root", str(root), "serve", str(recipe_path), "--detach", "--openai-port", str(port)]
        )
    assert result.exit_code != 0 and f"cannot listen on 127.0.0.1:{port}" in result.output, result.output
    assert runner.invoke(main, ["--root", str(root), "status", str(recipe_path)]).exit_code == 3  # nothing was started
    try:
        result = runner.invoke(
            main, ["--root", str(root), "serve", str(recipe_path), "--detach", "--openai-port", str(port)]
        )
        assert result.exit_code == 0, result.output
        assert f"http://127.0.0.1:{port}/v1" in result.output
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        assert recipe.name in {m.id for m in client.models.list().data}
        out = client.completions.create(
            model=f"{recipe.name}-control", prompt="The quick brown fox", max_tokens=4, temperature=0
        )
        assert out.choices[0].text and out.model_extra["specdeploy"]["path"] == "control"
        result = runner.invoke(main, ["--root", str(root), "status", str(recipe_path)])
        assert result.exit_code == 0 and f"openai front: http://127.0.0.1:{port}/v1" in result.output, result.output
        # the front dies while the server runs: status says so, with exit code 1 (running but not all well)
        front_pid = json.loads((layout.server_state / openai_api.STATE_FILE).read_text())["pid"]
        os.kill(front_pid, signal.SIGKILL)
        assert _gone(front_pid)
        result = runner.invoke(main, ["--root", str(root), "status", str(recipe_path)])
        assert result.exit_code == 1 and f"the OpenAI front (pid {front_pid}) has exited" in result.output, (
            result.output
        )
        assert "running, ready" in result.output  # the server itself is fine
    finally:
        result = runner.invoke(main, ["--root", str(root), "stop", str(recipe_path)])
    assert result.exit_code == 0 and "OpenAI front" in result.output and "stopped tritonserver" in result.output
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


def _gone(pid: int, timeout_s: float = 30) -> bool:
    """Waits for the process to be gone (reaped by its parent, or a zombie of a parent that is gone)."""
    from specdeploy.core.artifacts import pid_alive

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


# ---------------------------------------------------------------- request parsing (no server)


class _Codec:
    def chat_prompt(self, messages):
        return ops_deploy.chat_text(messages)


def _parse(body, chat=False):
    from specdeploy.recipe.load import parse_recipe

    recipe = parse_recipe(
        {"name": "r", "target": {"model": "x"}, "draft": {"model": "x"}, "canary": {"control_percent": 10}}
    )
    return requests.parse_job(body, chat, requests.routes(recipe), _Codec(), 16)


def test_parse_maps_openai_fields_to_the_triton_request():
    job = _parse({"model": "r-canary", "prompt": ["hi"], "temperature": 0.7, "top_p": 0.9, "seed": 5, "stop": "x"})
    assert (job.route.path, job.route.triton_model, job.route.send_num_draft_tokens) == (
        "canary",
        SPECULATIVE_MODEL,
        False,
    )
    assert (job.prompt, job.max_tokens, job.stops) == ("hi", 16, ("x",))
    assert (job.sampling.temperature, job.sampling.top_k, job.sampling.top_p, job.sampling.seed) == (
        pytest.approx(0.7),
        0,
        pytest.approx(0.9),
        5,
    )
    job = _parse(
        {
            "model": "r",
            "messages": MESSAGES,
            "temperature": 0,
            "max_completion_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        chat=True,
    )
    assert job.sampling is None and job.max_tokens == 3 and job.stream and job.include_usage
    assert job.prompt == ops_deploy.chat_text(MESSAGES) and job.route.send_num_draft_tokens
    assert (
        _parse({"model": "r-control", "prompt": "a", "response_format": {"type": "text"}}).route.triton_model
        == CONTROL_MODEL
    )
    assert (
        _parse({"model": "r", "prompt": "a", "temperature": 0.7, "top_p": 0}).sampling is None
    )  # the top token alone: greedy
    # content as a list of text parts (the SDK sends it as is) renders as the same text, an assistant turn may have none
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "brief."}]},
        {"role": "assistant", "content": None},
        MESSAGES[1],
    ]
    plain = [MESSAGES[0], {"role": "assistant", "content": ""}, MESSAGES[1]]
    assert (
        _parse({"model": "r", "messages": parts}, chat=True).prompt
        == _parse({"model": "r", "messages": plain}, chat=True).prompt
    )


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "a"}, 400, "model"),
        ({"model": "nope", "prompt": "a"}, 404, "model"),
        ({"model": "r", "prompt": 3}, 400, "prompt"),
        ({"model": "r", "prompt": ""}, 400, "prompt"),
        ({"model": "r", "prompt": "a", "temperature": 3}, 400, "temperature"),
        ({"model": "r", "prompt": "a", "max_tokens": 1.5}, 400, "max_tokens"),
        ({"model": "r", "prompt": "a", "logprobs": 2}, 400, "logprobs"),
        ({"model": "r", "prompt": "a", "stop": ["a", 1]}, 400, "stop"),
        ({"model": "r", "prompt": "a", "stream": "yes"}, 400, "stream"),
    ],
)
def test_parse_refuses_bad_requests_naming_the_field(body, status, param):
    with pytest.raises(requests.ApiError) as info:
        _parse(body)
    assert info.value.status == status and info.value.body()["error"]["param"] == param


@pytest.mark.parametrize("content", [[{"type": "image_url", "image_url": {"url": "x"}}], None, 3, []])
def test_parse_refuses_chat_content_it_cannot_render(content):
    message = {"role": "user"} if content is None else {"role": "user", "content": content}
    with pytest.raises(requests.ApiError) as info:
        _parse({"model": "r", "messages": [message]}, chat=True)
    assert info.value.status == 400 and info.value.body()["error"]["param"] == "messages"
    assert "messages[0].content" in info.value.body()["error"]["message"]


@pytest.mark.parametrize(
    ("message", "status"),
    [
        (
            (
                "generate failed on 127.0.0.1:1: Failed to process the request(s) for model 'tensorrt_llm_bls_0_0',"
                " message: Stub process 'tensorrt_llm_bls_0_0' is not healthy."
            ),
            503,
        ),
        (
            "generate failed on 127.0.0.1:1: Request for unknown model: 'tensorrt_llm_bls' has no available versions",
            503,
        ),
        (
            (
                "generate failed on 127.0.0.1:1: [TensorRT-LLM][ERROR] CUDA runtime error in cudaMallocAsync: out of"
                " memory"
            ),
            500,
        ),
        ("generate failed on 127.0.0.1:1: the prompt has 900 tokens, more than max_input_len (256); shorten it", 400),
        ("the server at 127.0.0.1:1 is unreachable or went away during generate", 503),
        ("generate timed out after 60 s (server 127.0.0.1:1)", 504),
    ],
)
def test_server_faults_are_5xx_and_refusals_400(message, status):
    """A deployment that cannot serve (a dead stub, a model not loaded) or fails inside is the server's fault (5xx: a
    client such as the openai SDK retries those), a request the model refused is the client's (400)."""
    from specdeploy.core.errors import ClientError
    from specdeploy.ops.openai.requests import from_client_error

    error = from_client_error(ClientError(message, "hint"))
    assert error.status == status and (error.type == "invalid_request_error") == (status == 400)


def test_stop_cutter_holds_back_partial_matches():
    cut = app.StopCutter(["END"])
    assert [cut.push(p) for p in ("abc E", "N", "Dxyz")] == ["abc ", "", ""]  # "E" held, "EN" held, then the stop
    assert cut.stopped and cut.text == "abc " and cut.flush() == ""
    free = app.StopCutter([])
    assert free.push("abc") == "abc" and free.flush() == ""
    tail = app.StopCutter(["xyz"])
    assert tail.push("hello x") == "hello " and tail.flush() == "x"
    # two stops where the shorter completes first but the longer starts first: the longer one is the cut, as in the
    # whole answer (it waits for the text that decides)
    agent = app.StopCutter(["\nObservation:", "Observation"])
    assert [agent.push(p) for p in ("Thought: look it up\nObserv", "ation", ": 42")] == ["Thought: look it up", "", ""]
    assert agent.stopped


def test_a_streamed_answer_is_cut_where_the_whole_answer_is():
    """Any answer, any stops, any split into pieces: the streamed text equals the whole text cut before the stop
    that starts first (the non-streamed answer), seeded over 3,000 cases."""
    import random

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 16)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(0, 4))]
        bounds = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 5)))) + [len(text)]
        pieces = [text[a:b] for a, b in zip([0] + bounds, bounds)]
        cutter = app.StopCutter(stops)
        streamed = "".join(cutter.push(p) for p in pieces) + cutter.flush()
        found = [text.find(s) for s in stops if s and s in text]
        assert streamed == (text[: min(found)] if found else text) and cutter.stopped == bool(found), (
            text,
            stops,
            pieces,
        )


def test_openai_endpoint_maps_paths_and_refuses_what_the_api_cannot_say():
    from specdeploy.client.openai_adapter import OpenAIEndpoint, base_url
    from specdeploy.core.errors import ClientError
    from specdeploy.speculation.sampling import SamplingParams

    assert (
        base_url("127.0.0.1:8000")
        == base_url("http://127.0.0.1:8000/")
        == base_url("http://127.0.0.1:8000/v1")
        == "http://127.0.0.1:8000/v1"
    )
    ep = OpenAIEndpoint("127.0.0.1:1", "ops", num_draft_tokens=3)
    assert ep.body(SPECULATIVE_MODEL, GenerateRequest("p", 5, num_draft_tokens=3)) == {
        "model": "ops-speculative",
        "prompt": "p",
        "max_tokens": 5,
        "stream": False,
        "temperature": 0,
    }
    assert (
        ep.body(SPECULATIVE_MODEL, GenerateRequest("p", 5))["model"] == "ops-canary"
    )  # no k: the canary share applies
    assert ep.body(CONTROL_MODEL, GenerateRequest("p", 5))["model"] == "ops-control"
    sampled = ep.body(CONTROL_MODEL, GenerateRequest("p", 5, sampling=SamplingParams(0.7, 0, 0.9, 4)))
    assert (sampled["temperature"], sampled["top_p"], sampled["seed"]) == (0.7, 0.9, 4)
    with pytest.raises(ClientError, match="no top_k"):
        ep.body(CONTROL_MODEL, GenerateRequest("p", 5, sampling=SamplingParams(1.0, 3)))
    with pytest.raises(ClientError, match="always sends num_draft_tokens=3"):
        ep.generate(SPECULATIVE_MODEL, GenerateRequest("p", 5, num_draft_tokens=2), 1)
    with pytest.raises(ClientError, match="unreachable"):  # nothing listens on port 1
        ep.generate(CONTROL_MODEL, GenerateRequest("p", 5), 2)
    with pytest.raises(ClientError, match="only be reached over Triton"):
        ep.check_ready(["preprocessing"])


def test_foreground_front_says_where_it_listens_once_it_does():
    import socket
    import threading

    from specdeploy.triton.ports import free_port

    port, lines, stop = free_port(), [], threading.Event()
    front = app.Front(None, None, {}, 16, 3, 5.0)  # /health needs no deployment
    worker = threading.Thread(
        target=openai_api.serve_foreground, args=(front, port), kwargs={"echo": lines.append, "stop": stop}, daemon=True
    )
    worker.start()
    try:
        for _ in range(200):
            if lines:
                break
            threading.Event().wait(0.05)
        assert lines == [f"  openai:  http://127.0.0.1:{port}/v1 (Ctrl-C stops it and the server)"]
        with socket.create_connection(("127.0.0.1", port), timeout=2):  # printed only once it listens
            pass
    finally:
        stop.set()
        worker.join(timeout=15)
    assert not worker.is_alive()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0


class _Streaming:
    """A decoupled deployment that streams the pieces `script` gives, then keeps sending one more every 10 ms until
    the front stops reading (its callback raises) or 10 s pass: `abandoned` says whether the front let go."""

    def __init__(self, script):
        import threading

        self.script, self.requests = script, []
        self.abandoned, self.sent_after_script = threading.Event(), 0

    def is_decoupled(self, model):
        return True

    def generate(self, model, request, timeout_s, on_text=None):
        import time

        from specdeploy.client.protocol import GenerateResult

        self.requests.append(request)
        if on_text is None:  # a whole answer
            return GenerateResult("".join(self.script), 0.0)
        try:
            for piece in self.script:
                on_text(piece)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # a long answer: the front must end it
                time.sleep(0.01)
                on_text("more ")
                self.sent_after_script += 1
        except Exception:
            self.abandoned.set()
            raise
        return GenerateResult("".join(self.script), 0.0)


class _WordCodec:
    add_special_tokens = True

    def chat_prompt(self, messages):
        return "".join(m["content"] for m in messages)

    def count_prompt(self, text):
        return len(text.split())

    def count_output(self, text):
        return len(text.split())


def _front_over(endpoint):
    from specdeploy.ops.openai.requests import Route
    from specdeploy.triton.ports import free_port

    front = app.Front(endpoint, _WordCodec(), {"r": Route("r", "speculative", SPECULATIVE_MODEL, True)}, 16, 3, 30.0)
    return openai_api.ApiServer(app.create_app(front), free_port())


def test_a_stop_string_ends_the_stream_and_the_server_request_and_goes_to_triton_as_stop_words():
    """The answer ends at the stop string at once (finish_reason stop, then [DONE]) and the Triton request is abandoned
    (its stream cancelled) rather than run to max_tokens; the stop strings also travel as the `stop_words` input."""
    endpoint = _Streaming(["one ", "two ", "END", " three "])
    with _front_over(endpoint) as api:
        client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=30)
        chunks = list(client.completions.create(model="r", prompt="p", max_tokens=16, stop=["END"], stream=True))
        assert "".join(c.choices[0].text for c in chunks) == "one two "
        assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
        assert endpoint.abandoned.wait(10), "the front kept reading the Triton stream after the stop string"
        assert endpoint.requests[0].stop_words == ("END",)
        unary = client.completions.create(model="r", prompt="p", max_tokens=16, stop="two", stream=False)
        assert unary.choices[0].text == "one " and endpoint.requests[1].stop_words == ("two",)


def test_whole_answers_wait_for_triton_beyond_the_default_thread_pool():
    """Non-streamed requests each wait in a thread of the front's own pool: 12 at once all reach the deployment together
    (asyncio's default pool held 6 on this 2-core machine, the rest queued in the front, not in Triton)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    class Gate:
        def __init__(self):
            self.lock, self.waiting, self.release = threading.Lock(), 0, threading.Event()
            self.all_in = threading.Event()

        def is_decoupled(self, model):
            return False

        def generate(self, model, request, timeout_s, on_text=None):
            from specdeploy.client.protocol import GenerateResult

            with self.lock:
                self.waiting += 1
                if self.waiting == 12:
                    self.all_in.set()
            self.release.wait(30)
            return GenerateResult("ok", 0.0)

    gate = Gate()
    with _front_over(gate) as api:
        client = openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=60)
        with ThreadPoolExecutor(12) as pool:
            answers = [pool.submit(client.completions.create, model="r", prompt="p", max_tokens=4) for _ in range(12)]
            reached = gate.all_in.wait(30)  # every request in the deployment at the same time
            gate.release.set()
            assert reached, f"only {gate.waiting} of 12 requests reached the deployment together"
            assert [a.result().choices[0].text for a in answers] == ["ok"] * 12


def test_a_client_that_leaves_mid_stream_cancels_the_triton_request():
    import json
    import socket

    endpoint = _Streaming(["one "])
    with _front_over(endpoint) as api:
        body = json.dumps({"model": "r", "prompt": "p", "max_tokens": 16, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", api.port), timeout=10) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            seen = b""
            while b'"text": "one "' not in seen:  # the first piece reached the client; then it hangs up
                seen += conn.recv(4096)
        assert endpoint.abandoned.wait(10), "the Triton request ran on after the client left"


@pytest.mark.server
def test_the_deployment_stops_at_the_stop_words_the_front_sends(streaming_api, model_dir):
    """The `stop_words` input the front fills from `stop` ends the generation on the server (NVIDIA's semantics: the
    string's own tokens), for the speculative and the control path, so a request stops there, not at max_tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    _, endpoint, _, _ = streaming_api
    prompt = ops_deploy.chat_text(MESSAGES)
    ids = list(endpoint.trace(prompt, MAX_TOKENS, 60, with_logits=False).output_ids)
    # a token of the answer whose text tokenizes back to it alone, and not earlier in the answer
    j = next(
        j
        for j in range(2, len(ids) - 2)
        if ids[j] not in ids[:j]
        and tokenizer(tokenizer.decode([ids[j]]), add_special_tokens=False).input_ids == [ids[j]]
    )
    word = tokenizer.decode([ids[j]])
    for model, k in ((SPECULATIVE_MODEL, 3), (CONTROL_MODEL, None)):
        full = endpoint.generate(model, GenerateRequest(prompt, MAX_TOKENS, num_draft_tokens=k), 60).text
        stopped = endpoint.generate(
            model, GenerateRequest(prompt, MAX_TOKENS, num_draft_tokens=k, stop_words=(word,)), 60
        ).text
        assert stopped == tokenizer.decode(ids[: j + 1]) and len(stopped) < len(full), (model, word, stopped, full)


def test_an_answer_that_filled_max_seq_len_says_length():
    """The deployment gives a request whose prompt and max_tokens pass max_seq_len the tokens that fit: such an answer
    was cut by the engine's length, so finish_reason is "length", not "stop" (which a client reads as complete)."""
    from specdeploy.ops.openai.requests import Job, Route

    front = app.Front(None, None, {}, 16, 3, 5.0, max_seq_len=100)
    job = Job(Route("r", "speculative", SPECULATIVE_MODEL, True), "p", 90, None, (), False, False)
    assert (
        front.finish_reason(job, {"prompt_tokens": 40, "completion_tokens": 60, "total_tokens": 100}, False) == "length"
    )
    assert front.finish_reason(job, {"prompt_tokens": 40, "completion_tokens": 20, "total_tokens": 60}, False) == "stop"
    assert (
        front.finish_reason(job, {"prompt_tokens": 4, "completion_tokens": 90, "total_tokens": 94}, False) == "length"
    )
    assert front.finish_reason(job, {"prompt_tokens": 40, "completion_tokens": 60, "total_tokens": 100}, True) == "stop"


def test_stop_says_a_front_that_died_had_exited(tmp_path):
    """`specdeploy stop` on a recorded front whose process is gone says so (it printed "stopped" for a dead one)."""
    import json
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / openai_api.STATE_FILE).write_text(
        json.dumps({"pid": gone.pid, "start_ticks": 1, "cmdline": ["python"]})
    )
    assert openai_api.stop_detached(tmp_path).startswith(f"the OpenAI front (pid {gone.pid}) had already exited")
    assert not (tmp_path / openai_api.STATE_FILE).exists() and openai_api.stop_detached(tmp_path) is None


def test_an_openai_server_that_breaks_mid_answer_is_a_client_error():
    """validate's OpenAI client: a stream cut before `data: [DONE]` (its text is no answer), a body that is not OpenAI's
    JSON, and a connection that drops mid-body are ClientErrors (validate then writes an incomplete report), not
    tracebacks nor a cut answer taken for a whole one."""
    import json
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from specdeploy.client.openai_adapter import OpenAIEndpoint
    from specdeploy.core.errors import ClientError

    mode = {"post": "cut"}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"data": [{"id": "m-speculative"}, {"id": "m-control"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            if mode["post"] == "html":
                body = b"<html>not an API</html>"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b'data: {"choices": [{"text": "hello"}]}\n\n'
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            if mode["post"] == "cut":  # the stream ends cleanly, but before [DONE]
                self.wfile.write(b"0\r\n\r\n")
            else:  # the server goes away mid-body
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = OpenAIEndpoint(f"http://127.0.0.1:{server.server_address[1]}", recipe_name="m")
        streamed = GenerateRequest("hi", 8, num_draft_tokens=4, stream=True)
        with pytest.raises(ClientError, match=r"ended a stream without 'data: \[DONE\]' after 1 chunks"):
            endpoint.generate(SPECULATIVE_MODEL, streamed, 10)
        mode["post"] = "drop"
        with pytest.raises(ClientError, match="went away while answering /completions|ended a stream without"):
            endpoint.generate(SPECULATIVE_MODEL, streamed, 10)
        mode["post"] = "html"
        with pytest.raises(ClientError, match="did not answer as an OpenAI API does"):
            endpoint.generate(SPECULATIVE_MODEL, GenerateRequest("hi", 8, num_draft_tokens=4), 10)
    finally:
        server.shutdown()
        server.server_close()
