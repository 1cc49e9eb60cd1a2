#!/usr/bin/python3
"""Replication cost: netblk with a synchronous (protocol C) replica in another network
namespace, against the same netblk without one, on the same machine in the same run.

    bench/replication.py            # full run, about 12 minutes
    bench/replication.py --quick    # smoke run, about 3 minutes

Two namespaces joined by a veth pair: the primary in one, the secondary in the other. The
clients (a libnbd script, fio, nbdfuse) talk to the primary over a Unix socket, so the only
TCP in the picture is the replication link, and the unreplicated row (plain `netblk serve` on
a Unix socket in the primary's namespace) has the same client path. Measured:

- the round trip of the link (a 64-byte TCP ping-pong with TCP_NODELAY) and its throughput
  (iperf3, 1 MiB writes);
- 4 KiB FUA writes at queue depth 1 (a python-libnbd loop): mean, percentiles, the slowest
  of all, and the kernel's delayed-ACK and retransmission counters of both namespaces (nstat);
- 1 MiB sequential writes at queue depth 8 (fio's nbd engine);
- pgbench on PostgreSQL whose data directory is on ext4 through nbdfuse and a loop device;
- resync of a device with 10% of it out of sync, unthrottled, as a share of the link.

Writes its section into bench/RESULTS.md between the replication markers (the rest of the file
is left alone). Needs root (namespaces, loop devices, mounts). Every process it starts is
stopped by its own PID; the namespaces, mounts and loop devices are removed at the end.
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
from datetime import datetime

import bench
from sections import write_section

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# NETBLK_BIN names the binary outright, as in bench.py; else where `cargo build --release` puts it.
NETBLK = os.environ.get("NETBLK_BIN") or os.path.join(
    os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target"), "release", "netblk")
RESULTS = os.path.join(HERE, "RESULTS.md")
# Named after this run's PID: a second run (or anyone else's namespaces) must not tear
# down this one's (make_namespaces deletes namespaces of these names first).
NS = (f"nbrA{os.getpid()}", f"nbrB{os.getpid()}")
VETH = (f"nbvA{os.getpid()}", f"nbvB{os.getpid()}")
ADDR = ("10.233.0.1", "10.233.0.2")
PG_BIN = "/usr/lib/postgresql/15/bin"
PROTOCOL = ["C"]  # set from --protocol
EXTRA_SERVE_ARGS = []  # from --threads


def log(message):
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def sh(argv, check=True, **kw):
    result = subprocess.run(argv, check=False, text=True, capture_output=True, **kw)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}:\n{result.stdout[-2000:]}"
                           f"\n{result.stderr[-2000:]}")
    return result


def in_ns(ns, argv):
    return ["ip", "netns", "exec", ns] + list(argv)


# ---- namespaces ----

def make_namespaces():
    remove_namespaces()
    sh(["ip", "netns", "add", NS[0]])
    sh(["ip", "netns", "add", NS[1]])
    sh(["ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1]])
    for i in (0, 1):
        sh(["ip", "link", "set", VETH[i], "netns", NS[i]])
        sh(["ip", "-n", NS[i], "addr", "add", f"{ADDR[i]}/24", "dev", VETH[i]])
        sh(["ip", "-n", NS[i], "link", "set", VETH[i], "up"])
        sh(["ip", "-n", NS[i], "link", "set", "lo", "up"])


def shape_link(rate):
    """Limits each direction of the veth pair to `rate` (tc's units, e.g. 4gbit) with a token
    bucket, so the link rather than the two shared CPUs is the bottleneck, as on real hosts."""
    bits = parse_rate(rate)
    burst = max(bits // 8 // 250, 256 * 1024)  # 4 ms of tokens, at least four 64 KiB GSO segments
    for i in (0, 1):
        sh(["tc", "-n", NS[i], "qdisc", "add", "dev", VETH[i], "root", "tbf", "rate", rate,
            "burst", str(burst), "latency", "20ms"])


def parse_rate(rate):
    """Bits per second of a tc rate such as 4gbit, 500mbit or 100kbit."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if not m:
        raise SystemExit(f"--link-rate {rate}: give bits per second as tc does, e.g. 4gbit")
    return int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)])


def remove_namespaces():
    for ns in NS:
        sh(["ip", "netns", "del", ns], check=False)


