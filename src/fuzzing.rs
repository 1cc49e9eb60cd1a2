//! Entry points for the fuzz targets in `fuzz/`, kept in the library so the committed
//! corpus is also replayed by an ordinary `cargo test` on stable Rust.
//!
//! Each entry point runs the real connection code (handshake and transmission) against a
//! small memory export, over an in-memory pipe whose client side sends the input bytes and
//! then closes.

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
        let export = Arc::new(Export {
            name: String::new(),
            description: "fuzz".into(),
            backend: Arc::new(MemoryBackend::new(FUZZ_EXPORT_SIZE, false)),
        });
        let config = Arc::new(ServerConfig {
            exports: vec![export],
            handshake_timeout: Duration::from_secs(5),
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
