//! The replicated backend: a [`Backend`] over the local backend that, on the primary,
//! ships every write to the connected peers and replies per protocol, and otherwise
//! refuses client writes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{oneshot, watch, Notify};
use tracing::{error, info, warn};

use super::config::{NodeConfig, Protocol, ResourceConfig};
use super::generation::{random_generation, SyncDecision, JUST_CREATED};
use super::meta::{MetaError, Metadata, AL_SLOTS, EXTENT_SIZE, REGION_SIZE};
use super::peer::{PeerConn, Plan, WaitKey};
use super::window::DataWindow;
use super::wire::{piece_checksums, write_flags, DiskState, Message, ResyncStatus, Role};
use crate::backend::{
    backend_future, Backend, BackendError, BackendFuture, Capabilities, Extent, ReadData,
    WriteData, ZeroFlags,
};
use crate::tcp::TcpSettings;
use crate::wire::NbdError;

/// Regions a resync has in flight at once (8 MiB; 4 MiB resynced 410 MiB in 0.57–0.71 s,
/// 8 MiB in 0.49–0.64 s).
const RESYNC_WINDOW: u64 = 128;
/// Most consecutive out-of-sync regions one resync request covers (1 MiB): one read, one
/// checksum message and one data message per run instead of per 64 KiB region. Measured:
/// a 4 GiB device with 1 MiB of every 10 MiB out of sync resynced at 417 MB/s with a
/// request per region, both nodes CPU-bound on per-message work.
const RESYNC_RUN_REGIONS: u64 = 16;
/// Regions resynced between two flushes of the target (16 MiB). Resync writes on the
/// target are not FUA: buffered writes to one file run one at a time in io_uring's
/// workers, so a FUA write (write + fdatasync) per 64 KiB region held the resync of a
/// 4 GiB device to about 140 MB/s; a flush per 16 MiB costs one fdatasync.
const RESYNC_FLUSH_REGIONS: usize = 256;

/// Protocol A: what a peer may have unacknowledged before writes wait for it, in bytes
/// of payload (a trim or zeroing counts by its length, at least 64 KiB: `peer::queue_cost`).
const PROTOCOL_A_MAX_UNACKED: u64 = 64 << 20;

/// Spaces a resync's data sends so they average the configured rate: each send takes the
/// next free slot as long as its bytes last at that rate, and goes at the slot's start.
/// New runs start only once the slots taken have passed, so a run rarely waits, and never
/// for its own slot: it holds its range lock while it waits, and client writes to the range
/// wait on that lock (at the slot's end, a 1 MiB run at 1 MB/s held it for a second, and
/// client writes there took up to a second each).
struct Pacer {
    bytes_per_second: f64,
    free_at: Mutex<tokio::time::Instant>,
}

impl Pacer {
    fn new(bytes_per_second: u64) -> Pacer {
        Pacer {
            bytes_per_second: bytes_per_second as f64,
            free_at: Mutex::new(tokio::time::Instant::now()),
        }
    }

    /// When the sends already admitted have had their time.
    fn free_at(&self) -> tokio::time::Instant {
        *self.free_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits until `bytes` may be sent: the start of the next free slot.
    async fn wait_to_send(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        let due = {
            let mut free_at = self.free_at.lock().unwrap_or_else(|e| e.into_inner());
            let start = (*free_at).max(tokio::time::Instant::now());
            *free_at = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_second);
            start
        };
        // Timers tick in milliseconds: a shorter wait is not worth one (the next send
        // still starts after this one's slot).
        if due > tokio::time::Instant::now() + Duration::from_millis(1) {
            tokio::time::sleep_until(due).await;
        }
    }
}

/// One configured peer and its connection, if any.
pub struct PeerSlot {
    /// Position among the peers: also the index of this peer's bitmap.
    pub index: usize,
    pub config: NodeConfig,
    pub conn: Mutex<Option<Arc<PeerConn>>>,
    /// Regions resynced to this peer in the current pass, and the pass's total.
    pub resync_done: AtomicU64,
    pub resync_total: AtomicU64,
    /// Bytes of data the current pass actually sent (the rest had equal checksums).
    pub resync_sent: AtomicU64,
    /// When the current (or last) pass started, and when it ended: for rate and ETA.
    pub resync_clock: Mutex<Option<(std::time::Instant, Option<std::time::Instant>)>>,
    /// Whether the last pass finished: every region sent and made durable on the peer, its
    /// bits cleared. A pass cut short (a lost link, a failed flush, a demotion) leaves it
    /// false even when every run had been sent.
    pub resync_finished: AtomicBool,
    /// The peer said it became primary (then dropped the link to reconnect in its new
    /// role) and has not said hello since: while set, promoting this node needs force,
    /// or a promote in the reconnect gap would make two primaries.
    pub announced_primary: AtomicBool,
    /// Why the last attempt to link with this peer was refused (by either side), until a
    /// link is made: `netblk status` shows it, and the log says it once per new reason
    /// rather than at every retry (review, session 66: a split brain showed only as
    /// "disconnected", and was logged twice a second by each side, for ever).
    pub refused: Mutex<Option<String>>,
    /// Why the last link with this peer ended, when this node knows more than that it
    /// closed (the peer's disk failed a write, it went silent): `netblk status` shows it
    /// while the peer is disconnected (review, session 68: a peer whose disk was full
    /// showed only as "disconnected").
    pub lost: Mutex<Option<String>>,
    /// The last link ended after the peer's disk failed a write: the dialing side waits
    /// longer before the next (`peer::dial_loop`), which clears it.
    pub disk_failed: AtomicBool,
    /// When the last link with this peer ended (see [`Shared::expect_relinks`]).
    pub link_ended: Mutex<Option<std::time::Instant>>,
    /// Since this node's last promotion: the peer is expected to link again in the new
    /// role, and writes wait for it (see [`Shared::wait_for_relinks`]).
    pub expected_back: AtomicBool,
    /// This node dropped the link to redo it in a new role: the dialling side dials again
    /// at once rather than after the retry interval (`peer::dial_loop` takes the
    /// permit). It also wakes a retry wait already running: after a demotion elsewhere
    /// that wait had begun, and a promotion here then found the peer half a second away
    /// (re-review, session 71).
    pub relink_now: Notify,
    /// Links with this peer installed so far (see [`Self::fenced_for`]).
    links_made: AtomicU64,
    /// `links_made + 1` as it was when the `fence_peer` handler last fenced this peer:
    /// fenced since its last link ended while it still equals `links_made + 1`.
    fenced_for: AtomicU64,
    /// Serialises the handler's runs for this peer, and keeps the last failure (when,
    /// why, and `links_made` then) so that writes do not run it again at once.
    fencing: tokio::sync::Mutex<Option<(std::time::Instant, String, u64)>>,
}

impl PeerSlot {
    /// Whether the `fence_peer` handler fenced this peer since its last link ended.
    pub fn fenced(&self) -> bool {
        self.fenced_for.load(Ordering::Acquire) == self.links_made.load(Ordering::Acquire) + 1
    }

    /// Whether a link with this peer is up (its hello done).
    pub fn linked(&self) -> bool {
        self.conn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }

    /// Whether this peer is this node's primary: linked, with this node its resync target.
    pub fn is_this_nodes_primary(&self) -> bool {
        self.conn
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|c| c.plan == Plan::Target)
    }

    /// The link with this peer, if it takes writes.
    fn replicating_conn(&self) -> Option<Arc<PeerConn>> {
        let conn = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        conn.as_ref()
            .filter(|c| c.replicating.load(Ordering::Acquire))
            .cloned()
    }

    /// Records a refusal of a link with this peer; true when its reason is new (so worth a
    /// warning), false when it repeats the last one.
    pub fn note_refusal(&self, reason: &str) -> bool {
        let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        if refused.as_deref() == Some(reason) {
            return false;
        }
        *refused = Some(reason.to_string());
        true
    }
}

/// State shared by the backend, the peer connections and the control socket.
pub struct Shared {
    pub local: Arc<dyn Backend>,
    pub resource: ResourceConfig,
    pub node: String,
    /// The TCP settings of this node's replication links and client listener.
    pub tcp: TcpSettings,
    pub meta: Mutex<Metadata>,
    pub peers: Vec<PeerSlot>,
    primary: AtomicBool,
    /// Set by an operator's `promote` or `demote` (the control socket): from then on the
    /// role is theirs, and a `--primary` start still waiting for its peers does not take it.
    role_commanded: AtomicBool,
    /// Whether this node's data has been known to be the newest since it started: it has
    /// been primary since, or a primary has brought it up to date. One that has not (any
    /// node restarted while its peers are away) may lack writes a peer acknowledged alone
    /// after this node went down: it is promoted without force only with every peer
    /// connected, their generations compared. Review, session 69: a secondary killed, its
    /// primary writing degraded and then killed, the secondary restarted alone with
    /// `--primary` took the role after the wait and served stale data; re-review: the same
    /// for a primary killed, its secondary promoted and writing, and the old primary
    /// restarted alone (being primary when it stopped does not make its data the newest).
    data_confirmed: AtomicBool,
    /// Held by an operator's `promote` or `demote` from start to answer, so that one runs
    /// after the other, never inside it: a demotion lets go of the role at once but
    /// records it only after its flush, and a promote in that gap succeeded, then the
    /// demotion answered "demoted" too and recorded secondary under a primary (review,
    /// session 69).
    pub role_change: tokio::sync::Mutex<()>,
    /// Orders a write's sends against a flush's barriers: a write goes to all its peers
    /// under the shared side, a flush's barriers under the exclusive one, so each write
    /// is on the same side of each barrier on every peer (the barriers of `flush_all`,
    /// which `BarrierDone` follows; a resync pass's barriers go to its one target and
    /// are never followed by one). Sent in turn unordered, a write
    /// could reach beta before a barrier and gamma after it; `BarrierDone` then told beta
    /// the write was durable everywhere, and had the primary died before gamma got it,
    /// neither node marked its extent (re-review, session 72).
    send_order: std::sync::RwLock<()>,
    /// Set after the final flush: connections ending now lose nothing.
    stopping: AtomicBool,
    next_seq: AtomicU64,
    next_epoch: AtomicU64,
    next_request: AtomicU64,
    ranges: RangeLocks,
    al_released: Notify,
    /// Set when this primary stopped using its local disk after an I/O error on it (see
    /// [`Shared::detach`]); `detached_why` says which.
    detached: AtomicBool,
    detached_why: Mutex<Option<String>>,
    /// After a promotion, until when writes wait for the peers expected back (see
    /// [`Shared::wait_for_relinks`]); `None` once none is.
    relink_deadline: Mutex<Option<tokio::time::Instant>>,
    /// Whether `relink_deadline` is set: what every write looks at, without a lock.
    relinks_pending: AtomicBool,
    /// Bumped whenever a link is installed or lost: what writes waiting for relinks watch.
    links_changed: watch::Sender<u64>,
}

