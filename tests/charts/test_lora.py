"""LoRA adapters in the chart (`lora`, and a `models:` entry's own laid over it), rendered: the engine's
slot flags, the scheduler's adapters at start and its run-time --lora-dir, the adapter volume mounted
read-only in both at one path (PVC, hostPath, or an emptyDir an init container fills), the admin key
from a Secret through the environment only, and every inconsistent value refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.commands import settings
from tests.charts.chart_render import RELEASE, args_of, containers, pod_spec, render, render_error

FULLNAME = f"{RELEASE}-pagedserve"
LORA = ("-f", str(Path(__file__).parent / "fixtures" / "lora-values.yaml"))


def mounts(container: dict) -> dict[str, dict]:
    return {m["name"]: m for m in container.get("volumeMounts", [])}


def volumes(workload: dict) -> dict[str, dict]:
    return {v["name"]: v for v in pod_spec(workload).get("volumes", [])}


def test_a_models_adapters_reach_its_engine_and_scheduler_and_no_other_model():
    rendered = render("default", *LORA)
    smol = rendered.get("Deployment", f"{FULLNAME}-replica-smol")
    c = containers(smol)
    engine, scheduler = args_of(c["engine"]), args_of(c["scheduler"])
    assert (engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (2, 8, 16)
    assert scheduler.lora_dir == "/adapters"
    assert scheduler.lora_modules == ["sql=/adapters/sql", "chat-v2=/adapters/tunes/chat-v2"]
    # Both containers read the same files at the same path, neither can write them.
    for name in ("engine", "scheduler"):
        assert mounts(c[name])["lora-adapters"] == {"name": "lora-adapters", "mountPath": "/adapters",
                                                    "readOnly": True}
    assert volumes(smol)["lora-adapters"]["persistentVolumeClaim"] == {"claimName": "smol-adapters",
                                                                       "readOnly": True}
    assert "lora-adapters" not in {i["name"] for i in pod_spec(smol).get("initContainers", [])}, "a PVC needs none"
    # The admin key comes from the chart's Secret through the environment, never the command line.
    env = {e["name"]: e for e in c["scheduler"]["env"]}
    ref = env[settings.LORA_ADMIN_KEY.env]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": f"{FULLNAME}-lora-admin", "key": "lora-admin-key"}
    assert rendered.secret_value(f"{FULLNAME}-lora-admin", "lora-admin-key")
    assert scheduler.lora_admin_key is None
    assert not any("admin" in a for a in c["scheduler"]["args"])
    # The entry that turned LoRA off gets none of it (a false in the entry wins over the release's true).
    plain = rendered.get("Deployment", f"{FULLNAME}-replica-plain")
    pc = containers(plain)
    assert args_of(pc["engine"]).max_loras == 0 and args_of(pc["scheduler"]).lora_dir is None
    assert "lora-adapters" not in volumes(plain) and "lora-adapters" not in mounts(pc["engine"])
    # The router needs nothing: it learns every adapter from the replicas' registry records.
    assert not any("lora" in a for a in containers(rendered.workload("router"))["router"]["args"])


def test_an_empty_dir_is_filled_by_the_init_container_before_the_services_start():
    rendered = render("default", "--set", "lora.enabled=true,lora.init.image=busybox:1.36",
                      "--set-json", 'lora.init.command=["sh","-c","cp -r /bundle/. $LORA_DIR"]',
                      "--set-json", 'lora.modules=[{"name":"sql","path":"sql"}]')
    replica = rendered.workload("replica")
    (init,) = [i for i in pod_spec(replica)["initContainers"] if i["name"] == "lora-adapters"]
    assert init["image"] == "busybox:1.36" and init["command"][0] == "sh"
    assert mounts(init)["lora-adapters"] == {"name": "lora-adapters", "mountPath": "/adapters"}  # writable here
    assert {"name": "LORA_DIR", "value": "/adapters"} in init["env"]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert volumes(replica)["lora-adapters"]["emptyDir"] == {"sizeLimit": "1Gi"}
    assert not rendered.of_kind("Secret") or f"{FULLNAME}-lora-admin" not in {
        s["metadata"]["name"] for s in rendered.of_kind("Secret")}, "no admin key asked for"
    hostpath = render("default", "--set", "lora.enabled=true,lora.source=hostPath,lora.hostPath.path=/srv/adapters")
    assert volumes(hostpath.workload("replica"))["lora-adapters"]["hostPath"] == {"path": "/srv/adapters",
                                                                                 "type": "Directory"}


def test_an_existing_admin_secret_is_used_and_none_created():
    rendered = render("default", "--set", "lora.enabled=true,lora.adminKey.enabled=true,"
                      "lora.adminKey.existingSecret=ops-lora,lora.adminKey.existingSecretKey=key")
    env = {e["name"]: e for e in containers(rendered.workload("replica"))["scheduler"]["env"]}
    assert env[settings.LORA_ADMIN_KEY.env]["valueFrom"]["secretKeyRef"] == {"name": "ops-lora", "key": "key"}
    assert f"{FULLNAME}-lora-admin" not in {s["metadata"]["name"] for s in rendered.of_kind("Secret")}


def test_lora_off_renders_nothing_of_it():
    rendered = render("default")
    c = containers(rendered.workload("replica"))
    assert args_of(c["engine"]).max_loras == 0 and args_of(c["scheduler"]).lora_dir is None
    assert "lora-adapters" not in volumes(rendered.workload("replica"))


@pytest.mark.parametrize("args,needle", [
    (("--set", "lora.enabled=true,lora.source=pvc"), "claimName"),
    (("--set", "lora.enabled=true,lora.source=hostPath"), "path"),
    (("--set", "lora.enabled=true,lora.source=s3"), "lora/source"),
    (("--set", "lora.maxLoras=0"), "lora/maxLoras"),
    (("--set", "lora.enabled=true,lora.source=pvc,lora.pvc.claimName=x", "--set-json",
      'lora.modules=[{"name":"sql","path":"../etc"}]'), "lora/modules/0/path"),
    (("--set", "lora.enabled=true,lora.source=pvc,lora.pvc.claimName=x", "--set-json",
      'lora.modules=[{"name":"sql"}]'), "path"),
    (("--set", "lora.enabled=true,lora.source=pvc,lora.pvc.claimName=x", "--set-json",
      'lora.modules=[{"name":"SmolLM2-135M-Instruct","path":"a"}]'), "is the base model's own"),
    (("--set", "lora.enabled=true,lora.source=pvc,lora.pvc.claimName=x", "--set-json",
      'lora.modules=[{"name":"a","path":"a"},{"name":"a","path":"b"}]'), "given twice"),
    (("--set", "lora.enabled=true", "--set-json", 'lora.modules=[{"name":"a","path":"a"}]'), "lora.init"),
    (("--set", "lora.enabled=true,lora.init.command[0]=sh"), "image"),
    (("--set", "models[0].name=a,models[0].lora.source=pvc,models[0].lora.enabled=true"), "claimName"),
])
def test_inconsistent_lora_values_are_refused_by_name(args, needle):
    assert needle in render_error(*args)
