"""The chart's pods, run: `helm template` with the CPU values (2 replicas), each container's command, args
and env as a local process in a virtualenv built the way its image is (tests.chart_e2e.images), under a
local kubelet (probes as rendered, liveness restarts, preStop and SIGTERM), Services as kube-proxy
routes them (tests.chart_e2e.cluster). The scenarios run in order on one release and print what they
counted (`make chart-e2e` shows it):

1. cold start: a request sent while no replica exists is held, then served; every pod becomes Ready;
   the helm test pod passes; no secret is on any process's command line.
2. a frozen engine (SIGSTOP): its liveness probe restarts the engine, not the scheduler, and the
   replica serves again.
3. scale-down under load: a replica pod is deleted while streams run on it; every request finishes.
4. discovery=kubernetes: routers rolled to EndpointSlice discovery against a loopback API server
   (list + watch, the chart's RBAC enforced); the helm test passes through them.
5. two models: upgraded to a `models:` list (the bundled weights under two names, a replica each); new
   routers with no model learn both tokenizers from the registry, route by `model`, helm test asks both.
6. LoRA: upgraded to `lora` on a hostPath holding a PEFT adapter of the bundled model, admin key on; the
   adapter loaded at run time on one replica: every request for it lands there; that pod deleted, the
   other replica loads it from the same volume and serves it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.contracts.internal_auth import HEADER
from tests.chart_e2e.cluster import Cluster
from tests.chart_e2e.fake_apiserver import FakeApiServer
from tests.chart_e2e.images import build_images
from tests.chart_e2e.kubelet import Pod
from tests.charts.chart_render import CHART, NAMESPACE, RELEASE, render
from tests.proc_children import cmdline, descendant_pids

HERE = Path(__file__).parent
VALUES = ("-f", str(CHART / "ci" / "cpu-values.yaml"), "-f", str(HERE / "values.yaml"))
FULLNAME = f"{RELEASE}-pagedserve"
MODEL = "SmolLM2-135M-Instruct"
COUNTS: dict[str, dict] = {}

pytestmark = pytest.mark.timeout(900)


def report(scenario: str, **counts) -> None:
    COUNTS[scenario] = counts
    print(f"\nchart-e2e {scenario}: " + ", ".join(f"{k}={v}" for k, v in counts.items()), flush=True)


@pytest.fixture(scope="module")
def release(request):
    work = Path(tempfile.mkdtemp(prefix="chart-e2e-"))
    rendered = render("default", *VALUES)
    images = build_images(work)
    cluster = Cluster(work, rendered, images, NAMESPACE)
    try:
        yield cluster
    finally:
        cluster.close()
        if cluster.apiserver is not None:
            cluster.apiserver.close()
        if request.session.testsfailed:
            print(f"chart-e2e: logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def api_key(cluster: Cluster) -> str:
    return cluster.object_data("Secret", f"{FULLNAME}-api-keys")["api-keys"].decode().split()[0]


def internal_token(cluster: Cluster) -> str:
    return cluster.object_data("Secret", f"{FULLNAME}-internal")["internal-token"].decode()


def chat(url: str, key: str, question: str, max_tokens: int = 16, timeout: float = 300,
         headers: dict | None = None) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": question}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})}, timeout=timeout)


def stream(url: str, key: str, prompt: str, max_tokens: int) -> tuple[str, bool, str]:
    """(replica that answered, finished whole, how it ended) of one streamed completion: whole means
    every token up to max_tokens (EOS ignored), then [DONE], and no error event."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    done, errored, finish = False, False, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=300) as resp:
        replica = resp.headers.get("x-pagedserve-replica", "?")
        if resp.status_code != 200:
            return replica, False, f"HTTP {resp.status_code}"
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                errored |= "error" in event
                finish = next((c["finish_reason"] for c in event.get("choices", []) if c.get("finish_reason")),
                              finish)
    return replica, done and not errored and finish == "length", str(finish)


def run_helm_test(cluster: Cluster) -> tuple[int, str]:
    """The release's `helm test` pod, run to completion (restartPolicy Never)."""
    (hook,) = [h for h in cluster.rendered.hooks if h["kind"] == "Pod"]
    pod = cluster.new_pod(hook, f"{hook['metadata']['name']}-{int(time.time() * 1000) % 100000}")
    (container,) = pod.containers
    container.start()
    code = container.proc.wait(300)
    pod.deleted = True
    del cluster.pods[pod.name]
    return code, container.log_path.read_text()


def router_gauge(cluster: Cluster, name: str) -> float:
    total = 0.0
    for pod in cluster.pods_of("router"):
        text = httpx.get(f"http://{pod.ip}:8000/metrics", timeout=5).text
        found = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        total += float(found.group(1)) if found else 0.0
    return total


