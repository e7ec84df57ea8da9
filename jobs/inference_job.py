"""Entry point for `flink run -py jobs/inference_job.py --config FILE` on a Flink cluster.

`llmstream submit` builds that command (with ``-s SNAPSHOT`` to resume and ``--state-dir``);
locally, `llmstream run` is the same job in a mini cluster. This file only loads the config
and hands the graph to Flink.
"""

from __future__ import annotations

import argparse
import sys

from jobs.graph.pipeline import build_pipeline, create_environment
from jobs.runtime import jars
from jobs.state.snapshots import StateDir
from udfs.config import load_config
from udfs.cost.cache import resolve_cache_location
from udfs.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="llmstream inference job (cluster entry point)")
    parser.add_argument("--config", default=None)
    parser.add_argument("--state-dir", default=None,
                        help="checkpoints and savepoints (default: checkpointing.directory, else var/state/<name>)")
    parser.add_argument("--jar", action="append", default=None,
                        help="connector jar URL (default: the pom-free cache)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"llmstream: config error: {err}", file=sys.stderr)
        return 2
    state = StateDir.for_job(config, args.state_dir)
    config = resolve_cache_location(config, state.path)  # beside the snapshots, not the shipped udfs/
    env = create_environment(config, args.jar if args.jar is not None else jars.connector_jar_urls(), state=state)
    build_pipeline(env, config)
    env.execute(config.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
