//! In-process tests of two replicating nodes over loopback TCP, with memory backends, so
//! that protocols A/B/C and read healing can be checked without an NBD client.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::config::ResourceConfig;
use super::layer::{ReplicatedBackend, Shared};
use super::meta::Metadata;
use super::peer::run_replication;
use crate::backend::memory::MemoryBackend;
use crate::backend::{
    backend_future, Backend, BackendError, BackendFuture, Capabilities, ReadData, WriteData,
    ZeroFlags,
};
use crate::tcp::TcpSettings;
use crate::wire::NbdError;

const SIZE: u64 = 8 << 20;

/// A memory backend with two faults to switch on: reads of the first 64 KiB fail with
/// EIO until that range is written again (`bad_sector`, like a sector the drive remaps on
/// write), and every write, trim, zeroing and flush fails with EIO (`failing`, a disk
/// that stopped taking data).
struct FaultyDisk {
    inner: MemoryBackend,
    bad_sector: AtomicBool,
    failing: AtomicBool,
    /// Fails only flushes (writes still land).
    failing_flush: AtomicBool,
}

impl FaultyDisk {
    fn new() -> Arc<FaultyDisk> {
        Arc::new(FaultyDisk {
            inner: MemoryBackend::new(SIZE, false),
            bad_sector: AtomicBool::new(false),
            failing: AtomicBool::new(false),
            failing_flush: AtomicBool::new(false),
        })
    }

    /// EIO for `op`, if the disk is failing.
    fn failure(&self, op: &'static str, offset: u64, length: u64) -> Option<BackendFuture<'_, ()>> {
        self.failing.load(Ordering::Acquire).then(|| {
            backend_future(
                async move { Err(BackendError::plain(op, offset, length, NbdError::Io)) },
            )
        })
    }
}

impl Backend for FaultyDisk {
    crate::backend::pass_to_inner!(size, capabilities, cache, extents);
    fn read(&self, offset: u64, length: usize) -> BackendFuture<'_, ReadData> {
        if offset < 65536 && self.bad_sector.load(Ordering::Acquire) {
            return backend_future(async move {
                Err(BackendError::plain(
                    "read",
                    offset,
                    length as u64,
                    NbdError::Io,
                ))
            });
        }
        self.inner.read(offset, length)
    }
    fn write(&self, offset: u64, data: WriteData, fua: bool) -> BackendFuture<'_, ()> {
        if let Some(failed) = self.failure("write", offset, data.len() as u64) {
            return failed;
        }
        if offset == 0 && data.len() >= 65536 {
            self.bad_sector.store(false, Ordering::Release);
        }
        self.inner.write(offset, data, fua)
    }
    fn flush(&self) -> BackendFuture<'_, ()> {
        if self.failing_flush.load(Ordering::Acquire) {
            return backend_future(async { Err(BackendError::plain("flush", 0, 0, NbdError::Io)) });
        }
        self.failure("flush", 0, 0)
            .unwrap_or_else(|| self.inner.flush())
    }
    fn trim(&self, offset: u64, length: u64, fua: bool) -> BackendFuture<'_, ()> {
        self.failure("trim", offset, length)
            .unwrap_or_else(|| self.inner.trim(offset, length, fua))
    }
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BackendFuture<'_, ()> {
        self.failure("write_zeroes", offset, length)
            .unwrap_or_else(|| self.inner.write_zeroes(offset, length, flags))
    }
}

struct Pair {
    primary: Arc<Shared>,
    secondary: Arc<Shared>,
    /// Every secondary (with three nodes, `secondary` is the first of them).
    secondaries: Vec<Arc<Shared>>,
    stop: Stops,
    _dir: tempfile::TempDir,
}

impl Pair {
    /// Whether the primary's and the first secondary's disks hold the same bytes.
    async fn replicas_equal(&self) -> bool {
        same_bytes(
            &*self.primary.local,
            &*self.secondary.local,
            0,
            SIZE as usize,
        )
        .await
    }

    /// The primary's export, as its clients reach it.
    fn primary_backend(&self) -> ReplicatedBackend {
        ReplicatedBackend {
            shared: Arc::clone(&self.primary),
        }
    }
}

/// One stop switch per running node (the primary's first).
struct Stops(Vec<watch::Sender<bool>>);

impl Stops {
    /// Stops every node.
    fn send(&self, stop: bool) -> Result<(), watch::error::SendError<bool>> {
        self.0.iter().try_for_each(|s| s.send(stop))
    }
}

async fn pair(protocol: &str, primary_local: Arc<dyn Backend>) -> Pair {
    cluster(protocol, 2, primary_local, "1G", 2, None).await
}

/// `nodes` nodes (2 or 3) of which the first `running` start; the first is primary with
/// `primary_local` as its backend, the next gets `first_secondary_local` if given.
async fn cluster(
    protocol: &str,
    nodes: usize,
    primary_local: Arc<dyn Backend>,
    resync_rate: &str,
    running: usize,
    first_secondary_local: Option<Arc<dyn Backend>>,
) -> Pair {
    let pair = cluster_started(
        protocol,
        nodes,
        primary_local,
        resync_rate,
        running,
        first_secondary_local,
    )
    .await;
    // Connected, and the first (full, checksum-only) resync done.
    tokio::time::timeout(Duration::from_secs(20), async {
        while pair
            .secondaries
            .iter()
            .any(|s| s.status().disk != "UpToDate")
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the nodes connect and sync");
    pair
}

/// As [`cluster_started`], with `resource_lines` added to the `[resource]` table.
async fn cluster_started_with(
    protocol: &str,
    nodes: usize,
    primary_local: Arc<dyn Backend>,
    resync_rate: &str,
    running: usize,
    first_secondary_local: Option<Arc<dyn Backend>>,
    resource_lines: &str,
) -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let mut listeners = Vec::new();
    for _ in 0..nodes {
        listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let names = &["alpha", "beta", "gamma"][..nodes];
    let mut text =
        format!("[resource]\nname = \"t\"\nprotocol = \"{protocol}\"\npeer_timeout = \"2s\"\nresync_rate = \"{resync_rate}\"\n{resource_lines}\n");
    for (name, listener) in names.iter().zip(&listeners) {
        text.push_str(&format!(
            "[[node]]\nname = \"{name}\"\nreplication = \"{}\"\nlisten = \"unix:{dir}/{name}.sock\"\nbacking = \"memory:8M\"\nmetadata = \"{dir}/{name}.meta\"\n",
            listener.local_addr().unwrap(),
            dir = dir.path().display(),
        ));
    }
    let resource = ResourceConfig::parse(&text, "test").unwrap();
    let open = |name: &str, local: Arc<dyn Backend>| {
        let path = dir.path().join(format!("{name}.meta"));
        let peers: Vec<String> = resource.peers_of(name).map(|n| n.name.clone()).collect();
        let meta = Metadata::open_or_create(&path, name, "t", &peers, SIZE, true).unwrap();
        Shared::new(local, resource.clone(), name, meta, TcpSettings::default()).unwrap()
    };
    let primary = open("alpha", primary_local);
    let mut first_secondary_local = first_secondary_local;
    let secondary_locals = std::iter::repeat_with(|| {
        first_secondary_local
            .take()
            .unwrap_or_else(|| Arc::new(MemoryBackend::new(SIZE, false)))
    });
    let secondaries: Vec<Arc<Shared>> = names[1..running]
        .iter()
        .zip(secondary_locals)
        .map(|(name, local)| open(name, local))
        .collect();
    // The harness picks the first primary before any link is up: forced, as an operator
    // would with `netblk promote --force`.
    primary.promote(true).unwrap();
    let mut stops = Vec::new();
    let all = std::iter::once(&primary).chain(&secondaries);
    for (shared, listener) in all.zip(listeners) {
        let (stop, stop_rx) = watch::channel(false);
        stops.push(stop);
        tokio::spawn(run_replication(Arc::clone(shared), listener, stop_rx));
    }
    Pair {
        primary,
        secondary: Arc::clone(&secondaries[0]),
        secondaries,
        stop: Stops(stops),
        _dir: dir,
    }
}

/// As [`cluster`], returning as soon as every node runs, before the first resync is done.
async fn cluster_started(
    protocol: &str,
    nodes: usize,
    primary_local: Arc<dyn Backend>,
    resync_rate: &str,
    running: usize,
    first_secondary_local: Option<Arc<dyn Backend>>,
) -> Pair {
    cluster_started_with(
        protocol,
        nodes,
        primary_local,
        resync_rate,
        running,
        first_secondary_local,
        "",
    )
    .await
}

fn pattern(seed: u8, len: usize) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect::<Vec<_>>(),
    )
}

/// A memory backend whose writes wait at a gate while it is shut (a disk that hangs),
/// counting the writes that wait and those dropped before they finished (abandoned: on a
/// disk behind io_uring, one the kernel may still be writing).
struct GatedDisk {
    inner: MemoryBackend,
    open: watch::Sender<bool>,
    waiting: AtomicUsize,
    abandoned: Arc<AtomicUsize>,
}

