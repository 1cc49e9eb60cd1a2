//! One test per client scenario: the standard NBD clients, unchanged, against the real
//! `netblk` binary. qemu-img and qemu-io (qemu 10, extended headers), nbdinfo, nbdcopy,
//! nbdsh and python libnbd, fio's nbd engine over TCP and a Unix socket, a file export
//! stopped with SIGTERM, and ext4 on nbdfuse and a loop device.

mod common;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// `nbdsh` runs the `python3` it finds on PATH; Debian's is the one with libnbd.
const SYSTEM_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

const MIB: usize = 1 << 20;

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

/// Fails with the first differing offset (not 64 MiB of bytes) when two files differ.
fn assert_same_file(actual: &Path, expected: &Path) {
    let (a, e) = (read_all(actual), read_all(expected));
    assert_eq!(
        a.len(),
        e.len(),
        "{} has the wrong length",
        actual.display()
    );
    if let Some(at) = a.iter().zip(&e).position(|(x, y)| x != y) {
        panic!(
            "{} differs from {} at byte {at}",
            actual.display(),
            expected.display()
        );
    }
}

fn qemu_img(args: &[&str]) -> String {
    run_stdout(Command::new("qemu-img").args(args))
}

/// Runs qemu-io commands against `uri` and fails if any of them did.
fn qemu_io(extra: &[&str], commands: &[&str], uri: &str) -> String {
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]).args(extra);
    for c in commands {
        cmd.args(["-c", c]);
    }
    let out = run_stdout(cmd.arg(uri));
    assert!(!out.contains("failed"), "qemu-io {commands:?}:\n{out}");
    out
}

fn nbdinfo(args: &[&str]) -> String {
    run_stdout(Command::new("nbdinfo").args(args))
}

/// `nbdsh -u URI -c SCRIPT`; the script must print `ok` at its end.
fn nbdsh(uri: &str, script: &str) {
    let out = run_stdout(
        Command::new("nbdsh")
            .env("PATH", SYSTEM_PATH)
            .args(["-u", uri, "-c", script]),
    );
    assert!(
        out.lines().any(|l| l == "ok"),
        "script did not finish:\n{out}"
    );
}

/// Like [`nbdsh`], with `base:allocation` requested before connecting.
fn nbdsh_allocation(uri: &str, script: &str) {
    let connect = format!("h.add_meta_context('base:allocation'); h.connect_uri({uri:?})");
    let out = run_stdout(
        Command::new("nbdsh")
            .env("PATH", SYSTEM_PATH)
            .args(["-c", &connect, "-c", script]),
    );
    assert!(
        out.lines().any(|l| l == "ok"),
        "script did not finish:\n{out}"
    );
}

/// Number of connections that reached transmission, from the server's log.
fn transmissions(server: &Server) -> usize {
    server.stderr().matches(" reply=").count()
}

// 1. qemu-img

#[test]
fn qemu_img_info_convert_in_compare_and_convert_out() {
    if !have("qemu-img") {
        return;
    }
    let dir = tempdir();
    let source = dir.path().join("source.img");
    pattern_file(&source, 64 * MIB, 101);
    let server = Server::start(&["memory:64M"]);
    let uri = server.uri();
    let info: serde_json::Value =
        serde_json::from_str(&qemu_img(&["info", "--output=json", &uri])).expect("JSON");
    assert_eq!(info["virtual-size"], 64 * MIB, "{info}");
    qemu_img(&[
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        path_str(&source),
        &uri,
    ]);
    qemu_img(&["compare", "-f", "raw", "-F", "raw", path_str(&source), &uri]);
    let out = dir.path().join("out.img");
    qemu_img(&["convert", "-f", "raw", "-O", "raw", &uri, path_str(&out)]);
    assert_same_file(&out, &source);
}

// 2. qemu-io

#[test]
fn qemu_io_writes_reads_flushes_discards_and_zeroes() {
    let Some(server) = server_for("qemu-io", &["memory:64M"]) else {
        return;
    };
    let out = qemu_io(
        &[],
        &[
            "write -P 0xa5 0 4M",
            "read -P 0xa5 0 4M",
            "flush",
            "discard 0 64k",
            "read -P 0xa5 64k 960k",
            // Zeroes over written data, with and without permission to unmap.
            "write -z 1M 1M",
            "read -P 0 1M 1M",
            "write -z -u 2M 512k",
            "read -P 0 2M 512k",
            "read -P 0xa5 2560k 1536k",
        ],
        &server.uri(),
    );
    assert_eq!(out.matches("read ").count(), 5, "{out}");
    assert_eq!(out.matches("wrote ").count(), 3, "{out}");
    assert_eq!(out.matches("discard ").count(), 1, "{out}");

    // cache=none and FUA writes (`write -f`), overwriting and read back at odd offsets.
    let out = qemu_io(
        &["-t", "none"],
        &[
            "write -f -P 0x3c 8M 1M",
            "write -f -P 0xc3 8389120 4096",
            "read -P 0x3c 8M 512",
            "read -P 0xc3 8389120 4096",
            "read -P 0x3c 8393216 1043968",
            "flush",
        ],
        &server.uri(),
    );
    assert_eq!(out.matches("read ").count(), 3, "{out}");
}

// 3. nbdinfo

