"""What the test modules share, in one place: no test module imports another.

- ``waiting``: ``wait_until`` (and its asyncio twin), the one deadline loop of the tests;
- ``configs``: job configs and requests for the inference client alone (no broker is dialled);
- ``calls``: running a test coroutine with a guard, one call of the client, one expected failure;
- ``fakes``: the PyFlink metric group the metrics register on;
- ``servers``: in-process model servers: the simulator in a thread (fixtures ``make_sim`` and
  ``sim``) and any aiohttp app on a free loopback port (``serve_app``);
- ``stages``: the ``harnesses`` fixture (inference stages on ``tests/unit/fake_flink.py``);
- ``prometheus``: reading what a Prometheus endpoint serves;
- ``runs``: scenarios on the standalone cluster (records in, a job submitted, a committed reader).

Modules with fixtures are plugins, listed in ``pytest_plugins`` in ``tests/conftest.py``; the others
are imported. The integration tests' record, tally and report helpers stay in
``tests/integration/helpers.py``.
"""
