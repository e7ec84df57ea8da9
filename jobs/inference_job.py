"""Entry point for `flink run -py jobs/inference_job.py --config FILE` on a Flink cluster.

`llmstream submit` builds that command (with ``-s SNAPSHOT`` to resume and ``--state-dir``) after
its launch sequence (`jobs/launch/plan.py`) has checked everything; locally, `llmstream run` is the
same job in a mini cluster. This file only loads the config, decides what the graph is built
from as the launch does (`jobs.launch.plan.job_build`) and hands the graph to Flink.
"""

from __future__ import annotations

import argparse
import sys

from jobs.graph.pipeline import build_pipeline, create_environment
from jobs.launch.plan import job_build
from jobs.runtime import jars
from jobs.state.snapshots import StateDir
from udfs.config import load_config
from udfs.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="llmstream inference job (cluster entry point)")
    parser.add_argument("--config", default=None)
    parser.add_argument("--state-dir", default=None,
                        help="checkpoints and savepoints (default: checkpointing.directory, else var/state/<name>)")
    parser.add_argument("--jar", action="append", default=None,
                        help="connector jar URL (default: the pom-free cache)")
    parser.add_argument("--python-file", action="append", default=None,
                        help="a user function's module to ship (default: found from the config's python.path)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"llmstream: config error: {err}", file=sys.stderr)
        return 2
    try:
        build = job_build(config, StateDir.for_job(config, args.state_dir),
                          args.jar if args.jar is not None else jars.connector_jar_urls(), args.python_file)
    except ConfigError as err:
        print(f"llmstream: config error: {err}", file=sys.stderr)
        return 2
    env = create_environment(config, list(build.jar_urls), state=build.state, python_files=build.python_files)
    build_pipeline(env, config, cache_file=build.cache_file)
    env.execute(config.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
