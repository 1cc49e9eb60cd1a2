//! Bad input over raw sockets: the real `netblk` binary gets what well-behaved clients never
//! send, one test per rule. Every test checks both the refusal (the error code, or the
//! closed connection) and what must go on afterwards (the same connection, another
//! connection, or the server itself).
//!
//! Payloads of refused writes are filled with valid-looking READ headers ("decoys"): a server
//! that failed to consume such a payload would parse them as requests and answer them, and
//! the next reply would carry the decoy's cookie instead of the expected one.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::raw::{Mode, Raw, Reply, Setup};
use common::*;
use netblk::wire::handshake::{ClientOption, InfoRequest, MetaContextRequest};
use netblk::wire::transmission::{RequestHeader, RequestStyle};
use netblk::wire::{
    client_flags, cmd, cmd_flags, opt, rep, reply, state, transmission_flags, IHAVEOPT, MAX_PAYLOAD,
};

const EPERM: u32 = 1;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const EOVERFLOW: u32 = 75;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// The cookie of every decoy request hidden in refused payloads.
const DECOY: u64 = 0xDEC0_DEC0_DEC0_DEC0;

/// Deterministic pseudo-random bytes (xorshift64*), so failures replay.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
    if x == 0 {
        x = 1;
    }
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A payload of back-to-back READ requests with cookie [`DECOY`] in `style`.
fn decoy(style: RequestStyle, len: usize) -> Vec<u8> {
    let header = RequestHeader {
        flags: 0,
        command: cmd::READ,
        cookie: DECOY,
        offset: 0,
        length: 512,
    }
    .encode(style);
    header.iter().copied().cycle().take(len).collect()
}

/// Writes 4 KiB of fresh data at `offset` and reads it back: the connection still works
/// and is still in step (each reply carries the cookie of its request).
fn assert_usable(raw: &mut Raw, offset: u64, seed: u64) {
    let data = noise(seed, 4096);
    let cookie = 0x7000_0000_0000_0000 | (seed << 8);
    assert_eq!(
        raw.write(cookie, offset, &data),
        Some(0),
        "a write on a connection that should still work"
    );
    let read = raw
        .read(cookie | 1, offset, 4096)
        .expect("the connection is still open");
    assert_eq!(read.cookie, cookie | 1);
    assert_eq!(read.error, 0);
    assert!(read.data == data, "read back what was written at {offset}");
}

/// Reads the reply to request `cookie` and checks that it is the error `expected`, sent the
/// way the negotiated reply format demands: a simple reply, or a single `ERROR` chunk marked
/// done. `read_len` frames a (wrongly) successful simple reply to a READ.
fn expect_error(raw: &mut Raw, cookie: u64, read_len: usize, expected: u32, what: &str) -> Reply {
    let reply = raw
        .reply(read_len)
        .unwrap_or_else(|| panic!("{what}: no reply, the connection closed"));
    assert_eq!(reply.cookie, cookie, "{what}: reply to another request");
    assert_eq!(reply.error, expected, "{what}: {reply:?}");
    match raw.mode {
        Mode::Simple => assert!(reply.simple),
        Mode::Structured | Mode::Extended => {
            assert!(!reply.simple, "{what}: a simple reply");
            assert_eq!(reply.kinds, vec![reply::TYPE_ERROR], "{what}");
        }
    }
    reply
}

