"""What the test modules share, in one place: no test module imports another.

- ``waiting``: ``wait_until`` (and its asyncio twin), the one deadline loop of the tests;
- ``configs``: job configs and requests for the inference client alone (no broker is dialled);
- ``calls``: running a test coroutine with a guard, one call of the client, one expected failure;
- ``fakes``: the PyFlink metric group the metrics register on;
- ``servers``: in-process model servers: the simulator in a thread (fixtures ``make_sim`` and
  ``sim``) and any aiohttp app on a free loopback port (``serve_app``);
- ``fake_flink``: PyFlink's keyed state, timers and runtime context, and a `Harness` that drives
  one inference stage (no JVM);
- ``stages``: the ``harnesses`` fixture (inference stages on ``fake_flink``);
- ``schema_store``: the Schema Registry as the Avro format sees it (``SchemaStore``), no server;
- ``tls_certs``: throwaway certificates made with the ``openssl`` CLI;
- ``redis_server``: a real ``redis-server`` on a free loopback port, for the cache tests;
- ``prometheus``: reading what a Prometheus endpoint serves;
- ``job_setup``: jobs on their own uuid topics (``make_job``, ``write_config``) and their records;
- ``cluster``: the shared standalone cluster healed between tests, checkpoints awaited;
- ``committed``: what a read_committed consumer sees (``CommittedReader``) and the exactly-once tally;
- ``fault_report``: the fault tests' numbers in ``var/fault-report.md`` / ``.json``;
- ``runs``: scenarios on the standalone cluster (records in, a job submitted, a committed reader),
  and ``LocalRun``, ``llmstream run`` as a user starts and stops it;
- ``release_build``: an earlier release of llmstream (the Flink 2.2.1 build) in a venv of its own,
  for the tests of upgrades across Flink versions;
- ``reasons``: the dead-letter reasons docs/record-contract.md documents;
- ``bench_runs``: finished bench runs made by hand, for the tests of the bench's report;
- ``secured``: the names of a job on the secured broker (the ``secured`` fixture makes them) and the
  hunt for canary secrets in what a run left behind.

Modules with fixtures are plugins, listed in ``pytest_plugins`` in ``tests/conftest.py``; the others
are imported. Support lives nowhere else under ``tests/`` (``tests/unit/test_test_layout.py``).
"""
