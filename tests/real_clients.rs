//! The standard clients, unchanged, against the real binary: qemu-img, qemu-io, nbdinfo,
//! nbdcopy, nbdsh and python libnbd, fio's nbd engine, and a real ext4 file system through
//! nbdfuse and a loop device.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

const SYSTEM_PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

fn qemu_img(args: &[&str], extra: &[&str]) -> String {
    run_stdout(Command::new("qemu-img").args(args).args(extra))
}

#[test]
fn qemu_img_converts_in_and_out_and_compares() {
    if !have("qemu-img") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.img");
    pattern_file(&source, 48 << 20, 1);
    let server = Server::start(&["memory:48M"]);
    let uri = server.uri();
    let info = qemu_img(&["info", "--output=json"], &[&uri]);
    assert!(info.contains("\"virtual-size\": 50331648"), "{info}");
    qemu_img(
        &["convert", "-n", "-f", "raw", "-O", "raw"],
        &[source.to_str().unwrap(), &uri],
    );
    qemu_img(
        &["compare", "-f", "raw", "-F", "raw"],
        &[source.to_str().unwrap(), &uri],
    );
    let out = dir.path().join("out.img");
    qemu_img(
        &["convert", "-f", "raw", "-O", "raw"],
        &[&uri, out.to_str().unwrap()],
    );
    assert!(read_all(&out) == read_all(&source), "converted out differs");
    // qemu 10 negotiates extended headers with us.
    assert!(
        server.stderr().contains("reply=Extended"),
        "{}",
        server.stderr()
    );
}

#[test]
fn qemu_io_writes_reads_flushes_discards_and_zeroes() {
    if !have("qemu-io") {
        return;
    }
    let server = Server::start(&["memory:16M"]);
    let out = run_stdout(
        Command::new("qemu-io")
            .args(["-f", "raw"])
            .args(["-c", "write -P 0xab 0 1M", "-c", "read -P 0xab 0 1M"])
            .args(["-c", "write -f -P 0xcd 1M 64k", "-c", "read -P 0xcd 1M 64k"])
            .args([
                "-c",
                "flush",
                "-c",
                "discard 0 64k",
                "-c",
                "write -z 2M 1M",
                "-c",
                "read -P 0 2M 1M",
            ])
            .args([
                "-c",
                "aio_write -P 0x11 4M 4k",
                "-c",
                "aio_write -P 0x22 5M 4k",
                "-c",
                "aio_flush",
            ])
            .args(["-c", "read -P 0x11 4M 4k", "-c", "read -P 0x22 5M 4k"])
            .arg(server.uri()),
    );
    assert!(
        !out.contains("failed") && !out.contains("Pattern verification"),
        "{out}"
    );
    assert_eq!(out.matches("read ").count(), 5, "{out}");
}

fn nbdinfo(args: &[&str]) -> String {
    run_stdout(Command::new("nbdinfo").args(args))
}