fn proc_status(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Waits up to 3 s for a log line containing every one of `needles`.
fn logged_line(server: &Server, needles: &[&str]) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let log = server.stderr();
        if let Some(line) = log.lines().find(|l| needles.iter().all(|n| l.contains(n))) {
            return Some(line.to_string());
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Rule 1: requests past the end of the export are refused, EINVAL for READ, TRIM and CACHE
/// and ENOSPC for WRITE and WRITE_ZEROES, with simple replies and as ERROR chunks with
/// structured replies and extended headers; nothing is changed and the connection goes on.
#[test]
fn rule1_past_the_end_is_einval_or_enospc_and_the_connection_goes_on() {
    let server = Server::start(&["memory:64M"]);
    let size = 64 * MIB;
    for (m, mode) in [Mode::Simple, Mode::Structured, Mode::Extended]
        .into_iter()
        .enumerate()
    {
        let mut raw = Raw::session(server.tcp(), mode);
        assert_eq!(raw.size, size);
        // Known data in the last 4 KiB: a refused write that landed anyway would show.
        let tail = noise(100 + m as u64, 4096);
        assert_eq!(raw.write(1, size - 4096, &tail), Some(0));
        let mut cases: Vec<(&str, u16, u64, u64, u32)> = vec![
            ("READ across the end", cmd::READ, size - 512, 1024, EINVAL),
            ("READ at the end", cmd::READ, size, 1, EINVAL),
            (
                "READ whose end overflows",
                cmd::READ,
                u64::MAX - 511,
                1024,
                EINVAL,
            ),
            ("TRIM across the end", cmd::TRIM, size - 4096, 8192, EINVAL),
            ("TRIM after the end", cmd::TRIM, size + 4096, 4096, EINVAL),
            ("CACHE across the end", cmd::CACHE, size - 1, 2, EINVAL),
            ("CACHE after the end", cmd::CACHE, size * 2, 4096, EINVAL),
            ("WRITE across the end", cmd::WRITE, size - 100, 200, ENOSPC),
            ("WRITE at the end", cmd::WRITE, size, 4096, ENOSPC),
            (
                "WRITE_ZEROES across the end",
                cmd::WRITE_ZEROES,
                size - 4096,
                8192,
                ENOSPC,
            ),
            (
                "WRITE_ZEROES far past the end",
                cmd::WRITE_ZEROES,
                4096,
                u64::from(u32::MAX),
                ENOSPC,
            ),
        ];
        if mode == Mode::Extended {
            cases.extend([
                ("TRIM with a 64-bit length", cmd::TRIM, 0, 5 * GIB, EINVAL),
                (
                    "CACHE whose 64-bit end overflows",
                    cmd::CACHE,
                    4096,
                    u64::MAX,
                    EINVAL,
                ),
                (
                    "WRITE_ZEROES with a 64-bit length",
                    cmd::WRITE_ZEROES,
                    0,
                    u64::MAX,
                    ENOSPC,
                ),
            ]);
        }
        for (i, (what, command, offset, length, expected)) in cases.into_iter().enumerate() {
            let what = format!("{mode:?} {what}");
            let cookie = 0x1000 + i as u64;
            let (payload, read_len, flags) = match command {
                cmd::WRITE => (
                    decoy(raw.style, length as usize),
                    0,
                    if mode == Mode::Extended {
                        cmd_flags::PAYLOAD_LEN
                    } else {
                        0
                    },
                ),
                cmd::READ => (Vec::new(), length as usize, 0),
                _ => (Vec::new(), 0, 0),
            };
            raw.request(command, flags, cookie, offset, length, &payload);
            let refused = expect_error(&mut raw, cookie, read_len, expected, &what);
            if mode == Mode::Extended {
                assert_eq!(refused.offsets, vec![Some(offset)], "{what}: offset echoed");
            }
            // A normal READ still works, and the refused request changed nothing.
            let read = raw
                .read(0x2000 + i as u64, size - 4096, 4096)
                .unwrap_or_else(|| panic!("{what}: connection closed"));
            assert_eq!(read.cookie, 0x2000 + i as u64, "{what}: reply to the READ");
            assert_eq!(read.error, 0, "{what}");
            assert!(read.data == tail, "{what}: the last 4 KiB changed");
        }
        assert_usable(&mut raw, 8 * MIB, m as u64);
    }
}

/// Rule 2: unknown commands, unknown flags, flags the negotiation did not allow, and
/// malformed commands are refused with EINVAL and the connection stays usable.
#[test]
fn rule2_unknown_commands_and_bad_flags_are_einval_and_the_connection_goes_on() {
    let server = Server::start(&["memory:64M"]);

    // (what, command, flags, offset, length, payload bytes)
    let simple_cases: [(&str, u16, u16, u64, u64, usize); 9] = [
        ("unknown command 42", 42, 0, 0, 4096, 0),
        ("unknown command 42, length 0", 42, 0, 0, 0, 0),
        ("unknown command 0xffff", 0xffff, 0, 0, 512, 0),
        (
            "READ with unknown flag bit 9",
            cmd::READ,
            1 << 9,
            0,
            4096,
            0,
        ),
        (
            "READ with DF without structured replies",
            cmd::READ,
            cmd_flags::DF,
            0,
            4096,
            0,
        ),
        (
            "BLOCK_STATUS without structured replies",
            cmd::BLOCK_STATUS,
            0,
            0,
            4096,
            0,
        ),
        ("FLUSH with a nonzero offset", cmd::FLUSH, 0, 4096, 0, 0),
        ("FLUSH with a nonzero length", cmd::FLUSH, 0, 0, 4096, 0),
        (
            "WRITE with unknown flag bit 9",
            cmd::WRITE,
            1 << 9,
            0,
            4096,
            4096,
        ),
    ];
    let mut raw = Raw::session(server.tcp(), Mode::Simple);
    for (i, (what, command, flags, offset, length, payload)) in simple_cases.into_iter().enumerate()
    {
        let cookie = 0x100 + i as u64;
        let read_len = if command == cmd::READ {
            length as usize
        } else {
            0
        };
        let payload = decoy(raw.style, payload);
        raw.request(command, flags, cookie, offset, length, &payload);
        expect_error(&mut raw, cookie, read_len, EINVAL, what);
        assert_usable(&mut raw, 4096 * i as u64, i as u64);
    }

    // Structured replies but no meta context at all, and extended headers with a
    // SET_META_CONTEXT that selected nothing: BLOCK_STATUS has no context to report.
    let mut structured = Raw::negotiate(
        server.tcp(),
        &Setup {
            meta: false,
            ..Setup::of(Mode::Structured)
        },
    );
    assert_eq!(structured.mode, Mode::Structured);
    let mut extended = Raw::hello(server.tcp());
    assert_eq!(
        extended.option(ClientOption::ExtendedHeaders)[0].reply_type,
        rep::ACK
    );
    let replies = extended.set_meta_context("", &["x-nosuch:context"]);
    assert_eq!(replies.len(), 1, "nothing selected: {replies:?}");
    assert_eq!(replies[0].reply_type, rep::ACK);
    assert_eq!(extended.go("").last().unwrap().reply_type, rep::ACK);
    assert_eq!(extended.mode, Mode::Extended);

    let chunked_cases: [(&str, u16, u16, u64, u64); 6] = [
        (
            "BLOCK_STATUS without a meta context",
            cmd::BLOCK_STATUS,
            0,
            0,
            4096,
        ),
        (
            "BLOCK_STATUS with REQ_ONE without a meta context",
            cmd::BLOCK_STATUS,
            cmd_flags::REQ_ONE,
            0,
            4096,
        ),
        ("unknown command 42", 42, 0, 0, 4096),
        ("READ with unknown flag bit 9", cmd::READ, 1 << 9, 0, 4096),
        ("READ with unknown flag bit 15", cmd::READ, 1 << 15, 0, 4096),
        ("FLUSH with a nonzero offset", cmd::FLUSH, 0, 512, 0),
    ];
    for raw in [&mut structured, &mut extended] {
        for (i, (what, command, flags, offset, length)) in chunked_cases.into_iter().enumerate() {
            let what = format!("{:?} {what}", raw.mode);
            let cookie = 0x200 + i as u64;
            raw.request(command, flags, cookie, offset, length, &[]);
            expect_error(raw, cookie, 0, EINVAL, &what);
            assert_usable(raw, 4096 * i as u64, 50 + i as u64);
        }
    }

    // A later SET_META_CONTEXT replaces the selection, even when it selects nothing or
    // fails: base:allocation selected first no longer counts.
    for (what, export, queries, reply_type) in [
        ("zero queries", "", &[][..], rep::ACK),
        (
            "an unknown export",
            "nosuch",
            &["base:allocation"][..],
            rep::ERR_UNKNOWN,
        ),
    ] {
        let mut raw = Raw::hello(server.tcp());
        raw.option(ClientOption::StructuredReply);
        raw.set_meta_context("", &["base:allocation"]);
        assert!(raw.context_id.is_some());
        let replies = raw.set_meta_context(export, queries);
        assert_eq!(replies.len(), 1, "{what}: {replies:?}");
        assert_eq!(replies[0].reply_type, reply_type, "{what}");
        assert_eq!(raw.go("").last().unwrap().reply_type, rep::ACK);
        raw.request(cmd::BLOCK_STATUS, 0, 0x300, 0, 4096, &[]);
        let what = format!("BLOCK_STATUS after a SET_META_CONTEXT with {what}");
        expect_error(&mut raw, 0x300, 0, EINVAL, &what);
        assert_usable(&mut raw, 0, 60);
    }
}

/// Rule 2, continued: a *malformed* SET_META_CONTEXT (answered `NBD_REP_ERR_INVALID`) also
/// replaces the selection ("Issuing this command replaces all previously-set metadata
/// contexts (including when this command fails)"), so BLOCK_STATUS afterwards has no
/// context and is EINVAL.
#[test]
fn rule2_a_flood_of_refused_requests_is_answered_but_barely_logged() {
    let server = Server::start(&["memory:1M"]);
    let mut raw = Raw::session(server.tcp(), Mode::Simple);
    let count = 2000;
    for cookie in 0..count {
        raw.request(99, 0, cookie, 0, 0, &[]);
    }
    for cookie in 0..count {
        expect_error(&mut raw, cookie, 0, EINVAL, "unknown command 99");
    }
    assert_usable(&mut raw, 0, 1);
    // The next window's first warning counts those left out.
    std::thread::sleep(Duration::from_millis(1100));
    raw.request(99, 0, count, 0, 0, &[]);
    expect_error(&mut raw, count, 0, EINVAL, "unknown command 99");
    let log = server.stderr();
    let lines = log.matches("refused request").count();
    // Ten a second pass; the run takes well under a few seconds.
    assert!(
        (1..=40).contains(&lines),
        "{lines} lines for {count} refused requests"
    );
    assert!(log.contains("suppressed"), "{log}");
}

/// Connects, reads the greeting, sends client flags and half an option, and resets.
fn reset_mid_handshake(address: &str) {
    let mut stream = TcpStream::connect(address).unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    stream.write_all(&3u32.to_be_bytes()).unwrap();
    stream.write_all(b"IHAVEOPT\0\0").unwrap();
    rustix::net::sockopt::set_socket_linger(&stream, Some(Duration::ZERO)).unwrap();
}

/// Rule 2, continued: clients that reset their connection in the middle of the handshake,
/// in a loop, are barely logged either: 5,000 such clients wrote 5,000 warnings in 0.8 s
/// (review, session 67).
#[test]
fn rule2_a_flood_of_broken_handshakes_is_barely_logged() {
    let server = Server::start(&["memory:1M"]);
    let count = 300;
    for _ in 0..count {
        reset_mid_handshake(server.tcp());
    }
    // A client asking for an export that does not exist, amid the resets, is still named:
    // its warning is limited apart from theirs.
    let mut stream = TcpStream::connect(server.tcp()).unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    stream.write_all(&3u32.to_be_bytes()).unwrap();
    let name = b"no-such-export";
    stream.write_all(b"IHAVEOPT").unwrap();
    stream.write_all(&1u32.to_be_bytes()).unwrap();
    stream
        .write_all(&(name.len() as u32).to_be_bytes())
        .unwrap();
    stream.write_all(name).unwrap();
    let _ = stream.read(&mut [0u8; 1]);
    // The next window's first warning counts those left out.
    std::thread::sleep(Duration::from_millis(1100));
    reset_mid_handshake(server.tcp());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !server.stderr().contains("suppressed") && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = server.stderr();
    let lines = log.matches("closing during handshake").count();
    assert!(
        (1..=40).contains(&lines),
        "{lines} lines for {count} broken handshakes"
    );
    assert!(log.contains("suppressed"), "{log}");
    assert!(log.contains("\"no-such-export\" requested"), "{log}");
    // The server still serves.
    let mut raw = Raw::session(server.tcp(), Mode::Simple);
    assert_usable(&mut raw, 0, 1);
}

#[test]
fn rule2_a_malformed_set_meta_context_also_clears_the_selection() {
    let server = Server::start(&["memory:64M"]);
    let mut raw = Raw::hello(server.tcp());
    raw.option(ClientOption::StructuredReply);
    raw.set_meta_context("", &["base:allocation"]);
    assert!(raw.context_id.is_some());
    // Export "", one query whose length runs past the option data.
    raw.send_option(
        opt::SET_META_CONTEXT,
        &[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 100, b'b', b'a', b's'],
    );
    let replies = raw.replies_until_final();
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].reply_type, rep::ERR_INVALID);
    assert_eq!(raw.go("").last().unwrap().reply_type, rep::ACK);
    raw.request(cmd::BLOCK_STATUS, 0, 1, 0, 4096, &[]);
    expect_error(
        &mut raw,
        1,
        0,
        EINVAL,
        "BLOCK_STATUS after a failed SET_META_CONTEXT",
    );
    assert_usable(&mut raw, 0, 1);
}

