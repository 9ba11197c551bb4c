"""`pagedserve engine-worker`: one tensor-parallel rank other than 0 (services/engine/tp_worker.py).

Rank 0's `pagedserve engine` starts the ranks of its own machine itself; this command is run by hand
(or by a LeaderWorkerSet's worker pods) only on the other machines of a group that spans machines.
"""

from __future__ import annotations

from services.engine.config import EngineConfig


def run(args) -> int:
    from services.engine.tp_worker import run_worker

    try:
        config = EngineConfig.from_args(args)
    except ValueError as exc:
        raise SystemExit(f"pagedserve engine-worker: {exc}") from None
    return run_worker(config, args.tp_node_rank, args.tp_local_rank)
