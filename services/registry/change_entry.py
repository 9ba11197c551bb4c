"""One entry of the registry's change stream ({ns}{records}changes, services.registry.keys), written by the
scheduler's sink and read by routers: which replica's record was written or removed, and, when only its
load moved, that load, signed, so a router applies it without reading and parsing the whole record.

The load is bound to the replica and its index generation by the HMAC, so a signed load cannot be replayed
onto another replica or a later generation; a router that cannot use an entry's load reads the record.
"""

from __future__ import annotations

from services.registry.model import ReplicaLoad, Signer


def entry_fields(replica_id: str, load: tuple[int, ReplicaLoad] | None, signer: Signer | None) -> dict[str, str]:
    """The entry for a write or removal of the replica's record; `load`: (generation, load) when the record's
    info is unchanged since the writer's previous write."""
    fields = {"r": replica_id}
    if load is not None:
        gen, compact = load[0], load[1].to_compact()
        fields.update(l=compact, g=str(gen))
        if signer is not None:
            fields["s"] = signer.sign(load_payload(replica_id, gen, compact))
    return fields


def entry_replica(fields: dict) -> str | None:
    return field(fields, "r") or None


def carries_load(fields: dict) -> bool:
    return b"l" in fields or "l" in fields


def entry_load(fields: dict, replica_id: str, generation: int, signer: Signer | None) -> ReplicaLoad | None:
    """The load the entry carries for the replica's record of `generation`, or None when it carries none,
    names another generation, does not verify against `signer`, or does not parse."""
    compact = field(fields, "l")
    if compact is None or field(fields, "g") != str(generation):
        return None
    if signer is not None and not signer.verify(load_payload(replica_id, generation, compact), field(fields, "s")):
        return None
    try:
        return ReplicaLoad.from_compact(compact)
    except ValueError:
        return None


def field(fields: dict, name: str) -> str | None:
    """An entry's field (the client may or may not decode replies), None when absent. Bytes that are not
    UTF-8 (no writer of ours puts them there) are replaced, not raised: an entry that raised would stop the
    router's refresh at it for good."""
    v = fields.get(name.encode())
    if v is None:
        v = fields.get(name)
    if v is None:
        return None
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def load_payload(replica_id: str, generation: int, compact: str) -> bytes:
    """What a load in an entry is signed over: the replica and generation it belongs to, and the load."""
    return f"{replica_id}\n{generation}\n{compact}".encode()