def test_cold_start_then_every_pod_ready_and_helm_test_passes(release):
    cluster = release
    started = time.monotonic()
    cluster.start_workload("StatefulSet", f"{FULLNAME}-redis")
    cluster.start_workload("Deployment", f"{FULLNAME}-router")
    cluster.wait(lambda: all(p.ready for p in cluster.pods.values()), 120, "Redis and the routers to be Ready")
    router_url = cluster.service_url(f"{FULLNAME}-router")
    key = api_key(cluster)

    # No replica exists: the router holds the request (the scale-from-zero signal) instead of a 503.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(chat, router_url, key, "Say hello.")
        cluster.wait(lambda: router_gauge(cluster, "pagedserve_router_requests_held") >= 1, 30,
                     "the request to be held")
        cluster.start_workload("Deployment", f"{FULLNAME}-replica")
        ready_after = cluster.wait(lambda: all(p.ready for p in cluster.pods.values()), 300, "every pod Ready")
        answer = held.result(120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] > 0

    code, output = run_helm_test(cluster)
    assert code == 0, output
    assert f"OK: {MODEL} answered" in output

    # Secrets reach processes as env and files only: none is on a command line.
    secrets = [key, cluster.object_data("Secret", f"{FULLNAME}-redis")["redis-password"].decode(),
               internal_token(cluster)]
    pids = [pid for p in cluster.pods.values() for c in p.containers if c.alive()
            for pid in {c.proc.pid} | descendant_pids(c.proc.pid)]
    leaks = [pid for pid in pids for s in secrets if s.encode() in b"\0".join(cmdline(pid) or [])]
    assert not leaks, f"secrets on the command line of {leaks}"
    pods = list(cluster.pods.values())
    report("ready", ok=True, pods_ready=f"{sum(p.ready for p in pods)}/{len(pods)}",
           containers=sum(len(p.containers) for p in pods), held_request_served=answer.status_code == 200,
           replicas_ready_after_s=round(ready_after, 1), helm_test="passed", processes_without_secrets=len(pids),
           total_s=round(time.monotonic() - started, 1))


def test_a_frozen_engine_is_restarted_by_its_liveness_probe_not_its_scheduler(release):
    cluster = release
    pod = sorted(cluster.pods_of("replica"), key=lambda p: p.name)[0]
    engine, scheduler = pod.container("engine"), pod.container("scheduler")
    engine_restarts, scheduler_restarts = engine.restarts, scheduler.restarts
    frozen_at = time.monotonic()
    os.kill(engine.proc.pid, signal.SIGSTOP)  # alive to TCP, dead to the step protocol
    cluster.wait(lambda: not pod.ready, 30, "the replica to leave the endpoints")
    unready_s = time.monotonic() - frozen_at
    restarted_s = cluster.wait(lambda: engine.restarts > engine_restarts, 60, "the engine to be restarted")
    ready_s = cluster.wait(lambda: pod.ready, 120, "the replica to be Ready again")
    assert scheduler.restarts == scheduler_restarts, "the scheduler must not be restarted for its engine"
    assert any("liveness probe failed" in e for e in engine.events), engine.events
    # It serves again: directly (its own scheduler, as a router calls it) and through the routers.
    scheduler_url = f"http://{pod.ip}:8100"
    assert chat(scheduler_url, api_key(cluster), "Who are you?").status_code == 401, "only routers are served"
    direct = chat(scheduler_url, api_key(cluster), "Are you back?", headers={HEADER: internal_token(cluster)})
    assert direct.status_code == 200, direct.text
    router_url = cluster.service_url(f"{FULLNAME}-router")
    through = [chat(router_url, api_key(cluster), f"Question {i}?").status_code for i in range(4)]
    assert through == [200] * 4
    report("frozen-engine", ok=True, pod=pod.name, unready_after_s=round(unready_s, 1),
           engine_restarted_after_s=round(unready_s + restarted_s, 1),
           ready_again_after_s=round(unready_s + restarted_s + ready_s, 1),
           engine_restarts=engine.restarts - engine_restarts,
           scheduler_restarts=scheduler.restarts - scheduler_restarts, requests_served_after=1 + len(through))


