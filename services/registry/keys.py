"""Redis key layout of the registry, shared by the schedulers that write it and the routers that read it.

    {ns}replicas           SET of replica ids ever registered (stale ids are pruned by readers)
    {ns}replica:{id}       JSON ReplicaState (identity + load), expires unless heartbeated
    {ns}blocks:{id}        SET of block hashes (decimal) the replica caches
    {ns}pending:{id}       ZSET block hash -> expiry (ms): blocks a router just sent there to be computed
"""

from __future__ import annotations

DEFAULT_NAMESPACE = "pagedserve:"


def replicas_key(ns: str) -> str:
    return ns + "replicas"


def replica_key(ns: str, replica_id: str) -> str:
    return ns + "replica:" + replica_id


def blocks_key(ns: str, replica_id: str) -> str:
    return ns + "blocks:" + replica_id


def pending_key(ns: str, replica_id: str) -> str:
    return ns + "pending:" + replica_id
