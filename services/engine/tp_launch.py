"""Starting an engine: the whole model in this process, or rank 0 of a tensor-parallel group.

`start_runner(config)` is what every command and the offline API call. With tensor_parallel_size N it
checks that the model splits into N (a clear error naming the sizes that fit, before anything is
started), converts the model once, starts this machine's other ranks (services/engine/rank_processes.py)
and loads rank 0's shard; the returned ModelRunner is rank 0, which alone speaks the step protocol.

When the group goes down (a rank died, hung past the timeout, or a step failed mid-collective) the
engine process exits (`exit_on_failure`, the `pagedserve engine` service): its scheduler sees a dead
engine, fails what was in flight, and the supervisor (`up`, `serve`, the kubelet) restarts the whole
group. In-process (the offline LLM) the runner raises RankGroupError instead, an EngineUnavailableError.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch

from services.engine.config import EngineConfig
from services.engine.model_loader import model_spec, read_config
from services.engine.model_runner import ModelRunner, pick_device
from services.engine.parallel_state import RankGroup, RankPlace
from services.engine.rank_processes import LocalRanks, OwnShare, cpu_shares
from services.engine.tp_shard import TensorParallelConfigError, TensorParallelShard
from services.model_files.model_source import resolve_weights

log = logging.getLogger(__name__)

STOP_TIMEOUT = 30.0  # ranks told to shut down


def rank_device(device: str, local_rank: int, local_size: int) -> torch.device:
    """The device of local rank `local_rank` (on CUDA its own GPU, which becomes the current one)."""
    dev = pick_device(device)
    if dev.type != "cuda":
        return dev
    count = torch.cuda.device_count()
    if count < local_size:
        raise TensorParallelConfigError(f"{local_size} tensor-parallel ranks on this machine need {local_size} "
                                        f"GPUs; {count} visible")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def check_split(model_dir: Path, size: int) -> None:
    """Raise TensorParallelConfigError unless the model splits into `size` ranks."""
    TensorParallelShard.for_config(model_spec(read_config(model_dir)), size, 0)


def exit_process(reason: str) -> None:
    # The group's failure was logged with its reason; a service's engine never outlives its group.
    logging.shutdown()
    os._exit(1)


def start_runner(config: EngineConfig, *, exit_on_failure: bool = False, graph_capture=None) -> ModelRunner:
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, graph_capture=graph_capture)
    size, local = config.tensor_parallel_size, config.ranks_per_machine
    if local < size and not config.tp_rendezvous:
        raise TensorParallelConfigError("a group spanning machines (tp_local_ranks < tensor_parallel_size) needs "
                                        "tp_rendezvous tcp://<this machine's address>:<port>")
    # Converted (or its tokenizer extracted) once, here; every rank reads the directory, or the GGUF file
    # whose weights are kept quantized.
    model_dir, gguf = resolve_weights(config.model, config.quantization)
    check_split(model_dir, size)
    device = rank_device(config.device, 0, local)
    tmpdir, rendezvous = None, config.tp_rendezvous
    if rendezvous is None:  # one machine: a file only this user can reach, no listening port
        tmpdir = tempfile.mkdtemp(prefix="pagedserve-tp-")
        rendezvous = f"file://{tmpdir}/rendezvous"
    group = RankGroup(RankPlace(0, size, 0, local, rendezvous), device, config.tp_timeout)
    if tmpdir is not None:
        group.on_close(lambda: shutil.rmtree(tmpdir, ignore_errors=True))
        group.on_failure(lambda reason: shutil.rmtree(tmpdir, ignore_errors=True))
    shares = cpu_shares(local) if device.type == "cpu" else None
    own = OwnShare(shares[0] if shares else None)
    group.on_close(own.restore)
    flags = dataclasses.replace(config, model=str(gguf or model_dir), tp_rendezvous=rendezvous).as_flags()
    ranks = LocalRanks.start(flags, node_rank=0, first_rank=0, local_size=local, shares=shares)
    group.on_close(lambda: ranks.stop(STOP_TIMEOUT))
    group.on_failure(lambda reason: ranks.kill())
    if exit_on_failure:
        group.on_failure(exit_process)
    ranks.watch(group.fail)
    group.explain_failures_with(ranks.exited)
    log.info("tensor parallel: rank 0 of %d on %s, ranks %s started on this machine (rendezvous %s)", size,
             device, sorted(ranks.procs), rendezvous)
    try:
        runner = ModelRunner(config, graph_capture=graph_capture, group=group)
    except BaseException:
        ranks.kill()
        group.close()
        raise
    # An offline LLM dropped without close() still stops its ranks (and does at interpreter exit).
    weakref.finalize(runner, runner.sender.shutdown)
    return runner
