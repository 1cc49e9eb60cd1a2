//! Entry points for the fuzz targets in `fuzz/`, kept in the library so the committed
//! corpus is also replayed by an ordinary `cargo test` on stable Rust.
//!
//! `handshake` and `requests` run the real connection code (handshake and transmission)
//! against a small memory export, over an in-memory pipe whose client side sends the input
//! bytes and then closes; `peer` runs the replication protocol decoder, then a secondary's
//! handling of the decoded messages.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::backend::memory::MemoryBackend;
use crate::server::{handle_connection, Export, ServerConfig};
use crate::wire::handshake::{ClientOption, InfoRequest, MetaContextRequest};
use crate::wire::{client_flags, BASE_ALLOCATION};

/// Size of the export the fuzzers talk to.
pub const FUZZ_EXPORT_SIZE: u64 = 1 << 20;

fn run_connection(input: Vec<u8>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let export = Arc::new(Export::new(
            String::new(),
            "fuzz".into(),
            Arc::new(MemoryBackend::new(FUZZ_EXPORT_SIZE, false)),
        ));
        let config = Arc::new(ServerConfig {
            exports: vec![export],
            handshake_timeout: Duration::from_secs(5),
            max_merge: crate::server::DEFAULT_MAX_MERGE,
            max_connections: crate::server::DEFAULT_MAX_CONNECTIONS,
            tcp: crate::tcp::TcpSettings::default(),
            clients: Default::default(),
        });
        let (client, server) = tokio::io::duplex(256 * 1024);
        let (mut client_read, mut client_write) = tokio::io::split(client);
        let drain = tokio::spawn(async move {
            let mut sink = vec![0u8; 64 * 1024];
            while matches!(client_read.read(&mut sink).await, Ok(n) if n > 0) {}
        });
        let feed = tokio::spawn(async move {
            let _ = client_write.write_all(&input).await;
            let _ = client_write.shutdown().await;
            // Keep the pipe open until the server is done with it.
            client_write
        });
        let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let (alive_tx, _alive_rx) = tokio::sync::mpsc::channel(1);
        handle_connection(server, config, stop_rx, alive_tx).await;
        let _ = feed.await;
        let _ = drain.await;
    });
}

/// Feeds raw bytes to a fresh connection, starting from the client's handshake flags.
pub fn handshake(data: &[u8]) {
    run_connection(data.to_vec());
}

