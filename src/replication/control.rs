//! What a replicated node answers on its control socket ([`crate::control`]): `status`,
//! `promote`, `promote --force`, `demote`, `verify` and `outdate`, each answered with the node's
//! [`Status`].

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tracing::{info, warn};

use super::layer::Shared;
use super::meta::REGION_SIZE;
use super::peer::{Plan, WaitKey};
use super::wire::{DiskState, Message, Role};
use crate::control::Reply;

/// A node's state as `netblk status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Status {
    pub resource: String,
    pub node: String,
    pub role: String,
    pub disk: String,
    pub generation: String,
    pub bitmap_generation: String,
    /// Bytes that some peer misses.
    pub out_of_sync_bytes: u64,
    /// Why the metadata stopped taking changes (a write or sync of it failed), if it did:
    /// writes fail until the node restarts.
    #[serde(default)]
    pub metadata_stopped: Option<String>,
    /// Why every FLUSH of the local disk fails, if a sync of it failed (data the kernel
    /// had accepted may be lost): until the node restarts.
    #[serde(default)]
    pub flush_stopped: Option<String>,
    /// Why this primary stopped using its local disk (an I/O error an in-sync peer
    /// covered), if it did: reads and writes go to the peers.
    #[serde(default)]
    pub detached: Option<String>,
    pub peers: Vec<PeerStatus>,
}

/// One peer, seen from this node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct PeerStatus {
    pub name: String,
    pub connected: bool,
    /// `source` (this node resyncs and replicates to it), `target`, `idle` or
    /// `disconnected`.
    pub link: String,
    pub replicating: bool,
    /// Bytes the pass compared. On a resync target (`link` is `target`), what the source
    /// has compared with this node so far: the target does not know the pass's total, so
    /// `resync_total_bytes` is 0 there and there is no ETA.
    pub resync_done_bytes: u64,
    pub resync_total_bytes: u64,
    /// Of the bytes resynced, those whose checksums differed and were sent (received, on
    /// a target).
    pub resync_sent_bytes: u64,
    /// Bytes this peer misses (its own bitmap).
    pub out_of_sync_bytes: u64,
    /// Bytes per second of the current (or last) resync pass, over the whole pass: bytes
    /// compared (sent or found equal), which sets the ETA.
    #[serde(default)]
    pub resync_rate_bytes_per_sec: u64,
    /// Bytes per second the pass sent (those that differed): what the resource's
    /// `resync_rate` limits.
    #[serde(default)]
    pub resync_sent_rate_bytes_per_sec: u64,
    /// Seconds the current pass still needs at that rate (`None` when none runs).
    #[serde(default)]
    pub resync_eta_seconds: Option<u64>,
    /// Whether the last pass is still running: it has neither finished nor been cut short
    /// (by a lost link or a demotion), so the figures above are the current pass's.
    #[serde(default)]
    pub resync_running: bool,
    /// Whether the last pass finished (its final flush on the peer included); a pass that
    /// ended otherwise shows as stopped, even with every run sent.
    #[serde(default)]
    pub resync_finished: bool,
    /// Why the last attempt to link with this peer was refused, by either side (a split
    /// brain, another primary, a different size...), until a link is made.
    #[serde(default)]
    pub refused: Option<String>,
    /// Why the last link with this peer ended, while it is disconnected.
    #[serde(default)]
    pub lost: Option<String>,
    /// The resource's `fence_peer` command fenced this peer since its last link ended.
    #[serde(default)]
    pub fenced: bool,
}

impl PeerStatus {
    /// Whether a resync pass to or from this peer is under way.
    pub fn resyncing(&self) -> bool {
        self.connected && self.resync_running
    }
}

