# Developer entry points. `make test` works on a fresh clone with only Python and apt-get.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint typecheck unit mps packages slurm prometheus torch engine native demo bench clean

test: lint typecheck unit

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

mps:
	scripts/get-mps-control.sh

# Debian packages the integration tests drive for real (zsh, fish, podman, runc, busybox-static);
# installed only as root.
packages:
	scripts/get-test-packages.sh

# A real single-node Slurm (slurmctld, slurmd, munge) for tests/cluster/test_slurm_*.py, from the
# distribution's packages (root, apt-get). Without it those tests skip and say why.
slurm:
	@scripts/get-slurm.sh || echo "make: no Slurm: the Slurm tests will skip (see above)"

# A real Prometheus server and promtool from the distribution's packages (root, apt-get) for
# tests/test_prometheus_real.py and the alerting rules' checks; without them those tests skip.
prometheus:
	@scripts/get-prometheus.sh || echo "make: no Prometheus: the real-Prometheus tests will skip (see above)"

# Debian's python3-torch (a CPU build; root, apt-get) for tests/daemon/test_e2e_torch_restart.py,
# which runs examples/train_checkpoint.py as an offline client gpushare restarts; else it skips.
torch:
	@scripts/get-torch.sh || echo "make: no python3-torch: the PyTorch restart test will skip (see above)"

# The simulator's GPU model (gpushare.sim.engine.COMPILED) compiled with mypyc as one group
# (optional, ~6x faster, identical results).
engine: $(STAMP)
	scripts/build-sim-engine.sh $(BIN)/python

# The shallow-queue interposer (gpushare.native, an LD_PRELOAD library) from C; without a C
# compiler this says why and the native tests skip.
native:
	scripts/build-native.sh

lint: $(STAMP)
	$(BIN)/ruff check gpushare tests bench scripts examples
	$(BIN)/ruff format --check gpushare tests bench scripts examples

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP) mps packages slurm prometheus torch engine native
	$(BIN)/pytest -q

# The real daemon on one simulated GPU, driven by the real CLI (scripts/demo.sh); ~90 s. With the
# real MPS control binary when it can be had; without it MPS is simulated too.
demo: $(STAMP) engine native
	@scripts/get-mps-control.sh || echo "make demo: no MPS control binary; MPS will be simulated"
	BIN=$(BIN) scripts/demo.sh

# bench/docs_tables.py last: it rewrites docs/benchmarks.md's tables from the JSON the others wrote.
bench: $(STAMP) mps engine
	@for b in $(filter-out bench/docs_tables.py,$(wildcard bench/*.py)); do \
		echo "== $$b"; $(BIN)/python $$b || exit 1; done
	$(BIN)/python bench/docs_tables.py

clean:
	rm -rf $(VENV) .cache .mypy_cache .pytest_cache .ruff_cache gpushare/sim/_native gpushare/native/libgpushare_inflight.so