def remove_stale_namespaces():
    """Deletes the namespaces a run that died without its cleanup (SIGKILL, a crash) left:
    those named after a PID that is no longer running (review, session 66: they piled up),
    with what still runs in them."""
    listed = sh(["ip", "netns", "list"], check=False).stdout
    for name in re.findall(r"^(nbr[AB](\d+))\b", listed, flags=re.M):
        ns, pid = name[0], int(name[1])
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            # The servers, iperf3 and postgres that run started inside it outlived it (a
            # killed parent does not take them along) and would keep the namespace, its
            # veth and their files alive (re-review, session 67).
            left = sh(["ip", "netns", "pids", ns], check=False).stdout.split()
            log(f"deleting namespace {ns}, left by a run (pid {pid}) that is gone, "
                f"and the {len(left)} processes still in it")
            for orphan in left:
                try:
                    os.kill(int(orphan), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh(["ip", "netns", "del", ns], check=False)
        except PermissionError:
            pass


def tcp_counters(ns):
    """Absolute TcpExt DelayedACKs and TCP retransmitted segments of a namespace (nstat)."""
    out = sh(in_ns(ns, ["nstat", "-asz", "TcpExtDelayedACKs", "TcpRetransSegs"]),
             env={**os.environ, "NSTAT_HISTORY": "/dev/null"}).stdout
    values = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("TcpExtDelayedACKs", "TcpRetransSegs"):
            values[parts[0]] = int(parts[1])
    return values.get("TcpExtDelayedACKs", 0), values.get("TcpRetransSegs", 0)


def counters():
    return [tcp_counters(ns) for ns in NS]


def counter_delta(before, after):
    delayed = sum(a[0] - b[0] for a, b in zip(after, before))
    retrans = sum(a[1] - b[1] for a, b in zip(after, before))
    return delayed, retrans


# ---- link measurements ----

PING_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("{addr}", 7099)); s.listen(1)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(64)
    if not b:
        break
    c.sendall(b)
"""


def link_round_trip(count):
    """Median and mean round trip (µs) of a 64-byte TCP ping-pong across the veth link."""
    server = subprocess.Popen(in_ns(NS[1], ["python3", "-c", PING_SERVER.format(addr=ADDR[1])]),
                              start_new_session=True)
    client = f"""
import socket, time, json, statistics
for _ in range(100):
    try:
        s = socket.create_connection(("{ADDR[1]}", 7099)); break
    except OSError:
        time.sleep(0.05)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
lat = []
for i in range({count}):
    t = time.perf_counter_ns(); s.sendall(b"x" * 64)
    got = 0
    while got < 64:
        got += len(s.recv(64 - got))
    lat.append((time.perf_counter_ns() - t) / 1000)
