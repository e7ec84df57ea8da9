"""`llmstream estate start|stop|status|fault`: the estate (`jobs/dev/estate/`) from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from jobs.dev.estate.estate import HOSTS, Estate
from jobs.dev.estate.network import EstateError, unavailable

DESCRIPTION = """\
llmstream's hosts as network namespaces on one bridge of this machine (10.77.0.0/24; needs root):
a JobManager (jm), two TaskManagers (tm1, tm2), three brokers (kafka1-3), a model server (model).

  llmstream estate start                      everything up (the job: llmstream submit --jobmanager 10.77.0.10:8081)
  llmstream estate status [--json]
  llmstream estate fault partition tm1 kafka1,kafka2,kafka3 [--seconds 60]
  llmstream estate fault heal tm1 kafka1      (or: heal-all)
  llmstream estate fault isolate HOST [--seconds N]   / rejoin HOST   (the host's link down / up)
  llmstream estate fault kill HOST            / restart HOST          (every process on it / its services again)
  llmstream estate fault kill-leader TOPIC [--partition P]
  llmstream estate fault --table [--scenarios partition-60,leader-kill] [--records N]
      scenarios: baseline, partition-60, partition-200, partition-past-tx-timeout, tm-host-kill, leader-kill,
      coordinator-kill, model-slow-link, model-stalled-link, jm-host-kill (faults),
      rescale-keyed (1→4→2, per_key), rescale-vectorized (1→3→1), rescale-provider-batch (1→2→1)
  llmstream estate stop
"""

HOST_NAMES = ", ".join(h.name for h in HOSTS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("estate_command", metavar="{start,stop,status,fault}",
                        choices=["start", "stop", "status", "fault"])
    parser.add_argument("fault_words", nargs="*", metavar="WORD",
                        help=f"fault: partition A B | heal A B | heal-all | isolate H | rejoin H | kill H | "
                             f"restart H | kill-leader TOPIC (hosts: {HOST_NAMES}; A and B may be lists: a,b)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="fault: undo it after this many seconds (the command waits)")
    parser.add_argument("--partition", type=int, default=0, help="kill-leader: the topic's partition (default 0)")
    parser.add_argument("--table", action="store_true", help="fault: run the fault table's scenarios")
    parser.add_argument("--scenarios", default=None, help="--table: which (comma-separated; default all)")
    parser.add_argument("--records", type=int, default=None, help="--table: records per scenario")
    parser.add_argument("--work-dir", type=Path, default=None, help="the estate's files (default <repo>/var/estate)")
    parser.add_argument("--timeout", type=float, default=240.0, help="start: seconds to wait (default 240)")
    parser.add_argument("--json", action="store_true", help="status: as JSON")


def run(args: argparse.Namespace) -> int:
    why = unavailable()
    if why is not None:
        print(f"estate: {why}", file=sys.stderr)
        return 2
    estate = Estate(args.work_dir)
    try:
        if args.estate_command == "start":
            started = time.monotonic()
            estate.start(timeout=args.timeout)
            print(f"estate: up in {time.monotonic() - started:.0f} s; brokers {estate.bootstrap_servers}, "
                  f"Flink {estate.layout.rest_url}, model {estate.model.url}")
            return 0
        if args.estate_command == "stop":
            estate.stop()
            print("estate: stopped")
            return 0
        if args.estate_command == "status":
            status = estate.status()
            if args.json:
                print(json.dumps(status, indent=2))
            else:
                _print_status(status)
            return 0 if all(h["up"] for h in status["hosts"].values()) else 1
        return _fault(estate, args)
    except EstateError as err:
        print(f"estate: {err}", file=sys.stderr)
        return 1


def _print_status(status: dict[str, object]) -> None:
    hosts = status["hosts"]
    assert isinstance(hosts, dict)
    for name, host in hosts.items():
        state = "up" if host["up"] else "absent"
        link = "" if not host["up"] else (" link up" if host["link"] else " LINK DOWN")
        print(f"  {name:<7} {host['address']:<11} {state}{link}, {host['processes']} processes")
    print(f"  partitions: {status['partitions'] or 'none'}")
    for key in ("kafka", "flink", "model", "objects"):
        print(f"  {key}: {status[key]}")


def _fault(estate: Estate, args: argparse.Namespace) -> int:
    if args.table:
        from jobs.dev.estate import rescale, table

        known = [*table.SCENARIOS, *rescale.RESCALES]
        names = args.scenarios.split(",") if args.scenarios else known
        unknown = [n for n in names if n not in known]
        if unknown:
            print(f"estate: no scenario {unknown} (scenarios: {', '.join(known)})", file=sys.stderr)
            return 2
        estate.start(timeout=args.timeout)
        rows = []
        for name in names:
            if name in rescale.RESCALES:
                row, _ = rescale.run_rescale(estate, rescale.RESCALES[name], records=args.records or 3000)
            else:
                row, _ = table.run_scenario(estate, table.SCENARIOS[name], records=args.records or table.RECORDS)
            rows.append(row)
            table.save([row], estate.work_dir / "fault-table.json")
            print(table.render([row]).splitlines()[-1], flush=True)
        print(table.render(rows))
        return 0 if all(r.verdict == "ok" for r in rows) else 1
    words = args.fault_words
    if not words:
        print("estate: fault needs a kind (partition, heal, heal-all, isolate, rejoin, kill, restart, kill-leader) "
              "or --table", file=sys.stderr)
        return 2
    kind, rest = words[0], words[1:]

    def hosts(word: str) -> list[str]:
        return [w for w in word.split(",") if w]

    needs = {"partition": 2, "heal": 2, "heal-all": 0, "isolate": 1, "rejoin": 1, "kill": 1, "restart": 1,
             "kill-leader": 1}
    if kind not in needs or len(rest) != needs[kind]:
        print(f"estate: fault {kind} takes {needs.get(kind, '?')} arguments, got {rest}", file=sys.stderr)
        return 2
    if kind == "partition":
        estate.partition(hosts(rest[0]), hosts(rest[1]))
        print(f"estate: {rest[0]} and {rest[1]} partitioned")
        if args.seconds:
            time.sleep(args.seconds)
            estate.heal(hosts(rest[0]), hosts(rest[1]))
            print(f"estate: healed after {args.seconds:g} s")
    elif kind == "heal":
        estate.heal(hosts(rest[0]), hosts(rest[1]))
    elif kind == "heal-all":
        estate.network.heal_all()
    elif kind == "isolate":
        estate.isolate(rest[0])
        print(f"estate: {rest[0]} isolated")
        if args.seconds:
            time.sleep(args.seconds)
            estate.rejoin(rest[0])
            print(f"estate: {rest[0]} rejoined after {args.seconds:g} s")
    elif kind == "rejoin":
        estate.rejoin(rest[0])
    elif kind == "kill":
        print(f"estate: {rest[0]} killed ({len(estate.kill_host(rest[0]))} processes)")
    elif kind == "restart":
        estate.restart_host(rest[0])
        print(f"estate: {rest[0]} restarted")
    else:
        print(f"estate: killed {estate.kill_leader(rest[0], args.partition)}, leader of {rest[0]}-{args.partition}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llmstream estate", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
