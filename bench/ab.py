#!/usr/bin/python3
"""A/B comparison of netblk builds or settings, interleaved with the reference servers, on the
same fio jobs as bench.py. For deciding whether a change helps before it lands; it prints a
table and writes nothing into the repository.

    # two binaries, the memory rows of one workload, three interleaved rounds
    /usr/bin/python3 bench/ab.py --variant new=target/release/netblk --variant old=/tmp/netblk-old \\
        --backends mem --with nbdkit-mem --only curve-write-256k --rounds 3

    # one binary with and without an environment setting (NETBLK_ prefix added); the
    # server reads none for tuning, so this is for a scratch build that does (here one that
    # reads NETBLK_NAP_US, as session 43's did to try nap lengths)
    /usr/bin/python3 bench/ab.py --variant base=/tmp/netblk-scratch \\
        --variant nap=/tmp/netblk-scratch:NAP_US=150 --only randread-qd32

    # one binary with and without a command-line option
    /usr/bin/python3 bench/ab.py --variant cubic=target/release/netblk \\
        --variant system=target/release/netblk:--tcp-congestion=system --only seqread

A variant is NAME=PATH[:SETTING,...], where a SETTING is VAR=VALUE (an environment variable)
or an option for `netblk serve` starting with "-"; each gives rows NAME-mem, NAME-file (page cache) and
NAME-direct (--cache=none), narrowed by --backends. --with adds bench.py's own rows (nbdkit-mem,
nbdkit-file, qemu-nbd-file, local-io_uring). Server CPU time per request is from /proc, as in
bench.py. Standard library only.

A workload with a round above --steal-limit percent steal (the hypervisor's share of the
machine's CPU time) gets up to --extra-rounds more rounds, every row once more, and the table
then shows each row's --rounds quietest rounds: bench.py's rule, because a comparison is as
easily spoilt as a full run. Session 54's rerun of 256 KiB writes ran its last two rounds of
every row at 18-59% steal, at a seventh of the rate of the first two.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402


def parse_variant(text):
    name, _, rest = text.partition("=")
    path, _, settings = rest.partition(":")
    if not name or not path:
        raise SystemExit(f"--variant {text!r}: want NAME=PATH[:SETTING,...]")
    env, options = {}, []
    for item in filter(None, settings.split(",")):
        if item.startswith("-"):
            options.append(item)
            continue
        var, _, value = item.partition("=")
        env[var if var.startswith("NETBLK_") else "NETBLK_" + var] = value
    return name, os.path.abspath(path), env, options


def measure_workload(name, rows, rounds, run_row, results, steal_limit, extra_rounds):
    """Runs `rounds` rounds of `rows`, interleaved, through `run_row(round, row)` (which adds
    each run to `results[(name, row)]`), then one more round of every row while some row's
    `rounds` quietest rounds (`bench.quietest`) still hold one above `steal_limit`, at most
    `extra_rounds` times. Returns how many more rounds ran."""
    for r in range(rounds):
        for row in rows:
            run_row(r, row)
    more = 0
    while more < extra_rounds and bench.noisy_workloads({name: (None, rows)}, results, rounds, steal_limit, None):
        for row in rows:
            run_row(rounds + more, row)
        more += 1
    return more


def main():
    # Every server on the same congestion control (see bench.same_congestion).
    with bench.same_congestion():
        compare()


def compare():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, help="NAME=PATH[:SETTING,...]")
    parser.add_argument("--backends", nargs="*", default=["mem", "file", "direct"])
    parser.add_argument("--with", dest="others", nargs="*", default=[], help="bench.py rows to add")
    parser.add_argument("--only", nargs="*", help="workload names or prefixes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runtime", type=int, default=3)
    parser.add_argument("--steal-limit", type=float, default=bench.STEAL_LIMIT * 100,
                        help="percent of steal above which a workload gets more rounds")
    parser.add_argument("--extra-rounds", type=int, default=bench.EXTRA_ROUNDS,
                        help="the most extra rounds per workload (0: none)")
    args = parser.parse_args()

    kinds = {"mem": ("memory", ["memory:{size}"]), "file": ("file", ["{file}"]),
             "direct": ("file", ["--cache", "none", "{file}"])}
    rows = []
    for text in args.variant:
        name, path, env, options = parse_variant(text)
        for backend in args.backends:
            kind, tail = kinds[backend]
            row = f"{name}-{backend}"
            bench.SERVERS[row] = bench.Server(row, kind, [path, "serve", "--listen", "127.0.0.1:{port}", *options, *tail], env)
            if backend == "file":
                # Page-cache rows start with the file cached, as netblk-file and nbdkit-file do
                # in bench.py. Until session 18 they started cold here, and file rows were then
                # compared with a warm nbdkit-file.
                bench.PAGE_CACHE_ROWS.add(row)
            rows.append(row)
    rows += args.others
    work = {k: job for k, (job, _) in bench.workloads().items()
            if not args.only or any(k.startswith(o) for o in args.only)}

    scratch = tempfile.mkdtemp(prefix="netblk-ab-", dir="/var/tmp")
    backing = os.path.join(scratch, "disk.img")
    bench.write_backing(backing)
    results = {}
    extra = {}
    started = time.time()
    try:
        for name, job in work.items():
            def run_row(r, row, name=name, job=job):
                try:
                    run = bench.one_run(name, job, row, backing, args.runtime, scratch)
                except Exception as e:  # a failed run is reported, not fatal
                    print(f"[{time.time() - started:5.0f}s] {name} {r + 1} {row}: {e}", flush=True)
                    return
                results.setdefault((name, row), []).append(run)
                cpu, depth, steal = run["cpu_per_mreq"], run.get("disk_depth"), run.get("steal")
                print(f"[{time.time() - started:5.0f}s] {name} {r + 1} {row}: {run['iops']:,.0f} IOPS "
                      f"{run['mbps']:,.0f} MB/s" + (f", {cpu:.2f} CPU µs/req" if cpu else "")
                      + (f", {depth:.1f} at the disk" if depth is not None else "")
                      + (f", steal {steal * 100:.1f}%" if steal is not None else ""), flush=True)
            extra[name] = measure_workload(name, rows, args.rounds, run_row, results,
                                           args.steal_limit / 100, args.extra_rounds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"\n{'workload':22} {'row':22} {'IOPS median (min-max)':>30} {'MB/s':>8} {'CPU µs/req':>11} {'delayed ACKs':>13} {'retrans':>9} {'at disk':>8} {'most steal %':>13}")
    for name in work:
        for row in rows:
            # The row's quietest rounds, as bench.py shows them.
            runs = bench.quietest(results.get((name, row), []), args.rounds)
            if not runs:
                continue
            iops, lo, hi = bench.median_range([r["iops"] for r in runs])
            mbps = bench.median_range([r["mbps"] for r in runs])[0]
            cpus = [r["cpu_per_mreq"] for r in runs if r["cpu_per_mreq"]]
            cpu = bench.median_range(cpus)[0] if cpus else None
            acks = sum(r["tcp"].get("TcpExtDelayedACKs", 0) for r in runs)
            retrans = sum(r["tcp"].get("TcpRetransSegs", 0) for r in runs)
            depth = bench.median_range([r.get("disk_depth") for r in runs])[0]
            # The largest of the rounds shown, not the median: one slowed round is what to look
            # for before trusting a difference between rows.
            steal = bench.median_range([r.get("steal") for r in runs])[2]
            print(f"{name:22} {row:22} {iops:>12,.0f} ({lo:,.0f}-{hi:,.0f}) {mbps:>8,.0f} "
                  f"{'' if cpu is None else f'{cpu:.2f}':>11} {acks:>13,} {retrans:>9,} "
                  f"{'' if depth is None else f'{depth:.1f}':>8} "
                  f"{'' if steal is None else f'{steal * 100:.1f}':>13}")
    measured_again = {name: count for name, count in extra.items() if count}
    for line in bench.extra_round_lines(measured_again, args.rounds, args.steal_limit):
        print(line)


if __name__ == "__main__":
    main()
