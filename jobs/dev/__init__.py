"""Development services: the model-server simulator, the local Kafka broker, the local Flink
cluster, real model servers from PyPI, process helpers and the benchmarks.

The job itself (``jobs/`` above this package, ``udfs/``) never needs them on a cluster; the
command line offers them (``llmstream kafka``, ``cluster``, ``model-server``, ``bench``) and the
local defaults of ``llmstream run``/``submit`` (a free port, the local cluster) come from here.
"""