#[test]
fn nbdinfo_shows_the_export_lists_exports_and_maps_allocation() {
    if !have("nbdinfo") || !have("qemu-io") {
        return;
    }
    let server = Server::start(&["--description", "scratch disk", "memory:64M"]);
    let info = nbdinfo(&[&server.uri()]);
    for expected in [
        "export-size: 67108864",
        "description: scratch disk",
        "can_flush: true",
        "can_fua: true",
        "can_multi_conn: true",
        "can_trim: true",
        "can_zero: true",
        "can_fast_zero: true",
        "can_cache: true",
        "can_df: true",
        "base:allocation",
        "block_size_minimum: 1",
        "block_size_preferred: 4096",
        "block_size_maximum: 33554432",
    ] {
        assert!(info.contains(expected), "missing {expected:?} in:\n{info}");
    }
    let map = nbdinfo(&["--map", &server.uri()]);
    assert_eq!(map.lines().count(), 1, "{map}");
    assert!(map.contains("hole,zero"), "{map}");
    run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 1 1M 1M"])
        .arg(server.uri()));
    let map = nbdinfo(&["--map", &server.uri()]);
    let data = map
        .lines()
        .find(|l| l.contains("data"))
        .unwrap_or_else(|| panic!("no data extent:\n{map}"));
    let fields: Vec<&str> = data.split_whitespace().collect();
    assert_eq!(&fields[..2], &["1048576", "1048576"], "{map}");

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("exports.toml");
    std::fs::write(
        &config,
        "listen = [\"127.0.0.1:0\"]\n\
         [[export]]\nname = \"alpha\"\nbacking = \"memory:1M\"\ndescription = \"first disk\"\n\
         [[export]]\nname = \"beta\"\nbacking = \"memory:2M\"\nread_only = true\ndescription = \"second disk\"\n",
    )
    .unwrap();
    let multi = Server::start(&["--config", config.to_str().unwrap()]);
    let list = nbdinfo(&["--list", &multi.uri()]);
    for expected in [
        "export=\"alpha\"",
        "first disk",
        "export=\"beta\"",
        "second disk",
        "is_read_only: true",
    ] {
        assert!(list.contains(expected), "missing {expected:?} in:\n{list}");
    }
    assert_eq!(
        nbdinfo(&["--size", &multi.uri_for("beta")]).trim(),
        "2097152"
    );
}

#[test]
fn nbdcopy_copies_in_and_out_over_several_connections() {
    if !have("nbdcopy") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.img");
    pattern_file(&source, 32 << 20, 2);
    let server = Server::start(&["memory:32M"]);
    run(Command::new("nbdcopy")
        .arg("--connections=4")
        .arg(&source)
        .arg(server.uri()));
    let out = dir.path().join("out.img");
    run(Command::new("nbdcopy")
        .arg("--connections=4")
        .arg(server.uri())
        .arg(&out));
    assert!(read_all(&out) == read_all(&source), "copy out differs");
    run(Command::new("nbdcopy")
        .arg("--connections=1")
        .arg("--flush")
        .arg(&source)
        .arg(server.uri()));
}

fn nbdsh(uri: &str, script: &str) -> String {
    let setup = format!("h.add_meta_context('base:allocation'); h.connect_uri('{uri}')\n");
    // nbdsh runs `python3` from PATH; Debian's interpreter is the one with libnbd.
    run_stdout(
        Command::new("nbdsh")
            .env("PATH", SYSTEM_PATH)
            .arg("-c")
            .arg(format!("{setup}{script}")),
    )
}

#[test]
fn nbdsh_drives_every_command() {
    if !have("nbdsh") {
        return;
    }
    let server = Server::start(&["memory:16M"]);
    let out = nbdsh(
        &server.uri(),
        r#"
buf = b'\x5a' * 65536
h.pwrite(buf, 0)
h.pwrite(b'\x01' * 4096, 65536, nbd.CMD_FLAG_FUA)
assert h.pread(65536, 0) == buf
assert h.pread(4096, 65536) == b'\x01' * 4096
chunks = []
def chunk(subbuf, offset, status, err):
    chunks.append((offset, len(subbuf), status))
    return 0
got = h.pread_structured(4 << 20, 0, chunk, nbd.CMD_FLAG_DF)
assert chunks == [(0, 4 << 20, nbd.READ_DATA)], chunks   # DF: one content chunk, zeroes included
assert got[:65536] == buf and got[65536 + 4096:] == bytes((4 << 20) - 65536 - 4096)
chunks.clear()
h.pread_structured(4 << 20, 0, chunk)
assert any(status == nbd.READ_HOLE for _, _, status in chunks), chunks   # without DF, holes are holes
h.flush()
h.trim(65536, 1 << 20)
h.zero(8192, 4096, nbd.CMD_FLAG_NO_HOLE)
h.zero(1 << 20, 1 << 20, nbd.CMD_FLAG_FAST_ZERO)
assert h.pread(8192, 4096) == bytes(8192)
h.cache(1 << 20, 0)
extents = []
def collect(metacontext, offset, entries, err):
    extents.extend(entries)
h.block_status(16 << 20, 0, collect)
assert sum(extents[0::2]) >= 16 << 20, extents
assert extents[1] == 0 and extents[-1] == 3, extents   # data first, then hole+zero
one = []
h.block_status(16 << 20, 0, lambda m, o, e, err: one.extend(e), nbd.CMD_FLAG_REQ_ONE)
assert len(one) == 2 and one[0] <= 16 << 20, one
assert h.can_multi_conn() and h.can_fua() and h.can_fast_zero()
print("nbdsh ok")
"#,
    );
    assert!(out.contains("nbdsh ok"), "{out}");

    let read_only = Server::start(&["--read-only", "memory:1M"]);
    let out = nbdsh(
        &read_only.uri(),
        r#"
import errno
assert h.is_read_only()
try:
    h.set_strict_mode(0)
    h.pwrite(b'x' * 512, 0)
    raise SystemExit("a write to a read-only export succeeded")
except nbd.Error as e:
    assert e.errnum == errno.EPERM, e   # errnum is the number, errno its name
print("read-only ok")
"#,
    );
    assert!(out.contains("read-only ok"), "{out}");
}

