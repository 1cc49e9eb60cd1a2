//! Crash consistency: writes, FUA writes and FLUSHes from several connections, then a crash
//! at a random instant, then a check of every block against what the server acknowledged.
//!
//! The rules (NBD spec, FLUSH and FUA): a write acknowledged with FUA, or acknowledged
//! before a FLUSH was sent whose reply then arrived (on any connection: the export is
//! multi-conn), must read back intact; every other block holds its old contents or one of
//! the versions written since, never anything else (no torn or foreign data).
//!
//! Two kinds of crash:
//! - **kill**: the real binary with `--fault-injection powercut` (unflushed writes live only
//!   in its memory) is SIGKILLed; run for both `--cache=none` and `--cache=writeback`;
//! - **power cut**: the server runs in this process over the power-cut layer on a real file
//!   backend, and the cut writes an arbitrary subset of the unflushed writes, in an arbitrary
//!   order, before the "disk" goes away.
//!
//! The volatile cache is the power-cut layer above the file backend, and the check reads
//! the file through a page cache that never crashed: these tests prove that FLUSH and FUA
//! reach the backend, not that the backend reaches the device (`backend::file`'s tests count
//! its syncs; ARCHITECTURE.md, "Durability").
//!
//! `NETBLK_CRASH_POINTS=N` runs N crash points of each kind (default: a short CI run).
//! Every failure prints its seed; `NETBLK_CRASH_SEED=S` replays one.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::raw::{Mode, Raw};
use common::workload::{
    check_disk, contents, run_workload, Dice, History, WriteRecord, BLOCK, BLOCKS,
};
use common::Server;
use netblk::backend::file::FileBackend;
use netblk::backend::powercut::PowerCut;
use netblk::backend::{Backend, CacheMode};
use netblk::server::{serve, Export, Listener, ServerConfig, DEFAULT_MAX_MERGE};
use netblk::tcp::TcpSettings;

fn crash_points() -> u64 {
    std::env::var("NETBLK_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6)
}

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("NETBLK_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return vec![seed];
    }
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    (0..crash_points())
        .map(|i| base.wrapping_add(i * 7919))
        .collect()
}

#[test]
fn acknowledged_writes_survive_sigkill_with_a_volatile_cache_in_both_cache_modes() {
    let mut points = 0;
    for seed in seeds() {
        for cache in ["none", "writeback"] {
            let dir = tempfile::tempdir().unwrap();
            let disk = dir.path().join("disk.img");
            let size = format!("{}", BLOCKS * BLOCK as u64);
            let server = Server::start(&[
                "--cache",
                cache,
                "--fault-injection",
                "powercut",
                "--size",
                &size,
                disk.to_str().unwrap(),
            ]);
            let addr = server.tcp().to_string();
            let delay = Duration::from_millis(30 + Dice(seed).below(300));
            let pid = server.pid();
            let history = run_workload(&addr, seed, || {
                std::thread::sleep(delay);
                let status = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status()
                    .unwrap();
                assert!(status.success());
            });
            drop(server);
            let what = format!("SIGKILL, --cache={cache}, seed {seed}");
            history.assert_ran(&what);
            check_disk(&disk, &history, &what);
            // The server starts again on what the crash left.
            let again = Server::start(&["--cache", cache, disk.to_str().unwrap()]);
            let mut raw = Raw::session(again.tcp(), Mode::Simple);
            assert_eq!(raw.write(1, 0, &contents(0, 1 << 40)), Some(0));
            drop(raw);
            again.stop();
            points += 1;
        }
    }
    eprintln!("SIGKILL crash points run: {points}, all consistent");
}

