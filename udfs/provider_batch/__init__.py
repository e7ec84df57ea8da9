"""The provider-batch lane's own pieces (`lane: provider-batch`, docs/cost.md): the providers' batch APIs
in one shape (`providers.py`) and what the lane keeps of a batch in Flink state (`entries.py`).
The Flink function that drives them is `udfs/stage/batch_lane.py`."""
