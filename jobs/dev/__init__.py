"""Development services: the model-server simulator, the local Kafka brokers (plain and secured),
the local Flink cluster, real model servers from PyPI, process helpers and the benchmarks.

The job itself (``jobs/`` above this package, ``udfs/``) never imports them (``tests/unit/test_layering.py``
keeps it so): the command line offers them (``llmstream kafka``, ``cluster``, ``model-server``,
``bench``, ``demo``) where this package is installed, and the local cluster records its address in
``var/flink/cluster.json`` (``jobs/clients/cluster_address.py``) for ``submit``/``stop``/``status`` to read.
"""
