//! Peer connections: dialling and accepting, the hello exchange and its checks, sending
//! through an [`Outbox`] (a sender writes its frame itself when the socket is idle; a
//! writer task sends the rest, batched), and the reader that delivers acks to waiting
//! writes or, on a secondary, applies what the primary sends.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch};
use tracing::{debug, info, warn};

use super::config::Protocol;
use super::generation::{Generations, SyncDecision};
use super::layer::Shared;
use super::outbox::Outbox;
use super::wire::{
    piece_checksums, write_flags, DiskState, Hello, Message, ResyncStatus, Role, PROTOCOL_VERSION,
};
use crate::backend::{backend_future, BackendFuture, ZeroFlags};
use crate::log_limit::{warn_limited, FAILED_REQUESTS};

/// What a reply is waited for under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WaitKey {
    /// The ack of a write, trim or zero.
    Seq(u64),
    /// Protocol B's "received" of a write.
    Received(u64),
    /// The ack of a barrier.
    Epoch(u64),
    /// The reply to a read, resync or checksum request.
    Request(u64),
}

/// What this node does with a peer after the hello exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// This node is primary: replicate to the peer and resync it (`full`: everything).
    Source { full: bool },
    /// The peer is primary: apply what it sends.
    Target,
    /// Both are secondary: stay connected, nothing to replicate.
    Idle,
}

/// One live connection to a peer.
pub struct PeerConn {
    pub peer: String,
    pub plan: Plan,
    /// The peer's generations, from its hello and later state messages.
    peer_generations: Mutex<Generations>,
    /// The peer's metadata was created with a blank backing (its hello).
    pub peer_created_blank: bool,
    /// Replicated writes go to this peer.
    pub replicating: AtomicBool,
    /// The peer finished its resync from this node and has every write since.
    pub synced: AtomicBool,
    outbox: Outbox,
    waiters: Mutex<HashMap<WaitKey, oneshot::Sender<Message>>>,
    /// Writes sent and not yet acknowledged: sequence number → (offset, length, cost in
    /// [`PeerConn::unacked_bytes`]).
    in_flight: Mutex<HashMap<u64, (u64, u64, u64)>>,
    /// What the writes in `in_flight` cost the peer to apply ([`queue_cost`]).
    unacked_bytes: AtomicU64,
    closed: watch::Sender<bool>,
    /// The peer (a resync target) has sent its whole bitmap.
    peer_bitmap_done: watch::Sender<bool>,
    /// On a secondary: barriers received from this primary, by epoch, with the flush
    /// generation their arrival began (see [`Shared::flushed_everywhere`]).
    barriers: Mutex<BTreeMap<u64, u64>>,
    /// When bytes last came from the peer, in nanoseconds since `born`: the sign of life
    /// the waits for its answers go by ([`PeerConn::answer_within`]).
    heard_at: AtomicU64,
    born: tokio::time::Instant,
    /// The peer's disk failed a write or a resync write on this link: the next dial waits
    /// longer ([`dial_loop`]).
    peer_disk_failed: AtomicBool,
    /// Why this end closed the connection, when it knows better than "connection closed"
    /// (the peer's disk failed a write): what the lost link is logged and shown with.
    close_reason: Mutex<Option<String>>,
}

/// How many peer timeouts a request may wait in all for its answer from a peer that keeps
/// sending (answers to other requests, keepalives) but leaves it unanswered: a peer whose
/// disk hangs is dropped after this, as DRBD's `ko-count` drops one.
pub const KO_COUNT: u32 = 10;

/// Why a wait for a peer's answer ended without one.
#[derive(Debug, PartialEq, Eq)]
pub enum NoAnswer {
    /// The peer sent nothing for a whole peer timeout.
    Silent(Duration),
    /// The peer kept sending, but not this answer, for [`KO_COUNT`] peer timeouts.
    TooSlow(Duration),
}

impl std::fmt::Display for NoAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NoAnswer::Silent(timeout) => write!(f, "the peer sent nothing for {timeout:?}"),
            NoAnswer::TooSlow(waited) => write!(f, "still unanswered after {waited:?}"),
        }
    }
}

/// What a replicated change costs a peer to apply, as far as the bound on a protocol A
/// peer's backlog counts it: a write's payload, at least a page; a TRIM or zeroing, which
/// carries no payload but takes the peer a device operation, at least 64 KiB and more as
/// it is longer. (Counted at their payload, trims and zeroings queued without bound: a
/// burst of 256 KiB trims left a FLUSH behind them long enough to drop the peer.)
fn queue_cost(message: &Message) -> u64 {
    match message {
        Message::Write { data, .. } => (data.len() as u64).max(4096),
        // Zeroing may write every byte (a device that cannot zero otherwise): its length.
        Message::Zero { length, .. } => (*length).max(64 << 10),
        // A trim's work grows with its length too, if far more slowly: 1 KiB a MiB.
        Message::Trim { length, .. } => (*length / 1024).max(64 << 10),
        _ => 64 << 10,
    }
}

impl PeerConn {
    fn new(hello: &Hello, plan: Plan) -> Arc<PeerConn> {
        Arc::new(PeerConn {
            peer: hello.node.clone(),
            plan,
            peer_generations: Mutex::new(hello.generations),
            peer_created_blank: hello.created_blank,
            replicating: AtomicBool::new(false),
            synced: AtomicBool::new(false),
            outbox: Outbox::default(),
            waiters: Mutex::new(HashMap::new()),
            in_flight: Mutex::new(HashMap::new()),
            unacked_bytes: AtomicU64::new(0),
            closed: watch::channel(false).0,
            peer_bitmap_done: watch::channel(false).0,
            barriers: Mutex::new(BTreeMap::new()),
            heard_at: AtomicU64::new(0),
            born: tokio::time::Instant::now(),
            peer_disk_failed: AtomicBool::new(false),
            close_reason: Mutex::new(None),
        })
    }

    /// Closes the connection, saying why ([`PeerConn::close_reason`]).
    pub fn close_because(&self, reason: String) {
        self.close_reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert(reason);
        self.close();
    }

