//! What a plain server (`netblk serve --control PATH`) answers on its control socket
//! ([`crate::control`]): `status`, with its exports (size, cache mode, whether FLUSH has
//! stopped working) and its clients. The commands of a replicated node are refused.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::UnixListener;
use tokio::sync::watch;

use super::clients::Clients;
use super::Export;
use crate::control::{ExportStatus, Reply, ServerStatus};

/// An export and how to describe its backing.
pub struct ExportDescription {
    pub export: Arc<Export>,
    /// `memory:SIZE`, or the file or block device.
    pub backing: String,
    /// Whether the backing is a file or device (which has a cache mode).
    pub on_disk: bool,
}

/// What a plain server's status is made of.
pub struct ServerState {
    pub exports: Vec<ExportDescription>,
    pub clients: Arc<Clients>,
    pub started: Instant,
}

impl ServerState {
    /// The server's status now.
    pub fn status(&self) -> ServerStatus {
        let clients = self.clients.list();
        let exports = self
            .exports
            .iter()
            .map(|described| {
                let backend = &described.export.backend;
                let name = &described.export.name;
                ExportStatus {
                    name: name.clone(),
                    backing: described.backing.clone(),
                    size: backend.size(),
                    read_only: backend.capabilities().read_only,
                    cache: described.on_disk.then(|| {
                        if backend.completes_through_ring() {
                            "none"
                        } else {
                            "writeback"
                        }
                        .to_string()
                    }),
                    flush_stopped: backend.flush_stopped().map(|e| e.to_string()),
                    clients: clients
                        .iter()
                        .filter(|c| c.export.as_ref() == Some(name))
                        .count(),
                    requests: described.export.stats.counts(),
                }
            })
            .collect();
        ServerStatus {
            uptime_seconds: self.started.elapsed().as_secs(),
            exports,
            clients,
        }
    }

    /// The reply to one request line.
    fn answer(&self, request: &str) -> Reply {
        let (ok, message) = match request.split_whitespace().next() {
            Some("status") => (true, String::new()),
            Some("promote" | "demote" | "verify") => (
                false,
                "this is a plain server, not a replicated node".to_string(),
            ),
            _ => (false, format!("unknown request {request:?} (status)")),
        };
        Reply {
            ok,
            message,
            status: None,
            server: Some(self.status()),
        }
    }
}

/// Serves the control socket until `stop` turns true, then removes its file.
pub async fn run_control(
    state: Arc<ServerState>,
    listener: UnixListener,
    path: PathBuf,
    stop: watch::Receiver<bool>,
) {
    crate::control::serve(listener, path, stop, move |line| {
        let state = Arc::clone(&state);
        async move { state.answer(&line) }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::memory::MemoryBackend;

    #[test]
    fn status_lists_exports_with_their_clients_and_refuses_node_commands() {
        let export = |name: &str, read_only| {
            Arc::new(Export::new(
                name.into(),
                String::new(),
                Arc::new(MemoryBackend::new(1 << 20, read_only)),
            ))
        };
        let clients = Arc::new(Clients::default());
        let state = ServerState {
            exports: vec![
                ExportDescription {
                    export: export("a", false),
                    backing: "memory:1048576".into(),
                    on_disk: false,
                },
                ExportDescription {
                    export: export("b", true),
                    backing: "memory:1048576".into(),
                    on_disk: false,
                },
            ],
            clients: Arc::clone(&clients),
            started: Instant::now(),
        };
        let on_a = clients.join("127.0.0.1:1".into(), 8).unwrap();
        on_a.transmitting("a");
        let _negotiating = clients.join("127.0.0.1:2".into(), 8).unwrap();
        let status = state.status();
        let summary: Vec<_> = status
            .exports
            .iter()
            .map(|e| (e.name.as_str(), e.size, e.read_only, e.clients))
            .collect();
        assert_eq!(summary, [("a", 1 << 20, false, 1), ("b", 1 << 20, true, 0)]);
        assert_eq!(status.clients.len(), 2);
        assert_eq!(status.exports[0].cache, None);
        assert_eq!(status.exports[0].flush_stopped, None);

        let reply = state.answer("status");
        assert!(reply.ok);
        assert_eq!(reply.server, Some(status));
        let refused = state.answer("promote --force");
        assert!(!refused.ok);
        assert_eq!(
            refused.message,
            "this is a plain server, not a replicated node"
        );
        assert!(!state.answer("bogus").ok);
    }
}
