//! Synchronous replication of one export across two or three nodes (DRBD's protocol C in
//! user space), as a [`Backend`](crate::backend::Backend) layer over a local backend.
//!
//! # Design
//! - **Connections.** Every node listens on its `replication` address. For each pair of
//!   nodes, the one whose name sorts first dials and keeps redialling; the other accepts.
//!   One full-duplex TCP connection per peer (TCP_NODELAY) carries data one way and acks
//!   the other, so an ack never waits on a delayed-ACK timer. Both sides start with a
//!   [`wire::Hello`]; a peer of another resource, an unknown node name or a different
//!   device size gets a [`wire::Message::Refuse`] naming the reason, and so does a peer
//!   whose generation identifiers show split brain or unrelated data.
//! - **Writes.** The primary numbers every write, trim and zero with a sequence number
//!   and sends it to each connected up-to-date peer while writing locally; with protocol
//!   C the client's reply waits for the local write and every such peer's ack. Writes
//!   that overlap one in flight wait for it, so no two in-flight writes overlap, and a
//!   secondary may apply everything it receives concurrently: a write the client saw
//!   acknowledged was already applied everywhere before any later write was sent.
//! - **Epochs.** A client FLUSH becomes a barrier with an epoch number: a secondary
//!   waits for every write received before it, makes them durable, then acks the epoch;
//!   the client's FLUSH reply waits for the local flush and every such ack.
//! - **Degraded.** A peer that sends nothing for `peer_timeout` while an answer is due,
//!   or leaves one unanswered for `KO_COUNT` timeouts (or whose connection drops), is
//!   disconnected; the write succeeds locally, its regions (and the extents of the
//!   activity log written since the last barrier done on every replica, which may sit
//!   unflushed in the peer's cache) are set in the out-of-sync bitmap, and the primary
//!   starts a new data generation.
//! - **Local disk errors.** On the primary a read error is served from an in-sync peer;
//!   a write, trim, zeroing or flush that fails locally but was applied by an in-sync
//!   peer (protocol C) detaches the local disk, and the node serves from its peers.
//! - **Generations** ([`generation`]): DRBD's UUID scheme, compared at every connect to
//!   pick the resync direction or detect split brain.
//! - **Metadata** ([`meta`]): per peer, a bit per 64 KiB region (a 1 TiB device needs
//!   2 MiB of bitmap per peer; one random 4 KiB write marks 64 KiB for resync) and an activity log of 256
//!   extents of 4 MiB, fdatasynced before a write to a new extent is submitted (an extent
//!   leaves it only after a flush everywhere covered its writes), so after a crash at
//!   most 1 GiB plus the bitmap needs resync, never the whole device and
//!   never less than what may differ. Secondaries log the extents of what they apply
//!   too, and mark them out of sync when their primary is lost, so that after a
//!   failover the writes in flight at the primary's death are resynced between the
//!   nodes that remain.
//! - **Resync**: the source sends a 128-bit digest per out-of-sync region; the target answers
//!   "in sync" or "need data", so equal regions cost a few dozen bytes, not 64 KiB.
//! - **Roles** ([`control`]): every node starts as secondary; `--primary` or
//!   `netblk promote` makes it primary (refused while a peer is primary, or, unless
//!   forced, when this node's data may be older). Promote and demote reconnect the peers
//!   so the hello checks run again with the new roles.
//!
//! [`node`] ties it together: backing + metadata + NBD, replication and control listeners.

pub mod config;
pub mod control;
pub mod generation;
pub mod layer;
pub mod meta;
pub mod node;
pub mod outbox;
pub mod peer;
pub mod window;
pub mod wire;

#[cfg(test)]
mod tests;
