//! Bad input at the protocol edge, over raw sockets: each rule of "a malformed request
//! closes at most that one connection" gets its own test, and each checks that the
//! connection (or the server, or another client) goes on as it should.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::raw::{Mode, Raw};
use common::*;
use netblk::wire::handshake::{ClientOption, InfoRequest, MetaContextRequest};
use netblk::wire::{client_flags, cmd, cmd_flags, opt, rep, reply, IHAVEOPT, MAX_PAYLOAD};

const EPERM: u32 = 1;
const EINVAL: u32 = 22;
const ENOSPC: u32 = 28;
const SIZE: u64 = 64 << 20;

fn still_works(raw: &mut Raw) {
    let data = vec![0x5a; 4096];
    assert_eq!(raw.write(900, 8192, &data), Some(0));
    let reply = raw.read(901, 8192, 4096).expect("connection still open");
    assert_eq!(reply.error, 0);
    assert_eq!(reply.data, data);
}

#[test]
fn past_the_end_is_einval_for_reads_and_enospc_for_writes() {
    let server = Server::start(&["memory:64M"]);
    for mode in [Mode::Simple, Mode::Structured, Mode::Extended] {
        let mut raw = Raw::session(server.tcp(), mode);
        let cases: [(u16, u64, u64, u32); 5] = [
            (cmd::READ, SIZE - 512, 1024, EINVAL),
            (cmd::TRIM, SIZE, 1, EINVAL),
            (cmd::CACHE, SIZE - 1, 2, EINVAL),
            (cmd::WRITE_ZEROES, SIZE - 4096, 8192, ENOSPC),
            (cmd::WRITE, SIZE - 100, 200, ENOSPC),
        ];
        for (i, (command, offset, length, expected)) in cases.into_iter().enumerate() {
            let payload = if command == cmd::WRITE {
                vec![1u8; length as usize]
            } else {
                Vec::new()
            };
            raw.request(command, 0, i as u64, offset, length, &payload);
            let reply = raw.reply(0).expect("a reply, not a closed connection");
            assert_eq!(reply.error, expected, "{mode:?} command {command}");
            if mode != Mode::Simple {
                assert_eq!(
                    reply.kinds,
                    vec![reply::TYPE_ERROR],
                    "errors arrive as an ERROR chunk"
                );
            }
            still_works(&mut raw);
        }
    }
}

#[test]
fn unknown_commands_and_flags_are_einval_and_the_connection_goes_on() {
    let server = Server::start(&["memory:64M"]);
    let mut simple = Raw::session(server.tcp(), Mode::Simple);
    for (command, flags, offset, length) in [
        (42u16, 0u16, 0u64, 0u64),
        (cmd::READ, 1 << 9, 0, 512),
        (cmd::READ, cmd_flags::DF, 0, 512), // DF needs structured replies
        (cmd::WRITE_ZEROES, cmd_flags::DF, 0, 512),
        (cmd::BLOCK_STATUS, 0, 0, 512), // no meta context without structured replies
        (cmd::FLUSH, 0, 4096, 0),
    ] {
        simple.request(command, flags, 7, offset, length, &[]);
        let reply = simple.reply(0).expect("reply");
        assert_eq!(reply.error, EINVAL, "command {command} flags {flags:#x}");
        still_works(&mut simple);
    }
    // Structured replies but no meta context selected: BLOCK_STATUS is still EINVAL.
    let mut raw = Raw::connect(server.tcp());
    raw.send(&(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES).to_be_bytes());
    raw.option(ClientOption::StructuredReply);
    raw.option(ClientOption::Go(InfoRequest {
        name: String::new(),
        requests: vec![],
    }));
    raw.mode = Mode::Structured;
    raw.request(cmd::BLOCK_STATUS, 0, 8, 0, 4096, &[]);
    assert_eq!(raw.reply(0).unwrap().error, EINVAL);
    still_works(&mut raw);
}