s.close()
print(json.dumps([statistics.median(lat), statistics.mean(lat)]))
"""
    try:
        out = sh(in_ns(NS[0], ["python3", "-c", client]), timeout=120).stdout
        return json.loads(out)
    finally:
        server.wait(10)


def iperf3_link(seconds):
    """Bytes per second of one TCP stream across the link with 1 MiB writes (iperf3)."""
    server = subprocess.Popen(in_ns(NS[1], ["iperf3", "-s", "-1", "-B", ADDR[1], "-p", "5299"]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    try:
        for _ in range(100):
            result = sh(in_ns(NS[0], ["iperf3", "-c", ADDR[1], "-p", "5299", "-t", str(seconds),
                                      "-l", "1M", "-J"]), check=False)
            try:
                return json.loads(result.stdout)["end"]["sum_received"]["bits_per_second"] / 8
            except (ValueError, KeyError):
                time.sleep(0.1)  # the server was not listening yet
        raise RuntimeError(f"iperf3 failed: {result.stdout} {result.stderr}")
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGTERM)
        server.wait(10)


# ---- servers ----

class Proc:
    """A process started by this script, stopped by its own PID."""

    def __init__(self, argv, log_path):
        self.log_path = log_path
        self.log_file = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log_file,
                                     stderr=self.log_file, start_new_session=True)

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def wait_for(self, needle, count=1, timeout=120):
        deadline = time.time() + timeout
        while self.log().count(needle) < count:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited ({self.proc.returncode}) waiting for {needle!r}:\n{self.log()}")
            if time.time() > deadline:
                raise RuntimeError(f"no {needle!r} after {timeout} s:\n{self.log()[-3000:]}")
            time.sleep(0.02)

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log_file.close()


def wait_socket(path, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on {path}")


def allocate(path, size):
    """Writes zeroes over the whole file and makes them durable."""
    count = int(size.rstrip("G")) * 1024
    sh(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={count}", "conv=fsync", "status=none"])


class Setup:
    """One export in the primary's namespace, with or without a replica."""

    def __init__(self, replicated, work, size, resync_rate="100G", secondary_dir=None, memory=False,
                 allocated=False):
        """`allocated`: write every block of the backing files first, as a disk or a laid-out
        image is; a sparse file's first write to a hole allocates blocks, and the FUA write's
        fdatasync then commits the ext4 journal, which both nodes share on this VM."""
        self.replicated = replicated
        self.dir = tempfile.mkdtemp(prefix="repl-" if replicated else "plain-", dir=work)
        os.chmod(self.dir, 0o755)  # PostgreSQL runs as its own user below this
        self.socket = os.path.join(self.dir, "alpha.sock")
        self.size = size
        self.procs = []
        if secondary_dir:
            secondary_dir = tempfile.mkdtemp(prefix="beta-", dir=secondary_dir)
            self.cleanup_dirs = [secondary_dir]
        else:
            self.cleanup_dirs = []
        if replicated:
            self.config = os.path.join(self.dir, "r.toml")
            with open(self.config, "w") as f:
                f.write(f'[resource]\nname = "bench"\nsize = "{size}"\n'
                        f'peer_timeout = "3s"\nresync_rate = "{resync_rate}"\nprotocol = "{PROTOCOL[0]}"\n')
                for name, addr in (("alpha", ADDR[0]), ("beta", ADDR[1])):
                    data = secondary_dir if (name == "beta" and secondary_dir) else self.dir
                    backing = f"memory:{size}" if memory else f"{data}/{name}.img"
                    if allocated and not memory:
                        allocate(backing, size)
                    f.write(f'\n[[node]]\nname = "{name}"\nreplication = "{addr}:7788"\n'
                            f'listen = "unix:{self.dir}/{name}.sock"\n'
                            f'backing = "{backing}"\nmetadata = "{data}/{name}.meta"\n')
            self.primary = self.node("alpha", True)
            self.secondary = self.node("beta", False)
            self.take_primary()
            self.wait_replicating()
        else:
            image = os.path.join(self.dir, "plain.img")
            if allocated and not memory:
                allocate(image, size)
            self.primary = self.proc(in_ns(NS[0], [NETBLK, "serve", *EXTRA_SERVE_ARGS, "--size", size, "--listen",
                                                   f"unix:{self.socket}",
                                                   f"memory:{size}" if memory else image]), "plain.log")
        wait_socket(self.socket)

    def proc(self, argv, name):
        p = Proc(argv, os.path.join(self.dir, name))
        self.procs.append(p)
        return p

    def status(self, node):
        """`netblk status --json` of `node`'s state, or {} while it does not answer."""
        out = subprocess.run([NETBLK, "status", "--config", self.config, "--node", node, "--json"],
                             capture_output=True, text=True)
        try:
            return json.loads(out.stdout).get("status") or {}
        except (ValueError, AttributeError):
            return {}

    def take_primary(self, timeout=60):
        """Until alpha is primary. Its `--primary` is refused over backings that held data
        before their metadata (every allocated image here: "did not start blank"), as it
        should be; the bench then does what the README tells an operator to do for the
        first primary over existing disks, `netblk promote --force`. (Until a72d78a the
        bench waited for the secondary's log and failed after 120 s instead.)"""
        deadline = time.time() + timeout
        forced = False
        while self.status("alpha").get("role", "").lower() != "primary":
            if not forced and "--primary refused" in self.primary.log():
                subprocess.run([NETBLK, "promote", "--force", "--config", self.config, "--node", "alpha"],
                               check=True, capture_output=True)
                forced = True
            if time.time() > deadline:
                raise RuntimeError(f"alpha not primary after {timeout} s:\n{self.primary.log()[-3000:]}")
            time.sleep(0.05)

    def wait_replicating(self, timeout=120):
        """Until the secondary is up to date and the primary replicates to it, by their status.
        (Not by its log's "in sync with the primary", which is logged only at the end of
        a resync.)"""
        deadline = time.time() + timeout
        while True:
            if self.secondary.proc.poll() is not None:
                raise RuntimeError(f"beta exited ({self.secondary.proc.returncode}):\n{self.secondary.log()}")
            beta = self.status("beta")
            peers = self.status("alpha").get("peers", [])
            if beta.get("disk") == "UpToDate" and any(
                    p.get("name") == "beta" and p.get("replicating") and not p.get("resync_running")
                    for p in peers):
                return
            if time.time() > deadline:
                raise RuntimeError(f"beta not replicating after {timeout} s: {beta}, alpha's peers {peers}")
            time.sleep(0.05)

    def node(self, name, primary):
        argv = [NETBLK, "serve", *EXTRA_SERVE_ARGS, "--config", self.config, "--node", name]
        if primary:
            argv.append("--primary")
        ns = NS[0] if name == "alpha" else NS[1]
        return self.proc(in_ns(ns, argv), f"{name}-{len(self.procs)}.log")

    @property
    def uri(self):
        return f"nbd+unix:///?socket={self.socket}"

    def stop(self):
        for p in reversed(self.procs):
            p.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        for d in self.cleanup_dirs:
            shutil.rmtree(d, ignore_errors=True)


