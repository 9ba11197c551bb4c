"""A kubelet for rendered pods, on one machine: containers are local processes, probes are polled as
rendered, failing liveness restarts a container, deletion runs preStop then SIGTERM then SIGKILL.

Each pod gets its own loopback address (127.77.1.N): what a container's spec says about 127.0.0.1
(its pod's own network namespace) and 0.0.0.0 is rewritten to it, so two pods' engines both listen on
"their" port 7000. Volumes are temp folders (emptyDir, Secret and ConfigMap items written out; a
hostPath is that directory of this machine) and
every mount path, like the image's own paths (/opt/venv, the bundled model), is rewritten to where it
lies here. Env comes from the image's ENV, then the container's env (values with $(VAR) expansion,
secretKeyRef from the rendered Secret, fieldRef status.podIP). Nothing else of the spec is changed.

What a kubelet does and this does not: user ids, read-only root filesystems, resource limits, image
pulls. Timings follow the spec; a crashed container is restarted after 1 s (the kubelet backs off
from 10 s).
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.chart_e2e.images import Image
from tests.chart_e2e.probes import probe_loops, run_handler

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
MIN_KILL_GRACE = 2.0  # the kubelet's floor between SIGTERM and SIGKILL


class Rewriter:
    """Rewrites a container's strings from the pod's view to this machine's (paths, addresses, names)."""

    def __init__(self, paths: dict[str, Path], words: dict[str, str], names=None):
        self.paths = {k.rstrip("/"): str(v) for k, v in paths.items()}
        self.words = words
        self.names = names  # Service DNS names -> loopback addresses (Cluster.rewrite_names)
        self._path_re = (re.compile("(?<![\\w.-])(" + "|".join(re.escape(p) for p in sorted(self.paths, key=len,
                                                                                             reverse=True))
                                    + ")(?=/|$|[^\\w.-])") if self.paths else None)
        self._word_re = (re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
                         if words else None)

    def __call__(self, text: str) -> str:
        if self.names:
            text = self.names(text)
        if self._word_re:
            text = self._word_re.sub(lambda m: self.words[m.group(0)], text)
        if self._path_re:
            text = self._path_re.sub(lambda m: self.paths[m.group(1)], text)
        return text