impl GatedDisk {
    fn new() -> Arc<GatedDisk> {
        Arc::new(GatedDisk {
            inner: MemoryBackend::new(SIZE, false),
            open: watch::channel(true).0,
            waiting: AtomicUsize::new(0),
            abandoned: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Waits until a write waits at the shut gate.
    async fn wait_for_a_held_write(&self) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while self.waiting.load(Ordering::Acquire) == 0 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("a write reaches the gated disk");
    }
}

/// Counts its write as abandoned if dropped before [`Unfinished::done`].
struct Unfinished(Option<Arc<AtomicUsize>>);

impl Unfinished {
    fn done(mut self) {
        self.0 = None;
    }
}

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(abandoned) = self.0.take() {
            abandoned.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl Backend for GatedDisk {
    crate::backend::pass_to_inner!(
        size,
        capabilities,
        read,
        flush,
        trim,
        write_zeroes,
        cache,
        extents
    );
    fn write(&self, offset: u64, data: WriteData, fua: bool) -> BackendFuture<'_, ()> {
        let unfinished = Unfinished(Some(Arc::clone(&self.abandoned)));
        let mut open = self.open.subscribe();
        backend_future(async move {
            if !*open.borrow() {
                self.waiting.fetch_add(1, Ordering::AcqRel);
                let _ = open.wait_for(|o| *o).await;
            }
            let result = self.inner.write(offset, data, fua).await;
            unfinished.done();
            result
        })
    }
}

/// A secondary whose link to the primary goes while it is applying a write lets that write
/// finish before it lets the link go: dropped half-way, a write through io_uring would
/// free its range lock while the kernel still held it, and a write after the reconnect
/// could land before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secondary_finishes_the_writes_it_was_applying_when_the_link_goes() {
    let disk = GatedDisk::new();
    let primary_disk = Arc::new(MemoryBackend::new(SIZE, false));
    let secondary_disk = Arc::clone(&disk) as Arc<dyn Backend>;
    // Under protocol C (A and B apply writes one by one, reading nothing meanwhile).
    let pair = cluster("C", 2, primary_disk, "1G", 2, Some(secondary_disk)).await;
    disk.open.send_replace(false);
    let data = pattern(9, 65536);
    let backend = pair.primary_backend();
    let written = data.clone();
    // It waits for the secondary's ack, until the link goes.
    let write = tokio::spawn(async move { backend.write(0, written.into(), false).await });
    disk.wait_for_a_held_write().await;
    pair.primary.drop_connections();
    write.await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        disk.abandoned.load(Ordering::Acquire),
        0,
        "a write was dropped"
    );
    disk.open.send_replace(true);
    tokio::time::timeout(Duration::from_secs(10), async {
        while disk.inner.read(0, 65536).await.unwrap().bytes() != data {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the write lands");
    assert_eq!(disk.abandoned.load(Ordering::Acquire), 0);
}

/// A write waiting for a peer that is lost is acknowledged degraded only if the metadata
/// recorded the loss (new generation, bits): when that update fails, the write fails.
/// Acknowledged, it would be missing on the peer with nothing on disk saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_is_not_acknowledged_degraded_when_the_loss_cannot_be_recorded() {
    let disk = GatedDisk::new();
    let primary_disk = Arc::new(MemoryBackend::new(SIZE, false));
    let secondary_disk = Arc::clone(&disk) as Arc<dyn Backend>;
    let pair = cluster("C", 2, primary_disk, "1G", 2, Some(secondary_disk)).await;
    let backend = pair.primary_backend();
    // The extent enters the activity log, so the next write needs no metadata write.
    backend
        .write(0, pattern(1, 4096).into(), false)
        .await
        .unwrap();
    disk.open.send_replace(false);
    pair.primary.meta().refuse_writes();
    let write = tokio::spawn(async move { backend.write(0, pattern(2, 4096).into(), false).await });
    disk.wait_for_a_held_write().await;
    pair.primary.drop_connections();
    let result = write.await.unwrap();
    let error = result.expect_err("acknowledged without the peer, the loss unrecorded");
    assert_eq!(error.errno, NbdError::Io);
    assert!(error.to_string().contains("could not record"), "{error}");
    disk.open.send_replace(true);
    let _ = pair.stop.send(true);
}

/// A write that chose its peers while the secondary was away, and whose local write is
/// still running when the secondary is back, is on the primary's disk before the resync
/// pass reads for its checksums: read without the range lock, the old bytes matched the
/// secondary's, the bit was cleared, and the write landed on the primary only (re-review,
/// session 70).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_degraded_write_still_running_at_the_reconnect_reaches_the_secondary() {
    let disk = GatedDisk::new();
    let pair = pair("C", Arc::clone(&disk) as Arc<dyn Backend>).await;
    let connected = |pair: &Pair| pair.primary.status().peers[0].connected;
    pair.primary.drop_connections();
    wait_until("the primary sees the link gone", || !connected(&pair)).await;
    disk.open.send_replace(false);
    let backend = pair.primary_backend();
    let data = pattern(7, 65536);
    let written = data.clone();
    let write = tokio::spawn(async move { backend.write(0, written.into(), false).await });
    disk.wait_for_a_held_write().await;
    // The link is redialled within a second; the pass then finds the region marked.
    wait_until("the secondary is back", || connected(&pair)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    disk.open.send_replace(true);
    write.await.unwrap().unwrap();
    wait_until("the pass ends with nothing out of sync", || {
        let status = pair.primary.status();
        let peer = &status.peers[0];
        peer.connected && !peer.resync_running && peer.out_of_sync_bytes == 0
    })
    .await;
    let on_secondary = pair.secondary.local.read(0, 65536).await.unwrap().bytes();
    assert_eq!(
        on_secondary, data,
        "the secondary misses an acknowledged write"
    );
    assert!(pair.replicas_equal().await);
    let _ = pair.stop.send(true);
}

/// After a promotion, writes wait for the peers expected to relink in the new role, but
/// not for ever: a peer lost just before the promotion that does not come back holds the
/// first write at most the grace (2 s, the harness's `peer_timeout`), and it is then
/// written degraded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_does_not_relink_after_a_promotion_holds_writes_only_briefly() {
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    stop_the_secondary(&pair).await;
    pair.primary.demote().await.unwrap();
    assert!(pair.primary.promote(true).unwrap());
    pair.primary.announce_primary_and_reconnect();
    let started = std::time::Instant::now();
    pair.primary_backend()
        .write(0, pattern(3, 4096).into(), false)
        .await
        .unwrap();
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1500) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(pair.primary.status().peers[0].out_of_sync_bytes, 65536);
    let _ = pair.stop.send(true);
}

/// A pair under `protocol` whose primary's disk is a [`FaultyDisk`], and that disk.
async fn pair_on_a_faulty_disk(protocol: &str) -> (Arc<FaultyDisk>, Pair) {
    let disk = FaultyDisk::new();
    let pair = pair(protocol, Arc::clone(&disk) as Arc<dyn Backend>).await;
    (disk, pair)
}

/// Three nodes, all running, the primary on an empty memory disk.
async fn trio(resync_rate: &str) -> Pair {
    cluster(
        "C",
        3,
        Arc::new(MemoryBackend::new(SIZE, false)),
        resync_rate,
        3,
        None,
    )
    .await
}

/// A memory disk of SIZE bytes holding `data` at `offset`, the rest zeroes.
async fn disk_with(data: Bytes, offset: u64) -> Arc<MemoryBackend> {
    let disk = Arc::new(MemoryBackend::new(SIZE, false));
    disk.write(offset, data.into(), false).await.unwrap();
    disk
}