    /// Why this end closed the connection, if it said.
    pub fn close_reason(&self) -> Option<String> {
        self.close_reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Notes that bytes came from the peer now.
    fn heard_from(&self) {
        let since = self.born.elapsed().as_nanos() as u64;
        self.heard_at.fetch_max(since, Ordering::Relaxed);
    }

    /// When bytes last came from the peer (the link's start if none has).
    fn last_heard(&self) -> tokio::time::Instant {
        self.born + Duration::from_nanos(self.heard_at.load(Ordering::Relaxed))
    }

    /// Notes that the peer's disk failed a write on this link.
    pub fn note_peer_disk_failure(&self) {
        self.peer_disk_failed.store(true, Ordering::Release);
    }

    /// Whether the peer's disk failed a write on this link.
    pub fn peer_disk_failed(&self) -> bool {
        self.peer_disk_failed.load(Ordering::Acquire)
    }

    /// Waits for `answer` from the peer until `deadline`, and then for as long as the
    /// peer shows life: until a whole peer timeout passes with no bytes from it, or
    /// [`KO_COUNT`] peer timeouts from `deadline - timeout` in all.
    ///
    /// Why not one timeout from the request: over a link slower than what is queued on it,
    /// the answer comes later than a timeout after the request while the peer works
    /// through the queue, answering earlier requests (and sending keepalives while it
    /// receives: [`read_frames`]). Timed from the request, a live peer was dropped as
    /// silent, again and again: 18 times a minute at 10 Mbit/s with 8 MiB queued, and a
    /// resync of 64 MiB restarted 35 times and never ended (review, session 68). Timed
    /// from the last bytes heard, not from this wait's start: the waits for several peers
    /// share one deadline and run one after another, so a later peer's wait can begin
    /// past it (re-review: a second peer was dropped as silent at once).
    pub async fn answer_within<F: std::future::Future + Unpin>(
        &self,
        mut answer: F,
        deadline: tokio::time::Instant,
        timeout: Duration,
    ) -> Result<F::Output, NoAnswer> {
        let started = deadline - timeout;
        let give_up = started + timeout * KO_COUNT;
        let mut deadline = deadline;
        loop {
            if let Ok(answered) = tokio::time::timeout_at(deadline, &mut answer).await {
                return Ok(answered);
            }
            let now = tokio::time::Instant::now();
            let silent_from = self.last_heard().max(started) + timeout;
            if silent_from <= now {
                return Err(NoAnswer::Silent(timeout));
            }
            if now >= give_up {
                return Err(NoAnswer::TooSlow(give_up - started));
            }
            deadline = silent_from.min(give_up);
        }
    }

    /// The peer's generations as last reported.
    pub fn peer_generations(&self) -> Generations {
        *self
            .peer_generations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the peer (a resync target) has sent its whole bitmap: it recorded its disk
    /// as outdated or inconsistent before, so it is not promoted without force until its
    /// pass ends.
    pub fn sent_bitmap(&self) -> bool {
        *self.peer_bitmap_done.borrow()
    }

    /// Waits until the peer has sent its whole bitmap, up to `timeout`.
    pub async fn wait_peer_bitmap(&self, timeout: Duration) -> Result<(), String> {
        let mut done = self.peer_bitmap_done.subscribe();
        let arrived = tokio::time::timeout(timeout, done.wait_for(|d| *d))
            .await
            .is_ok_and(|r| r.is_ok());
        if arrived {
            Ok(())
        } else {
            Err(format!(
                "{} did not send its bitmap within {timeout:?}",
                self.peer
            ))
        }
    }

    /// Sends a message, or queues it behind others being sent (dropped if the
    /// connection is gone; a socket error closes the connection).
    pub fn send(&self, message: Message) {
        if let Err(e) = self.outbox.send(&message) {
            debug!(peer = %self.peer, "send failed: {e}");
            self.close();
        }
    }

    /// Queues a message and returns where its reply arrives. If the connection closes
    /// first, the receiver reports an error.
    pub fn request(&self, key: WaitKey, message: Message) -> oneshot::Receiver<Message> {
        let (tx, rx) = oneshot::channel();
        // Checked under the waiters' lock, which `close` takes after it marks the
        // connection closed: a close between the check and the insert would otherwise
        // miss this waiter, which then waited out the peer timeout (review, session 66).
        let mut waiters = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if !self.is_closed() {
            waiters.insert(key, tx);
            drop(waiters);
            self.send(message);
        }
        rx
    }

    /// Queues a replicated write, remembering its range until the ack.
    pub fn send_write(
        &self,
        seq: u64,
        offset: u64,
        length: u64,
        key: WaitKey,
        message: Message,
    ) -> oneshot::Receiver<Message> {
        let cost = queue_cost(&message);
        self.unacked_bytes.fetch_add(cost, Ordering::AcqRel);
        self.in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(seq, (offset, length, cost));
        self.request(key, message)
    }

    /// What the writes sent to this peer and not yet acknowledged cost it to apply, in
    /// bytes ([`queue_cost`]).
    pub fn unacked_bytes(&self) -> u64 {
        self.unacked_bytes.load(Ordering::Acquire)
    }

    /// The ranges of writes sent and never acknowledged.
    pub fn take_in_flight(&self) -> Vec<(u64, u64)> {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        self.unacked_bytes.store(0, Ordering::Release);
        in_flight
            .drain()
            .map(|(_, (offset, length, _))| (offset, length))
            .collect()
    }

    /// Ends the connection: every waiter gets an error.
    pub fn close(&self) {
        self.closed.send_replace(true);
        self.outbox.close();
        self.waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    pub fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    /// Waits until the connection is closed.
    pub async fn wait_closed(&self) {
        let mut closed = self.closed.subscribe();
        let _ = closed.wait_for(|c| *c).await;
    }

    fn deliver(&self, key: WaitKey, message: Message) {
        // The peer failed to apply a write. Under protocol A or B nobody may be waiting for
        // this answer, so the connection ends here; the write stays in flight, and the
        // peer-lost path marks it (with the hot extents) out of sync.
        let failed_write = match message {
            Message::Ack { status, .. } if status != 0 => Some(status),
            _ => None,
        };
        if let (WaitKey::Seq(seq), None) = (key, failed_write) {
            let acked = self
                .in_flight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&seq);
            if let Some((_, _, cost)) = acked {
                self.unacked_bytes.fetch_sub(cost, Ordering::AcqRel);
            }
        }
        let waiter = self
            .waiters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
        if let Some(waiter) = waiter {
            let _ = waiter.send(message);
        }
        if let Some(status) = failed_write {
            let errno = crate::wire::NbdError::from_errno(status as i32);
            self.note_peer_disk_failure();
            self.close_because(format!("the peer's disk failed a write ({errno})"));
        }
    }
}

/// Accepts peers on `listener` and dials the peers this node dials (those whose names
/// sort after its own), until `stop` turns true.
pub async fn run_replication(
    shared: Arc<Shared>,
    listener: TcpListener,
    stop: watch::Receiver<bool>,
) {
    for index in 0..shared.peers.len() {
        if shared.node < shared.peers[index].config.name {
            tokio::spawn(dial_loop(Arc::clone(&shared), index, stop.clone()));
        }
    }
    let mut stop_accept = stop.clone();
    loop {
        let accepted = tokio::select! {
            _ = stop_accept.wait_for(|s| *s) => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, addr)) => {
                tokio::spawn(run_connection(
                    Arc::clone(&shared),
                    stream,
                    addr,
                    None,
                    stop.clone(),
                ));
            }
            Err(e) => {
                warn!("accepting a peer failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn dial_loop(shared: Arc<Shared>, index: usize, mut stop: watch::Receiver<bool>) {
    let addr = shared.peers[index].config.replication;
    // From this node's own replication address (with its IPv6 scope), which the peer
    // checks; a wildcard address, or one of the other family, leaves the choice to the
    // kernel.
    let from = shared
        .resource
        .node(&shared.node)
        .ok()
        .map(|me| me.replication)
        .filter(|me| !me.ip().is_unspecified() && me.is_ipv4() == addr.is_ipv4());
    let retry = Duration::from_millis(500);
    let peer = &shared.peers[index].config.name;
    // The first failure after a success (or at start) is a warning, the retries debug.
    let mut failing = false;
    // After a link that ended because the peer's disk failed a write, the next dial waits
    // longer, doubling up to RELINK_MOST while that goes on: a peer whose disk was full
    // was relinked, resynced from 0 and lost twice a second for ever, with a warning on
    // each node each time (review, session 68). Only for that reason: timed by how long
    // links lasted, a frozen peer's timed-out hellos and a flapping network's cut links
    // delayed a good relink by up to 10 s (re-review).
    let mut relink = retry;
    let mut redials_now: Vec<tokio::time::Instant> = Vec::new();
    loop {
        if *stop.borrow() {
            return;
        }
        let connecting = shared.tcp.connect(addr, from);
        let mut wait = retry;
        let failed = match tokio::time::timeout(shared.resource.peer_timeout, connecting).await {
            Ok(Ok(stream)) => {
                failing = false;
                let installed =
                    run_connection(Arc::clone(&shared), stream, addr, Some(index), stop.clone())
                        .await;
                let disk_failed = shared.peers[index]
                    .disk_failed
                    .swap(false, Ordering::AcqRel);
                relink = if disk_failed {
                    (relink * 2).min(RELINK_MOST)
                } else {
                    retry
                };
                // A link dropped for a role change (a promotion or demotion here, or a
                // promotion the peer announced) is dialled again at once: the new
                // primary's first writes wait for it (see `Shared::expect_relinks`), for
                // milliseconds rather than the retry interval. Only a link that got past
                // its hello (whose install cleared an earlier announcement), so only a new
                // role change, by an operator or `--primary`, redials at once; and at most
                // ten a second as a bound. Three a second held back half the relinks of
                // the re-reviewer's loop of a switchover every 0.3 s, whose promotes were
                // then refused while the peer's announcement stood.
                let slot = &shared.peers[index];
                let role_change = slot.relink_now.notified().now_or_never().is_some()
                    || slot.announced_primary.load(Ordering::Acquire);
                redials_now.retain(|at| at.elapsed() < Duration::from_secs(1));
                let redial_now = role_change
                    && installed
                    && !disk_failed
                    && redials_now.len() < MOST_REDIALS_NOW;
                wait = if redial_now {
                    redials_now.push(tokio::time::Instant::now());
                    Duration::ZERO
                } else {
                    relink
                };
                if disk_failed {
                    debug!(%peer, "the peer's disk failed a write: next dial in {wait:?}");
                }
                None
            }
            Ok(Err(e)) => Some(format!("connecting to {addr}: {e}")),
            Err(_) => Some(format!("connecting to {addr} timed out")),
        };
        if let Some(why) = failed {
            if failing {
                debug!(%peer, "{why}");
            } else {
                warn!(%peer, "{why}; retrying every {retry:?}");
                failing = true;
            }
        }
        // A role change here (`Shared::relink_all`) cuts the wait short.
        let slot = &shared.peers[index];
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = tokio::time::sleep(wait) => {}
            _ = slot.relink_now.notified() => {}
        }
    }
}

/// The longest wait before dialing a peer again while its disk fails writes.
const RELINK_MOST: Duration = Duration::from_secs(10);

/// Redials at once (after role changes) in any one second, at most.
const MOST_REDIALS_NOW: usize = 10;

fn our_hello(shared: &Shared) -> Hello {
    let (disk, generations) = shared.local_state();
    let created_blank = shared.meta().superblock().created_blank;
    Hello {
        version: PROTOCOL_VERSION,
        resource: shared.resource.name.clone(),
        node: shared.node.clone(),
        size: shared.local.size(),
        generations,
        role: shared.role(),
        disk,
        protocol: shared.resource.protocol,
        created_blank,
    }
}

/// Checks a peer's hello against the resource file and decides what to do with it.
fn check_hello(
    shared: &Shared,
    hello: &Hello,
    expected: Option<usize>,
    addr: SocketAddr,
) -> Result<(usize, Plan, SyncDecision), String> {
    if hello.version != PROTOCOL_VERSION {
        return Err(format!(
            "peer speaks protocol version {}, this node {PROTOCOL_VERSION}",
            hello.version
        ));
    }
    if hello.resource != shared.resource.name {
        return Err(format!(
            "peer {:?} belongs to resource {:?}, not {:?}",
            hello.node, hello.resource, shared.resource.name
        ));
    }
    if hello.protocol != shared.resource.protocol {
        // Under A or B a primary releases a range before its peers apply the write, and
        // relies on them applying writes in order; a secondary configured for C would not.
        return Err(format!(
            "peer {:?} replicates with protocol {:?}, this node with {:?}: the resource \
             files must agree",
            hello.node, hello.protocol, shared.resource.protocol
        ));
    }
    let index = shared
        .peers
        .iter()
        .position(|slot| slot.config.name == hello.node)
        .ok_or_else(|| {
            format!(
                "node {:?} is not a peer of {:?} in the resource file",
                hello.node, shared.node
            )
        })?;
    match expected {
        Some(expected) if expected != index => {
            return Err(format!(
                "dialled {:?} but {:?} answered",
                shared.peers[expected].config.name, hello.node
            ));
        }
        Some(_) => {}
        // Accepted: only a peer with a smaller name dials, and from the address the
        // resource file gives it (not TLS, but a stranger on the network cannot simply
        // claim a node's name and become this secondary's primary).
        None => {
            if hello.node >= shared.node {
                return Err(format!(
                    "{:?} dialled this node, but this node dials {:?}",
                    hello.node, hello.node
                ));
            }
            let configured = shared.peers[index].config.replication.ip();
            if !configured.is_unspecified() && addr.ip().to_canonical() != configured.to_canonical()
            {
                return Err(format!(
                    "a connection from {} says it is {:?}, whose address in the resource file is {configured}",
                    addr.ip(),
                    hello.node
                ));
            }
        }
    }
    if hello.size != shared.local.size() {
        return Err(format!(
            "peer {:?} has a device of {} bytes, this node {}",
            hello.node,
            hello.size,
            shared.local.size()
        ));
    }
    let (_, mine) = shared.local_state();
    let decision = mine.compare(&hello.generations);
    let split = |what: &str| {
        format!(
            "{what} with {:?}: generations {:#x}/{:#x} here, {:#x}/{:#x} there; resolve by hand \
             (recreate the metadata of the node whose changes are to be discarded)",
            hello.node,
            mine.current,
            mine.bitmap,
            hello.generations.current,
            hello.generations.bitmap
        )
    };
    match decision {
        SyncDecision::SplitBrain => return Err(split("split brain")),
        SyncDecision::Unrelated => return Err(split("unrelated data")),
        _ => {}
    }
    let plan = match (shared.role(), hello.role) {
        (Role::Primary, Role::Primary) => {
            return Err(format!("{:?} is primary too", hello.node));
        }
        (Role::Primary, Role::Secondary) if shared.is_detached() => {
            return Err(format!(
                "this primary's disk is detached ({}): it cannot resync {:?}; demote this node \
                 and promote an in-sync peer",
                shared.detached_why().unwrap_or_default(),
                hello.node
            ));
        }
        (Role::Primary, Role::Secondary) => match decision {
            SyncDecision::InSync | SyncDecision::SourceFromBitmap => Plan::Source { full: false },
            SyncDecision::SourceFull => Plan::Source { full: true },
            _ => {
                return Err(format!(
                    "peer {:?} has newer data than this primary ({decision:?}); demote this node",
                    hello.node
                ))
            }
        },
        (Role::Secondary, Role::Primary) => match decision {
            SyncDecision::InSync | SyncDecision::TargetFromBitmap | SyncDecision::TargetFull => {
                Plan::Target
            }
            _ => {
                return Err(format!(
                    "this node has newer data than primary {:?} ({decision:?})",
                    hello.node
                ))
            }
        },
        (Role::Secondary, Role::Secondary) => Plan::Idle,
    };
    Ok((index, plan, decision))
}

/// A hello is small: a stranger may not make this node buffer a 32 MiB frame.
const MAX_HELLO_FRAME: usize = 4096;

/// Reads the peer's first frame (its hello) within `timeout`.
async fn read_hello(
    reader: &mut OwnedReadHalf,
    buf: &mut BytesMut,
    timeout: Duration,
) -> Result<Message, String> {
    loop {
        if let Some(prefix) = buf.get(..super::wire::LENGTH_PREFIX) {
            let length = u32::from_be_bytes(prefix.try_into().expect("4 bytes")) as usize;
            if length > MAX_HELLO_FRAME {
                return Err(format!("first frame of {length} bytes is not a hello"));
            }
        }
        match Message::decode(buf) {
            Ok(Some(message)) => return Ok(message),
            Ok(None) => {}
            Err(e) => return Err(format!("bad frame: {e}")),
        }
        match tokio::time::timeout(timeout, reader.read_buf(buf)).await {
            Err(_) => return Err(format!("silent for {timeout:?}")),
            Ok(Ok(0)) => return Err("connection closed".into()),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(e.to_string()),
        }
    }
}

/// One peer connection from hello to close. Answers whether the link was installed
/// (its hello accepted by both ends).
async fn run_connection(
    shared: Arc<Shared>,
    stream: TcpStream,
    addr: SocketAddr,
    expected: Option<usize>,
    stop: watch::Receiver<bool>,
) -> bool {
    shared.tcp.tune(&stream, &addr.to_string());
    let (mut reader, mut writer) = stream.into_split();
    let timeout = shared.resource.peer_timeout;
    let mut out = BytesMut::new();
    let ours = our_hello(&shared);
    let sent_role = ours.role;
    Message::Hello(ours).encode(&mut out);
    if writer.write_all(&out).await.is_err() {
        return false;
    }
    let mut buf = BytesMut::with_capacity(256 * 1024);
    let hello = match read_hello(&mut reader, &mut buf, timeout).await {
        Ok(Message::Hello(hello)) => hello,
        Ok(Message::Refuse { reason }) => {
            let new = expected.map_or(true, |index| shared.peers[index].note_refusal(&reason));
            if new {
                warn!("peer at {addr} refused this node: {reason}");
            } else {
                debug!("peer at {addr} refused this node again: {reason}");
            }
            return false;
        }
        Ok(other) => {
            warn!("peer at {addr} sent {} before its hello", other.name());
            return false;
        }
        Err(e) => {
            debug!("no hello from {addr}: {e}");
            return false;
        }
    };
    let checked =
        check_hello(&shared, &hello, expected, addr).and_then(|(index, plan, decision)| {
            let conn = PeerConn::new(&hello, plan);
            shared.install(&shared.peers[index], Arc::clone(&conn), plan, sent_role)?;
            Ok((index, conn, decision))
        });
    let (index, conn, decision) = match checked {
        Ok(ok) => ok,
        Err(reason) => {
            let new = shared
                .slot_named(&hello.node)
                .map_or(true, |slot| slot.note_refusal(&reason));
            if new {
                warn!("refusing peer {:?} at {addr}: {reason}", hello.node);
            } else {
                debug!("refusing peer {:?} at {addr} again: {reason}", hello.node);
            }
            let mut out = BytesMut::new();
            Message::Refuse { reason }.encode(&mut out);
            let _ = writer.write_all(&out).await;
            return false;
        }
    };
    let slot = &shared.peers[index];
    info!(peer = %hello.node, %addr, plan = ?conn.plan, "peer connected");
    conn.outbox.attach(writer);
    let writer_task = tokio::spawn(write_frames(Arc::clone(&conn)));
    let pinger = tokio::spawn(ping(Arc::clone(&conn), timeout / 3));
    let resync = match conn.plan {
        Plan::Source { .. } => {
            let (shared, conn) = (Arc::clone(&shared), Arc::clone(&conn));
            Some(tokio::spawn(async move {
                let slot = &shared.peers[index];
                if let Err(e) = shared.resync(slot, &conn).await {
                    shared.peer_lost(slot, &conn, &format!("resync: {e}"));
                }
            }))
        }
        Plan::Target => {
            // Older data is overwritten region by region: unusable alone until the end.
            // Unrecorded, a crash mid-resync would leave a half-overwritten disk that
            // its superblock calls up to date: no resync then.
            // With the same generation this node's data stays consistent meanwhile, but
            // the regions in either bitmap (after a crash, the extents the lost writes may
            // touch) can still be older here than on the source: outdated until the pass
            // ends, so that if the source dies mid-pass this node is not promoted without
            // force and then resyncs its older regions over the newer ones (review,
            // session 67: 3,684 of 4,317 acknowledged writes lost on both nodes).
            let recorded = if decision != SyncDecision::InSync {
                shared.begin_resync_target()
            } else {
                shared.begin_bitmap_pass_as_target()
            };
            if let Err(e) = recorded {
                warn!(peer = %hello.node, "cannot record this disk's state before the resync ({e}): dropping the link");
                conn.close();
            }
            shared.begin_pass_as_target(&hello.node);
            // What this node itself may have different (its logged extents after a crash
            // as primary, for one) must be resynced too; a disk marked inconsistent with
            // the primary's generation (detached after an I/O error) has no record of
            // what it misses, so all of it is.
            let inconsistent = shared.local_state().0 == DiskState::Inconsistent;
            let runs = if inconsistent && decision == SyncDecision::InSync {
                info!(peer = %hello.node, "this node's disk is inconsistent: every region is resynced (by checksum)");
                vec![(0, shared.local.size())]
            } else {
                shared.meta().out_of_sync_runs()
            };
            for (offset, length) in runs {
                conn.send(Message::OutOfSync { offset, length });
            }
            conn.send(Message::OutOfSyncDone);
            None
        }
        Plan::Idle => None,
    };
    // Closed already (the disk could not be marked for the resync): frames that came
    // with the hello must not be applied either.
    let why = if conn.is_closed() {
        "closed before its first frame".to_string()
    } else {
        read_loop(&shared, &conn, &mut reader, buf, stop).await
    };
    shared.peer_lost(slot, &conn, &why);
    pinger.abort();
    if let Some(resync) = resync {
        resync.abort();
    }
    let _ = writer_task.await;
    true
}

/// Sends what the outbox's senders could not write at once, until the connection closes.
async fn write_frames(conn: Arc<PeerConn>) {
    let mut closed = conn.closed.subscribe();
    tokio::select! {
        _ = closed.wait_for(|c| *c) => {}
        result = conn.outbox.run_writer() => {
            if let Err(e) = result {
                debug!(peer = %conn.peer, "send failed: {e}");
            }
            conn.close();
        }
    }
}

async fn ping(conn: Arc<PeerConn>, every: Duration) {
    let mut token = 0;
    loop {
        tokio::time::sleep(every).await;
        token += 1;
        conn.send(Message::Ping { token });
    }
}

/// Reads frames until the connection ends; returns why it ended, once the requests it was
/// applying to the local disk have finished.
///
/// They run to their end even though no answer can be sent: a write dropped half-way
/// would free its range lock while the kernel still holds it, and an overlapping write
/// after the reconnect could then land before it, leaving the older data (as the client
/// pipeline, which drains its requests the same way).
async fn read_loop(
    shared: &Arc<Shared>,
    conn: &Arc<PeerConn>,
    reader: &mut (impl AsyncRead + Unpin),
    buf: BytesMut,
    stop: watch::Receiver<bool>,
) -> String {
    let local = Arc::clone(&shared.local);
    let mut applying: FuturesUnordered<BackendFuture<'_, Message>> = FuturesUnordered::new();
    let why = read_frames(shared, conn, &local, &mut applying, reader, buf, stop).await;
    while applying.next().await.is_some() {}
    why
}

/// [`read_loop`] until the connection ends.
async fn read_frames<'a>(
    shared: &Arc<Shared>,
    conn: &Arc<PeerConn>,
    local: &'a Arc<dyn crate::backend::Backend>,
    applying: &mut FuturesUnordered<BackendFuture<'a, Message>>,
    reader: &mut (impl AsyncRead + Unpin),
    mut buf: BytesMut,
    mut stop: watch::Receiver<bool>,
) -> String {
    let timeout = shared.resource.peer_timeout;
    // While bytes arrive, the peer hears from this node at least this often, even when
    // nothing it sent is answered yet: a keepalive (an unasked `Pong`, which every
    // version ignores), so that its waits know this node is working through what it sent
    // ([`PeerConn::answer_within`]). Pings cannot: they queue behind that data.
    let keepalive_every = timeout / 3;
    let mut last_keepalive = tokio::time::Instant::now();
    let mut closed = conn.closed.subscribe();
    loop {
        loop {
            let message = match Message::decode(&mut buf) {
                Ok(Some(message)) => message,
                Ok(None) => break,
                Err(e) => return format!("bad frame: {e}"),
            };
            if let Err(e) = handle(shared, conn, local, applying, message).await {
                return e;
            }
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return "this node is stopping".into(),
            _ = closed.wait_for(|c| *c) => {
                return conn.close_reason().unwrap_or_else(|| "connection closed".into())
            }
            Some(reply) = applying.next(), if !applying.is_empty() => {
                if let Ok(reply) = reply {
                    conn.send(reply);
                }
            }
            // Back-pressure: a peer cannot queue more work here than MAX_APPLYING requests
            // (each up to 32 MiB); TCP flow control holds the rest on its side.
            read = tokio::time::timeout(timeout, reader.read_buf(&mut buf)), if applying.len() < MAX_APPLYING => match read {
                Err(_) => return format!("silent for {timeout:?}"),
                Ok(Ok(0)) => return "peer closed the connection".into(),
                Ok(Ok(_)) => {
                    conn.heard_from();
                    if last_keepalive.elapsed() >= keepalive_every {
                        last_keepalive = tokio::time::Instant::now();
                        conn.send(Message::Pong { token: 0 });
                    }
                }
                Ok(Err(e)) => return e.to_string(),
            },
        }
    }
}

/// For the `peer` fuzz target: `input` as the byte stream of a connection from this
/// node's first peer, in `plan`, read through the same frame loop as a socket's (replies
/// stay queued: no socket is attached). Answers why the loop ended.
#[doc(hidden)]
pub async fn fuzz_read_loop(shared: &Arc<Shared>, plan: Plan, input: &[u8]) -> String {
    // A connection takes only the peer's name and generations from its hello: the peer
    // holds this node's, as after an InSync hello.
    let hello = Hello {
        node: shared.peers[0].config.name.clone(),
        ..our_hello(shared)
    };
    let conn = PeerConn::new(&hello, plan);
    let (_stop, stop) = watch::channel(false);
    let mut reader = input;
    read_loop(shared, &conn, &mut reader, BytesMut::new(), stop).await
}

/// Requests from one peer being applied or answered at once.
const MAX_APPLYING: usize = 1024;

fn errno_of(result: &Result<(), crate::backend::BackendError>) -> u32 {
    match result {
        Ok(()) => 0,
        Err(e) => e.errno.code(),
    }
}

/// A primary splits trims and zeroing into pieces the activity log can hold at once
/// ([`super::layer::MAX_PIECE`]); a longer one could never enter this node's log, and
/// waiting for room would hold the connection for ever.
fn too_long_for_the_log(what: &str, length: u64) -> Result<(), String> {
    if length > super::layer::MAX_PIECE {
        return Err(format!(
            "a {what} of {length} bytes is longer than a primary sends ({} at most)",
            super::layer::MAX_PIECE
        ));
    }
    Ok(())
}

fn in_range(size: u64, offset: u64, length: u64) -> bool {
    offset.checked_add(length).is_some_and(|end| end <= size)
}

/// Handles one message; an error ends the connection.
async fn handle<'a>(
    shared: &Arc<Shared>,
    conn: &Arc<PeerConn>,
    local: &'a Arc<dyn crate::backend::Backend>,
    applying: &mut FuturesUnordered<BackendFuture<'a, Message>>,
    message: Message,
) -> Result<(), String> {
    let size = local.size();
    // Under protocol C a write reaches the secondary only after every write the client
    // saw completed was acked here, so concurrent writes may be applied in any order.
    // Under A and B the primary does not wait for that: apply in the order sent, or a
    // secondary could hold a later write without an earlier, acknowledged one.
    let in_order = shared.resource.protocol != Protocol::C
        && matches!(
            message,
            Message::Write { .. } | Message::Trim { .. } | Message::Zero { .. }
        );
    let must_be_target = |what: &str| {
        if conn.plan == Plan::Target && !shared.is_primary() {
            Ok(())
        } else {
            Err(format!(
                "{} sent {what} but is not this node's primary",
                conn.peer
            ))
        }
    };
    match message {
        Message::Write {
            seq,
            offset,
            flags,
            data,
        } => {
            must_be_target("a write")?;
            if shared.resource.protocol == Protocol::B {
                conn.send(Message::Received { seq });
            }
            let fits = in_range(size, offset, data.len() as u64);
            let length = data.len() as u64;
            let shared = Arc::clone(shared);
            applying.push(backend_future(async move {
                let result = if fits {
                    apply_logged(&shared, offset, length, || {
                        local.write(offset, data.into(), flags & write_flags::FUA != 0)
                    })
                    .await
                } else {
                    Err(out_of_range("write", offset, 0))
                };
                Ok(Message::Ack {
                    seq,
                    status: errno_of(&result),
                })
            }));
        }
        Message::Trim {
            seq,
            offset,
            length,
            flags,
        } => {
            must_be_target("a trim")?;
            too_long_for_the_log("trim", length)?;
            if shared.resource.protocol == Protocol::B {
                conn.send(Message::Received { seq });
            }
            let fits = in_range(size, offset, length);
            let shared = Arc::clone(shared);
            applying.push(backend_future(async move {
                let result = if fits {
                    apply_logged(&shared, offset, length, || {
                        local.trim_to_zeroes(offset, length, flags & write_flags::FUA != 0)
                    })
                    .await
                } else {
                    Err(out_of_range("trim", offset, length))
                };
                Ok(Message::Ack {
                    seq,
                    status: errno_of(&result),
                })
            }));
        }
        Message::Zero {
            seq,
            offset,
            length,
            flags,
        } => {
            must_be_target("a zero")?;
            too_long_for_the_log("zero", length)?;
            if shared.resource.protocol == Protocol::B {
                conn.send(Message::Received { seq });
            }
            let fits = in_range(size, offset, length);
            let zero = ZeroFlags {
                may_trim: flags & write_flags::MAY_TRIM != 0,
                fast: false,
                fua: flags & write_flags::FUA != 0,
            };
            let shared = Arc::clone(shared);
            applying.push(backend_future(async move {
                let result = if fits {
                    apply_logged(&shared, offset, length, || {
                        local.write_zeroes(offset, length, zero)
                    })
                    .await
                } else {
                    Err(out_of_range("zero", offset, length))
                };
                Ok(Message::Ack {
                    seq,
                    status: errno_of(&result),
                })
            }));
        }
        Message::Barrier { epoch } => {
            must_be_target("a barrier")?;
            let generation = shared.meta().begin_flush();
            conn.barriers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(epoch, generation);
            // The barrier covers every write received before it: those finish, then one
            // flush makes them durable. It runs as one more future, so later writes,
            // pings and acks go on meanwhile (a slow flush does not look like a dead
            // peer), and a later barrier waits for this one.
            let mut before = std::mem::take(applying);
            let conn = Arc::clone(conn);
            applying.push(backend_future(async move {
                while let Some(reply) = before.next().await {
                    if let Ok(reply) = reply {
                        conn.send(reply);
                    }
                }
                let result = local.flush().await;
                Ok(Message::BarrierAck {
                    epoch,
                    status: errno_of(&result),
                })
            }));
        }
        Message::ReadRequest { id, offset, length } => {
            // Only a primary reads from its peers (healing, verify); from anyone else
            // each 25-byte request would pin up to 32 MiB of this node's memory.
            must_be_target("a read request")?;
            let fits = in_range(size, offset, u64::from(length));
            applying.push(backend_future(async move {
                let result = if fits {
                    local.read(offset, length as usize).await
                } else {
                    Err(out_of_range("read", offset, u64::from(length)))
                };
                Ok(match result {
                    Ok(read) => Message::ReadReply {
                        id,
                        status: 0,
                        data: read.bytes(),
                    },
                    Err(e) => Message::ReadReply {
                        id,
                        status: e.errno.code(),
                        data: Bytes::new(),
                    },
                })
            }));
        }
        Message::ResyncChecksum {
            id,
            offset,
            length,
            piece,
            checksums,
        } => {
            must_be_target("a resync checksum")?;
            shared.note_resync_received(&conn.peer, checksums.len() as u64, 0);
            let fits = in_range(size, offset, u64::from(length));
            applying.push(backend_future(async move {
                if !fits {
                    let status = ResyncStatus::Failed(crate::wire::NbdError::Inval.code());
                    return Ok(Message::ResyncReply { id, status });
                }
                let need = match local.read(offset, length as usize).await {
                    Ok(read) => piece_checksums(&read.bytes(), piece as usize)
                        .iter()
                        .zip(&checksums)
                        .enumerate()
                        .filter(|(_, (ours, theirs))| ours != theirs)
                        .fold(0u64, |need, (i, _)| need | 1 << i),
                    // Unreadable blocks are rewritten from the source.
                    Err(_) => u64::MAX >> (64 - checksums.len()),
                };
                Ok(Message::ResyncNeed { id, need })
            }));
        }
        Message::ResyncData { id, offset, data } => {
            must_be_target("resync data")?;
            shared.note_resync_received(&conn.peer, 0, data.len() as u64);
            let fits = in_range(size, offset, data.len() as u64);
            applying.push(backend_future(async move {
                // Made durable by the barrier the source sends before it clears the bit.
                let result = if fits {
                    local.write(offset, data.into(), false).await
                } else {
                    Err(out_of_range("resync", offset, 0))
                };
                let status = match result {
                    Ok(()) => ResyncStatus::InSync,
                    Err(e) => ResyncStatus::Failed(e.errno.code()),
                };
                Ok(Message::ResyncReply { id, status })
            }));
        }
        Message::ChecksumRequest { id, offset, length } => {
            // Only a primary reads from its peers (healing, verify); from anyone else
            // each 25-byte request would pin up to 32 MiB of this node's memory.
            must_be_target("a checksum request")?;
            let fits = in_range(size, offset, u64::from(length));
            applying.push(backend_future(async move {
                let result = if fits {
                    local.read(offset, length as usize).await
                } else {
                    Err(out_of_range("checksum", offset, u64::from(length)))
                };
                Ok(match result {
                    Ok(read) => Message::ChecksumReply {
                        id,
                        status: 0,
                        checksum: super::wire::digest(&read.bytes()),
                    },
                    Err(e) => Message::ChecksumReply {
                        id,
                        status: e.errno.code(),
                        checksum: 0,
                    },
                })
            }));
        }
        Message::State {
            role,
            disk,
            generations,
        } => {
            *conn
                .peer_generations
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = generations;
            if role == Role::Primary && conn.plan != Plan::Target {
                // It was promoted and is about to reconnect as primary.
                if let Some(slot) = shared.slot_named(&conn.peer) {
                    slot.announced_primary.store(true, Ordering::Release);
                }
            }
            if role == Role::Primary && disk == DiskState::UpToDate && conn.plan == Plan::Target {
                // Everything sent before this was applied in order on this connection
                // only if the applies finished: wait for them, then adopt.
                while let Some(reply) = applying.next().await {
                    if let Ok(reply) = reply {
                        conn.send(reply);
                    }
                }
                if let Err(e) = local.flush().await {
                    return Err(format!("flush before adopting the primary's state: {e}"));
                }
                shared.adopt_state_from_primary(generations);
                shared.end_pass_as_target(&conn.peer);
            }
        }
        Message::NewGeneration { generations } => {
            must_be_target("a new generation")?;
            *conn
                .peer_generations
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = generations;
            // Before any later write is applied: they are of the new generation.
            shared
                .take_primary_generation(&generations)
                .map_err(|e| format!("metadata: {e}"))?;
        }
        Message::OutOfSync { offset, length } => {
            if !matches!(conn.plan, Plan::Source { .. }) {
                return Err(format!(
                    "{} sent its bitmap but is not resynced from here",
                    conn.peer
                ));
            }
            let slot = shared
                .slot_named(&conn.peer)
                .expect("a connected peer has a slot");
            shared.meta().mark_out_of_sync(slot.index, offset, length);
        }
        Message::OutOfSyncDone => {
            conn.peer_bitmap_done.send_replace(true);
        }
        Message::BarrierDone { epoch } => {
            must_be_target("a barrier-done")?;
            // Barriers finish in order on every replica: this one's being done
            // everywhere covers every earlier one too.
            let generation = {
                let mut barriers = conn.barriers.lock().unwrap_or_else(|e| e.into_inner());
                // Epochs come from the peer: u64::MAX must not overflow here.
                let later = match epoch.checked_add(1) {
                    Some(next) => barriers.split_off(&next),
                    None => Default::default(),
                };
                let done = std::mem::replace(&mut *barriers, later);
                done.get(&epoch).copied()
            };
            if let Some(generation) = generation {
                shared.flushed_everywhere(generation);
            }
        }
        Message::Ping { token } => conn.send(Message::Pong { token }),
        Message::Pong { .. } => {}
        Message::Ack { seq, .. } => conn.deliver(WaitKey::Seq(seq), message),
        Message::Received { seq } => conn.deliver(WaitKey::Received(seq), message),
        Message::BarrierAck { epoch, .. } => conn.deliver(WaitKey::Epoch(epoch), message),
        Message::ReadReply { id, .. }
        | Message::ResyncReply { id, .. }
        | Message::ResyncNeed { id, .. }
        | Message::ChecksumReply { id, .. } => conn.deliver(WaitKey::Request(id), message),
        Message::Refuse { reason } => return Err(format!("refused by the peer: {reason}")),
        Message::Hello(_) => return Err("a second hello".into()),
    }
    if in_order {
        while let Some(reply) = applying.next().await {
            if let Ok(reply) = reply {
                conn.send(reply);
            }
        }
    }
    Ok(())
}

/// Applies a write, trim or zero from the primary with its extents in this node's
/// activity log (see [`Shared::activate_as_secondary`]).
async fn apply_logged<'a>(
    shared: &Shared,
    offset: u64,
    length: u64,
    apply: impl FnOnce() -> BackendFuture<'a, ()>,
) -> Result<(), crate::backend::BackendError> {
    let result = match shared.activate_as_secondary(offset, length).await {
        Ok(()) => {
            let applied = apply().await;
            shared.release(offset, length);
            applied
        }
        Err(e) => Err(e),
    };
    // The primary learns only the errno (and marks the range for this node); the reason
    // is this node's to log, once, as a failed client request is on the primary.
    if let Err(e) = &result {
        warn_limited!(FAILED_REQUESTS, "applying the primary's {e}");
    }
    result
}

