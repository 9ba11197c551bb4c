# The GPU engine path's device check (services/bench/gpu_check.py): one run on one GPU, under ten minutes,
# random weights in Llama-3.2-1B and Llama-3.1-8B shapes (no network). On a machine without a GPU:
#   make gpu-check GPU_CHECK_ARGS="--device cpu --dry-run"
# One engine split over N GPUs of one machine (tensor parallelism; needs N GPUs):
#   make gpu-check GPU_CHECK_ARGS="--tensor-parallel-size 2"
.PHONY: gpu-check

GPU_CHECK_ARGS ?=

gpu-check: install
	$(PY) -m services.bench.gpu_check $(GPU_CHECK_ARGS)