impl Shared {
    /// This node's status.
    pub fn status(&self) -> Status {
        let (disk, generations, out_of_sync_bytes, per_peer, metadata_stopped) = {
            let meta = self.meta();
            let sb = meta.superblock();
            let per_peer: Vec<u64> = (0..self.peers.len())
                .map(|peer| meta.out_of_sync_bytes(peer))
                .collect();
            (
                sb.disk,
                sb.generations,
                meta.out_of_sync_bytes_for_any(),
                per_peer,
                meta.stopped().map(|e| e.to_string()),
            )
        };
        let peers = self
            .peers
            .iter()
            .map(|slot| {
                let conn = slot.conn.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let done = slot.resync_done.load(Ordering::Relaxed) * REGION_SIZE;
                let total = slot.resync_total.load(Ordering::Relaxed) * REGION_SIZE;
                let clock = *slot.resync_clock.lock().unwrap_or_else(|e| e.into_inner());
                let running = conn.is_some() && matches!(clock, Some((_, None)));
                let sent = slot.resync_sent.load(Ordering::Relaxed);
                let (rate, sent_rate, eta) = match clock {
                    Some((start, end)) => {
                        let end = end.unwrap_or_else(std::time::Instant::now);
                        let seconds = end.duration_since(start).as_secs_f64().max(1e-3);
                        let rate = (done as f64 / seconds) as u64;
                        let eta = (done < total && rate > 0).then(|| (total - done).div_ceil(rate));
                        (rate, (sent as f64 / seconds) as u64, eta)
                    }
                    None => (0, 0, None),
                };
                let link = match conn.as_ref().map(|c| c.plan) {
                    None => "disconnected",
                    Some(Plan::Source { .. }) => "source",
                    Some(Plan::Target) => "target",
                    Some(Plan::Idle) => "idle",
                };
                PeerStatus {
                    name: slot.config.name.clone(),
                    connected: conn.is_some(),
                    link: link.into(),
                    replicating: conn
                        .as_ref()
                        .is_some_and(|c| c.replicating.load(Ordering::Acquire)),
                    resync_done_bytes: done,
                    resync_total_bytes: total,
                    resync_sent_bytes: sent,
                    out_of_sync_bytes: per_peer[slot.index],
                    resync_rate_bytes_per_sec: rate,
                    resync_sent_rate_bytes_per_sec: sent_rate,
                    resync_eta_seconds: running.then_some(eta).flatten(),
                    resync_running: running,
                    resync_finished: slot.resync_finished.load(Ordering::Acquire),
                    refused: conn
                        .is_none()
                        .then(|| {
                            slot.refused
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .clone()
                        })
                        .flatten(),
                    lost: conn
                        .is_none()
                        .then(|| slot.lost.lock().unwrap_or_else(|e| e.into_inner()).clone())
                        .flatten(),
                    fenced: slot.fenced(),
                }
            })
            .collect();
        Status {
            resource: self.resource.name.clone(),
            node: self.node.clone(),
            role: if self.is_primary() {
                "primary"
            } else {
                "secondary"
            }
            .into(),
            disk: format!("{disk:?}"),
            generation: format!("{:#018x}", generations.current),
            bitmap_generation: format!("{:#018x}", generations.bitmap),
            out_of_sync_bytes,
            metadata_stopped,
            flush_stopped: self.local.flush_stopped().map(|e| e.to_string()),
            detached: self.detached_why(),
            peers,
        }
    }

    /// Ends every peer connection; the dialling side reconnects and both sides run
    /// the hello checks again with their new roles.
    /// After a promotion: tells every peer connected as an idle secondary that this node
    /// is primary now (so a promote there in the reconnect gap is refused), then drops the
    /// links so they reconnect with the new role. Only idle links: on a link where the
    /// peer is this node's resync target (one left from before a demotion), a primary's
    /// state is its resync's end, and the peer would take it as up to date mid-resync.
    pub fn announce_primary_and_reconnect(&self) {
        let generations = self.meta().superblock().generations;
        for slot in &self.peers {
            let conn = slot.conn.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(conn) = conn.filter(|c| c.plan == Plan::Idle) {
                conn.send(Message::State {
                    role: Role::Primary,
                    disk: DiskState::UpToDate,
                    generations,
                });
            }
        }
        self.relink_all();
    }

    /// Drops every link to redo it in this node's new role, the dialling side dialling
    /// again at once (see [`super::layer::PeerSlot::relink_now`]).
    pub fn relink_all(&self) {
        for slot in &self.peers {
            slot.relink_now.notify_one();
        }
        self.drop_connections();
    }

    pub fn drop_connections(&self) {
        for slot in &self.peers {
            let conn = slot.conn.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(conn) = conn {
                conn.close();
            }
        }
    }