/// Whether two disks hold the same bytes in `offset..offset + length`.
async fn same_bytes(a: &dyn Backend, b: &dyn Backend, offset: u64, length: usize) -> bool {
    let a = a.read(offset, length).await.unwrap().bytes();
    let b = b.read(offset, length).await.unwrap().bytes();
    a == b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_protocol_delivers_writes_trims_and_zeroes_by_the_next_flush() {
    for protocol in ["A", "B", "C"] {
        let pair = pair(protocol, Arc::new(MemoryBackend::new(SIZE, false))).await;
        let backend = pair.primary_backend();
        backend
            .write(0, pattern(1, 1 << 20).into(), false)
            .await
            .unwrap();
        backend
            .write(4096, pattern(2, 512).into(), true)
            .await
            .unwrap();
        backend
            .write(3 << 20, pattern(3, 200_000).into(), false)
            .await
            .unwrap();
        backend
            .write_zeroes(
                100_000,
                50_000,
                ZeroFlags {
                    may_trim: true,
                    ..ZeroFlags::default()
                },
            )
            .await
            .unwrap();
        backend.trim(6 << 20, 1 << 20, false).await.unwrap();
        backend.flush().await.unwrap();
        assert!(
            pair.replicas_equal().await,
            "protocol {protocol}: replicas differ"
        );
        assert_eq!(
            pair.primary.status().out_of_sync_bytes,
            0,
            "protocol {protocol}"
        );
        let _ = pair.stop.send(true);
    }
}

/// A memory disk whose TRIM leaves the data in place, as a device's discard may (the NBD
/// spec lets a trimmed range read back as anything), and which says whether it zeroes by
/// itself or would write zeroes by hand.
struct DiscardKeepsData {
    inner: MemoryBackend,
    zeroing_trim: bool,
}

impl DiscardKeepsData {
    fn new(zeroing_trim: bool) -> Arc<DiscardKeepsData> {
        Arc::new(DiscardKeepsData {
            inner: MemoryBackend::new(SIZE, false),
            zeroing_trim,
        })
    }
}

impl Backend for DiscardKeepsData {
    crate::backend::pass_to_inner!(size, read, write, flush, write_zeroes, cache, extents);
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            zeroing_trim: self.zeroing_trim,
            ..self.inner.capabilities()
        }
    }
    fn trim(&self, _offset: u64, _length: u64, _fua: bool) -> BackendFuture<'_, ()> {
        backend_future(async { Ok(()) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trim_leaves_the_same_zeroes_on_every_node_whatever_each_disk_does_with_a_discard() {
    // The disk that keeps its data on a discard under the secondary, then under the primary.
    for keeper_is_primary in [false, true] {
        let keeper: Arc<dyn Backend> = DiscardKeepsData::new(true);
        let plain: Arc<dyn Backend> = Arc::new(MemoryBackend::new(SIZE, false));
        let (primary_local, secondary_local) = if keeper_is_primary {
            (keeper, plain)
        } else {
            (plain, keeper)
        };
        let pair = cluster("C", 2, primary_local, "1G", 2, Some(secondary_local)).await;
        let backend = pair.primary_backend();
        assert!(
            backend.capabilities().trim,
            "TRIM offered over disks that zero by themselves"
        );
        backend
            .write(0, pattern(7, 1 << 20).into(), false)
            .await
            .unwrap();
        // Unaligned at both ends, so partial blocks are part of it.
        backend.trim(1000, 300_000, false).await.unwrap();
        backend.flush().await.unwrap();
        assert!(
            pair.replicas_equal().await,
            "keeper is primary: {keeper_is_primary}: the nodes differ where the client trimmed"
        );
        let trimmed = pair
            .primary
            .local
            .read(1000, 300_000)
            .await
            .unwrap()
            .bytes();
        assert!(
            trimmed.iter().all(|&b| b == 0),
            "a trimmed range reads back as zeroes"
        );
        let kept = pair
            .primary
            .local
            .read(301_000, 4096)
            .await
            .unwrap()
            .bytes();
        assert_eq!(
            kept,
            pattern(7, 1 << 20).slice(301_000..305_096),
            "past the trim"
        );
        let _ = pair.stop.send(true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trim_is_not_offered_over_a_disk_that_would_write_its_zeroes_by_hand() {
    let pair = pair("C", DiscardKeepsData::new(false)).await;
    let backend = pair.primary_backend();
    let caps = backend.capabilities();
    assert!(
        !caps.trim,
        "a replicated TRIM there would write the whole range"
    );
    assert!(
        caps.write_zeroes,
        "WRITE_ZEROES stays offered: there the client asks for the writes"
    );
    // A client that sends one anyway still gets the same zeroes on both nodes.
    backend
        .write(0, pattern(8, 65536).into(), false)
        .await
        .unwrap();
    backend.trim(4096, 8192, false).await.unwrap();
    backend.flush().await.unwrap();
    assert!(pair.replicas_equal().await);
    let trimmed = pair.secondary.local.read(4096, 8192).await.unwrap().bytes();
    assert!(trimmed.iter().all(|&b| b == 0));
    let _ = pair.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_read_error_is_served_by_the_peer_and_rewritten_locally() {
    let (bad, pair) = pair_on_a_faulty_disk("C").await;
    let backend = pair.primary_backend();
    let data = pattern(9, 65536);
    backend.write(0, data.clone().into(), false).await.unwrap();
    bad.bad_sector.store(true, Ordering::Release);
    assert!(bad.read(0, 4096).await.is_err(), "the fault is in place");
    let read = backend.read(0, 65536).await.unwrap();
    assert_eq!(read.bytes(), data, "served from the peer");
    let local = bad.read(0, 65536).await.expect("rewritten locally");
    assert_eq!(local.bytes(), data);
    let _ = pair.stop.send(true);
}

/// Stops the (first) secondary, as a kill would, and waits until the primary sees the link
/// gone.
async fn stop_the_secondary(pair: &Pair) {
    pair.stop.0[1].send(true).unwrap();
    pair.primary.drop_connections();
    wait_until("the primary sees the link gone", || {
        !pair.primary.status().peers[0].connected
    })
    .await;
}

/// Waits up to 20 s for `done`, polling; panics naming `what` otherwise.
async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    tokio::time::timeout(Duration::from_secs(20), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("timed out waiting until {what}"));
}

/// A primary whose disk fails a write that the in-sync peer applied detaches the disk
/// and goes on serving from the peer (DRBD's `on-io-error detach`): the client's write
/// succeeds, reads return it, the replicas agree. Demoted, with its disk working again
/// and the peer promoted, the node is resynced in full and attaches again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_write_error_the_peer_applied_detaches_the_disk_and_the_peer_serves() {
    let (disk, pair) = pair_on_a_faulty_disk("C").await;
    let backend = pair.primary_backend();
    backend
        .write(0, pattern(1, 65536).into(), false)
        .await
        .unwrap();
    disk.failing.store(true, Ordering::Release);
    backend
        .write(0, pattern(2, 65536).into(), true)
        .await
        .expect("the peer applied the write");
    let status = pair.primary.status();
    assert!(status.detached.is_some(), "{status:?}");
    assert_eq!(status.disk, "Inconsistent", "recorded before the reply");
    assert_eq!(
        backend.read(0, 65536).await.unwrap().bytes(),
        pattern(2, 65536)
    );
    assert_eq!(
        disk.inner.read(0, 65536).await.unwrap().bytes(),
        pattern(1, 65536),
        "the detached disk is not written"
    );
    // Writes, zeroing, trims and flushes go on through the peer alone.
    backend
        .write(1 << 20, pattern(3, 8192).into(), false)
        .await
        .unwrap();
    backend
        .write_zeroes(0, 4096, ZeroFlags::default())
        .await
        .unwrap();
    backend.trim(2 << 20, 1 << 20, false).await.unwrap();
    backend.flush().await.unwrap();
    assert_eq!(
        pair.secondary
            .local
            .read(1 << 20, 8192)
            .await
            .unwrap()
            .bytes(),
        pattern(3, 8192)
    );
    assert_eq!(
        backend.read(0, 8192).await.unwrap().bytes(),
        [&[0u8; 4096][..], &pattern(2, 8192)[4096..]].concat()
    );
    assert!(disk.inner.read(1 << 20, 8192).await.unwrap().bytes() != pattern(3, 8192));
    // Verifying the stale disk against the peer would disconnect the only copy.
    assert!(pair.primary.verify().await.is_err());
    assert!(pair.primary.status().peers[0].replicating);

    // The way back: demote, replace the disk, promote the peer.
    pair.primary.demote().await.unwrap();
    // As `netblk demote` and `netblk promote` do.
    pair.primary.drop_connections();
    wait_until("beta sees alpha as a secondary", || {
        pair.secondary.status().peers[0].link == "idle"
    })
    .await;
    disk.failing.store(false, Ordering::Release);
    pair.secondary.promote(false).unwrap();
    pair.secondary.announce_primary_and_reconnect();
    wait_until("alpha is resynced from beta and up to date", || {
        pair.primary.status().disk == "UpToDate"
    })
    .await;
    assert_eq!(pair.primary.status().detached, None);
    assert!(
        same_bytes(&disk.inner, &*pair.secondary.local, 0, SIZE as usize).await,
        "the resynced disk differs from the new primary's"
    );
    let _ = pair.stop.send(true);
}

/// Without an in-sync peer that applied it, a failed local write fails, and its range is
/// left for the next resync: under protocol B (the peer's ack says only that it received
/// the write) and with no peer connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_write_error_no_peer_applied_fails_and_keeps_the_disk() {
    for (protocol, peer_running) in [("B", true), ("C", false)] {
        let (disk, nodes) = pair_on_a_faulty_disk(protocol).await;
        if !peer_running {
            let _ = nodes.stop.0[1].send(true);
            wait_until("the primary sees its peer go", || {
                nodes.primary.status().peers.iter().all(|p| !p.connected)
            })
            .await;
        }
        let backend = nodes.primary_backend();
        disk.failing.store(true, Ordering::Release);
        assert!(
            backend
                .write(0, pattern(2, 4096).into(), false)
                .await
                .is_err(),
            "protocol {protocol}, peer running: {peer_running}"
        );
        // The peer may hold what the disk did not take: the next resync settles it.
        let status = nodes.primary.status();
        assert_eq!(status.peers[0].out_of_sync_bytes, 65536, "{status:?}");
        assert!(backend.flush().await.is_err());
        let status = nodes.primary.status();
        assert_eq!(status.detached, None);
        assert_eq!(status.disk, "UpToDate");
        // The failed flush marks the whole extent written since the last flush.
        assert_eq!(status.peers[0].out_of_sync_bytes, 4 << 20, "{status:?}");
        let _ = nodes.stop.send(true);
    }
}

/// A failed local flush that does not detach (protocol B: the peer's barrier ack does
/// not say it applied the writes) marks what it should have made durable at once, so
/// status counts it and the next resync settles it; not only after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_local_flush_under_protocol_b_marks_the_unflushed_extents() {
    let (disk, nodes) = pair_on_a_faulty_disk("B").await;
    let backend = nodes.primary_backend();
    backend
        .write(0, pattern(3, 4096).into(), false)
        .await
        .unwrap();
    backend.flush().await.unwrap();
    backend
        .write(SIZE / 2, pattern(4, 4096).into(), false)
        .await
        .unwrap();
    assert_eq!(nodes.primary.status().peers[0].out_of_sync_bytes, 0);
    disk.failing.store(true, Ordering::Release);
    assert!(backend.flush().await.is_err());
    let status = nodes.primary.status();
    assert_eq!(status.detached, None);
    // Only the extent written since the completed flush: 4 MiB.
    assert_eq!(status.peers[0].out_of_sync_bytes, 4 << 20, "{status:?}");
    let _ = nodes.stop.send(true);
}

/// A failed local flush, the peer's barrier done, detaches the disk too: the data is
/// durable on the peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_flush_error_the_peer_covered_detaches_the_disk() {
    let (disk, pair) = pair_on_a_faulty_disk("C").await;
    let backend = pair.primary_backend();
    backend
        .write(0, pattern(4, 4096).into(), false)
        .await
        .unwrap();
    disk.failing.store(true, Ordering::Release);
    backend.flush().await.expect("the peer's barrier covers it");
    assert!(pair.primary.status().detached.is_some());
    assert_eq!(
        backend.read(0, 4096).await.unwrap().bytes(),
        pattern(4, 4096)
    );
    let _ = pair.stop.send(true);
}

/// Once a write of the metadata fails, the primary takes no more writes, not even to an
/// extent already in the log, and `netblk status` says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_metadata_write_stops_writes_and_status_says_so() {
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    let backend = pair.primary_backend();
    backend
        .write(0, pattern(4, 4096).into(), false)
        .await
        .unwrap();
    assert_eq!(pair.primary.status().metadata_stopped, None);
    pair.primary.meta().refuse_writes();
    // The second extent needs a log record, which the kernel refuses.
    let new_extent = backend.write(5 << 20, pattern(5, 4096).into(), false).await;
    assert_eq!(new_extent.unwrap_err().errno, NbdError::Io);
    let logged_extent = backend.write(0, pattern(6, 4096).into(), false).await;
    assert_eq!(logged_extent.unwrap_err().errno, NbdError::Io);
    let status = pair.primary.status();
    let why = status
        .metadata_stopped
        .clone()
        .expect("the status says it stopped");
    assert!(
        why.contains("stopped since writing the activity log failed"),
        "{why}"
    );
    let shown = super::control::render(&status);
    assert!(shown.contains("  writes stopped: metadata "), "{shown}");
    // Reads go on.
    let read = backend.read(0, 4096).await.unwrap();
    assert_eq!(read.bytes(), pattern(4, 4096));
    let _ = pair.stop.send(true);
}

