"""The provider-batch lane (`lane: provider-batch`, docs/cost.md): the Flink function (`lane.py`), the
providers' batch APIs in one shape (`providers.py`) and what the lane keeps of a batch in Flink
state (`entries.py`)."""