/// Negotiates a valid session first (the first byte picks simple, structured or extended
/// replies), then feeds the rest as the transmission-phase request stream.
pub fn requests(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut input = (client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    match mode % 3 {
        0 => {}
        1 => input.extend(ClientOption::StructuredReply.encode()),
        _ => input.extend(ClientOption::ExtendedHeaders.encode()),
    }
    if mode % 3 != 0 {
        let meta = MetaContextRequest {
            export: String::new(),
            queries: vec![BASE_ALLOCATION.into()],
        };
        input.extend(ClientOption::SetMetaContext(meta).encode());
    }
    input.extend(
        ClientOption::Go(InfoRequest {
            name: String::new(),
            requests: vec![],
        })
        .encode(),
    );
    input.extend_from_slice(rest);
    run_connection(input);
}

/// The `peer` target: arbitrary bytes as a stream of replication frames. Every message
/// that decodes must encode back to a frame that decodes to the same message; then the
/// same bytes are read by a secondary's frame loop (the handling of each message: writes,
/// trims, barriers, reads, state changes), from a peer that is its primary, a resync
/// target or idle (by the input's length), on one node kept across inputs.
pub fn peer(data: &[u8]) {
    use crate::replication::wire::Message;
    let mut buf = bytes::BytesMut::from(data);
    while let Ok(Some(message)) = Message::decode(&mut buf) {
        let mut again = bytes::BytesMut::new();
        message.encode(&mut again);
        let decoded = Message::decode(&mut again).expect("re-encoded frame decodes");
        assert_eq!(decoded, Some(message), "re-encoding changed the message");
        assert!(again.is_empty(), "re-encoding left bytes behind");
    }
    use crate::replication::peer::{fuzz_read_loop, Plan};
    let plan = match data.len() % 3 {
        0 => Plan::Target,
        1 => Plan::Source { full: false },
        _ => Plan::Idle,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(fuzz_read_loop(fuzz_node(), plan, data));
}

/// A secondary node ("beta" of a two-node resource on a 2 GiB memory disk, more than its
/// activity log covers at once) whose frame
/// loop the `peer` target feeds; made once per process, its metadata in a scratch
/// directory removed at once (the open file lives on).
fn fuzz_node() -> &'static Arc<crate::replication::layer::Shared> {
    use crate::replication::{config::ResourceConfig, layer::Shared, meta::Metadata};
    static NODE: std::sync::OnceLock<Arc<Shared>> = std::sync::OnceLock::new();
    NODE.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("netblk-fuzz-peer-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let text = format!(
            "[resource]\nname = \"f\"\nprotocol = \"C\"\npeer_timeout = \"1s\"\n\
             [[node]]\nname = \"alpha\"\nreplication = \"127.0.0.1:9\"\nlisten = \"unix:{d}/a.sock\"\n\
             backing = \"memory:2G\"\nmetadata = \"{d}/alpha.meta\"\n\
             [[node]]\nname = \"beta\"\nreplication = \"127.0.0.1:10\"\nlisten = \"unix:{d}/b.sock\"\n\
             backing = \"memory:2G\"\nmetadata = \"{d}/beta.meta\"\n",
            d = dir.display()
        );
        let resource = ResourceConfig::parse(&text, "fuzz").expect("resource");
        let size = 2 << 30;
        let meta = Metadata::open_or_create(
            &dir.join("beta.meta"),
            "beta",
            "f",
            &["alpha".to_string()],
            size,
            true,
        )
        .expect("metadata");
        let local = Arc::new(MemoryBackend::new(size, false));
        let node = Shared::new(
            local,
            resource,
            "beta",
            meta,
            crate::tcp::TcpSettings::default(),
        )
        .expect("node");
        // The metadata file stays open: unlinked, it leaves nothing behind.
        let _ = std::fs::remove_dir_all(&dir);
        node
    })
}

/// Parses arbitrary bytes as a request head to the metrics endpoint
/// ([`crate::metrics::parse_request`]), whole and as each prefix a slow client's reads
/// could hand it.
pub fn metrics_request(data: &[u8]) {
    let data = &data[..data.len().min(16 * 1024)];
    for end in (0..=data.len())
        .step_by(97)
        .chain(std::iter::once(data.len()))
    {
        let _ = crate::metrics::parse_request(&data[..end]);
    }
}

