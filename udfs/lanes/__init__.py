"""The lanes: three ways to run the same record rules between the same Kafka ends.

- `base.py`: the one runtime (`LaneParts`: set-up, tear-down, metrics, emitting, dead letters, the
  never-raise guard; `KeyedLane`: the keyed-bucket skeleton with its hooks);
- `record_path.py`: what happens to one record, the same in every lane (decode, the user's
  functions, the call through the client, the output record or dead letter);
- a module per lane, each deciding only how records are grouped and when their calls are made:
  `keyed.py` (calls in flight in keyed state), `vectorized.py` (Arrow batches), `provider_batch/`
  (a provider's batch API);
- their helpers: `inflight.py` (the calls' event loop), `admission.py` (the admission gate's
  signal), `ordering.py` (per-key order), `user_functions.py` (the user's Python).

The old paths (`udfs.stage.*`, `udfs.provider_batch.*`) stay importable for what was pickled under
them (`udfs/stage/__init__.py`, `udfs/provider_batch/__init__.py`)."""