#[test]
fn nbdinfo_shows_size_flags_block_sizes_and_description() {
    let Some(server) = server_for(
        "nbdinfo",
        &["--description", "clients test disk", "memory:64M"],
    ) else {
        return;
    };
    let info = nbdinfo(&[&server.uri()]);
    for expected in [
        "export-size: 67108864 (64M)",
        "description: clients test disk",
        "is_read_only: false",
        "can_flush: true",
        "can_multi_conn: true",
        "block_size_maximum: 33554432",
    ] {
        assert!(
            info.lines().any(|l| l.trim() == expected),
            "missing {expected:?} in:\n{info}"
        );
    }
    assert_eq!(nbdinfo(&["--size", &server.uri()]).trim(), "67108864");
}

#[test]
fn nbdinfo_lists_the_exports_of_a_config_file() {
    if !have("nbdinfo") {
        return;
    }
    let dir = tempdir();
    let config = dir.path().join("exports.toml");
    std::fs::write(
        &config,
        r#"listen = ["127.0.0.1:0"]

[[export]]
name = "alpha"
backing = "memory:1M"
description = "the first disk"

[[export]]
name = "beta"
backing = "memory:3M"
description = "the second disk"
read_only = true
"#,
    )
    .unwrap();
    let server = Server::start(&["--config", path_str(&config)]);
    let text = nbdinfo(&["--list", &server.uri()]);
    for expected in [
        "export=\"alpha\"",
        "the first disk",
        "export=\"beta\"",
        "the second disk",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in:\n{text}");
    }
    let json: serde_json::Value =
        serde_json::from_str(&nbdinfo(&["--list", "--json", &server.uri()])).expect("JSON");
    let exports: Vec<_> = json["exports"]
        .as_array()
        .expect("exports")
        .iter()
        .map(|e| {
            (
                e["export-name"].as_str().unwrap().to_string(),
                e["description"].as_str().unwrap().to_string(),
                e["export-size"].as_u64().unwrap(),
                e["is_read_only"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        exports,
        [
            ("alpha".into(), "the first disk".into(), 1 << 20, false),
            ("beta".into(), "the second disk".into(), 3 << 20, true),
        ],
        "{json}"
    );
}

/// `nbdinfo --map` as (offset, length, type, description).
fn map(uri: &str) -> Vec<(u64, u64, u32, String)> {
    nbdinfo(&["--map", uri])
        .lines()
        .map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            assert_eq!(f.len(), 4, "{line}");
            (
                f[0].parse().unwrap(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
                f[3].into(),
            )
        })
        .collect()
}

#[test]
fn nbdinfo_maps_holes_and_data() {
    if !have("nbdinfo") || !have("nbdsh") {
        return;
    }
    let server = Server::start(&["memory:64M"]);
    let uri = server.uri();
    assert_eq!(map(&uri), [(0, 64 << 20, 3, "hole,zero".into())]);
    nbdsh(&uri, "h.pwrite(b'\\x07' * (1 << 20), 1 << 20)\nprint('ok')");
    assert_eq!(
        map(&uri),
        [
            (0, 1 << 20, 3, "hole,zero".into()),
            (1 << 20, 1 << 20, 0, "data".into()),
            (2 << 20, 62 << 20, 3, "hole,zero".into()),
        ]
    );
}

// 4. nbdcopy

#[test]
fn nbdcopy_copies_in_and_out() {
    if !have("nbdcopy") {
        return;
    }
    let dir = tempdir();
    let source = dir.path().join("source.img");
    pattern_file(&source, 32 * MIB, 104);
    let server = Server::start(&["memory:32M"]);
    run(Command::new("nbdcopy").arg(&source).arg(server.uri()));
    nbdcopy_out_matches(&server, &[], dir.path(), &source);
}

/// Copies the whole of `server`'s export into a file in `dir` with nbdcopy and `options`,
/// and asserts that it holds what `expected` holds.
fn nbdcopy_out_matches(server: &Server, options: &[&str], dir: &Path, expected: &Path) {
    let out = dir.join("out.img");
    run(Command::new("nbdcopy")
        .args(options)
        .arg(server.uri())
        .arg(&out));
    assert_same_file(&out, expected);
}

/// A real client reads a cached file export through both of the server's ways out for large
/// cached reads. One connection's splice probe (`server::splice_probe`) splices its first
/// epoch (34 MiB of nbdcopy's 256 KiB requests) and copies the next two from the file's
/// mapping (`backend::mapping`); every byte must match either way.
#[test]
fn nbdcopy_reads_a_cached_file_export_spliced_and_mapped_byte_for_byte() {
    if !have("nbdcopy") {
        return;
    }
    let dir = tempdir();
    let export = dir.path().join("export.img");
    pattern_file(&export, 96 * MIB, 106);
    let server = Server::start(&[path_str(&export)]);
    let options = ["--connections=1", "--request-size=262144"];
    nbdcopy_out_matches(&server, &options, dir.path(), &export);
}

#[test]
fn nbdcopy_uses_four_connections_with_multi_conn() {
    if !have("nbdcopy") {
        return;
    }
    let dir = tempdir();
    let source = dir.path().join("source.img");
    pattern_file(&source, 32 * MIB, 105);
    let server = Server::start(&["memory:32M"]);
    // nbdcopy opens no more connections than it has threads.
    let copy = |from: &dyn AsRef<std::ffi::OsStr>, to: &dyn AsRef<std::ffi::OsStr>| {
        let before = transmissions(&server);
        run(Command::new("nbdcopy")
            .args(["--connections=4", "--threads=4", "--flush"])
            .arg(from)
            .arg(to));
        let opened = transmissions(&server) - before;
        assert!(
            opened >= 4,
            "nbdcopy opened {opened} connections:\n{}",
            server.stderr()
        );
    };
    copy(&source, &server.uri());
    let out = dir.path().join("out.img");
    copy(&server.uri(), &out);
    assert_same_file(&out, &source);
}

/// CPU time in nanoseconds each thread of `pid` named `netblk-conn-*` has used: the
/// scheduler's own count (`schedstat`), which is exact, where the kernel keeps it, else the
/// user and system clock ticks of `stat` (10 ms steps, which a thread with little to do can
/// stay under: a fast run once left one thread at 0 ticks).
fn connection_thread_runtime(pid: u32) -> Vec<u64> {
    let mut runtime = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("the server's threads") {
        let dir = task.expect("a thread").path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if !comm.starts_with("netblk-conn-") {
            continue;
        }
        let scheduled = std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
        runtime.push(scheduled.unwrap_or_else(|| {
            let stat = std::fs::read_to_string(dir.join("stat")).expect("the thread's stat");
            // Fields after the command name (which is in parentheses): utime is the 12th
            // and stime the 13th of them.
            let after = &stat[stat.rfind(')').expect("a command name") + 2..];
            let fields: Vec<&str> = after.split_whitespace().collect();
            let ticks = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
            ticks * 10_000_000
        }));
    }
    runtime
}

#[test]
fn connections_spread_over_the_connection_threads_and_each_serves_correctly() {
    if !have("nbdsh") {
        return;
    }
    let server = Server::start(&["--threads", "2", "memory:256M"]);
    // The threads run before the server says it is listening.
    assert_eq!(
        connection_thread_runtime(server.pid()).len(),
        2,
        "one connection thread per --threads"
    );
    let before = connection_thread_runtime(server.pid());
    // Four connections open at once, so each thread is given two (a new connection goes to
    // the thread with fewer), and every connection works: each writes, flushes and reads
    // back its own quarter on a thread of its own, then one reads all that the others wrote.
    // Not nbdcopy: it hands out work 128 MiB at a time, so over 256 MiB only two of its four
    // connections copy, and which two is up to how its threads start. The nbdcopy version of
    // this test found a server thread that did no work in 1 run of 10 of the whole suite.
    let out = python(
        r#"
import sys, threading, nbd
handles = []
for _ in range(4):
    h = nbd.NBD()
    h.connect_uri(sys.argv[1])
    handles.append(h)
quarter, piece = handles[0].get_size() // 4, 4 << 20
def expected(offset):   # each 4 KiB block holds its own offset
    return b"".join(o.to_bytes(8, "little") * 512 for o in range(offset, offset + piece, 4096))
failures = []
def work(i, h):
    offsets = range(i * quarter, (i + 1) * quarter, piece)
    for offset in offsets:
        h.pwrite(expected(offset), offset)
    h.flush()
    for offset in offsets:
        if h.pread(piece, offset) != expected(offset):
            failures.append(f"connection {i}: wrong data at {offset}")
threads = [threading.Thread(target=work, args=(i, h)) for i, h in enumerate(handles)]
for t in threads:
    t.start()
for t in threads:
    t.join()
for offset in range(0, 4 * quarter, piece):
    if handles[0].pread(piece, offset) != expected(offset):
        failures.append(f"connection 0: wrong data at {offset} after all wrote")
assert not failures, failures[:5]
print("ok")
"#,
        &[&server.uri()],
    );
    assert!(out.lines().any(|l| l == "ok"), "{out}");
    let after = connection_thread_runtime(server.pid());
    // Two connections moving 128 MiB each take far more than a millisecond; a thread that
    // served none stays parked and uses nothing.
    for (thread, (b, a)) in before.iter().zip(&after).enumerate() {
        assert!(
            a.saturating_sub(*b) >= 1_000_000,
            "connection thread {thread} did no work ({b} → {a} ns of CPU):\n{}",
            server.stderr()
        );
    }
}

// 5. nbdsh and python libnbd

#[test]
fn nbdsh_pwrite_pread_with_and_without_fua() {
    let Some(server) = server_for("nbdsh", &["memory:16M"]) else {
        return;
    };
    nbdsh(
        &server.uri(),
        r#"
import os
plain = os.urandom(1 << 20)
h.pwrite(plain, 0)
assert h.pread(len(plain), 0) == plain
fua = os.urandom(3 * 4096 + 17)
h.pwrite(fua, 123457, nbd.CMD_FLAG_FUA)
assert h.can_fua()
assert h.pread(len(fua), 123457) == fua
assert h.pread(123457, 0) == plain[:123457]
end = 123457 + len(fua)
assert h.pread(len(plain) - end, end) == plain[end:]
print("ok")
"#,
    );
}

#[test]
fn nbdsh_flush_trim_zero_and_cache() {
    let Some(server) = server_for("nbdsh", &["memory:16M"]) else {
        return;
    };
    nbdsh(
        &server.uri(),
        r#"
M = 1 << 20
h.pwrite(b'\xff' * (8 * M), 0)
h.flush()
h.trim(M, 0)
assert h.pread(M, M) == b'\xff' * M              # a trim stays in its range
h.zero(M + 4096, M + 512, nbd.CMD_FLAG_NO_HOLE)
assert h.pread(M + 4096, M + 512) == bytes(M + 4096)
assert h.pread(512, M) == b'\xff' * 512
assert h.pread(M, 2 * M + 4608) == b'\xff' * M
h.zero(2 * M, 4 * M, nbd.CMD_FLAG_FAST_ZERO)
assert h.pread(2 * M, 4 * M) == bytes(2 * M)
assert h.pread(2 * M, 6 * M) == b'\xff' * (2 * M)
h.zero(1, 6 * M + 1)                             # one byte, inside a page
assert h.pread(3, 6 * M) == b'\xff\x00\xff'
assert h.can_cache()
h.cache(4 * M, 0)
h.flush()
print("ok")
"#,
    );
}

/// An export that does not advertise fast zeroing (the crash test's powercut cache, which
/// cannot tell fast from slow) refuses a request that asks for it with EINVAL, as the spec
/// says it should, instead of zeroing slowly.
#[test]
fn a_fast_zero_where_none_was_advertised_is_einval() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    let args = [
        "--fault-injection",
        "powercut",
        "--size",
        "16M",
        path.to_str().unwrap(),
    ];
    let Some(server) = server_for("nbdsh", &args) else {
        return;
    };
    nbdsh(
        &server.uri(),
        r#"
assert not h.can_fast_zero()
h.set_strict_mode(0)
try:
    h.zero(1 << 20, 0, nbd.CMD_FLAG_FAST_ZERO)
    raise AssertionError("a fast zero was done")
except nbd.Error as e:
    assert "(EINVAL)" in str(e), e
h.zero(1 << 20, 0)
print("ok")
"#,
    );
}

#[test]
fn nbdsh_block_status_reports_base_allocation_extents() {
    let Some(server) = server_for("nbdsh", &["memory:16M"]) else {
        return;
    };
    nbdsh_allocation(
        &server.uri(),
        r#"
assert h.can_meta_context("base:allocation")
def extents(length, offset, flags=0):
    got = []
    def collect(context, at, entries, err):
        assert context == "base:allocation", context
        assert at == offset, at
        got.extend(zip(entries[0::2], entries[1::2]))
    h.block_status(length, offset, collect, flags)
    return got
S = h.get_size()
assert extents(S, 0) == [(S, 3)], extents(S, 0)
h.pwrite(b'\x01' * 65536, 1 << 20)
h.pwrite(b'\x02' * 65536, 4 << 20)
assert extents(S, 0) == [(1 << 20, 3), (65536, 0), ((3 << 20) - 65536, 3), (65536, 0),
                         (S - (4 << 20) - 65536, 3)], extents(S, 0)
assert extents(65536, 1 << 20) == [(65536, 0)]
one = extents(S, 0, nbd.CMD_FLAG_REQ_ONE)
assert one == [(1 << 20, 3)], one
h.zero(65536, 4 << 20)                          # may punch: reads back as zero
assert extents(65536, 4 << 20)[0][1] & 2 == 2
print("ok")
"#,
    );
}

#[test]
fn nbdsh_zero_with_no_hole_leaves_the_range_allocated() {
    let Some(server) = server_for("nbdsh", &["memory:16M"]) else {
        return;
    };
    nbdsh_allocation(
        &server.uri(),
        r#"
h.pwrite(b'\x01' * (1 << 20), 0)
h.zero(1 << 20, 0, nbd.CMD_FLAG_NO_HOLE)
got = []
h.block_status(1 << 20, 0, lambda c, o, e, err: got.extend(e))
assert got[1] & 1 == 0, got                     # NBD_STATE_HOLE must be clear
print("ok")
"#,
    );
}

#[test]
fn nbdsh_pread_structured_with_df_gets_one_chunk() {
    let Some(server) = server_for("nbdsh", &["memory:16M"]) else {
        return;
    };
    // libnbd 1.14 takes CMD_FLAG_DF only on pread_structured (pread refuses it).
    nbdsh(
        &server.uri(),
        r#"
assert h.can_df()
data = bytes(range(256)) * 256
h.pwrite(data, 0)
chunks = []
def chunk(buf, offset, status, err):
    chunks.append((offset, len(buf), status))
    return 0
got = h.pread_structured(4 << 20, 0, chunk, nbd.CMD_FLAG_DF)
assert chunks == [(0, 4 << 20, nbd.READ_DATA)], chunks
assert got == data + bytes((4 << 20) - len(data))
chunks.clear()
got = h.pread_structured(4 << 20, 0, chunk)
assert got == data + bytes((4 << 20) - len(data))
assert any(s == nbd.READ_HOLE for _, _, s in chunks), chunks
assert sorted(chunks)[0][0] == 0 and sum(n for _, n, _ in chunks) == 4 << 20, chunks
print("ok")
"#,
    );
}

#[test]
fn nbdsh_read_only_export_refuses_writes_with_eperm() {
    let Some(server) = server_for("nbdsh", &["--read-only", "memory:1M"]) else {
        return;
    };
    nbdsh(
        &server.uri(),
        r#"
import errno
assert h.is_read_only()
h.set_strict_mode(0)           # send the commands; the server must refuse them
for name, call in [("pwrite", lambda: h.pwrite(b'x' * 512, 0)),
                   ("trim", lambda: h.trim(4096, 0)),
                   ("zero", lambda: h.zero(4096, 0))]:
    try:
        call()
        raise SystemExit(name + " succeeded on a read-only export")
    except nbd.Error as e:
        assert e.errnum == errno.EPERM, (name, e)
        assert "command failed" in e.string, e.string   # the server's answer, not libnbd's
assert h.pread(512, 0) == bytes(512)
print("ok")
"#,
    );
}

#[test]
fn python_libnbd_completes_200_concurrent_commands() {
    if !have("nbdsh") {
        return;
    }
    // A file export: its large reads go to a thread pool while small ones are served at
    // once from the page cache, so replies come back out of order.
    let dir = tempdir();
    let disk = dir.path().join("disk.img");
    let server = Server::start(&["--size", "16M", path_str(&disk)]);
    let out = python(
        r#"
import sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
B = 4096
block = lambda i: bytes([i % 251]) * (B - 8) + i.to_bytes(8, "little")
A = b"".join(block(i) for i in range(100))
h.pwrite(A, 0)                  # region A [0, 400K): read below; writes go to 8M and up
expected = A + bytes(2 << 20)
done = []
def finished(cookie):
    return lambda err: done.append((cookie, err.value)) or 0
reads, writes, most = {}, {}, 0
for i in range(100):
    # 1 MiB reads among 4 KiB ones: the small ones overtake them.
    n = (1 << 20) if i % 25 == 0 else B
    buf = nbd.Buffer(n)
    reads[i] = (buf, n, h.aio_pread(buf, i * B, completion=finished(("r", i))))
    writes[i] = h.aio_pwrite(block(1000 + i), (8 << 20) + i * B,
                             completion=finished(("w", i)))
    most = max(most, 2 * (i + 1) - len(done))
assert most > 1, most                  # commands really were outstanding together
while h.aio_in_flight() > 0:
    h.poll(-1)
assert len(done) == 200 and all(err == 0 for _, err in done), done
for i, (buf, n, cookie) in reads.items():
    assert h.aio_command_completed(cookie)
    assert buf.to_bytearray() == expected[i * B:i * B + n], i
for i, cookie in writes.items():
    assert h.aio_command_completed(cookie)
assert h.pread(100 * B, 8 << 20) == b"".join(block(1000 + i) for i in range(100))
issued = lambda c: (c[1], c[0] == "w")
order = [c for c, _ in done]
late = sum(1 for a, b in zip(order, order[1:]) if issued(b) < issued(a))
assert late > 0, "every reply came back in order: " + repr(order)
print("ok")
"#,
        &[&server.uri()],
    );
    assert!(out.lines().any(|l| l == "ok"), "{out}");
}

// 6. Extended headers, and simple replies

#[test]
fn qemu_io_negotiates_extended_headers() {
    let Some(server) = server_for("qemu-io", &["memory:64M"]) else {
        return;
    };
    qemu_io(
        &[],
        &[
            "write -P 0x42 3M 5M",
            "read -P 0x42 3M 5M",
            "write -z 4M 1M",
            "read -P 0 4M 1M",
            "read -P 0x42 5M 3M",
        ],
        &server.uri(),
    );
    let log = server.stderr();
    assert!(
        log.lines().any(|l| l.contains("reply=Extended")),
        "qemu did not negotiate extended headers:\n{log}"
    );
}

#[test]
fn python_libnbd_with_simple_replies() {
    let Some(server) = server_for("nbdsh", &["memory:16M"]) else {
        return;
    };
    let out = python(
        r#"
import os, sys, nbd
h = nbd.NBD()
if hasattr(h, "set_request_extended_headers"):   # libnbd >= 1.22 only
    h.set_request_extended_headers(False)
h.set_request_structured_replies(False)
h.connect_uri(sys.argv[1])
assert not h.get_structured_replies_negotiated()
data = os.urandom(5 << 20)
h.pwrite(data, 4096)
assert h.pread(len(data), 4096) == data               # one simple reply, 5 MiB
assert h.pread(4096, 0) == bytes(4096)
h.pwrite(b"\x01" * 100, 7, nbd.CMD_FLAG_FUA)
assert h.pread(110, 0) == bytes(7) + b"\x01" * 100 + bytes(3)
h.shutdown()
# The same data through a second handle that keeps libnbd's default, structured replies.
s = nbd.NBD()
s.connect_uri(sys.argv[1])
assert s.get_structured_replies_negotiated()
assert s.pread(len(data), 4096) == data
s.shutdown()
print("ok")
"#,
        &[&server.uri()],
    );
    assert!(out.lines().any(|l| l == "ok"), "{out}");
    let log = server.stderr();
    let styles: Vec<&str> = log
        .lines()
        .filter_map(|l| l.split(" reply=").nth(1))
        .collect();
    assert_eq!(styles, ["Simple", "Structured"], "{log}");
}

// 7. fio

fn fio_verify(server: &Server, uri: &str) {
    fio_verify_sizes(server, uri, "--bs=4k");
}

/// fio randrw at depth 64 with every block checked by crc32c; `block_sizes` is a fio
/// `--bs` or `--bsrange` argument.
fn fio_verify_sizes(server: &Server, uri: &str, block_sizes: &str) {
    fio_verify_jobs(
        server,
        uri,
        &["--rw=randrw", block_sizes, "--iodepth=64", "--size=64M"],
    );
}

/// fio with `job` (its workload, sizes and depth), every block it writes checked by crc32c;
/// every job (one connection each) must have written and read something, without error.
fn fio_verify_jobs(server: &Server, uri: &str, job: &[&str]) {
    let dir = tempdir();
    let output = dir.path().join("fio.json");
    let uri = format!("--uri={uri}");
    let output_arg = format!("--output={}", output.display());
    let mut args = vec!["--name=x", "--ioengine=nbd", &uri];
    args.extend_from_slice(job);
    args.extend([
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_state_save=0",
        "--output-format=json",
        &output_arg,
    ]);
    run(Command::new("fio").current_dir(dir.path()).args(&args));
    let text = std::fs::read_to_string(&output).expect("fio output");
    let report: serde_json::Value = serde_json::from_str(&text).expect("fio JSON");
    let jobs = report["jobs"].as_array().expect("fio jobs");
    assert!(!jobs.is_empty(), "{text}");
    for job in jobs {
        assert_eq!(job["error"], 0, "{text}");
        for dir in ["read", "write"] {
            let bytes = job[dir]["io_bytes"].as_u64().unwrap_or(0);
            assert!(bytes > 0, "no {dir}s:\n{text}\n{}", server.stderr());
        }
    }
}

#[test]
fn fio_randrw_verifies_at_depth_64_over_tcp() {
    let Some(server) = server_for("fio", &["memory:64M"]) else {
        return;
    };
    fio_verify(&server, &server.uri());
}

/// Writes of 64 KiB to 4 MiB at 64 KiB-aligned offsets: a memory export receives them
/// straight into pages it takes over (`backend::PageStore`); fio checks every block read
/// back, while reads still hold pages that later writes replace.
#[test]
fn fio_verifies_page_aligned_memory_writes_received_into_pages() {
    let Some(server) = server_for("fio", &["memory:64M"]) else {
        return;
    };
    fio_verify_sizes(&server, &server.uri(), "--bsrange=64k-4m");
}

#[test]
fn fio_randrw_verifies_at_depth_64_over_a_unix_socket() {
    if !have("fio") {
        return;
    }
    let dir = tempdir();
    let socket = dir.path().join("nbd.sock");
    let listen = format!("unix:{}", socket.display());
    let server = Server::start(&["--listen", &listen, "memory:64M"]);
    assert_eq!(server.listeners, [listen]);
    fio_verify(
        &server,
        &format!("nbd+unix:///?socket={}", socket.display()),
    );
}

#[test]
fn fio_verifies_direct_io_files_with_sizes_down_to_one_sector() {
    // --cache=none: O_DIRECT through io_uring. 512-byte requests on a file system whose
    // direct-I/O block may be larger go through read-modify-write under a range lock.
    // From 64 KiB on, payloads and read pieces are pooled buffers in the registered arena
    // (READ_FIXED / WRITE_FIXED), and past 4 MiB heap buffers beside them.
    for (cache, sizes) in [
        ("none", "--bsrange=512-64k"),
        ("none", "--bsrange=64k-6m"),
        ("writeback", "--bsrange=512-64k"),
    ] {
        let dir = tempdir();
        let backing = dir.path().join("disk.img");
        let args = ["--cache", cache, "--size", "64M", path_str(&backing)];
        let Some(server) = server_for("fio", &args) else {
            return;
        };
        fio_verify_sizes(&server, &server.uri(), sizes);
    }
}

/// Four connections write unaligned blocks of 512 bytes to 64 KiB at random into regions
/// 1,000 bytes apart, so the direct-I/O blocks at each boundary hold two connections' bytes:
/// their read-modify-writes must lock each other out, or one connection's write undoes
/// the other's (fio checks every block as it goes and at the end).
#[test]
fn fio_verifies_unaligned_direct_writes_from_four_connections_sharing_blocks() {
    let dir = tempdir();
    let backing = dir.path().join("disk.img");
    let args = ["--cache", "none", "--size", "64M", path_str(&backing)];
    let Some(server) = server_for("fio", &args) else {
        return;
    };
    // 8 MiB regions, each starting 1,000 bytes past the end of the one before.
    let step = format!("--offset_increment={}", (8 << 20) + 1000);
    fio_verify_jobs(
        &server,
        &server.uri(),
        &[
            "--numjobs=4",
            "--size=8M",
            &step,
            "--rw=randwrite",
            "--bsrange=512-64k",
            "--bs_unaligned",
            "--iodepth=16",
            "--verify_backlog=256",
            "--verify_fatal=1",
        ],
    );
}

/// Reads of page-cache data of 64 KiB and more are spliced from the file into the socket
/// (no copy); fio checks every block it reads back, over TCP and over a Unix socket.
#[test]
fn fio_verifies_large_cached_file_reads_sent_by_splice() {
    if !have("fio") {
        return;
    }
    let dir = tempdir();
    let backing = dir.path().join("disk.img");
    let socket = dir.path().join("nbd.sock");
    let unix = format!("unix:{}", socket.display());
    let server = Server::start(&[
        "--listen",
        "127.0.0.1:0",
        "--listen",
        &unix,
        "--size",
        "64M",
        path_str(&backing),
    ]);
    fio_verify_sizes(&server, &server.uri(), "--bsrange=64k-2m");
    fio_verify_sizes(
        &server,
        &format!("nbd+unix:///?socket={}", socket.display()),
        "--bsrange=4k-1m",
    );
}

// 8. A file export

#[test]
fn file_export_holds_the_converted_bytes_after_sigterm() {
    if !have("qemu-img") {
        return;
    }
    let dir = tempdir();
    let source = dir.path().join("source.img");
    pattern_file(&source, 64 * MIB, 108);
    let backing = dir.path().join("disk.img");
    let server = Server::start(&["--size", "64M", path_str(&backing)]);
    assert_eq!(std::fs::metadata(&backing).unwrap().len(), 64 << 20);
    let uri = server.uri();
    qemu_img(&[
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        path_str(&source),
        &uri,
    ]);
    qemu_img(&["compare", "-f", "raw", "-F", "raw", path_str(&source), &uri]);
    let status = server.stop();
    assert!(status.success(), "netblk exited with {status}");
    assert_same_file(&backing, &source);
}

/// Keeps 64 writes of 4 KiB in flight, and a FLUSH every 16, each block written once with
/// its own pattern, until the connection ends (argv: host, port, server PID); the server
/// gets SIGTERM after 0.5 s. Prints the blocks whose writes were acknowledged, refused
/// (ESHUTDOWN) and failed otherwise.
const WRITES_THROUGH_A_STOP: &str = r#"
import errno, json, os, signal, sys, time
import nbd
host, port, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
h = nbd.NBD()
h.connect_tcp(host, port)
pending, acked, refused, failed = {}, [], [], []
block, start, signalled = 0, time.time(), False
while True:
    try:
        while len(pending) < 64 and block < 65536:
            data = (block + 1).to_bytes(8, "little") * 512
            pending[h.aio_pwrite(data, block * 4096)] = block
            block += 1
            if block % 16 == 0:
                pending[h.aio_flush()] = None
        h.poll(100)
    except nbd.Error:
        break
    for cookie in list(pending):
        try:
            if not h.aio_command_completed(cookie):
                continue
            if pending[cookie] is not None:
                acked.append(pending[cookie])
        except nbd.Error as e:
            if pending[cookie] is not None:
                (refused if e.errnum == errno.ESHUTDOWN else failed).append(pending[cookie])
        del pending[cookie]
    if not signalled and time.time() - start > 0.5:
        os.kill(pid, signal.SIGTERM)
        signalled = True
failed += [b for b in pending.values() if b is not None]
print(json.dumps({"acked": acked, "refused": refused, "failed": failed}))
"#;

/// A stop while libnbd keeps writes in flight: every write the server did reaches the
/// client as done. Before a31119e the server's close could reset the connection with
/// replies unread (35 done writes reported failed in one run); a version of the close
/// that did not wait for a sending client failed 4–57 a run (RESULTS, session 64).
#[test]
fn writes_in_flight_at_a_stop_are_done_exactly_when_acknowledged() {
    let dir = tempdir();
    let backing = dir.path().join("disk.img");
    let mut server = Server::start(&["--size", "256M", path_str(&backing)]);
    let addr = server.tcp().to_string();
    let (host, port) = addr.split_once(':').unwrap();
    let out = python(
        WRITES_THROUGH_A_STOP,
        &[host, port, &server.pid().to_string()],
    );
    let status = server
        .wait_exit(Duration::from_secs(30))
        .expect("exits after SIGTERM");
    assert!(status.success(), "{status}");
    let said: serde_json::Value = serde_json::from_str(out.trim()).expect(&out);
    let blocks = |what: &str| -> Vec<u64> {
        said[what]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap())
            .collect()
    };
    let data = std::fs::read(&backing).unwrap();
    let holds = |block: u64| {
        let at = block as usize * 4096;
        let want: Vec<u8> = (block + 1).to_le_bytes().repeat(512);
        data[at..at + 4096] == want[..]
    };
    let acked = blocks("acked");
    assert!(!acked.is_empty(), "{out}");
    for block in &acked {
        assert!(
            holds(*block),
            "acknowledged write {block} is not in the file"
        );
    }
    for block in blocks("refused").iter().chain(&blocks("failed")) {
        assert!(
            !holds(*block),
            "write {block} was done, yet reported failed"
        );
    }
}