/// Rule 3: READ and WRITE above the advertised maximum payload (32 MiB) are refused with
/// EINVAL (a READ with chunked replies with EOVERFLOW); the refused write's payload is consumed, so the stream stays in step, and it is
/// discarded rather than buffered: a 200 MiB payload barely moves the server's peak RSS.
#[test]
fn rule3_above_the_maximum_is_einval_and_the_payload_is_discarded() {
    assert_eq!(u64::from(MAX_PAYLOAD), 32 * MIB);
    // Large enough that every refused request here lies inside the export.
    let server = Server::start(&["memory:256M"]);
    let pid = server.pid();
    let mut raw = Raw::session(server.tcp(), Mode::Simple);
    assert_usable(&mut raw, 0, 1);

    // 200 MiB of payload behind a compact header, streamed 1 MiB at a time.
    let rss_before = proc_status(pid, "VmRSS:");
    let len = 200 * MIB;
    raw.request(cmd::WRITE, 0, 10, 0, len, &[]);
    let piece = decoy(raw.style, MIB as usize);
    for _ in 0..200 {
        raw.send(&piece);
    }
    expect_error(&mut raw, 10, 0, EINVAL, "WRITE of 200 MiB");
    assert_usable(&mut raw, 4096, 2);
    let peak = proc_status(pid, "VmHWM:");
    assert!(
        peak < rss_before + 64 * 1024,
        "peak RSS {peak} KiB after a 200 MiB refused write, {rss_before} KiB before: \
         the payload was buffered"
    );

    for mode in [Mode::Simple, Mode::Structured, Mode::Extended] {
        let mut raw = Raw::session(server.tcp(), mode);
        // One byte over the limit, well inside the export: the limit is what refuses it.
        let over = u64::from(MAX_PAYLOAD) + 1;
        raw.request(cmd::READ, 0, 20, 0, over, &[]);
        // With chunked replies the spec bounds no read by the maximum payload, and lets a
        // server refuse a large one with EOVERFLOW (the hint to retry smaller).
        let expected = if mode == Mode::Simple {
            EINVAL
        } else {
            EOVERFLOW
        };
        expect_error(&mut raw, 20, over as usize, expected, "READ of 32 MiB + 1");
        assert_usable(&mut raw, 8192, 3);

        let len = MAX_PAYLOAD as usize + 4096;
        let payload = decoy(raw.style, len);
        if mode == Mode::Extended {
            // With PAYLOAD_LEN above the maximum the extension prefers a hard disconnect
            // ("SHOULD"); consuming the payload and answering EINVAL is accepted as well.
            let header =
                raw.encode_request(cmd::WRITE, cmd_flags::PAYLOAD_LEN, 21, 0, len as u64, &[]);
            let sent = raw.try_send(&header) && raw.try_send(&payload);
            match sent.then(|| raw.reply(0)).flatten() {
                None => {
                    assert!(raw.wait_closed(Duration::from_secs(5)).is_closed());
                    let mut fresh = Raw::session(server.tcp(), mode);
                    let read = fresh.read(22, 16384, 4096).expect("a fresh connection");
                    assert!(
                        read.data.iter().all(|&b| b == 0),
                        "the refused write landed"
                    );
                    continue;
                }
                Some(reply) => {
                    assert_eq!((reply.cookie, reply.error), (21, EINVAL), "{reply:?}");
                    assert_eq!(reply.kinds, vec![reply::TYPE_ERROR]);
                }
            }
        } else {
            raw.request(cmd::WRITE, 0, 21, 0, len as u64, &payload);
            expect_error(&mut raw, 21, 0, EINVAL, "WRITE of 32 MiB + 4 KiB");
        }
        // The next request parses, and nothing of the refused write landed.
        let read = raw.read(22, 16384, 4096).expect("connection open");
        assert_eq!(read.cookie, 22, "the next request is read in step");
        assert!(
            read.data.iter().all(|&b| b == 0),
            "the refused write landed"
        );
        assert_usable(&mut raw, 12288, 4);
    }

    // Exactly the maximum is accepted.
    let mut raw = Raw::session(server.tcp(), Mode::Structured);
    let full = noise(5, MAX_PAYLOAD as usize);
    assert_eq!(raw.write(30, 0, &full), Some(0));
    let read = raw.read(31, 0, MAX_PAYLOAD).unwrap();
    assert_eq!(read.error, 0);
    assert_eq!(read.data_offset, Some(0));
    assert!(read.data == full, "a 32 MiB write reads back");
}

