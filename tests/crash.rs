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
//! `NETBLK_CRASH_POINTS=N` runs N crash points of each kind (default: a short CI run).
//! Every failure prints its seed; `NETBLK_CRASH_SEED=S` replays one.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::raw::{Mode, Raw};
use common::Server;
use netblk::backend::file::FileBackend;
use netblk::backend::powercut::PowerCut;
use netblk::backend::{Backend, CacheMode};
use netblk::server::{serve, Export, Listener, ServerConfig, DEFAULT_MAX_MERGE};
use netblk::wire::{cmd, cmd_flags, SIMPLE_REPLY_MAGIC};

const BLOCK: usize = 4096;
const BLOCKS: u64 = 1024;
const CONNECTIONS: u64 = 4;
const WINDOW: usize = 16;

/// splitmix64: deterministic per seed.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The contents of version `version` (≥ 1) of `block`: a stamp, then bytes derived from it,
/// so any torn or misplaced block is recognisable. Version 0 is the zeroes of a new file.
fn contents(block: u64, version: u64) -> Vec<u8> {
    let mut data = Vec::with_capacity(BLOCK);
    data.extend_from_slice(&block.to_le_bytes());
    data.extend_from_slice(&version.to_le_bytes());
    let mut dice = Dice(block.wrapping_mul(1_000_003) ^ version);
    while data.len() < BLOCK {
        data.extend_from_slice(&dice.next().to_le_bytes());
    }
    data
}

/// Which version a block holds, if it is exactly one of its versions (or zeroes).
fn version_of(block: u64, data: &[u8]) -> Option<u64> {
    if data.iter().all(|&b| b == 0) {
        return Some(0);
    }
    let stamped = u64::from_le_bytes(data[..8].try_into().unwrap());
    let version = u64::from_le_bytes(data[8..16].try_into().unwrap());
    (stamped == block && version > 0 && contents(block, version) == data).then_some(version)
}

/// What the clients saw, in one global order of events.
#[derive(Default)]
struct History {
    clock: AtomicU64,
    /// Per block: (version, sent at, acked at with FUA?) in the order sent.
    writes: Mutex<HashMap<u64, Vec<WriteRecord>>>,
    /// (sent at, acked at) of every FLUSH whose reply arrived.
    flushes: Mutex<Vec<(u64, u64)>>,
}

#[derive(Clone, Copy, Debug)]
struct WriteRecord {
    version: u64,
    acked: Option<u64>,
    fua: bool,
}

impl History {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }

    /// Checks one block's contents against the rules; `Err` says what is wrong.
    fn check(&self, block: u64, data: &[u8]) -> Result<(), String> {
        let writes = self.writes.lock().unwrap();
        let flushes = self.flushes.lock().unwrap();
        let history = writes.get(&block).cloned().unwrap_or_default();
        // The newest version that must have survived.
        let durable = history
            .iter()
            .rposition(|w| match w.acked {
                Some(_) if w.fua => true,
                Some(acked) => flushes.iter().any(|&(sent, _)| sent > acked),
                None => false,
            })
            .map(|i| history[i].version)
            .unwrap_or(0);
        let Some(found) = version_of(block, data) else {
            return Err(format!(
                "block {block} holds neither its old contents nor any version written \
                 (torn or foreign data); durable version was {durable}"
            ));
        };
        let legal = found == durable
            || history
                .iter()
                .any(|w| w.version == found && w.version > durable);
        if legal {
            Ok(())
        } else {
            Err(format!(
                "block {block} holds version {found}, but version {durable} was durable \
                 (history: {history:?})"
            ))
        }
    }
}