#[test]
fn requests_above_the_maximum_are_refused_and_the_payload_is_consumed() {
    let server = Server::start(&["memory:128M"]);
    let mut raw = Raw::session(server.tcp(), Mode::Structured);
    raw.request(cmd::READ, 0, 1, 0, u64::from(MAX_PAYLOAD) + 1, &[]);
    assert_eq!(raw.reply(0).unwrap().error, EINVAL);
    let len = MAX_PAYLOAD as usize + 4096;
    raw.request(cmd::WRITE, 0, 2, 0, len as u64, &vec![0xee; len]);
    assert_eq!(raw.reply(0).unwrap().error, EINVAL);
    still_works(&mut raw);
    // Nothing of the refused write landed.
    let reply = raw.read(3, 0, 4096).unwrap();
    assert!(reply.data.iter().all(|&b| b == 0));
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn an_oversized_payload_is_discarded_not_buffered() {
    let server = Server::start(&["memory:64M"]);
    let mut raw = Raw::session(server.tcp(), Mode::Simple);
    still_works(&mut raw);
    let before = rss_kib(server.pid());
    let len: u64 = 200 << 20;
    raw.request(cmd::WRITE, 0, 1, 0, len, &[]);
    let chunk = vec![0xabu8; 1 << 20];
    for _ in 0..200 {
        raw.send(&chunk);
    }
    assert_eq!(raw.reply(0).unwrap().error, EINVAL);
    let after = rss_kib(server.pid());
    assert!(
        after < before + 64 * 1024,
        "RSS grew from {before} KiB to {after} KiB"
    );
    still_works(&mut raw);
}

#[test]
fn writes_to_a_read_only_export_are_eperm() {
    let server = Server::start(&["--read-only", "memory:64M"]);
    let mut raw = Raw::session(server.tcp(), Mode::Structured);
    raw.request(cmd::WRITE, cmd_flags::FUA, 1, 0, 4096, &[7u8; 4096]);
    assert_eq!(raw.reply(0).unwrap().error, EPERM);
    raw.request(cmd::TRIM, 0, 2, 0, 4096, &[]);
    assert_eq!(raw.reply(0).unwrap().error, EPERM);
    raw.request(cmd::WRITE_ZEROES, 0, 3, 0, 4096, &[]);
    assert_eq!(raw.reply(0).unwrap().error, EPERM);
    // The refused write's payload was consumed: the next request parses.
    let reply = raw.read(4, 0, 4096).unwrap();
    assert_eq!(reply.error, 0);
    assert!(reply.data.iter().all(|&b| b == 0));
}

#[test]
fn a_bad_request_magic_closes_only_that_connection() {
    let server = Server::start(&["memory:64M"]);
    let mut bystander = Raw::session(server.tcp(), Mode::Structured);
    still_works(&mut bystander);
    let mut offender = Raw::session(server.tcp(), Mode::Simple);
    let offender_addr = offender.local_addr();
    offender.send(&[0xde, 0xad, 0xbe, 0xef].repeat(7));
    assert!(offender.is_closed(), "the connection is closed");
    still_works(&mut bystander);
    let log = server.stderr();
    let line = log
        .lines()
        .find(|l| l.contains("bad request magic"))
        .expect("logged");
    assert!(
        line.contains(&offender_addr),
        "the log names the client: {line}"
    );
    assert_eq!(log.matches("bad request magic").count(), 1, "logged once");
}

#[test]
fn handshake_violations_close_the_connection_and_bad_options_do_not() {
    let server = Server::start(&["memory:64M"]);
    let hello = (client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES).to_be_bytes();

    // Unknown client flags.
    let mut raw = Raw::connect(server.tcp());
    raw.send(&(1u32 << 5).to_be_bytes());
    assert!(raw.is_closed());

    // Bad option magic.
    let mut raw = Raw::connect(server.tcp());
    raw.send(&hello);
    let mut bad = ClientOption::List.encode();
    bad[0] ^= 0xff;
    raw.send(&bad);
    assert!(raw.is_closed());

    // An oversized option is refused from its header alone.
    let mut raw = Raw::connect(server.tcp());
    raw.send(&hello);
    let mut header = IHAVEOPT.to_be_bytes().to_vec();
    header.extend(opt::GO.to_be_bytes());
    header.extend((1u32 << 20).to_be_bytes());
    raw.send(&header);
    assert!(raw.is_closed());

    // NBD_OPT_EXPORT_NAME for an unknown export cannot be answered: closed.
    let mut raw = Raw::connect(server.tcp());
    raw.send(&hello);
    raw.send(&ClientOption::ExportName("nope".into()).encode());
    assert!(raw.is_closed());

    // Everything below is answered with an error and negotiation goes on.
    let mut raw = Raw::connect(server.tcp());
    raw.send(&hello);
    let mut malformed = IHAVEOPT.to_be_bytes().to_vec();
    malformed.extend(opt::GO.to_be_bytes());
    malformed.extend(5u32.to_be_bytes());
    malformed.extend([0, 0, 0, 9, b'x']); // name length runs past the data
    raw.send(&malformed);
    assert_eq!(
        raw.replies_until_final().last().unwrap().reply_type,
        rep::ERR_INVALID
    );
    assert_eq!(
        raw.option(ClientOption::Unknown(99))[0].reply_type,
        rep::ERR_UNSUP
    );
    let go_unknown = ClientOption::Go(InfoRequest {
        name: "nope".into(),
        requests: vec![],
    });
    assert_eq!(
        raw.option(go_unknown).last().unwrap().reply_type,
        rep::ERR_UNKNOWN
    );
    let meta = MetaContextRequest {
        export: String::new(),
        queries: vec!["base:allocation".into()],
    };
    assert_eq!(
        raw.option(ClientOption::SetMetaContext(meta))[0].reply_type,
        rep::ERR_INVALID
    );
    let mut list_with_data = IHAVEOPT.to_be_bytes().to_vec();
    list_with_data.extend(opt::LIST.to_be_bytes());
    list_with_data.extend(1u32.to_be_bytes());
    list_with_data.push(0);
    raw.send(&list_with_data);
    assert_eq!(
        raw.replies_until_final().last().unwrap().reply_type,
        rep::ERR_INVALID
    );
    assert_eq!(
        raw.option(ClientOption::StartTls)[0].reply_type,
        rep::ERR_UNSUP
    );
    let go = ClientOption::Go(InfoRequest {
        name: String::new(),
        requests: vec![],
    });
    assert_eq!(raw.option(go).last().unwrap().reply_type, rep::ACK);
    still_works(&mut raw);

    // ABORT is acknowledged, then the server closes.
    let mut raw = Raw::connect(server.tcp());
    raw.send(&hello);
    assert_eq!(raw.option(ClientOption::Abort)[0].reply_type, rep::ACK);
    assert!(raw.is_closed());
    assert!(server.stderr().contains("unknown client flags"));
}

#[test]
fn a_client_stalling_in_the_handshake_is_dropped_after_the_timeout() {
    let server = Server::start(&["--handshake-timeout", "1s", "memory:64M"]);
    let mut staller = Raw::connect(server.tcp());
    let staller_addr = staller.local_addr();
    let started = Instant::now();
    // Meanwhile another client negotiates and works.
    let mut other = Raw::session(server.tcp(), Mode::Structured);
    still_works(&mut other);
    assert!(staller.is_closed());
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    still_works(&mut other);
    let log = server.stderr();
    assert!(
        log.lines()
            .any(|l| l.contains("handshake not finished") && l.contains(&staller_addr)),
        "{log}"
    );
}

/// A small deterministic generator, so failures replay.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn garbage_never_takes_the_server_down() {
    let server = Server::start(&["--handshake-timeout", "2s", "memory:64M"]);
    for seed in 0..50u64 {
        let mut sock = TcpStream::connect(server.tcp()).unwrap();
        let _ = sock.write_all(&noise(seed, 4096));
    }
    for seed in 0..50u64 {
        let mode = [Mode::Simple, Mode::Structured, Mode::Extended][seed as usize % 3];
        let mut raw = Raw::session(server.tcp(), mode);
        // A valid magic first, so the garbage reaches the command and flag checks too.
        let mut bytes = if mode == Mode::Extended {
            vec![0x21, 0xe4, 0x1c, 0x71]
        } else {
            vec![0x25, 0x60, 0x95, 0x13]
        };
        bytes.extend(noise(1000 + seed, 4096));
        let _ = raw.sock.write_all(&bytes);
    }
    let mut raw = Raw::session(server.tcp(), Mode::Structured);
    still_works(&mut raw);
    let mut server = server;
    assert!(
        server.wait_exit(Duration::ZERO).is_none(),
        "the server is still running"
    );
    assert!(!server.stderr().contains("panicked"));
}