def test_a_replica_scaled_down_under_load_finishes_its_requests(release):
    cluster = release
    replicas = sorted(cluster.pods_of("replica"), key=lambda p: p.name)
    assert len(replicas) == 2
    victim = replicas[-1]
    router_url = cluster.service_url(f"{FULLNAME}-router")
    key = api_key(cluster)
    n, tokens = 16, 48

    def running(pod: Pod) -> float:
        text = httpx.get(f"http://{pod.ip}:8100/metrics", timeout=5).text
        return sum(float(v) for v in re.findall(
            r"^pagedserve_requests_(?:running|waiting) ([0-9.]+)$", text, re.M))

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(stream, router_url, key, f"Story number {i}: once upon a time", tokens)
                   for i in range(n)]
        cluster.wait(lambda: running(victim) >= 2, 60, f"requests in flight on {victim.name}")
        in_flight_on_victim = running(victim)
        deletion = threading.Thread(target=cluster.delete_pod, args=(victim,))
        deleted_at = time.monotonic()
        deletion.start()
        results = [f.result(300) for f in futures]
        deletion.join(300)
    engine, scheduler = victim.container("engine"), victim.container("scheduler")
    # The engine's preStop held its SIGTERM until its scheduler had drained and exited.
    assert engine.exited_at >= scheduler.exited_at, "the engine stopped before its scheduler"
    on_victim = [r for r in results if r[0] == victim.name]
    failures = [r for r in results if not r[1]]
    assert not failures, f"{len(failures)} of {n} requests failed or were cut short: {failures}"
    assert on_victim, "no request ran on the replica that was removed"
    report("scale-down", ok=True, requests=n, finished=n - len(failures), failed=len(failures),
           on_removed_replica=len(on_victim), in_flight_there_at_deletion=int(in_flight_on_victim),
           tokens_each=tokens, pod_gone_after_s=round(time.monotonic() - deleted_at, 1),
           engine_outlived_scheduler_s=round(engine.exited_at - scheduler.exited_at, 1),
           replicas_left=len(cluster.pods_of("replica")))


def upgrade(cluster: Cluster, *args: str) -> None:
    """`helm upgrade` with new values: generated Secrets are kept (the chart looks up the live ones)."""
    rendered = render("default", *VALUES, *args)
    secrets = {s["metadata"]["name"]: s for s in cluster.rendered.of_kind("Secret")}
    rendered.objects = [secrets.get(o["metadata"]["name"], o) if o["kind"] == "Secret" else o
                        for o in rendered.objects]
    cluster.rendered = rendered


