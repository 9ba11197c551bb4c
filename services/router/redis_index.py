"""The router's view of the Redis registry: live replicas and their cached prefix, in one round trip.

A Lua script walks every registered replica server-side and returns its record and how many leading
blocks of the prompt it holds (cached, or claimed by a router in the last seconds), so a routing
decision costs one network round trip however many replicas there are. Scripts touch keys they do
not declare, which standalone Redis allows (Redis Cluster would not; the registry is one small node).
"""

from __future__ import annotations

import logging

from redis.asyncio import Redis

from services.registry import keys
from services.registry.model import ReplicaState, Signer, UntrustedRecord

log = logging.getLogger(__name__)

# Enough for a 64k-token prompt at block size 16; Lua's unpack() has a stack limit near 8000.
MAX_HASHES = 4096
CLAIM_TTL_MS = 10_000

_SNAPSHOT = """
local ns = ARGV[1]
local nh = #ARGV - 1
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', ns .. 'replicas')) do
  local rec = redis.call('GET', ns .. 'replica:' .. id)
  if rec then
    local n = 0
    if nh > 0 then
      local have = redis.call('SMISMEMBER', ns .. 'blocks:' .. id, unpack(ARGV, 2))
      local pend = nil
      for i = 1, nh do
        local ok = have[i] == 1
        if not ok then
          if pend == nil then pend = redis.call('ZMSCORE', ns .. 'pending:' .. id, unpack(ARGV, 2)) end
          ok = pend[i] and tonumber(pend[i]) > now
        end
        if not ok then break end
        n = i
      end
    end
    table.insert(out, id)
    table.insert(out, rec)
    table.insert(out, n)
  else
    redis.call('SREM', ns .. 'replicas', id)
  end
end
return out
"""

_CLAIM = """
local key = KEYS[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = now + tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
for i = 2, #ARGV do redis.call('ZADD', key, expiry, ARGV[i]) end
redis.call('PEXPIRE', key, tonumber(ARGV[1]))
return 1
"""


class RedisIndex:
    def __init__(self, client: Redis, namespace: str = keys.DEFAULT_NAMESPACE, signer: Signer | None = None):
        self.client = client
        self.ns = namespace
        self.signer = signer  # with the internal token, records it cannot verify are ignored
        self._warned: set[str] = set()
        self._snapshot = client.register_script(_SNAPSHOT)
        self._claim = client.register_script(_CLAIM)

    async def snapshot(self, block_hashes: list[int]) -> list[ReplicaState]:
        args = [self.ns, *(str(h) for h in block_hashes[:MAX_HASHES])]
        flat = await self._snapshot(keys=[], args=args)
        states = []
        for i in range(0, len(flat), 3):
            try:
                states.append(ReplicaState.from_json(flat[i + 1], int(flat[i + 2]), self.signer))
            except (UntrustedRecord, ValueError, KeyError, TypeError) as exc:
                rid = flat[i].decode(errors="replace") if isinstance(flat[i], bytes) else str(flat[i])
                if rid not in self._warned and len(self._warned) < 1024:  # a forger must not flood the log
                    self._warned.add(rid)
                    log.warning("ignoring registry record %r: %s", rid, exc)
        return states

    async def claim(self, replica_id: str, block_hashes: list[int]) -> None:
        if block_hashes:
            args = [CLAIM_TTL_MS, *(str(h) for h in block_hashes[:MAX_HASHES])]
            await self._claim(keys=[keys.pending_key(self.ns, replica_id)], args=args)
