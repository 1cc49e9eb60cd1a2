//! A crash workload shared by the crash and replication tests: several connections write
//! stamped 4 KiB blocks (some with FUA) and send FLUSHes, each recording when its requests
//! were sent and acknowledged in one global order, so that a disk image left by a crash can
//! be checked block by block against what the server promised.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::raw::{Mode, Raw};
use netblk::wire::{cmd, cmd_flags, SIMPLE_REPLY_MAGIC};

/// What a crash may take away.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Promise {
    /// The NBD rule for one server: a write must survive once it was acknowledged with FUA,
    /// or acknowledged before a FLUSH was sent whose reply then arrived.
    FlushedOrFua,
    /// Synchronous replication (protocol C) when a node dies but its replica lives: every
    /// acknowledged write is on the replica.
    Acknowledged,
}

pub const BLOCK: usize = 4096;
pub const BLOCKS: u64 = 1024;
pub const CONNECTIONS: u64 = 4;
pub const WINDOW: usize = 16;

/// splitmix64: deterministic per seed.
pub struct Dice(pub u64);

impl Dice {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The contents of version `version` (≥ 1) of `block`: a stamp, then bytes derived from it,
/// so any torn or misplaced block is recognisable. Version 0 is the zeroes of a new file.
pub fn contents(block: u64, version: u64) -> Vec<u8> {
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
pub fn version_of(block: u64, data: &[u8]) -> Option<u64> {
    if data.iter().all(|&b| b == 0) {
        return Some(0);
    }
    let stamped = u64::from_le_bytes(data[..8].try_into().unwrap());
    let version = u64::from_le_bytes(data[8..16].try_into().unwrap());
    (stamped == block && version > 0 && contents(block, version) == data).then_some(version)
}

/// What the clients saw, in one global order of events.
#[derive(Default)]
pub struct History {
    pub clock: AtomicU64,
    /// Per block: (version, sent at, acked at with FUA?) in the order sent.
    pub writes: Mutex<HashMap<u64, Vec<WriteRecord>>>,
    /// (sent at, acked at) of every FLUSH whose reply arrived.
    pub flushes: Mutex<Vec<(u64, u64)>>,
}

#[derive(Clone, Copy, Debug)]
pub struct WriteRecord {
    pub version: u64,
    pub acked: Option<u64>,
    pub fua: bool,
}

impl History {
    pub fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }

    /// Writes and FLUSHes that were acknowledged with success.
    pub fn acknowledged(&self) -> (usize, usize) {
        let writes = self.writes.lock().unwrap();
        let acked_writes = writes
            .values()
            .flatten()
            .filter(|w| w.acked.is_some())
            .count();
        (acked_writes, self.flushes.lock().unwrap().len())
    }

    /// Panics unless the workload ran for real before the crash: a server that failed
    /// every write or FLUSH would otherwise leave nothing to check, and pass.
    pub fn assert_ran(&self, what: &str) {
        let (writes, flushes) = self.acknowledged();
        assert!(
            writes > 20 && flushes > 0,
            "{what}: the workload barely ran ({writes} writes and {flushes} FLUSHes acknowledged)"
        );
    }

    /// Checks one block's contents against the flush rule; `Err` says what is wrong.
    pub fn check(&self, block: u64, data: &[u8]) -> Result<(), String> {
        self.check_promise(block, data, Promise::FlushedOrFua)
    }

    /// Checks one block's contents against `promise`; `Err` says what is wrong.
    pub fn check_promise(&self, block: u64, data: &[u8], promise: Promise) -> Result<(), String> {
        let writes = self.writes.lock().unwrap();
        let flushes = self.flushes.lock().unwrap();
        let history = writes.get(&block).cloned().unwrap_or_default();
        // The newest version that must have survived.
        let durable = history
            .iter()
            .rposition(|w| match w.acked {
                Some(_) if w.fua || promise == Promise::Acknowledged => true,
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
/// `stop` is set. Connection 0 commits as a database does instead: one write, its reply,
/// a FLUSH, its reply, and again, which a file export soon flushes ahead
/// (`server::flush_ahead`): each write synced as its reply leaves.
pub fn workload(addr: &str, connection: u64, seed: u64, history: &History, stop: &AtomicBool) {
    let committer = connection == 0;
    let window = if committer { 1 } else { WINDOW };
    let mut flush_next = false;
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
        while in_flight.len() < window && !stop.load(Ordering::SeqCst) {
            cookie += 1;
            let flush_in_flight = in_flight.values().any(|v| v.0 == u64::MAX);
            let flush = if committer {
                // Write, FLUSH, write, FLUSH, ...
                let now = flush_next;
                flush_next = !now;
                now
            } else {
                dice.below(8) == 0 && !flush_in_flight
            };
            let request = if flush {
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
                let fua = !committer && dice.below(5) == 0;
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
pub fn run_workload(addr: &str, seed: u64, crash: impl FnOnce()) -> Arc<History> {
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

/// Checks every block of `disk` against the flush rule; returns how many blocks held a
/// version above zero.
pub fn check_disk(disk: &Path, history: &History, what: &str) -> usize {
    check_disk_promise(disk, history, what, Promise::FlushedOrFua)
}

/// Checks every block of `disk` against `promise`; returns how many blocks held a version
/// above zero.
pub fn check_disk_promise(disk: &Path, history: &History, what: &str, promise: Promise) -> usize {
    let data = std::fs::read(disk).expect("read the disk image");
    let mut written = 0;
    for block in 0..BLOCKS {
        let at = block as usize * BLOCK;
        let bytes = &data[at..at + BLOCK];
        if let Err(e) = history.check_promise(block, bytes, promise) {
            panic!("{what}: {e}");
        }
        written += usize::from(version_of(block, bytes) != Some(0));
    }
    written
}