/// How long writes after a promotion wait at most for the peers that had a link (or lost
/// one shortly before) to link again in the new role; `peer_timeout` if shorter. A
/// relink on loopback takes a few milliseconds; the bound is what a peer that does not
/// come back costs the first writes, once.
const RELINK_GRACE: Duration = Duration::from_secs(2);

/// The replicated export's backend.
#[derive(Clone)]
pub struct ReplicatedBackend {
    pub shared: Arc<Shared>,
}

/// Stops a resync pass's clock (when it started, when it ended) when dropped, if the pass
/// had not ended yet.
struct PassClock<'a>(&'a Mutex<Option<(std::time::Instant, Option<std::time::Instant>)>>);

impl PassClock<'_> {
    fn stop(&self) {
        let mut clock = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, end @ None)) = clock.as_mut() {
            *end = Some(std::time::Instant::now());
        }
    }
}

impl Drop for PassClock<'_> {
    fn drop(&mut self) {
        self.stop();
    }
}

impl PeerSlot {
    /// Starts the figures of a pass (as its source, or as its target: see
    /// [`Shared::note_resync_received`]).
    fn start_pass(&self, total_regions: u64) {
        self.resync_total.store(total_regions, Ordering::Relaxed);
        self.resync_done.store(0, Ordering::Relaxed);
        self.resync_sent.store(0, Ordering::Relaxed);
        self.resync_finished.store(false, Ordering::Release);
        *self.resync_clock.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((std::time::Instant::now(), None));
    }
}

impl Shared {
    /// Builds the shared state; the metadata is marked in use (not clean).
    pub fn new(
        local: Arc<dyn Backend>,
        resource: ResourceConfig,
        node: &str,
        mut meta: Metadata,
        tcp: TcpSettings,
    ) -> Result<Arc<Shared>, MetaError> {
        meta.set_clean(false)?;
        // Every start is as secondary, as with DRBD: after a crash the other node may have
        // been promoted meanwhile, and two primaries must never both serve clients. The
        // operator or orchestrator promotes (`--primary`, `netblk promote`).
        let was_primary = meta.superblock().primary;
        if was_primary {
            meta.update(|sb| sb.primary = false)?;
            info!("this node was primary when it stopped; it starts as secondary");
        }
        let peers = resource
            .peers_of(node)
            .enumerate()
            .map(|(index, config)| PeerSlot {
                index,
                config: config.clone(),
                conn: Mutex::new(None),
                resync_done: AtomicU64::new(0),
                resync_total: AtomicU64::new(0),
                resync_sent: AtomicU64::new(0),
                resync_clock: Mutex::new(None),
                resync_finished: AtomicBool::new(false),
                announced_primary: AtomicBool::new(false),
                refused: Mutex::new(None),
                lost: Mutex::new(None),
                disk_failed: AtomicBool::new(false),
                link_ended: Mutex::new(None),
                expected_back: AtomicBool::new(false),
                relink_now: Notify::new(),
                links_made: AtomicU64::new(0),
                fenced_for: AtomicU64::new(0),
                fencing: tokio::sync::Mutex::new(None),
            })
            .collect();
        Ok(Arc::new(Shared {
            local,
            node: node.to_string(),
            tcp,
            resource,
            meta: Mutex::new(meta),
            peers,
            primary: AtomicBool::new(false),
            role_commanded: AtomicBool::new(false),
            data_confirmed: AtomicBool::new(false),
            role_change: tokio::sync::Mutex::new(()),
            send_order: std::sync::RwLock::new(()),
            stopping: AtomicBool::new(false),
            next_seq: AtomicU64::new(1),
            next_epoch: AtomicU64::new(1),
            next_request: AtomicU64::new(1),
            ranges: RangeLocks::default(),
            al_released: Notify::new(),
            detached: AtomicBool::new(false),
            detached_why: Mutex::new(None),
            relink_deadline: Mutex::new(None),
            relinks_pending: AtomicBool::new(false),
            links_changed: watch::channel(0).0,
        }))
    }

    /// At a promotion, whose announcement drops every link so that each peer links again
    /// in the new role: the peers that had a link, or lost one within the grace before, are
    /// expected back, and writes wait for them (at most [`RELINK_GRACE`], or
    /// `peer_timeout` if shorter). Written meanwhile, the new primary's first writes went
    /// to no peer: after every switchover, about half a second of acknowledged writes was
    /// on one node only, under a new data generation and resynced later (review, session
    /// 71).
    pub fn expect_relinks(&self) {
        let grace = RELINK_GRACE.min(self.resource.peer_timeout);
        let now = std::time::Instant::now();
        let mut any = false;
        for slot in &self.peers {
            let linked = slot.linked();
            let lately = slot
                .link_ended
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some_and(|ended| now.duration_since(ended) < grace);
            let expected = linked || lately;
            slot.expected_back.store(expected, Ordering::Release);
            any |= expected;
        }
        let mut deadline = self
            .relink_deadline
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *deadline = any.then(|| tokio::time::Instant::now() + grace);
        self.relinks_pending.store(any, Ordering::Release);
    }

    /// Waits, after a promotion, until every peer expected back takes writes again, or
    /// the grace is over (see [`Self::expect_relinks`]). Free once that is done.
    async fn wait_for_relinks(&self) {
        if !self.relinks_pending.load(Ordering::Acquire) {
            return;
        }
        let Some(deadline) = *self
            .relink_deadline
            .lock()
            .unwrap_or_else(|e| e.into_inner())
        else {
            return;
        };
        let mut changed = self.links_changed.subscribe();
        loop {
            let waiting = self.peers.iter().any(|slot| {
                slot.expected_back.load(Ordering::Acquire) && slot.replicating_conn().is_none()
            });
            if !waiting || !self.is_primary() {
                break;
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                break;
            }
        }
        let mut current = self
            .relink_deadline
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if *current == Some(deadline) {
            *current = None;
            self.relinks_pending.store(false, Ordering::Release);
        }
    }

    pub fn is_primary(&self) -> bool {
        self.primary.load(Ordering::Acquire)
    }

    /// Records that an operator chose the role (`netblk promote` or `netblk demote`).
    pub fn note_role_command(&self) {
        // Under the metadata lock: see `promote_unless_commanded`.
        let _meta = self.meta();
        self.role_commanded.store(true, Ordering::Release);
    }

    /// Whether an operator has chosen the role since the start (see [`Self::note_role_command`]).
    pub fn role_commanded(&self) -> bool {
        self.role_commanded.load(Ordering::Acquire)
    }

    pub fn role(&self) -> Role {
        if self.is_primary() {
            Role::Primary
        } else {
            Role::Secondary
        }
    }

