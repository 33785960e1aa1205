# Squall's build. Every target installs what it needs itself, so a fresh clone
# needs only `make run` or `make test`.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
SEEDS ?= 5000
PYTEST_ARGS ?=
# `make chaos`: the fault schedule's seed, seconds of faults and load, cluster size (3 or 5).
SEED ?= 1
DURATION ?= 60
NODES ?= 3
# Passed to `python -m bench.suite` by `make bench`, e.g. BENCH_ARGS="--repeats 5".
BENCH_ARGS ?=

.PHONY: install run stop test unit integration sim fuzz bench protos protos-check lint clean \
	test-spark pipeline-demo chaos

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,spark]'
	@test -f clients/squall/v1/broker_pb2.py || $(PY) scripts/gen_protos.py
	@touch $(STAMP)

protos: install
	$(PY) scripts/gen_protos.py

protos-check: install
	$(PY) scripts/gen_protos.py --check

lint: install
	$(BIN)/ruff check services clients tests scripts deploy bench examples chaos
	$(BIN)/mypy services clients/squall deploy scripts bench chaos

test: install protos-check lint
	$(BIN)/pytest -q -p no:cacheprovider $(PYTEST_ARGS)

unit: install
	$(BIN)/pytest -q tests/unit $(PYTEST_ARGS)

integration: install
	$(BIN)/pytest -q -m integration $(PYTEST_ARGS)

# The PySpark data source's tests alone (one SparkSession, one local cluster; needs Java 17+).
test-spark: install
	$(BIN)/pytest -q -p no:cacheprovider -m spark $(PYTEST_ARGS)

sim: install
	$(BIN)/pytest -q tests/sim --sim-seeds=$(SEEDS) $(PYTEST_ARGS)

# Property-based fuzzing (docs/fuzzing.md): the quick derandomized "ci" profile by default;
# HYPOTHESIS_PROFILE=deep [FUZZ_EXAMPLES=N] for a long random search.
fuzz: install
	$(BIN)/pytest -q tests/fuzz $(PYTEST_ARGS)

run: install
	$(PY) -m deploy.launcher start --config deploy/cluster.example.toml --demo $(if $(TLS),--tls)

stop: install
	$(PY) -m deploy.launcher stop

# The example streaming pipeline (examples/spark_pipeline.py) against the local cluster:
# the one `make run` started, or the same cluster started for the demo and stopped after.
pipeline-demo: install
	$(PY) examples/spark_pipeline.py --demo

# The benchmark report (bench/results/<UTC stamp>/report.{json,md} + PNGs, ~10 minutes);
# the single-node figures alone: $(PY) -m bench.run (bench/README.md).
bench: install
	$(PY) -m bench.suite $(BENCH_ARGS)

# One chaos run (docs/chaos.md): real processes in network namespaces (needs root for
# partitions), a recorded workload, seeded faults, then the history checker.
chaos: install
	$(PY) -m chaos run --seed $(SEED) --duration $(DURATION) --nodes $(NODES)

clean:
	rm -rf $(VENV) .run build *.egg-info
