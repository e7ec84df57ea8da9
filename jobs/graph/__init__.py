"""The job graph: Kafka source, the gate, the keyed inference stage and the exactly-once sink, from config."""