    /// The metadata, locked. Lock order: metadata before any peer slot.
    pub fn meta(&self) -> MutexGuard<'_, Metadata> {
        self.meta.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A fresh id for a request/reply pair on a peer connection.
    pub fn request_id(&self) -> u64 {
        self.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// Makes this node primary. Refused unless `force` when its data is not known to be
    /// up to date, or when a connected peer's generations show newer data; a
    /// just-created node gets its first real generation. Answers whether the role changed
    /// (false: it was primary already, and nothing is done).
    pub fn promote(&self, force: bool) -> Result<bool, String> {
        self.promote_checked(force, false)
    }

    /// `--primary`'s promotion: [`Self::promote`] without force, unless an operator chose
    /// the role meanwhile (then `Ok(false)`, and nothing is done). Checked under the
    /// metadata lock, which [`Self::note_role_command`] takes too: a demote either comes
    /// first and is kept, or comes after the promotion and undoes it whole (re-review,
    /// session 67: between a check outside the lock and the promotion, a demote could
    /// leave the node primary with metadata saying secondary).
    pub fn promote_unless_commanded(&self) -> Result<bool, String> {
        self.promote_checked(false, true)
    }

    fn promote_checked(&self, force: bool, unless_commanded: bool) -> Result<bool, String> {
        let mut meta = self.meta();
        if unless_commanded && self.role_commanded() {
            return Ok(false);
        }
        let sb = meta.superblock().clone();
        if self.is_primary() {
            return Ok(false);
        }
        // Under the metadata lock, as `install`: a primary's hello is either installed
        // before this check (and refuses it) or refused by `install` after it.
        for slot in &self.peers {
            if slot.is_this_nodes_primary() {
                return Err(format!(
                    "peer {} is primary: demote it first",
                    slot.config.name
                ));
            }
            if !force && slot.announced_primary.load(Ordering::Acquire) {
                return Err(format!(
                    "peer {} announced it became primary and has not reconnected since; \
                     if it is down, use --force",
                    slot.config.name
                ));
            }
        }
        if !force {
            for slot in &self.peers {
                let conn = slot.conn.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let Some(conn) = conn else { continue };
                let theirs = conn.peer_generations();
                if matches!(
                    sb.generations.compare(&theirs),
                    SyncDecision::TargetFromBitmap | SyncDecision::TargetFull
                ) {
                    return Err(format!(
                        "peer {} has newer data (generation {:#x}); promote it instead, or use --force",
                        conn.peer, theirs.current
                    ));
                }
            }
        }
        let fresh = sb.generations.current == JUST_CREATED;
        let every_peer_connected = self.peers.iter().all(PeerSlot::linked);
        // The first primary (no data generation yet here) is chosen among all the nodes,
        // and never over a disk that may hold data of unknown age: a node created blank
        // alone said nothing of its peers' data (a memory node whose metadata was lost
        // with it took the role and served zeroes; re-review, session 70), and new
        // metadata over a disk that held data says nothing of how old that data is
        // (recreated metadata let a lone node serve stale data; review, session 69). This
        // node's own old data is the only data when every peer is connected and blank.
        if !force && fresh {
            if !every_peer_connected {
                return Err(
                    "this node has no data generation yet and not every peer is connected: \
                     the first primary is chosen with every node present, since a peer may \
                     hold the data; start the peers and promote, or use --force if none has \
                     data to keep"
                        .into(),
                );
            }
            for slot in &self.peers {
                let conn = slot.conn.lock().unwrap_or_else(|e| e.into_inner()).clone();
                let Some(conn) = conn else { continue };
                if conn.peer_generations().current == JUST_CREATED && !conn.peer_created_blank {
                    return Err(format!(
                        "peer {} has no data generation yet and did not start blank (its \
                         disk held data before its metadata, or it lost its data at a \
                         restart): it may hold data this node lacks; promote the node whose \
                         data is to be kept with --force",
                        conn.peer
                    ));
                }
            }
        }
        if !force && !fresh && !every_peer_connected && !self.data_confirmed.load(Ordering::Acquire)
        {
            return Err(
                "not every peer is connected, and no primary has brought this node up to \
                 date since it started: a peer may hold writes it acknowledged after this \
                 node went down; start the peers and promote, or use --force if none has \
                 newer data"
                    .into(),
            );
        }
        if !force && !fresh && sb.disk != DiskState::UpToDate {
            return Err(format!(
                "this node's data is {:?}: it may be older than a peer's; use --force to promote anyway",
                sb.disk
            ));
        }
        if !force && sb.disk == DiskState::Inconsistent {
            return Err("this node is in the middle of a resync; use --force".into());
        }
        let new_generation = random_generation().map_err(|e| format!("random: {e}"))?;
        meta.update(|sb| {
            if fresh {
                // The first real generation: peers that are still just-created get a
                // full (checksum) resync from this node.
                sb.generations.current = new_generation;
            } else if force {
                // Forced data may differ from a peer's: a new generation, so the peers
                // see either an older ancestor (resync) or split brain, never "equal".
                sb.generations.start_new(new_generation);
            }
            sb.primary = true;
            sb.disk = DiskState::UpToDate;
        })
        .map_err(|e| e.to_string())?;
        // Before the role: a write that sees it also waits for the links to be redone.
        self.expect_relinks();
        self.primary.store(true, Ordering::Release);
        self.data_confirmed.store(true, Ordering::Release);
        info!(
            generation = format!("{:#x}", meta.superblock().generations.current),
            "promoted to primary"
        );
        Ok(true)
    }

    /// Makes this node secondary: new client writes are refused at once, the writes
    /// already past that check finish, and one replicated flush makes them durable on
    /// every replica before the role change is recorded.
    pub async fn demote(&self) -> Result<(), String> {
        self.primary.store(false, Ordering::Release);
        // Writes waiting for relinks after a promotion fail now, not at the grace's end
        // (re-review, session 71).
        self.links_changed.send_modify(|n| *n += 1);
        self.ranges.wait_idle().await;
        self.flush_all()
            .await
            .map_err(|e| format!("flush before demoting failed: {e}"))?;
        self.meta()
            .update(|sb| sb.primary = false)
            .map_err(|e| e.to_string())?;
        info!("demoted to secondary");
        Ok(())
    }

    /// Connections that take replicated writes now.
    fn replicating_conns(&self) -> Vec<Arc<PeerConn>> {
        self.peers
            .iter()
            .filter_map(PeerSlot::replicating_conn)
            .collect()
    }

    /// Under the metadata lock: which peers get this write; regions of peers that do
    /// not are marked out of sync, and a new data generation starts the first time.
    fn targets_for_write(&self, offset: u64, length: u64) -> Result<Vec<Arc<PeerConn>>, String> {
        let mut meta = self.meta();
        let conns = self.replicating_conns();
        if conns.len() < self.peers.len() {
            for slot in &self.peers {
                if !conns.iter().any(|c| c.peer == slot.config.name) {
                    meta.mark_out_of_sync(slot.index, offset, length);
                }
            }
            self.start_generation_if_needed(&mut meta, &conns)?;
        }
        Ok(conns)
    }

    /// Before the first write that some peer misses is acknowledged: a new data
    /// generation, durable, so that the peer is known to be behind when it returns (and
    /// cannot be promoted over this node without force).
    fn start_generation_if_needed(
        &self,
        meta: &mut Metadata,
        conns: &[Arc<PeerConn>],
    ) -> Result<(), String> {
        if meta.superblock().generations.bitmap != 0 {
            return Ok(());
        }
        self.start_generation(meta, conns)
    }

    /// A new data generation, durable, shared at once with the connected peers that take
    /// writes (`conns`). With a bitmap generation already open (another peer was away
    /// before) the old `current` goes to history and the bitmap base stays.
    fn start_generation(&self, meta: &mut Metadata, conns: &[Arc<PeerConn>]) -> Result<(), String> {
        let new = random_generation().map_err(|e| e.to_string())?;
        blocking(|| meta.update(|sb| sb.generations.start_new(new))).map_err(|e| e.to_string())?;
        warn!(
            "writing without every peer: new data generation {new:#x}; the bitmap tracks what they miss"
        );
        // Every peer that takes writes gets the new generation's writes too, so it takes
        // the generation now: else, after a failover, it would hold them under the old
        // name, and a node that missed them would compare with it as in sync (and never
        // get them), or as a split brain. One in sync adopts it whole; a resync target in
        // its pass only takes the new name (its pass goes on).
        let generations = meta.superblock().generations;
        for conn in conns {
            conn.send(if conn.synced.load(Ordering::Acquire) {
                Message::State {
                    role: Role::Primary,
                    disk: DiskState::UpToDate,
                    generations,
                }
            } else {
                Message::NewGeneration { generations }
            });
        }
        Ok(())
    }

    /// A peer connection ended: everything it may have missed is marked out of sync
    /// (its unacknowledged writes, and the hot extents no barrier done on every replica
    /// covers, since acknowledged writes can still sit in its volatile cache until one
    /// does), and it leaves its slot.
    pub fn peer_lost(&self, slot: &PeerSlot, conn: &Arc<PeerConn>, why: &str) {
        let mut meta = self.meta();
        let mut current = slot.conn.lock().unwrap_or_else(|e| e.into_inner());
        if !current.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            return;
        }
        let was_replicating = conn.replicating.swap(false, Ordering::AcqRel);
        *current = None;
        drop(current);
        *slot.link_ended.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(std::time::Instant::now());
        self.links_changed.send_modify(|n| *n += 1);
        // What this end said when it closed the link (the peer's disk failed a write)
        // tells more than whichever waiter saw the close first (re-review).
        let why = conn.close_reason().unwrap_or_else(|| why.to_string());
        let why = why.as_str();
        // A resync target's pass ends with its link (a source's clock stops as its pass
        // task ends).
        if conn.plan == Plan::Target {
            PassClock(&slot.resync_clock).stop();
        }
        *slot.lost.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.to_string());
        if conn.peer_disk_failed() {
            slot.disk_failed.store(true, Ordering::Release);
        }
        conn.close();
        // While a demotion drains, this node is no longer primary but writes may still be
        // in flight to the peer: those count as a primary's.
        let in_flight = if was_replicating {
            conn.take_in_flight()
        } else {
            Vec::new()
        };
        let writing = self.is_primary() || !in_flight.is_empty();
        if was_replicating && writing && !self.stopping.load(Ordering::Acquire) {
            for (offset, length) in in_flight {
                meta.mark_out_of_sync(slot.index, offset, length);
            }
            // Writes it acknowledged may still be in its volatile cache until a barrier
            // covers them. Those a barrier made durable there are not marked: a link that
            // dropped for a moment made the next pass compare the whole log, up to 1 GiB.
            for extent in meta.unflushed_extents() {
                meta.mark_out_of_sync(slot.index, extent * EXTENT_SIZE, EXTENT_SIZE);
            }
            warn!(peer = %slot.config.name, "peer lost ({why}): going on degraded, {} bytes out of sync", meta.out_of_sync_bytes(slot.index));
            // Writes in flight to the lost peer are acknowledged degraded as soon as this
            // returns: the generation moves on first, not at the next write. A peer that
            // holds this node's `current` gets a new one started even when a
            // bitmap generation is open already (another peer was away): otherwise, were
            // that peer promoted and written, its new generation would name this one's as
            // its bitmap base and hide the split brain, and the resync would overwrite
            // what this node acknowledged alone.
            // Holding it: in sync, or connected with it (an InSync hello) and lost before
            // its first bitmap pass ended.
            let others = self.replicating_conns();
            let holds_current = conn.synced.load(Ordering::Acquire)
                || conn.peer_generations().current == meta.superblock().generations.current;
            let started = if holds_current {
                self.start_generation(&mut meta, &others)
            } else {
                self.start_generation_if_needed(&mut meta, &others)
            };
            if let Err(e) = started {
                warn!("metadata: {e}");
            }
        } else if conn.plan == Plan::Target && !self.stopping.load(Ordering::Acquire) {
            // The primary is gone, maybe with writes in flight that reached this node and
            // not another (or the other way round): whichever node is promoted next must
            // resync the extents those writes may touch with every other node. Not those
            // a barrier made durable everywhere: after a clean demotion (which flushes)
            // that is all of them, where marking the whole log made the next primary
            // compare up to 1 GiB after every switchover (review, session 71).
            let marked = meta.mark_unflushed_out_of_sync();
            if marked > 0 {
                warn!(peer = %slot.config.name, "primary lost ({why}): {marked} extents of its recent writes marked for resync with every node");
            } else {
                // A clean demotion flushed everything first: nothing is in doubt.
                info!(peer = %slot.config.name, "primary lost ({why}): none of its writes is in doubt");
            }
        } else {
            info!(peer = %slot.config.name, "peer disconnected ({why})");
        }
    }

    /// The slot of the peer called `name`.
    pub fn slot_named(&self, name: &str) -> Option<&PeerSlot> {
        self.peers.iter().find(|slot| slot.config.name == name)
    }

    /// Installs a new connection in its slot; as a resync source it takes writes from
    /// now on (the metadata lock orders this against writes choosing their targets).
    /// `sent_role` is the role this node's hello told the peer: if a promotion came in
    /// between, the two ends would plan from different roles (the peer idle beside a
    /// primary it does not know of, free to be promoted too), so the link is refused and
    /// redone with the new role.
    pub fn install(
        &self,
        slot: &PeerSlot,
        conn: Arc<PeerConn>,
        plan: Plan,
        sent_role: Role,
    ) -> Result<(), String> {
        let mut meta = self.meta();
        let mut current = slot.conn.lock().unwrap_or_else(|e| e.into_inner());
        if current.is_some() {
            return Err(format!("{} is already connected", slot.config.name));
        }
        if self.role() != sent_role {
            return Err("this node's role changed during the hello; reconnecting".into());
        }
        if plan == Plan::Target && self.is_primary() {
            // Its hello was checked before this node's promotion took the lock.
            return Err(format!(
                "{} is primary and so is this node now",
                slot.config.name
            ));
        }
        // Its hello says its role from now on.
        slot.announced_primary.store(false, Ordering::Release);
        if let Plan::Source { full } = plan {
            if !self.is_primary() {
                return Err("this node stopped being primary".into());
            }
            if full {
                meta.mark_all_out_of_sync(slot.index);
            }
            conn.replicating.store(true, Ordering::Release);
        }
        *current = Some(conn);
        *slot.refused.lock().unwrap_or_else(|e| e.into_inner()) = None;
        // A fencing of the peer holds only until it links again.
        slot.links_made.fetch_add(1, Ordering::AcqRel);
        self.links_changed.send_modify(|n| *n += 1);
        Ok(())
    }

    async fn activate(&self, offset: u64, length: u64) -> Result<(), BackendError> {
        self.activate_extents(offset, length, Role::Primary).await
    }

    /// On a secondary, before it applies a write, trim or zero from the primary: the
    /// extents enter this node's activity log too. If the primary fails with writes in
    /// flight, a write may have reached this node and not another; the extents in the
    /// log are then resynced between the nodes that remain (see [`Shared::peer_lost`]).
    pub async fn activate_as_secondary(
        &self,
        offset: u64,
        length: u64,
    ) -> Result<(), BackendError> {
        self.activate_extents(offset, length, Role::Secondary).await
    }

    /// Enters the extents of `offset..offset+length` in the activity log, waiting while
    /// every slot is busy. A full log of idle extents is made room in by a replicated
    /// flush on a primary; a secondary cannot start one, so it marks the extents it
    /// evicts out of sync for every peer instead (always safe, costs a resync check).
    async fn activate_extents(
        &self,
        offset: u64,
        length: u64,
        role: Role,
    ) -> Result<(), BackendError> {
        let extents = Metadata::extents_of(offset, length);
        loop {
            let released = self.al_released.notified();
            let result = {
                let mut meta = self.meta();
                if meta.is_active(&extents) {
                    meta.activate(extents.clone())
                } else {
                    // A log transaction is an fdatasync.
                    blocking(|| meta.activate(extents.clone()))
                }
            };
            match result {
                Ok(()) => return Ok(()),
                Err(MetaError::ActivityLogBusy) => released.await,
                Err(MetaError::ActivityLogNeedsFlush) if role == Role::Secondary => {
                    let mut meta = self.meta();
                    if let Err(e) = blocking(|| meta.make_room_marking_out_of_sync(&extents)) {
                        return Err(BackendError::because(
                            "activity log",
                            offset,
                            length,
                            NbdError::Io,
                            e,
                        ));
                    }
                }
                Err(MetaError::ActivityLogNeedsFlush) => {
                    // Make the idle extents' writes durable everywhere so one can leave.
                    if let Err(e) = self.flush_all().await {
                        return Err(BackendError::because(
                            "activity log",
                            offset,
                            length,
                            NbdError::Io,
                            format_args!("the flush before an eviction failed: {e}"),
                        ));
                    }
                }
                Err(e) => {
                    return Err(BackendError::because(
                        "activity log",
                        offset,
                        length,
                        NbdError::Io,
                        e,
                    ));
                }
            }
        }
    }

    /// On a secondary: the primary reports every replica finished the barrier whose
    /// arrival here began flush `generation`, so extents written before it may leave
    /// the activity log.
    pub fn flushed_everywhere(&self, generation: u64) {
        self.meta().flush_done(generation);
        self.al_released.notify_waiters();
    }

    /// Takes the extents of a finished write out of use (they stay in the log).
    pub fn release(&self, offset: u64, length: u64) {
        self.meta().release(Metadata::extents_of(offset, length));
        self.al_released.notify_waiters();
    }

    /// A replicated TRIM or WRITE_ZEROES of any size: [`Shared::replicate`] per extent-
    /// aligned piece (see [`MAX_PIECE`]), in order, stopping at the first error.
    async fn replicate_in_pieces<'a>(
        &'a self,
        op: &'static str,
        offset: u64,
        length: u64,
        local: impl Fn(u64, u64) -> BackendFuture<'a, ()>,
        message: impl Fn(u64, u64, u64) -> Message,
    ) -> Result<(), BackendError> {
        for (offset, length) in pieces(offset, length) {
            let local = &local;
            self.replicate(
                op,
                offset,
                length,
                move || local(offset, length),
                |seq| message(seq, offset, length),
            )
            .await?;
        }
        Ok(())
    }

    /// Runs one replicated write-like operation: `local` on this node and `message` (with
    /// the sequence number filled in) on every replicating peer, replying per protocol.
    async fn replicate<'a>(
        &'a self,
        op: &'static str,
        offset: u64,
        length: u64,
        local: impl FnOnce() -> BackendFuture<'a, ()>,
        message: impl Fn(u64) -> Message,
    ) -> Result<(), BackendError> {
        if !self.is_primary() {
            return Err(BackendError::plain(op, offset, length, NbdError::Perm));
        }
        self.wait_for_relinks().await;
        let _range = self.ranges.lock(offset, length.max(1)).await;
        // Again: a demotion may have begun while this waited for an overlapping write,
        // and found the ranges idle in the moment between that write and this one.
        if !self.is_primary() {
            return Err(BackendError::plain(op, offset, length, NbdError::Perm));
        }
        self.activate(offset, length).await?;
        let result = self
            .replicate_locked(op, offset, length, local, message)
            .await;
        self.release(offset, length);
        result
    }

    async fn replicate_locked<'a>(
        &'a self,
        op: &'static str,
        offset: u64,
        length: u64,
        local: impl FnOnce() -> BackendFuture<'a, ()>,
        message: impl Fn(u64) -> Message,
    ) -> Result<(), BackendError> {
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        // One deadline for every peer: two lost peers cost one timeout, not two.
        let deadline = tokio::time::Instant::now() + self.resource.peer_timeout;
        let conns = self.targets_for_write(offset, length).map_err(|e| {
            BackendError::because(
                op,
                offset,
                length,
                NbdError::Io,
                format_args!("metadata: {e}"),
            )
        })?;
        let key = match self.resource.protocol {
            Protocol::B => WaitKey::Received(seq),
            Protocol::A | Protocol::C => WaitKey::Seq(seq),
        };
        let without_a_peer = conns.len() < self.peers.len();
        let sending = self.send_order.read().unwrap_or_else(|e| e.into_inner());
        let waits: Vec<(Arc<PeerConn>, oneshot::Receiver<Message>)> = conns
            .into_iter()
            .map(|conn| {
                let wait = conn.send_write(seq, offset, length, key, message(seq));
                (conn, wait)
            })
            .collect();
        drop(sending);
        // Created only now: the local write must not start before the log update. A
        // detached node has no local disk to write.
        let detached = self.is_detached();
        let local_result = if detached { Ok(()) } else { local().await };
        let mut applied_by_synced_peer = false;
        let mut lost_peer = false;
        for (conn, wait) in waits {
            // Protocol A does not wait, except for a peer so far behind that its queue
            // would grow without bound: then this write waits like protocol C.
            let behind = conn.unacked_bytes() > PROTOCOL_A_MAX_UNACKED;
            if self.resource.protocol != Protocol::A || behind {
                let acked = self.await_peer(&conn, wait, op, deadline).await;
                applied_by_synced_peer |= acked && conn.synced.load(Ordering::Acquire);
                lost_peer |= !acked;
            }
        }
        if lost_peer {
            self.check_degraded_is_recorded(op, offset, length)?;
        }
        if without_a_peer || lost_peer {
            self.fence_missing_peers(op, offset, length).await?;
        }
        self.local_outcome(
            op,
            offset,
            length,
            detached,
            local_result,
            applied_by_synced_peer,
        )
    }

    /// With `fence_peer` set in the resource file (DRBD's fence-peer handler): before a
    /// write or flush is acknowledged without a peer, that peer is fenced, by running the
    /// command with `NETBLK_RESOURCE`, `NETBLK_NODE`, `NETBLK_PEER` and
    /// `NETBLK_PEER_ADDRESS` in its environment. Exit 0 says the peer can no longer take
    /// over (outdated with `netblk outdate`, or powered off); until then the request
    /// waits, and if the command fails (or runs past `fence_timeout`) it fails with
    /// EIO, as every such request does for [`FENCE_RETRY`] before the command runs again.
    /// Without fencing, a primary cut off from a secondary that a cluster manager then
    /// promoted acknowledged writes that the split brain's resolution drops. A fencing
    /// holds until the peer links again. Nothing is run while every peer takes writes.
    async fn fence_missing_peers(
        &self,
        op: &'static str,
        offset: u64,
        length: u64,
    ) -> Result<(), BackendError> {
        let Some(command) = self.resource.fence_peer.as_deref() else {
            return Ok(());
        };
        let refused = |why: &str| {
            BackendError::because(op, offset, length, NbdError::Io, format_args!("{why}"))
        };
        // A peer linked again since the request chose its peers missed it, but needs no
        // fencing once it has sent its bitmap: it recorded its disk as outdated (or
        // inconsistent) first, and is not promoted without force until its pass ends.
        // Before that it might not be: a link the primary installed while the peer never
        // got the primary's hello left it up to date, and skipping every linked peer let
        // a write go unfenced (review, session 72). The wait is the pass's own.
        let needs_no_fence = |slot: &PeerSlot| {
            slot.fenced() || slot.replicating_conn().is_some_and(|c| c.sent_bitmap())
        };
        for slot in &self.peers {
            if needs_no_fence(slot) {
                continue;
            }
            if let Some(conn) = slot.replicating_conn() {
                // Or until that link ends: a newer one is then checked below.
                tokio::select! {
                    _ = conn.wait_peer_bitmap(self.resource.peer_timeout) => {}
                    () = conn.wait_closed() => {}
                }
            }
            let mut last_failure = slot.fencing.lock().await;
            if needs_no_fence(slot) {
                continue;
            }
            let links_made = slot.links_made.load(Ordering::Acquire);
            // A failure before the peer's last link says nothing of this loss.
            if let Some((at, why, _)) = last_failure
                .as_ref()
                .filter(|(_, _, then)| *then == links_made)
            {
                if at.elapsed() < FENCE_RETRY {
                    return Err(refused(why));
                }
            }
            warn!(peer = %slot.config.name, "going on without the peer: fencing it first (fence_peer)");
            let fenced = run_fence_peer(
                command,
                self.resource.fence_timeout,
                &self.resource.name,
                &self.node,
                &slot.config,
            );
            match fenced.await {
                Ok(()) => {
                    slot.fenced_for.store(links_made + 1, Ordering::Release);
                    *last_failure = None;
                    warn!(peer = %slot.config.name, "peer fenced: writes go on without it");
                }
                // Linked again meanwhile (the command's `netblk outdate` is then refused):
                // the peer will have the request from its pass.
                Err(e) if needs_no_fence(slot) => {
                    info!(peer = %slot.config.name, "the peer linked again while it was being fenced ({e})");
                }
                Err(e) => {
                    let why = format!(
                        "peer {} could not be fenced ({e}): nothing is acknowledged without it",
                        slot.config.name
                    );
                    error!(
                        "{why}; the fence_peer command runs again in {}s, or the peer links again",
                        FENCE_RETRY.as_secs()
                    );
                    *last_failure = Some((std::time::Instant::now(), why.clone(), links_made));
                    return Err(refused(&why));
                }
            }
        }
        Ok(())
    }

    /// A peer was lost while this write waited for it: it may be acknowledged without
    /// that peer only if the metadata recorded the loss (the new generation and the bits).
    /// Once the metadata has stopped, it may not have: then the write fails, as writes
    /// after it do.
    fn check_degraded_is_recorded(
        &self,
        op: &'static str,
        offset: u64,
        length: u64,
    ) -> Result<(), BackendError> {
        match self.meta().stopped() {
            None => Ok(()),
            Some(e) => Err(BackendError::because(
                op,
                offset,
                length,
                NbdError::Io,
                format_args!("a peer was lost and the metadata could not record it: {e}"),
            )),
        }
    }

    /// The reply to a replicated operation from its local result and whether a synced
    /// peer applied it (protocol C's ack): a local failure the peer covers detaches the
    /// local disk and succeeds, as DRBD's default `on-io-error detach` does; one it does
    /// not cover fails, with the range marked out of sync for every peer; a detached node
    /// succeeds only through a peer.
    fn local_outcome(
        &self,
        op: &'static str,
        offset: u64,
        length: u64,
        detached: bool,
        local_result: Result<(), BackendError>,
        applied_by_synced_peer: bool,
    ) -> Result<(), BackendError> {
        match local_result {
            _ if detached && !applied_by_synced_peer => Err(BackendError::because(
                op,
                offset,
                length,
                NbdError::Io,
                "the local disk is detached and no in-sync peer applied it",
            )),
            Err(e) if applied_by_synced_peer && self.detach(&e) => Ok(()),
            Err(e) => {
                // The peers may hold what this disk failed to take (under A or B, or from a
                // peer still resyncing): the range is marked, so the next resync makes the
                // replicas agree on whatever this disk holds, as the client was told the
                // write failed.
                if length > 0 {
                    self.meta().mark_out_of_sync_for_all(offset, length);
                }
                Err(e)
            }
            Ok(()) => Ok(()),
        }
    }

    /// Waits for a peer's answer; a peer that fails, closes or stays silent past the
    /// timeout is dropped (and what it misses goes into the bitmap). True when it
    /// answered with success.
    async fn await_peer(
        &self,
        conn: &Arc<PeerConn>,
        wait: oneshot::Receiver<Message>,
        op: &str,
        deadline: tokio::time::Instant,
    ) -> bool {
        let outcome = conn
            .answer_within(wait, deadline, self.resource.peer_timeout)
            .await;
        let why = match outcome {
            Ok(Ok(Message::Ack { status: 0, .. }))
            | Ok(Ok(Message::Received { .. }))
            | Ok(Ok(Message::BarrierAck { status: 0, .. })) => return true,
            Ok(Ok(Message::Ack { status, .. })) | Ok(Ok(Message::BarrierAck { status, .. })) => {
                let errno = crate::wire::NbdError::from_errno(status as i32);
                format!("the peer's disk failed a {op} ({errno})")
            }
            Ok(Ok(other)) => format!("{op} failed on the peer: {}", other.name()),
            Ok(Err(_)) => format!("connection closed during {op}"),
            Err(no_answer) => format!("no answer to {op}: {no_answer}"),
        };
        if let Some(slot) = self.peers.iter().find(|s| s.config.name == conn.peer) {
            self.peer_lost(slot, conn, &why);
        }
        false
    }

    /// A replicated flush no client waits for (a demotion's, the activity log's, the
    /// server's last at a stop): a barrier on every replicating peer and a local flush.
    pub async fn flush_all(&self) -> Result<(), BackendError> {
        self.replicated_flush(false).await
    }

    /// A client's FLUSH: [`Self::flush_all`], and with `fence_peer` set, every peer it
    /// goes without is fenced before it is acknowledged. Internal flushes answer no
    /// client: fencing there ran the command at every stop of a primary with a peer away
    /// (with a power-off command, a needless power-off) and failed the stop's flush when
    /// it could not (re-review, session 72).
    pub async fn flush_for_client(&self) -> Result<(), BackendError> {
        self.replicated_flush(true).await
    }

    async fn replicated_flush(&self, for_a_client: bool) -> Result<(), BackendError> {
        if for_a_client {
            // As a write does: after a promotion the peers relink in the new role within
            // milliseconds. A FLUSH in that gap went without them, and with fencing set
            // ran the command against the healthy old primary; `netblk outdate` there was
            // refused once it had relinked, and the FLUSH failed with EIO after 10 s
            // (re-review, session 72).
            self.wait_for_relinks().await;
        }
        // Before the exclusive side, so that no write waits behind the metadata lock
        // for it: a write released in between is stamped a generation later, which only
        // keeps its extent in doubt longer.
        let generation = self.meta().begin_flush();
        let barriers = self.send_order.write().unwrap_or_else(|e| e.into_inner());
        let epoch = self.next_epoch.fetch_add(1, Ordering::Relaxed);
        // Only a primary has replicating connections (a demoted one until it reconnects).
        let waits: Vec<_> = self
            .replicating_conns()
            .into_iter()
            .map(|conn| {
                let wait = conn.request(WaitKey::Epoch(epoch), Message::Barrier { epoch });
                (conn, wait)
            })
            .collect();
        drop(barriers);
        let detached = self.is_detached();
        let local = if detached {
            Ok(())
        } else {
            self.local.flush().await
        };
        let deadline = tokio::time::Instant::now() + self.resource.peer_timeout;
        let mut flushed = Vec::new();
        let mut lost_peer = false;
        for (conn, wait) in waits {
            if self.await_peer(&conn, wait, "flush", deadline).await {
                flushed.push(conn);
            } else {
                lost_peer = true;
            }
        }
        if lost_peer {
            self.check_degraded_is_recorded("flush", 0, 0)?;
        }
        // Only a primary's FLUSH fences. A secondary's own (its read-only export) speaks
        // for no peer; and one that finds its node demoted meanwhile fenced both peers
        // after the demotion dropped the links itself (the healthy one too; re-review,
        // session 72): the demotion's own flush covers every linked peer, and a peer
        // that was away was fenced by the first write that went without it.
        if for_a_client && self.is_primary() && (lost_peer || flushed.len() < self.peers.len()) {
            self.fence_missing_peers("flush", 0, 0).await?;
        }
        let flushed_by_synced_peer = flushed.iter().any(|c| c.synced.load(Ordering::Acquire));
        let local = self.local_outcome("flush", 0, 0, detached, local, flushed_by_synced_peer);
        if local.is_err() {
            // Under A or B (or with no synced peer) the peers may hold writes this disk
            // lost: marked now, so status counts them and the next resync settles them.
            let marked = self.meta().mark_unflushed_out_of_sync();
            warn!("the local flush failed: {marked} extents written since the last flush marked out of sync");
        }
        // A peer that failed the barrier was dropped, and what it misses is in the bitmap.
        if local.is_ok() {
            self.meta().flush_done(generation);
            self.al_released.notify_waiters();
            // The secondaries' activity logs may let these writes' extents go too.
            for conn in flushed {
                conn.send(Message::BarrierDone { epoch });
            }
        }
        local
    }

    /// Reads from a replicating peer after a local read error, and rewrites the block
    /// locally so the next read is served from this node again.
    async fn heal_read(
        &self,
        offset: u64,
        length: usize,
        error: BackendError,
    ) -> Result<ReadData, BackendError> {
        // Only a peer that is in sync (resync done, no bit set for the range) holds the
        // current data; the range lock keeps a client write from passing the peer read and
        // then being overwritten by the local rewrite.
        let _range = self.ranges.lock(offset, (length as u64).max(1)).await;
        let Some((peer, data)) = self.read_from_peers(offset, length).await else {
            return Err(error);
        };
        warn!(%peer, "local read failed ({error}): served from the peer, rewriting locally");
        if let Err(e) = self.local.write(offset, data.clone().into(), true).await {
            warn!("rewriting the healed block failed: {e}");
        }
        Ok(ReadData::dense(data))
    }

    /// Reads from the first replicating peer that holds the current data of the range
    /// (resync done, no bit set for it) and answers: the peer's name and the data.
    async fn read_from_peers(&self, offset: u64, length: usize) -> Option<(String, Bytes)> {
        let current: Vec<Arc<PeerConn>> = {
            let meta = self.meta();
            let regions =
                offset / REGION_SIZE..=(offset + (length as u64).max(1) - 1) / REGION_SIZE;
            self.replicating_conns()
                .into_iter()
                .filter(|conn| conn.synced.load(Ordering::Acquire))
                .filter(|conn| {
                    self.peers
                        .iter()
                        .find(|slot| slot.config.name == conn.peer)
                        .is_some_and(|slot| {
                            regions
                                .clone()
                                .all(|region| !meta.is_out_of_sync(slot.index, region))
                        })
                })
                .collect()
        };
        for conn in current {
            let id = self.request_id();
            let wait = conn.request(
                WaitKey::Request(id),
                Message::ReadRequest {
                    id,
                    offset,
                    length: length as u32,
                },
            );
            let timeout = self.resource.peer_timeout;
            let deadline = tokio::time::Instant::now() + timeout;
            match conn.answer_within(wait, deadline, timeout).await {
                Ok(Ok(Message::ReadReply {
                    status: 0, data, ..
                })) if data.len() == length => return Some((conn.peer.clone(), data)),
                _ => continue,
            }
        }
        None
    }

    /// A read on a detached node: from a peer, or EIO when none holds the range.
    async fn read_detached(&self, offset: u64, length: usize) -> Result<ReadData, BackendError> {
        match self.read_from_peers(offset, length).await {
            Some((_, data)) => Ok(ReadData::dense(data)),
            None => Err(BackendError::because(
                "read",
                offset,
                length as u64,
                NbdError::Io,
                "the local disk is detached and no in-sync peer answered",
            )),
        }
    }

    /// Whether this primary stopped using its local disk after an I/O error on it.
    pub fn is_detached(&self) -> bool {
        self.detached.load(Ordering::Acquire)
    }

    /// Why the local disk is detached, if it is (for `netblk status`).
    pub fn detached_why(&self) -> Option<String> {
        self.detached_why
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The local disk failed an operation (`error`) that an in-sync peer applied: from
    /// now on this primary serves its clients from its peers (reads go to a peer, writes
    /// and flushes succeed when one applies them), like DRBD's `on-io-error detach`, so
    /// a failing disk does not take the service down and the replicas never disagree
    /// about an acknowledged write. The disk is recorded as inconsistent first (so a
    /// restart does not trust it: it is resynced in full, by checksums, from the next
    /// primary), and peers still resyncing from it are dropped. False (the error stands)
    /// under protocol A or B, whose acks do not say the peer applied the write, or when
    /// the metadata cannot record the detach.
    fn detach(&self, error: &BackendError) -> bool {
        if self.resource.protocol != Protocol::C {
            return false;
        }
        // The metadata lock orders concurrent detaches (and is taken before `detached_why`
        // everywhere).
        let mut meta = self.meta();
        if self.is_detached() {
            return true;
        }
        if let Err(e) = blocking(|| meta.update(|sb| sb.disk = DiskState::Inconsistent)) {
            tracing::error!("the local disk failed ({error}) and the metadata could not record a detach ({e}): the error stands");
            return false;
        }
        *self.detached_why.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.to_string());
        self.detached.store(true, Ordering::Release);
        drop(meta);
        tracing::error!(
            "the local disk failed ({error}); an in-sync peer has the data: detached, this \
             node now reads from and writes to its peers only. Its disk is marked \
             inconsistent; demote this node and promote a peer, and it is resynced in \
             full when it next connects"
        );
        for conn in self.replicating_conns() {
            if !conn.synced.load(Ordering::Acquire) {
                warn!(peer = %conn.peer, "dropping a peer that was resyncing from the detached disk");
                conn.close();
            }
        }
        true
    }

    /// Takes the range lock, for resync: no client write to the range runs meanwhile.
    pub async fn lock_range(&self, offset: u64, length: u64) -> RangeGuard<'_> {
        self.ranges.lock(offset, length).await
    }

    /// Resync of one peer's out-of-sync regions, in runs of consecutive regions, several
    /// runs in flight, rate-limited.
    /// Only this peer's bitmap is used and cleared.
    pub async fn resync(&self, slot: &PeerSlot, conn: &Arc<PeerConn>) -> Result<(), String> {
        let size = self.local.size();
        // The union of both bitmaps: the target's arrives first.
        conn.wait_peer_bitmap(self.resource.peer_timeout).await?;
        let total = self.meta().out_of_sync_regions(slot.index);
        slot.start_pass(total);
        // However the pass ends (done, failed, or its future dropped), its clock stops, so
        // status shows it ended and not running with an ETA.
        let _pass_clock = PassClock(&slot.resync_clock);
        info!(peer = %slot.config.name, "resync: {} bytes out of sync", total * REGION_SIZE);
        let rate = self.resource.resync_rate;
        let pacer = Pacer::new(rate);
        // In flight at most what the rate sends in 100 ms (at least one run), so a run
        // waiting for its turn to send (behind the others in flight) holds its range lock
        // briefly. (With a floor of a whole run's 16 regions, 16 scattered regions were 16
        // runs queued in the pacer: at 1 MB/s the last held its lock for 0.94 s.)
        let window = (rate / 10 / REGION_SIZE).clamp(1, RESYNC_WINDOW);
        // The data on its way to the target, sized from the link (see `window`).
        let data_window = DataWindow::new(RESYNC_WINDOW * REGION_SIZE);
        let mut sent_bytes = 0u64;
        let mut region = 0;
        // Several runs in flight, so a resync is not one round trip per run.
        let mut in_flight = FuturesUnordered::new();
        let mut regions_in_flight = 0u64;
        // Regions the target wrote (without FUA) whose bits clear after its next flush,
        // and the flushes under way (resync goes on while the target flushes).
        let mut unflushed = Vec::new();
        let mut flushes = FuturesUnordered::new();
        let mut exhausted = false;
        loop {
            // Rate limit on the bytes actually sent (each run's data waits for its turn in
            // the pacer): new runs start only when the pacer has no backlog, while those
            // in flight are still polled (they hold range locks that client writes may be
            // waiting for).
            let due = pacer.free_at();
            let on_schedule = due <= tokio::time::Instant::now();
            // A demotion waits for the range locks to be let go of: no new runs then, and
            // the pass ends once those in flight are done (the demotion drops the links,
            // and a primary resyncs what is left).
            let primary = self.is_primary();
            if !primary && in_flight.is_empty() {
                // Not a lost peer: the demotion's FLUSH still goes to it, then the
                // demotion drops the link, and the pass ends with it. A demotion that
                // failed drops no link: then the pass ends as a lost peer does.
                let _ = tokio::time::timeout(self.resource.peer_timeout, conn.wait_closed()).await;
                return Err("this node stopped being primary".into());
            }
            while primary && on_schedule && !exhausted && regions_in_flight < window {
                let (first, count) = {
                    let meta = self.meta();
                    let Some(first) = meta.next_out_of_sync(slot.index, region) else {
                        exhausted = true;
                        break;
                    };
                    let count = (1..RESYNC_RUN_REGIONS)
                        .take_while(|&i| meta.is_out_of_sync(slot.index, first + i))
                        .count() as u64
                        + 1;
                    (first, count)
                };
                region = first + count;
                regions_in_flight += count;
                in_flight.push(self.resync_run(
                    slot,
                    conn,
                    first,
                    count,
                    size,
                    &pacer,
                    &data_window,
                ));
            }
            if exhausted && in_flight.is_empty() {
                flushes.push(self.resync_flush(slot, conn, std::mem::take(&mut unflushed)));
                while let Some(flushed) = flushes.next().await {
                    flushed?;
                }
                break;
            }
            tokio::select! {
                Some(done) = in_flight.next(), if !in_flight.is_empty() => {
                    let (first, count, sent) = done?;
                    regions_in_flight -= count;
                    // Not primary any more: its bits stay, and the loop ends the pass once
                    // the runs in flight are done.
                    let Some(sent) = sent else { continue };
                    sent_bytes += sent;
                    // Progress (and the rate and ETA shown from it) counts a run when the
                    // peer has it, not at the next barrier: at a low resync rate a barrier
                    // (every 16 MiB) came only every few seconds, and status showed 0 bytes
                    // at 0.0 MB/s until it did (review, session 66).
                    slot.resync_done.fetch_add(count, Ordering::Relaxed);
                    unflushed.extend(first..first + count);
                    if unflushed.len() >= RESYNC_FLUSH_REGIONS {
                        flushes.push(self.resync_flush(slot, conn, std::mem::take(&mut unflushed)));
                    }
                }
                Some(flushed) = flushes.next(), if !flushes.is_empty() => flushed?,
                () = tokio::time::sleep_until(due), if !on_schedule => {}
            }
        }
        {
            let mut meta = self.meta();
            if meta.out_of_sync_bytes_for_any() == 0
                && self.replicating_conns().len() == self.peers.len()
            {
                meta.update(|sb| sb.generations.close_bitmap())
                    .map_err(|e| e.to_string())?;
                meta.flush_bitmap().map_err(|e| e.to_string())?;
            }
            // Under the metadata lock, so a new generation started by a write is either
            // in this message or sent after it.
            let generations = meta.superblock().generations;
            conn.synced.store(true, Ordering::Release);
            conn.send(Message::State {
                role: Role::Primary,
                disk: DiskState::UpToDate,
                generations,
            });
        }
        slot.resync_finished.store(true, Ordering::Release);
        info!(peer = %slot.config.name, "resync done: {sent_bytes} bytes sent, the rest had equal checksums");
        Ok(())
    }

    /// Resyncs the run of `count` regions from `first`: the target compares checksums per
    /// region, and only the regions that differ are sent, in messages that fit the data
    /// window. Returns the run and the data bytes sent, or no bytes if this node stopped
    /// being primary before all of it was sent (then the run's bits stay).
    ///
    /// The comparison holds the range lock only for its local read, not for the round
    /// trip: a client write that starts after the read chose its peers with the target
    /// among them, so where the checksums match, both nodes end with that write over the
    /// same bytes, whichever of them it reached before its checksum was taken (marks that
    /// a lost link leaves keep their bits: [`Metadata::copying`]). The data is read and
    /// sent under the range lock, message by message once the window has room, so a
    /// client write waits for at most one message there. Until session 70 the lock was
    /// held from the read to the last data ack, through the pacer and everything queued
    /// ahead on the link: 7.93 s for a client write over 10 Mbit/s.
    #[allow(clippy::too_many_arguments)]
    async fn resync_run(
        &self,
        slot: &PeerSlot,
        conn: &Arc<PeerConn>,
        first: u64,
        count: u64,
        size: u64,
        pacer: &Pacer,
        window: &DataWindow,
    ) -> Result<(u64, u64, Option<u64>), String> {
        if conn.is_closed() {
            return Err("connection closed".into());
        }
        let offset = first * REGION_SIZE;
        let length = (count * REGION_SIZE).min(size - offset);
        // The checksums are of a read under the range lock: a write still running when
        // this pass began (one that chose its peers without this one, and marked its
        // regions before the pass) is on this disk before the read. Read without the
        // lock, the old bytes matched the target's, the bit was cleared, and the write
        // then landed here only (re-review, session 70). The lock is let go of before
        // the round trip; a mark from here on is newer than anything this run copies.
        let checksums = {
            let _guard = self.lock_range(offset, length).await;
            self.meta().copying(slot.index, offset, length);
            piece_checksums(
                &self.resync_read(offset, length).await?,
                REGION_SIZE as usize,
            )
        };
        let id = self.request_id();
        let reply = conn.request(
            WaitKey::Request(id),
            Message::ResyncChecksum {
                id,
                offset,
                length: length as u32,
                piece: REGION_SIZE as u32,
                checksums,
            },
        );
        let need = match self.await_resync(conn, reply).await? {
            Message::ResyncNeed { need, .. } => need,
            Message::ResyncReply { status, .. } => {
                return Err(format!(
                    "the peer could not compare offset {offset}: {status}"
                ))
            }
            other => return Err(format!("unexpected {} during resync", other.name())),
        };
        // Each stretch of consecutive regions that differ, in messages of at most a
        // quarter window.
        let most = window.message_bytes(REGION_SIZE, RESYNC_RUN_REGIONS * REGION_SIZE);
        let mut sends = FuturesUnordered::new();
        let mut piece = 0;
        while piece < count {
            if need & (1 << piece) == 0 {
                piece += 1;
                continue;
            }
            let start = piece;
            while piece < count && need & (1 << piece) != 0 {
                piece += 1;
            }
            let (from, to) = (start * REGION_SIZE, (piece * REGION_SIZE).min(length));
            let mut at = from;
            while at < to {
                let bytes = most.min(to - at);
                sends.push(self.resync_send(slot, conn, offset + at, bytes, pacer, window));
                at += bytes;
            }
        }
        let mut sent = 0;
        let mut stopped = false;
        while let Some(done) = sends.next().await {
            match done? {
                Some(bytes) => sent += bytes,
                None => stopped = true,
            }
        }
        Ok((first, count, (!stopped).then_some(sent)))
    }

    /// Reads what a resync compares or sends from the local disk.
    async fn resync_read(&self, offset: u64, length: u64) -> Result<Bytes, String> {
        Ok(self
            .local
            .read(offset, length as usize)
            .await
            .map_err(|e| format!("resync read: {e}"))?
            .bytes())
    }

    /// Sends `length` bytes at `offset` to a resync target once the data window has room
    /// and the pacer allows, read and sent under the range lock (released once the target
    /// has them). Returns the bytes sent, or `None` if this node is no longer primary (a
    /// demotion waited for the range locks already, and must not find more data sent
    /// after its flush).
    async fn resync_send(
        &self,
        slot: &PeerSlot,
        conn: &Arc<PeerConn>,
        offset: u64,
        length: u64,
        pacer: &Pacer,
        window: &DataWindow,
    ) -> Result<Option<u64>, String> {
        let mut credit = window.acquire(length).await;
        pacer.wait_to_send(length).await;
        let _guard = self.lock_range(offset, length).await;
        if !self.is_primary() {
            return Ok(None);
        }
        let data = self.resync_read(offset, length).await?;
        let id = self.request_id();
        credit.sending();
        let write = conn.request(
            WaitKey::Request(id),
            Message::ResyncData { id, offset, data },
        );
        slot.resync_sent.fetch_add(length, Ordering::Relaxed);
        match self.await_resync(conn, write).await? {
            Message::ResyncReply {
                status: ResyncStatus::InSync,
                ..
            } => {
                credit.acked();
                Ok(Some(length))
            }
            Message::ResyncReply { status, .. } => {
                conn.note_peer_disk_failure();
                Err(format!(
                    "the peer's disk could not take offset {offset}: {status}"
                ))
            }
            other => Err(format!("unexpected {} during resync", other.name())),
        }
    }

    /// Makes the target's resync writes durable (a barrier: it finishes what it received
    /// and flushes), then clears their bits.
    async fn resync_flush(
        &self,
        slot: &PeerSlot,
        conn: &Arc<PeerConn>,
        regions: Vec<u64>,
    ) -> Result<(), String> {
        if regions.is_empty() {
            return Ok(());
        }
        let epoch = self.next_epoch.fetch_add(1, Ordering::Relaxed);
        let reply = conn.request(WaitKey::Epoch(epoch), Message::Barrier { epoch });
        let timeout = self.resource.peer_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        match conn.answer_within(reply, deadline, timeout).await {
            Ok(Ok(Message::BarrierAck { status: 0, .. })) => {}
            Ok(Ok(other)) => return Err(format!("resync flush failed on the peer: {other:?}")),
            Ok(Err(_)) => return Err("connection closed".into()),
            Err(no_answer) => return Err(format!("resync flush unanswered: {no_answer}")),
        }
        let mut meta = self.meta();
        // Under the metadata lock, as `peer_lost` marks what a lost link missed: once it
        // has, these bits must stay.
        let current = slot.conn.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if !current.is_some_and(|c| Arc::ptr_eq(&c, conn)) {
            return Err("connection closed".into());
        }
        for &region in regions.iter() {
            // A region marked again after it was copied (a write it then missed) stays.
            meta.mark_copied_in_sync(slot.index, region);
        }
        Ok(())
    }

    /// The target's answer to a resync request, within the peer timeout (for as long as
    /// the target shows life: [`PeerConn::answer_within`]).
    async fn await_resync(
        &self,
        conn: &PeerConn,
        reply: oneshot::Receiver<Message>,
    ) -> Result<Message, String> {
        let timeout = self.resource.peer_timeout;
        let deadline = tokio::time::Instant::now() + timeout;
        match conn.answer_within(reply, deadline, timeout).await {
            Ok(Ok(message)) => Ok(message),
            Ok(Err(_)) => Err("connection closed".into()),
            Err(no_answer) => Err(format!("resync reply: {no_answer}")),
        }
    }

    /// Marks the node as stopping after its final flush.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Closes the metadata cleanly (bitmap written, clean flag set). A secondary first
    /// marks the extents of its activity log that hold writes of its primary no barrier
    /// has covered everywhere out of sync with every peer: those writes may have reached
    /// this node and not another. When the link to the primary ends the marking is done too, but not
    /// when this node is stopping, and a primary that vanished (no FIN, no reset) is not
    /// noticed before the stop: a clean close then kept no record of those extents, a
    /// write that reached only this node stayed only here, and two nodes later linked as
    /// in sync while one block differed (review, session 67, three nodes).
    pub fn close(&self) {
        let mut meta = self.meta();
        if !self.is_primary() {
            let marked = meta.mark_unflushed_out_of_sync();
            if marked > 0 {
                info!("{marked} extents of the primary's last writes marked for resync with every node");
            }
        }
        if let Err(e) = meta.set_clean(true) {
            warn!("closing metadata: {e}");
        }
    }

    /// Whether client reads may come from this node's disk: on a secondary, not while
    /// the disk is inconsistent (overwritten region by region in a resync, or its
    /// data lost at a restart), where it served a mix of old bytes and zeroes as data
    /// (re-review, session 70). A primary's reads are its own, forced or not.
    pub fn serves_local_reads(&self) -> bool {
        self.is_primary() || self.local_state().0 != DiskState::Inconsistent
    }

    /// This node's disk state and generations, for hellos and status.
    pub fn local_state(&self) -> (DiskState, super::generation::Generations) {
        let meta = self.meta();
        (meta.superblock().disk, meta.superblock().generations)
    }

    /// This node became `source`'s resync target: its status and metrics show the pass
    /// from here too, as far as a target sees it (review, session 69: a target showed
    /// "0 bytes out of sync" and no pass at all, and `status --watch` there ended at once).
    pub fn begin_pass_as_target(&self, source: &str) {
        if let Some(slot) = self.slot_named(source) {
            slot.start_pass(0);
        }
    }

    /// A resync target compared `regions` with its source and received `bytes` of them.
    pub fn note_resync_received(&self, source: &str, regions: u64, bytes: u64) {
        if let Some(slot) = self.slot_named(source) {
            slot.resync_done.fetch_add(regions, Ordering::Relaxed);
            slot.resync_sent.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    /// The pass from `source` ended: this node is up to date.
    pub fn end_pass_as_target(&self, source: &str) {
        if let Some(slot) = self.slot_named(source) {
            slot.resync_finished.store(true, Ordering::Release);
            PassClock(&slot.resync_clock).stop();
        }
    }

    /// The primary finished resyncing this node: take its generations, up to date.
    pub fn adopt_state_from_primary(&self, generations: super::generation::Generations) {
        let mut meta = self.meta();
        // Equal to the source now: nothing here differs any more. The new generations go
        // to disk before the cleared bits do: a crash between the two then leaves bits
        // set (a resync check too many), where the other order left the old bitmap
        // generation with no bits, and a peer that bitmap was kept for would be taken for
        // in sync with everything it missed.
        let result = meta
            .update(|sb| {
                sb.generations.adopt(&generations);
                sb.disk = DiskState::UpToDate;
            })
            .and_then(|()| {
                meta.mark_all_in_sync();
                meta.flush_bitmap()
            });
        match result {
            Ok(()) => {
                self.data_confirmed.store(true, Ordering::Release);
                info!("in sync with the primary: up to date");
                // A detached disk that took a whole resync holds the data again.
                if self.detached.swap(false, Ordering::AcqRel) {
                    info!("the local disk is attached again");
                    *self.detached_why.lock().unwrap_or_else(|e| e.into_inner()) = None;
                }
            }
            Err(e) => warn!("metadata: {e}"),
        }
        // The other secondaries judge a promotion by what they last heard from this
        // node: tell them, or after a failover one of them could take over with data
        // older than this node's without being refused.
        let generations = meta.superblock().generations;
        drop(meta);
        self.tell_peers_as_secondary(DiskState::UpToDate, generations);
    }

    /// Sends this secondary's disk state and generations to every connected peer.
    fn tell_peers_as_secondary(
        &self,
        disk: DiskState,
        generations: super::generation::Generations,
    ) {
        for slot in &self.peers {
            let conn = slot.conn.lock().unwrap_or_else(|e| e.into_inner()).clone();
            if let Some(conn) = conn {
                conn.send(Message::State {
                    role: Role::Secondary,
                    disk,
                    generations,
                });
            }
        }
    }

    /// The primary started a new data generation while this node's resync pass runs: a
    /// consistent node (a pass of the regions some crash left in doubt, outdated until it
    /// ends: see [`Self::begin_bitmap_pass_as_target`]) takes its name,
    /// durably, before any of its writes are applied here (see
    /// [`super::generation::Generations::take_primary_generation`]), and tells its other
    /// peers, as [`Shared::adopt_state_from_primary`] does. An inconsistent one (a full or
    /// bitmap pass) keeps its old name: it cannot be promoted without force, and a pass
    /// that ends early is planned again from that name (or, at an equal one, in full).
    pub fn take_primary_generation(
        &self,
        generations: &super::generation::Generations,
    ) -> Result<(), MetaError> {
        let mut meta = self.meta();
        let disk = meta.superblock().disk;
        if disk == DiskState::Inconsistent {
            return Ok(());
        }
        meta.update(|sb| sb.generations.take_primary_generation(generations.current))?;
        info!(
            generation = format!("{:#x}", generations.current),
            "the primary started a new data generation; taken in the middle of the resync"
        );
        let generations = meta.superblock().generations;
        drop(meta);
        self.tell_peers_as_secondary(disk, generations);
        Ok(())
    }

    /// Marks this node's data as being overwritten by a resync.
    pub fn begin_resync_target(&self) -> Result<(), MetaError> {
        self.meta().update(|sb| sb.disk = DiskState::Inconsistent)
    }

    /// Records an up-to-date disk as outdated for a pass from a primary of the same
    /// generation: consistent, but its marked regions may be older than the source's
    /// until [`Self::adopt_state_from_primary`] ends the pass. An inconsistent disk stays
    /// inconsistent.
    pub fn begin_bitmap_pass_as_target(&self) -> Result<(), MetaError> {
        let mut meta = self.meta();
        if meta.superblock().disk != DiskState::UpToDate {
            return Ok(());
        }
        meta.update(|sb| sb.disk = DiskState::Outdated)
    }
}

impl Backend for ReplicatedBackend {
    fn size(&self) -> u64 {
        self.shared.local.size()
    }

    fn capabilities(&self) -> Capabilities {
        let mut caps = self.shared.local.capabilities();
        // Clients of a secondary see a read-only export; writes there are refused anyway.
        caps.read_only |= !self.shared.is_primary();
        // FLUSH is a replicated barrier: always offer it.
        caps.flush = true;
        caps.fast_zero = false;
        // A TRIM leaves zeroes on every node (see `trim`): offered only where that costs
        // about what a discard does, not on a device that would write its zeroes by hand.
        caps.trim &= caps.zeroing_trim;
        caps
    }

    /// The local disk's, as the node's status shows it (the export's metric said FLUSH
    /// worked while the node's said it failed; review, session 69), except while the disk
    /// is detached: FLUSH goes to the peers then, and works (re-review).
    fn flush_stopped(&self) -> Option<std::io::Error> {
        if self.shared.is_detached() {
            return None;
        }
        self.shared.local.flush_stopped()
    }

    fn read(&self, offset: u64, length: usize) -> BackendFuture<'_, ReadData> {
        backend_future(async move {
            if !self.shared.serves_local_reads() {
                return Err(BackendError::because(
                    "read",
                    offset,
                    length as u64,
                    NbdError::Io,
                    format_args!(
                        "this secondary's disk is inconsistent (a resync into it is under way, \
                         or it lost its data): read through the primary"
                    ),
                ));
            }
            if self.shared.is_detached() {
                return self.shared.read_detached(offset, length).await;
            }
            match self.shared.local.read(offset, length).await {
                Ok(data) => Ok(data),
                Err(e) if self.shared.is_primary() => {
                    self.shared.heal_read(offset, length, e).await
                }
                Err(e) => Err(e),
            }
        })
    }

    fn read_to_pipe(&self, offset: u64, length: usize) -> Option<crate::backend::splice::Spliced> {
        // Reads are local unless detached; one that cannot be spliced (or fails) takes
        // `read`, which heals a read error from a peer.
        if self.shared.is_detached() || !self.shared.serves_local_reads() {
            return None;
        }
        self.shared.local.read_to_pipe(offset, length)
    }

    fn can_splice(&self) -> bool {
        self.shared.local.can_splice()
    }

    fn all_cached(&self, offset: u64, length: u64) -> bool {
        !self.shared.is_detached()
            && self.shared.serves_local_reads()
            && self.shared.local.all_cached(offset, length)
    }

    fn write(&self, offset: u64, data: WriteData, fua: bool) -> BackendFuture<'_, ()> {
        backend_future(async move {
            let length = data.len() as u64;
            let flags = if fua { write_flags::FUA } else { 0 };
            let local_data = data.clone();
            // What the peers are sent: a pooled payload is wrapped once for all of them.
            let data = data.into_bytes();
            let local = move || self.shared.local.write(offset, local_data, fua);
            self.shared
                .replicate("write", offset, length, local, |seq| Message::Write {
                    seq,
                    offset,
                    flags,
                    data: data.clone(),
                })
                .await
        })
    }

    fn flush(&self) -> BackendFuture<'_, ()> {
        backend_future(self.shared.flush_for_client())
    }

    fn final_flush(&self) -> BackendFuture<'_, ()> {
        backend_future(self.shared.flush_all())
    }

    /// Every node applies a TRIM as [`Backend::trim_to_zeroes`], not as a plain TRIM.
    /// What a discarded range reads back as is the store's choice: a file's hole and a
    /// memory export's released pages read as zeroes, a device's discard may leave old
    /// bytes or others, and leaves the partial blocks at the ends of the range. Nodes on
    /// different stores then held different bytes where a client trimmed, which a failover
    /// showed the client and `netblk verify` reported as damage.
    fn trim(&self, offset: u64, length: u64, fua: bool) -> BackendFuture<'_, ()> {
        let flags = if fua { write_flags::FUA } else { 0 };
        backend_future(self.shared.replicate_in_pieces(
            "trim",
            offset,
            length,
            move |offset, length| self.shared.local.trim_to_zeroes(offset, length, fua),
            move |seq, offset, length| Message::Trim {
                seq,
                offset,
                length,
                flags,
            },
        ))
    }

    fn write_zeroes(&self, offset: u64, length: u64, zero: ZeroFlags) -> BackendFuture<'_, ()> {
        let mut flags = 0;
        if zero.fua {
            flags |= write_flags::FUA;
        }
        if zero.may_trim {
            flags |= write_flags::MAY_TRIM;
        }
        let local_flags = ZeroFlags {
            fast: false,
            ..zero
        };
        backend_future(self.shared.replicate_in_pieces(
            "write_zeroes",
            offset,
            length,
            move |offset, length| self.shared.local.write_zeroes(offset, length, local_flags),
            move |seq, offset, length| Message::Zero {
                seq,
                offset,
                length,
                flags,
            },
        ))
    }

    fn cache(&self, offset: u64, length: u64) -> BackendFuture<'_, ()> {
        if self.shared.is_detached() {
            // Advisory: there is no local cache to fill.
            return backend_future(async { Ok(()) });
        }
        self.shared.local.cache(offset, length)
    }

    fn extents(&self, offset: u64, length: u64) -> BackendFuture<'_, Vec<Extent>> {
        if self.shared.is_detached() {
            // The local map may be wrong now: "allocated data" is always a true answer.
            return backend_future(async move {
                Ok(vec![Extent {
                    length,
                    hole: false,
                    zero: false,
                }])
            });
        }
        self.shared.local.extents(offset, length)
    }
}

