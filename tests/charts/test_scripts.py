"""The scripts the chart runs inside pods, run here for real: the `helm test` chat completion (against a
local OpenAI-shaped HTTP server) and the engine's preStop wait (against a real TCP connection)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest

from services.commands.cli import build_parser
from tests.charts.chart_render import NAMESPACE, pod_spec, render
from tests.json_http import send_json


def _hook_pod(variant: str) -> dict:
    (pod,) = [h for h in render(variant).hooks if h["kind"] == "Pod"]
    return pod


@pytest.mark.parametrize("variant", ["default", "api-keys", "existing-secrets"])
def test_helm_test_pod_targets_the_router_service_with_the_served_model(variant):
    rendered = render(variant)
    pod = _hook_pod(variant)
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    (container,) = pod["spec"]["containers"]
    url, model, key_file, _timeout = container["args"]
    target = urlparse(url)
    service_name, namespace = target.hostname.split(".")[:2]
    service = rendered.get("Service", service_name)
    assert namespace == NAMESPACE and target.port == service["spec"]["ports"][0]["port"]
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "router"
    scheduler = build_parser().parse_args(rendered.container("scheduler")["args"])
    assert model == scheduler.served_model_name
    router = build_parser().parse_args(rendered.container("router")["args"])
    if router.api_keys_file:
        # The test pod reads the same Secret key the router reads.
        router_volume = next(v for v in pod_spec(rendered.workload("router"))["volumes"] if v["name"] == "api-keys")
        (test_volume,) = pod["spec"]["volumes"]
        assert test_volume["secret"] == router_volume["secret"]
        mount = container["volumeMounts"][0]["mountPath"]
        assert key_file == f"{mount}/{test_volume['secret']['items'][0]['path']}"
    else:
        assert key_file == ""


class _FakeRouter(BaseHTTPRequestHandler):
    """Answers /v1/chat/completions like the router; `reply` picks a good or a broken answer."""

    reply = "good"
    required_key: str | None = None
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
        if self.required_key and self.headers.get("Authorization") != f"Bearer {self.required_key}":
            return self._send(401, {"error": {"message": "Incorrect or missing API key", "code": "invalid_api_key"}})
        content = "Hello there!" if self.reply == "good" else ""
        self._send(200, {"id": "chatcmpl-1", "object": "chat.completion", "model": body["model"],
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 9, "completion_tokens": 4 if content else 0,
                                   "total_tokens": 13}})

    def _send(self, status: int, payload: dict) -> None:
        send_json(self, status, payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_router():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeRouter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FakeRouter.reply, _FakeRouter.required_key, _FakeRouter.seen = "good", None, []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _run_hook(variant: str, url: str, key_file: str = "") -> subprocess.CompletedProcess:
    (container,) = _hook_pod(variant)["spec"]["containers"]
    assert container["command"][:2] == ["python", "-c"]
    _, model, _, timeout = container["args"]
    return subprocess.run([sys.executable, "-c", container["command"][2], url, model, key_file, timeout],
                          capture_output=True, text=True, timeout=60)


def test_helm_test_script_passes_on_a_real_completion(fake_router):
    result = _run_hook("default", fake_router)
    assert result.returncode == 0, result.stderr
    assert "OK: SmolLM2-135M-Instruct answered 'Hello there!'" in result.stdout
    (request,) = _FakeRouter.seen
    assert request["path"] == "/v1/chat/completions" and request["auth"] is None
    assert request["body"]["model"] == "SmolLM2-135M-Instruct" and request["body"]["messages"][0]["role"] == "user"


def test_helm_test_script_sends_the_first_api_key(fake_router, tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text(render("api-keys").secret_value("llm-pagedserve-api-keys", "api-keys"))
    _FakeRouter.required_key = "sk-team-a-0123456789"
    assert _run_hook("api-keys", fake_router, str(keys)).returncode == 0
    _FakeRouter.required_key = "another-key"
    result = _run_hook("api-keys", fake_router, str(keys))
    assert result.returncode != 0 and "HTTP 401" in result.stderr


def test_helm_test_script_fails_on_an_empty_answer_or_no_router(fake_router):
    _FakeRouter.reply = "empty"
    result = _run_hook("default", fake_router)
    assert result.returncode != 0
    assert "no generated text" in result.stderr and "completion_tokens missing or zero" in result.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    result = _run_hook("default", f"http://127.0.0.1:{closed_port}")
    assert result.returncode != 0 and "cannot reach" in result.stderr


def _engine_pre_stop(port: int, seconds: int) -> list[str]:
    """The rendered preStop command of the engine, pointed at a test `port` with a `seconds` deadline."""
    command = render("default").container("engine")["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "pagedserve"
    args = [a.replace(":7000", f":{port}") if a.startswith("--engine=") else a for a in command[1:]]
    args = [f"--timeout={seconds}" if a.startswith("--timeout=") else a for a in args]
    return [sys.executable, "-m", "services.commands.cli", *args]


def test_engine_pre_stop_waits_while_its_scheduler_is_connected():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))  # the scheduler's connection
        server_side, _ = listener.accept()
        started = time.monotonic()
        waiter = subprocess.Popen(_engine_pre_stop(port, 30))
        time.sleep(1.5)
        assert waiter.poll() is None, "the engine must not stop while its scheduler is connected"
        client.close()  # the scheduler has exited
        server_side.close()
        assert waiter.wait(timeout=10) == 0
        assert time.monotonic() - started < 10


def test_engine_pre_stop_returns_at_once_without_a_scheduler_and_honours_its_deadline():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        started = time.monotonic()
        subprocess.run(_engine_pre_stop(port, 30), check=True, timeout=10)
        assert time.monotonic() - started < 5
        client = socket.create_connection(("127.0.0.1", port))
        server_side, _ = listener.accept()
        started = time.monotonic()
        subprocess.run(_engine_pre_stop(port, 2), check=True, timeout=10)
        assert 1.5 < time.monotonic() - started < 8, "the deadline bounds the wait"
        client.close()
        server_side.close()
