# Squall's build. Every target installs what it needs itself, so a fresh clone
# needs only `make run` or `make test` (and Python 3.11 or later: `make PYTHON=python3.12`
# picks another interpreter). scripts/venv.sh checks the interpreter, rebuilds a .venv a
# failed attempt left half-made, and writes a stamp only once every step succeeded.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
# Everything (tests, lint, Spark, plots) vs. only what running a cluster needs (`make run`).
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
SEEDS ?= 5000
PYTEST_ARGS ?=
# `make chaos`: the fault schedule's seed, seconds of faults and load, cluster size (3 or 5),
# the cluster's durability.acks.
SEED ?= 1
DURATION ?= 60
NODES ?= 3
ACKS ?= majority
# Passed to `python -m bench.suite` by `make bench`, e.g. BENCH_ARGS="--repeats 5".
BENCH_ARGS ?=

.PHONY: install install-run run stop test unit integration sim fuzz bench protos protos-check lint clean \
	test-spark pipeline-demo chaos protos-release node-deps browser-deps dist bytecode

install: $(STAMP)

# The full install also satisfies `make run`, so it writes both stamps.
$(STAMP): pyproject.toml clients/pyproject.toml setup.py constraints.txt scripts/venv.sh
	@bash scripts/venv.sh '$(PYTHON)' $(VENV) dev,spark $(STAMP) $(RUN_STAMP)

install-run: $(RUN_STAMP)

$(RUN_STAMP): pyproject.toml clients/pyproject.toml setup.py constraints.txt scripts/venv.sh
	@bash scripts/venv.sh '$(PYTHON)' $(VENV) '' $(RUN_STAMP)

protos: install
	$(PY) scripts/gen_protos.py

# Also: the public protos compile alone and break nothing against the last release's
# descriptors (protos/released/); a release rewrites those with `make protos-release`.
protos-check: install
	$(PY) scripts/gen_protos.py --check
	$(PY) scripts/public_protos.py check

protos-release: install
	$(PY) scripts/public_protos.py snapshot

# The Node client test's packages (tests/integration/test_node_client.py), installed once
# into clients/node/node_modules from its lockfile; skipped where npm is missing (the test
# then skips with one line).
NODE_STAMP := clients/node/node_modules/.installed
node-deps: $(NODE_STAMP)

$(NODE_STAMP): clients/node/package.json clients/node/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
		cd clients/node && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.installed; \
	else \
		echo "make: npm not found: the Node client test will skip (install Node.js 18+)"; \
	fi

# The console's browser test (tests/integration/test_console.py) drives headless Chromium.
# Installed from Debian's packages where it is missing, only as root with apt-get (a
# developer's own machine is left alone); without it the test skips with one line.
browser-deps:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "make: installing chromium for the console's browser test (apt-get)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
			>/dev/null) || echo "make: chromium did not install: the console's browser test will skip"; \
	else \
		echo "make: chromium not found: the console's browser test will skip (apt-get install chromium)"; \
	fi

# Bytecode written ahead for our own modules and for every package the server and the
# client need to run (scripts/bytecode.py). Where the shell sets PYTHONDONTWRITEBYTECODE
# (this project's CI machines do), every service process would otherwise compile every
# module it imports again at start-up (a replica: 0.77 s of CPU against 0.47 s with
# bytecode; a three-node cluster and its gateway took 3.3 s to start against 2.35 s),
# paid by every cluster a test or `make run` starts. Incremental (1.3 s when nothing
# changed), and safe: a stale file is compiled again on import. Silent unless a file does
# not compile (then it names the file and line, and the target fails).
bytecode: install-run
	@$(PY) scripts/bytecode.py

LINT_PATHS := services clients tests scripts deploy bench examples chaos
LINT_STEPS := '$(BIN)/ruff check $(LINT_PATHS)' '$(BIN)/ruff format --check $(LINT_PATHS)' \
	'$(BIN)/mypy squall_server clients/squall deploy scripts bench chaos'

lint: install
	@for step in $(LINT_STEPS); do echo "$$step"; $$step || exit 1; done

# The unit tests run on two workers, a file per worker at a time. Then the tests that start
# real processes run one at a time, as their failover bounds assume, and beside them, at
# the lowest CPU priority (nice 19), the simulators' seeds on two workers
# (scripts/test_suites.sh: the real-process tests leave a core idle while they wait; the
# simulators run on virtual time), and the lint (ruff, mypy; it only computes). Each chunk
# of 25 whole-node seeds (400 in all, COORD_SEEDS=N for another count) or 20 shell seeds
# is a unit any worker takes (tests/xdist_units.py); a failing chunk lists each failing
# seed with its replay command (SEED=S ...). With PYTEST_ARGS, the lint, then one run of
# what they select.
test: install protos-check node-deps browser-deps bytecode $(if $(strip $(PYTEST_ARGS)),lint)
ifeq ($(strip $(PYTEST_ARGS)),)
	@bash scripts/test_suites.sh $(BIN) $(LINT_STEPS)
else
	$(BIN)/pytest -q -p no:cacheprovider --durations=25 $(PYTEST_ARGS)
endif

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

run: install-run bytecode
	$(PY) -m deploy.launcher start --config deploy/cluster.example.toml --demo $(if $(TLS),--tls)

stop: install-run
	$(PY) -m deploy.launcher stop

# The example streaming pipeline (examples/spark_pipeline.py) against the local cluster:
# the one `make run` started, or the same cluster started for the demo and stopped after.
pipeline-demo: install
	$(PY) examples/spark_pipeline.py --demo

# The benchmark report (bench/results/<UTC stamp>/report.{json,md} + PNGs, ~20 minutes on
# 2 cores: ~9 for the throughput, latency and failover figures, ~10 for the fault gaps);
# the single-node figures alone: $(PY) -m bench.run (bench/README.md).
# The report, then what a topic link costs (two one-node clusters; its figures print).
bench: install bytecode
	$(PY) -m bench.suite $(BENCH_ARGS)
	$(PY) -m bench.links

# One chaos run (docs/chaos.md): real processes in network namespaces (needs root for
# partitions), a recorded workload, seeded faults, then the history checker.
chaos: install bytecode
	$(PY) -m chaos run --seed $(SEED) --duration $(DURATION) --nodes $(NODES) --acks $(ACKS)

# The two wheels, into dist/: the client `squall` (clients/pyproject.toml) and the server
# `squall-server` (pyproject.toml, imported as squall_server). Built offline from a copy of
# the tree; install a server with `pip install -c constraints.txt dist/*.whl`.
dist: install
	$(PY) scripts/build_dists.py dist

clean:
	rm -rf $(VENV) .run build dist *.egg-info clients/build clients/*.egg-info