/// Runs a short blocking step (a metadata fdatasync) from async code: on a multi-thread
/// runtime the worker hands its other tasks to the rest first; elsewhere it just runs.
fn blocking<T>(step: impl FnOnce() -> T) -> T {
    let multi_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
    if multi_thread {
        tokio::task::block_in_place(step)
    } else {
        step()
    }
}

/// Byte ranges with a write (or a resync step) in flight; an overlapping one waits.
#[derive(Default)]
struct RangeLocks {
    held: Mutex<HashMap<u64, (u64, u64)>>,
    next_id: AtomicU64,
    released: Notify,
}

/// Holds a range until dropped.
pub struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    id: u64,
}

impl RangeLocks {
    async fn lock(&self, offset: u64, length: u64) -> RangeGuard<'_> {
        let end = offset.saturating_add(length);
        loop {
            let released = self.released.notified();
            {
                let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
                if !held.values().any(|&(s, e)| s < end && offset < e) {
                    let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                    held.insert(id, (offset, end));
                    return RangeGuard { locks: self, id };
                }
            }
            released.await;
        }
    }
}

impl RangeLocks {
    /// Waits until no range is held.
    async fn wait_idle(&self) {
        loop {
            let released = self.released.notified();
            if self
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty()
            {
                return;
            }
            released.await;
        }
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        self.locks
            .held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.id);
        self.locks.released.notify_waiters();
    }
}