#[test]
fn acknowledged_writes_survive_a_power_cut_that_keeps_any_subset_of_the_cache() {
    let mut points = 0;
    let mut kept = 0;
    let mut dropped = 0;
    for seed in seeds() {
        for cache in [CacheMode::None, CacheMode::Writeback] {
            let dir = tempfile::tempdir().unwrap();
            let disk = dir.path().join("disk.img");
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let file = FileBackend::open(&disk, Some(BLOCKS * BLOCK as u64), false, Some(cache))
                .expect("open the disk");
            let layer = Arc::new(PowerCut::new(Arc::new(file)));
            let (addr, stop_server, served) = runtime.block_on(async {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let addr = listener.local_addr().unwrap().to_string();
                let config = ServerConfig {
                    exports: vec![Arc::new(Export::new(
                        String::new(),
                        String::new(),
                        Arc::clone(&layer) as Arc<dyn Backend>,
                    ))],
                    handshake_timeout: Duration::from_secs(10),
                    max_merge: DEFAULT_MAX_MERGE,
                    max_connections: netblk::server::DEFAULT_MAX_CONNECTIONS,
                    tcp: TcpSettings::default(),
                    clients: Default::default(),
                };
                let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
                let served = tokio::spawn(serve(vec![Listener::Tcp(listener)], config, async {
                    let _ = stop_rx.await;
                }));
                (addr, stop_tx, served)
            });
            let delay = Duration::from_millis(30 + Dice(seed).below(300));
            let handle = runtime.handle().clone();
            let cut_layer = Arc::clone(&layer);
            let started = Instant::now();
            let history = run_workload(&addr, seed, || {
                std::thread::sleep(delay);
                let (total, written) = handle.block_on(cut_layer.cut(seed)).expect("power cut");
                kept += written;
                dropped += total - written;
            });
            let _ = stop_server.send(());
            let _ = runtime.block_on(served);
            drop(layer);
            drop(runtime);
            let what = format!(
                "power cut, --cache={cache}, seed {seed}, after {:?}",
                started.elapsed()
            );
            history.assert_ran(&what);
            check_disk(&disk, &history, &what);
            points += 1;
        }
    }
    eprintln!(
        "power-cut crash points run: {points}, all consistent \
         ({kept} cached writes kept and {dropped} dropped by the cuts)"
    );
}

/// The checker is not vacuous: an acknowledged, flushed write that went missing, and a
/// block with foreign contents, are both caught.
#[test]
fn the_checker_catches_lost_and_torn_writes() {
    let history = History::default();
    let fua_acked = history.tick();
    history.writes.lock().unwrap().insert(
        5,
        vec![
            WriteRecord {
                version: 1,
                acked: Some(fua_acked),
                fua: true,
            },
            WriteRecord {
                version: 2,
                acked: None,
                fua: false,
            },
        ],
    );
    assert!(history.check(5, &contents(5, 1)).is_ok());
    assert!(
        history.check(5, &contents(5, 2)).is_ok(),
        "an unacknowledged newer write may land"
    );
    assert!(
        history.check(5, &vec![0u8; BLOCK]).is_err(),
        "a FUA write was lost"
    );
    let mut torn = contents(5, 1);
    torn[2048..].copy_from_slice(&contents(5, 2)[2048..]);
    assert!(history.check(5, &torn).is_err(), "a torn block");
    assert!(
        history.check(5, &contents(6, 1)).is_err(),
        "another block's data"
    );
    // A plain write counts only once a FLUSH sent after its reply has been answered.
    let acked = history.tick();
    history.writes.lock().unwrap().insert(
        7,
        vec![WriteRecord {
            version: 1,
            acked: Some(acked),
            fua: false,
        }],
    );
    assert!(
        history.check(7, &vec![0u8; BLOCK]).is_ok(),
        "not yet flushed"
    );
    let sent = history.tick();
    let answered = history.tick();
    history.flushes.lock().unwrap().push((sent, answered));
    assert!(
        history.check(7, &vec![0u8; BLOCK]).is_err(),
        "flushed, then lost"
    );
    assert!(history.check(7, &contents(7, 1)).is_ok());
}
