//! Who is connected to a server, for `netblk status`: each accepted connection takes a
//! slot that names its peer, gains its export once the handshake chose one, and leaves
//! when the connection ends (the slot is dropped with it).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// The connections of one server.
#[derive(Debug, Default)]
pub struct Clients {
    next_id: AtomicU64,
    table: Mutex<BTreeMap<u64, Client>>,
}

#[derive(Debug)]
struct Client {
    peer: String,
    export: Option<String>,
    since: Instant,
}

/// One connection as `netblk status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ClientStatus {
    /// The peer's address (`127.0.0.1:40000`, or `unix` for a Unix socket client).
    pub peer: String,
    /// The export it uses; `None` while it negotiates.
    pub export: Option<String>,
    pub connected_seconds: u64,
}

impl Clients {
    /// Registers a connection from `peer`, unless `limit` connections are registered
    /// already; it is listed until the slot is dropped.
    pub fn join(self: &Arc<Self>, peer: String, limit: usize) -> Option<ClientSlot> {
        let mut table = self.table();
        if table.len() >= limit {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        table.insert(
            id,
            Client {
                peer,
                export: None,
                since: Instant::now(),
            },
        );
        Some(ClientSlot {
            clients: Arc::clone(self),
            id,
        })
    }

    /// Every connection, oldest first.
    pub fn list(&self) -> Vec<ClientStatus> {
        let now = Instant::now();
        self.table()
            .values()
            .map(|c| ClientStatus {
                peer: c.peer.clone(),
                export: c.export.clone(),
                connected_seconds: now.duration_since(c.since).as_secs(),
            })
            .collect()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Client>> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A connection's entry in [`Clients`], removed on drop.
#[derive(Debug)]
pub struct ClientSlot {
    clients: Arc<Clients>,
    id: u64,
}

impl ClientSlot {
    /// Records the export the handshake chose.
    pub fn transmitting(&self, export: &str) {
        if let Some(client) = self.clients.table().get_mut(&self.id) {
            client.export = Some(export.to_string());
        }
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        self.clients.table().remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_listed_with_its_export_until_it_is_dropped() {
        let clients = Arc::new(Clients::default());
        let first = clients.join("127.0.0.1:1000".into(), 2).unwrap();
        let second = clients.join("unix".into(), 2).unwrap();
        second.transmitting("disk0");
        let peers = |c: &Clients| {
            c.list()
                .into_iter()
                .map(|s| (s.peer, s.export))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            peers(&clients),
            [
                ("127.0.0.1:1000".to_string(), None),
                ("unix".to_string(), Some("disk0".to_string()))
            ]
        );
        drop(first);
        assert_eq!(
            peers(&clients),
            [("unix".to_string(), Some("disk0".to_string()))]
        );
        drop(second);
        assert!(clients.list().is_empty());
    }

    #[test]
    fn a_full_table_refuses_until_a_slot_is_dropped() {
        let clients = Arc::new(Clients::default());
        let first = clients.join("a".into(), 2).unwrap();
        let _second = clients.join("b".into(), 2).unwrap();
        assert!(clients.join("c".into(), 2).is_none());
        assert_eq!(clients.list().len(), 2);
        drop(first);
        assert!(clients.join("c".into(), 2).is_some());
    }
}