# ---- workloads ----

FUA_SCRIPT = """
import nbd, sys, time, json, random
h = nbd.NBD()
h.connect_uri(sys.argv[1])
count = int(sys.argv[2])
blocks = h.get_size() // 4096
buf = bytearray(random.randbytes(4096))
rng = random.Random(7)
# Warm up: one write in every 4 MiB extent, so the measured writes see the steady state
# (every extent already in the replication activity log, as on a running system).
for extent in range(h.get_size() // (4 << 20)):
    h.pwrite(buf, extent * (4 << 20), nbd.CMD_FLAG_FUA)
lat = []
for i in range(count):
    off = rng.randrange(blocks) * 4096
    t = time.perf_counter_ns()
    h.pwrite(buf, off, nbd.CMD_FLAG_FUA)
    lat.append((time.perf_counter_ns() - t) / 1000)
h.shutdown()
lat.sort()
print(json.dumps({"mean": sum(lat) / len(lat), "p50": lat[len(lat) // 2],
                  "p99": lat[int(len(lat) * 0.99)], "p999": lat[int(len(lat) * 0.999)],
                  "max": lat[-1], "over_10ms": sum(1 for x in lat if x > 10000), "count": count}))
"""


def fua_latency(setup, count):
    before = counters()
    out = sh(["/usr/bin/python3", "-c", FUA_SCRIPT, setup.uri, str(count)], timeout=600).stdout
    result = json.loads(out)
    result["delayed_acks"], result["retrans"] = counter_delta(before, counters())
    return result


def seq_write(setup, runtime):
    before = counters()
    out = sh(["fio", "--name=seq", "--ioengine=nbd", f"--uri={setup.uri}", "--rw=write",
              "--bs=1m", "--iodepth=8", "--size=1g", "--time_based", f"--runtime={runtime}",
              "--ramp_time=1", "--output-format=json"], timeout=600).stdout
    report = json.loads(out[out.index("{"):])
    delayed, retrans = counter_delta(before, counters())
    return {"bytes_per_s": report["jobs"][0]["write"]["bw_bytes"], "delayed_acks": delayed,
            "retrans": retrans}


