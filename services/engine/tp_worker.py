"""A tensor-parallel rank other than 0 (`pagedserve engine-worker`): its shard, its KV heads, and the
steps rank 0 broadcasts, until rank 0 says stop or the group goes down.

It opens no port and never sees the scheduler: each step arrives already validated and laid out
(services/engine/step_broadcast.py). The first rank of a machine other than rank 0's starts that
machine's other ranks. Any failure (rank 0 gone, a collective timed out, a step raised) ends the
process with a non-zero code, and its own child ranks with it: the group restarts as a whole.
"""

from __future__ import annotations

import logging
import os

import torch

from services.engine.config import EngineConfig, EngineConfigError
from services.engine.model_runner import ModelRunner
from services.engine.parallel_state import RankGroup, RankPlace
from services.engine.rank_processes import LocalRanks, OwnShare, cpu_shares
from services.engine.step_broadcast import Op, StepReceiver
from services.engine.tp_launch import STOP_TIMEOUT, rank_device

log = logging.getLogger(__name__)


def serve_steps(runner: ModelRunner) -> None:
    """Run what rank 0 sends until it sends SHUTDOWN (a LORA message carries adapter commands, not a step)."""
    group = runner.group
    receiver = StepReceiver(group, pin=runner.device.type == "cuda")
    served = 0
    with torch.inference_mode():
        while True:
            try:
                op, step = receiver.next()
                if op is Op.STEP:
                    runner.run_step(step)
                    group.wait_device(f"step {served + 1}")
                    served += 1
                elif op is Op.LORA:
                    runner.lora.receive(step)
                elif op is Op.RESET:
                    runner.reset()
                elif op is Op.SHUTDOWN:
                    log.info("tensor-parallel rank %d stopping after %d steps", group.rank, served)
                    return
            except Exception as exc:
                raise group.fail(f"after {served} steps: {type(exc).__name__}: {exc}") from exc


def run_worker(config: EngineConfig, node_rank: int, local_rank: int) -> int:
    size, local = config.tensor_parallel_size, config.ranks_per_machine
    try:
        rank = config.worker_rank(node_rank, local_rank)
    except EngineConfigError as exc:
        raise SystemExit(f"pagedserve engine-worker: {exc}") from None
    device = rank_device(config.device, local_rank, local)
    ranks = None
    if local_rank == 0:  # the first rank of another machine starts that machine's other ranks
        shares = cpu_shares(local) if device.type == "cpu" else None
        OwnShare(shares[0] if shares else None)
        ranks = LocalRanks.start(config.as_flags(), node_rank=node_rank, first_rank=rank, local_size=local,
                                 shares=shares)
    log.info("tensor-parallel rank %d of %d on %s: meeting rank 0 at %s", rank, size, device, config.tp_rendezvous)
    group = RankGroup(RankPlace(rank, size, local_rank, local, config.tp_rendezvous), device, config.tp_timeout)

    def die(reason: str) -> None:
        if ranks is not None:
            ranks.kill()
        logging.shutdown()
        os._exit(1)

    group.on_failure(die)
    if ranks is not None:
        ranks.watch(group.fail)
        group.explain_failures_with(ranks.exited)
    try:
        runner = ModelRunner(config, group=group)
    except Exception as exc:
        group.report_start_failure(f"{type(exc).__name__}: {exc}")
        raise
    serve_steps(runner)
    if ranks is not None:
        ranks.stop(STOP_TIMEOUT)
    return 0