/// After the `fence_peer` command failed, requests that need it fail at once for this
/// long before it runs again.
const FENCE_RETRY: Duration = Duration::from_secs(1);

/// How much of the end of what the `fence_peer` command prints to stderr is kept.
const FENCE_STDERR_KEPT: usize = 4096;

/// Runs the `fence_peer` command for `peer`: `Ok` on exit 0, else what went wrong, with
/// the end of what it printed to stderr. Its exit decides, not the end of its output: a
/// command that leaves a process running (`cmd &`, an ssh master) may keep its pipes open
/// long after it exited 0, which took its whole 60 s (re-review, session 72). It runs in
/// a process group of its own, all of which is killed at `timeout`; stdout is not read.
async fn run_fence_peer(
    command: &str,
    timeout: Duration,
    resource: &str,
    node: &str,
    peer: &NodeConfig,
) -> Result<(), String> {
    let mut child = tokio::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(command)
        .env("NETBLK_RESOURCE", resource)
        .env("NETBLK_NODE", node)
        .env("NETBLK_PEER", &peer.name)
        .env("NETBLK_PEER_ADDRESS", peer.replication.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("fence_peer could not run: {e}"))?;
    let group = child
        .id()
        .and_then(|id| rustix::process::Pid::from_raw(id as i32));
    // The last FENCE_STDERR_KEPT bytes it printed, read beside the wait.
    let printed = Arc::new(Mutex::new(Vec::new()));
    let reader = child.stderr.take().map(|mut stderr| {
        let printed = Arc::clone(&printed);
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let mut chunk = [0u8; 1024];
            while let Ok(n @ 1..) = stderr.read(&mut chunk).await {
                let mut kept = printed.lock().unwrap_or_else(|e| e.into_inner());
                kept.extend_from_slice(&chunk[..n]);
                let excess = kept.len().saturating_sub(FENCE_STDERR_KEPT);
                kept.drain(..excess);
            }
        })
    });
    let status = match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => Ok(status),
        Ok(Err(e)) => Err(format!("waiting for fence_peer: {e}")),
        Err(_) => {
            if let Some(group) = group {
                let _ = rustix::process::kill_process_group(group, rustix::process::Signal::Kill);
            }
            let _ = child.wait().await;
            Err(format!(
                "fence_peer ran past {} (fence_timeout) and was killed",
                humantime::format_duration(timeout)
            ))
        }
    };
    if let Some(reader) = reader {
        // What it printed before it exited is in the pipe already; a process it left
        // running may hold the pipe open, so this waits only a moment for the end. The
        // reader reads on meanwhile (keeping 4 KiB): stopping it would close the pipe,
        // and that process's next write to stderr would kill it with SIGPIPE (review,
        // session 73).
        let _ = tokio::time::timeout(Duration::from_millis(100), reader).await;
    }
    let status = status?;
    if status.success() {
        return Ok(());
    }
    let printed = printed.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let printed = String::from_utf8_lossy(&printed);
    let printed = printed.trim();
    // The last 200 characters (not bytes: a cut inside a character would panic).
    let skip = printed.chars().count().saturating_sub(200);
    let tail: String = printed.chars().skip(skip).collect();
    // One log line: its lines joined.
    let tail = tail.lines().collect::<Vec<_>>().join(" / ");
    Err(if tail.is_empty() {
        format!("fence_peer {status}")
    } else {
        format!("fence_peer {status}: {tail}")
    })
}

