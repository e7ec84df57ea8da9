"""The keyed inference stage Flink runs: admission, calls in flight, per-key order and the operator itself."""