/// `--primary`'s promotion yields to an operator's role command, checked under the
/// metadata lock that the command takes too (re-review, session 67).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_flags_promotion_yields_to_an_operators_command() {
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    let secondary = &pair.secondary;
    secondary.note_role_command();
    assert_eq!(secondary.promote_unless_commanded(), Ok(false));
    assert!(!secondary.is_primary());
    assert!(!secondary.meta().superblock().primary);
    let _ = pair.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secondary_refuses_client_writes_and_exports_read_only() {
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    let secondary = ReplicatedBackend {
        shared: Arc::clone(&pair.secondary),
    };
    assert!(secondary.capabilities().read_only);
    let refused = secondary
        .write(0, pattern(1, 512).into(), false)
        .await
        .unwrap_err();
    assert_eq!(refused.errno, NbdError::Perm);
    let refused = secondary.trim(0, 4096, false).await.unwrap_err();
    assert_eq!(refused.errno, NbdError::Perm);
    let _ = pair.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_all_hold_every_write_and_secondaries_link_idle() {
    let trio = trio("1G").await;
    let backend = trio.primary_backend();
    for i in 0..32u64 {
        let data = pattern(i as u8, 4096 * (1 + i as usize % 5));
        backend
            .write(i * 200_000, data.into(), i % 7 == 0)
            .await
            .unwrap();
    }
    backend.flush().await.unwrap();
    // The secondaries' own link comes up on its own schedule.
    tokio::time::timeout(Duration::from_secs(10), async {
        while trio
            .secondaries
            .iter()
            .any(|s| s.status().peers.iter().any(|p| !p.connected))
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("every pair of nodes connects");
    for secondary in &trio.secondaries {
        assert!(
            same_bytes(&*trio.primary.local, &*secondary.local, 0, SIZE as usize).await,
            "{} differs from the primary",
            secondary.node
        );
        let links: Vec<String> = secondary
            .status()
            .peers
            .iter()
            .map(|p| p.link.clone())
            .collect();
        let mut links = links;
        links.sort();
        assert_eq!(links, ["idle", "target"], "{}", secondary.node);
    }
    let status = trio.primary.status();
    assert!(status.peers.iter().all(|p| p.replicating), "{status:?}");
    let _ = trio.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_full_resync_sends_only_differing_regions_at_the_configured_rate() {
    // 2 MiB of the primary differ from the fresh secondary (all zeroes); at 4 MiB/s the
    // resync of those must take about half a second, and the equal 6 MiB cost no data.
    let local = disk_with(pattern(5, 2 << 20), 1 << 20).await;
    let started = std::time::Instant::now();
    let pair = cluster("C", 2, local, "4M", 2, None).await;
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(450),
        "2 MiB at 4 MiB/s took only {elapsed:?}"
    );
    assert!(
        pair.replicas_equal().await,
        "the full resync left differences"
    );
    let status = pair.primary.status();
    assert_eq!(status.peers[0].resync_total_bytes, SIZE);
    assert_eq!(status.peers[0].resync_sent_bytes, 2 << 20);
    assert!(status.peers[0].resync_finished, "{status:?}");
    // The rate the limit applies to is the sent one (re-review, session 67: status showed
    // only the compare rate, 1,251 MiB/s for a pass limited to 1 MiB/s).
    let sent_rate = status.peers[0].resync_sent_rate_bytes_per_sec;
    assert!(sent_rate > 0 && sent_rate <= 5 << 20, "{status:?}");
    assert!(
        status.peers[0].resync_rate_bytes_per_sec > sent_rate,
        "{status:?}"
    );
    assert_eq!(status.out_of_sync_bytes, 0);
    let _ = pair.stop.send(true);
}

/// A slow pass shows its progress as the peer takes each run, not only at the barriers
/// (every 16 MiB, here none before the end): 4 MiB at 1 MiB/s showed 0 bytes done at 0.0
/// MB/s for the whole pass (review, session 66).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_resync_shows_its_progress_before_its_first_barrier() {
    let local = disk_with(pattern(6, 4 << 20), 0).await;
    let pair = cluster_started("C", 2, local, "1M", 2, None).await;
    wait_until("a quarter of the pass is shown done", || {
        let peer = &pair.primary.status().peers[0];
        peer.resyncing() && peer.resync_done_bytes >= 1 << 20 && peer.resync_rate_bytes_per_sec > 0
    })
    .await;
    let peer = &pair.primary.status().peers[0];
    assert!(
        peer.resync_done_bytes < peer.resync_total_bytes,
        "only at the end: {peer:?}"
    );
    let _ = pair.stop.send(true);
}

/// A secondary's clean close marks the extents of its primary's writes that no barrier
/// covered, for every peer: a write that reached it and not the other secondary (the
/// primary vanished mid-write, and this node stopped before noticing) must be resynced
/// when one of the two is promoted. A clean close kept no record, and the two later
/// linked as in sync with one block different (review, session 67).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secondarys_clean_close_keeps_its_unbarriered_extents_in_doubt() {
    let trio = trio("1G").await;
    let backend = trio.primary_backend();
    // A write a barrier made durable on every node is in no doubt (session 72: every
    // logged extent was marked).
    backend
        .write(1 << 20, pattern(4, 4096).into(), false)
        .await
        .unwrap();
    backend.flush().await.unwrap();
    backend
        .write(5 << 20, pattern(3, 4096).into(), false)
        .await
        .unwrap();
    let beta = &trio.secondaries[0];
    let logged = beta.meta().logged_extents().to_vec();
    assert!(!logged.is_empty(), "no barrier yet: {:?}", beta.status());
    assert_eq!(beta.status().out_of_sync_bytes, 0);
    beta.stop();
    beta.close();
    let status = beta.status();
    assert_eq!(status.out_of_sync_bytes, 4 << 20, "{status:?}");
    assert!(
        status.peers.iter().all(|p| p.out_of_sync_bytes == 4 << 20),
        "{status:?}"
    );
    let _ = trio.stop.send(true);
}

/// A clean demotion flushes on every node, so when the links then drop for the new roles
/// no extent is in doubt: the secondary marked its whole activity log for resync with
/// every node, and the next primary compared up to 1 GiB after every switchover
/// (review, session 71).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_demotion_leaves_no_extent_in_doubt() {
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    let backend = pair.primary_backend();
    for extent in 0..2u64 {
        backend
            .write(extent * (4 << 20), pattern(5, 65536).into(), false)
            .await
            .unwrap();
    }
    assert!(!pair.secondary.meta().logged_extents().is_empty());
    pair.primary.demote().await.unwrap();
    pair.primary.drop_connections();
    wait_until("the link comes back idle", || {
        pair.primary.status().peers[0].link == "idle"
    })
    .await;
    assert_eq!(pair.secondary.status().out_of_sync_bytes, 0);
    assert_eq!(pair.primary.status().out_of_sync_bytes, 0);
    let _ = pair.stop.send(true);
}

