#!/usr/bin/python3
"""Flush cost: write+flush operations per second by write size and by connection count, the
same without flush, and the time of one FLUSH against the amount of dirty data.

    bench/flush.py            # full run, about 6 minutes
    bench/flush.py --quick    # smoke run, under a minute

Writes its section into bench/RESULTS.md between the flush markers (the rest of the file is
left alone) and plots under bench/plots/. The three servers run at once on 127.0.0.1 ports
of this script's choosing, each on its own file in a temporary directory, and each cell is
measured on every server in turn (A B C, cell after cell) so that the by-server comparison
is made minutes apart at most by one cell. Servers are stopped by PID.
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import bench
from sections import write_section

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NETBLK = bench.NETBLK  # honours NETBLK_BIN and CARGO_TARGET_DIR
RESULTS = os.path.join(HERE, "RESULTS.md")
SIZES = ["512", "1k", "2k", "4k", "8k", "16k", "64k"]
CONNECTIONS = [1, 2, 4, 8, 16]
DISK_SIZE = 1 << 30


class Server:
    """One NBD server on a fresh port; stopped by its own PID."""

    def __init__(self, kind, disk):
        self.port = bench.free_port()
        if kind.startswith("netblk"):
            cache = kind.split("-", 1)[1]
            cmd = [NETBLK, "serve", "--cache", cache, "--listen", f"127.0.0.1:{self.port}", disk]
        elif kind == "qemu-nbd":
            cmd = ["qemu-nbd", "-f", "raw", "--cache=none", "--aio=io_uring", "-t", "--shared=32",
                   "-b", "127.0.0.1", "-p", str(self.port), disk]
        else:
            raise ValueError(kind)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"{kind} did not start")

    @property
    def uri(self):
        return f"nbd://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def fio_ops(uri, size, jobs, flush, runtime):
    """Write operations per second (each followed by a FLUSH when `flush`)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fio.json")
        cmd = ["fio", "--name=w", "--ioengine=nbd", f"--uri={uri}", "--rw=randwrite",
               f"--bs={size}", "--iodepth=1", f"--numjobs={jobs}",
               "--size=256M", f"--runtime={runtime}", "--time_based",
               "--output-format=json", f"--output={out}"]
        if flush:
            cmd.append("--fsync=1")
        log_prefix = os.path.join(tmp, "jobs")
        cmd += bench.fio_window_args(log_prefix)
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        # Counted over the span of the jobs' windows, not fio's --group_reporting (see
        # bench.py's fio_totals and fio_job_windows).
        return bench.fio_report(out, log_prefix)["iops"]


def flush_times(uri, dirty_mib, repeats):
    """Median seconds of a FLUSH after writing each amount of dirty data, and of a FLUSH
    with nothing dirty right after."""
    script = r"""
import nbd, sys, time, json, statistics
h = nbd.NBD(); h.connect_uri(sys.argv[1])
amounts = json.loads(sys.argv[2]); repeats = int(sys.argv[3])
buf = bytearray(b"\x5a" * (1 << 20)); size = h.get_size(); out = {}
h.flush()
for mib in amounts:
    dirty, clean = [], []
    for r in range(repeats):
        base = (r * 300 << 20) % (size - (mib << 20) if size > (mib << 20) else 1)
        for i in range(mib):
            h.pwrite(buf, base + (i << 20))
        t = time.perf_counter(); h.flush(); dirty.append(time.perf_counter() - t)
        t = time.perf_counter(); h.flush(); clean.append(time.perf_counter() - t)
    out[mib] = [statistics.median(dirty), statistics.median(clean)]
print(json.dumps(out))
"""
    result = subprocess.run(["/usr/bin/python3", "-c", script, uri, json.dumps(dirty_mib),
                             str(repeats)], capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(result.stdout).items()}