/// Rule 4: on a read-only export WRITE, TRIM and WRITE_ZEROES are EPERM, READ works, and a
/// refused write's payload is consumed.
#[test]
fn rule4_writes_to_a_read_only_export_are_eperm() {
    let server = Server::start(&["--read-only", "memory:64M"]);
    for mode in [Mode::Simple, Mode::Structured, Mode::Extended] {
        let mut raw = Raw::session(server.tcp(), mode);
        assert!(
            raw.transmission_flags & transmission_flags::READ_ONLY != 0,
            "the export is advertised read-only"
        );
        let write_flags = if mode == Mode::Extended {
            cmd_flags::PAYLOAD_LEN
        } else {
            0
        };
        let cases: [(&str, u16, u16, u64); 5] = [
            ("WRITE", cmd::WRITE, write_flags, 4096),
            (
                "WRITE with FUA",
                cmd::WRITE,
                write_flags | cmd_flags::FUA,
                65536,
            ),
            ("TRIM", cmd::TRIM, 0, 4096),
            ("WRITE_ZEROES", cmd::WRITE_ZEROES, 0, 4096),
            (
                "WRITE_ZEROES with NO_HOLE",
                cmd::WRITE_ZEROES,
                cmd_flags::NO_HOLE,
                1 << 20,
            ),
        ];
        for (i, (what, command, flags, length)) in cases.into_iter().enumerate() {
            let what = format!("{mode:?} {what}");
            let cookie = 0x40 + i as u64;
            let payload = if command == cmd::WRITE {
                decoy(raw.style, length as usize)
            } else {
                Vec::new()
            };
            raw.request(command, flags, cookie, 4096, length, &payload);
            expect_error(&mut raw, cookie, 0, EPERM, &what);
            // READ works, the stream is in step, and nothing changed.
            let read = raw.read(0x80 + i as u64, 0, 8192).expect("connection open");
            assert_eq!(read.cookie, 0x80 + i as u64, "{what}: payload consumed");
            assert_eq!(read.error, 0, "{what}");
            assert!(read.data.iter().all(|&b| b == 0), "{what}: data changed");
        }
        // Reads of any kind keep working.
        raw.request(cmd::FLUSH, 0, 0x90, 0, 0, &[]);
        assert_eq!(raw.reply(0).unwrap().error, 0);
        let read = raw.read(0x91, 60 * MIB, 1 << 20).unwrap();
        assert_eq!(
            (read.cookie, read.error, read.data.len()),
            (0x91, 0, 1 << 20)
        );
    }
}

/// Rule 5: a bad request magic closes that connection only; another connection keeps
/// working, and the log names the problem and the offending client.
#[test]
fn rule5_a_bad_request_magic_closes_only_that_connection() {
    let server = Server::start(&["memory:64M"]);
    let mut bystander = Raw::session(server.tcp(), Mode::Structured);
    assert_usable(&mut bystander, 0, 1);
    let bystander_addr = bystander.local_addr();

    // A compact connection sending garbage where a header belongs.
    let mut offender = Raw::session(server.tcp(), Mode::Simple);
    assert_usable(&mut offender, 4096, 2);
    let offender_addr = offender.local_addr();
    offender.send(&[0xde, 0xad, 0xbe, 0xef].repeat(8));
    let closed = offender.wait_closed(Duration::from_secs(5));
    assert!(
        closed.is_closed(),
        "the server closes the connection after a bad magic: {closed:?}"
    );
    assert_usable(&mut bystander, 8192, 3);
    let line = logged_line(&server, &["magic", &offender_addr])
        .unwrap_or_else(|| panic!("no log line about the bad magic from {offender_addr}"));
    assert!(line.contains("deadbeef"), "the log shows the magic: {line}");

    // An extended connection sending a compact header: also a bad magic.
    let mut offender = Raw::session(server.tcp(), Mode::Extended);
    assert_usable(&mut offender, 12288, 4);
    let offender_addr = offender.local_addr();
    let compact = RequestHeader {
        flags: 0,
        command: cmd::READ,
        cookie: 5,
        offset: 0,
        length: 512,
    }
    .encode(RequestStyle::Compact);
    offender.send(&compact);
    offender.send(&[0; 4]); // a full extended header's worth of bytes
    let closed = offender.wait_closed(Duration::from_secs(5));
    assert!(
        closed.is_closed(),
        "a compact header on an extended connection closes it: {closed:?}"
    );
    assert!(
        logged_line(&server, &["magic", &offender_addr]).is_some(),
        "no log line about the bad magic from {offender_addr}:\n{}",
        server.stderr()
    );

    assert_usable(&mut bystander, 16384, 5);
    assert!(
        !server
            .stderr()
            .lines()
            .any(|l| l.contains(&bystander_addr) && l.contains("magic")),
        "the bystander was blamed"
    );
}

