"""What the user reads: NOTES.txt tells how to reach the endpoint of the release as configured, and the
README's "Deploy on Kubernetes" section names only values and files that exist."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.charts.chart_render import CHART, NAMESPACE, RELEASE, REPO, VARIANTS, helm, render


def notes(variant: str) -> str:
    args = ["install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client"]
    if VARIANTS[variant] is not None:
        args += ["-f", str(VARIANTS[variant])]
    result = helm(*args)
    assert result.returncode == 0, result.stderr
    return result.stdout[result.stdout.index("NOTES:"):]


def test_notes_without_ingress_port_forward_to_the_router_service():
    text = notes("default")
    service = render("default").get("Service", f"{RELEASE}-pagedserve-router")
    port = service["spec"]["ports"][0]["port"]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{service['metadata']['name']} 8000:{port}" in text
    assert '"model": "SmolLM2-135M-Instruct"' in text
    assert "WARNING: API keys are off" in text and "Authorization" not in text
    assert f"helm test {RELEASE} -n {NAMESPACE}" in text
    assert "Autoscaling is off" in text


@pytest.mark.parametrize("variant, base_url", [
    ("ingress-tls", "BASE_URL=https://llm.example.com"),
    ("gateway-k8s-discovery", "BASE_URL=https://llm.example.com"),
])
def test_notes_show_the_public_url(variant, base_url):
    assert base_url in notes(variant)


@pytest.mark.parametrize("variant", ["api-keys", "existing-secrets", "ingress-tls"])
def test_notes_read_the_api_key_from_the_secret_the_router_reads(variant):
    rendered = render(variant)
    volume = next(v for v in rendered.workload("router")["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "api-keys")
    secret, key = volume["secret"]["secretName"], volume["secret"]["items"][0]["key"]
    escaped = key.replace(".", "\\.")  # kubectl's jsonpath needs dots in keys escaped
    text = notes(variant)
    assert f"get secret {secret} -o jsonpath='{{.data.{escaped}}}'" in text
    assert '-H "Authorization: Bearer $API_KEY"' in text and "WARNING: API keys are off" not in text


def test_notes_explain_the_autoscaler_in_use():
    hpa = notes("gpu")
    assert "an HPA scales llm-pagedserve-replica between 2 and 16 replicas" in hpa
    assert "/apis/custom.metrics.k8s.io/v1beta1/namespaces/serving/pods/*/pagedserve_requests_waiting" in hpa
    keda = notes("keda")
    assert "KEDA scales llm-pagedserve-replica between 0 and 8 replicas" in keda
    assert "WARNING" not in keda.split("Autoscaling:")[1]
    without_monitors = notes_with("--set", "keda.enabled=true", "--set", "keda.serverAddress=http://prom:9090")
    assert "metrics.serviceMonitor.enabled=false" in without_monitors


def notes_with(*args: str) -> str:
    result = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *args)
    assert result.returncode == 0, result.stderr
    return result.stdout[result.stdout.index("NOTES:"):]


def _value_exists(values: dict, dotted: str) -> bool:
    node = values
    for part in dotted.split("."):
        if part == "*":
            return isinstance(node, dict)
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_readme_deploy_section_names_real_values_and_files():
    readme = (REPO / "README.md").read_text()
    assert "## Deploy on Kubernetes" in readme
    section = readme[readme.index("## Deploy on Kubernetes"):]
    assert "helm install" in section and "make images" in section
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for token in re.findall(r"`([^`\s]+)`", section):
        name = token.split("=", 1)[0]
        if re.fullmatch(r"[a-z][A-Za-z]*(\.[a-zA-Z*]+)+", name) and name.split(".")[0] in values:
            assert _value_exists(values, name), f"README names a value that does not exist: {name}"
        elif re.fullmatch(r"(charts|k8s|services|docker)/[\w./-]+", token):
            assert (REPO / token).exists(), f"README names a missing file: {token}"
    # The README's example release is `llm`; its port-forward must hit the real router Service and port.
    service = render("default").get("Service", f"{RELEASE}-pagedserve-router")
    assert f"svc/{service['metadata']['name']} 8000:{service['spec']['ports'][0]['port']}" in section


def test_notes_say_whom_the_router_policy_admits():
    rendered = render("loadbalancer")
    text = notes("loadbalancer")
    assert "NetworkPolicy: the router (port 8000) accepts connections only from:" in text
    assert "clients of the LoadBalancer Service" in text and "203.0.113.0/24" in text
    assert "this release's helm test pod" in text and "Egress is limited too" in text
    (rule,) = rendered.get("NetworkPolicy", f"{RELEASE}-pagedserve-router")["spec"]["ingress"]
    for peer in rule["from"]:
        for cidr in [peer["ipBlock"]["cidr"]] if "ipBlock" in peer else []:
            assert cidr in text, f"NOTES does not mention {cidr}, which the policy admits"
    assert "the ingress controller" in notes("ingress-tls") and "the Gateway of router.httpRoute.parentRefs" in notes(
        "gateway-k8s-discovery")
    assert "While no replica is ready, routers hold requests for up to 300s" in notes_with(
        "-f", str(REPO / "k8s" / "keda" / "values.yaml"))