fn out_of_range(op: &'static str, offset: u64, length: u64) -> crate::backend::BackendError {
    crate::backend::BackendError::plain(op, offset, length, crate::wire::NbdError::Inval)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replication::wire::example_messages;

    fn conn() -> Arc<PeerConn> {
        let Some(Message::Hello(hello)) = example_messages().into_iter().next() else {
            panic!("the first example is a hello");
        };
        PeerConn::new(&hello, Plan::Source { full: false })
    }

    /// An answer is waited for while the peer shows life: past the first timeout while
    /// bytes keep coming, not once they stop, and not past [`KO_COUNT`] timeouts.
    #[tokio::test(start_paused = true)]
    async fn an_answer_is_waited_for_while_the_peer_shows_life() {
        use std::time::Duration;
        use tokio::time::{sleep, Instant};
        let timeout = Duration::from_secs(1);
        // Bytes every 400 ms, the answer after 3.5 s: waited for.
        let conn = conn();
        let (tx, rx) = oneshot::channel::<u32>();
        let talker = {
            let conn = Arc::clone(&conn);
            tokio::spawn(async move {
                for _ in 0..9 {
                    sleep(Duration::from_millis(400)).await;
                    conn.heard_from();
                }
                let _ = tx.send(7);
            })
        };
        let start = Instant::now();
        let answered = conn.answer_within(rx, start + timeout, timeout).await;
        assert_eq!(answered.map(|r| r.ok()), Ok(Some(7)));
        talker.await.unwrap();
        // Silent: given up one timeout after the last bytes.
        let (_tx, rx) = oneshot::channel::<u32>();
        let start = Instant::now();
        let talker = {
            let conn = Arc::clone(&conn);
            tokio::spawn(async move {
                sleep(Duration::from_millis(500)).await;
                conn.heard_from();
            })
        };
        let answered = conn.answer_within(rx, start + timeout, timeout).await;
        assert_eq!(answered.unwrap_err(), NoAnswer::Silent(timeout));
        assert_eq!(
            start.elapsed(),
            Duration::from_millis(1500),
            "one timeout after the last bytes"
        );
        talker.await.unwrap();
        // A wait that begins past its deadline (the second of two peers sharing one) goes
        // on while the peer was heard within a timeout.
        let (tx, rx) = oneshot::channel::<u32>();
        conn.heard_from();
        let start = Instant::now();
        let answerer = tokio::spawn(async move {
            sleep(Duration::from_millis(600)).await;
            let _ = tx.send(9);
        });
        let late = start - Duration::from_millis(200);
        let answered = conn.answer_within(rx, late, timeout).await;
        assert_eq!(answered.map(|r| r.ok()), Ok(Some(9)));
        answerer.await.unwrap();
        // Talking, but never answering: given up after KO_COUNT timeouts.
        let (_tx, rx) = oneshot::channel::<u32>();
        let talker = {
            let conn = Arc::clone(&conn);
            tokio::spawn(async move {
                loop {
                    sleep(Duration::from_millis(300)).await;
                    conn.heard_from();
                }
            })
        };
        let start = Instant::now();
        let answered = conn.answer_within(rx, start + timeout, timeout).await;
        assert_eq!(answered.unwrap_err(), NoAnswer::TooSlow(timeout * KO_COUNT));
        assert_eq!(start.elapsed(), timeout * KO_COUNT);
        talker.abort();
    }

    fn write(seq: u64, len: usize) -> Message {
        Message::Write {
            seq,
            offset: seq << 20,
            flags: 0,
            data: Bytes::from(vec![0; len]),
        }
    }

    fn trim(seq: u64, length: u64) -> Message {
        Message::Trim {
            seq,
            offset: 0,
            length,
            flags: 0,
        }
    }

    fn zero(seq: u64, length: u64) -> Message {
        Message::Zero {
            seq,
            offset: 0,
            length,
            flags: 0,
        }
    }

    #[test]
    fn trims_and_zeroing_longer_than_a_primary_sends_end_the_connection() {
        use crate::replication::layer::MAX_PIECE;
        use crate::replication::meta::{AL_SLOTS, EXTENT_SIZE};
        // What a primary sends always fits this node's activity log at once...
        assert!(MAX_PIECE.div_ceil(EXTENT_SIZE) < AL_SLOTS as u64);
        assert!(too_long_for_the_log("trim", MAX_PIECE).is_ok());
        // ...and anything longer is refused instead of waiting for room for ever.
        let e = too_long_for_the_log("trim", 2 << 30).unwrap_err();
        assert!(e.contains("longer than a primary sends"), "{e}");
    }

    #[test]
    fn unacknowledged_writes_are_counted_and_returned_on_loss() {
        let conn = conn();
        let mut waits = Vec::new();
        for seq in 1..=3 {
            waits.push(conn.send_write(
                seq,
                seq << 20,
                1 << 20,
                WaitKey::Seq(seq),
                write(seq, 1 << 20),
            ));
        }
        assert_eq!(conn.unacked_bytes(), 3 << 20);
        // No socket is attached: the frames wait in the outbox, in order.
        let mut sent = conn.outbox.take_queued();
        assert!(matches!(
            Message::decode(&mut sent),
            Ok(Some(Message::Write { seq: 1, .. }))
        ));
        conn.deliver(WaitKey::Seq(2), Message::Ack { seq: 2, status: 0 });
        assert_eq!(conn.unacked_bytes(), 2 << 20);
        assert!(matches!(
            waits[1].try_recv(),
            Ok(Message::Ack { seq: 2, .. })
        ));
        let mut lost = conn.take_in_flight();
        lost.sort();
        assert_eq!(lost, [(1 << 20, 1 << 20), (3 << 20, 1 << 20)]);
        assert_eq!(conn.unacked_bytes(), 0);
        // Closing fails every waiter instead of leaving it hanging.
        conn.close();
        assert_eq!(
            waits[0].try_recv(),
            Err(oneshot::error::TryRecvError::Closed)
        );
        assert!(conn.is_closed());
    }

    /// Trims carry no payload but still count toward a protocol A peer's backlog, and
    /// small writes count a page: a burst of either cannot queue without bound.
    #[test]
    fn trims_and_small_writes_count_toward_the_backlog() {
        let conn = conn();
        let _trim = conn.send_write(1, 0, 256 << 10, WaitKey::Seq(1), trim(1, 256 << 10));
        let _small = conn.send_write(2, 2 << 20, 512, WaitKey::Seq(2), write(2, 512));
        assert_eq!(conn.unacked_bytes(), (64 << 10) + 4096);
        conn.deliver(WaitKey::Seq(1), Message::Ack { seq: 1, status: 0 });
        assert_eq!(conn.unacked_bytes(), 4096);
        // Long ones count more: a zeroing its length, a trim 1 KiB a MiB.
        let _zero = conn.send_write(3, 0, 256 << 20, WaitKey::Seq(3), zero(3, 256 << 20));
        assert_eq!(conn.unacked_bytes(), 4096 + (256 << 20));
        let _trim = conn.send_write(4, 0, 1 << 30, WaitKey::Seq(4), trim(4, 1 << 30));
        assert_eq!(conn.unacked_bytes(), 4096 + (256 << 20) + (1 << 20));
    }
}