/// Rule 6: handshake violations drop the connection; malformed, unknown or refused options
/// get an error reply and negotiation goes on.
#[test]
fn rule6_handshake_violations_drop_and_bad_options_are_answered() {
    // A long handshake timeout, so a close within seconds is the server's own decision.
    let server = Server::start(&["--handshake-timeout", "60s", "memory:64M"]);
    let prompt = Duration::from_secs(3);

    // Unknown client flags.
    let mut raw = Raw::connect(server.tcp());
    raw.send(&(client_flags::FIXED_NEWSTYLE | 1 << 5).to_be_bytes());
    assert!(raw.wait_closed(prompt).is_closed(), "unknown client flags");
    assert!(logged_line(&server, &["unknown client flags"]).is_some());

    // Bad option magic.
    let mut raw = Raw::hello(server.tcp());
    let mut bad = ClientOption::List.encode();
    bad[0] ^= 0xff;
    raw.send(&bad);
    assert!(raw.wait_closed(prompt).is_closed(), "bad option magic");

    // An option beyond all reason is refused from its header alone: the server does not
    // wait for (or read) the gigabyte of data announced. (Up to 64 MiB it reads past an
    // option too long to take, and refuses it with NBD_REP_ERR_TOO_BIG: below.)
    let mut raw = Raw::hello(server.tcp());
    let mut header = IHAVEOPT.to_be_bytes().to_vec();
    header.extend(opt::GO.to_be_bytes());
    header.extend((1u32 << 30).to_be_bytes());
    raw.send(&header);
    let started = Instant::now();
    assert!(
        raw.wait_closed(prompt).is_closed(),
        "an option announcing 1 GiB of data"
    );
    assert!(started.elapsed() < prompt);

    // NBD_OPT_EXPORT_NAME for an unknown export has no error reply: dropped.
    let mut raw = Raw::hello(server.tcp());
    raw.send(&ClientOption::ExportName("nosuch".into()).encode());
    let closed = raw.wait_closed(prompt);
    assert!(
        closed.is_closed(),
        "EXPORT_NAME of an unknown export: {closed:?}"
    );

    // ABORT is acknowledged, then the server closes.
    let mut raw = Raw::hello(server.tcp());
    let replies = raw.option(ClientOption::Abort);
    assert_eq!(replies.len(), 1);
    assert_eq!(replies[0].reply_type, rep::ACK);
    let closed = raw.wait_closed(prompt);
    assert!(closed.is_closed(), "not closed after ABORT: {closed:?}");

    // Everything below is answered with an error, and negotiation goes on.
    let mut raw = Raw::hello(server.tcp());
    let expect = |raw: &mut Raw, option: u32, reply_type: u32, what: &str| {
        let replies = raw.replies_until_final();
        assert_eq!(replies.len(), 1, "{what}: {replies:?}");
        assert_eq!(replies[0].option, option, "{what}");
        assert_eq!(replies[0].reply_type, reply_type, "{what}: {replies:?}");
    };
    // GO whose name length runs past the option data.
    raw.send_option(opt::GO, &[0, 0, 0, 9, b'x', 0, 0]);
    expect(&mut raw, opt::GO, rep::ERR_INVALID, "malformed GO");
    // GO with trailing bytes.
    raw.send_option(opt::GO, &[0, 0, 0, 0, 0, 0, 0xff]);
    expect(
        &mut raw,
        opt::GO,
        rep::ERR_INVALID,
        "GO with trailing bytes",
    );
    // An unknown option, with data the server must skip.
    raw.send_option(99, &noise(99, 1000));
    expect(&mut raw, 99, rep::ERR_UNSUP, "unknown option 99");
    raw.send_option(0xffff_fff0, &[]);
    expect(
        &mut raw,
        0xffff_fff0,
        rep::ERR_UNSUP,
        "unknown option 0xfffffff0",
    );
    // GO for an export that does not exist.
    raw.send(
        &ClientOption::Go(InfoRequest {
            name: "nosuch".into(),
            requests: vec![],
        })
        .encode(),
    );
    expect(
        &mut raw,
        opt::GO,
        rep::ERR_UNKNOWN,
        "GO of an unknown export",
    );
    // SET_META_CONTEXT before structured replies.
    raw.send(
        &ClientOption::SetMetaContext(MetaContextRequest {
            export: String::new(),
            queries: vec!["base:allocation".into()],
        })
        .encode(),
    );
    expect(
        &mut raw,
        opt::SET_META_CONTEXT,
        rep::ERR_INVALID,
        "SET_META_CONTEXT before structured replies",
    );
    // LIST with data.
    raw.send_option(opt::LIST, b"x");
    expect(&mut raw, opt::LIST, rep::ERR_INVALID, "LIST with data");
    // An option of exactly the largest accepted length is read and skipped.
    raw.send_option(98, &vec![0xa5; netblk::wire::MAX_OPTION_LEN as usize]);
    expect(&mut raw, 98, rep::ERR_UNSUP, "unknown option of 64 KiB");
    // A longer one is read past and refused as too big, known or not (the spec: the
    // server may skip any option; NBD_REP_ERR_TOO_BIG is the refusal for its size).
    let long = vec![0x5a; netblk::wire::MAX_OPTION_LEN as usize + 4464];
    raw.send_option(97, &long);
    expect(
        &mut raw,
        97,
        rep::ERR_TOO_BIG,
        "unknown option of 70,000 bytes",
    );
    raw.send_option(opt::SET_META_CONTEXT, &long);
    expect(
        &mut raw,
        opt::SET_META_CONTEXT,
        rep::ERR_TOO_BIG,
        "SET_META_CONTEXT of 70,000 bytes",
    );
    // An error that quotes a long name keeps to 4096 bytes of UTF-8 (a name of 2048 'é'
    // is 4096 bytes, legal; quoted, the message is longer and was cut inside a character).
    raw.send(
        &ClientOption::Info(InfoRequest {
            name: "é".repeat(2048),
            requests: vec![],
        })
        .encode(),
    );
    let replies = raw.replies_until_final();
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(replies[0].reply_type, rep::ERR_UNKNOWN);
    assert!(replies[0].data.len() <= 4096);
    assert!(std::str::from_utf8(&replies[0].data).is_ok(), "not UTF-8");
    // TLS is not offered: STARTTLS is refused and negotiation goes on in the clear.
    raw.send_option(netblk::wire::opt::STARTTLS, &[]);
    expect(
        &mut raw,
        netblk::wire::opt::STARTTLS,
        rep::ERR_UNSUP,
        "STARTTLS without TLS",
    );
    // A plain LIST still works, then GO enters transmission.
    let list = raw.option(ClientOption::List);
    assert_eq!(list.last().unwrap().reply_type, rep::ACK, "{list:?}");
    let go = raw.go("");
    assert_eq!(go.last().unwrap().reply_type, rep::ACK, "{go:?}");
    assert_eq!(raw.size, 64 * MIB);
    assert_usable(&mut raw, 0, 6);

    // NBD_OPT_ABORT is acknowledged and ends the session whatever data it carries.
    let mut raw = Raw::hello(server.tcp());
    raw.send_option(opt::ABORT, &long);
    expect(
        &mut raw,
        opt::ABORT,
        rep::ACK,
        "ABORT with 70,000 bytes of data",
    );
    assert!(raw.is_closed(), "still open after ABORT");
}

/// Rule 7: a client that stalls in the handshake is dropped after the handshake timeout and
/// logged, while other clients negotiate and work (and keep working past the timeout).
#[test]
fn rule7_a_stalled_handshake_is_dropped_after_the_timeout() {
    let server = Server::start(&["--handshake-timeout", "1s", "memory:64M"]);
    let started = Instant::now();
    // One sends nothing after the greeting; one stops inside an option header.
    let mut silent = Raw::connect(server.tcp());
    let mut halfway = Raw::hello(server.tcp());
    halfway.send(&IHAVEOPT.to_be_bytes());
    let silent_addr = silent.local_addr();
    let halfway_addr = halfway.local_addr();

    // Meanwhile another client negotiates and works.
    let mut other = Raw::session(server.tcp(), Mode::Structured);
    assert_usable(&mut other, 0, 1);

    for (raw, addr) in [(&mut silent, &silent_addr), (&mut halfway, &halfway_addr)] {
        let left = Duration::from_secs(3).saturating_sub(started.elapsed());
        let closed = raw.wait_closed(left);
        let waited = started.elapsed();
        assert!(
            closed.is_closed(),
            "{addr}: {closed:?} after {waited:?}, not closed within 3 s"
        );
        assert!(
            waited >= Duration::from_millis(900),
            "{addr}: closed after {waited:?}, before the 1 s timeout"
        );
        assert!(
            logged_line(&server, &["handshake", addr]).is_some(),
            "the stalled client {addr} is not logged:\n{}",
            server.stderr()
        );
    }

    // The negotiated client is past the handshake: the timeout does not apply to it.
    std::thread::sleep(Duration::from_millis(1500).saturating_sub(started.elapsed()));
    assert_usable(&mut other, 4096, 2);
    let mut late = Raw::session(server.tcp(), Mode::Simple);
    assert_usable(&mut late, 8192, 3);
}

