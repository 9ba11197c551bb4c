"""The chart's containers, run from the built images (make images) by podman or docker, under the local
kubelet of tests.chart_e2e.kubelet: its probes, restarts, preStop and SIGTERM/SIGKILL are the same; what
starts and signals a container is this.

Each container gets, from its pod spec: the command (as entrypoint) and args, its env (Secrets' values
resolved), the user and group of its and its pod's securityContext, a read-only root filesystem where it
says so (and then nothing else writable: no tmpfs is added), its volumeMounts (an emptyDir or a Secret
is a directory of the node, a Secret read-only), its working directory. Only the host network is used:
every pod has its own loopback address (127.77.1.N), and what the spec says about 127.0.0.1 or 0.0.0.0
and the Services' DNS names is rewritten to addresses on 127.0.0.1's network, as the process kubelet
does; paths are not rewritten, since the image has them. exec probes run in the container (`exec`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.chart_e2e.images import Image
from tests.chart_e2e.kubelet import _VAR, Container, Rewriter

REPO = Path(__file__).resolve().parents[2]
STATE = REPO / ".images"
# The images the chart's pods run, by the name tests.chart_e2e.kubelet.Pod._image looks them up under.
IMAGES = {"router": "router", "scheduler": "scheduler", "engine-cpu": "engine-cpu", "redis": "e2e-redis",
          "valkey": "e2e-redis"}


def engine() -> dict:
    """What make/images.py found: {'cli', 'run_flags', 'prefix', 'tag'}, or {'error': why not}."""
    path = STATE / "engine.json"
    if not path.exists():
        return {"error": "no .images/engine.json: run `make images` (or `make container-e2e`) first"}
    return json.loads(path.read_text())


def built_images(found: dict) -> dict[str, Image]:
    return {name: Image(f"localhost/{found['prefix']}/{target}:{found['tag']}", None)
            for name, target in IMAGES.items()}


class ContainerRun(Container):
    """One container of a pod, as a container of the built image (podman/docker run, attached)."""

    ENGINE: dict = {}

    @property
    def cname(self) -> str:
        return f"ce2e-{self.pod.name}-{self.name}"[:120]

    def _rewriter(self) -> Rewriter:
        return Rewriter({}, {"127.0.0.1": self.pod.ip, "0.0.0.0": self.pod.ip}, self.pod.cluster.rewrite_names)

    def env(self) -> dict[str, str]:
        """The container's own env (the image's ENV is in the image), $(VAR) expanded, addresses rewritten."""
        env: dict[str, str] = {}
        self.add_spec_env(env, self._rewriter())
        env.update(self.pod.extra_env.get(self.name, {}))
        return env

    def argv(self) -> list[str]:
        rw = self._rewriter()
        env = self.env()
        return [_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), rw(a))
                for a in self.spec.get("command", []) + self.spec.get("args", [])]

    def security(self) -> list[str]:
        pod_ctx = self.pod.spec.get("securityContext") or {}
        ctx = {**pod_ctx, **(self.spec.get("securityContext") or {})}
        flags = []
        if "runAsUser" in ctx:
            flags += ["--user", f"{ctx['runAsUser']}:{ctx.get('runAsGroup', ctx['runAsUser'])}"]
        if "fsGroup" in pod_ctx:
            flags += ["--group-add", str(pod_ctx["fsGroup"])]
        if ctx.get("readOnlyRootFilesystem"):
            flags += ["--read-only"] + (["--read-only-tmpfs=false"] if self.ENGINE["cli"][0] == "podman" else [])
        if ctx.get("capabilities", {}).get("drop") == ["ALL"]:
            flags += ["--cap-drop", "ALL"]
        if ctx.get("allowPrivilegeEscalation") is False:
            flags += ["--security-opt", "no-new-privileges"]
        return flags

    def mounts(self) -> list[str]:
        flags = []
        for m in self.spec.get("volumeMounts", []):
            volume = next(v for v in self.pod.spec.get("volumes", []) if v["name"] == m["name"])
            host = self.pod.volumes[m["name"]] / m.get("subPath", "")
            host.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in volume:
                host.chmod(0o777)  # an emptyDir is world-writable, as the kubelet makes it
            fs_group = (self.pod.spec.get("securityContext") or {}).get("fsGroup")
            if fs_group is not None and ("secret" in volume or "configMap" in volume):
                # The kubelet's volume ownership: files of the pod's fsGroup, so a mode of 0440 lets the
                # pod's user (in that group) read them.
                for path in [host, *host.rglob("*")]:
                    os.chown(path, 0, fs_group)
            read_only = m.get("readOnly") or "secret" in volume or "configMap" in volume
            flags += ["-v", f"{host}:{m['mountPath']}{':ro' if read_only else ''}"]
        return flags

    def start(self) -> None:
        with self._lock:
            self.generation += 1
            self.started = self.ready = False
            cli = self.ENGINE["cli"]
            subprocess.run(cli + ["rm", "-f", self.cname], capture_output=True)
            argv = self.argv()
            run = [*cli, "run", "--rm", "--name", self.cname, "--network", "host", *self.ENGINE["run_flags"],
                   "--hostname", self.pod.name, *self.security(), *self.mounts()]
            for name, value in self.env().items():
                run += ["-e", f"{name}={value}"]
            if self.spec.get("workingDir"):
                run += ["--workdir", self.spec["workingDir"]]
            if argv:
                run += ["--entrypoint", argv[0]]
            run += [self.image.name, *argv[1:]]
            self.log_path = self.pod.dir / f"{self.name}.log"
            log = open(self.log_path, "ab")
            log.write(f"\n--- start {self.restarts} at {time.strftime('%H:%M:%S')}: {self.image.name} "
                      f"{' '.join(argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(run, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
            log.close()
        self.event(f"started ({self.image.name})")

    def signal(self, sig: int) -> None:
        """To the container's first process, as the kubelet's runtime sends it (not to the CLI)."""
        if self.alive():
            subprocess.run(self.ENGINE["cli"] + ["kill", "--signal", str(int(sig)), self.cname], capture_output=True,
                           timeout=60)

    def stop(self, grace: float, reason: str) -> None:
        super().stop(grace, reason)
        subprocess.run(self.ENGINE["cli"] + ["rm", "-f", self.cname], capture_output=True)

    def run_handler(self, handler: dict, timeout: float) -> bool:
        if "exec" not in handler:
            return super().run_handler(handler, timeout)
        rw = self._rewriter()
        argv = [*self.ENGINE["cli"], "exec", self.cname, *[rw(a) for a in handler["exec"]["command"]]]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=max(1.0, timeout) + 5,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0

    def inspect(self) -> dict:
        done = subprocess.run(self.ENGINE["cli"] + ["inspect", self.cname], capture_output=True, text=True)
        return json.loads(done.stdout)[0] if done.returncode == 0 else {}


def kill_hard(container: ContainerRun) -> None:
    """SIGKILL to the container's first process: what an OOM kill or a crash does."""
    container.signal(signal.SIGKILL)