class FileSystem:
    """ext4 on a loop device over nbdfuse over the export; torn down in reverse."""

    def __init__(self, setup):
        self.dir = tempfile.mkdtemp(prefix="fs-", dir=setup.dir)
        os.chmod(self.dir, 0o755)
        # nbdfuse mounts over the directory that holds its file: keep the ext4 mount point
        # out of that directory.
        os.mkdir(os.path.join(self.dir, "fuse"))
        self.fuse_file = os.path.join(self.dir, "fuse", "disk")
        self.mount = os.path.join(self.dir, "mnt")
        os.mkdir(self.mount)
        self.loop = None
        self.mounted = False
        self.nbdfuse = Proc(["nbdfuse", self.fuse_file, setup.uri], os.path.join(self.dir, "nbdfuse.log"))
        try:
            deadline = time.time() + 20
            while not (os.path.exists(self.fuse_file) and os.path.getsize(self.fuse_file) > 0):
                if time.time() > deadline or self.nbdfuse.proc.poll() is not None:
                    raise RuntimeError("nbdfuse did not start: " + self.nbdfuse.log())
                time.sleep(0.05)
            self.loop = sh(["losetup", "-f", "--show", self.fuse_file]).stdout.strip()
            sh(["mkfs.ext4", "-q", "-F", self.loop])
            sh(["mount", self.loop, self.mount])
            self.mounted = True
        except BaseException:
            self.close()
            raise

    def close(self):
        if self.mounted:
            sh(["umount", self.mount], check=False)
        if self.loop:
            sh(["losetup", "-d", self.loop], check=False)
        for _ in range(100):
            if sh(["fusermount3", "-u", os.path.dirname(self.fuse_file)], check=False).returncode == 0:
                break
            time.sleep(0.1)
        try:
            self.nbdfuse.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.nbdfuse.stop()
        self.nbdfuse.log_file.close()


def pgbench(setup, scale, clients, seconds):
    """TPS of pgbench (TPC-B like) with PostgreSQL's data directory on the export."""
    fs = FileSystem(setup)
    sock_dir = tempfile.mkdtemp(prefix="pgsock-")
    os.chmod(sock_dir, 0o777)
    data = os.path.join(fs.mount, "pg")
    os.mkdir(data)
    shutil.chown(data, "postgres", "postgres")
    as_pg = ["runuser", "-u", "postgres", "--"]
    port = "5499"
    started = False
    try:
        sh(as_pg + [f"{PG_BIN}/initdb", "-D", data, "-A", "trust", "-U", "postgres"])
        sh(as_pg + [f"{PG_BIN}/pg_ctl", "-D", data, "-l", os.path.join(sock_dir, "pg.log"), "-w",
                    "-o", f"-k {sock_dir} -p {port} -c listen_addresses='' -c shared_buffers=128MB",
                    "start"])
        started = True
        conn = ["-h", sock_dir, "-p", port, "-U", "postgres"]
        sh(as_pg + ["pgbench", "-i", "-q", "-s", str(scale)] + conn + ["postgres"], timeout=900)
        out = sh(as_pg + ["pgbench", "-c", str(clients), "-j", "2", "-T", str(seconds)] + conn +
                 ["postgres"], timeout=seconds + 300).stdout
        match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", out)
        if not match:
            raise RuntimeError("no tps in pgbench output:\n" + out)
        return float(match.group(1))
    finally:
        if started:
            sh(as_pg + [f"{PG_BIN}/pg_ctl", "-D", data, "-m", "fast", "-w", "stop"], check=False)
        fs.close()
        shutil.rmtree(sock_dir, ignore_errors=True)


def log_time(line):
    stamp = re.match(r"^(\S+?)Z?\s", line).group(1)
    return datetime.fromisoformat(stamp[:26]).timestamp()


def resync(work, size, fraction_step_mib):
    """Seconds and bytes of one unthrottled resync after the secondary missed 1 MiB of every
    `fraction_step_mib` MiB."""
    setup = Setup(True, work, size)
    try:
        setup.secondary.stop()
        setup.procs.remove(setup.secondary)
        setup.primary.wait_for("going on degraded")
        sh(["fio", "--name=oos", "--ioengine=nbd", f"--uri={setup.uri}",
            f"--rw=write:{fraction_step_mib - 1}m", "--bs=1m", "--iodepth=8", f"--size={size}",
            "--refill_buffers", "--output-format=json"], timeout=900)
        done_before = setup.primary.log().count("resync done")
        before = counters()
        setup.secondary = setup.node("beta", False)
        setup.primary.wait_for("resync done", done_before + 1, timeout=900)
        delayed, retrans = counter_delta(before, counters())
        lines = setup.primary.log().splitlines()
        start = [l for l in lines if "bytes out of sync" in l and "resync:" in l][-1]
        done = [l for l in lines if "resync done" in l][-1]
        out_of_sync = int(re.search(r"resync: (\d+) bytes out of sync", start).group(1))
        sent = int(re.search(r"resync done: (\d+) bytes sent", done).group(1))
        seconds = log_time(done) - log_time(start)
        setup.secondary.wait_for("in sync with the primary")
        return {"out_of_sync": out_of_sync, "sent": sent, "seconds": seconds,
                "delayed_acks": delayed, "retrans": retrans}
    finally:
        setup.stop()