#[test]
fn hundreds_of_requests_in_flight_complete_out_of_order() {
    let server = Server::start(&["memory:64M"]);
    for mode in [Mode::Simple, Mode::Structured] {
        let mut raw = Raw::session(server.tcp(), mode);
        let block = |i: u64| noise(i, 4096);
        let mut batch = Vec::new();
        for i in 0..512u64 {
            let header = netblk::wire::transmission::RequestHeader {
                flags: 0,
                command: cmd::WRITE,
                cookie: i,
                offset: i * 4096,
                length: 4096,
            };
            batch.extend(header.encode(raw.style));
            batch.extend(block(i));
        }
        raw.send(&batch);
        let mut seen = vec![false; 512];
        for _ in 0..512 {
            let reply = raw.reply(0).unwrap();
            assert_eq!(reply.error, 0);
            assert!(
                !std::mem::replace(&mut seen[reply.cookie as usize], true),
                "one reply per cookie"
            );
        }
        for i in 0..512u64 {
            raw.request(cmd::READ, 0, 10_000 + i, i * 4096, 4096, &[]);
        }
        // Simple replies are framed by the request, so read them by cookie.
        for _ in 0..512 {
            let reply = raw.reply(4096).unwrap();
            assert_eq!(reply.error, 0);
            assert_eq!(
                reply.data,
                block(reply.cookie - 10_000),
                "data for cookie {}",
                reply.cookie
            );
        }
    }
}