    /// Online verify: compares the digest of every region with every replicating peer.
    /// Regions that differ are marked out of sync and the peer is reconnected, which
    /// resyncs them. Answers how many regions differed and with which peers it compared;
    /// an error when no peer could be compared.
    /// `netblk outdate`, what a `fence_peer` command runs on the peer it fences (DRBD's
    /// `drbdadm outdate`): a secondary cut off from its primary records its data as
    /// outdated, so that it is not promoted without `--force` while the primary goes on
    /// writing without it. Refused on a primary, and on a node linked to one (its data
    /// is kept current); a primary's next link with the node makes it up to date again.
    pub fn outdate(&self) -> Result<String, String> {
        // Under the metadata lock, as a promotion's checks and a link's installation.
        let mut meta = self.meta();
        if self.is_primary() || meta.superblock().primary {
            return Err("this node is primary: its data is the current data".into());
        }
        for slot in &self.peers {
            if slot.is_this_nodes_primary() {
                return Err(format!(
                    "peer {} is this node's primary and keeps its data current",
                    slot.config.name
                ));
            }
        }
        match meta.superblock().disk {
            DiskState::UpToDate => {
                meta.update(|sb| sb.disk = DiskState::Outdated)
                    .map_err(|e| format!("recording the disk as outdated: {e}"))?;
                warn!("outdated by an operator or a fence_peer command: promote needs --force until a primary brings this node up to date");
                Ok(
                    "outdated: promote needs --force until a primary brings this node up to date"
                        .into(),
                )
            }
            DiskState::Outdated => Ok("already outdated".into()),
            DiskState::Inconsistent => Ok(
                "inconsistent (in or after a resync): already not promoted without --force".into(),
            ),
        }
    }

    pub async fn verify(&self) -> Result<String, String> {
        if !self.is_primary() {
            return Err("verify runs on the primary".into());
        }
        if let Some(why) = self.detached_why() {
            // Its stale disk would differ everywhere, and the peers hold the data.
            return Err(format!(
                "this primary's disk is detached ({why}): there is nothing local to verify"
            ));
        }
        let size = self.local.size();
        let mut differing = 0;
        let mut compared = Vec::new();
        for slot in &self.peers {
            let conn = slot.conn.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let Some(conn) = conn.filter(|c| c.replicating.load(Ordering::Acquire)) else {
                continue;
            };
            let mut peer_differing = 0;
            let mut offset = 0;
            while offset < size {
                let length = REGION_SIZE.min(size - offset);
                let guard = self.lock_range(offset, length).await;
                let local = self
                    .local
                    .read(offset, length as usize)
                    .await
                    .map_err(|e| format!("verify read: {e}"))?;
                let id = self.request_id();
                let reply = conn.request(
                    WaitKey::Request(id),
                    Message::ChecksumRequest {
                        id,
                        offset,
                        length: length as u32,
                    },
                );
                let timeout = self.resource.peer_timeout;
                let deadline = tokio::time::Instant::now() + timeout;
                let theirs = match conn.answer_within(reply, deadline, timeout).await {
                    Ok(Ok(Message::ChecksumReply {
                        status: 0,
                        checksum,
                        ..
                    })) => Some(checksum),
                    Ok(Ok(_)) => None,
                    _ => return Err(format!("peer {} did not answer the verify", conn.peer)),
                };
                if theirs != Some(super::wire::digest(&local.bytes())) {
                    self.meta().mark_out_of_sync(slot.index, offset, length);
                    peer_differing += 1;
                }
                drop(guard);
                offset += length;
            }
            if peer_differing > 0 {
                warn!(peer = %conn.peer, "verify: {peer_differing} regions differ; reconnecting to resync them");
                conn.close();
            } else {
                info!(peer = %conn.peer, "verify: every region is equal");
            }
            differing += peer_differing;
            compared.push(conn.peer.clone());
        }
        if compared.is_empty() {
            return Err("no peer is connected and replicating: nothing to compare with".into());
        }
        let skipped = self.peers.len() - compared.len();
        let not_compared = if skipped > 0 {
            format!("; {skipped} peer(s) not connected, not compared")
        } else {
            String::new()
        };
        Ok(format!(
            "verify done: {differing} regions differed (compared with {}{not_compared})",
            compared.join(", ")
        ))
    }
}

