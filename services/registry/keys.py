"""Redis key layout of the registry, shared by the schedulers that write it and the routers that read it.

    {ns}replicas            SET of replica ids ever registered (stale ids are pruned by readers)
    {ns}replica:{id}        JSON ReplicaState (identity + load + index generation), expires unless heartbeated
    {ns}{records}changes    STREAM of replica ids whose record was written or removed (field "r"), trimmed
                            to about CHANGES_MAXLEN entries: routers read only the records that changed.
                            A write that changed only the load also carries it (field "l",
                            ReplicaLoad.to_compact; "g" the generation; "s" its HMAC): routers apply it
                            without reading the record
    {ns}tokenizer:{digest}  a model's tokenizer bundle (services.model_files.tokenizer), named by the SHA-256 in its
                            replicas' signed records; expires unless a replica of it heartbeats
    {ns}blk:{<hash>}        ZSET generation -> expiry (ms): the replicas holding one block, for the chain
                            positions the index files (services.registry.index_grid). A stored block
                            scores +inf; a claim (a router just sent the prompt there) scores its expiry

The prefix index is inverted (block -> holders), so a routing decision reads a few keys of its own prompt,
never one key per replica. Every command touches one key, and a block's key carries its hash in a hash tag,
so the layout is legal on Redis Cluster (no CROSSSLOT) and block writes spread over the shards.
A replica files its blocks under a generation (a random id it takes at each full resync, published in its
signed record): entries of dead replicas and of superseded generations are ignored by readers, so their
removal costs no decision anything.
"""

from __future__ import annotations

DEFAULT_NAMESPACE = "pagedserve:"
STORED = "+inf"  # the score of a stored block: a claim (finite expiry) never overrides it (ZADD GT)
CHANGES_MAXLEN = 50_000  # a router further behind than this reads every record again


def replicas_key(ns: str) -> str:
    return ns + "replicas"


def replica_key(ns: str, replica_id: str) -> str:
    return ns + "replica:" + replica_id


def block_key(ns: str, block_hash: int) -> str:
    return f"{ns}blk:{{{block_hash}}}"


def tokenizer_key(ns: str, digest: str) -> str:
    return ns + "tokenizer:" + digest


def changes_key(ns: str) -> str:
    return ns + "{records}changes"