/// A primary that loses a peer marks for it the extents written since the last barrier
/// (they may be in the peer's volatile cache), not those a barrier made durable there: a
/// link that dropped for a moment made the next pass compare the whole log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_peer_is_marked_only_for_the_writes_since_the_last_barrier() {
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    let backend = pair.primary_backend();
    backend
        .write(0, pattern(5, 65536).into(), false)
        .await
        .unwrap();
    backend.flush().await.unwrap();
    backend
        .write(6 << 20, pattern(6, 4096).into(), false)
        .await
        .unwrap();
    stop_the_secondary(&pair).await;
    assert_eq!(pair.primary.status().peers[0].out_of_sync_bytes, 4 << 20);
    let _ = pair.stop.send(true);
}

/// A pass that sent every run but whose final flush failed on the target is shown
/// stopped, not done: its bits stay set, and the data may not be on the target's disk
/// (review, session 66: status said "done" from the runs sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_whose_final_flush_failed_is_not_shown_done() {
    let local = disk_with(pattern(6, 1 << 20), 0).await;
    let target_disk = FaultyDisk::new();
    target_disk.failing_flush.store(true, Ordering::Release);
    let pair = cluster_started(
        "C",
        2,
        local,
        "1G",
        2,
        Some(Arc::clone(&target_disk) as Arc<dyn Backend>),
    )
    .await;
    wait_until("a pass sent every run and ended", || {
        let peer = &pair.primary.status().peers[0];
        peer.resync_total_bytes > 0
            && peer.resync_done_bytes >= peer.resync_total_bytes
            && !peer.resync_running
    })
    .await;
    let status = pair.primary.status();
    assert!(status.peers[0].out_of_sync_bytes > 0, "{status:?}");
    assert!(!status.peers[0].resync_finished, "{status:?}");
    let text = super::control::render(&status);
    assert!(
        text.contains(", stopped") && !text.contains(", done"),
        "status text: {text}"
    );
    let _ = pair.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_pass_cut_short_by_a_demotion_is_not_shown_running() {
    // 4 MiB differ and travel at 1 MiB/s; the primary is demoted a moment into the pass,
    // which ends it unfinished, and the link comes back idle (two secondaries). Status
    // must then say the pass stopped, not show it running with an ETA.
    let local = disk_with(pattern(6, 4 << 20), 0).await;
    let pair = cluster_started("C", 2, local, "1M", 2, None).await;
    wait_until("the resync pass is under way", || {
        let status = pair.primary.status();
        status.peers[0].resyncing() && status.peers[0].resync_sent_bytes > 0
    })
    .await;
    pair.primary.demote().await.unwrap();
    pair.primary.drop_connections();
    wait_until("the link comes back idle", || {
        pair.primary.status().peers[0].link == "idle"
    })
    .await;
    let status = pair.primary.status();
    let peer = &status.peers[0];
    assert!(
        peer.resync_done_bytes < peer.resync_total_bytes,
        "the pass was not cut short: {peer:?}"
    );
    assert!(!peer.resyncing(), "an ended pass shown running: {peer:?}");
    assert_eq!(peer.resync_eta_seconds, None);
    let text = super::control::render(&status);
    assert!(
        text.contains(", stopped") && !text.contains("ETA"),
        "status text: {text}"
    );
    let _ = pair.stop.send(true);
}