async fn answer(shared: &Shared, request: &str) -> Reply {
    let words: Vec<&str> = request.split_whitespace().collect();
    let done = |result: Result<String, String>| match result {
        Ok(message) => Reply {
            ok: true,
            message,
            status: Some(shared.status()),
            server: None,
        },
        Err(message) => Reply {
            ok: false,
            message,
            status: Some(shared.status()),
            server: None,
        },
    };
    match words.as_slice() {
        ["status"] => done(Ok(String::new())),
        ["promote"] | ["promote", "--force"] => {
            let force = words.len() == 2;
            let _role = shared.role_change.lock().await;
            let result = shared.promote(force).map(|promoted| {
                // Only a promote that was not refused chose the role: a refused one left
                // a `--primary` start's wait to go on (it cancelled the wait's promotion).
                shared.note_role_command();
                if promoted {
                    shared.announce_primary_and_reconnect();
                    "promoted to primary".to_string()
                } else {
                    "already primary".to_string()
                }
            });
            done(result)
        }
        ["demote"] => {
            let _role = shared.role_change.lock().await;
            // Also ends a `--primary` start's wait for its peers: the operator chose.
            shared.note_role_command();
            // Secondary in memory and in the metadata: a demotion whose flush failed let
            // go of the role but recorded nothing, and is tried again (re-review).
            if !shared.is_primary() && !shared.meta().superblock().primary {
                // Nothing to make durable, and no link to drop: dropping them made the
                // primary go on degraded and resync this node (review, session 69).
                return done(Ok("already secondary".into()));
            }
            let result = shared.demote().await.map(|()| {
                shared.relink_all();
                "demoted to secondary".to_string()
            });
            done(result)
        }
        ["verify"] => done(shared.verify().await),
        ["outdate"] => {
            let _role = shared.role_change.lock().await;
            done(shared.outdate())
        }
        _ => done(Err(format!(
            "unknown request {request:?} (status, promote [--force], demote, verify, outdate)"
        ))),
    }
}

/// Serves the node's control socket until `stop` turns true, then removes its file.
pub async fn run_control(
    shared: Arc<Shared>,
    listener: UnixListener,
    path: PathBuf,
    stop: watch::Receiver<bool>,
) {
    crate::control::serve(listener, path, stop, move |line| {
        let shared = Arc::clone(&shared);
        async move { answer(&shared, &line).await }
    })
    .await;
}

/// Bytes per second in MiB/s, the unit of the resource's `resync_rate`.
pub fn mib(bytes_per_second: u64) -> f64 {
    bytes_per_second as f64 / f64::from(1 << 20)
}

/// A human-readable rendering of a status.
pub fn render(status: &Status) -> String {
    let mut text = format!(
        "resource {} node {}: {}, disk {}, generation {}, {} bytes out of sync\n",
        status.resource,
        status.node,
        status.role,
        status.disk,
        status.generation,
        status.out_of_sync_bytes
    );
    if let Some(why) = &status.metadata_stopped {
        text.push_str(&format!("  writes stopped: {why}\n"));
    }
    if let Some(why) = &status.flush_stopped {
        text.push_str(&format!(
            "  flushes fail: a sync of the disk failed ({why})\n"
        ));
    }
    if let Some(why) = &status.detached {
        text.push_str(&format!(
            "  disk detached after an I/O error ({why}): reads and writes go to the peers\n"
        ));
    }
    for peer in &status.peers {
        text.push_str(&format!("  peer {}: {}", peer.name, peer.link));
        if let Some(why) = &peer.refused {
            text.push_str(&format!(" (refused: {why})"));
        } else if let Some(why) = &peer.lost {
            text.push_str(&format!(" (link lost: {why})"));
        }
        if peer.fenced {
            text.push_str(", fenced");
        }
        text.push_str(&format!(", {} bytes out of sync", peer.out_of_sync_bytes));
        if peer.replicating {
            text.push_str(", replicating");
        }
        if peer.resync_total_bytes > 0 {
            text.push_str(&format!(
                ", resync {}/{} bytes ({} sent, the rest equal), compared at {:.1} MiB/s, \
                 sent at {:.1} MiB/s",
                peer.resync_done_bytes,
                peer.resync_total_bytes,
                peer.resync_sent_bytes,
                mib(peer.resync_rate_bytes_per_sec),
                mib(peer.resync_sent_rate_bytes_per_sec)
            ));
            match peer.resync_eta_seconds {
                Some(eta) if peer.resyncing() => text.push_str(&format!(", ETA {eta} s")),
                _ if peer.resyncing() => text.push_str(", ETA unknown"),
                _ if peer.resync_finished => text.push_str(", done"),
                _ => text.push_str(", stopped"),
            }
        } else if peer.link == "target" && (peer.resyncing() || peer.resync_done_bytes > 0) {
            text.push_str(&format!(
                ", resync from it: {} bytes compared ({} received), at {:.1} MiB/s",
                peer.resync_done_bytes,
                peer.resync_sent_bytes,
                mib(peer.resync_rate_bytes_per_sec)
            ));
            if peer.resyncing() {
                text.push_str(", running");
            } else if peer.resync_finished {
                text.push_str(", done");
            }
        }
        text.push('\n');
    }
    text
}
