#!/usr/bin/env python3
"""Merge the shards of one bench run (bench.py --shard I/N, one per machine or pod) into one
result: the JSON, table, verdict and log entry a single client would have written.

Reads each shard's result (its --json-out file) and its --records file, which the result names
and which must sit beside it. The percentiles are those of the union of every shard's requests
(exact: taken from the records, never averaged over shards); throughput is over the union window,
from the first request any shard sent to the last token any shard received, on the wall clock
(each shard recorded the offset between its monotonic and wall clocks). The run is valid when every
shard's client kept up: each shard's self-check, its start against --start-at and its clock (the
kernel's own error bound: shards on one machine share one clock) are stated in "merge". The
server's view is that of the shard that finished last: its /metrics scrapes enclose every shard's
requests. The shards must be all N of one run (one --start-at, one workload), each given once.
compare.py and report.py read the merged result like any bench result.

Examples:
  merge.py shard-0.json shard-1.json shard-2.json shard-3.json
  merge.py results/ --json-out merged.json --records merged.jsonl
  merge.py results/ --log bench-log.md --json
  task merge -- results/ --json-out merged.json

Exit codes: 0 SLO met (or no SLO set and every request completed), 1 SLO missed or requests
failed, 2 bad input (no shard result, a shard missing or given twice, shards of different runs or
workloads, a records file missing or not that shard's), 3 every request failed, 4 the merged run
is invalid (a shard's client could not keep up), 5 the result is printed but --records, --log or
--json-out could not be written, 130 a shard was interrupted (its partial results are merged) or
the merge was.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from rooflib.core import cli, fileio, printing, signals
from rooflib.core.errors import UsageError
from rooflib.load import merging
from rooflib.render import bench_text


def build_parser():
    p = cli.parser(__doc__)
    p.add_argument("files", nargs="*", help="the shards' results (bench --shard ... --json-out), or a folder of them")
    p.add_argument("--records", default="", help="write the merged per-request records here (JSON lines; sent_ns "
                                                 "on the wall clock, each with its shard)")
    p.add_argument("--log", default="", help="append the merged run's entry to this Markdown bench log")
    printing.add_output_args(p)
    return p


def run(args: Any) -> int:
    if not args.files:
        raise UsageError("no shard results given: pass the --json-out files of bench --shard I/N, or their folder")
    for what, path in (("--records", args.records), ("--log", args.log)):
        if path:
            fileio.check_writable(path, what)
    results = [merging.read_result(path) for path in merging.expand(args.files)]
    with signals.SignalHold("merge") as hold:
        hold.start()  # from here a Ctrl-C waits until the merged result is printed and written
        result = merging.merge(results, args.records or None)
        return bench_text.publish(result, args.output, args.records or None, args.log or None, "merge")


@cli.entry
def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    return cli.run_main(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
