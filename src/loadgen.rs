//! A load generator: an NBD client that keeps a fixed number of reads (random or sequential)
//! in flight on one connection and finds each reply's request by its cookie in constant time.
//!
//! Why it exists: the benchmark's client, fio's `nbd` engine, goes through libnbd, which
//! keeps the commands in flight in a list and walks it for every reply. At iodepth 256 that
//! walk, not the server, sets the rate (bench/RESULTS.md, sessions 8 to 18), so fio cannot
//! say whether a server loses anything with more requests in flight. This client's cost per
//! request does not grow with the depth: it sends every free slot's request in one write,
//! reads replies in large reads into one buffer, and uses the cookie as the slot's index.
//! Nor does its cost per byte grow with the read size: data is consumed as it arrives into
//! a buffer that stays in cache, where fio (through libnbd) first zeroes each request's
//! buffer and then receives into it, 256 MiB of buffers for 32 MiB reads at iodepth 8.
//! `bench/bench.py` runs it (`cargo run --release --example nbd-load`) at iodepth 32 and 256,
//! and for sequential reads from 64 KiB to 32 MiB, beside the fio rows.
//!
//! It negotiates simple replies (`NBD_OPT_GO` without structured replies), as the Linux
//! kernel client does, and reads the export named `""`.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::wire::handshake::{ClientOption, InfoRequest, OptionReply, GREETING_LEN};
use crate::wire::transmission::{RequestHeader, RequestStyle, SIMPLE_REPLY_LEN};
use crate::wire::{client_flags, cmd, info, rep, IHAVEOPT, NBD_MAGIC, SIMPLE_REPLY_MAGIC};

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadSpec {
    /// Reads kept in flight.
    pub depth: usize,
    /// Bytes per read.
    pub block: u32,
    /// How long to count, after `ramp`.
    pub duration: Duration,
    /// How long to run before counting.
    pub ramp: Duration,
    /// Seed of the offsets' generator.
    pub seed: u64,
    /// Read the export in order, from the start, wrapping at its end, instead of at random.
    pub sequential: bool,
}

/// What a run measured, over the counted window.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReport {
    /// Replies that arrived in the window.
    pub requests: u64,
    /// The window's length.
    pub seconds: f64,
    /// Mean time from a request's send to its reply's arrival, over those replies.
    pub mean_latency_us: f64,
}

