# The e2e's stand-in for the chart's redis image (docker.io/library/redis, which no registry here can
# serve): Debian's redis-server and redis-cli on the same base as pagedserve's images. Run with the
# chart's own command, user (999:1000) and probes.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends redis-server && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