/// Rule 8: garbage from 100 connections, at the handshake and in transmission, never takes
/// the server down nor leaks connections; a normal client works afterwards.
#[test]
fn rule8_garbage_never_takes_the_server_down() {
    let mut server = Server::start(&["--handshake-timeout", "5s", "memory:64M"]);
    let pid = server.pid();
    let fds_before = open_fds(pid);

    for seed in 0..50u64 {
        let mut sock = TcpStream::connect(server.tcp()).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        // Some garbage starts with valid client flags, some also with an option magic, and
        // some is a run of well-framed options with random data, so it reaches the option
        // parsers.
        let mut bytes = Vec::new();
        if seed % 4 >= 1 {
            bytes.extend(client_flags::FIXED_NEWSTYLE.to_be_bytes());
        }
        match seed % 4 {
            2 => bytes.extend(IHAVEOPT.to_be_bytes()),
            3 => {
                for (i, r) in noise(seed, 16).into_iter().enumerate() {
                    let data = noise(seed * 100 + i as u64, usize::from(r) % 200);
                    let option = [
                        opt::GO,
                        opt::INFO,
                        opt::SET_META_CONTEXT,
                        opt::LIST_META_CONTEXT,
                    ][usize::from(r) % 4];
                    let mut frame = IHAVEOPT.to_be_bytes().to_vec();
                    frame.extend(option.to_be_bytes());
                    frame.extend((data.len() as u32).to_be_bytes());
                    frame.extend(data);
                    bytes.extend(frame);
                }
            }
            _ => {}
        }
        bytes.extend(noise(seed, 1024 + (seed as usize % 7) * 512));
        let _ = sock.write_all(&bytes);
        let mut raw = Raw::from_socket(sock);
        let (closed, _) = raw.finish_and_drain(Duration::from_secs(10));
        assert!(closed, "handshake garbage {seed}: the server never closed");
    }

    for seed in 0..50u64 {
        let mode = [Mode::Simple, Mode::Structured, Mode::Extended][seed as usize % 3];
        let mut raw = Raw::session(server.tcp(), mode);
        let magic: &[u8] = if mode == Mode::Extended {
            &[0x21, 0xe4, 0x1c, 0x71]
        } else {
            &[0x25, 0x60, 0x95, 0x13]
        };
        let mut bytes = Vec::new();
        match seed % 4 {
            // Pure noise.
            0 => bytes.extend(noise(1000 + seed, 4096)),
            // A valid magic, then noise: reaches the command and flag checks.
            1 => {
                bytes.extend_from_slice(magic);
                bytes.extend(noise(1000 + seed, 4096));
            }
            // Headers with a valid magic and random fields, back to back.
            _ => {
                let fields = noise(2000 + seed, 64 * 32);
                for f in fields.chunks(32).take(64) {
                    bytes.extend_from_slice(magic);
                    bytes.extend_from_slice(&f[..2]); // flags
                    bytes.extend_from_slice(&[0, f[2] % 10]); // mostly known commands
                    bytes.extend_from_slice(&f[3..11]); // cookie
                    if f[11] % 2 == 0 {
                        bytes.extend_from_slice(&f[12..20]); // any offset
                    } else {
                        bytes.extend_from_slice(&(u64::from(f[12]) * 4096).to_be_bytes());
                    }
                    let len = u32::from_be_bytes([0, f[20] % 2, f[21], f[22]]);
                    if mode == Mode::Extended {
                        bytes.extend_from_slice(&u64::from(len).to_be_bytes());
                    } else {
                        bytes.extend_from_slice(&len.to_be_bytes());
                    }
                }
            }
        }
        let _ = raw.sock.write_all(&bytes);
        let (closed, _) = raw.finish_and_drain(Duration::from_secs(10));
        assert!(
            closed,
            "transmission garbage {seed} ({mode:?}): the server never closed"
        );
    }

    assert!(
        server.wait_exit(Duration::ZERO).is_none(),
        "the server died:\n{}",
        server.stderr()
    );
    for mode in [Mode::Simple, Mode::Structured, Mode::Extended] {
        let mut raw = Raw::session(server.tcp(), mode);
        assert_usable(&mut raw, 0, mode as u64);
    }
    // Every garbage connection was let go.
    let deadline = Instant::now() + Duration::from_secs(5);
    while open_fds(pid) > fds_before + 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        open_fds(pid) <= fds_before + 2,
        "{} descriptors open, {fds_before} before the garbage",
        open_fds(pid)
    );
    let log = server.stderr();
    let panics: Vec<&str> = log.lines().filter(|l| l.contains("panicked")).collect();
    assert!(panics.is_empty(), "the server panicked: {panics:#?}");
    assert!(server.wait_exit(Duration::ZERO).is_none());
}

/// Connections that break off mid-request (a write whose payload stops short, a 32 MiB read
/// never collected, part of a header, 200 reads then a reset, noise), after negotiating
/// simple, structured or extended headers by turns, while libnbd clients check every read
/// against a model of what they wrote, in each cache mode: the broken connections cost only
/// themselves, and no verifying client sees a wrong byte or an error.
#[test]
fn breaking_connections_never_disturb_clients_that_verify_their_data() {
    if !have("nbdsh") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let backing = dir.path().join("disk.img");
    let backing = backing.to_str().expect("UTF-8 path");
    let modes: [&[&str]; 3] = [
        &["memory:48M"],
        &["--cache", "writeback", "--size", "48M", backing],
        &["--cache", "none", "--size", "48M", backing],
    ];
    for args in modes {
        // The breakers open a connection every few milliseconds, and one that asked for a
        // 32 MiB read is retired only once that read is done: on a loaded machine over a
        // hundred wait to end at once, more than the default --max-connections.
        let limit = ["--max-connections", "4096"];
        let mut server = Server::start(&[&limit[..], args].concat());
        let clients = std::process::Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(VERIFYING_CLIENTS)
            .arg(server.uri())
            .arg(VERIFYING_CLIENTS_COUNT.to_string())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("python3");
        let clients = std::sync::Mutex::new(clients);
        // The verifying clients keep the fifth of the export past their regions free.
        let scratch = 48 * MIB / (VERIFYING_CLIENTS_COUNT + 1) * VERIFYING_CLIENTS_COUNT;
        let broken: usize = std::thread::scope(|scope| {
            let breakers: Vec<_> = (0..2u64)
                .map(|seed| {
                    let (tcp, clients) = (server.tcp(), &clients);
                    scope.spawn(move || {
                        let mut broken = 0;
                        while clients.lock().unwrap().try_wait().unwrap().is_none() {
                            break_one_connection(tcp, seed * 1_000_000 + broken as u64, scratch);
                            broken += 1;
                        }
                        broken
                    })
                })
                .collect();
            breakers.into_iter().map(|b| b.join().unwrap()).sum()
        });
        let out = clients.into_inner().unwrap().wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.starts_with("ok "),
            "{args:?}: {stdout}{}\nserver log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            server.stderr()
        );
        assert!(broken > 20, "{args:?}: only {broken} broken connections");
        eprintln!("{args:?}: {}, {broken} broken connections", stdout.trim());
        assert!(
            server.wait_exit(Duration::ZERO).is_none(),
            "{args:?}: the server died:\n{}",
            server.stderr()
        );
        let log = server.stderr();
        assert!(
            !log.contains("panicked"),
            "{args:?}: the server panicked:\n{log}"
        );
    }
}

/// Opens a session (simple, structured or extended headers, by turns) and breaks it off in
/// one of five ways chosen by `seed`; writes go to `scratch`, outside the verifying clients'
/// regions.
fn break_one_connection(addr: &str, seed: u64, scratch: u64) {
    let mode = [Mode::Simple, Mode::Structured, Mode::Extended][(seed / 5 % 3) as usize];
    let mut raw = Raw::session(addr, mode);
    let random = u64::from_le_bytes(noise(seed, 8).try_into().unwrap());
    let request = |raw: &Raw, command, cookie, offset, length: u64| {
        raw.encode_request(command, 0, cookie, offset, length, &[])
    };
    let mut bytes = match seed % 5 {
        0 => {
            let mut write = request(&raw, cmd::WRITE, 1, scratch, MIB);
            write.extend(noise(seed, (random % MIB) as usize));
            write
        }
        1 => request(&raw, cmd::READ, 2, 0, 32 * MIB),
        2 => request(&raw, cmd::READ, 3, 0, 4096),
        3 => (0..200)
            .flat_map(|c| request(&raw, cmd::READ, c, 4096 * c, 4096))
            .collect(),
        _ => noise(seed, 1 + (random % 4096) as usize),
    };
    if seed % 5 == 2 {
        // Part of the read's header (28 bytes, or 32 with extended headers).
        bytes.truncate(1 + (random % (bytes.len() as u64 - 1)) as usize);
    }
    let _ = raw.try_send(&bytes);
    if seed % 5 == 3 {
        // Closing with unread replies and a zero linger resets the connection.
        let _ = rustix::net::sockopt::set_socket_linger(&raw.sock, Some(Duration::ZERO));
    }
    if random % 2 == 0 {
        std::thread::sleep(Duration::from_micros(random % 5000));
    }
}

/// How many verifying clients [`VERIFYING_CLIENTS`] runs (its second argument), each on its
/// own fifth of the export.
const VERIFYING_CLIENTS_COUNT: u64 = 4;

