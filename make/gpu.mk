# The GPU engine path's device check (services/device_check/run.py): one run on one GPU, about 7 minutes on
# an H200, random weights in Llama-3.2-1B and Llama-3.1-8B shapes (no network). On a machine without a GPU:
#   make gpu-check GPU_CHECK_ARGS="--device cpu --dry-run"
# One engine split over N GPUs of one machine (tensor parallelism; needs N GPUs):
#   make gpu-check GPU_CHECK_ARGS="--tensor-parallel-size 2"
#
# On a lent machine with no network and its own python, torch and Triton (the device tool's H200):
#   here:  make gpu-bundle                      # the wheels the check needs beyond torch and Triton
#   there: make gpu-check-offline               # run with carry: [".gpu-bundle"]; no venv, no download
# PYTHON_VERSION is the device's Python (3.12); PYTHON the interpreter that runs the check (python3).
.PHONY: gpu-check gpu-bundle gpu-check-offline

GPU_CHECK_ARGS ?=
GPU_BUNDLE ?= .gpu-bundle
PYTHON_VERSION ?= 3.12

gpu-check: install
	$(PY) -m services.device_check.run $(GPU_CHECK_ARGS)

gpu-bundle:
	$(PYTHON) make/gpu_bundle.py download --dest $(GPU_BUNDLE) --python-version $(PYTHON_VERSION)

gpu-check-offline:
	@site=$$(mktemp -d /tmp/pagedserve-gpu-site.XXXXXX); \
	$(PYTHON) make/gpu_bundle.py install --wheels $(GPU_BUNDLE) --target $$site \
	&& PYTHONPATH=$(CURDIR):$$site PYTHONUNBUFFERED=1 $(PYTHON) -m services.device_check.run $(GPU_CHECK_ARGS); \
	rc=$$?; rm -rf $$site; exit $$rc
