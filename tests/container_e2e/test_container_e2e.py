"""The chart's pods run from the built images (`make container-e2e`, which `make test` runs after building
them with make/images.py): `helm template` with the CPU values, each container started by podman or
docker with its pod's command, args, env, user, read-only root filesystem, volumes and probes, on the
host network (tests.container_e2e.runtime), under the local kubelet of tests.chart_e2e. In order, on one
release, each printing what it counted:

0. the CPU engine image alone: `pagedserve serve` with --read-only and --user 10001, only /cache and /tmp
   writable, answers the README's request;
1. ready: Redis, routers and replicas Ready, a request through the router, `helm test` passes; the
   containers run as the chart says (uid, read-only root, the CPU kernels compiled into the image used);
2. an engine container killed (SIGKILL) while a stream runs through the router: the stream ends with an
   error event (never a hang or a silent cut), the container is restarted and the replica serves again;
3. two models: upgraded to a `models:` list, each model served by its own replica, `helm test` asks both.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.chart_e2e.cluster import Cluster
from tests.chart_e2e.test_chart_e2e import (
    FULLNAME,
    MODEL,
    api_key,
    chat,
    roll_out_two_models,
    run_helm_test,
)
from tests.charts.chart_render import CHART, NAMESPACE, render
from tests.container_e2e import runtime
from tests.container_e2e.runtime import ContainerRun, built_images

HERE = Path(__file__).parent
# The chart e2e's values (CPU replicas, short probe periods), then this e2e's own (tests/container_e2e/values.yaml).
VALUES = ("-f", str(CHART / "ci" / "cpu-values.yaml"), "-f", str(HERE.parent / "chart_e2e" / "values.yaml"),
          "-f", str(HERE / "values.yaml"))
ENGINE = runtime.engine()

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif("error" in ENGINE, reason=ENGINE.get("error", ""))]


def report(scenario: str, **counts) -> None:
    print(f"\ncontainer-e2e {scenario}: " + ", ".join(f"{k}={v}" for k, v in counts.items()), flush=True)


@pytest.fixture(scope="module")
def release(request):
    work = Path(tempfile.mkdtemp(prefix="container-e2e-"))
    ContainerRun.ENGINE = ENGINE
    cluster = Cluster(work, render("default", *VALUES), built_images(ENGINE), NAMESPACE)
    cluster.container_class = ContainerRun
    try:
        yield cluster
    finally:
        for pod in list(cluster.pods.values()):
            pod.terminating = True
        cluster.close()
        # Only this e2e's containers (ce2e-*), whichever engine runs them.
        names = subprocess.run(ENGINE["cli"] + ["ps", "-a", "--filter", "name=ce2e-", "--format", "{{.Names}}"],
                               capture_output=True, text=True, timeout=60).stdout.split()
        if names:
            subprocess.run(ENGINE["cli"] + ["rm", "-f", *names], capture_output=True, timeout=300)
        if request.session.testsfailed:
            print(f"container-e2e: logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_cpu_engine_image_serves_alone_read_only_as_uid_10001(tmp_path):
    image = built_images(ENGINE)["engine-cpu"].name
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    for path in (cache, tmp):
        path.mkdir()
        path.chmod(0o777)
    port, name = _free_port(), f"ce2e-serve-{os.getpid()}"
    read_only = ["--read-only"] + (["--read-only-tmpfs=false"] if ENGINE["cli"][0] == "podman" else [])
    started = time.monotonic()
    proc = subprocess.Popen([*ENGINE["cli"], "run", "--rm", "--name", name, "--network", "host", *ENGINE["run_flags"],
                             *read_only, "--user", "10001", "-v", f"{cache}:/cache", "-v", f"{tmp}:/tmp", image,
                             "serve", "--model", "/opt/pagedserve/default-model", "--host", "127.0.0.1", "--port",
                             str(port), "--kv-cache-memory", "64M"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve did not become healthy in 300 s"
            time.sleep(1)
        ready_s = time.monotonic() - started
        # The README's request, as it is written there.
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hello!"}]})
        assert answer.status_code == 200, answer.text
        text = answer.json()["choices"][0]["message"]["content"]
        assert text.strip()
        inspected = json.loads(subprocess.run(ENGINE["cli"] + ["inspect", name], capture_output=True, text=True,
                                              check=True).stdout)[0]
        assert inspected["HostConfig"]["ReadonlyRootfs"] is True
        assert inspected["Config"]["User"] == "10001"
        # Nothing but the two volumes can be written: a write anywhere else in the image fails.
        probe = subprocess.run(ENGINE["cli"] + ["exec", name, "sh", "-c", "id -u; touch /opt/x 2>&1; touch /x 2>&1; "
                                                "touch /cache/ok /tmp/ok && echo writable"],
                               capture_output=True, text=True, timeout=60)
        lines = probe.stdout.splitlines()
        assert lines[0] == "10001" and lines[-1] == "writable", probe.stdout
        assert sum("Read-only file system" in ln for ln in lines) == 2, probe.stdout
    finally:
        subprocess.run(ENGINE["cli"] + ["kill", "--signal", "TERM", name], capture_output=True, timeout=60)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            subprocess.run(ENGINE["cli"] + ["rm", "-f", name], capture_output=True, timeout=60)
    report("serve-alone", ok=True, image=image, healthy_after_s=round(ready_s, 1), user=10001, read_only_root=True,
           writable="/cache,/tmp", answer_chars=len(text))


def _kernel_path(container) -> str:
    """What the engine's log says about its CPU kernels (the image's prebuilt ones, or a compile)."""
    text = container.log_path.read_text()
    if "compiling the CPU kernels" in text:
        return "compiled at start"
    if "no prebuilt CPU kernels" in text or "CPU attention kernels unavailable" in text:
        return "PyTorch references"
    return "prebuilt in the image"


def test_ready_request_through_the_router_and_helm_test(release):
    cluster = release
    started = time.monotonic()
    cluster.start_workload("StatefulSet", f"{FULLNAME}-redis")
    cluster.start_workload("Deployment", f"{FULLNAME}-router")
    cluster.start_workload("Deployment", f"{FULLNAME}-replica")
    ready_s = cluster.wait(lambda: all(p.ready for p in cluster.pods.values()), 420, "every pod Ready")
    router_url = cluster.service_url(f"{FULLNAME}-router")
    answer = chat(router_url, api_key(cluster), "Say hello.")
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] > 0
    code, output = run_helm_test(cluster)
    assert code == 0, output
    assert f"OK: {MODEL} answered" in output
    # The containers run as the chart says.
    checked = 0
    for pod in cluster.pods.values():
        for container in pod.containers:
            info = container.inspect()
            assert info, f"{container.cname} is not running"
            ctx = {**(pod.spec.get("securityContext") or {}), **(container.spec.get("securityContext") or {})}
            assert info["HostConfig"]["ReadonlyRootfs"] is bool(ctx.get("readOnlyRootFilesystem"))
            assert info["Config"]["User"].split(":")[0] == str(ctx["runAsUser"])
            checked += 1
    engine = sorted(cluster.pods_of("replica"), key=lambda p: p.name)[0].container("engine")
    kernels = _kernel_path(engine)
    assert kernels == "prebuilt in the image", engine.log_path.read_text()[-2000:]
    pods = list(cluster.pods.values())
    report("ready", ok=True, pods_ready=f"{sum(p.ready for p in pods)}/{len(pods)}", containers_checked=checked,
           ready_after_s=round(ready_s, 1), helm_test="passed", engine_cpu_kernels=kernels,
           total_s=round(time.monotonic() - started, 1))


def _stream_events(url: str, key: str, max_tokens: int, first_byte: concurrent.futures.Future) -> dict:
    """One streamed completion through the router: how it ended."""
    body = {"model": MODEL, "prompt": "Tell me a long story about a lighthouse.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    tokens, done, error = 0, False, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=300) as resp:
        replica = resp.headers.get("x-pagedserve-replica", "?")
        if resp.status_code != 200:
            first_byte.set_result(replica)
            return {"status": resp.status_code, "replica": replica, "error": resp.read().decode()}
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                tokens += sum(1 for c in event.get("choices", []) if c.get("text"))
                if tokens == 3 and not first_byte.done():
                    first_byte.set_result(replica)
    if not first_byte.done():
        first_byte.set_result(replica)
    return {"status": 200, "replica": replica, "tokens": tokens, "done": done, "error": error}


def test_an_engine_container_killed_mid_stream(release):
    """SIGKILL to a replica's engine container while a stream through the router is being served there:
    the client gets an error event naming the failure (or a retried, whole answer), never a hang; the
    container is started again by the kubelet and the replica serves again."""
    cluster = release
    router_url, key = cluster.service_url(f"{FULLNAME}-router"), api_key(cluster)
    first_byte: concurrent.futures.Future = concurrent.futures.Future()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(_stream_events, router_url, key, 2000, first_byte)
        replica_name = first_byte.result(300)
        pod = cluster.pods[replica_name]
        engine = pod.container("engine")
        restarts = engine.restarts
        killed_at = time.monotonic()
        runtime.kill_hard(engine)
        ended = streaming.result(180)
    ended_s = time.monotonic() - killed_at
    whole = ended.get("done") and ended.get("tokens") == 2000 and not ended.get("error")
    assert whole or ended.get("error") or ended["status"] >= 500, ended
    if ended.get("error"):
        assert ended["error"].get("message"), ended
    restarted_s = cluster.wait(lambda: engine.restarts > restarts, 60, "the engine container to be restarted")
    ready_s = cluster.wait(lambda: pod.ready, 300, "the replica to be Ready again")
    served = [chat(router_url, key, f"Question {i}?").status_code for i in range(4)]
    assert served == [200] * 4
    report("engine-killed", ok=True, pod=pod.name, stream_ended_after_s=round(ended_s, 1),
           stream=("whole (retried)" if whole else f"error event: {ended.get('error', {}).get('message', '')[:80]!r}"),
           tokens_before_the_end=ended.get("tokens"), restarted_after_s=round(restarted_s, 1),
           ready_again_after_s=round(restarted_s + ready_s, 1), requests_served_after=len(served))


def test_two_models_behind_one_router(release):
    ready_s = roll_out_two_models(release, VALUES, 420)
    report("two-models", ok=True, models=2, replicas_ready_after_s=round(ready_s, 1), helm_test="passed")