/// libnbd clients on disjoint regions for three seconds, each checking every read against
/// a model of what it wrote; arguments: the export's URI and how many clients.
const VERIFYING_CLIENTS: &str = r#"
import nbd, os, random, sys, threading, time
uri, WORKERS, SECONDS = sys.argv[1], int(sys.argv[2]), 3.0
failures, verified = [], [0]

def verify(i):
    rnd = random.Random(i)
    h = nbd.NBD()
    if i % 2:
        h.set_request_structured_replies(False)
    h.connect_uri(uri)
    region = h.get_size() // (WORKERS + 1)
    base = i * region
    model = bytearray(h.pread(region, base))
    end = time.time() + SECONDS
    while time.time() < end and not failures:
        n = min(rnd.choice([1, 511, 4096, 4097, 65536, 131075, 1 << 20, 3 << 20]), region)
        off = rnd.randrange(region - n + 1)
        if rnd.random() < 0.5:
            off -= off % 512
        op = rnd.random()
        if op < 0.4:
            data = os.urandom(n)
            h.pwrite(data, base + off, nbd.CMD_FLAG_FUA if rnd.random() < 0.1 else 0)
            model[off:off + n] = data
        elif op < 0.75:
            if h.pread(n, base + off) != model[off:off + n]:
                failures.append(f"client {i}: wrong data at {base + off}+{n}")
        elif op < 0.85:
            h.zero(n, base + off)
            model[off:off + n] = bytes(n)
        elif op < 0.9:
            h.trim(n, base + off)     # leaves the range undefined: read back what it holds
            model[off:off + n] = h.pread(n, base + off)
        elif op < 0.95:
            h.flush()
        else:                          # eight reads in flight at once
            reads = []
            for _ in range(8):
                m = rnd.choice([4096, 65536])
                o = rnd.randrange(region - m + 1)
                buf = nbd.Buffer(m)
                reads.append((h.aio_pread(buf, base + o), buf, o, m))
            for cookie, buf, o, m in reads:
                while not h.aio_command_completed(cookie):
                    h.poll(-1)
                if buf.to_bytearray() != model[o:o + m]:
                    failures.append(f"client {i}: wrong data in flight at {base + o}+{m}")
        verified[0] += 1
    if h.pread(region, base) != model:
        failures.append(f"client {i}: the region differs at the end")
    h.shutdown()

def guarded(i):
    try:
        verify(i)
    except Exception as e:
        failures.append(f"client {i}: {e!r}")

