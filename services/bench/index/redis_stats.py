"""Redis's own accounting for `bench index`: command microseconds and calls (INFO commandstats) and memory,
summed over every node of a cluster, the INFO calls the benchmark makes left out."""

from __future__ import annotations


async def redis_stats(client) -> tuple[float, int]:
    """(command usec, used_memory bytes) summed over every node (one, or every cluster primary); the
    INFO calls this benchmark makes are left out."""
    usec = sum(u for _, u in (await command_stats(client)).values())
    if is_cluster(client):
        from redis.asyncio.cluster import RedisCluster

        mem = list((await client.info("memory", target_nodes=RedisCluster.PRIMARIES)).values())
    else:
        mem = [await client.info("memory")]
    return usec, sum(int(m.get("used_memory", 0)) for m in mem)


async def _node_commandstats(client) -> dict[str, dict]:
    if is_cluster(client):
        from redis.asyncio.cluster import RedisCluster

        return await client.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
    return {"one": await client.info("commandstats")}


async def node_usec(client) -> dict[str, float]:
    """Node -> command usec so far (INFO left out)."""
    return {name: sum(float(v.get("usec", 0)) for k, v in node.items()
                      if k.startswith("cmdstat_") and k != "cmdstat_info")
            for name, node in (await _node_commandstats(client)).items()}


async def command_stats(client) -> dict[str, tuple[int, float]]:
    """Command name -> (calls, usec) summed over every node, INFO left out."""
    out: dict[str, tuple[int, float]] = {}
    for node in (await _node_commandstats(client)).values():
        for k, v in node.items():
            if k.startswith("cmdstat_") and k != "cmdstat_info":
                calls, usec = out.get(k[8:], (0, 0.0))
                out[k[8:]] = (calls + int(v.get("calls", 0)), usec + float(v.get("usec", 0)))
    return out


def plus(a: dict[str, tuple[int, float]], b: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
    return {k: (a.get(k, (0, 0.0))[0] + b.get(k, (0, 0.0))[0], a.get(k, (0, 0.0))[1] + b.get(k, (0, 0.0))[1])
            for k in a.keys() | b.keys()}


def minus(a: dict[str, tuple[int, float]], b: dict[str, tuple[int, float]]) -> dict[str, tuple[int, float]]:
    return {k: (c - b.get(k, (0, 0.0))[0], u - b.get(k, (0, 0.0))[1]) for k, (c, u) in a.items()}


def is_cluster(client) -> bool:
    return type(client).__name__ == "RedisCluster"
