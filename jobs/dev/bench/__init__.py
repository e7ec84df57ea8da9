"""`llmstream bench`: llmstream against two hand-written Kafka consumers, on one machine.

Benchmark code only. Nothing in `udfs/` or the job imports this package; the job runs
here exactly as users run it (`llmstream run --config FILE`), in its own process tree.
Modules: `scenarios` (simulator settings and the Little's-law limit), `workload` (the
input records), `baselines` (the two hand-written consumers, run as
`python -m jobs.dev.bench.baselines`), `measure` (the read_committed observer, RSS and
simulator samplers, statistics), `harness` (one approach on one scenario), `report`
(markdown, JSON, chart) and `main` (the command line).
"""
