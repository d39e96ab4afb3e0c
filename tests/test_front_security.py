"""Security of the OpenAI front: API key, body and max_tokens bounds, bind address, where it writes.

The HTTP cases run the real front (FastAPI + uvicorn) over the session's REAL tritonserver deployment
(`ops_decoupled` in conftest.py), with raw httpx requests so the headers are exactly what is named.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from specdeploy.core.errors import ConfigError
from specdeploy.ops.openai import api as openai_api
from specdeploy.ops.openai import app

KEY = "sk-test-é-not-ascii-safe?"  # non-ASCII on purpose: compare_digest must get bytes, not str


@pytest.fixture(scope="module")
def keyed(ops_decoupled):
    """(base url without /v1, recipe, front) of a front started with an API key; stopped after the module."""
    from specdeploy.triton.ports import free_port

    recipe, layout, srv = ops_decoupled
    front = openai_api.build_front(
        recipe, layout, srv.state.grpc_url, timeout_s=60, api_key=KEY, max_body_bytes=64 * 1024
    )
    with openai_api.ApiServer(app.create_app(front), free_port()) as api:
        yield api.url[: -len("/v1")], recipe, front, api


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}".encode()}  # bytes: http.client sends them as given (UTF-8 here)


class Http:
    """Raw HTTP/1.1 with http.client: the headers and body framing are exactly the ones a test names."""

    def __init__(self, base: str, headers: dict | None = None):
        self.address, self.headers = urlsplit(base).netloc, headers or {}

    def request(
        self, method: str, path: str, json_body=None, headers: dict | None = None, content=None, chunked: bool = False
    ):
        conn = http.client.HTTPConnection(self.address, timeout=60)
        try:
            head = {**self.headers, **(headers or {})}
            body = content
            if json_body is not None:
                body, head = json.dumps(json_body).encode(), {"Content-Type": "application/json", **head}
            if chunked:
                head["Transfer-Encoding"] = "chunked"
            conn.request(method, path, body=body, headers=head, encode_chunked=chunked)
            response = conn.getresponse()
            data = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(data) if data else None
        finally:
            conn.close()

    def get(self, path, **kw):
        return self.request("GET", path, **kw)

    def post(self, path, json_body=None, **kw):
        return self.request("POST", path, json_body, **kw)


@pytest.mark.server
def test_api_key_guards_every_route_but_health(keyed):
    base, recipe, _, _ = keyed
    body = {"model": f"{recipe.name}-control", "prompt": "The quick brown fox", "max_tokens": 3, "temperature": 0}
    http_ = Http(base)
    for method, path in (
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{recipe.name}"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/openapi.json"),
        ("GET", "/nowhere"),
    ):
        for headers, code in (
            ({}, "missing_api_key"),
            (_auth("sk-wrong"), "invalid_api_key"),
            ({"Authorization": "Basic " + "x"}, "missing_api_key"),
            (_auth(KEY[:-1]), "invalid_api_key"),
            (_auth(KEY + "x"), "invalid_api_key"),
        ):
            status, head, data = http_.request(method, path, body if method == "POST" else None, headers=headers)
            assert status == 401, (method, path, headers, data)
            error = data["error"]  # OpenAI's error format
            assert error["type"] == "invalid_request_error" and error["message"] and error["code"] == code
            assert head["www-authenticate"] == "Bearer"
    assert http_.get("/health")[0] == 200  # no key: load balancers and wait_listening use it
    assert http_.get("/v1/models", headers=_auth(KEY))[0] == 200
    status, _, data = http_.post("/v1/completions", body, headers=_auth(KEY))
    assert status == 200, data
    assert data["choices"][0]["text"]
    assert http_.get("/openapi.json", headers=_auth(KEY))[0] == 404  # FastAPI's schema pages are off


@pytest.mark.server
def test_openai_sdk_is_refused_with_a_wrong_key(keyed):
    openai = pytest.importorskip("openai")
    _, recipe, _, api = keyed
    client = openai.OpenAI(base_url=api.url, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as info:
        client.models.list()
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"


@pytest.mark.server
def test_body_size_is_bounded_with_413(keyed):
    base, recipe, front, _ = keyed
    huge = "fox " * (front.max_body_bytes // 4 + 10)
    http_ = Http(base, _auth(KEY))
    status, _, data = http_.post("/v1/completions", {"model": recipe.name, "prompt": huge, "max_tokens": 2})
    assert status == 413, data
    assert data["error"]["code"] == "request_too_large" and str(front.max_body_bytes) in data["error"]["message"]

    def chunks():  # no Content-Length: the front must count what arrives
        for _ in range(front.max_body_bytes // 1024 + 2):
            yield b" " * 1024

    status, _, data = http_.request(
        "POST", "/v1/completions", content=chunks(), chunked=True, headers={"Content-Type": "application/json"}
    )
    assert status == 413, data
    assert str(front.max_body_bytes) in data["error"]["message"]
    # without the key the body is never read: 401 first
    assert Http(base).request("POST", "/v1/completions", content=huge.encode())[0] == 401
    assert http_.get("/health")[0] == 200


@pytest.mark.server
def test_max_tokens_is_bounded_by_the_deployment(keyed):
    base, recipe, front, _ = keyed
    limit = recipe.engine.max_seq_len - 1  # prompt plus output fit in max_seq_len; a prompt has at least one token
    assert front.max_tokens_limit == limit
    http_ = Http(base, _auth(KEY))
    for path, key, body in (
        ("/v1/completions", "max_tokens", {"prompt": "a"}),
        ("/v1/chat/completions", "max_tokens", {"messages": [{"role": "user", "content": "a"}]}),
        ("/v1/chat/completions", "max_completion_tokens", {"messages": [{"role": "user", "content": "a"}]}),
    ):
        status, _, data = http_.post(path, {"model": recipe.name, key: limit + 1, **body})
        assert status == 400, data
        error = data["error"]
        assert error["param"] == key and error["code"] == "max_tokens_too_large"
        assert str(limit) in error["message"] and "max_seq_len" in error["message"]


def test_max_tokens_option_may_lower_the_limit_but_not_raise_it():
    from specdeploy.recipe.load import parse_recipe

    recipe = parse_recipe(
        {
            "name": "r",
            "target": {"model": "x"},
            "draft": {"model": "x"},
            "engine": {"max_input_len": 64, "max_seq_len": 100},
        }
    )
    assert openai_api.deployment_max_tokens(recipe) == 99
    assert openai_api.deployment_max_tokens(recipe, 20) == 20
    with pytest.raises(ConfigError, match=r"--max-tokens-limit is 100, must be in \[1, 99\]"):
        openai_api.deployment_max_tokens(recipe, 100)


def test_default_bind_is_loopback_and_wider_binds_need_a_key():
    import inspect

    from specdeploy.cli.serve import serve
    from specdeploy.triton.ports import free_port

    assert openai_api.HOST == "127.0.0.1"
    for fn in (openai_api.ApiServer.__init__, openai_api.serve_foreground, openai_api.start_detached):
        assert inspect.signature(fn).parameters["host"].default == "127.0.0.1"
    assert {p.name: p.default for p in serve.params}["openai_host"] == "127.0.0.1"
    # the socket uvicorn opens by default is on 127.0.0.1
    front = app.Front(None, None, {}, 16, 3, 5.0)
    with openai_api.ApiServer(app.create_app(front), free_port()) as api:
        assert {s.getsockname()[0] for srv in api.server.servers for s in srv.sockets} == {"127.0.0.1"}
        assert api.url.startswith("http://127.0.0.1:")

    for host in ("0.0.0.0", "::", "192.168.1.5", "example.org"):
        with pytest.raises(ConfigError, match="without an API key"):
            openai_api.check_bind(host, None)
        openai_api.check_bind(host, "k")  # with a key it may
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        openai_api.check_bind(host, None)


def test_cli_refuses_a_wide_bind_without_a_key_before_starting_anything(tmp_path):
    import yaml
    from click.testing import CliRunner

    from specdeploy.cli.main import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "target": {"model": "x"}, "draft": {"model": "x"}}))
    result = CliRunner().invoke(
        main,
        ["--root", str(tmp_path), "serve", str(recipe), "--openai-port", "9", "--openai-host", "0.0.0.0"],
        env={"SPECDEPLOY_API_KEY": ""},
    )
    assert result.exit_code != 0 and "without an API key" in result.output, result.output
    assert not (tmp_path / "engines").exists()  # nothing started, nothing written


def test_cli_serve_with_a_front_names_the_running_server_not_the_port_its_front_holds(tmp_path):
    """`serve --openai-port P` while the recipe is served (its front on P): the error is the running server's, with
    the fix (stop it), not "cannot listen on P"; nothing else starts."""
    import socket
    import subprocess
    import sys

    import yaml
    from click.testing import CliRunner

    from specdeploy.cli.main import main
    from specdeploy.core.artifacts import Layout, process_identity
    from specdeploy.recipe.load import load_recipe
    from specdeploy.triton.server_state import ServerState

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "target": {"model": "x"}, "draft": {"model": "x"}}))
    layout = Layout.of(load_recipe(str(recipe)), tmp_path)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # stands in for the recorded server
    try:
        identity = process_identity(live.pid)
        ServerState(live.pid, 1, 2, 3, "log", "repo", 0.0, identity.start_ticks, list(identity.cmdline)).write(
            Path(layout.server_state)
        )
        with socket.socket() as held:  # the running deployment's front
            held.bind(("127.0.0.1", 0))
            held.listen()
            port = held.getsockname()[1]
            result = CliRunner().invoke(
                main, ["--root", str(tmp_path), "serve", str(recipe), "--openai-port", str(port)]
            )
        assert result.exit_code != 0, result.output
        assert f"already running (pid {live.pid}" in result.output and f"specdeploy stop {recipe}" in result.output, (
            result.output
        )
        assert "cannot listen" not in result.output
        assert ServerState.read(layout.server_state).pid == live.pid  # the record is left as it was
    finally:
        live.kill()
        live.wait()


def test_detached_front_gets_the_key_in_its_environment_not_its_command_line(tmp_path, monkeypatch):
    import subprocess

    import specdeploy.core.artifacts

    seen = {}

    class FakeProcess:
        pid = 4242

        def __init__(self, cmd, env=None, **_):
            seen["cmd"], seen["env"] = cmd, env

        def poll(self):
            return None

    monkeypatch.setattr(subprocess, "Popen", FakeProcess)
    monkeypatch.setattr(openai_api, "wait_listening", lambda *a, **k: True)
    monkeypatch.setattr(specdeploy.core.artifacts, "process_identity", lambda pid: None)
    monkeypatch.setenv(app.API_KEY_ENV, "from-the-parent")
    openai_api.start_detached("r.yaml", None, "127.0.0.1:1", 9, tmp_path, echo=lambda *_: None, api_key="sk-secret")
    assert seen["env"][app.API_KEY_ENV] == "sk-secret"
    assert not any("sk-secret" in part for part in seen["cmd"])
    assert seen["cmd"][seen["cmd"].index("--host") + 1] == "127.0.0.1"
    assert "sk-secret" not in (tmp_path / openai_api.STATE_FILE).read_text()
    openai_api.start_detached("r.yaml", None, "127.0.0.1:1", 9, tmp_path, echo=lambda *_: None)
    assert app.API_KEY_ENV not in seen["env"]  # no key given: the parent's is not passed on by accident
    # what it writes stays in the state folder it was given
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([openai_api.LOG_FILE, openai_api.STATE_FILE])


def test_recipe_names_that_are_not_folders_are_refused():
    from specdeploy.recipe.load import parse_recipe

    for name in (".", "..", "a/b", "", "x y"):
        with pytest.raises(ConfigError, match="key 'name'"):
            parse_recipe({"name": name, "target": {"model": "x"}, "draft": {"model": "x"}})
    assert parse_recipe({"name": "v1.2_a-b", "target": {"model": "x"}, "draft": {"model": "x"}}).name == "v1.2_a-b"


@pytest.mark.server
def test_validates_own_openai_client_sends_the_key_from_the_environment(ops_decoupled, monkeypatch):
    """`validate --protocol openai` / `canary --drive openai` reach a front that wants a key: the client sends
    SPECDEPLOY_API_KEY (or OpenAI's own OPENAI_API_KEY) as a Bearer token, and is refused without it."""
    from specdeploy.client.openai_adapter import OpenAIEndpoint
    from specdeploy.core.errors import SpecDeployError
    from specdeploy.triton.ports import free_port

    recipe, layout, srv = ops_decoupled
    front = openai_api.build_front(recipe, layout, srv.state.grpc_url, timeout_s=60, api_key="sk-ascii-key")
    with openai_api.ApiServer(app.create_app(front), free_port()) as api:
        endpoint = OpenAIEndpoint(api.url, recipe.name)
        for name in ("SPECDEPLOY_API_KEY", "OPENAI_API_KEY"):
            monkeypatch.delenv(name, raising=False)
        with pytest.raises(SpecDeployError, match="401") as refused:
            endpoint.served_models(endpoint.url)
        assert refused.value.hint == "set SPECDEPLOY_API_KEY or OPENAI_API_KEY to the key the front was started with"
        monkeypatch.setenv("OPENAI_API_KEY", "sk-other-key")
        with pytest.raises(SpecDeployError, match="401") as refused:
            endpoint.served_models(endpoint.url)
        assert refused.value.hint == "the key in $OPENAI_API_KEY is not the front's"
        for name in ("SPECDEPLOY_API_KEY", "OPENAI_API_KEY"):
            monkeypatch.setenv(name, "sk-ascii-key")
            assert f"{recipe.name}-speculative" in endpoint.served_models(endpoint.url)
            monkeypatch.delenv(name)


def test_foreground_serve_with_a_front_does_not_say_detached(tmp_path, monkeypatch):
    """`serve RECIPE --openai-port P` without --detach: the server is recorded for status/stop, but the command
    waits and Ctrl-C ends both, so it does not print the detached start's "stop it with" line."""
    import yaml
    from click.testing import CliRunner

    from specdeploy.cli.main import main
    from specdeploy.deploy import backend_stages
    from specdeploy.recipe.load import load_recipe
    from specdeploy.triton import server, server_state
    from specdeploy.triton.ports import free_port

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "target": {"model": "x"}, "draft": {"model": "x"}}))
    stages = type(backend_stages.of(load_recipe(str(recipe))))

    def fake_serve(self, r, layout, *, detach, recipe_path, echo=print, **_):
        assert detach  # recorded, so that `status` and `stop` find it
        echo("tritonserver ready (pid 1)")
        echo(f"{server.DETACHED_LINE} {recipe_path}")
        return server_state.ServerState(1, 1, 2, 3, "log", "repo", 0.0)

    monkeypatch.setattr(stages, "serve", fake_serve)
    monkeypatch.setattr(openai_api, "build_front", lambda *a, **k: None)
    monkeypatch.setattr(
        openai_api, "serve_foreground", lambda front, port, echo=print, host="": echo("  openai:  front")
    )
    monkeypatch.setattr(server, "stop", lambda state_dir: "stopped tritonserver (pid 1)")
    for detach, said in ((False, "Ctrl-C here stops it and the front"), (True, f"{server.DETACHED_LINE} {recipe}")):
        monkeypatch.setattr(openai_api, "start_detached", lambda *a, **k: 1)
        result = CliRunner().invoke(
            main,
            ["--root", str(tmp_path), "serve", str(recipe), "--openai-port", str(free_port())]
            + (["--detach"] if detach else []),
        )
        assert result.exit_code == 0, result.output
        assert said in result.output and (detach or "detached" not in result.output), result.output


def test_standalone_front_names_an_unreachable_server_and_its_own_option(tmp_path):
    """`python -m specdeploy.ops.openai.api RECIPE --grpc-url H:P`: a Triton that does not answer is one error line and
    a hint naming --grpc-url, not a traceback."""
    import yaml

    from specdeploy.triton.ports import free_port

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "target": {"model": "x"}, "draft": {"model": "x"}}))
    with pytest.raises(SystemExit) as stopped:
        openai_api.main(
            [str(recipe), "--grpc-url", f"127.0.0.1:{free_port()}", "--port", str(free_port()), "--root", str(tmp_path)]
        )
    said = str(stopped.value.code)
    assert said.startswith("error: ") and "unreachable" in said and "--grpc-url" in said and "Traceback" not in said, (
        said
    )
