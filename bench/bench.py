#!/usr/bin/python3
"""Side-by-side benchmark: netblk against nbdkit, qemu-nbd and the local disk, same machine,
same fio jobs, servers interleaved (A B C A B C ...) so drift hits every server alike.

    /usr/bin/python3 bench/bench.py                 # every workload, 3 rounds, 5 s runs
    /usr/bin/python3 bench/bench.py --quick         # 1 round, 2 s runs (smoke test)
    /usr/bin/python3 bench/bench.py --only randread-qd32 seq-curve

Writes bench/RESULTS.md (bench/RESULTS-quick.md with --quick) and SVG plots in bench/plots/.
For every run it records the server's own CPU time (utime + stime from /proc/PID/stat) per
million requests and the kernel's TCP delayed-ACK and retransmission counters (nstat).
Standard library only (Debian's /usr/bin/python3).
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NETBLK = os.path.join(ROOT, "target", "release", "netblk")
CLK_TCK = os.sysconf("SC_CLK_TCK")
SIZE = 512 << 20  # exports and backing file
NSTAT_KEYS = ("TcpExtDelayedACKs", "TcpExtDelayedACKLost", "TcpRetransSegs")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def nstat():
    out = subprocess.run(["nstat", "-az", *NSTAT_KEYS], capture_output=True, text=True).stdout
    values = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in NSTAT_KEYS:
            values[parts[0]] = int(parts[1])
    return values


class Server:
    """A server kind: how to start it on a port over a backing."""

    def __init__(self, name, kind, argv):
        self.name, self.kind, self.argv = name, kind, argv

    def start(self, port, backing):
        argv = [a.format(port=port, file=backing, size=SIZE) for a in self.argv]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        wait_port(port, proc)
        return proc


SERVERS = {
    "netblk-mem": Server("netblk-mem", "memory", [NETBLK, "serve", "--listen", "127.0.0.1:{port}", "memory:{size}"]),
    "nbdkit-mem": Server("nbdkit-mem", "memory", ["nbdkit", "-f", "-p", "{port}", "-i", "127.0.0.1", "memory", "{size}"]),
    "netblk-file": Server("netblk-file", "file", [NETBLK, "serve", "--listen", "127.0.0.1:{port}", "{file}"]),
    "netblk-direct": Server("netblk-direct", "file", [NETBLK, "serve", "--cache", "none", "--listen", "127.0.0.1:{port}", "{file}"]),
    "nbdkit-file": Server("nbdkit-file", "file", ["nbdkit", "-f", "-p", "{port}", "-i", "127.0.0.1", "file", "{file}"]),
    "qemu-nbd-file": Server("qemu-nbd-file", "file", [
        "qemu-nbd", "-f", "raw", "-p", "{port}", "-b", "127.0.0.1", "-x", "", "--persistent", "--shared=16",
        "--cache=none", "--aio=io_uring", "{file}"]),
}
LOCAL = "local-io_uring"


def workloads():
    """name -> (fio args, servers). Memory rows need no disk; file rows add the local row."""
    mem = ["netblk-mem", "nbdkit-mem"]
    files = ["netblk-file", "netblk-direct", "nbdkit-file", "qemu-nbd-file", LOCAL]
    both = mem + files
    w = {
        "randread-qd1": (["--rw=randread", "--bs=4k", "--iodepth=1"], both),
        "randread-qd32": (["--rw=randread", "--bs=4k", "--iodepth=32"], both),
        "randread-qd256": (["--rw=randread", "--bs=4k", "--iodepth=256"], both),
        "randread-4x32": (["--rw=randread", "--bs=4k", "--iodepth=32", "--numjobs=4", "--group_reporting"], both),
        "randwrite-qd32": (["--rw=randwrite", "--bs=4k", "--iodepth=32"], both),
        "write-fsync-qd1": (["--rw=randwrite", "--bs=4k", "--iodepth=1", "--fsync=1"], files),
        "seqread-1m-qd8": (["--rw=read", "--bs=1m", "--iodepth=8"], both),
        "seqwrite-1m-qd8": (["--rw=write", "--bs=1m", "--iodepth=8"], both),
    }
    for bs in ("4k", "64k", "256k", "1m", "4m", "32m"):
        w[f"curve-read-{bs}"] = ([f"--rw=read", f"--bs={bs}", "--iodepth=8"], mem)
        w[f"curve-write-{bs}"] = ([f"--rw=write", f"--bs={bs}", "--iodepth=8"], mem)
    return w


def run_fio(job_args, target, runtime, out_path):
    argv = ["fio", "--name=bench", f"--size={SIZE}", "--time_based", f"--runtime={runtime}", "--ramp_time=1",
            "--output-format=json", f"--output={out_path}", *job_args]
    if target.startswith("nbd://"):
        argv += ["--ioengine=nbd", f"--uri={target}"]
    else:
        argv += ["--ioengine=io_uring", "--direct=1", f"--filename={target}"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=runtime + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed: {proc.stderr.strip()[-300:]}")
    with open(out_path) as f:
        job = json.load(f)["jobs"][0]
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}")
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    iops = job["read"]["iops"] + job["write"]["iops"]
    bw = (job["read"]["bw_bytes"] + job["write"]["bw_bytes"]) / 1e6
    lats = [job[d]["lat_ns"]["mean"] for d in ("read", "write") if job[d]["total_ios"]]
    sync = job.get("sync", {}).get("lat_ns", {}).get("mean", 0)
    return {"ios": ios, "iops": iops, "mbps": bw, "lat_us": (max(lats) if lats else 0) / 1000,
            "sync_lat_us": sync / 1000}


def one_run(name, job_args, server_name, backing, runtime, scratch):
    out = os.path.join(scratch, "fio.json")
    net_before = nstat()
    if server_name == LOCAL:
        result = run_fio(job_args, backing, runtime, out)
        result["cpu_per_mreq"] = None
    else:
        port = free_port()
        proc = SERVERS[server_name].start(port, backing)
        try:
            if SERVERS[server_name].kind == "memory":
                # Fill the export first: unwritten memory is a hole, which netblk answers with
                # a 12-byte OFFSET_HOLE chunk instead of data; that would not be a transfer.
                prefill = ["--rw=write", "--bs=1m", "--iodepth=8", "--time_based=0", "--runtime=0"]
                subprocess.run(["fio", "--name=prefill", f"--size={SIZE}", "--ioengine=nbd",
                                f"--uri=nbd://127.0.0.1:{port}", "--output=/dev/null", *prefill[:3]],
                               check=True, capture_output=True, timeout=300)
            cpu0 = cpu_seconds(proc.pid)
            result = run_fio(job_args, f"nbd://127.0.0.1:{port}", runtime, out)
            cpu1 = cpu_seconds(proc.pid)
            result["cpu_per_mreq"] = (cpu1 - cpu0) / (result["ios"] / 1e6) if result["ios"] else None
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    net_after = nstat()
    result["tcp"] = {k: net_after.get(k, 0) - net_before.get(k, 0) for k in NSTAT_KEYS}
    return result


def median_range(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def fmt(value, digits=0):
    if value is None:
        return "–"
    return f"{value:,.{digits}f}"


def svg_lines(path, title, xlabels, series, ylabel):
    """A small line chart: series = {name: [y or None per x]}."""
    width, height, left, bottom, top, right = 640, 360, 70, 40, 30, 150
    ys = [y for values in series.values() for y in values if y is not None]
    ymax = max(ys) * 1.1 if ys else 1
    plot_w, plot_h = width - left - right, height - top - bottom
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13">{title}</text>',
             f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="black"/>',
             f'<text x="14" y="{top + plot_h / 2}" transform="rotate(-90 14 {top + plot_h / 2})" text-anchor="middle">{ylabel}</text>']
    for i in range(5):
        y = top + plot_h - plot_h * i / 4
        parts.append(f'<text x="{left - 6}" y="{y + 4}" text-anchor="end">{ymax * i / 4:,.0f}</text>')
        parts.append(f'<line x1="{left}" y1="{y}" x2="{left + plot_w}" y2="{y}" stroke="#ddd"/>')
    step = plot_w / max(1, len(xlabels) - 1)
    for i, label in enumerate(xlabels):
        parts.append(f'<text x="{left + i * step}" y="{top + plot_h + 16}" text-anchor="middle">{label}</text>')
    for n, (name, values) in enumerate(series.items()):
        colour = colours[n % len(colours)]
        points = [(left + i * step, top + plot_h - plot_h * v / ymax) for i, v in enumerate(values) if v is not None]
        if points:
            parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in points)}"/>')
        parts.append(f'<text x="{left + plot_w + 10}" y="{top + 14 + 16 * n}" fill="{colour}">{name}</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def loopback_ceiling(seconds=3):
    """MB/s of 1 MiB sends over loopback between two processes (no iperf3 here)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    child = os.fork()
    if child == 0:
        conn, _ = listener.accept()
        while conn.recv(1 << 20):
            pass
        os._exit(0)
    sock = socket.create_connection(("127.0.0.1", port))
    block = b"\0" * (1 << 20)
    sent, start = 0, time.time()
    while time.time() - start < seconds:
        sock.sendall(block)
        sent += len(block)
    elapsed = time.time() - start
    sock.close()
    os.waitpid(child, 0)
    listener.close()
    return sent / elapsed / 1e6


