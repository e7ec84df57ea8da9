"""Clients of the systems a job talks to from outside Flink: Kafka admin, Flink's REST API and CLI."""