#[test]
fn python_libnbd_keeps_hundreds_of_commands_in_flight() {
    if !have("nbdsh") {
        return;
    }
    let server = Server::start(&["memory:16M"]);
    let out = python(
        r#"
import sys, nbd
for structured in (True, False):
    h = nbd.NBD()
    h.set_request_structured_replies(structured)
    h.connect_uri(sys.argv[1])
    assert h.get_structured_replies_negotiated() == structured
    blocks = {i: bytes([i % 251]) * 4096 for i in range(200)}
    writes = [h.aio_pwrite(blocks[i], i * 4096) for i in range(200)]
    while h.aio_in_flight() > 0:
        h.poll(-1)
    for cookie in writes:
        assert h.aio_command_completed(cookie)
    bufs = {i: nbd.Buffer(4096) for i in range(200)}
    reads = [h.aio_pread(bufs[i], i * 4096) for i in range(200)]
    while h.aio_in_flight() > 0:
        h.poll(-1)
    for i in range(200):
        assert h.aio_command_completed(reads[i])
        assert bufs[i].to_bytearray() == blocks[i], i
    h.shutdown()
print("aio ok")
"#,
        &[&server.uri()],
    );
    assert!(out.contains("aio ok"), "{out}");
}

fn fio_json(args: &[String]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fio.json");
    run(Command::new("fio")
        .args(args)
        .arg("--output-format=json")
        .arg(format!("--output={}", out.display())));
    std::fs::read_to_string(out).unwrap()
}

fn assert_fio_clean(json: &str) {
    let report: serde_json::Value = serde_json::from_str(json).expect("fio JSON");
    let job = &report["jobs"][0];
    assert_eq!(job["error"], 0, "{json}");
    for dir in ["read", "write"] {
        assert!(
            job[dir]["io_bytes"].as_u64().unwrap_or(0) > 0,
            "no {dir}s: {json}"
        );
    }
}

