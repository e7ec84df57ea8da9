# llmstream in one image: Java 17, Python 3.11, PyFlink 2.3.0 (its wheel is FLINK_HOME), the
# project, and the pom-free jars. The same image runs as Kafka broker, JobManager, TaskManager,
# model-server simulator and submitter (docker-compose.yml), and as the Flink image of the
# Kubernetes FlinkDeployment (flink-conf/kubernetes/). A job running on an image of another Flink
# (2.2.1) moves to this one through a savepoint: docs/operations.md, "Upgrading Flink under a running job".
#
#   docker build -t llmstream:local .                                    # from a public base
#   docker build --build-arg BASE_IMAGE=llmstream-base:bookworm ...      # the tests' local base
#
# BASE_IMAGE is any Debian bookworm or python:3.11-slim-bookworm image. The tests' base is made
# with debootstrap and `docker import` (jobs/dev/containers.py) and already carries Java and
# Python, so no apt step runs; with a public base, apt installs Java here.
# Optional inputs taken from the build context when present (both are made by
# jobs/dev/containers.py; a user's plain `docker build` fetches instead):
#   var/docker/wheels/   a wheelhouse of the project's dependencies: pip installs offline from it;
#   pom-free/cache/      the hash-checked jars: pom-free/fetch.py then needs no Maven.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

# Only what the base lacks (man1: openjdk's postinst links a man page that slim images drop).
RUN pkgs=""; \
    command -v java >/dev/null || pkgs="openjdk-17-jre-headless"; \
    command -v ps >/dev/null || pkgs="$pkgs procps"; \
    python3 -c 'import ensurepip' 2>/dev/null || pkgs="$pkgs python3-venv"; \
    if [ -n "$pkgs" ]; then \
      mkdir -p /usr/share/man/man1 \
      && apt-get update && apt-get install -y --no-install-recommends $pkgs \
      && rm -rf /var/lib/apt/lists/*; \
    fi

ENV LLMSTREAM_HOME=/llmstream \
    VIRTUAL_ENV=/opt/llmstream/venv \
    PATH=/opt/llmstream/venv/bin:/opt/llmstream/venv/lib/python3.11/site-packages/pyflink/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    FLINK_HOME=/opt/llmstream/venv/lib/python3.11/site-packages/pyflink \
    FLINK_CONF_DIR=/llmstream/flink-conf \
    FLINK_LIB_DIR=/opt/flink-lib \
    FLINK_LOG_DIR=/llmstream/var/flink/log \
    FLINK_PID_DIR=/tmp/flink-pid \
    FLINK_IDENT_STRING=llmstream \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# Dependencies first, from setup.py alone, so a source change does not reinstall PyFlink.
# `var/docker/wheel[s]` matches nothing when there is no wheelhouse; setup.py always matches.
COPY setup.py var/docker/wheel[s] /tmp/llmstream-build/
RUN python3 -m venv "$VIRTUAL_ENV" \
 && cd /tmp/llmstream-build \
 && if ls ./*.whl >/dev/null 2>&1; then offline="--no-index --find-links /tmp/llmstream-build"; else offline=""; fi \
 && pip install -q $offline setuptools wheel \
 && pip install -q --no-build-isolation $offline . \
 && pip uninstall -q -y llmstream \
 && rm -rf /tmp/llmstream-build

WORKDIR /llmstream
# The jars: no Maven call when pom-free/cache/ came with the context and its hashes match.
COPY pom-free/ ./pom-free/
RUN fetch() { for set in connector metrics broker s3; do python3 pom-free/fetch.py --set "$set" || return 1; done; }; \
    fetch || { apt-get update && apt-get install -y --no-install-recommends maven \
               && fetch && rm -rf /root/.m2 /var/lib/apt/lists/*; }
# flink-python and the Kafka connector (and the metrics reporter) on the cluster classpath, as
# jobs/dev/local_cluster.py's write_lib_dir does: loaded once, not again in every job's classloader.
RUN mkdir -p "$FLINK_LIB_DIR" \
 && ln -s "$FLINK_HOME"/lib/*.jar "$FLINK_HOME"/opt/flink-python-*.jar \
          /llmstream/pom-free/cache/connector/*.jar /llmstream/pom-free/cache/metrics/*.jar "$FLINK_LIB_DIR"/
# Flink's S3 file system, for state, savepoints and HA data on s3:// (docs/operations.md, "State on
# object storage"): Flink loads it only as a plugin, one folder of its own under $FLINK_HOME/plugins,
# as jobs/dev/local_cluster.py's write_plugins_dir does for the local cluster.
RUN mkdir -p "$FLINK_HOME"/plugins/s3-fs-hadoop \
 && ln -s /llmstream/pom-free/cache/s3/*.jar "$FLINK_HOME"/plugins/s3-fs-hadoop/

COPY setup.py ./
COPY flink-conf ./flink-conf
# All of jobs/: the job (jobs/inference_job.py on the cluster) and `llmstream submit` never import
# jobs/dev/ (tests/unit/test_layering.py), but the compose services that are not the job do: the
# broker (jobs.dev.containers), the model-server simulator and the demo producer (jobs.demo).
COPY jobs ./jobs
COPY udfs ./udfs
RUN pip install -q --no-deps --no-build-isolation --no-index -e . \
 && mkdir -p /llmstream/var/flink/log /llmstream/var/flink/state