/// Three nodes. The primary dies, beta is promoted, and gamma's pass from beta (the
/// extents the lost primary's writes may touch, 4 MiB that differ, at 1 MiB/s) runs when
/// beta's first write opens a new generation (alpha is away). Gamma applies that write
/// and what follows, so it must take the new generation's name at once, not at the end of
/// its pass: had it kept the old one, a failover to gamma before the pass ended would
/// meet alpha (at the old generation) as "in sync", and alpha would never get those
/// writes (review, session 66: 144 of 400 acknowledged writes missing on a node shown
/// UpToDate).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_in_its_pass_takes_the_primarys_new_generation_at_once() {
    let trio = trio("1M").await;
    let backend = trio.primary_backend();
    // Not flushed: the primary dies before a barrier covers these writes.
    backend
        .write(0, pattern(7, 4 << 20).into(), false)
        .await
        .unwrap();
    let (beta, gamma) = (&trio.secondaries[0], &trio.secondaries[1]);
    // Beta holds data gamma does not, in every extent the primary wrote.
    beta.local
        .write(0, pattern(9, 4 << 20).into(), false)
        .await
        .unwrap();
    trio.primary.stop();
    let _ = trio.stop.0[0].send(true);
    wait_until("the secondaries notice the primary is gone", || {
        [beta, gamma].iter().all(|s| {
            !s.status()
                .peers
                .iter()
                .any(|p| p.name == "alpha" && p.connected)
        })
    })
    .await;
    beta.promote(false).unwrap();
    beta.announce_primary_and_reconnect();
    wait_until("gamma's pass from beta is under way", || {
        beta.status()
            .peers
            .iter()
            .any(|p| p.name == "gamma" && p.resyncing() && p.replicating && p.resync_sent_bytes > 0)
    })
    .await;
    let (_, before) = beta.local_state();
    let beta_backend = ReplicatedBackend {
        shared: Arc::clone(beta),
    };
    // The write first waits out the relink grace for alpha (lost just before the
    // promotion, so expected back: 2 s here), then opens the generation: timed from its
    // end, not its start, where the grace alone put it at the 2 s bound (session 72).
    beta_backend
        .write(6 << 20, pattern(8, 4096).into(), false)
        .await
        .unwrap();
    let written = std::time::Instant::now();
    beta_backend.flush().await.unwrap();
    let (_, primary) = beta.local_state();
    assert_ne!(
        primary.current, before.current,
        "alpha's absence opens a generation"
    );
    wait_until("gamma takes the new generation", || {
        gamma.local_state().1.current == primary.current
    })
    .await;
    assert!(
        written.elapsed() < Duration::from_secs(1),
        "taken only at the end of the pass, {:?} after the write",
        written.elapsed()
    );
    assert!(
        beta.status()
            .peers
            .iter()
            .any(|p| p.name == "gamma" && p.resyncing()),
        "the pass goes on"
    );
    // A node still at the old generation (alpha) is behind gamma, never equal to it.
    // Gamma is outdated until its pass ends: it may not be promoted without force meanwhile.
    let (disk, taken) = gamma.local_state();
    assert_eq!(disk, super::wire::DiskState::Outdated);
    assert!(gamma.promote(false).is_err(), "promoted in its pass");
    assert_eq!(
        taken.compare(&before),
        super::generation::SyncDecision::SourceFull
    );
    // And the pass still ends with the two equal.
    wait_until("gamma's pass ends", || {
        beta.status()
            .peers
            .iter()
            .any(|p| p.name == "gamma" && p.replicating && p.out_of_sync_bytes == 0)
    })
    .await;
    assert!(
        same_bytes(&*beta.local, &*gamma.local, 0, 8 << 20).await,
        "the pass left differences"
    );
    wait_until("gamma is up to date at the end of its pass", || {
        gamma.local_state().0 == super::wire::DiskState::UpToDate
    })
    .await;
    let _ = trio.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_run_sends_only_its_regions_that_differ() {
    // Both nodes start from the same data; the primary differs in scattered regions,
    // some inside one run of consecutive regions, one by a single sector, one at the
    // device's end. Only those regions may travel, and the copies must end up equal.
    const REGION: u64 = 64 << 10;
    let base = pattern(9, SIZE as usize);
    let primary = Arc::new(MemoryBackend::new(SIZE, false));
    let secondary = Arc::new(MemoryBackend::new(SIZE, false));
    primary.write(0, base.clone().into(), false).await.unwrap();
    secondary.write(0, base.into(), false).await.unwrap();
    let differing = [1u64, 3, 4, 5, 7, 40, SIZE / REGION - 1];
    for &region in &differing {
        // Region 7 differs in one sector only.
        let length = if region == 7 { 512 } else { REGION as usize };
        let data = pattern(region as u8 + 100, length);
        primary
            .write(region * REGION, data.into(), false)
            .await
            .unwrap();
    }
    let pair = cluster("C", 2, primary, "100G", 2, Some(secondary)).await;
    assert!(pair.replicas_equal().await, "the resync left differences");
    let status = pair.primary.status();
    assert_eq!(status.peers[0].resync_total_bytes, SIZE);
    assert_eq!(
        status.peers[0].resync_sent_bytes,
        differing.len() as u64 * REGION,
        "only the differing regions are sent"
    );
    let _ = pair.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connected_peer_takes_the_new_generation_when_another_is_away() {
    // Three nodes, gamma never starts: the first write opens a new generation, which beta
    // (connected, in sync) must share, or a failover to beta would later look like a
    // split brain to alpha.
    let pair = cluster(
        "C",
        3,
        Arc::new(MemoryBackend::new(SIZE, false)),
        "1G",
        2,
        None,
    )
    .await;
    let before = pair.primary.status().generation;
    let backend = pair.primary_backend();
    backend
        .write(0, pattern(4, 4096).into(), false)
        .await
        .unwrap();
    backend.flush().await.unwrap();
    let after = pair.primary.status();
    assert_ne!(
        after.generation, before,
        "a new generation for gamma's absence"
    );
    // Per-peer bitmaps: gamma misses the one region written, beta (resynced) nothing.
    assert_eq!(after.out_of_sync_bytes, 65536);
    let missed: Vec<(String, u64)> = after
        .peers
        .iter()
        .map(|p| (p.name.clone(), p.out_of_sync_bytes))
        .collect();
    assert_eq!(
        missed,
        [("beta".to_string(), 0), ("gamma".to_string(), 65536)]
    );
    tokio::time::timeout(Duration::from_secs(5), async {
        while pair.secondary.status().generation != after.generation {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("beta takes the new generation");
    let (_, beta) = pair.secondary.local_state();
    let (_, alpha) = pair.primary.local_state();
    assert_eq!(
        beta.compare(&alpha),
        super::generation::SyncDecision::InSync
    );
    let _ = pair.stop.send(true);
}

/// Three nodes: gamma is away (a bitmap generation is open) when beta, in sync, is lost
/// too. Alpha's writes after that must not share beta's generation: were beta then
/// promoted and written, the two would meet as a split brain, not as "alpha behind
/// beta's bitmap", whose resync would overwrite what alpha acknowledged alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_second_peer_starts_a_new_generation_so_a_later_split_brain_shows() {
    use super::generation::SyncDecision;
    let nodes = cluster(
        "C",
        3,
        Arc::new(MemoryBackend::new(SIZE, false)),
        "1G",
        2,
        None,
    )
    .await;
    let backend = nodes.primary_backend();
    backend
        .write(0, pattern(1, 4096).into(), false)
        .await
        .unwrap();
    let shared = nodes.primary.status().generation;
    wait_until("beta takes the generation of gamma's absence", || {
        nodes.secondary.status().generation == shared
    })
    .await;
    let _ = nodes.stop.0[1].send(true);
    wait_until("alpha sees beta go", || {
        nodes.primary.status().peers.iter().all(|p| !p.connected)
    })
    .await;
    backend
        .write(SIZE / 2, pattern(2, 4096).into(), false)
        .await
        .unwrap();
    backend.flush().await.unwrap();
    let (_, alpha) = nodes.primary.local_state();
    let (_, beta) = nodes.secondary.local_state();
    assert_ne!(alpha.current, beta.current, "alpha wrote alone: {alpha:?}");
    // Beta returning as it is: behind alpha (a full, checksum-only resync from alpha).
    assert_eq!(alpha.compare(&beta), SyncDecision::SourceFull);
    assert_eq!(beta.compare(&alpha), SyncDecision::TargetFull);
    // Beta promoted and written meanwhile: a split brain from both sides.
    let mut promoted_beta = beta;
    promoted_beta.start_new(super::generation::random_generation().unwrap());
    assert_eq!(alpha.compare(&promoted_beta), SyncDecision::SplitBrain);
    assert_eq!(promoted_beta.compare(&alpha), SyncDecision::SplitBrain);
    // Gamma, away since the first new generation, is still behind alpha's bitmap.
    let gamma_then = super::generation::Generations {
        current: alpha.bitmap,
        ..Default::default()
    };
    assert_eq!(alpha.compare(&gamma_then), SyncDecision::SourceFromBitmap);
    let _ = nodes.stop.send(true);
}

/// Verify finds a region that differs (bytes changed behind the replication's back),
/// names it, and the resync it starts makes the replicas equal again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_finds_a_region_that_differs_and_the_resync_repairs_it() {
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    let backend = pair.primary_backend();
    backend
        .write(0, pattern(1, 1 << 20).into(), false)
        .await
        .unwrap();
    backend.flush().await.unwrap();
    let said = pair.primary.verify().await.unwrap();
    assert!(
        said.starts_with("verify done: 0 regions differed"),
        "{said}"
    );
    // One byte changed on beta's disk, bypassing replication.
    pair.secondary
        .local
        .write(3 * 65536 + 7, Bytes::from_static(b"!").into(), false)
        .await
        .unwrap();
    assert!(!pair.replicas_equal().await);
    let said = pair.primary.verify().await.unwrap();
    assert!(
        said.starts_with("verify done: 1 regions differed (compared with beta)"),
        "{said}"
    );
    wait_until("the resync repairs beta", || {
        let beta = &pair.primary.status().peers[0];
        beta.connected && beta.out_of_sync_bytes == 0
    })
    .await;
    tokio::time::timeout(Duration::from_secs(10), async {
        while !pair.replicas_equal().await {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the replicas are equal again");
    let _ = pair.stop.send(true);
}

/// Promoting beta drops its links so they reconnect in the new role; in that gap alpha
/// sees no peer at all. Beta's announcement must still keep alpha from being promoted
/// too (two primaries, each taking writes), until beta says hello again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promote_in_the_reconnect_gap_after_a_peers_promote_is_refused() {
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    let (alpha, beta) = (&pair.primary, &pair.secondary);
    // Promoting a primary changes nothing, so nothing is announced (on a link where the
    // peer is a resync target, a primary's state would end its resync).
    assert_eq!(alpha.promote(false), Ok(false));
    demote_alpha_and_promote_beta(&pair).await;
    // Alpha dials, and would dial again at once after an announced promotion: its next
    // dial is held back a second, as after a peer's disk failed, so the gap shows.
    alpha.peers[0].disk_failed.store(true, Ordering::Release);
    beta.announce_primary_and_reconnect();
    wait_until("alpha sees the link go", || {
        !alpha.status().peers[0].connected
    })
    .await;
    let refused = alpha.promote(false).expect_err("two primaries");
    assert!(refused.contains("announced it became primary"), "{refused}");
    assert!(!alpha.is_primary());
    // Once beta is back as primary, even force is refused.
    wait_until("beta reconnects as primary", || {
        alpha.status().peers[0].link == "target"
    })
    .await;
    let refused = alpha.promote(true).expect_err("two primaries");
    assert!(refused.contains("demote it first"), "{refused}");
    let _ = pair.stop.send(true);
}

#[tokio::test(flavor = "current_thread")]
async fn the_layer_also_runs_on_a_current_thread_runtime() {
    // Metadata updates must not rely on block_in_place, which panics here.
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    let backend = pair.primary_backend();
    backend
        .write(5 << 20, pattern(6, 8192).into(), true)
        .await
        .unwrap();
    backend.flush().await.unwrap();
    let theirs = pair
        .secondary
        .local
        .read(5 << 20, 8192)
        .await
        .unwrap()
        .bytes();
    assert_eq!(theirs, pattern(6, 8192));
    let _ = pair.stop.send(true);
}

/// A memory backend that records the order in which writes complete, and makes a write
/// at offset 0 slow.
struct OrderRecorder {
    inner: MemoryBackend,
    completed: std::sync::Mutex<Vec<u64>>,
}

impl Backend for OrderRecorder {
    crate::backend::pass_to_inner!(
        size,
        capabilities,
        read,
        flush,
        trim,
        write_zeroes,
        cache,
        extents
    );
    fn write(&self, offset: u64, data: WriteData, fua: bool) -> BackendFuture<'_, ()> {
        backend_future(async move {
            if offset == 0 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            let result = self.inner.write(offset, data, fua).await;
            self.completed.lock().unwrap().push(offset);
            result
        })
    }
}

#[tokio::test(flavor = "current_thread")]
async fn under_protocol_a_a_secondary_applies_writes_in_the_order_sent() {
    // The primary acknowledges the first write at once (protocol A), so the client may
    // issue the second before the secondary applied the first: the secondary must still
    // apply them in that order, even though the first is slow there.
    let recorder = Arc::new(OrderRecorder {
        inner: MemoryBackend::new(SIZE, false),
        completed: std::sync::Mutex::new(Vec::new()),
    });
    let pair = cluster(
        "A",
        2,
        Arc::new(MemoryBackend::new(SIZE, false)),
        "1G",
        2,
        Some(Arc::clone(&recorder) as Arc<dyn Backend>),
    )
    .await;
    let backend = pair.primary_backend();
    recorder.completed.lock().unwrap().clear();
    backend
        .write(0, pattern(1, 4096).into(), false)
        .await
        .unwrap();
    backend
        .write(1 << 20, pattern(2, 4096).into(), false)
        .await
        .unwrap();
    backend.flush().await.unwrap();
    assert_eq!(*recorder.completed.lock().unwrap(), [0, 1 << 20]);
    let _ = pair.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_a_write_only_one_secondary_got_is_resynced_to_the_other() {
    // Three nodes. The primary dies with a write in flight that reached beta and not
    // gamma (made here by writing to beta's disk behind the protocol's back). Beta is
    // promoted; its activity log, marked when the primary was lost, must bring gamma to
    // beta's data, or the two replicas would silently differ in that block.
    let trio = trio("1G").await;
    let backend = trio.primary_backend();
    let offset = 3 << 20;
    // No flush after it: a barrier done on every node would make the write durable
    // everywhere, and its extent would leave the secondaries' doubt.
    backend
        .write(offset, pattern(1, 65536).into(), false)
        .await
        .unwrap();
    let (beta, gamma) = (&trio.secondaries[0], &trio.secondaries[1]);
    beta.local
        .write(offset + 4096, pattern(2, 4096).into(), false)
        .await
        .unwrap();
    // The primary dies: it changes nothing on the way down (as after SIGKILL), and both
    // secondaries see it go.
    trio.primary.stop();
    let _ = trio.stop.0[0].send(true);
    tokio::time::timeout(Duration::from_secs(10), async {
        while [beta, gamma].iter().any(|s| {
            s.status()
                .peers
                .iter()
                .any(|p| p.name == "alpha" && p.connected)
        }) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the secondaries notice the primary is gone");
    beta.promote(false).unwrap();
    // As `netblk promote` does: the peers reconnect, and gamma finds beta primary.
    beta.announce_primary_and_reconnect();
    tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let status = beta.status();
            let gamma_synced = status
                .peers
                .iter()
                .any(|p| p.name == "gamma" && p.replicating && p.out_of_sync_bytes == 0);
            if gamma_synced && gamma.status().disk == "UpToDate" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "gamma is not resynced from beta: beta {:?}, gamma {:?}",
            beta.status(),
            gamma.status()
        )
    });
    assert!(
        same_bytes(&*beta.local, &*gamma.local, offset, 65536).await,
        "gamma differs from beta where only beta had the write"
    );
    let _ = trio.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secondary_tells_the_other_secondaries_the_generation_it_takes() {
    // Gamma must not judge a promotion by an old hello from beta: when beta takes a new
    // generation from the primary, gamma hears of it on their idle link.
    let trio = trio("1G").await;
    let (beta, gamma) = (&trio.secondaries[0], &trio.secondaries[1]);
    let (_, mut newer) = beta.local_state();
    newer.start_new(0x1234_5678_9abc_def0);
    beta.adopt_state_from_primary(newer);
    let (_, adopted) = beta.local_state();
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let view = gamma
                .slot_named("beta")
                .and_then(|slot| slot.conn.lock().unwrap().clone())
                .map(|conn| conn.peer_generations());
            if view == Some(adopted) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("gamma's view of beta follows beta's generation");
    let _ = trio.stop.send(true);
}

/// A secondary that took the primary's state after a resync records the new generations
/// before it clears its bitmaps: if the first cannot be written (a crash between the two
/// does the same), the bits stay, where the other order left the old bitmap generation
/// with no bits and a peer it was kept for seemingly in sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secondary_keeps_its_bits_until_it_has_recorded_the_primarys_state() {
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    let (_, generations) = pair.primary.local_state();
    {
        let mut meta = pair.secondary.meta();
        meta.mark_out_of_sync(0, 1 << 20, 65536);
        meta.refuse_writes();
    }
    pair.secondary.adopt_state_from_primary(generations);
    assert_eq!(pair.secondary.meta().out_of_sync_bytes(0), 65536);
    let _ = pair.stop.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_lost_while_a_demotion_drains_its_writes_misses_them_in_the_bitmap() {
    // Demote stops taking writes at once but waits for those in flight. If the peer is
    // lost meanwhile, the write still in flight to it is acknowledged degraded, so its
    // region must be in the peer's bitmap although this node is no longer primary.
    // Beta's disk: its writes wait at a gate that stays shut (a disk that hangs).
    let stall = GatedDisk::new();
    let pair = cluster(
        "C",
        2,
        Arc::new(MemoryBackend::new(SIZE, false)),
        "1G",
        2,
        Some(Arc::clone(&stall) as Arc<dyn Backend>),
    )
    .await;
    stall.open.send_replace(false);
    let primary = Arc::clone(&pair.primary);
    let write = tokio::spawn(async move {
        let backend = ReplicatedBackend { shared: primary };
        backend.write(5 << 20, pattern(3, 4096).into(), false).await
    });
    let conn = pair
        .primary
        .slot_named("beta")
        .and_then(|slot| slot.conn.lock().unwrap().clone())
        .expect("beta is connected");
    tokio::time::timeout(Duration::from_secs(5), async {
        while conn.unacked_bytes() == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the write is in flight to beta");
    let primary = Arc::clone(&pair.primary);
    let demote = tokio::spawn(async move { primary.demote().await });
    while pair.primary.is_primary() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Beta goes away while the demotion waits for the write.
    let _ = pair.stop.0[1].send(true);
    write.await.unwrap().expect("acknowledged degraded");
    demote.await.unwrap().expect("the demotion finishes");
    let missed = pair
        .primary
        .status()
        .peers
        .iter()
        .find(|p| p.name == "beta")
        .map(|p| p.out_of_sync_bytes)
        .unwrap();
    assert!(
        missed >= 65536,
        "the write beta never applied is not in its bitmap"
    );
    let _ = pair.stop.send(true);
}

/// Lesson 2 of the field's write-ups: a link that carries data one way and acks the
/// other must never leave a message waiting on a TCP timer (a delayed ACK is ~40 ms), or
/// 3,000 transactions a second become 30. Writes one at a time over real loopback TCP,
/// each waiting for the peer's ack (protocol C): sizes that fit one segment and sizes
/// that end in a small one (Nagle holds such a tail until the previous segment is
/// acknowledged), FUA writes and flushes among them. A stall on every transaction puts
/// the median at 40 ms; here it must stay a few milliseconds, and at most 1% may reach
/// 35 ms. With `TCP_NODELAY` off, 20 of the 400 (the first write after every other flush)
/// took 41–46 ms, and the test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_writes_one_at_a_time_never_wait_on_a_tcp_timer() {
    let pair = pair("C", Arc::new(MemoryBackend::new(SIZE, false))).await;
    let backend = pair.primary_backend();
    let sizes = [512, 4096, 65536 + 512, 200_000];
    let mut times = Vec::new();
    for i in 0..400u64 {
        let length = sizes[i as usize % sizes.len()];
        let started = std::time::Instant::now();
        backend
            .write(
                (i % 16) * (256 << 10),
                pattern(i as u8, length).into(),
                i % 7 == 6,
            )
            .await
            .unwrap();
        if i % 10 == 9 {
            backend.flush().await.unwrap();
        }
        times.push(started.elapsed());
    }
    times.sort();
    let median = times[times.len() / 2];
    let slow = times
        .iter()
        .filter(|t| **t >= Duration::from_millis(35))
        .count();
    assert!(
        median < Duration::from_millis(10) && slow <= times.len() / 100,
        "median {median:?}, {slow} of {} at 35 ms or more",
        times.len()
    );
    let _ = pair.stop.send(true);
}

/// A pair in sync whose resource file fences with `script` (a shell script), and the
/// directory holding the script and the log it may write (`$DIR/fence.log`).
async fn fenced_pair(script: &str) -> (Pair, tempfile::TempDir) {
    fenced_cluster(2, script).await
}

/// As [`fenced_pair`], with `nodes` nodes (2 or 3), every secondary in sync.
async fn fenced_cluster(nodes: usize, script: &str) -> (Pair, tempfile::TempDir) {
    fenced_cluster_with(nodes, script, "").await
}

/// As [`fenced_cluster`], with `resource_lines` added to the `[resource]` table.
async fn fenced_cluster_with(
    nodes: usize,
    script: &str,
    resource_lines: &str,
) -> (Pair, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fence.sh");
    std::fs::write(
        &path,
        script.replace("$DIR", &dir.path().display().to_string()),
    )
    .unwrap();
    let line = format!("fence_peer = \"sh {}\"\n{resource_lines}", path.display());
    let pair = cluster_started_with(
        "C",
        nodes,
        Arc::new(MemoryBackend::new(SIZE, false)),
        "1G",
        nodes,
        None,
        &line,
    )
    .await;
    wait_until("the secondaries are in sync", || {
        pair.secondaries
            .iter()
            .all(|s| s.status().disk == "UpToDate")
            && pair.primary.status().peers.iter().all(|p| p.replicating)
    })
    .await;
    (pair, dir)
}

/// A switchover by hand: the primary (alpha) demotes and drops its links, and once both
/// nodes are linked again as secondaries, beta is promoted (not yet announced to alpha).
async fn demote_alpha_and_promote_beta(pair: &Pair) {
    let (alpha, beta) = (&pair.primary, &pair.secondary);
    alpha.demote().await.unwrap();
    alpha.drop_connections();
    wait_until("both secondaries, connected again", || {
        alpha.status().peers[0].link == "idle" && beta.status().peers[0].link == "idle"
    })
    .await;
    assert_eq!(beta.promote(false), Ok(true));
}

/// Processes of process group `group` that are not zombies, from /proc.
fn live_processes_in_group(group: u32) -> usize {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            // After the command name's closing parenthesis: state, ppid, pgrp.
            let fields: Vec<&str> = stat
                .rsplit_once(')')
                .map_or(vec![], |(_, rest)| rest.split_whitespace().collect());
            fields.len() > 2 && fields[0] != "Z" && fields[2] == group.to_string()
        })
        .count()
}

fn fence_log(dir: &tempfile::TempDir) -> Vec<String> {
    std::fs::read_to_string(dir.path().join("fence.log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// With `fence_peer` set, nothing is acknowledged without a peer before the command has
/// fenced it (DRBD's fence-peer handler): the command runs once, with the resource, the
/// node and the peer in its environment, and then writes and flushes go on degraded
/// without running it again. While every peer takes writes it never runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_without_a_peer_is_acknowledged_only_after_the_peer_is_fenced() {
    let (pair, dir) = fenced_pair(
        "echo \"$NETBLK_RESOURCE $NETBLK_NODE fences $NETBLK_PEER at $NETBLK_PEER_ADDRESS\" >> $DIR/fence.log\n",
    )
    .await;
    let backend = pair.primary_backend();
    backend
        .write(0, pattern(1, 4096).into(), false)
        .await
        .unwrap();
    backend.flush().await.unwrap();
    assert!(fence_log(&dir).is_empty(), "run with every peer linked");
    stop_the_secondary(&pair).await;
    backend
        .write(65536, pattern(2, 4096).into(), false)
        .await
        .unwrap();
    let log = fence_log(&dir);
    let address = pair.primary.peers[0].config.replication;
    assert_eq!(log, [format!("t alpha fences beta at {address}")]);
    let status = pair.primary.status();
    assert!(status.peers[0].fenced, "{status:?}");
    let text = super::control::render(&status);
    assert!(text.contains("disconnected (link lost: "), "{text}");
    assert!(text.contains(", fenced"), "{text}");
    backend
        .write(131072, pattern(3, 4096).into(), true)
        .await
        .unwrap();
    backend.flush().await.unwrap();
    assert_eq!(
        fence_log(&dir).len(),
        1,
        "fenced once until the peer links again"
    );
    let _ = pair.stop.send(true);
}

/// A `fence_peer` command that fails fails the write (EIO, with what the command said),
/// and every write for a second after it without running it again; then it runs again,
/// and once it succeeds writes go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_fence_fails_the_write_and_is_tried_again_a_second_later() {
    let (pair, dir) = fenced_pair(
        "echo run >> $DIR/fence.log\n[ -e $DIR/reachable ] || { echo beta does not answer >&2; exit 3; }\n",
    )
    .await;
    stop_the_secondary(&pair).await;
    let backend = pair.primary_backend();
    let error = backend
        .write(0, pattern(1, 4096).into(), false)
        .await
        .expect_err("acknowledged without a fenced peer");
    assert_eq!(error.errno, NbdError::Io);
    let text = error.to_string();
    assert!(
        text.contains("could not be fenced") && text.contains("beta does not answer"),
        "{text}"
    );
    assert!(backend.flush().await.is_err());
    assert_eq!(fence_log(&dir).len(), 1, "run again at once");
    std::fs::write(dir.path().join("reachable"), "").unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    backend
        .write(0, pattern(1, 4096).into(), false)
        .await
        .unwrap();
    assert_eq!(fence_log(&dir).len(), 2);
    let _ = pair.stop.send(true);
}

/// A fencing holds only until the peer links again: lost a second time, it is fenced
/// again before a write goes on without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_linked_again_is_fenced_again_at_its_next_loss() {
    let (pair, dir) = fenced_pair("echo run >> $DIR/fence.log\n").await;
    let backend = pair.primary_backend();
    for round in 1..=2 {
        pair.primary.drop_connections();
        wait_until("the primary sees the link gone", || {
            !pair.primary.status().peers[0].connected
        })
        .await;
        backend
            .write(0, pattern(round, 4096).into(), false)
            .await
            .unwrap();
        assert_eq!(fence_log(&dir).len(), usize::from(round));
        wait_until("the peer is back in sync", || {
            let peer = &pair.primary.status().peers[0];
            peer.replicating && peer.out_of_sync_bytes == 0
        })
        .await;
        assert!(
            !pair.primary.status().peers[0].fenced,
            "fenced while linked"
        );
    }
    let _ = pair.stop.send(true);
}

/// `netblk outdate` (what a fence_peer command runs on the fenced peer): refused on a
/// primary and on a secondary linked to its primary; on a secondary cut off from it, the
/// disk is recorded outdated and promote needs --force. A primary's next link with the
/// node brings it up to date again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outdate_marks_a_cut_off_secondary_so_promote_needs_force() {
    let trio = trio("1G").await;
    let (beta, gamma) = (&trio.secondaries[0], &trio.secondaries[1]);
    let refused = trio.primary.outdate().unwrap_err();
    assert!(refused.contains("primary"), "{refused}");
    let refused = beta.outdate().unwrap_err();
    assert!(refused.contains("alpha"), "{refused}");
    trio.primary.stop();
    let _ = trio.stop.0[0].send(true);
    wait_until("beta sees its primary gone", || {
        !beta
            .status()
            .peers
            .iter()
            .any(|p| p.name == "alpha" && p.connected)
    })
    .await;
    let said = beta.outdate().unwrap();
    assert!(said.starts_with("outdated"), "{said}");
    assert_eq!(beta.status().disk, "Outdated");
    assert_eq!(beta.outdate().unwrap(), "already outdated");
    let refused = beta.promote(false).unwrap_err();
    assert!(refused.contains("Outdated"), "{refused}");
    // Gamma, not outdated, is promoted, and its link with beta brings beta up to date.
    assert!(gamma.promote(false).unwrap());
    gamma.announce_primary_and_reconnect();
    wait_until("beta is up to date again", || {
        beta.status().disk == "UpToDate"
    })
    .await;
    let _ = trio.stop.send(true);
}

/// The command's exit decides, not the end of its output: a command that leaves a process
/// running with its stderr (`cmd &`, an ssh master) held every write for its whole 60 s
/// timeout and then failed it, though it had exited 0 at once (re-review, session 72).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_command_that_leaves_a_process_running_counts_at_its_exit() {
    let (pair, dir) = fenced_pair("sleep 5 &\necho run >> $DIR/fence.log\n").await;
    stop_the_secondary(&pair).await;
    let started = std::time::Instant::now();
    pair.primary_backend()
        .write(0, pattern(1, 4096).into(), false)
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the write waited {:?} for the command's background process",
        started.elapsed()
    );
    assert_eq!(fence_log(&dir).len(), 1);
    let _ = pair.stop.send(true);
}