def svg_lines(path, title, xlabel, ylabel, xs, series, logx=False):
    """A small line plot: `series` maps a label to y values over `xs`."""
    import math
    w, h, left, bottom, top, right = 640, 380, 70, 50, 30, 150
    ymax = max(max(v) for v in series.values()) * 1.1 or 1
    fx = (lambda x: math.log2(x)) if logx else (lambda x: x)
    x0, x1 = fx(xs[0]), fx(xs[-1])
    px = lambda x: left + (fx(x) - x0) / ((x1 - x0) or 1) * (w - left - right)
    py = lambda y: h - bottom - y / ymax * (h - bottom - top)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             f'font-family="sans-serif" font-size="12">',
             f'<text x="{w / 2}" y="18" text-anchor="middle" font-size="14">{title}</text>',
             f'<line x1="{left}" y1="{h - bottom}" x2="{w - right}" y2="{h - bottom}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{h - bottom}" stroke="black"/>',
             f'<text x="{(w - right + left) / 2}" y="{h - 12}" text-anchor="middle">{xlabel}</text>',
             f'<text x="14" y="{h / 2}" transform="rotate(-90 14 {h / 2})" '
             f'text-anchor="middle">{ylabel}</text>']
    for x in xs:
        parts.append(f'<text x="{px(x):.1f}" y="{h - bottom + 16}" text-anchor="middle">{x}</text>')
    for i in range(5):
        y = ymax * i / 4
        parts.append(f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:,.0f}</text>')
    for n, (label, ys) in enumerate(series.items()):
        c = colors[n % len(colors)]
        pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(xs, ys))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{c}" stroke-width="2"/>')
        parts.append(f'<text x="{w - right + 8}" y="{top + 16 * n + 10}" fill="{c}">{label}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def write_whole(path):
    """Creates the DISK_SIZE file with every block written and on the disk. A file from
    `fallocate` has unwritten extents, and the first write to each costs a metadata update
    that a later one does not (local fio: 1,856–3,365 write+flush pairs a second on a fresh
    file against 4,590–6,353 once written): the server whose cells ran first on fresh
    extents measured slower (review, session 66)."""
    block = b"\xa5" * (1 << 20)
    with open(path, "wb") as f:
        for _ in range(DISK_SIZE >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def main():
    with bench.same_congestion():
        measure_and_report()


def measure_and_report():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    runtime = 1 if args.quick else 2
    sizes = ["512", "4k", "64k"] if args.quick else SIZES
    conns = [1, 4] if args.quick else CONNECTIONS
    dirty = [0, 1, 16] if args.quick else [0, 1, 4, 16, 64, 256]
    if not os.path.exists(NETBLK):
        sys.exit("build first: cargo build --release")
    started = time.time()
    kinds = ["netblk-writeback", "netblk-none", "qemu-nbd"]
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        servers = {}
        try:
            for kind in kinds:
                disk = os.path.join(tmp, f"{kind}.img")
                write_whole(disk)
                servers[kind] = Server(kind, disk)
            matrix = {}  # (server, flush, size, conns) -> ops/s
            for flush in [True, False]:
                for size in sizes:
                    for n in conns:
                        for kind in kinds:
                            if kind != "netblk-writeback" and size not in ("4k",):
                                continue
                            matrix[(kind, flush, size, n)] = fio_ops(servers[kind].uri, size, n, flush, runtime)
                            print(kind, "flush" if flush else "no-flush", size, n,
                                  int(matrix[(kind, flush, size, n)]), flush=True)
            for kind in kinds[:2]:
                matrix[(kind, "dirty")] = flush_times(servers[kind].uri, dirty, 1 if args.quick else 3)
        finally:
            for server in servers.values():
                server.stop()
    elapsed = time.time() - started

    os.makedirs(os.path.join(HERE, "plots"), exist_ok=True)
    svg_lines(os.path.join(HERE, "plots", "flush-connections.svg"),
              "netblk (writeback): write+flush ops/s by connections", "client connections",
              "write+flush pairs per second", conns,
              {f"{s} B" if s == "512" else s: [matrix[("netblk-writeback", True, s, n)] for n in conns]
               for s in sizes}, logx=True)
    dirty_x = [d for d in dirty if d > 0]
    svg_lines(os.path.join(HERE, "plots", "flush-dirty.svg"),
              "Time of one FLUSH against dirty data", "MiB written since the last flush",
              "milliseconds", dirty_x,
              {k: [matrix[(k, "dirty")][d][0] * 1000 for d in dirty_x]
               for k in ["netblk-writeback", "netblk-none"]}, logx=True)

    lines = ["## Flush cost (`bench/flush.py`)", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {runtime} s per cell, "
             f"one pass ({elapsed / 60:.1f} min in all){', QUICK smoke run' if args.quick else ''}; "
             "the servers run at once, each on its own file (written in full first, so no cell meets "
             "unwritten extents), and each cell is measured on each "
             "server in turn. fio `--ioengine=nbd --rw=randwrite --iodepth=1 --numjobs=N` (one "
             "connection per job), `--fsync=1` sends a FLUSH after every write. The disk under "
             "this VM differs between machines (a device flush cost microseconds on some, "
             "milliseconds on others): compare rows of one run, not runs. Noisy 2-core VM.",
             "", "### write+flush pairs per second, netblk `--cache=writeback`", "",
             "| write size | " + " | ".join(f"{n} conn" for n in conns) + " | scaling 1→" + str(conns[-1]) + " |",
             "|---|" + "---|" * (len(conns) + 1)]
    for s in sizes:
        row = [matrix[("netblk-writeback", True, s, n)] for n in conns]
        lines.append(f"| {s} | " + " | ".join(f"{v:,.0f}" for v in row)
                     + f" | {row[-1] / row[0]:.2f}× (linear: {conns[-1]}×) |")
    lines += ["", "### the same without flush (writes per second)", "",
              "| write size | " + " | ".join(f"{n} conn" for n in conns) + " |",
              "|---|" + "---|" * len(conns)]
    for s in sizes:
        lines.append(f"| {s} | " + " | ".join(
            f"{matrix[('netblk-writeback', False, s, n)]:,.0f}" for n in conns) + " |")
    lines += ["", "### 4 KiB write+flush by server (pairs per second; no flush in brackets)", "",
              "| server | " + " | ".join(f"{n} conn" for n in conns) + " |",
              "|---|" + "---|" * len(conns)]
    for kind in ["netblk-writeback", "netblk-none", "qemu-nbd"]:
        label = {"netblk-writeback": "netblk --cache=writeback", "netblk-none": "netblk --cache=none",
                 "qemu-nbd": "qemu-nbd --cache=none --aio=io_uring"}[kind]
        lines.append(f"| {label} | " + " | ".join(
            f"{matrix[(kind, True, '4k', n)]:,.0f} ({matrix[(kind, False, '4k', n)]:,.0f})"
            for n in conns) + " |")
    lines += ["", "### time of one FLUSH against the data dirtied since the last", "",
              "| dirty MiB | netblk writeback: flush ms | then a clean flush ms | "
              "netblk none: flush ms | then a clean flush ms |", "|---|---|---|---|---|"]
    for d in dirty:
        wb = matrix[("netblk-writeback", "dirty")][d]
        dn = matrix[("netblk-none", "dirty")][d]
        lines.append(f"| {d} | {wb[0] * 1000:.3f} | {wb[1] * 1000:.3f} | {dn[0] * 1000:.3f} | {dn[1] * 1000:.3f} |")
    one = [matrix[("netblk-writeback", True, "4k", n)] for n in conns]
    best = max(range(len(conns)), key=lambda i: one[i])
    wb_dirty = matrix[("netblk-writeback", "dirty")]
    lines += ["", "**Scaling in connections** (4 KiB write+flush, writeback): "
              + ", ".join(f"{n} → {v / one[0]:.2f}×" for n, v in zip(conns, one))
              + f"; the most at {conns[best]} connections ({one[best] / one[0]:.2f}×, linear would "
              f"be {conns[best]}×). "
              + ("At or above linear: concurrent FLUSHes share syncs (one `fdatasync` covers "
                 "every connection's writes, and a FLUSH that finds nothing new dirty returns "
                 "without one), so a slow device flush is paid once for several connections."
                 if one[best] / one[0] >= conns[best] else
                 "Below linear: the fio client and the server share two cores, and every "
                 "write+flush pair is two loopback round trips, so once both cores are busy "
                 "pairs per second cannot grow in proportion; the server adds no serialisation "
                 "of its own (one `fdatasync` covers every connection's writes)."),
              "", "A FLUSH costs what is dirty: with nothing written it returns without a "
              "syscall (the 'clean flush' column is one loopback round trip). In this run, "
              "writeback: "
              + ", ".join(f"{d} MiB {wb_dirty[d][0] * 1000:.2f} ms" for d in dirty)
              + ". Once clients flush, the server starts writeback of the file every 32 MiB "
              "written (write-behind, ARCHITECTURE.md), so a FLUSH after more than that finds "
              "part of the data already on its way to the disk.", "",
              "![write+flush by connections](plots/flush-connections.svg) "
              "![flush time against dirty data](plots/flush-dirty.svg)"]
    write_section(RESULTS, "flush", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