/// One connection's workload: writes to its own blocks (some FUA) and FLUSHes, with up to
/// [`WINDOW`] requests in flight and never two to one block, until the server goes away or
/// `stop` is set.
fn workload(addr: &str, connection: u64, seed: u64, history: &History, stop: &AtomicBool) {
    let raw = Raw::session(addr, Mode::Simple);
    let mut sock: TcpStream = raw.sock;
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut dice = Dice(seed ^ (connection << 32));
    let mine: Vec<u64> = (0..BLOCKS)
        .filter(|b| b % CONNECTIONS == connection)
        .collect();
    let mut next_version: HashMap<u64, u64> = HashMap::new();
    // cookie -> (block, version, fua) for writes, or block u64::MAX for a flush.
    let mut in_flight: HashMap<u64, (u64, u64, bool, u64)> = HashMap::new();
    let mut cookie = 0u64;
    loop {
        while in_flight.len() < WINDOW && !stop.load(Ordering::SeqCst) {
            cookie += 1;
            let flush_in_flight = in_flight.values().any(|v| v.0 == u64::MAX);
            let request = if dice.below(8) == 0 && !flush_in_flight {
                let sent = history.tick();
                in_flight.insert(cookie, (u64::MAX, 0, false, sent));
                netblk::wire::transmission::RequestHeader {
                    flags: 0,
                    command: cmd::FLUSH,
                    cookie,
                    offset: 0,
                    length: 0,
                }
                .encode(netblk::wire::transmission::RequestStyle::Compact)
            } else {
                let busy: Vec<u64> = in_flight.values().map(|v| v.0).collect();
                let block = mine[dice.below(mine.len() as u64) as usize];
                if busy.contains(&block) {
                    continue;
                }
                let version = next_version.entry(block).or_insert(0);
                *version += 1;
                let fua = dice.below(5) == 0;
                history
                    .writes
                    .lock()
                    .unwrap()
                    .entry(block)
                    .or_default()
                    .push(WriteRecord {
                        version: *version,
                        acked: None,
                        fua,
                    });
                in_flight.insert(cookie, (block, *version, fua, history.tick()));
                let mut bytes = netblk::wire::transmission::RequestHeader {
                    flags: if fua { cmd_flags::FUA } else { 0 },
                    command: cmd::WRITE,
                    cookie,
                    offset: block * BLOCK as u64,
                    length: BLOCK as u64,
                }
                .encode(netblk::wire::transmission::RequestStyle::Compact);
                bytes.extend(contents(block, *version));
                bytes
            };
            if sock.write_all(&request).is_err() {
                return;
            }
        }
        if in_flight.is_empty() {
            return;
        }
        let mut reply = [0u8; 16];
        if sock.read_exact(&mut reply).is_err() {
            return; // the server is gone
        }
        assert_eq!(
            u32::from_be_bytes(reply[..4].try_into().unwrap()),
            SIMPLE_REPLY_MAGIC
        );
        let error = u32::from_be_bytes(reply[4..8].try_into().unwrap());
        let cookie = u64::from_be_bytes(reply[8..16].try_into().unwrap());
        let (block, version, _fua, sent) = in_flight.remove(&cookie).expect("a reply we asked for");
        if error != 0 {
            // Only a dead "disk" may fail a request; nothing failed counts as acknowledged.
            continue;
        }
        let acked = history.tick();
        if block == u64::MAX {
            history.flushes.lock().unwrap().push((sent, acked));
        } else if let Some(record) = history
            .writes
            .lock()
            .unwrap()
            .get_mut(&block)
            .and_then(|h| h.iter_mut().find(|w| w.version == version))
        {
            record.acked = Some(acked);
        }
    }
}

/// Runs the workload on `addr` from every connection until `crash` has been called.
fn run_workload(addr: &str, seed: u64, crash: impl FnOnce()) -> Arc<History> {
    let history = Arc::new(History::default());
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..CONNECTIONS)
        .map(|c| {
            let (addr, history, stop) = (addr.to_string(), Arc::clone(&history), Arc::clone(&stop));
            std::thread::spawn(move || workload(&addr, c, seed, &history, &stop))
        })
        .collect();
    crash();
    stop.store(true, Ordering::SeqCst);
    for thread in threads {
        thread.join().expect("a workload thread panicked");
    }
    history
}

/// Checks every block of `disk`; returns how many blocks held a version above zero.
fn check_disk(disk: &Path, history: &History, what: &str) -> usize {
    let data = std::fs::read(disk).expect("read the disk image");
    let mut written = 0;
    for block in 0..BLOCKS {
        let at = block as usize * BLOCK;
        let bytes = &data[at..at + BLOCK];
        if let Err(e) = history.check(block, bytes) {
            panic!("{what}: {e}");
        }
        written += usize::from(version_of(block, bytes) != Some(0));
    }
    written
}

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
            let acked = history.clock.load(Ordering::SeqCst);
            assert!(
                acked > 20,
                "{what}: the workload barely ran ({acked} events)"
            );
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
                    exports: vec![Arc::new(Export {
                        name: String::new(),
                        description: String::new(),
                        backend: Arc::clone(&layer) as Arc<dyn Backend>,
                    })],
                    handshake_timeout: Duration::from_secs(10),
                    max_merge: DEFAULT_MAX_MERGE,
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