/// A command that hangs counts as failed after `fence_timeout`, and is killed: the write
/// waits that long, not the default minute, and then fails with EIO.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_command_that_hangs_fails_the_write_at_the_fence_timeout() {
    let (pair, dir) = fenced_cluster_with(
        2,
        "awk '{print $5}' /proc/$$/stat >> $DIR/fence.log\nsleep 30\n",
        "fence_timeout = \"1s\"",
    )
    .await;
    stop_the_secondary(&pair).await;
    let started = std::time::Instant::now();
    let error = pair
        .primary_backend()
        .write(0, pattern(1, 4096).into(), false)
        .await
        .expect_err("acknowledged while the peer was not fenced");
    let waited = started.elapsed();
    assert_eq!(error.errno, NbdError::Io);
    assert!(error.to_string().contains("fence_timeout"), "{error}");
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_secs(6),
        "the write waited {waited:?}"
    );
    // The shells and the sleep were killed with their process group (the script logged
    // its group's id; a killed process no one has reaped yet stays as a zombie, so those
    // do not count).
    let log = fence_log(&dir);
    let group: u32 = log.first().expect("the script ran").parse().unwrap();
    wait_until("the command's process group is gone", || {
        live_processes_in_group(group) == 0
    })
    .await;
    let _ = pair.stop.send(true);
}