#[test]
fn fio_verifies_random_read_write_at_depth_64_over_tcp_and_unix() {
    if !have("fio") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    let unix = format!("unix:{}", sock.display());
    let server = Server::start(&["--listen", "127.0.0.1:0", "--listen", &unix, "memory:64M"]);
    let job = |uri: String| -> Vec<String> {
        [
            "--name=verify",
            "--ioengine=nbd",
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=64",
            "--size=64M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_state_save=0",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([format!("--uri={uri}")])
        .collect()
    };
    assert_fio_clean(&fio_json(&job(server.uri())));
    assert_fio_clean(&fio_json(&job(format!(
        "nbd+unix:///?socket={}",
        sock.display()
    ))));
}

#[test]
fn a_file_export_holds_the_bytes_after_a_clean_stop() {
    if !have("qemu-img") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.img");
    pattern_file(&source, 64 << 20, 3);
    let backing = dir.path().join("disk.img");
    let server = Server::start(&["--size", "64M", backing.to_str().unwrap()]);
    qemu_img(
        &["convert", "-n", "-f", "raw", "-O", "raw"],
        &[source.to_str().unwrap(), &server.uri()],
    );
    qemu_img(
        &["compare", "-f", "raw", "-F", "raw"],
        &[source.to_str().unwrap(), &server.uri()],
    );
    assert!(server.stop().success());
    assert!(
        read_all(&backing) == read_all(&source),
        "the backing file differs"
    );
}

/// Undoes the file-system stack in reverse order, whatever failed.
struct FsStack {
    fuse_dir: PathBuf,
    mount_dir: PathBuf,
    nbdfuse: Option<Child>,
    loop_dev: Option<String>,
    mounted: bool,
}

impl Drop for FsStack {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new("umount").arg(&self.mount_dir).status();
        }
        if let Some(dev) = self.loop_dev.take() {
            let _ = Command::new("losetup").arg("-d").arg(dev).status();
        }
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.fuse_dir)
            .stderr(Stdio::null())
            .status();
        if let Some(mut child) = self.nbdfuse.take() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
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

fn same_tree(a: &Path, b: &Path) {
    for entry in std::fs::read_dir(a).unwrap() {
        let entry = entry.unwrap();
        let other = b.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            same_tree(&entry.path(), &other);
        } else {
            assert!(
                read_all(&entry.path()) == read_all(&other),
                "{} differs",
                other.display()
            );
        }
    }
}

#[test]
fn ext4_on_nbdfuse_and_a_loop_device_survives_write_read_and_fsck() {
    for tool in [
        "nbdfuse",
        "losetup",
        "mkfs.ext4",
        "fsck.ext4",
        "fusermount3",
    ] {
        if !have(tool) {
            return;
        }
    }
    let server = Server::start(&["memory:256M"]);
    let dir = tempfile::tempdir().unwrap();
    let mut stack = FsStack {
        fuse_dir: dir.path().join("fuse"),
        mount_dir: dir.path().join("mnt"),
        nbdfuse: None,
        loop_dev: None,
        mounted: false,
    };
    std::fs::create_dir_all(&stack.fuse_dir).unwrap();
    std::fs::create_dir_all(&stack.mount_dir).unwrap();
    let disk = stack.fuse_dir.join("disk");
    stack.nbdfuse = Some(
        Command::new("nbdfuse")
            .arg(&disk)
            .arg(server.uri())
            .spawn()
            .unwrap(),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::fs::metadata(&disk).map(|m| m.len()).unwrap_or(0) != 256 << 20 {
        assert!(Instant::now() < deadline, "nbdfuse did not expose the disk");
        std::thread::sleep(Duration::from_millis(50));
    }
    let dev = run_stdout(Command::new("losetup").args(["-f", "--show"]).arg(&disk))
        .trim()
        .to_string();
    stack.loop_dev = Some(dev.clone());
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&dev));
    run(Command::new("mount").arg(&dev).arg(&stack.mount_dir));
    stack.mounted = true;

    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    copy_tree(&src, &stack.mount_dir.join("src"));
    pattern_file(&stack.mount_dir.join("big.bin"), 20 << 20, 4);
    run(&mut Command::new("sync"));
    // Drop the page cache's copy so the reads below come through the export.
    run(Command::new("umount").arg(&stack.mount_dir));
    run(Command::new("mount").arg(&dev).arg(&stack.mount_dir));
    same_tree(&src, &stack.mount_dir.join("src"));
    let expected = dir.path().join("expected.bin");
    pattern_file(&expected, 20 << 20, 4);
    assert!(
        read_all(&stack.mount_dir.join("big.bin")) == read_all(&expected),
        "big.bin differs"
    );

    run(Command::new("umount").arg(&stack.mount_dir));
    stack.mounted = false;
    let fsck = Command::new("fsck.ext4")
        .args(["-f", "-n"])
        .arg(&dev)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "fsck: {}",
        String::from_utf8_lossy(&fsck.stdout)
    );
    drop(stack);
}
