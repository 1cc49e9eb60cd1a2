#!/usr/bin/python3
"""Large sequential reads through libnbd with and without its buffer zeroing, to tell the
server's share of the throughput curve from the client's.

libnbd zeroes every read buffer before it sends the read (`pread_initialize`, on by default,
so that a misbehaving server cannot leak the client's old heap contents), and fio's nbd
engine leaves it on. With 8 requests of 32 MiB in flight the zeroing walks 256 MiB of buffers
that do not fit in any CPU cache: `perf` on fio put 38.6% of its samples in `memset` (session
18, bench/RESULTS.md). This script runs the same sequential reads (queue depth 8, request
sizes of 1 MiB and up) from a small libnbd client with the zeroing on and off, servers and
settings interleaved, and prints MB/s medians. Python's own cost per request is negligible
at these sizes; below 1 MiB it would be the limit, so smaller sizes are not offered.

    /usr/bin/python3 bench/client_curve.py                    # netblk-mem nbdkit-mem, 3 rounds
    /usr/bin/python3 bench/client_curve.py --servers netblk-file nbdkit-file --rounds 5

Needs python3-libnbd (`import nbd`) and the servers bench.py starts. Writes nothing into the
repository.
"""

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

try:
    import nbd
except ImportError:  # pragma: no cover - environment check
    raise SystemExit("needs python3-libnbd: apt-get install python3-libnbd, run with /usr/bin/python3")

QUEUE_DEPTH = 8
SIZES = {"1m": 1 << 20, "4m": 4 << 20, "32m": 32 << 20}


def read_throughput(uri, block, zeroing, seconds):
    """MB/s of sequential reads of `block` bytes, QUEUE_DEPTH in flight, for `seconds`."""
    h = nbd.NBD()
    h.set_pread_initialize(zeroing)
    h.connect_uri(uri)
    try:
        blocks = min(h.get_size(), bench.SIZE) // block
        buffers = [nbd.Buffer(block) for _ in range(QUEUE_DEPTH)]
        in_flight, issued, done = {}, 0, 0

        def issue(slot):
            nonlocal issued
            in_flight[slot] = h.aio_pread(buffers[slot], (issued % blocks) * block)
            issued += 1

        for slot in range(QUEUE_DEPTH):
            issue(slot)
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            h.poll(-1)
            for slot, cookie in list(in_flight.items()):
                if h.aio_command_completed(cookie):
                    done += 1
                    issue(slot)
        elapsed = time.monotonic() - start
        while in_flight:
            h.poll(-1)
            for slot, cookie in list(in_flight.items()):
                if h.aio_command_completed(cookie):
                    del in_flight[slot]
        return done * block / elapsed / 1e6
    finally:
        h.shutdown()


def one_round(server_name, backing, sizes, seconds, zeroing_first=True):
    """{(size, zeroing): MB/s} for one start of the server; the two zeroing modes in the
    order given (rounds alternate it, so neither always runs on a warmer server)."""
    server = bench.SERVERS[server_name]
    if server.kind == "file":
        bench.settle_backing(backing, warm=server_name in bench.PAGE_CACHE_ROWS)
    port = bench.free_port()
    proc = server.start(port, backing)
    uri = f"nbd://127.0.0.1:{port}"
    try:
        if server.kind == "memory":
            subprocess.run(["fio", "--name=prefill", f"--size={bench.SIZE}", "--ioengine=nbd",
                            f"--uri={uri}", "--output=/dev/null", "--rw=write", "--bs=1m", "--iodepth=8"],
                           check=True, capture_output=True, timeout=300)
        results = {}
        for size in sizes:
            for zeroing in ((True, False) if zeroing_first else (False, True)):
                results[(size, zeroing)] = read_throughput(uri, SIZES[size], zeroing, seconds)
        return results
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", nargs="*", default=["netblk-mem", "nbdkit-mem"],
                        choices=sorted(n for n in bench.SERVERS if n != "qemu-nbd-file"))
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runtime", type=float, default=3.0, help="seconds per measurement")
    args = parser.parse_args()
    if not os.path.exists(bench.NETBLK):
        raise SystemExit(f"{bench.NETBLK} not found: cargo build --release first")
    samples = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as scratch:
        backing = os.path.join(scratch, "backing.img")
        if any(bench.SERVERS[s].kind == "file" for s in args.servers):
            bench.write_backing(backing)
        for round_no in range(1, args.rounds + 1):
            for server in args.servers:
                first = round_no % 2 == 1
                for key, mbps in one_round(server, backing, args.sizes, args.runtime, first).items():
                    samples.setdefault((server, *key), []).append(mbps)
                    print(f"round {round_no} {server} {key[0]} zeroing={'on' if key[1] else 'off'}: "
                          f"{mbps:,.0f} MB/s", flush=True)
    print(f"\n{'server':<14} {'size':>5}  {'zeroing on (libnbd default)':>30}  {'zeroing off':>24}")
    for server in args.servers:
        for size in args.sizes:
            cells = []
            for zeroing in (True, False):
                values = samples[(server, size, zeroing)]
                cells.append(f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})")
            print(f"{server:<14} {size:>5}  {cells[0]:>30}  {cells[1]:>24}")


if __name__ == "__main__":
    with bench.one_run_at_a_time("client_curve.py"):
        main()
