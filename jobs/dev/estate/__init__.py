"""The estate: llmstream's hosts as network namespaces on one Linux bridge of this machine.

A JobManager host, two TaskManager hosts, three broker hosts and a model-server host, each with its
own address on a private subnet (10.77.0.0/24), so the job's traffic crosses real interfaces and a
fault can cut one host off, partition two, or take a whole host down (`estate.Estate`). Needs root.

- `network`: the bridge, the namespaces, link-down and per-pair partitions;
- `services`: the brokers, the Flink daemons and the model server, each started inside its host;
- `estate`: `Estate`, all of it as one, with the faults as methods;
- `table`: the fault table (`llmstream estate fault --table`), each run judged by `jobs/dev/history.py`;
- `cli`: ``llmstream estate start|stop|status|fault``.
"""

from jobs.dev.estate.estate import HOSTS, Estate
from jobs.dev.estate.network import EstateError, unavailable

__all__ = ["HOSTS", "Estate", "EstateError", "unavailable"]
