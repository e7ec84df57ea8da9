"""The Schema Registry as the Avro format sees it (`udfs/records/avro.py` calls `RegistryClient`), for
tests without a registry: schemas by id, registrations by subject, and a switch that makes it stop
answering (the real Apicurio is in tests/integration/test_avro.py)."""

from __future__ import annotations

from typing import Any

from udfs.records.registry import RegistryUnavailable, SchemaNotFound


class SchemaStore:
    """The registry as the format sees it: schemas by id, registrations by subject."""

    def __init__(self, schemas: dict[int, Any]) -> None:
        self.schemas = schemas
        self.subjects: dict[str, list[int]] = {}
        self.down = False

    def schema(self, schema_id: int) -> tuple[str, Any]:
        if self.down:
            raise RegistryUnavailable("schema_registry.url did not answer (schema id 1) after 3 attempt(s)")
        if schema_id not in self.schemas:
            raise SchemaNotFound(f"no schema id {schema_id}")
        return "AVRO", self.schemas[schema_id]

    def subject_exists(self, subject: str) -> bool:
        return subject in self.subjects

    def register(self, subject: str, schema: Any) -> int:
        schema_id = 100 + len(self.schemas)
        self.schemas[schema_id] = schema
        self.subjects.setdefault(subject, []).append(schema_id)
        return schema_id

    def set_compatibility(self, subject: str, level: str) -> None:
        assert level == "BACKWARD"

    def close(self) -> None:
        pass