/// Seed inputs for the targets, built with the library's own codec: (target, name, bytes).
/// `NETBLK_WRITE_CORPUS=1 cargo test seed_corpus` writes them under `fuzz/corpus`.
pub fn seed_corpus() -> Vec<(&'static str, String, Vec<u8>)> {
    use crate::wire::transmission::{RequestHeader, RequestStyle};
    use crate::wire::{cmd, cmd_flags, info};
    let flags = (client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    let go = |name: &str| {
        ClientOption::Go(InfoRequest {
            name: name.into(),
            requests: vec![info::NAME, info::DESCRIPTION, info::BLOCK_SIZE],
        })
        .encode()
    };
    let meta = |set: bool| {
        let request = MetaContextRequest {
            export: String::new(),
            queries: vec![BASE_ALLOCATION.into(), "base:".into()],
        };
        if set {
            ClientOption::SetMetaContext(request)
        } else {
            ClientOption::ListMetaContext(request)
        }
        .encode()
    };
    let cat = |parts: &[Vec<u8>]| parts.concat();
    let mut seeds = vec![
        ("handshake", "go".to_string(), cat(&[flags.clone(), go("")])),
        (
            "handshake",
            "list-abort".into(),
            cat(&[
                flags.clone(),
                ClientOption::List.encode(),
                ClientOption::Abort.encode(),
            ]),
        ),
        (
            "handshake",
            "structured-meta-info-go".into(),
            cat(&[
                flags.clone(),
                ClientOption::StructuredReply.encode(),
                meta(false),
                meta(true),
                ClientOption::Info(InfoRequest {
                    name: String::new(),
                    requests: vec![],
                })
                .encode(),
                go(""),
            ]),
        ),
        (
            "handshake",
            "export-name".into(),
            cat(&[
                flags.clone(),
                ClientOption::ExportName(String::new()).encode(),
            ]),
        ),
        (
            "handshake",
            "extended-go".into(),
            cat(&[
                flags.clone(),
                ClientOption::ExtendedHeaders.encode(),
                meta(true),
                go(""),
            ]),
        ),
        (
            "handshake",
            "unknown-then-go".into(),
            cat(&[
                flags.clone(),
                ClientOption::Unknown(99).encode(),
                go("nope"),
                go(""),
            ]),
        ),
        (
            "handshake",
            "malformed-go".into(),
            cat(&[
                flags.clone(),
                vec![
                    0x49, 0x48, 0x41, 0x56, 0x45, 0x4f, 0x50, 0x54, 0, 0, 0, 7, 0, 0, 0, 5, 0, 0,
                    0, 9, b'x',
                ],
            ]),
        ),
    ];
    for mode in 0u8..3 {
        let style = if mode == 2 {
            RequestStyle::Extended
        } else {
            RequestStyle::Compact
        };
        let request = |command: u16, flags: u16, cookie: u64, offset: u64, length: u64| {
            RequestHeader {
                flags,
                command,
                cookie,
                offset,
                length,
            }
            .encode(style)
        };
        let mut stream = vec![mode];
        let write_flags = if mode == 2 { cmd_flags::PAYLOAD_LEN } else { 0 };
        stream.extend(request(cmd::WRITE, write_flags, 1, 4096, 512));
        stream.extend(vec![0xa5; 512]);
        stream.extend(request(cmd::READ, 0, 2, 4096, 512));
        stream.extend(request(cmd::WRITE, write_flags | cmd_flags::FUA, 3, 0, 16));
        stream.extend(vec![0x5a; 16]);
        stream.extend(request(cmd::FLUSH, 0, 4, 0, 0));
        stream.extend(request(cmd::TRIM, 0, 5, 0, 65536));
        stream.extend(request(
            cmd::WRITE_ZEROES,
            cmd_flags::NO_HOLE,
            6,
            8192,
            8192,
        ));
        stream.extend(request(cmd::CACHE, 0, 7, 0, 4096));
        if mode != 0 {
            stream.extend(request(
                cmd::BLOCK_STATUS,
                cmd_flags::REQ_ONE,
                8,
                0,
                1 << 20,
            ));
            stream.extend(request(cmd::READ, cmd_flags::DF, 9, 0, 200_000));
        }
        stream.extend(request(cmd::READ, 0, 10, FUZZ_EXPORT_SIZE - 1, 2));
        stream.extend(request(42, 0, 11, 0, 0));
        stream.extend(request(cmd::DISC, 0, 12, 0, 0));
        seeds.push(("requests", format!("session-mode{mode}"), stream));

        // Page-aligned writes, which a memory export receives straight into its pages,
        // the last one cut off inside its payload.
        let page = crate::backend::memory::PAGE_SIZE;
        let mut paged = vec![mode];
        paged.extend(request(cmd::WRITE, write_flags, 1, 0, page));
        paged.extend(vec![0x11; page as usize]);
        paged.extend(request(cmd::WRITE, write_flags, 2, 2 * page, 2 * page));
        paged.extend(vec![0x22; 2 * page as usize]);
        paged.extend(request(cmd::READ, 0, 3, page / 2, 3 * page));
        paged.extend(request(cmd::WRITE, write_flags, 4, 8 * page, 4 * page));
        paged.extend(vec![0x44; page as usize + 1000]);
        seeds.push(("requests", format!("paged-writes-mode{mode}"), paged));
    }
    let mut all_kinds = bytes::BytesMut::new();
    for message in crate::replication::wire::example_messages() {
        let mut one = bytes::BytesMut::new();
        message.encode(&mut one);
        seeds.push(("peer", format!("peer-{}", message.name()), one.to_vec()));
        message.encode(&mut all_kinds);
    }
    seeds.push(("peer", "peer-all-kinds".into(), all_kinds.to_vec()));
    for (name, head) in [
        (
            "get",
            "GET /metrics HTTP/1.1\r\nHost: netblk:9810\r\nAccept: */*\r\n\r\n",
        ),
        ("head-query", "HEAD /metrics?x=1 HTTP/1.0\r\n\r\n"),
        ("post", "POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n"),
    ] {
        seeds.push((
            "metrics",
            format!("metrics-{name}"),
            head.as_bytes().to_vec(),
        ));
    }
    seeds
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus(target: &str) -> Vec<Vec<u8>> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fuzz/corpus")
            .join(target);
        let mut inputs = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.flatten() {
                inputs.push(std::fs::read(entry.path()).expect("corpus file"));
            }
        }
        inputs
    }

    #[test]
    fn seed_corpus_is_committed() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus");
        for (target, name, bytes) in seed_corpus() {
            let path = root.join(target).join(format!("seed-{name}"));
            if std::env::var_os("NETBLK_WRITE_CORPUS").is_some() {
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(&path, &bytes).unwrap();
            }
            let committed = std::fs::read(&path).unwrap_or_default();
            assert_eq!(
                committed,
                bytes,
                "{} is stale: run NETBLK_WRITE_CORPUS=1 cargo test seed_corpus",
                path.display()
            );
        }
    }

    #[test]
    fn handshake_corpus_replays_without_panics() {
        let inputs = corpus("handshake");
        assert!(
            !inputs.is_empty(),
            "the handshake corpus is committed under fuzz/corpus"
        );
        for input in inputs {
            handshake(&input);
        }
    }

    #[test]
    fn metrics_corpus_replays_without_panics() {
        let inputs = corpus("metrics");
        assert!(
            !inputs.is_empty(),
            "the metrics corpus is committed under fuzz/corpus"
        );
        for input in inputs {
            metrics_request(&input);
        }
    }

    #[test]
    fn peer_corpus_replays_without_panics() {
        let inputs = corpus("peer");
        assert!(
            !inputs.is_empty(),
            "the peer corpus is committed under fuzz/corpus"
        );
        for input in inputs {
            peer(&input);
        }
    }

    /// The hang a reviewer found by hand (a trim longer than the activity log held the
    /// session for ever) ends through the fuzz entry too, so the target would catch it.
    #[test]
    fn a_peer_session_with_an_overlong_trim_ends() {
        use crate::replication::wire::Message;
        let mut input = bytes::BytesMut::new();
        Message::Trim {
            seq: 1,
            offset: 0,
            length: 2 << 30,
            flags: 0,
        }
        .encode(&mut input);
        // Its primary's session (the input's length a multiple of three).
        while input.len() % 3 != 0 {
            input.extend_from_slice(&[0]);
        }
        let (done_tx, done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            peer(&input);
            let _ = done_tx.send(());
        });
        done.recv_timeout(Duration::from_secs(20))
            .expect("the session ends");
    }

    #[test]
    fn request_corpus_replays_without_panics() {
        let inputs = corpus("requests");
        assert!(
            !inputs.is_empty(),
            "the request corpus is committed under fuzz/corpus"
        );
        for input in inputs {
            requests(&input);
        }
    }
}
