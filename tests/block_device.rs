//! Exporting a real block device (a loop device over a temporary file): its size comes
//! from the device, and writes, zeroing and discard reach the device's bytes.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// A loop device, detached on drop.
struct LoopDevice(PathBuf);

impl LoopDevice {
    fn attach(file: &Path) -> LoopDevice {
        let out = run_stdout(Command::new("losetup").args(["-f", "--show"]).arg(file));
        LoopDevice(PathBuf::from(out.trim()))
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

#[test]
fn a_loop_device_exports_its_size_and_takes_writes_zeroes_and_discards() {
    if !have("losetup") || !have("qemu-img") || !have("qemu-io") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let backing = dir.path().join("backing.img");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let device = LoopDevice::attach(&backing);
    let source = dir.path().join("source.img");
    pattern_file(&source, 32 << 20, 7);

    let server = Server::start(&[device.0.to_str().unwrap()]);
    let info = run_stdout(
        Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(server.uri()),
    );
    assert!(info.contains("\"virtual-size\": 33554432"), "{info}");
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&source)
        .arg(server.uri()));
    run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&source)
        .arg(server.uri()));

    let io = run_stdout(
        Command::new("qemu-io")
            .args([
                "-f",
                "raw",
                "-c",
                "write -z 1M 1M",
                "-c",
                "read -P 0 1M 1M",
                "-c",
                "discard 4M 1M",
                "-c",
                "flush",
            ])
            .arg(server.uri()),
    );
    assert!(!io.contains("failed"), "{io}");
    assert!(server.stop().success());

    // The device's bytes: the pattern, with the zeroed megabyte.
    let mut expected = read_all(&source);
    expected[1 << 20..2 << 20].fill(0);
    let actual = read_all(&backing);
    assert_eq!(actual[..4 << 20], expected[..4 << 20]);
    assert_eq!(actual[5 << 20..], expected[5 << 20..]);
}