impl LoadReport {
    pub fn iops(&self) -> f64 {
        self.requests as f64 / self.seconds
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("talking to the server: {0}")]
    Io(#[from] io::Error),
    #[error("the server broke the protocol: {0}")]
    Protocol(String),
    #[error("read at offset {offset} failed with NBD error {error}")]
    ReadFailed { offset: u64, error: u32 },
}

fn protocol(what: impl Into<String>) -> LoadError {
    LoadError::Protocol(what.into())
}

/// Negotiates the default export on `stream` and returns its size.
pub fn handshake(stream: &mut TcpStream) -> Result<u64, LoadError> {
    let mut greeting = [0u8; GREETING_LEN];
    stream.read_exact(&mut greeting)?;
    let magic = u64::from_be_bytes(greeting[0..8].try_into().expect("8 bytes"));
    let newstyle = u64::from_be_bytes(greeting[8..16].try_into().expect("8 bytes"));
    if magic != NBD_MAGIC || newstyle != IHAVEOPT {
        return Err(protocol("not a newstyle NBD server"));
    }
    stream.write_all(&(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES).to_be_bytes())?;
    let go = ClientOption::Go(InfoRequest {
        name: String::new(),
        requests: Vec::new(),
    });
    stream.write_all(&go.encode())?;
    let mut pending = Vec::new();
    let mut size = None;
    loop {
        let reply = loop {
            if let Some((reply, used)) = OptionReply::decode(&pending).map_err(protocol)? {
                pending.drain(..used);
                break reply;
            }
            let mut chunk = [0u8; 4096];
            let n = stream.read(&mut chunk)?;
            if n == 0 {
                return Err(protocol("the server closed during the handshake"));
            }
            pending.extend_from_slice(&chunk[..n]);
        };
        match reply.reply_type {
            rep::INFO if reply.data.len() >= 12 => {
                let item = u16::from_be_bytes([reply.data[0], reply.data[1]]);
                if item == info::EXPORT {
                    size = Some(u64::from_be_bytes(
                        reply.data[2..10].try_into().expect("8 bytes"),
                    ));
                }
            }
            rep::ACK => break,
            other if reply.is_final() => {
                return Err(protocol(format!(
                    "NBD_OPT_GO refused (reply type {other:#x}): {}",
                    String::from_utf8_lossy(&reply.data)
                )))
            }
            _ => {}
        }
    }
    size.ok_or_else(|| protocol("NBD_OPT_GO ended without the export's size"))
}

/// Where the reads go: xorshift64* for random offsets (no pattern the server could exploit,
/// at no cost to the client), or one block after another.
struct Offsets {
    state: u64,
    blocks: u64,
    block: u64,
    sequential: bool,
    next_block: u64,
}

impl Offsets {
    fn next(&mut self) -> u64 {
        if self.sequential {
            let block = self.next_block;
            self.next_block = (block + 1) % self.blocks;
            return block * self.block;
        }
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        (self.state.wrapping_mul(0x2545_f491_4f6c_dd1d) % self.blocks) * self.block
    }
}

/// Connects to `address`, negotiates, and runs `spec`'s reads.
pub fn reads(address: &str, spec: &LoadSpec) -> Result<LoadReport, LoadError> {
    let mut stream = TcpStream::connect(address)?;
    stream.set_nodelay(true)?;
    let size = handshake(&mut stream)?;
    run(&mut stream, size, spec)
}

/// Where a slot's request stands.
#[derive(Clone, Copy)]
struct Slot {
    offset: u64,
    sent: Instant,
}

/// Runs `spec`'s reads over a negotiated `stream` to an export of `size` bytes, then lets
/// every request in flight finish.
pub fn run(stream: &mut TcpStream, size: u64, spec: &LoadSpec) -> Result<LoadReport, LoadError> {
    let block = u64::from(spec.block);
    if spec.depth == 0 || block == 0 || size < block {
        return Err(protocol(format!(
            "nothing to run: depth {}, {block}-byte reads of a {size}-byte export",
            spec.depth
        )));
    }
    let mut offsets = Offsets {
        state: spec.seed | 1,
        blocks: size / block,
        block,
        sequential: spec.sequential,
        next_block: 0,
    };
    let mut slots: Vec<Option<Slot>> = vec![None; spec.depth];
    let mut free: Vec<usize> = (0..spec.depth).rev().collect();
    let mut out = Vec::with_capacity(spec.depth * 28);
    let mut inbuf = vec![0u8; RECEIVE_BUFFER];
    // Bytes of a reply header carried over from the last receive, and the reply whose
    // data is still arriving (its slot and how many bytes are owed).
    let mut held = 0usize;
    let mut receiving: Option<(usize, usize)> = None;

    let start = Instant::now();
    let count_from = start + spec.ramp;
    let stop_at = count_from + spec.duration;
    let mut counted = 0u64;
    let mut latency_sum = Duration::ZERO;
    let mut in_flight = 0usize;
    loop {
        let now = Instant::now();
        if now < stop_at {
            out.clear();
            while let Some(index) = free.pop() {
                let offset = offsets.next();
                slots[index] = Some(Slot { offset, sent: now });
                let header = RequestHeader {
                    flags: 0,
                    command: cmd::READ,
                    cookie: index as u64,
                    offset,
                    length: block,
                };
                out.extend_from_slice(&header.encode(RequestStyle::Compact));
                in_flight += 1;
            }
            if !out.is_empty() {
                stream.write_all(&out)?;
            }
        }
        if in_flight == 0 {
            break;
        }
        let n = stream.read(&mut inbuf[held..])?;
        if n == 0 {
            return Err(protocol("the server closed with requests in flight"));
        }
        let filled = held + n;
        let arrived = Instant::now();
        let mut at = 0;
        while at < filled {
            if let Some((index, owed)) = receiving {
                let taken = owed.min(filled - at);
                at += taken;
                if taken < owed {
                    receiving = Some((index, owed - taken));
                    continue;
                }
                receiving = None;
                let slot = slots[index]
                    .take()
                    .expect("a reply in progress is in flight");
                free.push(index);
                in_flight -= 1;
                if arrived >= count_from && arrived < stop_at {
                    counted += 1;
                    latency_sum += arrived - slot.sent;
                }
                continue;
            }
            if filled - at < SIMPLE_REPLY_LEN {
                break;
            }
            // An error reply is the header alone; a read's reply carries its data.
            let reply = &inbuf[at..at + SIMPLE_REPLY_LEN];
            let magic = u32::from_be_bytes(reply[0..4].try_into().expect("4 bytes"));
            let error = u32::from_be_bytes(reply[4..8].try_into().expect("4 bytes"));
            let cookie = u64::from_be_bytes(reply[8..16].try_into().expect("8 bytes"));
            if magic != SIMPLE_REPLY_MAGIC {
                return Err(protocol(format!("reply magic {magic:#010x}")));
            }
            let index = usize::try_from(cookie)
                .ok()
                .filter(|&index| slots.get(index).is_some_and(Option::is_some))
                .ok_or_else(|| protocol(format!("a reply to cookie {cookie}, not in flight")))?;
            if error != 0 {
                let offset = slots[index].map_or(0, |slot| slot.offset);
                return Err(LoadError::ReadFailed { offset, error });
            }
            at += SIMPLE_REPLY_LEN;
            receiving = Some((index, spec.block as usize));
        }
        inbuf.copy_within(at..filled, 0);
        held = filled - at;
    }
    Ok(LoadReport {
        requests: counted,
        seconds: spec.duration.as_secs_f64(),
        mean_latency_us: if counted == 0 {
            0.0
        } else {
            latency_sum.as_secs_f64() * 1e6 / counted as f64
        },
    })
}

/// Bytes received per read: room for a round of 4 KiB replies at depth 256, and a size that
/// stays in cache while large replies stream through it.
const RECEIVE_BUFFER: usize = 1 << 20;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_stay_aligned_and_inside_the_export() {
        let mut offsets = Offsets {
            state: 7,
            blocks: 1000,
            block: 4096,
            sequential: false,
            next_block: 0,
        };
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let offset = offsets.next();
            assert_eq!(offset % 4096, 0);
            assert!(offset < 1000 * 4096);
            seen.insert(offset);
        }
        assert!(seen.len() > 900, "offsets should cover the export");
    }

    #[test]
    fn sequential_offsets_follow_each_other_and_wrap_at_the_end() {
        let mut offsets = Offsets {
            state: 7,
            blocks: 3,
            block: 1 << 20,
            sequential: true,
            next_block: 0,
        };
        let seen: Vec<u64> = (0..5).map(|_| offsets.next() >> 20).collect();
        assert_eq!(seen, [0, 1, 2, 0, 1]);
    }

    /// `depth` reads of `block` bytes counted for `millis`, with no ramp.
    fn spec(depth: usize, block: u32, millis: u64) -> LoadSpec {
        LoadSpec {
            depth,
            block,
            duration: Duration::from_millis(millis),
            ramp: Duration::ZERO,
            seed: 3,
            sequential: false,
        }
    }

    /// A memory export of `size` bytes served on a runtime of its own; the address and
    /// what stops it.
    fn memory_server(
        size: u64,
    ) -> (
        String,
        tokio::sync::oneshot::Sender<()>,
        std::thread::JoinHandle<()>,
    ) {
        use crate::backend::{memory::MemoryBackend, Backend};
        use crate::server::{serve, Export, Listener, ServerConfig, DEFAULT_MAX_MERGE};
        use std::sync::Arc;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let runtime = crate::test_runtime();
            runtime.block_on(async {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx
                    .send(listener.local_addr().unwrap().to_string())
                    .unwrap();
                let config = ServerConfig {
                    exports: vec![Arc::new(Export::new(
                        String::new(),
                        String::new(),
                        Arc::new(MemoryBackend::new(size, false)) as Arc<dyn Backend>,
                    ))],
                    handshake_timeout: Duration::from_secs(10),
                    max_merge: DEFAULT_MAX_MERGE,
                    max_connections: crate::server::DEFAULT_MAX_CONNECTIONS,
                    tcp: crate::tcp::TcpSettings::default(),
                    clients: Default::default(),
                };
                serve(vec![Listener::Tcp(listener)], config, async {
                    let _ = stop_rx.await;
                })
                .await
                .unwrap();
            });
        });
        (addr_rx.recv().unwrap(), stop_tx, thread)
    }

    #[test]
    fn reads_at_every_depth_are_answered_and_counted() {
        let (addr, stop, thread) = memory_server(1 << 20);
        for depth in [1, 64, 300] {
            let spec = LoadSpec {
                ramp: Duration::from_millis(50),
                ..spec(depth, 4096, 200)
            };
            let report = reads(&addr, &spec).expect("the run succeeds");
            assert!(report.requests > 100, "depth {depth}: {report:?}");
            assert!(report.mean_latency_us > 0.0, "depth {depth}: {report:?}");
        }
        stop.send(()).unwrap();
        thread.join().unwrap();
    }

    #[test]
    fn reads_larger_than_the_receive_buffer_stream_through_it() {
        let (addr, stop, thread) = memory_server(32 << 20);
        let spec = LoadSpec {
            sequential: true,
            ..spec(2, 8 << 20, 200)
        };
        let report = reads(&addr, &spec).expect("the run succeeds");
        assert!(report.requests > 0, "{report:?}");
        stop.send(()).unwrap();
        thread.join().unwrap();
    }

    /// A server on a thread that runs `script` on the one connection it accepts.
    fn fake_server(
        script: impl FnOnce(TcpStream) + Send + 'static,
    ) -> (String, std::thread::JoinHandle<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let server = std::thread::spawn(move || script(listener.accept().unwrap().0));
        (addr, server)
    }

    #[test]
    fn an_error_reply_ends_the_run_without_waiting_for_data() {
        use crate::wire::handshake::encode_greeting;
        use crate::wire::{handshake_flags, opt};
        let (addr, server) = fake_server(|mut socket| {
            socket
                .write_all(&encode_greeting(
                    handshake_flags::FIXED_NEWSTYLE | handshake_flags::NO_ZEROES,
                ))
                .unwrap();
            let mut flags = [0u8; 4];
            socket.read_exact(&mut flags).unwrap();
            let mut header = [0u8; 16];
            socket.read_exact(&mut header).unwrap();
            let length = u32::from_be_bytes(header[12..16].try_into().unwrap());
            socket.read_exact(&mut vec![0; length as usize]).unwrap();
            let mut replies = Vec::new();
            OptionReply::info_export(opt::GO, 1 << 20, 1).encode_into(&mut replies);
            OptionReply::ack(opt::GO).encode_into(&mut replies);
            socket.write_all(&replies).unwrap();
            let mut request = [0u8; 28];
            socket.read_exact(&mut request).unwrap();
            let mut reply = Vec::new();
            reply.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
            reply.extend_from_slice(&5u32.to_be_bytes()); // EIO
            reply.extend_from_slice(&request[8..16]); // the cookie
            socket.write_all(&reply).unwrap();
            // Stay open until the client leaves: a client waiting for 4 KiB of data after
            // the error would wait until this gives up and closes, and then fail otherwise.
            socket
                .set_read_timeout(Some(Duration::from_secs(3)))
                .unwrap();
            let _ = socket.read(&mut [0u8; 1]);
        });
        let spec = spec(1, 4096, 100);
        let started = Instant::now();
        let error = reads(&addr, &spec).unwrap_err();
        assert!(
            matches!(error, LoadError::ReadFailed { error: 5, .. }),
            "{error}"
        );
        assert!(started.elapsed() < Duration::from_secs(2));
        server.join().unwrap();
    }

    #[test]
    fn a_server_that_does_not_speak_nbd_is_a_protocol_error() {
        let (addr, server) = fake_server(|mut socket| {
            socket.write_all(b"SSH-2.0-OpenSSH_9.2 hello\r\n").unwrap();
        });
        let spec = spec(1, 4096, 10);
        let error = reads(&addr, &spec).unwrap_err();
        assert!(matches!(error, LoadError::Protocol(_)), "{error}");
        server.join().unwrap();
    }
}