threads = [threading.Thread(target=guarded, args=(i,)) for i in range(WORKERS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not failures, failures[:5]
assert verified[0] > 20, verified[0]
print(f"ok {verified[0]} checked operations")
"#;

/// Rule 9: 512 requests in flight on one connection: pipelined WRITEs, then pipelined READs,
/// every reply matched by cookie (in any order) and every read verified.
#[test]
fn rule9_hundreds_of_requests_in_flight() {
    let server = Server::start(&["memory:64M"]);
    const N: u64 = 512;
    for (m, mode) in [Mode::Simple, Mode::Structured, Mode::Extended]
        .into_iter()
        .enumerate()
    {
        let mut raw = Raw::session(server.tcp(), mode);
        let block = |i: u64| noise((m as u64) << 32 | i, 4096);
        // Scattered offsets, and cookies that use all 64 bits.
        let offset = |i: u64| ((i * 193) % N) * 4096 + (m as u64) * 4 * MIB;
        let write_cookie = |i: u64| 0xC0DE_0000_0000_0000 | (i << 24) | i;
        let read_cookie = |i: u64| 0xFEED_0000_0000_0000 | (i << 40) | i;
        let write_flags = if mode == Mode::Extended {
            cmd_flags::PAYLOAD_LEN
        } else {
            0
        };

        let mut batch = Vec::with_capacity(N as usize * 4200);
        for i in 0..N {
            batch.extend(raw.encode_request(
                cmd::WRITE,
                write_flags,
                write_cookie(i),
                offset(i),
                4096,
                &block(i),
            ));
        }
        raw.send(&batch);
        let replies = raw.replies(N as usize, |_| 0).expect("all write replies");
        for i in 0..N {
            let reply = &replies[&write_cookie(i)];
            assert_eq!(reply.error, 0, "{mode:?} write {i}");
        }

        let mut batch = Vec::new();
        for i in 0..N {
            batch.extend(raw.encode_request(cmd::READ, 0, read_cookie(i), offset(i), 4096, &[]));
        }
        raw.send(&batch);
        let replies: HashMap<u64, Reply> =
            raw.replies(N as usize, |_| 4096).expect("all read replies");
        for i in 0..N {
            let reply = &replies[&read_cookie(i)];
            assert_eq!(reply.error, 0, "{mode:?} read {i}");
            if mode != Mode::Simple {
                assert_eq!(reply.data_offset, Some(offset(i)), "{mode:?} read {i}");
            }
            assert!(reply.data == block(i), "{mode:?} read {i}: wrong data");
        }
    }
}

/// Rule 10: with extended headers, WRITE works with and without PAYLOAD_LEN, reply chunks
/// echo the request offset, effect lengths are 64-bit (zeroing over 4 GiB), and BLOCK_STATUS
/// answers with a BLOCK_STATUS_EXT chunk.
#[test]
fn rule10_extended_headers_carry_64_bit_lengths_and_echo_offsets() {
    let server = Server::start(&["memory:8G"]);
    let mut raw = Raw::session(server.tcp(), Mode::Extended);
    assert_eq!(raw.size, 8 * GIB);
    let context = raw.context_id.expect("base:allocation selected");

    let a = noise(1, 4096);
    let b = noise(2, 4096);
    let c = noise(3, 4096);
    raw.request(cmd::WRITE, cmd_flags::PAYLOAD_LEN, 1, MIB, 4096, &a);
    let reply = raw.reply(0).unwrap();
    assert_eq!((reply.cookie, reply.error), (1, 0));
    assert_eq!(reply.kinds, vec![reply::TYPE_NONE]);
    assert_eq!(
        reply.offsets,
        vec![Some(MIB)],
        "the reply echoes the offset"
    );
    // Without PAYLOAD_LEN (as qemu sends it) the payload is still the write's data.
    raw.request(cmd::WRITE, 0, 2, 2 * MIB, 4096, &b);
    let reply = raw.reply(0).unwrap();
    assert_eq!((reply.cookie, reply.error), (2, 0));
    assert_eq!(reply.offsets, vec![Some(2 * MIB)]);
    let high = 4 * GIB + GIB / 2 + 12345;
    raw.request(cmd::WRITE, cmd_flags::PAYLOAD_LEN, 3, high, 4096, &c);
    assert_eq!(raw.reply(0).unwrap().error, 0);

    for (cookie, offset, data) in [(4, MIB, &a), (5, 2 * MIB, &b), (6, high, &c)] {
        let reply = raw.read(cookie, offset, 4096).unwrap();
        assert_eq!((reply.cookie, reply.error), (cookie, 0));
        assert!(reply.data == *data, "read back at {offset}");
        assert!(
            reply.offsets.iter().all(|o| *o == Some(offset)),
            "every chunk echoes the request offset: {:?}",
            reply.offsets
        );
    }
    // A read spanning data and holes: several chunks, all echoing the request offset.
    let reply = raw.read(7, MIB - 65536, 196608).unwrap();
    assert_eq!(reply.error, 0);
    assert_eq!(reply.data_offset, Some(MIB - 65536));
    assert!(reply.data[65536..65536 + 4096] == a[..]);
    assert!(reply.offsets.iter().all(|o| *o == Some(MIB - 65536)));
    // An error reply echoes the offset too.
    raw.request(cmd::READ, 0, 8, 8 * GIB - 100, 4096, &[]);
    let reply = expect_error(&mut raw, 8, 0, EINVAL, "READ past the end");
    assert_eq!(reply.offsets, vec![Some(8 * GIB - 100)]);

    // BLOCK_STATUS over more than 4 GiB: one BLOCK_STATUS_EXT chunk for base:allocation.
    raw.request(cmd::BLOCK_STATUS, 0, 9, 0, 6 * GIB, &[]);
    let reply = raw.reply(0).unwrap();
    assert_eq!((reply.cookie, reply.error), (9, 0));
    assert_eq!(reply.kinds, vec![reply::TYPE_BLOCK_STATUS_EXT]);
    assert_eq!(reply.offsets, vec![Some(0)]);
    let payload = &reply.payloads[0];
    assert_eq!(
        u32::from_be_bytes(payload[..4].try_into().unwrap()),
        context
    );
    let count = u32::from_be_bytes(payload[4..8].try_into().unwrap()) as usize;
    assert!(count >= 1);
    assert_eq!(payload.len(), 8 + 16 * count, "descriptor count matches");
    let mut at = 0u64;
    let mut status_at_a = None;
    for d in payload[8..].chunks(16) {
        let len = u64::from_be_bytes(d[..8].try_into().unwrap());
        let status = u64::from_be_bytes(d[8..].try_into().unwrap());
        assert!(len > 0, "empty extent");
        if (at..at + len).contains(&MIB) {
            status_at_a = Some(status);
        }
        at += len;
    }
    assert!(at <= 6 * GIB, "extents cover {at} bytes, more than asked");
    assert_eq!(
        status_at_a.map(|s| s & u64::from(state::HOLE)),
        Some(0),
        "the written block at 1 MiB is not a hole"
    );

    // WRITE_ZEROES with a 5 GiB effect length: the high block is zeroed too, so the
    // length was not cut to 32 bits (which would leave 1 GiB).
    raw.request(cmd::WRITE_ZEROES, 0, 10, 0, 5 * GIB, &[]);
    let reply = raw.reply(0).unwrap();
    assert_eq!((reply.cookie, reply.error), (10, 0));
    assert_eq!(reply.offsets, vec![Some(0)]);
    for (cookie, offset) in [(11, MIB), (12, 2 * MIB), (13, high)] {
        let reply = raw.read(cookie, offset, 4096).unwrap();
        assert_eq!(reply.error, 0);
        assert!(reply.data.iter().all(|&b| b == 0), "not zeroed at {offset}");
    }
    // A TRIM over more than 4 GiB is fine too, and the connection goes on.
    raw.request(cmd::TRIM, 0, 14, GIB, 6 * GIB, &[]);
    assert_eq!(raw.reply(0).unwrap().error, 0);
    assert_usable(&mut raw, 7 * GIB, 7);
}

/// Rule 11: past `--max-connections` (counting clients still negotiating), a new
/// connection is closed at once and logged; the clients already there go on, and a place
/// freed by one that leaves is taken by the next.
#[test]
fn rule11_a_connection_past_the_limit_is_closed_and_the_others_go_on() {
    let server = Server::start(&["--max-connections", "2", "memory:64M"]);
    let mut transmitting = Raw::session(server.tcp(), Mode::Structured);
    let negotiating = Raw::hello(server.tcp());

    let mut third = Raw::from_socket(TcpStream::connect(server.tcp()).expect("connect"));
    let closed = third.wait_closed(Duration::from_secs(3));
    assert!(
        matches!(
            closed,
            common::raw::Closed::Eof | common::raw::Closed::Reset
        ),
        "the third connection got {closed:?}, not closed before its greeting"
    );
    assert!(
        logged_line(&server, &["2 connections are served already"]).is_some(),
        "the refusal is not logged:\n{}",
        server.stderr()
    );
    assert_usable(&mut transmitting, 0, 1);

    drop(negotiating);
    // The server sees the close when it next reads that socket: give it a moment.
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut next = loop {
        let mut raw = Raw::from_socket(TcpStream::connect(server.tcp()).expect("connect"));
        if let Some(greeting) = raw.read_n(18) {
            assert_eq!(&greeting[8..16], &IHAVEOPT.to_be_bytes(), "IHAVEOPT");
            break raw;
        }
        assert!(
            Instant::now() < deadline,
            "no place freed 3 s after a client left"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    next.send(&(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES).to_be_bytes());
    assert_eq!(next.go("").last().unwrap().reply_type, rep::ACK);
    assert_usable(&mut next, 4096, 2);
    assert_usable(&mut transmitting, 8192, 3);
}

#[test]
fn rule11_a_connection_ended_for_bad_input_frees_its_place_before_its_socket_lingers() {
    // A client that sent a bad magic and keeps sending: its connection is ended, and its
    // socket lingers (reading and dropping) for up to 2 s so that no reset is sent. Its
    // place among `--max-connections` must be free at once, not after the linger.
    let server = Server::start(&["--max-connections", "1", "memory:64M"]);
    let mut offender = Raw::session(server.tcp(), Mode::Simple);
    let mut sock = offender.sock.try_clone().expect("clone");
    let sender = std::thread::spawn(move || {
        let garbage = [0xde, 0xad, 0xbe, 0xef].repeat(1024);
        let until = Instant::now() + Duration::from_secs(3);
        while Instant::now() < until && sock.write_all(&garbage).is_ok() {
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let closed = offender.wait_closed(Duration::from_secs(5));
    assert!(
        closed.is_closed(),
        "not closed after a bad magic: {closed:?}"
    );
    let ended = Instant::now();
    let deadline = ended + Duration::from_secs(5);
    let served = loop {
        let mut raw = Raw::from_socket(TcpStream::connect(server.tcp()).expect("connect"));
        if raw.read_n(18).is_some() {
            break Instant::now();
        }
        assert!(Instant::now() < deadline, "no place freed within 5 s");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        served - ended < Duration::from_millis(1000),
        "the next client waited {:?} for the place of one already ended",
        served - ended
    );
    sender.join().unwrap();
}

#[test]
fn a_client_gone_inside_a_write_payload_is_let_go_while_others_hold_the_shared_budget() {
    // Five connections each ask for 8 reads of 32 MiB and read none of it, which spends
    // the server-wide byte budget. A client that sends a 32 MiB WRITE, 1 MiB of its
    // payload, and then ends its side must see the server end the connection: its payload
    // can never complete. It used to wait for budget room that nothing would ever free.
    let server = Server::start(&["memory:256M"]);
    let mut hogs = Vec::new();
    for h in 0..5u64 {
        let mut hog = Raw::session(server.tcp(), Mode::Simple);
        for j in 0..8u64 {
            hog.request(
                cmd::READ,
                0,
                h * 100 + j,
                (j * 32 * MIB) % (256 * MIB),
                32 * MIB,
                &[],
            );
        }
        hogs.push(hog);
    }
    std::thread::sleep(Duration::from_millis(500));
    let mut writer = Raw::session(server.tcp(), Mode::Simple);
    writer.request(cmd::WRITE, 0, 7, 0, 32 * MIB, &[]);
    writer.send(&vec![0x55; MIB as usize]);
    std::thread::sleep(Duration::from_millis(200));
    let (closed, _) = writer.finish_and_drain(Duration::from_secs(5));
    assert!(
        closed,
        "the server kept a connection whose client ended inside a payload"
    );
    drop(hogs);
}