# ---- report ----

def med(values):
    return statistics.median(values)


def spread(values, fmt):
    return f"{fmt(med(values))} ({fmt(min(values))}–{fmt(max(values))})"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--skip", nargs="*", default=[], choices=["fua", "seq", "pgbench", "resync"])
    parser.add_argument("--secondary-dir", help="a directory on another file system for the secondary's "
                        "backing and metadata (a diagnostic: by default both nodes share /var/tmp, so "
                        "their fdatasyncs share one ext4 journal, as no two real hosts would)")
    parser.add_argument("--protocol", choices=["A", "B", "C"], default="C",
                        help="replication protocol (the targets are for C)")
    parser.add_argument("--memory", action="store_true", help="memory backends on every node (a diagnostic: "
                        "the protocol's cost without any disk)")
    parser.add_argument("--work-dir", default="/var/tmp", help="where the backings and metadata go "
                        "(a diagnostic: /dev/shm takes the disk out)")
    parser.add_argument("--sparse", action="store_true", help="leave the FUA and sequential runs' "
                        "backing files sparse (a diagnostic: first writes to holes then commit the "
                        "journal that both nodes share here)")
    parser.add_argument("--threads", type=int, help="tokio worker threads per node (a diagnostic: "
                        "the default is one per core)")
    parser.add_argument("--link-rate", help="shape the veth link to this rate with tc tbf (e.g. 4gbit), "
                        "so the link and not the two shared CPUs is the bottleneck; the report goes "
                        "to its own section of RESULTS.md")
    parser.add_argument("--no-write", action="store_true", help="print, do not write RESULTS.md")
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the finally blocks unmount, detach and stop
    # what this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))
    PROTOCOL[0] = args.protocol
    if args.threads:
        EXTRA_SERVE_ARGS.extend(["--threads", str(args.threads)])
    if os.geteuid() != 0:
        sys.exit("needs root: network namespaces, loop devices and mounts")
    for tool in ("iperf3", "fio", "nbdfuse", "nstat", "pgbench", "losetup", "mkfs.ext4"):
        if not shutil.which(tool):
            sys.exit(f"missing {tool}: apt-get install iperf3 fio libnbd-bin python3-libnbd fuse3 "
                     "iproute2 postgresql e2fsprogs util-linux")
    if not os.path.exists(NETBLK):
        sh(["cargo", "build", "--release"], cwd=ROOT)
    with bench.one_run_at_a_time("replication.py"):
        remove_stale_namespaces()
        run(args)


def run(args):
    """Measures, and writes the report (or prints it with --no-write)."""
    quick = args.quick
    rounds = args.rounds or (1 if quick else 3)
    fua_count = 2000 if quick else 20000
    runtime = 3 if quick else 5
    pg = (5, 10) if quick else (10, 30)  # scale, seconds
    resync_size, step = ("1G", 10) if quick else ("4G", 10)
    work = tempfile.mkdtemp(prefix="netblk-repl-bench-", dir=args.work_dir)
    os.chmod(work, 0o755)
    started = time.time()
    results = {"fua": {True: [], False: []}, "seq": {True: [], False: []},
               "pgbench": {True: [], False: []}, "resync": [], "rtt": [], "iperf": []}
    make_namespaces()
    try:
        if args.link_rate:
            shape_link(args.link_rate)
        for r in range(rounds):
            rtt = link_round_trip(2000)
            results["rtt"].append(rtt)
            link = iperf3_link(runtime)
            results["iperf"].append(link)
            log(f"round {r + 1}: link round trip median {rtt[0]:.1f} µs mean {rtt[1]:.1f} µs; "
                f"iperf3 {link / 1e6:,.0f} MB/s")
            for replicated in (False, True):
                name = "replicated" if replicated else "unreplicated"
                if "fua" not in args.skip or "seq" not in args.skip:
                    setup = Setup(replicated, work, "1G", secondary_dir=args.secondary_dir,
                                  memory=args.memory, allocated=not args.sparse)
                    try:
                        if "fua" not in args.skip:
                            fua = fua_latency(setup, fua_count)
                            results["fua"][replicated].append(fua)
                            log(f"  {name} FUA QD1: mean {fua['mean']:.1f} µs, max {fua['max']:.0f} µs, "
                                f"delayed ACKs {fua['delayed_acks']}")
                        if "seq" not in args.skip:
                            seq = seq_write(setup, runtime)
                            results["seq"][replicated].append(seq)
                            log(f"  {name} 1 MiB seq write QD8: {seq['bytes_per_s'] / 1e6:,.0f} MB/s")
                    finally:
                        setup.stop()
                if "pgbench" not in args.skip:
                    setup = Setup(replicated, work, "1G")
                    try:
                        tps = pgbench(setup, pg[0], 4, pg[1])
                        results["pgbench"][replicated].append(tps)
                        log(f"  {name} pgbench: {tps:,.0f} TPS")
                    finally:
                        setup.stop()
            if "resync" not in args.skip:
                rs = resync(work, resync_size, step)
                results["resync"].append(rs)
                log(f"  resync: {rs['out_of_sync'] / 2**20:,.0f} MiB out of sync, "
                    f"{rs['sent'] / 2**20:,.0f} MiB sent in {rs['seconds']:.2f} s")
    finally:
        remove_namespaces()
        shutil.rmtree(work, ignore_errors=True)
    elapsed = time.time() - started
    text = report(results, rounds, fua_count, runtime, pg, resync_size, step, elapsed, quick,
                  args.link_rate)
    if args.no_write:
        print(text)
    else:
        write_section(RESULTS, "replication-shaped" if args.link_rate else "replication", text)
        log(f"wrote {RESULTS} ({elapsed / 60:.1f} min)")