// 9. A real file system: ext4 on a loop device over nbdfuse

/// Takes the file-system stack down in reverse order, whatever step failed.
struct FsStack {
    fuse_dir: PathBuf,
    mount_dir: PathBuf,
    nbdfuse: Option<Child>,
    fuse_mounted: bool,
    loop_dev: Option<String>,
    mounted: bool,
}

impl FsStack {
    fn umount(&mut self) {
        run(Command::new("umount").arg(&self.mount_dir));
        self.mounted = false;
    }

    fn detach_loop(&mut self) {
        let dev = self.loop_dev.take().expect("a loop device");
        run(Command::new("losetup").arg("-d").arg(dev));
    }

    /// Unmounts the FUSE file system and waits for nbdfuse to exit on its own.
    fn unmount_fuse(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        // A just-detached loop device may hold the file open a moment longer.
        while !Command::new("fusermount3")
            .arg("-u")
            .arg(&self.fuse_dir)
            .status()
            .is_ok_and(|s| s.success())
        {
            assert!(Instant::now() < deadline, "fusermount3 -u kept failing");
            std::thread::sleep(Duration::from_millis(100));
        }
        self.fuse_mounted = false;
        let mut child = self.nbdfuse.take().expect("nbdfuse");
        let status = loop {
            if let Some(status) = child.try_wait().expect("nbdfuse status") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("nbdfuse did not exit after fusermount3 -u");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(status.success(), "nbdfuse exited with {status}");
    }
}

impl Drop for FsStack {
    fn drop(&mut self) {
        let quiet = |cmd: &mut Command| {
            let _ = cmd.stdout(Stdio::null()).stderr(Stdio::null()).status();
        };
        if self.mounted {
            quiet(Command::new("umount").arg(&self.mount_dir));
        }
        if let Some(dev) = self.loop_dev.take() {
            quiet(Command::new("losetup").arg("-d").arg(dev));
        }
        if self.fuse_mounted {
            quiet(Command::new("fusermount3").arg("-u").arg(&self.fuse_dir));
        }
        if let Some(mut child) = self.nbdfuse.take() {
            // Child::kill signals this child's PID only.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Every file under `expected` is in `actual` with the same bytes; returns how many.
fn assert_same_tree(actual: &Path, expected: &Path) -> usize {
    let mut files = 0;
    for entry in std::fs::read_dir(expected).unwrap() {
        let entry = entry.unwrap();
        let other = actual.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            files += assert_same_tree(&other, &entry.path());
        } else {
            assert_same_file(&other, &entry.path());
            files += 1;
        }
    }
    files
}

#[test]
fn ext4_on_nbdfuse_and_a_loop_device() {
    for tool in [
        "nbdfuse",
        "fusermount3",
        "losetup",
        "mkfs.ext4",
        "fsck.ext4",
        "debugfs",
        "nbdcopy",
    ] {
        if !have(tool) {
            return;
        }
    }
    let server = Server::start(&["memory:128M"]);
    let dir = tempdir();
    // Declared after `dir`, so it is dropped (and unwinds the stack) before `dir` goes.
    let mut stack = FsStack {
        fuse_dir: dir.path().join("fuse"),
        mount_dir: dir.path().join("mnt"),
        nbdfuse: None,
        fuse_mounted: false,
        loop_dev: None,
        mounted: false,
    };
    std::fs::create_dir(&stack.fuse_dir).unwrap();
    std::fs::create_dir(&stack.mount_dir).unwrap();
    let disk = stack.fuse_dir.join("disk");
    let log = File::create(dir.path().join("nbdfuse.log")).unwrap();
    stack.fuse_mounted = true;
    stack.nbdfuse = Some(
        Command::new("nbdfuse")
            .arg(&disk)
            .arg(server.uri())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start nbdfuse"),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::metadata(&disk).map(|m| m.len()).unwrap_or(0) != 128 << 20 {
        let exited = stack.nbdfuse.as_mut().unwrap().try_wait().unwrap();
        assert!(
            exited.is_none() && Instant::now() < deadline,
            "nbdfuse did not expose {} ({exited:?}):\n{}",
            disk.display(),
            std::fs::read_to_string(dir.path().join("nbdfuse.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let dev = run_stdout(Command::new("losetup").args(["-f", "--show"]).arg(&disk))
        .trim()
        .to_string();
    assert!(dev.starts_with("/dev/loop"), "{dev}");
    stack.loop_dev = Some(dev.clone());
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&dev));
    run(Command::new("mount").arg(&dev).arg(&stack.mount_dir));
    stack.mounted = true;

    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    copy_tree(&src, &stack.mount_dir.join("src"));
    let expected = dir.path().join("random.bin");
    pattern_file(&expected, 20 * MIB, 109);
    std::fs::copy(&expected, stack.mount_dir.join("random.bin")).unwrap();
    run(&mut Command::new("sync"));
    // A fresh mount: the reads below do not come from this mount's page cache.
    stack.umount();
    run(Command::new("mount").arg(&dev).arg(&stack.mount_dir));
    stack.mounted = true;
    let files = assert_same_tree(&stack.mount_dir.join("src"), &src);
    assert!(files > 10, "only {files} files under src/");
    assert_same_file(&stack.mount_dir.join("random.bin"), &expected);
    stack.umount();
    run(Command::new("fsck.ext4").args(["-f", "-n"]).arg(&dev));
    stack.detach_loop();
    stack.unmount_fuse();
    drop(stack);

    // The server holds the file system itself, not just some cache on the way: copy the
    // export out and read the files with debugfs, without the kernel.
    let image = dir.path().join("image.raw");
    run(Command::new("nbdcopy").arg(server.uri()).arg(&image));
    let dumped = dir.path().join("dumped.bin");
    run(Command::new("debugfs")
        .arg("-R")
        .arg(format!("dump /random.bin {}", dumped.display()))
        .arg(&image));
    assert_same_file(&dumped, &expected);
    let tree = dir.path().join("dumped");
    std::fs::create_dir(&tree).unwrap();
    run(Command::new("debugfs")
        .arg("-R")
        .arg(format!("rdump /src {}", tree.display()))
        .arg(&image));
    assert_same_tree(&tree.join("src"), &src);
}