/// Flushes no client waits for (a server's last flush at its stop, a demotion's) do not
/// fence: at every stop of a primary with a peer away the command ran (with a power-off
/// command, a needless power-off), and when it failed the stop logged its flush failed
/// (re-review, session 72).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_or_a_demotion_does_not_run_the_fence_command() {
    let (pair, dir) = fenced_pair("echo run >> $DIR/fence.log\nexit 1\n").await;
    let backend = pair.primary_backend();
    backend
        .write(0, pattern(1, 4096).into(), false)
        .await
        .unwrap();
    stop_the_secondary(&pair).await;
    backend.final_flush().await.unwrap();
    pair.primary.demote().await.unwrap();
    assert!(fence_log(&dir).is_empty(), "{:?}", fence_log(&dir));
    let _ = pair.stop.send(true);
}

/// A client's FLUSH right after a switchover waits for the old primary to relink, as a
/// write does: it went without it, and with fencing set ran the command against a
/// healthy peer (whose `netblk outdate` was refused once it relinked), failing the FLUSH
/// with EIO after 10 s (re-review, session 72).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_right_after_a_switchover_waits_for_the_relink_and_fences_nobody() {
    let (pair, dir) = fenced_pair("echo run >> $DIR/fence.log\nexit 1\n").await;
    let beta = &pair.secondary;
    demote_alpha_and_promote_beta(&pair).await;
    beta.announce_primary_and_reconnect();
    let beta_backend = ReplicatedBackend {
        shared: Arc::clone(beta),
    };
    beta_backend.flush().await.unwrap();
    assert!(fence_log(&dir).is_empty(), "{:?}", fence_log(&dir));
    assert!(beta.status().peers[0].replicating);
    let _ = pair.stop.send(true);
}

/// A client FLUSH that a demotion overtakes fences nobody: woken from its wait for
/// relinks by the demotion, it went on as the primary it no longer was, and fenced the
/// peers the demotion's own relinking dropped, a healthy one too (final re-review,
/// session 72: both other nodes left Outdated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flush_overtaken_by_a_demotion_fences_nobody() {
    let (trio, dir) = fenced_cluster(3, "echo \"$NETBLK_PEER\" >> $DIR/fence.log\n").await;
    let alpha = Arc::clone(&trio.primary);
    // Gamma is gone, so after a promotion a FLUSH waits for it to relink (2 s).
    trio.stop.0[2].send(true).unwrap();
    alpha.drop_connections();
    wait_until("alpha sees gamma gone, and beta back", || {
        let peers = alpha.status().peers;
        !peers[1].connected && peers[0].replicating
    })
    .await;
    alpha.demote().await.unwrap();
    assert!(alpha.promote(true).unwrap());
    alpha.announce_primary_and_reconnect();
    let flushing = Arc::clone(&alpha);
    let flush = tokio::spawn(async move { ReplicatedBackend { shared: flushing }.flush().await });
    wait_until("beta relinked", || alpha.status().peers[0].replicating).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    alpha.demote().await.unwrap();
    alpha.relink_all();
    flush.await.unwrap().unwrap();
    assert!(fence_log(&dir).is_empty(), "{:?}", fence_log(&dir));
    let _ = trio.stop.send(true);
}