@dataclass
class Container:
    pod: Pod
    spec: dict
    image: Image
    init: bool = False
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started: bool = False  # startup probe passed (or none)
    ready: bool = False
    generation: int = 0  # bumped on every (re)start: probe threads of an old run stop counting
    log_path: Path | None = None
    exited_at: float | None = None  # monotonic time of the last stop's exit
    events: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return self.spec["name"]

    # -- the process ------------------------------------------------------------------------------
    def argv(self) -> list[str]:
        rw = self.pod.rewriter_for(self)
        argv = self.on_image_path([rw(a) for a in self.spec.get("command", []) + self.spec.get("args", [])])
        env = self.env()
        return [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in argv]

    def on_image_path(self, argv: list[str]) -> list[str]:
        """A bare command name resolved on the image's PATH, as the container runtime does."""
        if "/" not in argv[0]:
            for directory in self.image.path_dirs:
                if (directory / argv[0]).exists():
                    return [str(directory / argv[0]), *argv[1:]]
        return argv

    def env(self) -> dict[str, str]:
        rw = self.pod.rewriter_for(self)
        env: dict[str, str] = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOSTNAME": self.pod.name,
                               "LANG": "C.UTF-8"}
        for name, value in self.image.env:
            value = value.replace("$PATH", env["PATH"])
            env[name] = rw(value)
        env["PATH"] = ":".join([str(d) for d in self.image.path_dirs] + [env["PATH"]])
        self.add_spec_env(env, rw)
        if "/tmp" in self.pod.mounts_of(self):
            env.setdefault("TMPDIR", str(self.pod.mounts_of(self)["/tmp"]))
        env.update(self.pod.extra_env.get(self.name, {}))
        return env

    def add_spec_env(self, env: dict[str, str], rw: Rewriter) -> None:
        """The container's own env over `env`: $(VAR) expanded, Secrets' and fields' values resolved."""
        for item in self.spec.get("env", []):
            if "value" in item:
                value = _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), item["value"])
            else:
                value = self.pod.value_from(item["valueFrom"])
            env[item["name"]] = rw(value)

    def start(self) -> None:
        with self._lock:
            self.generation += 1
            self.started = self.ready = False
            self.log_path = self.pod.dir / f"{self.name}.log"
            log = open(self.log_path, "ab")
            log.write(f"\n--- start {self.restarts} at {time.strftime('%H:%M:%S')}: {' '.join(self.argv())}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.argv(), env=self.env(), cwd=self.pod.workdir(self), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            log.close()
        self.event(f"started (pid {self.proc.pid})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace: float, reason: str) -> None:
        """preStop hook, SIGTERM, then SIGKILL once the grace period (which the hook shares) is over."""
        deadline = time.monotonic() + grace
        self.ready = False
        self.event(f"stopping: {reason} (grace {grace:g}s)")
        hook = (self.spec.get("lifecycle") or {}).get("preStop")
        if hook and self.alive():
            self.run_handler(hook, timeout=max(0.0, deadline - time.monotonic()))
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(max(MIN_KILL_GRACE, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.event("grace period over: SIGKILL")
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
        self.exited_at = time.monotonic()
        self.event(f"exited {self.proc.returncode}")

    def restart(self, grace: float, reason: str) -> None:
        self.stop(grace, reason)
        self.restarts += 1
        self.start()

    def event(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {self.pod.name}/{self.name}: {text}"
        self.events.append(line)
        self.pod.cluster.events.append(line)

    def run_handler(self, handler: dict, timeout: float) -> bool:
        return run_handler(self, handler, timeout)

    def probe_loops(self) -> list[threading.Thread]:
        return probe_loops(self)


class Pod:
    """One pod: its address, volumes, containers and probe threads."""

    def __init__(self, cluster, name: str, spec: dict, labels: dict, ip: str, images: dict[str, Image],
                 extra_env: dict[str, dict[str, str]] | None = None):
        self.cluster = cluster
        self.name = name
        self.spec = spec
        self.labels = labels
        self.ip = ip
        self.dir = cluster.work / "pods" / name
        self.dir.mkdir(parents=True)
        self.extra_env = extra_env or {}
        self.deleted = False
        self.terminating = False
        self.volumes = {v["name"]: self._make_volume(v) for v in spec.get("volumes", [])}
        # tests/container_e2e runs each container from its built image instead (ContainerRun).
        make = getattr(cluster, "container_class", Container)
        self.init_containers = [make(self, c, self._image(c, images), init=True)
                                for c in spec.get("initContainers", [])]
        self.containers = [make(self, c, self._image(c, images)) for c in spec["containers"]]

    @staticmethod
    def _image(container: dict, images: dict[str, Image]) -> Image:
        repo = container["image"].rsplit(":", 1)[0].split("@")[0]
        for name in (repo.rsplit("/", 1)[-1], repo.rsplit("/", 1)[-1].removesuffix("-cpu")):
            if name in images:  # pagedserve/engine-cpu runs from the engine's image where no CPU one is apart
                return images[name]
        raise AssertionError(f"no local image for {container['image']}")

    # -- volumes -----------------------------------------------------------------------------------
    def _make_volume(self, volume: dict) -> Path:
        if "hostPath" in volume:  # this machine is the node
            return Path(volume["hostPath"]["path"])
        path = self.dir / "volumes" / volume["name"]
        path.mkdir(parents=True)
        if "secret" in volume or "configMap" in volume:
            source = volume.get("secret") or volume["configMap"]
            kind = "Secret" if "secret" in volume else "ConfigMap"
            name = source.get("secretName") or source.get("name")
            data = self.cluster.object_data(kind, name)
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                target = path / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data[item["key"]])
                target.chmod(item.get("mode", source.get("defaultMode", 0o644)))
        elif "emptyDir" not in volume:
            raise AssertionError(f"unsupported volume {volume}")
        return path

    def mounts_of(self, container: Container) -> dict[str, Path]:
        mounts = {}
        for m in container.spec.get("volumeMounts", []):
            host = self.volumes[m["name"]] / m.get("subPath", "")
            host.mkdir(parents=True, exist_ok=True)
            mounts[m["mountPath"]] = host
        return mounts

    def workdir(self, container: Container) -> Path:
        path = self.dir / "root" / container.name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def rewriter_for(self, container: Container) -> Rewriter:
        paths = {**container.image.paths, **self.mounts_of(container)}
        return Rewriter(paths, {"127.0.0.1": self.ip, "0.0.0.0": self.ip}, self.cluster.rewrite_names)

    def value_from(self, source: dict) -> str:
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            return self.cluster.object_data("Secret", ref["name"])[ref["key"]].decode()
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self.cluster.object_data("ConfigMap", ref["name"])[ref["key"]].decode()
        field_path = source["fieldRef"]["fieldPath"]
        return {"status.podIP": self.ip, "metadata.name": self.name,
                "metadata.namespace": self.cluster.namespace}[field_path]

    def grace(self, probe: dict | None = None) -> float:
        if probe and "terminationGracePeriodSeconds" in probe:
            return float(probe["terminationGracePeriodSeconds"])
        return float(self.spec.get("terminationGracePeriodSeconds", 30))

    # -- lifecycle ----------------------------------------------------------------------------------
    def run(self) -> None:
        """Init containers one after another to success, then every container with its probes."""
        for init in self.init_containers:
            init.start()
            if init.proc.wait() != 0:
                raise AssertionError(f"{self.name}: init container {init.name} failed:\n{init.log_path.read_text()}")
        for container in self.containers:
            container.start()
        for container in self.containers:
            for thread in container.probe_loops():
                thread.start()
        threading.Thread(target=self._supervise, daemon=True, name=f"{self.name}/supervise").start()

    def _supervise(self) -> None:
        """restartPolicy Always: a container that exits by itself is started again."""
        while not self.deleted:
            for container in self.containers:
                if not self.terminating and container.proc is not None and container.proc.poll() is not None \
                        and not self.cluster.restarting(container):
                    container.event(f"exited by itself ({container.proc.returncode}); restarting")
                    time.sleep(1.0)
                    if not self.terminating:
                        container.restarts += 1
                        container.start()
            time.sleep(0.2)

    @property
    def ready(self) -> bool:
        return not self.terminating and all(c.ready for c in self.containers)

    def delete(self) -> None:
        """What deleting a pod does: out of the endpoints at once, then every container's preStop and
        SIGTERM together, SIGKILL at the end of the grace period."""
        self.terminating = True
        for container in self.containers:
            container.ready = False
        grace = self.grace()
        threads = [threading.Thread(target=c.stop, args=(grace, "pod deleted")) for c in self.containers if c.alive()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.deleted = True

    def container(self, name: str) -> Container:
        return next(c for c in self.containers if c.name == name)


def decode_data(obj: dict) -> dict[str, bytes]:
    data = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    data.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
    return data
