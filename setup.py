"""Packaging for llmstream: the `jobs` and `udfs` packages (without `jobs/dev/`) and the `llmstream` command."""
from setuptools import find_packages, setup

setup(
    name="llmstream",
    version="0.1.0",
    description="PyFlink job: LLM inference over Kafka with bounded concurrency and exactly-once output",
    python_requires=">=3.11,<3.12",
    # The development tools (jobs/dev/: simulator, bench, local services) are not part of the product:
    # they run from a checkout (`pip install -e .`), never from the wheel.
    packages=find_packages(include=["jobs", "jobs.*", "udfs", "udfs.*"], exclude=["jobs.dev", "jobs.dev.*"]),
    package_data={"jobs": ["*.yaml", "examples/*.yaml", "data/*.jsonl"]},
    install_requires=[
        "apache-flink==2.3.0",
        "kafka-python==3.0.12",
        "requests>=2.32,<3",
        "pyyaml>=6,<7",
        # The inference hot path: measured ~8x faster than requests on a thread pool
        # (see docs/performance.md). requests stays for admin and REST calls.
        "aiohttp>=3.10,<4",
        # JSON of the model calls and the output records: a fifth of a call's Python CPU with
        # the standard library (udfs/records/fastjson.py falls back to it where orjson refuses).
        "orjson>=3.10,<4",
        "psutil>=5.9",
        # `llmstream status`: tables, live refresh and the SVG capture in docs/observe.md.
        "rich>=13,<16",
        # The result cache's shared backend (Redis/Valkey), asyncio client; imported only then.
        "redis>=5,<6",
        # Structured output: every answer validated against model.response_format (a JSON Schema).
        "jsonschema>=4.18,<5",
        # State on S3 (jobs/state/storage.py): snapshots found, run records and the run lease kept
        # before and without a JVM, fed the same s3.* settings as Flink's own S3 file system.
        "boto3>=1.34,<2",
    ],
    extras_require={
        # confluent-kafka: the Avro integration test's producer and consumer (AvroSerializer /
        # AvroDeserializer), a second implementation of the wire format; the job itself uses fastavro,
        # which apache-flink already brings.
        "dev": ["pytest>=8", "pytest-xdist>=3.6", "py-spy>=0.3", "ruff>=0.6", "mypy>=1.10", "matplotlib>=3.8", "types-requests", "types-PyYAML", "openai>=3,<4", "anthropic>=2,<3", "hypothesis>=6.100,<7",
                "confluent-kafka[avro,schemaregistry]>=2.16,<3"],
    },
    entry_points={"console_scripts": ["llmstream=jobs.cli:main"]},
)
