# `make demo`: set up and run the main job on the demo dataset. `make test`: set up and run the tests:
# the whole suite on the newest supported Ray, then a subset on the oldest (test-oldest-ray).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONFIG ?= configs/demo.toml

# The oldest Ray pyproject.toml accepts, in an environment of its own, with only what differs between
# Ray versions: the optional internals and the elastic refusal, the workers' own cluster and State API
# (tests/test_runtime.py), the fit's Ray tasks and Ray Data, Ray
# Train's DataConfig for a user's datasets, and the built-in job through `ray job submit` on a real head
# (Ray Train without Result.return_value, the job server's statuses and logs).
OLDEST_RAY   ?= 2.52.1
OLDEST_VENV  ?= .venv-ray-$(OLDEST_RAY)
OLDEST_TESTS ?= tests/test_ray_versions.py tests/test_runtime.py tests/test_jobs.py \
	tests/test_integration.py::test_distributed_fit_equals_single_process_fit \
	tests/test_distribution.py::test_users_own_datasets_are_kept_and_split_beside_the_plan
# Two test processes (pytest-xdist): most tests wait on Ray, so two share this 2-core machine's CPUs well.
# Each test module runs whole in one process, the longest first (tests/conftest.py).
TEST_PROCS   ?= 2
XDIST        := -n $(TEST_PROCS) --dist loadscope --no-loadscope-reorder
PIP_INSTALL  := pip install -q --disable-pip-version-check

.PHONY: setup demo test test-quick test-oldest-ray bench k8s clean

# The image and the KubeRay manifests for one Ray version: `make k8s RAY_VERSION=2.55.0`.
RAY_VERSION ?= $(shell sed -n 's/^ARG RAY_VERSION=//p' k8s/Dockerfile)
k8s:
	$(PYTHON) k8s/render.py --ray-version $(RAY_VERSION) --out build/k8s
	docker build -f k8s/Dockerfile --build-arg RAY_VERSION=$(RAY_VERSION) -t parquet-ray-pipeline:$(RAY_VERSION)-gpu .

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/$(PIP_INSTALL) -r requirements-dev.txt
	touch $@

demo: setup
	$(BIN)/python -m pipeline generate --config $(CONFIG)
	$(BIN)/python -m pipeline train --config $(CONFIG)

test: setup
	$(BIN)/python -m pytest -q $(XDIST) --durations=15
	$(MAKE) test-oldest-ray

# The inner loop: every test that needs neither Ray nor a whole job (`make test` is what CI runs).
test-quick: setup
	$(BIN)/python -m pytest -q $(XDIST) --quick

# Only Ray (and whatever of its pins the main environment does not meet) is installed here: every other
# package comes from the main environment (a .pth file puts its site-packages after this one's), so the
# oldest Ray is tried with the same torch, pyarrow and pytest, and the environment builds in seconds.
$(OLDEST_VENV)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(OLDEST_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_main_env.pth"
	$(OLDEST_VENV)/bin/$(PIP_INSTALL) "ray[data,train,default]==$(OLDEST_RAY)" -e .
	touch $@

test-oldest-ray: $(OLDEST_VENV)/.installed
	$(OLDEST_VENV)/bin/python -c "import ray; assert ray.__version__ == '$(OLDEST_RAY)', ray.__version__; print('Ray', ray.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -q $(XDIST) -p no:cacheprovider $(OLDEST_TESTS)

bench: setup
	$(BIN)/python -m pipeline bench  # writes runs/bench-loader/bench-loader.json and .png

clean:
	rm -rf runs data/demo .pytest_cache .venv-ray-*