def test_kubernetes_discovery_against_a_loopback_api_server(release):
    cluster = release
    cluster.apiserver = FakeApiServer(cluster, cluster.work)
    upgrade(cluster, "--set", "router.discovery=kubernetes")
    old = cluster.pods_of("router")
    new = cluster.start_workload("Deployment", f"{FULLNAME}-router")  # the rollout: new pods first
    cluster.wait(lambda: all(p.ready for p in new), 120, "the new routers to be Ready")
    for pod in old:
        cluster.delete_pod(pod)
    code, output = run_helm_test(cluster)
    assert code == 0, output
    router_url = cluster.service_url(f"{FULLNAME}-router")
    answers = [chat(router_url, api_key(cluster), f"Discovery {i}?") for i in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    account = f"{NAMESPACE}/{FULLNAME}-router"
    verbs = {(who, verb, status) for who, verb, status in cluster.apiserver.requests}
    assert {(account, "list", 200), (account, "watch", 200)} <= verbs
    assert not [r for r in cluster.apiserver.requests if r[2] != 200], cluster.apiserver.requests
    report("kubernetes-discovery", ok=True, routers_ready=f"{sum(p.ready for p in new)}/{len(new)}",
           api_lists=sum(1 for r in cluster.apiserver.requests if r[1] == "list"),
           watches_open=cluster.apiserver.watches_open, helm_test="passed",
           requests_served=sum(a.status_code == 200 for a in answers))


def test_two_models_behind_one_router(release):
    """`helm upgrade` to a `models:` list: the bundled weights under two names, one replica each (the
    existing replicas go, as a rollout would remove them). The new routers are given no model: they learn
    both tokenizers from the registry, route each request to its model's replica, and `helm test` asks
    both models."""
    ready_s = roll_out_two_models(release, (), 300)
    report("two-models", ok=True, models=2, replicas_ready_after_s=round(ready_s, 1), helm_test="passed")


def roll_out_two_models(cluster: Cluster, values: tuple[str, ...], timeout_s: float) -> float:
    """`helm upgrade` (after `values`) to two models of one replica each, as a rollout would: the old replicas
    deleted, a new router and each model's replica started, the old routers deleted once those are Ready;
    then each model served by its replicas. Returns the seconds until Ready."""
    names = ("smol", "smol-two")
    sets = [f"models[{i}].name={n},models[{i}].replicas=1" for i, n in enumerate(names)]
    upgrade(cluster, *values, *[a for s in sets for a in ("--set", s)])
    for pod in cluster.pods_of("replica"):
        cluster.delete_pod(pod)
    old_routers = cluster.pods_of("router")
    routers = cluster.start_workload("Deployment", f"{FULLNAME}-router", replicas=1)
    replicas = {n: cluster.start_workload("Deployment", f"{FULLNAME}-replica-{n}") for n in names}
    ready_s = cluster.wait(lambda: all(p.ready for p in routers + [p for ps in replicas.values() for p in ps]),
                           timeout_s, "both models' replicas and the new router to be Ready")
    for pod in old_routers:
        cluster.delete_pod(pod)
    check_each_model_served_by_its_replicas(cluster, replicas)
    return ready_s


def check_each_model_served_by_its_replicas(cluster: Cluster, replicas: dict[str, list]) -> None:
    """The router lists every model, sends each model's request to that model's replicas, and the helm
    test asks each model."""
    names = sorted(replicas)
    router_url = cluster.service_url(f"{FULLNAME}-router")
    key = api_key(cluster)
    listed = httpx.get(f"{router_url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()
    assert sorted(m["id"] for m in listed["data"]) == names
    for name in names:
        body = {"model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        answer = httpx.post(f"{router_url}/v1/chat/completions", json=body, timeout=300,
                            headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == name
        assert answer.headers["x-pagedserve-replica"] in {p.name for p in replicas[name]}
    code, output = run_helm_test(cluster)
    assert code == 0, output
    assert all(f"OK: {n} answered" in output for n in names)


def test_a_lora_adapter_on_one_replica_then_loaded_by_the_other(release, tmp_path_factory):
    """`helm upgrade` to LoRA (hostPath adapters, admin key from the chart's Secret), two replicas: an
    adapter loaded at run time on one replica through its admin endpoint gets every request for it; with
    that pod deleted, the other replica loads it on demand from the same volume and serves it."""
    from services.model_files.model_source import resolve_model
    from tests.engine.lora_adapters import save_random_adapter

    cluster = release
    adapters = tmp_path_factory.mktemp("adapters")
    save_random_adapter(resolve_model(None), adapters / "sql", seed=1)
    upgrade(cluster, "--set", f"lora.enabled=true,lora.source=hostPath,lora.hostPath.path={adapters},"
            "lora.maxLoras=1,lora.maxLoraRank=8,lora.adminKey.enabled=true")
    for pod in cluster.pods_of("replica"):
        cluster.delete_pod(pod)
    if not cluster.pods_of("redis"):  # run on its own (-k lora)
        cluster.start_workload("StatefulSet", f"{FULLNAME}-redis")
    if not cluster.pods_of("router"):
        cluster.start_workload("Deployment", f"{FULLNAME}-router", replicas=1)
    first, second = sorted(cluster.start_workload("Deployment", f"{FULLNAME}-replica", replicas=2),
                           key=lambda p: p.name)
    ready_s = cluster.wait(lambda: all(p.ready for p in cluster.pods.values()), 300, "the LoRA replicas to be Ready")
    admin = cluster.object_data("Secret", f"{FULLNAME}-lora-admin")["lora-admin-key"].decode()
    loaded = httpx.post(f"http://{first.ip}:8100/v1/load_lora_adapter", timeout=120,
                        headers={"Authorization": f"Bearer {admin}"}, json={"lora_name": "sql", "lora_path": "sql"})
    assert loaded.status_code == 200, loaded.text
    router_url, key = cluster.service_url(f"{FULLNAME}-router"), api_key(cluster)
    auth = {"Authorization": f"Bearer {key}"}
    cluster.wait(lambda: "sql" in {m["id"] for m in httpx.get(f"{router_url}/v1/models", headers=auth,
                                                              timeout=30).json()["data"]},
                 30, "the router to learn the adapter from the registry")

    def ask(i: int) -> httpx.Response:
        body = {"model": "sql", "max_tokens": 4, "messages": [{"role": "user", "content": f"Rows {i}?"}]}
        return httpx.post(f"{router_url}/v1/chat/completions", json=body, headers=auth, timeout=300)

    before = [ask(i) for i in range(6)]
    assert [a.status_code for a in before] == [200] * 6, before[0].text
    assert {a.headers["x-pagedserve-replica"] for a in before} == {first.name}
    cluster.delete_pod(first)
    after = [ask(i) for i in range(6, 10)]
    assert [a.status_code for a in after] == [200] * 4, after[0].text
    assert {a.headers["x-pagedserve-replica"] for a in after} == {second.name}
    report("lora", ok=True, replicas_ready_after_s=round(ready_s, 1), on_resident=len(before),
           after_its_pod_deleted=len(after), served_by_the_other=len(after))