def report(results, rounds, fua_count, runtime, pg, resync_size, step, elapsed, quick, link_rate=None):
    if link_rate:
        lines = [f"## Replication over a link shaped to {link_rate} (`bench/replication.py "
                 f"--link-rate {link_rate}`)", "",
                 f"The same setup as the unshaped run, with each direction of the veth pair limited "
                 f"to {link_rate} by a tc token bucket (tbf), so that the link, not the two CPUs "
                 "that both nodes, both TCP stacks and the clients share, is the bottleneck, as "
                 "between real hosts. The link figures below are measured through the shaper.", ""]
    else:
        lines = ["## Replication (`bench/replication.py`)", ""]
    commit = sh(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=False).stdout.strip()
    lines.append(
        f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at netblk {commit}"
        f"{' (quick run)' if quick else ''}: {rounds} round(s), unreplicated and replicated "
        f"alternating within each round, {elapsed / 60:.1f} min in all. The primary and the "
        f"secondary run in two network namespaces joined by a veth pair (protocol {PROTOCOL[0]}, "
        "`--cache` default for files: writeback); the clients reach the primary over a Unix "
        "socket, so the replication link is the only TCP. The unreplicated row is plain "
        "`netblk serve` on a Unix socket in the primary's namespace. Both namespaces share this "
        "VM's two cores with the clients. Medians, with min–max over rounds.")
    lines.append("")
    targets = []
    rtt_median = med([r[0] for r in results["rtt"]])
    rtt_mean = med([r[1] for r in results["rtt"]])
    link = med(results["iperf"])
    lines.append(f"Link: TCP round trip {spread([r[0] for r in results['rtt']], lambda v: f'{v:.1f}')} µs "
                 f"(median of 2,000 64-byte ping-pongs; mean {rtt_mean:.1f} µs); iperf3 with 1 MiB "
                 f"writes {spread([v / 1e6 for v in results['iperf']], lambda v: f'{v:,.0f}')} MB/s.")
    lines.append("")
    fua = results["fua"]
    if fua[True] and fua[False]:
        lines += [f"### 4 KiB FUA writes at queue depth 1 ({fua_count:,} per run, python-libnbd)", "",
                  "| | mean µs | p50 µs | p99 µs | p99.9 µs | max µs | writes > 10 ms | delayed ACKs | retransmits |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for replicated in (False, True):
            rows = fua[replicated]
            f1 = lambda v: f"{v:,.1f}"
            f0 = lambda v: f"{v:,.0f}"
            lines.append(
                f"| {'replicated' if replicated else 'unreplicated'} | {spread([r['mean'] for r in rows], f1)} "
                f"| {f1(med([r['p50'] for r in rows]))} | {f1(med([r['p99'] for r in rows]))} "
                f"| {f1(med([r['p999'] for r in rows]))} | {f0(max(r['max'] for r in rows))} (worst run) "
                f"| {sum(r['over_10ms'] for r in rows)} | {sum(r['delayed_acks'] for r in rows)} "
                f"| {sum(r['retrans'] for r in rows)} |")
        lines.append("")
        added = med([r["mean"] for r in fua[True]]) - med([r["mean"] for r in fua[False]])
        budget = rtt_median + 50
        targets.append(("FUA QD1: replicated mean − unreplicated ≤ round trip + 50 µs",
                        f"{added:.1f} µs (budget {budget:.1f} µs)", added <= budget))
        worst = max(r["max"] for r in fua[True]) / 1000
        over = sum(r["over_10ms"] for r in fua[True])
        targets.append((f"no replicated FUA write in {fua_count:,} over 10 ms",
                        f"slowest {worst:.2f} ms, {over} over 10 ms, "
                        f"{sum(r['delayed_acks'] for r in fua[True])} delayed ACKs",
                        over == 0))
    seq = results["seq"]
    if seq[True] and seq[False]:
        lines += [f"### 1 MiB sequential writes at queue depth 8 (fio nbd engine, {runtime} s runs)", "",
                  "| | MB/s | delayed ACKs | retransmits |", "|---|---|---|---|"]
        for replicated in (False, True):
            rows = seq[replicated]
            lines.append(f"| {'replicated' if replicated else 'unreplicated'} "
                         f"| {spread([r['bytes_per_s'] / 1e6 for r in rows], lambda v: f'{v:,.0f}')} "
                         f"| {sum(r['delayed_acks'] for r in rows)} | {sum(r['retrans'] for r in rows)} |")
        lines.append("")
        repl = med([r["bytes_per_s"] for r in seq[True]])
        plain = med([r["bytes_per_s"] for r in seq[False]])
        floor = min(plain, link)
        targets.append(("1 MiB seq write QD8: replicated ≥ 90% of min(unreplicated, iperf3)",
                        f"{repl / 1e6:,.0f} MB/s = {100 * repl / floor:.0f}% of {floor / 1e6:,.0f} MB/s",
                        repl >= 0.9 * floor))
    pgb = results["pgbench"]
    if pgb[True] and pgb[False]:
        scale, seconds = pg
        lines += [f"### pgbench (PostgreSQL 15, scale {scale}, 4 clients, {seconds} s; ext4 on "
                  "nbdfuse and a loop device)", "", "| | TPS |", "|---|---|"]
        for replicated in (False, True):
            lines.append(f"| {'replicated' if replicated else 'unreplicated'} "
                         f"| {spread(pgb[replicated], lambda v: f'{v:,.0f}')} |")
        lines.append("")
        ratio = med(pgb[True]) / med(pgb[False])
        targets.append(("pgbench: replicated TPS ≥ 70% of unreplicated", f"{100 * ratio:.0f}%",
                        ratio >= 0.7))
    if results["resync"]:
        rs = results["resync"]
        rates = [r["out_of_sync"] / r["seconds"] for r in rs]
        lines += [f"### Resync, unthrottled: {resync_size} device, 1 MiB of every {step} MiB written "
                  "while the secondary was down", "",
                  "| out of sync MiB | sent MiB | seconds | MB/s | delayed ACKs | retransmits |",
                  "|---|---|---|---|---|---|"]
        for r in rs:
            lines.append(f"| {r['out_of_sync'] / 2**20:,.0f} | {r['sent'] / 2**20:,.0f} | {r['seconds']:.2f} "
                         f"| {r['out_of_sync'] / r['seconds'] / 1e6:,.0f} | {r['delayed_acks']} | {r['retrans']} |")
        lines.append("")
        rate = med(rates)
        targets.append(("resync ≥ 80% of the link (iperf3)",
                        f"{rate / 1e6:,.0f} MB/s = {100 * rate / link:.0f}% of {link / 1e6:,.0f} MB/s",
                        rate >= 0.8 * link))
    lines += ["### Targets (issue 4)", "", "| target | measured | verdict |", "|---|---|---|"]
    for text, measured, ok in targets:
        lines.append(f"| {text} | {measured} | {'PASS' if ok else 'FAIL'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
