"""Step protocol over real ZeroMQ sockets: round trips, engine errors, and engines that die or hang."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from services.commands.ports import free_port
from services.contracts.step_protocol import (
    EngineInfo,
    ModelRunnerOutput,
    SamplingSpec,
    ScheduledSequence,
    SchedulerOutput,
    TokenLogprobs,
)
from services.transport import EngineOpError, EngineServer, EngineUnavailableError, RemoteExecutor


class FakeRunner:
    """Stands in for the model runner: the transport must not care what computes the tokens."""

    info = EngineInfo(model_id="fake", block_size=4, num_kv_blocks=8, max_model_len=64, vocab_size=100,
                      dtype="float32", device="cpu", eos_token_ids=[0])

    def __init__(self, step_sleep: float = 0.0):
        self.step_sleep = step_sleep
        self.resets = 0

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self.step_sleep)
        if any(s.seq_id == "boom" for s in so.sequences):
            raise RuntimeError("kaboom")
        out = ModelRunnerOutput(step_id=so.step_id)
        for s in so.sequences:
            if s.sample:
                out.sampled[s.seq_id] = [sum(s.token_ids) % 100] * s.num_samples
                lp = TokenLogprobs(logprob=-0.5, top_ids=[1, 2], top_logprobs=[-0.5, -1.0])
                out.logprobs[s.seq_id] = [lp]
        return out

    def reset(self) -> None:
        self.resets += 1


def _step(seq_id: str = "a", tokens=(1, 2, 3)) -> SchedulerOutput:
    seq = ScheduledSequence(seq_id=seq_id, token_ids=list(tokens), start_pos=0, block_table=[0], sample=True,
                            sampling=SamplingSpec(temperature=0.0), num_samples=2)
    return SchedulerOutput(step_id=7, sequences=[seq], blocks_to_copy=[(1, 2)])


@pytest.fixture
def served():
    runner = FakeRunner()
    server = EngineServer(runner, "tcp://127.0.0.1:*")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    ex = RemoteExecutor(server.url, timeout=5.0)
    yield runner, server, ex
    ex.close()
    server.stop()
    thread.join(2)


def test_handshake_step_reset_health_round_trip(served):
    runner, server, ex = served
    info = ex.wait_ready(5.0)
    assert info == FakeRunner.info
    out = ex.execute(_step())
    assert out.step_id == 7 and out.sampled == {"a": [6, 6]}
    assert out.logprobs["a"][0].top_ids == [1, 2]
    before = server.instance
    # A reset zeroes the KV cache: to the scheduler it is a restart (its prefix cache is stale).
    with pytest.raises(EngineUnavailableError, match="restarted"):
        ex.reset()
    assert runner.resets == 1 and server.instance != before
    assert ex.health()
    ex.handshake()
    assert ex.instance == server.instance


def test_only_the_scheduler_that_handshook_may_step_or_reset(served):
    runner, server, owner = served
    owner.wait_ready(5.0)
    intruder = RemoteExecutor(server.url, timeout=5.0)
    try:
        deadline = time.monotonic() + 5
        while intruder.probe() is None:  # connecting
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert intruder.health() and intruder.probe() == server.instance  # health is open to anyone
        intruder._instance = server.instance  # even knowing the instance id does not make it the owner
        for call in (intruder.reset, lambda: intruder.execute(_step())):
            with pytest.raises(EngineUnavailableError, match="only the scheduler that handshook"):
                call()
        assert runner.resets == 0
        assert owner.execute(_step()).sampled == {"a": [6, 6]}
    finally:
        intruder.close()


def test_an_engine_with_a_token_serves_only_callers_that_present_it():
    from services.contracts.internal_auth import InternalToken

    token = InternalToken.generate()
    server = EngineServer(FakeRunner(), "tcp://127.0.0.1:*", token)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    good, bad = RemoteExecutor(server.url, timeout=5.0, token=token), RemoteExecutor(server.url, timeout=5.0)
    time.sleep(0.5)  # both connect
    try:
        with pytest.raises(EngineOpError, match="unauthorized"):
            bad.handshake()
        assert not bad.health()
        assert good.wait_ready(5.0) == FakeRunner.info and good.execute(_step()).sampled == {"a": [6, 6]}
    finally:
        good.close()
        bad.close()
        server.stop()
        thread.join(2)


def test_the_engine_refuses_to_listen_beyond_loopback_without_a_token():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "services.commands.cli", "engine", "--host", "0.0.0.0", "--port",
                           str(free_port())], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--internal-token-file" in done.stderr


def test_engine_side_error_is_an_exception_and_the_engine_keeps_serving(served):
    _, _, ex = served
    ex.wait_ready(5.0)
    with pytest.raises(EngineOpError, match="kaboom"):
        ex.execute(_step("boom"))
    assert ex.execute(_step()).sampled == {"a": [6, 6]}


def test_no_engine_listening_fails_fast():
    ex = RemoteExecutor(f"tcp://127.0.0.1:{free_port()}", timeout=30.0)
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailableError, match="not connected"):
        ex.execute(_step())
    assert time.monotonic() - t0 < 1.0
    assert not ex.health(timeout=0.3)
    ex.close()


def _serve_in_child(port: int, step_sleep: float) -> None:
    EngineServer(FakeRunner(step_sleep), f"tcp://127.0.0.1:{port}").serve_forever()


def _start_child(port: int, step_sleep: float):
    proc = multiprocessing.get_context("spawn").Process(target=_serve_in_child, args=(port, step_sleep),
                                                        daemon=True)
    proc.start()
    return proc


def _child_and_executor(step_sleep: float, timeout: float):
    port = free_port()
    proc = _start_child(port, step_sleep)
    ex = RemoteExecutor(f"tcp://127.0.0.1:{port}", timeout=timeout)
    ex.wait_ready(30.0)
    return port, proc, ex


def test_killed_engine_mid_step_is_noticed_at_once_and_restart_is_detected():
    port, proc, ex = _child_and_executor(step_sleep=3.0, timeout=60.0)
    try:
        first_instance = ex.instance
        threading.Timer(0.5, os.kill, args=(proc.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailableError):
            ex.execute(_step())
        assert time.monotonic() - t0 < 3.0, "a killed engine must not wait out the step timeout"
        proc.join(5)

        proc = _start_child(port, step_sleep=0.0)
        deadline = time.monotonic() + 30
        while not ex.health(timeout=0.5):
            assert time.monotonic() < deadline
        # Same address, new process: its KV cache is empty, so steps fail until the scheduler re-handshakes.
        with pytest.raises(EngineUnavailableError, match="restarted"):
            ex.execute(_step())
        ex.handshake()
        assert ex.instance != first_instance
        assert ex.execute(_step()).sampled == {"a": [6, 6]}
    finally:
        ex.close()
        proc.kill()
        proc.join(5)


def test_hung_engine_times_out():
    _, proc, ex = _child_and_executor(step_sleep=0.0, timeout=1.0)
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="did not answer"):
            ex.execute(_step())
        assert 0.9 < time.monotonic() - t0 < 3.0
        os.kill(proc.pid, signal.SIGCONT)
        # The late reply to the abandoned step is dropped; the next call gets its own answer.
        assert ex.execute(_step(tokens=(1,))).sampled == {"a": [1, 1]}
    finally:
        ex.close()
        proc.kill()
        proc.join(5)