/// The most a single replicated operation spans: a quarter of the activity log, so that a
/// huge TRIM or WRITE_ZEROES (mkfs discards a whole device in one request) is applied as
/// extent-aligned pieces, each of which can enter the log, instead of waiting forever for
/// more log slots than exist.
pub(crate) const MAX_PIECE: u64 = (AL_SLOTS as u64 / 4) * EXTENT_SIZE;

/// Splits `offset..offset+length` into extent-aligned pieces of at most [`MAX_PIECE`].
fn pieces(offset: u64, length: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = offset.saturating_add(length);
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let boundary = (at / MAX_PIECE + 1).saturating_mul(MAX_PIECE);
        let piece = (at, boundary.min(end) - at);
        at = boundary.min(end);
        Some(piece)
    })
}

#[cfg(test)]
mod piece_tests {
    use super::*;

    #[test]
    fn pieces_are_aligned_cover_the_range_and_stay_within_the_log() {
        let cases = [
            (0, 0),
            (0, 1),
            (5, MAX_PIECE),
            (MAX_PIECE - 1, 2),
            (123, 10 * MAX_PIECE + 7),
            (u64::MAX - 10, 10),
        ];
        for (offset, length) in cases {
            let parts: Vec<_> = pieces(offset, length).collect();
            let mut at = offset;
            for &(o, l) in &parts {
                assert_eq!(o, at);
                assert!(l > 0 && l <= MAX_PIECE);
                assert!(Metadata::extents_of(o, l).count() <= AL_SLOTS / 4);
                at += l;
            }
            assert_eq!(at, offset + length, "{offset} {length}");
        }
    }

    /// A send goes at the start of its slot: the first at once, the next when the first's
    /// bytes have had their time at the rate, so sends average the rate without a run
    /// waiting (with its range locked) for its own slot to pass.
    #[tokio::test(start_paused = true)]
    async fn the_pacer_sends_at_the_start_of_each_slot() {
        let pacer = Pacer::new(1 << 20);
        let start = tokio::time::Instant::now();
        pacer.wait_to_send(1 << 20).await;
        assert_eq!(start.elapsed(), Duration::ZERO, "the first send waited");
        pacer.wait_to_send(512 << 10).await;
        assert_eq!(start.elapsed(), Duration::from_secs(1));
        pacer.wait_to_send(1 << 20).await;
        assert_eq!(start.elapsed(), Duration::from_millis(1500));
        assert_eq!(pacer.free_at() - start, Duration::from_millis(2500));
    }
}