def versions():
    def first_line(argv):
        try:
            out = subprocess.run(argv, capture_output=True, text=True)
            return (out.stdout or out.stderr).strip().splitlines()[0]
        except OSError:
            return "missing"
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return [f"netblk {commit}", first_line(["fio", "--version"]), first_line(["nbdkit", "--version"]),
            first_line(["qemu-nbd", "--version"]), f"kernel {os.uname().release}", f"{os.cpu_count()} CPUs"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s runs; writes RESULTS-quick.md")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--runtime", type=int, default=None, help="seconds per fio run")
    parser.add_argument("--only", nargs="*", help="workload names or prefixes")
    parser.add_argument("--servers", nargs="*", help="server names to include")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    runtime = args.runtime or (2 if args.quick else 5)
    if not os.path.exists(NETBLK):
        subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True)
    selected = {k: v for k, v in workloads().items() if not args.only or any(k.startswith(o) for o in args.only)}
    scratch = tempfile.mkdtemp(prefix="netblk-bench-", dir="/var/tmp")
    backing = os.path.join(scratch, "disk.img")
    with open(backing, "wb") as f:  # real data, so reads are not served from holes
        block = os.urandom(1 << 20)
        for _ in range(SIZE >> 20):
            f.write(block)
    results = {}  # (workload, server) -> [run results]
    errors = {}
    started = time.time()
    ceiling = loopback_ceiling()
    try:
        for name, (job, servers) in selected.items():
            servers = [s for s in servers if not args.servers or s in args.servers]
            for r in range(rounds):
                for server in servers:
                    key = (name, server)
                    try:
                        results.setdefault(key, []).append(one_run(name, job, server, backing, runtime, scratch))
                    except Exception as e:  # a failed run is reported, not fatal
                        errors[key] = str(e)
                    print(f"[{time.time() - started:6.0f}s] {name} round {r + 1} {server}: "
                          f"{fmt(results.get(key, [{}])[-1].get('iops'))} IOPS" if key not in errors else f"{name} {server}: {errors[key]}",
                          flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    write_report(args, selected, results, errors, rounds, runtime, ceiling, time.time() - started)


def med(results, key, field):
    return median_range([r.get(field) for r in results.get(key, [])])[0]


def write_report(args, selected, results, errors, rounds, runtime, ceiling, elapsed):
    out = os.path.join(ROOT, "bench", "RESULTS-quick.md" if args.quick else "RESULTS.md")
    plots = os.path.join(ROOT, "bench", "plots")
    os.makedirs(plots, exist_ok=True)
    lines = ["# Benchmark results", "",
             f"Generated by `bench/bench.py` ({rounds} rounds of {runtime} s per server and workload, servers "
             f"interleaved, {elapsed / 60:.0f} min). Medians with min–max. CPU is the server's own "
             "utime+stime per million requests. Memory exports are filled with data before each run. Backing for file rows: a 512 MiB file of random data on "
             "/var/tmp; this VM's disk is backed by host memory, so O_DIRECT and flushes are far "
             "faster than on real media.", "", "Machine: " + "; ".join(versions()), "",
             f"Loopback ceiling (1 MiB sends between two processes; iperf3 is not installed): {ceiling:,.0f} MB/s", ""]
    lines += ["| workload | server | IOPS (min–max) | MB/s | mean lat µs | CPU s / M req | delayed ACKs | retrans |",
              "|---|---|---|---|---|---|---|---|"]
    for name, (_, servers) in selected.items():
        for server in servers:
            key = (name, server)
            if key in errors and key not in results:
                lines.append(f"| {name} | {server} | error: {errors[key][:80]} | | | | | |")
                continue
            runs = results.get(key, [])
            if not runs:
                continue
            iops, lo, hi = median_range([r["iops"] for r in runs])
            mbps = median_range([r["mbps"] for r in runs])[0]
            lat = median_range([r["lat_us"] for r in runs])[0]
            cpu = median_range([r["cpu_per_mreq"] for r in runs])[0]
            dack = sum(r["tcp"].get("TcpExtDelayedACKs", 0) for r in runs)
            retr = sum(r["tcp"].get("TcpRetransSegs", 0) for r in runs)
            lines.append(f"| {name} | {server} | {fmt(iops)} ({fmt(lo)}–{fmt(hi)}) | {fmt(mbps)} | {fmt(lat, 1)} | "
                         f"{fmt(cpu, 2)} | {dack} | {retr} |")
    lines += ["", "## Targets (issue 3)", "", "| target | measured | verdict |", "|---|---|---|"]

    def ratio(a, b):
        return a / b if a is not None and b else None

    def target(text, value, ok, shown):
        if value is None:
            lines.append(f"| {text} | not measured | – |")
        else:
            lines.append(f"| {text} | {shown} | {'PASS' if ok else 'FAIL'} |")

    for kind in ("mem", "file"):
        r = ratio(med(results, ("randread-qd32", f"netblk-{kind}"), "cpu_per_mreq"),
                  med(results, ("randread-qd32", f"nbdkit-{kind}"), "cpu_per_mreq"))
        target(f"CPU per 4 KiB read at QD32 ≤ 0.5× nbdkit ({kind})", r, r is not None and r <= 0.5, f"{fmt(r, 2)}×")
        for w in ("randread-qd1", "randread-qd32", "randread-qd256", "randread-4x32"):
            r = ratio(med(results, (w, f"netblk-{kind}"), "iops"), med(results, (w, f"nbdkit-{kind}"), "iops"))
            target(f"{w} IOPS ≥ nbdkit ({kind})", r, r is not None and r >= 1.0, f"{fmt(r, 2)}×")
        r = ratio(med(results, ("randread-qd256", f"netblk-{kind}"), "iops"), med(results, ("randread-qd32", f"netblk-{kind}"), "iops"))
        target(f"IOPS at QD256 ≥ IOPS at QD32 ({kind})", r, r is not None and r >= 1.0, f"{fmt(r, 2)}×")
        r = ratio(med(results, ("randread-qd1", f"netblk-{kind}"), "lat_us"), med(results, ("randread-qd1", f"nbdkit-{kind}"), "lat_us"))
        target(f"mean latency at QD1 ≤ nbdkit ({kind})", r, r is not None and r <= 1.0, f"{fmt(r, 2)}×")
    for w, q, l, text in (("randread-qd32", 1.5, 0.9, "4 KiB randread QD32"), ("randwrite-qd32", 2.0, 0.7, "4 KiB randwrite QD32"),
                          ("write-fsync-qd1", 1.5, 0.6, "write+fsync QD1")):
        r = ratio(med(results, (w, "netblk-direct"), "iops"), med(results, (w, "qemu-nbd-file"), "iops"))
        target(f"--cache=none {text} ≥ {q}× qemu-nbd --cache=none", r, r is not None and r >= q, f"{fmt(r, 2)}×")
        r = ratio(med(results, (w, "netblk-direct"), "iops"), med(results, (w, LOCAL), "iops"))
        target(f"--cache=none {text} ≥ {int(l * 100)}% of local", r, r is not None and r >= l, f"{fmt(r * 100 if r else None)}%")
    figures = []
    for direction in ("read", "write"):
        sizes = ["4k", "64k", "256k", "1m", "4m", "32m"]
        ours = [med(results, (f"curve-{direction}-{bs}", "netblk-mem"), "mbps") for bs in sizes]
        theirs = [med(results, (f"curve-{direction}-{bs}", "nbdkit-mem"), "mbps") for bs in sizes]
        if any(v is not None for v in ours):
            best = max(v for v in ours if v is not None)
            flat = [v / best for v, bs in zip(ours, sizes) if v is not None and bs != "4k"]
            target(f"sequential {direction} 64k–32m ≥ 90% of best size", min(flat) if flat else None,
                   bool(flat) and min(flat) >= 0.9, f"worst {fmt(min(flat) * 100 if flat else None)}%")
            beats = [a / b for a, b, bs in zip(ours, theirs, sizes) if a and b and bs != "4k"]
            target(f"sequential {direction} 64k–32m ≥ nbdkit at each size", min(beats) if beats else None,
                   bool(beats) and min(beats) >= 1.0, f"worst {fmt(min(beats) if beats else None, 2)}×")
            at_1m = ours[sizes.index("1m")]
            r = ratio(at_1m, ceiling)
            target(f"sequential {direction} at 1 MiB ≥ 80% of loopback ceiling", r, r is not None and r >= 0.8, f"{fmt(r * 100 if r else None)}%")
            svg_lines(os.path.join(plots, f"seq-{direction}.svg"), f"Sequential {direction}, iodepth 8 (MB/s)",
                      sizes, {"netblk": ours, "nbdkit": theirs}, "MB/s")
            figures.append(f"![sequential {direction}](plots/seq-{direction}.svg)")
    for figure in figures:
        lines += ["", figure]
    lines += ["", "## fio command lines", "",
              "Every run: `fio --name=bench --size=1g --time_based --runtime=R --ramp_time=1 --output-format=json "
              "--ioengine=nbd --uri=nbd://127.0.0.1:PORT` plus the workload's arguments (the local row uses "
              "`--ioengine=io_uring --direct=1 --filename=FILE` instead):", ""]
    for name, (job, _) in selected.items():
        lines.append(f"- {name}: `{' '.join(job)}`")
    lines += kept_sections(out)
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out}")


def kept_sections(path):
    """Sections other scripts own (`<!-- NAME:begin -->` … `<!-- NAME:end -->`), carried over
    from the old report unchanged: bench/flush.py, bench/replication.py, and the history."""
    if not os.path.exists(path):
        return []
    text = open(path).read()
    kept = []
    for match in re.finditer(r"<!-- (\w+):begin -->.*?<!-- \1:end -->", text, re.S):
        kept += ["", match.group(0)]
    return kept


if __name__ == "__main__":
    sys.exit(main())