#[test]
fn extended_headers_carry_64_bit_lengths_and_echo_offsets() {
    let server = Server::start(&["memory:8G"]);
    let mut raw = Raw::session(server.tcp(), Mode::Extended);
    // WRITE with and without PAYLOAD_LEN (qemu 10 omits it).
    raw.request(
        cmd::WRITE,
        cmd_flags::PAYLOAD_LEN,
        1,
        1 << 20,
        4096,
        &[3u8; 4096],
    );
    let reply = raw.reply(0).unwrap();
    assert_eq!(reply.error, 0);
    assert_eq!(
        reply.offsets,
        vec![Some(1 << 20)],
        "the extended reply echoes the offset"
    );
    raw.request(cmd::WRITE, 0, 2, 2 << 20, 4096, &[4u8; 4096]);
    assert_eq!(raw.reply(0).unwrap().error, 0);
    let reply = raw.read(3, 1 << 20, 4096).unwrap();
    assert_eq!(reply.data, vec![3u8; 4096]);
    let reply = raw.read(4, 2 << 20, 4096).unwrap();
    assert_eq!(reply.data, vec![4u8; 4096]);
    // An effect length over 4 GiB.
    raw.request(cmd::WRITE_ZEROES, 0, 5, 0, 5 << 30, &[]);
    assert_eq!(raw.reply(0).unwrap().error, 0);
    assert!(raw
        .read(6, 1 << 20, 4096)
        .unwrap()
        .data
        .iter()
        .all(|&b| b == 0));
    raw.request(cmd::BLOCK_STATUS, 0, 7, 0, 6 << 30, &[]);
    let reply = raw.reply(0).unwrap();
    assert_eq!(reply.kinds, vec![reply::TYPE_BLOCK_STATUS_EXT]);
    let payload = &reply.payloads[0];
    let count = u32::from_be_bytes(payload[4..8].try_into().unwrap()) as usize;
    assert_eq!(payload.len(), 8 + 16 * count);
    let first_len = u64::from_be_bytes(payload[8..16].try_into().unwrap());
    assert!(first_len > 0);
    // A non-write command with a payload is refused, and its payload consumed.
    raw.request(cmd::TRIM, cmd_flags::PAYLOAD_LEN, 8, 0, 16, &[0u8; 16]);
    assert_eq!(raw.reply(0).unwrap().error, EINVAL);
    still_works(&mut raw);
}
