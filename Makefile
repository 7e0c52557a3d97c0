# `make demo`: set up and run the main job on the demo dataset. `make test`: set up and run the tests:
# the whole suite on the newest supported Ray, then a subset on the oldest (test-oldest-ray).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/demo.toml

# The oldest Ray pyproject.toml accepts, in an environment of its own, with a meaningful subset: the
# public API on a local Ray, the built-in job, and `ray job submit` against a real head.
OLDEST_RAY   ?= 2.52.1
OLDEST_VENV  ?= .venv-ray-$(OLDEST_RAY)
OLDEST_TESTS ?= tests/test_ray_versions.py tests/test_integration.py tests/test_jobs.py
# left out there (the full suite runs them on the newest Ray; they take the same code paths as those kept)
OLDEST_SKIP  ?= time_line or memory_mapped or multiclass or regression

.PHONY: setup demo test test-quick test-oldest-ray bench k8s clean

# The image and the KubeRay manifests for one Ray version: `make k8s RAY_VERSION=2.55.0`.
RAY_VERSION ?= $(shell sed -n 's/^ARG RAY_VERSION=//p' k8s/Dockerfile)
k8s:
	$(PYTHON) k8s/render.py --ray-version $(RAY_VERSION) --out build/k8s
	docker build -f k8s/Dockerfile --build-arg RAY_VERSION=$(RAY_VERSION) -t parquet-ray-pipeline:$(RAY_VERSION)-gpu .

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-dev.txt
	touch $@

demo: setup
	$(BIN)/python -m pipeline generate --config $(CONFIG)
	$(BIN)/python -m pipeline train --config $(CONFIG)

test: setup
	$(BIN)/python -m pytest -q --durations=15
	$(MAKE) test-oldest-ray

# The inner loop: every test that needs neither Ray nor a whole job (`make test` is what CI runs).
test-quick: setup
	$(BIN)/python -m pytest -q --quick

$(OLDEST_VENV)/.installed: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/pip install -q --disable-pip-version-check torch==2.13.0 "ray[data,train,default]==$(OLDEST_RAY)" \
		-e . "pytest>=8" "psutil>=5.9" "pyyaml>=6" "jsonschema>=4.20"
	touch $@

test-oldest-ray: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -c "import ray; assert ray.__version__ == '$(OLDEST_RAY)', ray.__version__; print('Ray', ray.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -q -p no:cacheprovider $(OLDEST_TESTS) -k "not ($(OLDEST_SKIP))"

bench: setup
	$(BIN)/python -m pipeline bench --out bench.json --plot bench.png

clean:
	rm -rf runs data/demo .pytest_cache .venv-ray-*
