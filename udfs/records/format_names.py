"""The record formats by name: the one registration of each (`input.format`, `output.format`).

Apart from `udfs/records/formats.py` so that the config loader (`udfs/config`), which checks a
format's name, needs nothing that itself needs the config: the names are data, the classes are
imported only when a job uses them.
"""

from __future__ import annotations

FORMATS: dict[str, str] = {
    "json": "udfs.records.json_format:JsonFormat",
    "avro": "udfs.records.avro:AvroFormat",
}
"""Format names (`input.format`, `output.format`) and the class of each, as `module:Class`: imported
only when a job uses it, so checking a config needs neither fastavro nor a registry client."""
