//! A backend over a regular file or a block device. Reads, writes and syncs go through an
//! io_uring ([`super::uring`]), except in writeback mode, where writes without FUA are
//! copied into the page cache on the calling thread (those of 256 KiB or more beside it,
//! on the export's writer thread, [`super::beside`], or tokio's blocking pool, while the
//! connection receives the next), cached reads of a page or more are copied into the
//! client's socket by the kernel straight from a mapping of the file ([`super::mapping`])
//! unless large ones are spliced into it without a copy ([`super::splice`]), and other
//! reads are tried on the calling thread first. With `--cache=none` the file is opened
//! `O_DIRECT` and requests that do not cover whole blocks are read-modify-written under a
//! range lock ([`super::range_lock`]). TRIM punches holes (on a device: `BLKDISCARD`),
//! WRITE_ZEROES uses `fallocate`, block status comes from `SEEK_DATA`/`SEEK_HOLE`, FUA
//! writes are a write and a sync (in page-cache mode a sync of the write's range), and
//! FLUSH syncs only when a write completed since the last sync, answering only once the
//! syncs beside it ended ([`SyncsInFlight`]; and fails for good once a sync failed:
//! [`LostWriteback`]).

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use rustix::fs::FallocateFlags;

use super::beside::{Job, Writer};
use super::change_order::{self, ChangeOrder};
use super::mapping::Mapping;
use super::range_lock::RangeLocks;
use super::uring::Ring;
use super::WriteData;
use super::{
    backend_future, inline_backend_future, Backend, BackendError, BackendFuture, CacheMode,
    Capabilities, Extent, Pieces, ReadData, ZeroFlags,
};
use crate::buffer::{Buffer, ALIGN};

/// Reads shorter than this in writeback mode first try the page cache without blocking
/// (`RWF_NOWAIT`) on the calling worker: a plain `preadv2` is cheaper than a trip through
/// the ring when the page is there.
const NOWAIT_READ_MAX: usize = 64 * 1024;
/// Reads at least this long ask the file system where its holes are first.
const HOLE_QUERY_MIN: usize = 64 * 1024;
/// Cached reads from this length on may be served from the mapping
/// ([`Backend::read_mapped`]): a page. From 64 KiB until session 60, when 4 KiB random
/// reads from the mapping measured 11–12% more reads a second at QD32 with 12–14% less
/// server CPU a read (ARCHITECTURE.md, "Cached file reads copied once, from a mapping").
const MAPPED_READ_MIN: usize = 4 * 1024;
/// In writeback mode, once this many bytes have been written into the page cache since
/// writeback was last started, writeback of the file's dirty pages is started in the
/// background (see [`WriteBehind`]).
const WRITE_BEHIND: u64 = 32 << 20;
/// Write-behind runs while a FLUSH came at most this long ago.
const FLUSH_RECENT: std::time::Duration = std::time::Duration::from_secs(30);
/// Chunk used when zeroes must be written out by hand.
const ZERO_CHUNK: u64 = 1024 * 1024;
/// The largest single read or write handed to the ring (its length field is 32 bits).
const MAX_RING_IO: usize = 1 << 30;
/// Page-cache writes of at least this many bytes are copied beside the connection's thread
/// ([`FileBackend::write_beside`]): on the export's writer thread ([`super::beside`]).
const WRITE_BESIDE_MIN: usize = 256 << 10;
/// Writes beside of at least this many bytes (a streamed write's pieces are this long,
/// `WRITE_PIECE`) are copied on tokio's blocking pool instead, each once the one like it
/// before has been copied.
const WRITE_BESIDE_TURN: usize = 1 << 20;
/// Most bytes of writes waiting for, or in, [`FileBackend::write_beside`].
const WRITE_BESIDE_BACKLOG: usize = 8 << 20;
/// How long after a failed start of the writer thread it is tried again
/// ([`FileBackend::writer`]).
const WRITER_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// A file or block device export.
pub struct FileBackend {
    path: PathBuf,
    file: Arc<File>,
    size: u64,
    read_only: bool,
    block_device: bool,
    /// The media is rotational (sysfs `queue/rotational` of the device, or of the device
    /// holding the file): advertised to clients as `NBD_FLAG_ROTATIONAL`.
    rotational: bool,
    /// What `fallocate` on the file wants its ranges aligned to: a block device's logical
    /// block size (it refuses anything else with `EINVAL`), 1 for a regular file.
    fallocate_block: u64,
    cache: CacheMode,
    /// Offsets and lengths of direct I/O must be multiples of this (1 in writeback mode).
    block: u64,
    /// Direct I/O buffers must start on a multiple of this (1 in writeback mode).
    memory_align: usize,
    ring: Arc<Ring>,
    /// The file mapped, for cached reads the kernel copies into a socket straight from the
    /// page cache ([`Backend::read_mapped`]); page-cache mode only, and `None` where the
    /// file could not be mapped.
    mapping: Option<Arc<Mapping>>,
    /// Set once a read of the file failed, or a send from the mapping did: cached reads
    /// are copied from then on (see [`FileBackend::stop_mapped_reads`]).
    mapped_reads_off: AtomicBool,
    locks: RangeLocks,
    dirty: Arc<DirtyTracker>,
    lost: LostWriteback,
    /// The syncs in flight ([`SyncsInFlight`]).
    syncs: SyncsInFlight,
    behind: Arc<WriteBehind>,
    /// The thread that copies page-cache writes from [`WRITE_BESIDE_MIN`] to below
    /// [`WRITE_BESIDE_TURN`] beside the connections' threads
    /// ([`FileBackend::write_beside`]), started with the first.
    writer: std::sync::OnceLock<Writer<CopyBeside>>,
    /// Held while the writer thread is started; when a start failed, the earliest time to
    /// try again ([`WRITER_RETRY`]).
    writer_start: Mutex<Option<std::time::Instant>>,
    /// The turn of the writes beside of [`WRITE_BESIDE_TURN`] or more: one at a time.
    beside_turn: Arc<tokio::sync::Semaphore>,
    /// Bytes of writes handed to [`FileBackend::write_beside`] and not yet written.
    beside_backlog: Arc<AtomicUsize>,
    /// Those writes and the changes over them, in the order they started, for later
    /// changes over them to wait for ([`super::change_order`]).
    change_order: Arc<ChangeOrder>,
    /// Writes copied beside the connection's thread, for tests that count them.
    #[cfg(test)]
    writes_beside: AtomicU64,
    /// Makes the next start of the writer thread fail, for tests.
    #[cfg(test)]
    fail_writer_start: AtomicBool,
    /// Copies beside that ended, counted on the copying thread, for tests.
    #[cfg(test)]
    copies_beside_ended: Arc<AtomicU64>,
    /// Non-blocking page-cache reads tried, for tests that count them.
    #[cfg(test)]
    nowait_tries: AtomicU64,
    /// How a device discards, read from sysfs once at open: `None` for a file or a
    /// device that takes no discards (`queue/discard_max_bytes` 0), else its granule
    /// (`queue/discard_granularity`, at least a block: a discard that covers only part
    /// of one may be ignored, as a thin volume ignores part of its 64 KiB chunk) and how
    /// far into a partition its first whole granule starts (`discard_alignment`). A
    /// device that stops taking discards later answers EOPNOTSUPP, which each caller
    /// handles.
    discards: Option<DiscardGranules>,
    /// A test's device that discards as this says instead (every loop device here
    /// discards by 512 bytes from its start, and the VM's own disk is not a test's to
    /// touch).
    #[cfg(test)]
    pretend_discards: std::sync::Mutex<Option<Option<DiscardGranules>>>,
}

/// Write-behind for writeback mode: after every [`WRITE_BEHIND`] bytes written into the page
/// cache, the backend asks the kernel to start writing the file's dirty pages
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)` through the ring, not waited for), one such
/// request at a time.
///
/// Why: the kernel starts background writeback only past `dirty_background_ratio` (10% of
/// memory, gigabytes on a storage server), so a stream of writes accumulated that much dirty
/// data and the next FLUSH (an ext4 journal commit, a database fsync) wrote all of it while
/// the client waited. Started early, the writes reach the disk while more data arrives and a
/// FLUSH has about [`WRITE_BEHIND`] left to write.
///
/// Only while clients flush: when no FLUSH came for [`FLUSH_RECENT`], writeback is left to
/// the kernel. Data a client rewrites before it ever flushes need not reach the disk each
/// time, and writing it behind costs the server CPU (the ring's worker threads build the
/// disk writes): fio rewriting a 512 MiB file with 1 MiB writes and no FLUSH fell from
/// 3.96 to 2.43 GB/s with unconditional write-behind, while bonnie++'s block write on ext4
/// (whose journal commits FLUSH every few seconds) went from 237–361 to 465–468 MiB/s.
struct WriteBehind {
    /// Bytes written since writeback was last started.
    written: AtomicU64,
    /// A start-writeback request is in flight.
    running: std::sync::atomic::AtomicBool,
    /// When the last FLUSH came, in microseconds since `epoch` (0: never).
    flushed_at: AtomicU64,
    epoch: std::time::Instant,
}

impl WriteBehind {
    fn new() -> WriteBehind {
        WriteBehind {
            written: AtomicU64::new(0),
            running: Default::default(),
            flushed_at: AtomicU64::new(0),
            epoch: std::time::Instant::now(),
        }
    }

    fn flush_seen(&self) {
        let now = self.epoch.elapsed().as_micros() as u64;
        self.flushed_at.store(now.max(1), Ordering::Release);
    }

    /// A FLUSH came within [`FLUSH_RECENT`].
    fn clients_flush(&self) -> bool {
        let at = self.flushed_at.load(Ordering::Acquire);
        at != 0 && self.epoch.elapsed().as_micros() as u64 - at < FLUSH_RECENT.as_micros() as u64
    }
}

/// Counts completed writes so that FLUSH can skip the sync when nothing changed.
#[derive(Default)]
struct DirtyTracker {
    /// Bumped after every write that is not yet known durable.
    written: AtomicU64,
    /// The value of `written` that the last completed sync covered.
    synced: AtomicU64,
}

impl DirtyTracker {
    fn mark(&self) {
        self.written.fetch_add(1, Ordering::AcqRel);
    }

    /// The point a sync starting now would cover, or `None` when every write completed so
    /// far is already durable.
    fn sync_target(&self) -> Option<u64> {
        let target = self.written.load(Ordering::Acquire);
        (self.synced.load(Ordering::Acquire) < target).then_some(target)
    }

    /// Records that a sync covering `target` completed.
    fn synced(&self, target: u64) {
        self.synced.fetch_max(target, Ordering::AcqRel);
    }
}

/// The syncs of one export in flight (page-cache FUA writes' syncs of their range too), so that one that succeeded can wait for those beside it.
///
/// Why: Linux reports a failed writeback once: to one sync per open file description, and
/// a cache below the export's file system (a loop device over a file) to one of the device
/// flushes it is sent, whatever the descriptor. So of two syncs in flight at once, one can
/// succeed for data that is lost (a review found three FLUSHes sent together answered EIO,
/// ok, ok). A sync that succeeded therefore answers only once every sync that ran beside
/// it has ended, and fails if one of them failed ([`FileBackend::sync`]). Measured
/// against the alternatives (session 63, pairs a second at 16 connections, page cache):
/// one sync at a time lost a quarter of the write+flush rate (6,611 against 8,917), as
/// syncs in flight together share the file system's journal commit; a descriptor per sync
/// kept the rate but not the guarantee under a stacked file system. Only this export's
/// syncs are tracked: a sync of another file on the same file system can still take a
/// lower cache's report unseen (ARCHITECTURE.md, "Durability").
#[derive(Default)]
struct SyncsInFlight {
    /// The next sync's number, and the numbers of those in flight.
    state: Mutex<(u64, std::collections::BTreeSet<u64>)>,
    ended: tokio::sync::Notify,
}

impl SyncsInFlight {
    /// A sync starts: it is in flight until its ticket ends (or is dropped).
    fn start(&self) -> SyncTicket<'_> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let id = state.0;
        state.0 += 1;
        state.1.insert(id);
        SyncTicket {
            syncs: self,
            id,
            ended: false,
        }
    }

    fn finish(&self, id: u64) -> u64 {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.1.remove(&id);
        self.ended.notify_waiters();
        state.0
    }

    /// Waits until no sync numbered below `end` is in flight.
    async fn wait_for_those_before(&self, end: u64) {
        loop {
            let ended = self.ended.notified();
            {
                let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                if state.1.first().map_or(true, |&first| first >= end) {
                    return;
                }
            }
            ended.await;
        }
    }
}

/// A sync in flight in [`SyncsInFlight`]; ended when dropped, if not before.
struct SyncTicket<'a> {
    syncs: &'a SyncsInFlight,
    id: u64,
    ended: bool,
}

impl SyncTicket<'_> {
    /// The sync ended (its failure, if any, recorded first): returns the number the next
    /// sync will get, so every sync that ran beside this one has a smaller one.
    fn end(mut self) -> u64 {
        self.ended = true;
        self.syncs.finish(self.id)
    }
}

impl Drop for SyncTicket<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.syncs.finish(self.id);
        }
    }
}

/// The first sync that failed: from then on every FLUSH fails with its error, until the
/// export is opened again.
///
/// Why: Linux reports a failed writeback to each open file once. The pages that could not
/// be written are marked clean, so the next `fdatasync` has nothing to write and succeeds,
/// although data acknowledged before it never reached the device (PostgreSQL's "fsyncgate",
/// 2018). A FLUSH answered with success then would promise what is lost. In writeback mode
/// that cache is this file's own; with `--cache=none` it can lie below the device (a loop
/// device over a file, whose flush is an `fsync` of that file), and the same happens there.
/// qemu's file driver makes FLUSH fail for good in writeback mode only
/// (`page_cache_inconsistent`), and nbdkit's file plugin never does: measured on loop
/// devices that fail writeback, nbdkit answers the FLUSH after a failed one with success in
/// both cases, and qemu-nbd with `--cache=none` too.
///
/// What counts: a failed `fdatasync` (FLUSH, a FUA trim, zeroing or direct write, which
/// is a write and such a sync), and in page-cache mode a FUA write's sync of its range. A
/// failed write, FUA or not, does not: a failed copy into the page cache (no space, a
/// block it could not read) or a failed direct write (more likely its own blocks failing,
/// a bad sector) must not stop the export. Nor does a sync the
/// ring never handed to the kernel ([`super::uring::reached_the_kernel`]).
///
/// The kernel reports a failure once, so a sync that succeeded answers only after the
/// syncs beside it, and fails if one of them failed ([`SyncsInFlight`]). A direct FUA write
/// is not `RWF_DSYNC`: the device flush that sends could take the only report of a failure
/// in a cache below the device (a loop device over a file), unseen by the syncs (found by
/// review: the FUA write failed, and the FLUSH after it answered ok).
#[derive(Default)]
struct LostWriteback {
    /// The errno of the first failed sync; 0 while none has failed.
    errno: AtomicI32,
}

impl LostWriteback {
    /// Records the failure `error`; returns whether it is the first.
    fn record(&self, error: &std::io::Error) -> bool {
        let errno = error.raw_os_error().unwrap_or(libc::EIO);
        self.errno
            .compare_exchange(0, errno, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// The error every FLUSH fails with, once a sync failed.
    fn error(&self) -> Option<std::io::Error> {
        match self.errno.load(Ordering::Acquire) {
            0 => None,
            errno => Some(std::io::Error::from_raw_os_error(errno)),
        }
    }
}

impl FileBackend {
    /// Opens `path`. With `size`, a missing file is created sparse at that size and an
    /// existing one must already have it; an existing file is never truncated.
    /// `cache` defaults to `none` (direct I/O) for block devices and `writeback` for files.
    pub fn open(
        path: &Path,
        size: Option<u64>,
        read_only: bool,
        cache: Option<CacheMode>,
    ) -> anyhow::Result<FileBackend> {
        let exists = path.exists();
        if !exists {
            let Some(size) = size else {
                bail!(
                    "{} does not exist (give a size to create it: --size, or `size` in a config file)",
                    path.display()
                );
            };
            if read_only {
                bail!(
                    "{} does not exist, and a read-only export cannot create it",
                    path.display()
                );
            }
            if size == 0 {
                bail!("--size must be above zero to create {}", path.display());
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(path)
                .with_context(|| format!("creating {}", path.display()))?;
            // From here a failure removes the file again: it was never served, and left
            // behind it would make the next start's error about its size misleading.
            let opened = file
                .set_len(size)
                .with_context(|| format!("sizing {} to {size} bytes", path.display()))
                .and_then(|()| FileBackend::open_existing(path, Some(size), read_only, cache));
            if opened.is_err() {
                let _ = std::fs::remove_file(path);
            }
            return opened;
        }
        FileBackend::open_existing(path, size, read_only, cache)
    }

    /// [`FileBackend::open`] of a file or device that exists.
    fn open_existing(
        path: &Path,
        size: Option<u64>,
        read_only: bool,
        cache: Option<CacheMode>,
    ) -> anyhow::Result<FileBackend> {
        let file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        let meta = file
            .metadata()
            .with_context(|| format!("inspecting {}", path.display()))?;
        let block_device = meta.file_type().is_block_device();
        if !block_device && !meta.is_file() {
            bail!(
                "{} is neither a regular file nor a block device",
                path.display()
            );
        }
        let actual = if block_device {
            (&file)
                .seek(SeekFrom::End(0))
                .with_context(|| format!("measuring {}", path.display()))?
        } else {
            meta.len()
        };
        if let Some(size) = size {
            if size != actual {
                bail!(
                    "{} is {actual} bytes but the size given (--size, or `size` in a config file) is {size}; netblk never resizes existing storage",
                    path.display()
                );
            }
        }
        if actual == 0 {
            bail!(
                "{} is empty; give a size to create a new file instead",
                path.display()
            );
        }
        // As root, a read-write open of a read-only device (`losetup -r`, a write-protected
        // disk) succeeds, and every write then fails with EPERM: export it read-only
        // instead, as the device is (review, session 67: it was advertised writable).
        let read_only = read_only
            || (block_device && {
                let device_read_only = rustix::fs::fstat(&file)
                    .ok()
                    .and_then(|stat| device_attribute(stat.st_rdev, "ro"))
                    .is_some_and(|ro| ro != 0);
                if device_read_only {
                    tracing::warn!(
                        "{} is a read-only device: exported read-only",
                        path.display()
                    );
                }
                device_read_only
            });
        // The media under the export: the device's own queue, or that of the device that
        // holds the file (none for tmpfs and the like: not rotational).
        let rotational = rustix::fs::fstat(&file)
            .ok()
            .and_then(|stat| {
                queue_attribute(
                    if block_device {
                        stat.st_rdev
                    } else {
                        stat.st_dev
                    },
                    "rotational",
                )
            })
            .is_some_and(|rotational| rotational != 0);
        let cache = cache.unwrap_or(if block_device {
            CacheMode::None
        } else {
            CacheMode::Writeback
        });
        let (file, block, memory_align) = match cache {
            CacheMode::Writeback => (file, 1, 1),
            CacheMode::None => {
                let direct = OpenOptions::new()
                    .read(true)
                    .write(!read_only)
                    .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
                    .open(path)
                    .with_context(|| {
                        format!(
                            "opening {} for direct I/O (--cache=none); \
                             --cache=writeback works on file systems without O_DIRECT",
                            path.display()
                        )
                    })?;
                let (block, memory_align) = direct_io_alignment(&direct, block_device);
                if actual % block != 0 {
                    // A device's page cache is read and written in its own blocks too:
                    // writeback mode would fail at the last partial block.
                    let advice = if block_device {
                        "resize the device (for a loop device, its file) to a whole number of blocks"
                    } else {
                        "use --cache=writeback"
                    };
                    bail!(
                        "{} is {actual} bytes, not a whole number of {block}-byte blocks, \
                         which direct I/O (--cache=none) needs; {advice}",
                        path.display()
                    );
                }
                (direct, block, memory_align)
            }
        };
        let ring = match cache {
            CacheMode::None => Ring::for_direct_io(),
            CacheMode::Writeback => Ring::new(),
        }
        .context("setting up io_uring")?;
        let mapping = match cache {
            CacheMode::Writeback => match Mapping::of(&file, actual) {
                Ok(mapping) => Some(Arc::new(mapping)),
                Err(e) => {
                    tracing::debug!(
                        "{} not mapped ({e}): cached reads are copied",
                        path.display()
                    );
                    None
                }
            },
            CacheMode::None => None,
        };
        let fallocate_block = if block_device {
            rustix::fs::ioctl_blksszget(&file)
                .map_or(512, u64::from)
                .max(1)
        } else {
            1
        };
        let discards = block_device
            .then(|| DiscardGranules::of(&file, fallocate_block))
            .flatten();
        Ok(FileBackend {
            path: path.to_path_buf(),
            file: Arc::new(file),
            size: actual,
            read_only,
            block_device,
            rotational,
            fallocate_block,
            cache,
            block,
            memory_align,
            ring,
            mapping,
            mapped_reads_off: AtomicBool::new(false),
            locks: RangeLocks::default(),
            dirty: Arc::new(DirtyTracker::default()),
            writer: std::sync::OnceLock::new(),
            writer_start: Mutex::new(None),
            beside_turn: Arc::new(tokio::sync::Semaphore::new(1)),
            beside_backlog: Arc::new(AtomicUsize::new(0)),
            change_order: Arc::default(),
            #[cfg(test)]
            writes_beside: AtomicU64::new(0),
            #[cfg(test)]
            fail_writer_start: AtomicBool::new(false),
            #[cfg(test)]
            copies_beside_ended: Arc::new(AtomicU64::new(0)),
            lost: LostWriteback::default(),
            syncs: SyncsInFlight::default(),
            behind: Arc::new(WriteBehind::new()),
            #[cfg(test)]
            nowait_tries: AtomicU64::new(0),
            discards,
            #[cfg(test)]
            pretend_discards: std::sync::Mutex::new(None),
        })
    }

    /// Serves cached reads by copying from now on, never from the mapping.
    ///
    /// Why: a page whose read from the device failed stays in the page cache, not up to
    /// date, and `cachestat` counts it as cached. Sent from the mapping, the socket's copy
    /// faults on it, the device fails again, and `writev` fails with `EFAULT` in the middle
    /// of a reply whose data chunk was already promised, so the connection must close: a
    /// client that retried a failed read lost its connection, every time, and so did every
    /// new connection that read the range. A copied read reports `EIO` for that request
    /// alone. So the first read error (or a failed send from the mapping, for a page that
    /// someone else's read, or readahead, left behind) turns the mapping off for good: a
    /// device with bad sectors is not one to save a copy on.
    fn stop_mapped_reads(&self, why: &dyn std::fmt::Display) {
        if self.mapping.is_some() && !self.mapped_reads_off.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "{}: {why}; cached reads are copied from now on (a page that failed to read \
                 cannot be sent from the mapping)",
                self.path.display()
            );
        }
    }

    /// The part of `[offset, offset + length)` that `fallocate` takes, as `(start, end)`:
    /// all of it for a file, the whole blocks within it for a device (`start == end`
    /// when there are none, with `start` within the range).
    fn fallocate_range(&self, offset: u64, length: u64) -> (u64, u64) {
        let block = self.fallocate_block;
        let end = offset + length;
        let start = offset.next_multiple_of(block).min(end);
        (start, (end - end % block).max(start))
    }

    /// Whether the device zeroes ranges itself (`queue/write_zeroes_max_bytes` above 0 in
    /// sysfs); else the kernel writes pages of zeroes for a `fallocate`. False when sysfs
    /// cannot tell. Read for each fast WRITE_ZEROES, not once at open: a loop device
    /// learns at its first zeroing that its file cannot zero ranges, and only then says so
    /// (`tests/block_device.rs`, a fast zero on a device that cannot zero fast; read at
    /// open, session 74, it answered that fast zero by writing zeroes).
    fn device_zeroes_fast(&self) -> bool {
        rustix::fs::fstat(&*self.file)
            .ok()
            .and_then(|stat| queue_attribute(stat.st_rdev, "write_zeroes_max_bytes"))
            .is_some_and(|bytes| bytes > 0)
    }

    /// How the device discards (`None` for a file, or a device that takes no discards).
    fn device_discards(&self) -> Option<DiscardGranules> {
        #[cfg(test)]
        if let Some(pretended) = *self.pretend_discards.lock().unwrap() {
            return pretended;
        }
        self.discards
    }

    /// Discards `start..end` (whole blocks, or whole discard granules) of a device with
    /// BLKDISCARD, or punches it out of a file. `Ok(false)` where the store cannot
    /// (EOPNOTSUPP): it keeps the data then.
    async fn discard_blocks(
        &self,
        op: &'static str,
        offset: u64,
        length: u64,
        start: u64,
        end: u64,
    ) -> Result<bool, BackendError> {
        let block_device = self.block_device;
        self.blocking(op, offset, length, move |file| {
            // On a device, a hole punch is a zeroing (a write-zeroes command, or
            // EOPNOTSUPP without one): only BLKDISCARD discards (review, session 67: TRIM
            // freed nothing on an SSD or thin volume).
            let done = if block_device {
                discard(file, start, end - start)
            } else {
                let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
                rustix::fs::fallocate(file, flags, start, end - start)
            };
            match done {
                Ok(()) => Ok(true),
                Err(rustix::io::Errno::OPNOTSUPP) => Ok(false),
                Err(e) => Err(errno(e)),
            }
        })
        .await
    }

    /// A read within the export's size met the end of the data. The export's size is
    /// fixed at open, and netblk never shortens what it exports, so a device or file that
    /// ends there was shrunk under the export (an `lvreduce`, `losetup -c`, a `truncate`,
    /// `qemu-img resize --shrink`), and zeroes would be a silent wrong answer (review,
    /// sessions 67 for devices, 68 for files): EIO, as nbdkit's file plugin answers. A file
    /// as long as the export again by now (grown back meanwhile) reads as zeroes there.
    fn past_the_end(&self, offset: u64, want: usize) -> Result<(), BackendError> {
        if !self.block_device && shrunk_to(&self.file, self.size).is_none() {
            return Ok(());
        }
        let error = ends_early(&self.path, self.size);
        Err(BackendError::io("read", offset, want as u64, error))
    }

    /// The error of a failed read of `want` bytes at `offset`, which turns mapped reads off.
    fn read_failed(&self, offset: u64, want: usize, e: std::io::Error) -> BackendError {
        let error = BackendError::io("read", offset, want as u64, e);
        self.stop_mapped_reads(&error);
        error
    }

    /// The cache mode in use.
    pub fn cache_mode(&self) -> CacheMode {
        self.cache
    }

    /// The block-aligned range covering `[offset, offset + length)`.
    fn covering(&self, offset: u64, length: u64) -> (u64, u64) {
        let start = offset - offset % self.block;
        let end = (offset + length).div_ceil(self.block) * self.block;
        (start, end.min(self.size.max(start)))
    }

    /// Holds the covering blocks of a range shared against read-modify-writes (direct
    /// I/O only; in writeback mode the page cache keeps partial writes whole).
    async fn lock_shared(
        &self,
        offset: u64,
        length: u64,
    ) -> Option<super::range_lock::RangeGuard<'_>> {
        if self.cache == CacheMode::Writeback {
            return None;
        }
        let (start, end) = self.covering(offset, length);
        Some(self.locks.lock(start, end, false).await)
    }

    /// Fills all of `buffer` from `offset` (short only at the end of the file, where the
    /// rest is zeroed; a device or file shorter than the export fails instead).
    async fn read_into(&self, offset: u64, mut buffer: Buffer) -> Result<Buffer, BackendError> {
        let want = buffer.len();
        let mut filled = 0usize;
        if want <= MAX_RING_IO {
            let (result, returned) = self.ring.read(&self.file, offset, buffer).await;
            buffer = returned;
            filled = result.map_err(|e| self.read_failed(offset, want, e))?;
            if filled == 0 {
                self.past_the_end(offset, want)?;
                buffer.as_mut().fill(0);
                return Ok(buffer);
            }
        }
        // Rare: a short read (or one too long for one ring entry) goes on piece by piece.
        while filled < want {
            let piece = Buffer::take((want - filled).min(MAX_RING_IO));
            let (result, piece) = self
                .ring
                .read(&self.file, offset + filled as u64, piece)
                .await;
            let n = result.map_err(|e| self.read_failed(offset, want, e))?;
            if n == 0 {
                self.past_the_end(offset, want)?;
                buffer.as_mut()[filled..].fill(0);
                break;
            }
            buffer.as_mut()[filled..filled + n].copy_from_slice(&piece.as_ref()[..n]);
            filled += n;
        }
        Ok(buffer)
    }

    /// Writes all of `data` at `offset` through the ring (`data` must suit the file's
    /// alignment).
    async fn write_through_ring(&self, offset: u64, data: WriteData) -> Result<(), BackendError> {
        let length = data.len() as u64;
        let mut done = 0usize;
        while done < data.len() {
            let end = (done + MAX_RING_IO).min(data.len());
            let n = self
                .ring
                .write(
                    &self.file,
                    offset + done as u64,
                    data.slice(done, end - done),
                    0,
                )
                .await
                .map_err(|e| BackendError::io("write", offset, length, e))?;
            if n == 0 {
                return Err(BackendError::io(
                    "write",
                    offset,
                    length,
                    std::io::ErrorKind::WriteZero.into(),
                ));
            }
            done += n;
        }
        Ok(())
    }

    /// Copies `data` into the page cache at `offset` on the calling thread (`pwrite`).
    ///
    /// Why not through the ring: ext4 cannot take a buffered write without blocking
    /// (`RWF_NOWAIT` gives EOPNOTSUPP), so io_uring hands every one to a worker thread, and
    /// buffered writes to one file are hashed to one worker and run one at a time, each
    /// with a thread hand-off. Measured with fio at QD8 / QD32, alternating with nbdkit,
    /// each run from a freshly cached file: sequential 4 KiB writes 228–257 MB/s through
    /// the ring, 421–487 inline (nbdkit 344–447); 64 KiB 2.7–2.8 GB/s against 3.5–3.8
    /// (nbdkit 3.7–4.7); 4 KiB random writes at QD32 148–167 MB/s against 280–389 (nbdkit
    /// 223–321), at half the server CPU per write. The cost: a write the kernel throttles
    /// (dirty-page limits) holds this worker thread meanwhile, as it holds one of nbdkit's.
    fn write_to_page_cache(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(data, offset)
            .map_err(|e| BackendError::io("write", offset, data.len() as u64, e))?;
        self.write_behind(data.len() as u64);
        Ok(())
    }

    /// [`FileBackend::write_to_page_cache`], and the export marked dirty: when the copy
    /// failed too, since one that failed part way (no space for the rest) left the bytes
    /// before in the page cache, where reads see them, and the next FLUSH must sync them.
    fn copy_to_page_cache(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        let copied = self.write_to_page_cache(offset, data);
        self.dirty.mark();
        copied
    }

    /// A write that is not copied beside, once the changes over it started before it
    /// have landed ([`super::change_order`]); also a zeroing's zeroes written by hand.
    fn write_in_turn(&self, offset: u64, data: WriteData, fua: bool) -> BackendFuture<'_, ()> {
        inline_backend_future(async move {
            let length = data.len() as u64;
            if self.cache == CacheMode::Writeback {
                if !fua {
                    return self.copy_to_page_cache(offset, &data);
                }
                return self.fua_write_to_page_cache(offset, data).await;
            }
            // Direct I/O. A FUA write is a plain write and a sync: the device flush
            // `RWF_DSYNC` would send could take the only report of a failure in a cache
            // below the device ([`LostWriteback`]), which the sync records.
            if offset % self.block == 0 && length % self.block == 0 {
                let _held = self.lock_shared(offset, length).await;
                self.write_blocks(offset, data).await?;
            } else {
                // Its errors are said of the client's request, not of the blocks around it.
                self.read_modify_write(offset, data)
                    .await
                    .map_err(|e| e.of_request("write (read-modify-write)", offset, length))?;
            }
            if fua {
                return self.after_change("write", offset, length, true).await;
            }
            self.dirty.mark();
            Ok(())
        })
    }

    /// WRITE_ZEROES once its turn came ([`super::change_order`]); also the parts of a
    /// TRIM that zeroes.
    async fn zero_range(
        &self,
        offset: u64,
        length: u64,
        flags: ZeroFlags,
    ) -> Result<(), BackendError> {
        let block_device = self.block_device;
        // On a device, `fallocate` zeroes whole blocks (the part of the range it can
        // take); the ends are written. A device whose zeroing is not offloaded has the
        // kernel write pages of zeroes instead, which a fast zero must not wait for.
        let (start, end) = self.fallocate_range(offset, length);
        if flags.fast && block_device && start < end && !self.device_zeroes_fast() {
            return Err(BackendError::fast_zero_refused(offset, length));
        }
        let held = self.lock_shared(offset, length).await;
        let zeroed = start == end
            || self
                .blocking("write zeroes", offset, length, move |file| {
                    // On a device a hole punch zeroes too, and lets the device unmap
                    // the blocks (without an offloaded zeroing it fails, and the range
                    // is written by hand); a zero range keeps them allocated.
                    let mode = if flags.may_trim {
                        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE
                    } else {
                        FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE
                    };
                    match rustix::fs::fallocate(file, mode, start, end - start) {
                        Ok(()) => Ok(true),
                        Err(rustix::io::Errno::OPNOTSUPP) => Ok(false),
                        Err(e) => Err(errno(e)),
                    }
                })
                .await?;
        drop(held);
        let by_hand = if zeroed {
            [(offset, start), (end, offset + length)]
        } else if flags.fast {
            return Err(BackendError::fast_zero_refused(offset, length));
        } else {
            [(offset, offset + length), (0, 0)]
        };
        // Written out by hand, through the path (and locks) of client writes that are
        // not copied beside: the zeroing already has its turn.
        for (mut at, to) in by_hand {
            while at < to {
                let n = (to - at).min(ZERO_CHUNK);
                let zeroes = Buffer::zeroed(n as usize).share().into();
                self.write_in_turn(at, zeroes, false).await?;
                at += n;
            }
        }
        self.after_change("write zeroes", offset, length, flags.fua)
            .await
    }

    /// Registers a TRIM or zeroing of `[offset, offset + length)` in the order of
    /// starting, on a page-cache export (where writes are copied beside); `None` on
    /// another (nothing there is copied beside, so nothing waits).
    fn change_in_order(&self, offset: u64, length: u64) -> Option<change_order::Registered> {
        (self.cache == CacheMode::Writeback)
            .then(|| self.change_order.register(offset, offset + length))
    }

    /// Takes a place in the backlog of [`FileBackend::write_beside`] for a page-cache
    /// write of `length` bytes at `offset`, when the write is that large and the backlog
    /// has room, and registers its copy in the order of starting ([`super::change_order`]).
    fn place_beside(&self, offset: u64, length: usize, fua: bool) -> Option<BacklogPlace> {
        if self.cache != CacheMode::Writeback || fua || length < WRITE_BESIDE_MIN {
            return None;
        }
        self.beside_backlog
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                (queued + length <= WRITE_BESIDE_BACKLOG).then_some(queued + length)
            })
            .ok()?;
        Some(BacklogPlace {
            backlog: Arc::clone(&self.beside_backlog),
            length,
            registered: self.change_order.register(offset, offset + length as u64),
        })
    }

    /// Copies a write of [`WRITE_BESIDE_MIN`] or more into the page cache beside the
    /// connection's thread, so that the connection receives the next payload while this
    /// one is copied (nbdkit's threads overlap the two the same way): below
    /// [`WRITE_BESIDE_TURN`] on the export's writer thread ([`super::beside`]), from there
    /// on tokio's blocking pool, one at a time.
    ///
    /// Measured reason (`bench/ab.py`, file export, fio sequential writes at QD8, 3
    /// rounds, IOPS against the binary before in the same run; RESULTS, "Session 74" and
    /// "Session 75"): copied on its own thread, a 1 MiB write kept the connection's thread
    /// at all of a CPU receiving and copying every byte. Beside it, 1 MiB 3,813 against
    /// 3,151 (nbdkit 3,185), 4 MiB 870 against 862, 32 MiB level (session 74); on the
    /// writer thread, 256 KiB 13,601 against 11,808 (nbdkit 11,500), the other sizes
    /// level (session 75).
    ///
    /// The rules, each measured:
    /// - One write at a time on each path: ext4 takes the inode's lock for each buffered
    ///   write anyway, and on several threads at once the pieces of 4 MiB writes cost a
    ///   quarter more CPU a request, and were slower than on the connection's thread.
    /// - Below 1 MiB, the writer thread, which drains its whole queue each time it wakes:
    ///   `spawn_blocking` per write woke a pool thread for each and allocated its task,
    ///   which at 256 KiB cost 123 µs of CPU a write against 80 copied inline, at 7,322
    ///   IOPS against 12,320; the writer's queue took 256 KiB to 14,926.
    /// - With the client's socket on bbr instead of cubic (this VM's loopback slow mode,
    ///   RESULTS session 17), copies beside lose at every size they are made at: 256 KiB
    ///   on the writer thread 8,796–9,059 against 11,813–12,531 inline, 1 MiB on the
    ///   blocking pool 2,531 and 2,570 against 3,189 and 2,846 (fio by hand). The
    ///   benchmark runs every socket on cubic, as netblk sets its own.
    /// - Only from [`WRITE_BESIDE_MIN`]: 64 KiB writes on the writer thread lost (37,051
    ///   against 39,537 IOPS inline, at 29.9 against 24.6 µs of CPU a write); 128 KiB
    ///   writes were level (21,597 and 21,283 against 21,983 and 21,586, fio by hand) at
    ///   a fifth more CPU; 256 and 512 KiB gained a quarter by hand (15,322 and 14,242
    ///   against 11,747 and 11,641; 7,368 and 6,903 against 6,116 and 5,215).
    /// - From [`WRITE_BESIDE_TURN`] (whole 1 MiB writes and the pieces of larger ones),
    ///   the blocking pool, each write handed over only once the one before it was
    ///   copied. On the writer thread, queued at once, 4 MiB writes fell to 822 against
    ///   883 IOPS and 32 MiB to 97 against 102; queued one at a time there, 1 MiB fell to
    ///   2,981 against 3,322 and 4 MiB to 805 against 844 at 9% more CPU a write. Why the
    ///   writer thread loses at these sizes was not found.
    /// - At most [`WRITE_BESIDE_BACKLOG`] queued; a write beyond it is copied on the
    ///   connection's thread, which meanwhile receives nothing. With no bound, the
    ///   connection received far ahead of the copy, whose source then came from memory
    ///   instead of the cache: the copy into the page cache took 25% of the samples
    ///   against 9%, and 4 MiB writes fell to 664 IOPS, 32 MiB to 74 (833 and 101
    ///   copied on the connection's thread, 903 and 101 with the bound, in that run).
    /// - `spawn_blocking` allocates its task: one allocation per write of 1 MiB or more,
    ///   the only one a large request makes (`tests/allocations.rs`). Through the ring
    ///   instead (no allocation, and io-wq runs one file's buffered writes one at a
    ///   time), 1 MiB writes were as fast but 4 MiB fell to 779 against 893 and 32 MiB to
    ///   89 against 104.
    async fn write_beside(
        &self,
        offset: u64,
        data: WriteData,
        place: BacklogPlace,
    ) -> Result<(), BackendError> {
        let length = data.len() as u64;
        #[cfg(test)]
        self.writes_beside.fetch_add(1, Ordering::Relaxed);
        // The turn, the place and the dirty mark go with the copy: should this future be
        // dropped once the copy began, it still runs to its end, no other starts beside it
        // or counts it gone meanwhile, and the next FLUSH still syncs what it wrote. On
        // the writer thread, a copy not yet begun is skipped instead (`super::beside`).
        let mut copy = CopyBeside {
            offset,
            data,
            dirty: Arc::clone(&self.dirty),
            held: (None, place),
            #[cfg(test)]
            ended: Arc::clone(&self.copies_beside_ended),
        };
        // Before the turn: a copy that came earlier may itself wait for it.
        copy.held.1.registered.wait_for_earlier().await;
        if length >= WRITE_BESIDE_TURN as u64 {
            let turn = Arc::clone(&self.beside_turn).acquire_owned().await;
            copy.held.0 = Some(turn.expect("the semaphore of writes beside is never closed"));
            self.blocking("write", offset, length, move |file| copy.run(file))
                .await?;
        } else if let Some(writer) = self.writer() {
            writer
                .submit(copy)
                .await
                .map_err(|e| BackendError::io("write", offset, length, e))?;
        } else {
            copy.run(&self.file)
                .map_err(|e| BackendError::io("write", offset, length, e))?;
        }
        self.write_behind(length);
        Ok(())
    }

    /// The export's writer thread, started on first use; `None` if it could not be
    /// started (its writes are then copied on the connection's thread, as smaller ones
    /// are). A failed start (threads exhausted for a moment) is tried again after
    /// [`WRITER_RETRY`], not on every write meanwhile.
    fn writer(&self) -> Option<&Writer<CopyBeside>> {
        if let Some(writer) = self.writer.get() {
            return Some(writer);
        }
        let mut retry_at = self.writer_start.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(writer) = self.writer.get() {
            return Some(writer);
        }
        if retry_at.is_some_and(|at| std::time::Instant::now() < at) {
            return None;
        }
        #[cfg(test)]
        let started = if self.fail_writer_start.swap(false, Ordering::AcqRel) {
            Err(std::io::Error::from_raw_os_error(libc::EAGAIN))
        } else {
            Writer::start(Arc::clone(&self.file), "netblk-writer")
        };
        #[cfg(not(test))]
        let started = Writer::start(Arc::clone(&self.file), "netblk-writer");
        match started {
            Ok(writer) => {
                *retry_at = None;
                Some(self.writer.get_or_init(|| writer))
            }
            Err(e) => {
                tracing::warn!(
                    "{}: no thread for copying large writes ({e}); they are copied on the \
                     connections' threads, and the thread is tried again in {:?}",
                    self.path.display(),
                    WRITER_RETRY
                );
                *retry_at = Some(std::time::Instant::now() + WRITER_RETRY);
                None
            }
        }
    }

    /// Counts `written` bytes toward [`WriteBehind`], and starts writeback of the file's
    /// dirty pages in the background when enough have come.
    fn write_behind(&self, written: u64) {
        let behind = &self.behind;
        if behind.written.fetch_add(written, Ordering::AcqRel) + written < WRITE_BEHIND
            || !behind.clients_flush()
            || behind.running.swap(true, Ordering::AcqRel)
        {
            return;
        }
        behind.written.store(0, Ordering::Release);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            behind.running.store(false, Ordering::Release);
            return;
        };
        let (ring, file, behind) = (
            Arc::clone(&self.ring),
            Arc::clone(&self.file),
            Arc::clone(&self.behind),
        );
        runtime.spawn(async move {
            if let Err(e) = ring.start_writeback(&file, 0, 0).await {
                tracing::debug!("starting writeback failed: {e}");
            }
            behind.running.store(false, Ordering::Release);
        });
    }

    /// A direct-I/O write of whole blocks; the data is copied into an aligned buffer when
    /// it does not start on one.
    async fn write_blocks(&self, offset: u64, data: WriteData) -> Result<(), BackendError> {
        let data = if data.as_ptr() as usize % self.memory_align == 0 {
            data
        } else {
            // Moved here so that it is let go of now, not after the write: a payload shared
            // out of a connection's read buffer keeps that buffer from being reused.
            let unaligned = data;
            let mut aligned = Buffer::take(unaligned.len());
            aligned.as_mut().copy_from_slice(&unaligned);
            WriteData::from(aligned.share())
        };
        self.write_through_ring(offset, data).await
    }

    /// A direct-I/O write that does not cover whole blocks: read the blocks it touches,
    /// patch in the data, write them back, with the blocks held exclusively throughout.
    async fn read_modify_write(&self, offset: u64, data: WriteData) -> Result<(), BackendError> {
        let (start, end) = self.covering(offset, data.len() as u64);
        let _held = self.locks.lock(start, end, true).await;
        let span = (end - start) as usize;
        let mut blocks = Buffer::take(span);
        let block = self.block as usize;
        let head = (offset - start) as usize;
        let tail = head + data.len();
        // Only the first and last blocks hold bytes the client did not send.
        if head % block != 0 || span == block {
            let first = self.read_into(start, Buffer::take(block)).await?;
            blocks.as_mut()[..block].copy_from_slice(first.as_ref());
        }
        if tail % block != 0 && span > block {
            let last = self
                .read_into(end - self.block, Buffer::take(block))
                .await?;
            blocks.as_mut()[span - block..].copy_from_slice(last.as_ref());
        }
        blocks.as_mut()[head..tail].copy_from_slice(&data);
        self.write_through_ring(start, blocks.share().into()).await
    }

    /// After a trim or zeroing: remember there is something to sync, and sync now for FUA.
    async fn after_change(
        &self,
        op: &'static str,
        offset: u64,
        length: u64,
        fua: bool,
    ) -> Result<(), BackendError> {
        self.dirty.mark();
        if fua {
            self.sync(op, offset, length).await?;
        }
        Ok(())
    }

    /// A FUA write in page-cache mode: a copy into the page cache (on this thread, as a
    /// write without FUA), then a sync of the write's own range through the ring (the
    /// `vfs_fsync_range` that `RWF_DSYNC` runs, so no dirty page elsewhere is waited for:
    /// 0.5–0.9 ms against 422–578 ms with 1 GiB dirty elsewhere), in flight as a sync: its
    /// failure is recorded, and its success waits for the syncs beside it
    /// ([`SyncsInFlight`]).
    ///
    /// Two steps, not one `RWF_DSYNC` write: the copy's errors are this write's own (no
    /// space for it, a block it could not read first), which say nothing of the writes
    /// before it, while one write's errno cannot tell them from a failed writeback. Until
    /// session 68 it was one, and a FUA write into a full file system (or a bad sector)
    /// stopped every FLUSH of the export until a restart (found by review).
    async fn fua_write_to_page_cache(
        &self,
        offset: u64,
        data: WriteData,
    ) -> Result<(), BackendError> {
        let length = data.len() as u64;
        if let Some(lost) = self.lost.error() {
            return Err(BackendError::io("write", offset, length, lost));
        }
        if let Err(e) = self.write_to_page_cache(offset, &data) {
            // Part of it may be in the page cache (as in `copy_to_page_cache`).
            self.dirty.mark();
            return Err(e);
        }
        let ticket = self.syncs.start();
        // At most MAX_PAYLOAD bytes, far below 4 GiB.
        let synced = self
            .ring
            .fdatasync_range(&self.file, offset, length as u32)
            .await;
        if let Err(e) = &synced {
            self.sync_failed(e);
            // The copy stays in the page cache: the next FLUSH must sync it (a range sync
            // the ring never took records nothing, and would leave it unsynced).
            self.dirty.mark();
        }
        let beside = ticket.end();
        synced.map_err(|e| BackendError::io("write", offset, length, e))?;
        self.after_syncs_beside(beside, "write", offset, length)
            .await
    }

    /// Waits for the syncs that ran beside one that succeeded (numbered below `beside`),
    /// and fails if a failure was recorded meanwhile.
    async fn after_syncs_beside(
        &self,
        beside: u64,
        op: &'static str,
        offset: u64,
        length: u64,
    ) -> Result<(), BackendError> {
        self.syncs.wait_for_those_before(beside).await;
        match self.lost.error() {
            Some(lost) => Err(BackendError::io(op, offset, length, lost)),
            None => Ok(()),
        }
    }

    /// Makes every write completed so far durable (`fdatasync`), unless a sync already
    /// did. A failure is recorded before the sync ends; a success answers once the syncs
    /// beside it have ended without one ([`SyncsInFlight`]).
    async fn sync(&self, op: &'static str, offset: u64, length: u64) -> Result<(), BackendError> {
        if let Some(lost) = self.lost.error() {
            return Err(BackendError::io(op, offset, length, lost));
        }
        let Some(target) = self.dirty.sync_target() else {
            return Ok(());
        };
        let ticket = self.syncs.start();
        let synced = self.ring.fsync(&self.file, true).await;
        if let Err(e) = &synced {
            self.sync_failed(e);
        }
        let beside = ticket.end();
        synced.map_err(|e| BackendError::io(op, offset, length, e))?;
        self.after_syncs_beside(beside, op, offset, length).await?;
        self.dirty.synced(target);
        Ok(())
    }

    /// A sync (or a FUA write in writeback mode) failed with `error`: FLUSH fails from now
    /// on ([`LostWriteback`]), unless the sync never reached the kernel (the ring could not
    /// take it), which says nothing of the data written before: the next FLUSH tries again.
    fn sync_failed(&self, error: &std::io::Error) {
        if !super::uring::reached_the_kernel(error) {
            return;
        }
        if self.lost.record(error) {
            tracing::error!(
                "{}: a sync failed ({error}): writes acknowledged before it may not be on the \
                 device, and the kernel reports that only once, so every FLUSH on this \
                 export fails from now on; check the device, then restart",
                self.path.display()
            );
        }
    }

    /// Runs blocking file work on tokio's blocking pool.
    async fn blocking<T: Send + 'static>(
        &self,
        op: &'static str,
        offset: u64,
        length: u64,
        work: impl FnOnce(&File) -> std::io::Result<T> + Send + 'static,
    ) -> Result<T, BackendError> {
        let file = Arc::clone(&self.file);
        match tokio::task::spawn_blocking(move || work(&file)).await {
            Ok(result) => result.map_err(|e| BackendError::io(op, offset, length, e)),
            Err(join) => Err(BackendError::io(
                op,
                offset,
                length,
                std::io::Error::other(join.to_string()),
            )),
        }
    }
}

/// A write for the export's writer thread ([`FileBackend::write_beside`]).
struct CopyBeside {
    offset: u64,
    data: WriteData,
    dirty: Arc<DirtyTracker>,
    /// The write's turn (the largest only) and its place in the backlog, given back once
    /// it is copied.
    held: (Option<tokio::sync::OwnedSemaphorePermit>, BacklogPlace),
    #[cfg(test)]
    ended: Arc<AtomicU64>,
}

impl Job for CopyBeside {
    fn run(self, file: &File) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let written = file.write_all_at(&self.data, self.offset);
        // Failed or not: a copy that failed part way left its first bytes in the page
        // cache (as in `FileBackend::copy_to_page_cache`).
        self.dirty.mark();
        #[cfg(test)]
        self.ended.fetch_add(1, Ordering::Release);
        drop(self.held);
        written
    }
}

/// A write's place in the backlog of [`FileBackend::write_beside`] (one for the whole
/// export) and in the order of starting ([`super::change_order`]), given back when dropped:
/// when its copy ends, or when its future is dropped before the copy began.
struct BacklogPlace {
    backlog: Arc<AtomicUsize>,
    length: usize,
    registered: change_order::Registered,
}

impl Drop for BacklogPlace {
    fn drop(&mut self) {
        self.backlog.fetch_sub(self.length, Ordering::AcqRel);
    }
}

/// The length of a regular file now shorter than its export's `size` (shrunk under it),
/// or `None`.
fn shrunk_to(file: &File, size: u64) -> Option<u64> {
    let now = rustix::fs::fstat(file).map_or(0, |stat| stat.st_size as u64);
    (now < size).then_some(now)
}

/// The error for data that ends before the export's `size` (a file or device shrunk
/// while exported).
fn ends_early(path: &Path, size: u64) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        format!(
            "{} ends before its exported size of {size} bytes: shrunk while exported?",
            path.display()
        ),
    )
}

fn errno(e: rustix::io::Errno) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.raw_os_error())
}

/// Most runs one allocation query returns (see [`super::MAX_EXTENTS`]).
const MAX_RUNS: usize = super::MAX_EXTENTS;

/// Where data and holes lie from `offset`, as (length, is_hole) runs covering at most
/// `length` bytes and at least one byte (fewer than `length` past [`MAX_RUNS`] runs). One
/// run (all data, the common case) is kept without an allocation: a `--cache=none` read
/// of 512 KiB or more asks this of every piece.
fn allocation_runs(file: &File, offset: u64, length: u64) -> std::io::Result<super::Runs> {
    let end = offset + length;
    let mut runs = super::Runs::new();
    let mut at = offset;
    while at < end && runs.len() < MAX_RUNS {
        let data_start = match rustix::fs::seek(file, rustix::fs::SeekFrom::Data(at as i64)) {
            Ok(pos) => pos.min(end),
            Err(rustix::io::Errno::NXIO) => end, // no data after `at`
            Err(e) => return Err(errno(e)),
        };
        if data_start > at {
            runs.push(((data_start - at) as usize, true));
            at = data_start;
            continue;
        }
        let hole_start = match rustix::fs::seek(file, rustix::fs::SeekFrom::Hole(at as i64)) {
            Ok(pos) => pos.min(end),
            Err(rustix::io::Errno::NXIO) => end,
            Err(e) => return Err(errno(e)),
        };
        let hole_start = hole_start.max(at + 1).min(end);
        runs.push(((hole_start - at) as usize, false));
        at = hole_start;
    }
    Ok(runs)
}

/// Reads from the page cache if that needs no waiting; `None` if it would block, came up
/// short, or the kernel does not support `RWF_NOWAIT` here.
fn read_without_blocking(file: &File, offset: u64, length: usize) -> Option<Buffer> {
    // A pooled buffer holds old data: it is used only if the read fills all of it.
    let mut buffer = Buffer::take(length);
    let mut slices = [std::io::IoSliceMut::new(buffer.as_mut())];
    match rustix::io::preadv2(
        file,
        &mut slices,
        offset,
        rustix::io::ReadWriteFlags::NOWAIT,
    ) {
        Ok(n) if n == length => Some(buffer),
        _ => None,
    }
}

/// A number from the sysfs directory of block device `device` (`/sys/dev/block/M:m/NAME`).
fn device_attribute(device: u64, name: &str) -> Option<u64> {
    let (major, minor) = (rustix::fs::major(device), rustix::fs::minor(device));
    std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/{name}"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// How a block device discards: by whole granules of `granule` bytes, the first whole one
/// starting `alignment` bytes into the device. sysfs' `discard_alignment` of a partition
/// is that distance: the kernel computes it as (granule − start mod granule) mod granule
/// (`queue_limit_discard_alignment`), whatever its ABI text suggests (review, session 73:
/// the opposite reading put every discard across two granules on a partition that starts
/// 16 KiB into a 64 KiB granule).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DiscardGranules {
    granule: u64,
    alignment: u64,
}

impl DiscardGranules {
    /// What sysfs says of `file`'s device, whose blocks are `block` bytes; `None` when it
    /// takes no discards (or sysfs cannot tell).
    fn of(file: &File, block: u64) -> Option<DiscardGranules> {
        let device = rustix::fs::fstat(file).ok()?.st_rdev;
        if queue_attribute(device, "discard_max_bytes")? == 0 {
            return None;
        }
        let granule = queue_attribute(device, "discard_granularity")
            .unwrap_or(0)
            .max(block);
        let alignment = device_attribute(device, "discard_alignment").unwrap_or(0) % granule;
        Some(DiscardGranules { granule, alignment })
    }

    /// The whole granules within `offset..offset + length`, as a range (empty, at the
    /// range's end, when there is none).
    fn within(self, offset: u64, length: u64) -> (u64, u64) {
        let DiscardGranules { granule, alignment } = self;
        let end = offset + length;
        // How far `at` lies past the granule boundary at or below it (boundaries lie at
        // `alignment` plus multiples of `granule`; below the first, a partial one at 0).
        let past = |at: u64| (at + granule - alignment) % granule;
        let first = offset + (granule - past(offset)) % granule;
        // A range that ends before the first boundary has none: `end - past(end)` would
        // wrap (review: a 100-byte TRIM at 0 asked the device to discard 2^64 bytes, and
        // the node's disk was detached on its EINVAL).
        match end.checked_sub(past(end)) {
            Some(last) if first < last => (first, last),
            _ => (end, end),
        }
    }
}

/// A number from the request queue of block device `device` in sysfs; a partition's queue
/// is its disk's, one level up.
fn queue_attribute(device: u64, name: &str) -> Option<u64> {
    device_attribute(device, &format!("queue/{name}"))
        .or_else(|| device_attribute(device, &format!("../queue/{name}")))
}

/// `BLKDISCARD` from linux/fs.h: `_IO(0x12, 119)`, whose argument points at the start and
/// length in bytes.
const BLKDISCARD: rustix::ioctl::RawOpcode = 0x1277;

/// Discards `length` bytes at `offset` of a block device (whole logical blocks; EOPNOTSUPP
/// where the device cannot discard). The one ioctl here without a rustix wrapper.
#[allow(unsafe_code)]
fn discard(file: &File, offset: u64, length: u64) -> rustix::io::Result<()> {
    use rustix::ioctl::{ioctl, BadOpcode, Setter};
    // SAFETY: BLKDISCARD reads two u64 (start and length in bytes) through its argument,
    // which `Setter` points at the array it owns for the length of the call; the kernel
    // neither writes through it nor keeps it.
    unsafe {
        ioctl(
            file,
            Setter::<BadOpcode<BLKDISCARD>, [u64; 2]>::new([offset, length]),
        )
    }
}

/// Where a direct-I/O file wants its offsets and memory aligned: what `statx` reports, else
/// the device's logical block size, else a page (always safe).
fn direct_io_alignment(file: &File, block_device: bool) -> (u64, usize) {
    if let Ok(stat) = rustix::fs::statx(
        file,
        "",
        rustix::fs::AtFlags::EMPTY_PATH,
        rustix::fs::StatxFlags::DIOALIGN,
    ) {
        if stat.stx_mask & rustix::fs::StatxFlags::DIOALIGN.bits() != 0
            && stat.stx_dio_offset_align > 0
        {
            return (
                u64::from(stat.stx_dio_offset_align),
                (stat.stx_dio_mem_align as usize).clamp(1, ALIGN),
            );
        }
    }
    if block_device {
        if let Ok(size) = rustix::fs::ioctl_blksszget(file) {
            return (u64::from(size), (size as usize).clamp(1, ALIGN));
        }
    }
    (ALIGN as u64, ALIGN)
}

impl Backend for FileBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            rotational: self.rotational,
            zeroing_trim: !self.block_device || self.device_discards().is_some(),
            ..Capabilities::full_store(self.read_only)
        }
    }

    fn read(&self, offset: u64, length: usize) -> BackendFuture<'_, ReadData> {
        match self.read_at_once(offset, length) {
            Some(done) => inline_backend_future(std::future::ready(done)),
            None => self.read_declined(offset, length),
        }
    }

    fn read_at_once(&self, offset: u64, length: usize) -> Option<Result<ReadData, BackendError>> {
        if self.cache != CacheMode::Writeback || length >= NOWAIT_READ_MAX {
            return None;
        }
        #[cfg(test)]
        self.nowait_tries
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        read_without_blocking(&self.file, offset, length)
            .map(|buffer| Ok(ReadData::dense(buffer.share())))
    }

    fn read_declined(&self, offset: u64, length: usize) -> BackendFuture<'_, ReadData> {
        inline_backend_future(async move {
            let dense: super::Runs = smallvec::smallvec![(length, false)];
            // Holes read as zeroes anyway; knowing where they are lets the reply skip them.
            let runs = if length >= HOLE_QUERY_MIN && !self.block_device {
                match allocation_runs(&self.file, offset, length as u64) {
                    Ok(runs) if runs.iter().map(|r| r.0).sum::<usize>() == length => runs,
                    _ => dense,
                }
            } else {
                dense
            };
            let (start, end) = self.covering(offset, length as u64);
            let blocks = self
                .read_into(start, Buffer::take((end - start) as usize))
                .await
                .map_err(|e| e.of_request("read", offset, length as u64))?;
            let head = (offset - start) as usize;
            let data = blocks.share().slice(head, length);
            Ok(ReadData {
                data: data.into(),
                runs,
            })
        })
    }

    fn read_to_pipe(&self, offset: u64, length: usize) -> Option<super::splice::Spliced> {
        // Only cached data can be spliced without blocking, and direct I/O bypasses the
        // cache. Cached holes read as zeroes and go out as data, which is correct; an
        // uncached range (holes never read are never cached) takes the copying path,
        // which reports holes as holes.
        if !self.can_splice() || length < super::splice::SPLICE_MIN {
            return None;
        }
        // After a read error a cached page may be unreadable: splicing it would read the
        // device again on the connection's thread, to fail (see `stop_mapped_reads`).
        if self.mapped_reads_off.load(Ordering::Relaxed) {
            return None;
        }
        super::splice::splice_cached(&self.file, offset, length)
    }

    fn read_mapped(&self, offset: u64, length: usize) -> Option<ReadData> {
        // A read of less than a page stays with `preadv2` (clients read whole blocks).
        if length < MAPPED_READ_MIN {
            return None;
        }
        let mapping = self.mapping.as_ref()?;
        if self.mapped_reads_off.load(Ordering::Relaxed) {
            return None;
        }
        // Only cached pages: an uncached one would make the socket's copy wait on the
        // device inside `writev`, with the connection's thread blocked. Cached holes read
        // as zeroes and go out as data, which is correct (as for splicing). Checked before
        // the part takes its reference to the mapping, which an uncached read would drop.
        if super::splice::cached(&self.file, offset, length as u64) != Some(true) {
            return None;
        }
        let part = mapping.part(offset, length)?;
        Some(ReadData::dense(Pieces::Mapped(part)))
    }

    fn can_splice(&self) -> bool {
        self.cache == CacheMode::Writeback
    }

    fn all_cached(&self, offset: u64, length: u64) -> bool {
        // After a read error a cached page may not be readable (see `stop_mapped_reads`).
        self.cache == CacheMode::Writeback
            && !self.mapped_reads_off.load(Ordering::Relaxed)
            && super::splice::cached(&self.file, offset, length) == Some(true)
    }

    fn mapped_send_failed(&self, error: &std::io::Error) {
        self.stop_mapped_reads(&format_args!(
            "a cached read sent from the mapping failed ({error})"
        ));
    }

    fn write(&self, offset: u64, data: WriteData, fua: bool) -> BackendFuture<'_, ()> {
        if let Some(place) = self.place_beside(offset, data.len(), fua) {
            return inline_backend_future(self.write_beside(offset, data, place));
        }
        // Over a change still under way, the write takes its place after it (rarely: a
        // future that may be boxed).
        match self
            .change_order
            .register_if_over(offset, offset + data.len() as u64)
        {
            None => self.write_in_turn(offset, data, fua),
            Some(turn) => backend_future(async move {
                turn.wait_for_earlier().await;
                self.write_in_turn(offset, data, fua).await
            }),
        }
    }

    fn write_inline(
        &self,
        offset: u64,
        data: &[u8],
        fua: bool,
    ) -> Option<Result<(), BackendError>> {
        // A write without FUA in writeback mode is a copy into the page cache; `write`
        // takes this path too. Over a change still under way (a copy beside, a TRIM), it
        // is made after that change, by `write`.
        if self.cache != CacheMode::Writeback
            || fua
            || self
                .change_order
                .any_over(offset, offset + data.len() as u64)
        {
            return None;
        }
        Some(self.copy_to_page_cache(offset, data))
    }

    fn flush(&self) -> BackendFuture<'_, ()> {
        inline_backend_future(async move {
            if self.cache == CacheMode::Writeback {
                self.behind.flush_seen();
            }
            self.sync("flush", 0, 0).await
        })
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> BackendFuture<'_, ()> {
        let turn = self.change_in_order(offset, length);
        backend_future(async move {
            if let Some(turn) = &turn {
                turn.wait_for_earlier().await;
            }
            let _held = self.lock_shared(offset, length).await;
            // A device discards whole blocks only; the rest of the range keeps its data,
            // which TRIM allows.
            let (start, end) = self.fallocate_range(offset, length);
            if start == end {
                return Ok(());
            }
            // TRIM is advisory: a store that cannot discard keeps the data.
            let discarded = self
                .discard_blocks("trim", offset, length, start, end)
                .await?;
            if discarded {
                self.after_change("trim", offset, length, fua).await?;
            }
            Ok(())
        })
    }

    /// A file punches a hole, as WRITE_ZEROES without NO_HOLE does. A device that takes
    /// discards discards the whole granules of the range, trusted to read back as zeroes
    /// after (as DRBD's default `discard-zeroes-if-aligned` trusts them), and has the rest
    /// written as zeroes, so that its blocks are unmapped as a TRIM's would be: a zeroing
    /// instead would make a thin LUN that does not read zeroes after an unmap allocate
    /// them (SCSI WRITE SAME without UNMAP), and a disk with WRITE SAME but no discard
    /// write every block of mkfs's whole-device discard. A device that does not discard
    /// writes zeroes (a replicated export there does not offer TRIM), as does a device
    /// that refuses a discard after all.
    fn trim_to_zeroes(&self, offset: u64, length: u64, fua: bool) -> BackendFuture<'_, ()> {
        let zeroing = ZeroFlags {
            may_trim: true,
            fast: false,
            fua,
        };
        let Some(granules) = self.device_discards().filter(|_| self.block_device) else {
            return self.write_zeroes(offset, length, zeroing);
        };
        let turn = self.change_in_order(offset, length);
        backend_future(async move {
            if let Some(turn) = &turn {
                turn.wait_for_earlier().await;
            }
            let range_end = offset + length;
            let (start, end) = granules.within(offset, length);
            if start < end {
                let held = self.lock_shared(start, end - start).await;
                let discarded = self
                    .discard_blocks("trim", offset, length, start, end)
                    .await?;
                drop(held);
                if !discarded {
                    return self.zero_range(offset, length, zeroing).await;
                }
            }
            // The partial granules at the ends, then one sync for all of it.
            let unsynced = ZeroFlags {
                fua: false,
                ..zeroing
            };
            for (at, to) in [(offset, start), (end, range_end)] {
                if at < to {
                    self.zero_range(at, to - at, unsynced).await?;
                }
            }
            self.after_change("trim", offset, length, fua).await
        })
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BackendFuture<'_, ()> {
        let turn = self.change_in_order(offset, length);
        backend_future(async move {
            if let Some(turn) = &turn {
                turn.wait_for_earlier().await;
            }
            self.zero_range(offset, length, flags).await
        })
    }

    fn cache(&self, offset: u64, length: u64) -> BackendFuture<'_, ()> {
        backend_future(self.blocking("cache", offset, length, move |file| {
            rustix::fs::fadvise(file, offset, length, rustix::fs::Advice::WillNeed).map_err(errno)
        }))
    }

    fn extents(&self, offset: u64, length: u64) -> BackendFuture<'_, Vec<Extent>> {
        let block_device = self.block_device;
        let (size, path) = (self.size, self.path.clone());
        backend_future(self.blocking("block status", offset, length, move |file| {
            if block_device {
                return Ok(vec![Extent {
                    length,
                    hole: false,
                    zero: false,
                }]);
            }
            // Past the end of a file shrunk under the export, `SEEK_DATA` finds no data,
            // and the range would be reported a hole that reads as zeroes: tools that
            // trust block status then copy zeroes without reading (re-review, session 68;
            // reads there fail with EIO, `past_the_end`).
            if shrunk_to(file, size).is_some_and(|now| offset + length > now) {
                return Err(ends_early(&path, size));
            }
            let runs = allocation_runs(file, offset, length)?;
            Ok(runs
                .into_iter()
                .map(|(length, hole)| Extent {
                    length: length as u64,
                    hole,
                    zero: hole,
                })
                .collect())
        }))
    }

    fn poll_completions(&self) -> Option<u64> {
        Some(self.ring.reap_posted())
    }

    fn completes_through_ring(&self) -> bool {
        self.cache == CacheMode::None
    }

    fn wants_pooled_payloads(&self) -> bool {
        self.cache == CacheMode::None
    }

    fn flush_ahead_pays(&self) -> bool {
        true
    }

    fn flush_stopped(&self) -> Option<std::io::Error> {
        self.lost.error()
    }
}

impl std::fmt::Debug for FileBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileBackend")
            .field("path", &self.path)
            .field("size", &self.size)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::os::unix::fs::FileExt;

    fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
        crate::test_runtime().block_on(f)
    }

    const MODES: [CacheMode; 2] = [CacheMode::Writeback, CacheMode::None];

    /// A new export of `size` bytes in a directory of its own (removed when the returned
    /// directory is dropped), in `mode` or the default cache mode.
    fn new_export(
        size: u64,
        mode: Option<CacheMode>,
    ) -> (tempfile::TempDir, std::path::PathBuf, FileBackend) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        let backend = FileBackend::open(&path, Some(size), false, mode).unwrap();
        (dir, path, backend)
    }

    #[test]
    fn a_missing_file_is_created_sparse_and_an_existing_one_is_never_resized() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        assert!(FileBackend::open(&path, None, false, None).is_err());
        let b = FileBackend::open(&path, Some(1 << 20), false, None).unwrap();
        assert_eq!(b.size(), 1 << 20);
        assert_eq!(
            b.cache_mode(),
            CacheMode::Writeback,
            "files default to writeback"
        );
        let err = FileBackend::open(&path, Some(2 << 20), false, None).unwrap_err();
        assert!(err.to_string().contains("never resizes"), "{err}");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
    }

    /// Dirty pages of the file, or `None` where the kernel cannot tell.
    fn dirty_pages(file: &File) -> Option<u64> {
        super::super::splice::cachestat(file, 0, 0).map(|c| c.nr_dirty + c.nr_writeback)
    }

    #[test]
    fn writes_behind_only_once_clients_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        let size = 3 * WRITE_BEHIND;
        let b = FileBackend::open(&path, Some(size), false, None).unwrap();
        let file = Arc::clone(&b.file);
        let Some(_) = dirty_pages(&file) else {
            eprintln!("no cachestat here: dirty pages cannot be watched");
            return;
        };
        let page = rustix::param::page_size() as u64;
        let chunk = 4 << 20;
        let write_range = |from: u64| {
            let b = &b;
            async move {
                for at in (from..from + WRITE_BEHIND + chunk).step_by(chunk as usize) {
                    b.write(at, Bytes::from(vec![1u8; chunk as usize]).into(), false)
                        .await
                        .unwrap();
                }
            }
        };
        block_on(async {
            // No FLUSH yet: what was written stays dirty, for the kernel to write back.
            write_range(0).await;
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            let dirty = dirty_pages(&file).unwrap() * page;
            assert!(
                dirty > WRITE_BEHIND,
                "{dirty} bytes dirty: written behind unasked"
            );
            // A FLUSH writes it all; after it, the next WRITE_BEHIND bytes start writeback.
            b.flush().await.unwrap();
            write_range(WRITE_BEHIND + chunk).await;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let dirty = dirty_pages(&file).unwrap() * page;
                if dirty < WRITE_BEHIND / 2 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "{dirty} bytes still dirty: nothing was written behind"
                );
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        });
    }

    #[test]
    fn direct_io_refuses_a_file_that_is_not_whole_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("odd.img");
        std::fs::write(&path, vec![1u8; 1000]).unwrap();
        let err = FileBackend::open(&path, None, false, Some(CacheMode::None)).unwrap_err();
        assert!(format!("{err:#}").contains("--cache=writeback"), "{err:#}");
        assert!(FileBackend::open(&path, None, false, Some(CacheMode::Writeback)).is_ok());
    }

    /// Page-cache writes of [`WRITE_BESIDE_MIN`] or more are copied beside the
    /// connection's thread while the backlog has room, and land; smaller ones, FUA ones,
    /// direct-I/O ones and those beyond the backlog are copied as before, and land too. A
    /// write's place in the backlog is given back when it ends, and when its future is
    /// dropped unpolled. Both sizes beside: those for the writer thread, and those for
    /// the blocking pool ([`WRITE_BESIDE_TURN`]).
    #[test]
    fn large_page_cache_writes_are_copied_beside_within_a_bounded_backlog() {
        for (big, mode) in [WRITE_BESIDE_MIN, WRITE_BESIDE_TURN]
            .into_iter()
            .flat_map(|big| MODES.map(|mode| (big, mode)))
        {
            let (_dir, _path, b) = new_export(4 * big as u64, Some(mode));
            let beside = || b.writes_beside.load(Ordering::Relaxed);
            let queued = || b.beside_backlog.load(Ordering::Acquire);
            block_on(async {
                let expect_beside = u64::from(mode == CacheMode::Writeback);
                b.write(0, Bytes::from(vec![1u8; big]).into(), false)
                    .await
                    .unwrap();
                assert_eq!(beside(), expect_beside, "{mode}: {big} bytes go beside");
                assert_eq!(queued(), 0, "{mode}: its place is given back");
                let small = WRITE_BESIDE_MIN / 2;
                b.write(big as u64, Bytes::from(vec![2u8; small]).into(), false)
                    .await
                    .unwrap();
                b.write(2 * big as u64, Bytes::from(vec![3u8; big]).into(), true)
                    .await
                    .unwrap();
                assert_eq!(beside(), expect_beside, "{mode}: small and FUA stay");
                // A full backlog: the write is copied on the calling thread.
                b.beside_backlog
                    .store(WRITE_BESIDE_BACKLOG, Ordering::Release);
                b.write(3 * big as u64, Bytes::from(vec![4u8; big]).into(), false)
                    .await
                    .unwrap();
                assert_eq!(beside(), expect_beside, "{mode}: no room, no hand-off");
                b.beside_backlog.store(0, Ordering::Release);
                let r = b.read(0, 4 * big).await.unwrap();
                let bytes = r.bytes();
                assert!(bytes[..big].iter().all(|&x| x == 1), "{mode}");
                assert!(bytes[big..big + small].iter().all(|&x| x == 2), "{mode}");
                assert!(bytes[big + small..2 * big].iter().all(|&x| x == 0));
                assert!(bytes[2 * big..3 * big].iter().all(|&x| x == 3), "{mode}");
                assert!(bytes[3 * big..].iter().all(|&x| x == 4), "{mode}");
            });
            let unpolled = b.write(0, Bytes::from(vec![5u8; big]).into(), false);
            let expect_queued = if mode == CacheMode::Writeback { big } else { 0 };
            assert_eq!(queued(), expect_queued, "{mode}: a place taken at once");
            drop(unpolled);
            assert_eq!(queued(), 0, "{mode}: a dropped write gives its place back");
        }
    }

    /// A write beside whose future is dropped after the copy began: the copy runs to
    /// its end, and its place in the backlog is given back only then (so whenever the
    /// backlog reads empty, the data is all there), and the next write beside is not
    /// held up. On the writer thread, a copy not yet begun is skipped instead: never
    /// torn, and its place given back.
    #[test]
    fn a_write_beside_dropped_while_copying_still_lands_and_gives_its_place_back() {
        // The blocking pool's size, then the writer thread's.
        for big in [WRITE_BESIDE_BACKLOG, WRITE_BESIDE_TURN - 4096] {
            dropped_write_beside_lands(big);
        }
    }

    fn dropped_write_beside_lands(big: usize) {
        let (_dir, _path, b) = new_export(2 * big as u64, Some(CacheMode::Writeback));
        block_on(async {
            let mut write = Box::pin(b.write(0, Bytes::from(vec![7u8; big]).into(), false));
            // Polled once (the copy is handed over), then dropped.
            let pending = std::future::poll_fn(|cx| {
                let polled = std::future::Future::poll(write.as_mut(), cx);
                std::task::Poll::Ready(polled.is_pending())
            })
            .await;
            // The blocking pool's copy (8 MiB) has begun and is still running; the writer
            // thread's may not have begun, and is then skipped.
            let begun = big >= WRITE_BESIDE_TURN;
            assert!(pending || !begun, "an 8 MiB copy is still running");
            drop(write);
            assert_eq!(b.writes_beside.load(Ordering::Relaxed), 1);
            // The place is held for as long as a begun copy runs.
            let queued = b.beside_backlog.load(Ordering::Acquire);
            let ended = b.copies_beside_ended.load(Ordering::Acquire);
            assert!(
                queued == big || ended == 1 || !begun,
                "place given back mid-copy"
            );
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while b.beside_backlog.load(Ordering::Acquire) != 0 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "place never given back"
                );
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            let r = b.read(0, big).await.unwrap();
            let landed = r.bytes().iter().filter(|&&x| x == 7).count();
            if begun {
                assert_eq!(landed, big, "the backlog emptied before the copy ended");
            } else {
                assert!(landed == 0 || landed == big, "skipped or whole: {landed}");
            }
            if landed == big {
                assert!(
                    b.dirty.sync_target().is_some(),
                    "the next FLUSH syncs what the dropped write copied"
                );
            }
            b.write(big as u64, Bytes::from(vec![8u8; big]).into(), false)
                .await
                .unwrap();
            assert_eq!(b.writes_beside.load(Ordering::Relaxed), 2);
        });
    }

    /// A writer thread that could not be started: the write is copied on the calling
    /// thread and lands, the start is not tried again on every write, and it is tried
    /// again once [`WRITER_RETRY`] has passed. Before, the failure was kept for the life
    /// of the export.
    #[test]
    fn a_writer_thread_that_failed_to_start_is_tried_again() {
        let size = WRITE_BESIDE_MIN;
        let (_dir, _path, b) = new_export(4 * size as u64, Some(CacheMode::Writeback));
        b.fail_writer_start.store(true, Ordering::Release);
        let write = |at: usize, byte: u8| {
            block_on(b.write(at as u64, Bytes::from(vec![byte; size]).into(), false)).unwrap()
        };
        write(0, 1);
        assert!(b.writer.get().is_none(), "the start failed");
        write(size, 2);
        assert!(
            b.writer.get().is_none(),
            "not tried again before WRITER_RETRY"
        );
        // As if WRITER_RETRY had passed.
        *b.writer_start.lock().unwrap() = Some(std::time::Instant::now());
        write(2 * size, 3);
        assert!(b.writer.get().is_some(), "tried again, and started");
        assert_eq!(b.writes_beside.load(Ordering::Relaxed), 3);
        let r = block_on(b.read(0, 3 * size)).unwrap();
        for (i, chunk) in r.bytes().chunks(size).enumerate() {
            assert!(chunk.iter().all(|&x| x == i as u8 + 1), "write {i} landed");
        }
    }

    /// A write whose copy into the page cache failed still leaves the export to sync: a
    /// copy that fails part way (no space for the rest) has left its first bytes in the
    /// page cache, where reads see them, and a FLUSH that skipped the sync would let a
    /// crash take back what reads had shown. Each path: on the connection's thread, on
    /// the writer thread, on the blocking pool, and a FUA write. (Here the copy fails at
    /// once, over a descriptor opened read-only; which bytes a copy leaves is the kernel's.)
    #[test]
    fn a_failed_copy_into_the_page_cache_leaves_the_export_to_sync() {
        let (_dir, path, mut b) = new_export(4 << 20, Some(CacheMode::Writeback));
        b.file = Arc::new(std::fs::File::open(&path).unwrap());
        for (size, fua) in [
            (4096, false),
            (WRITE_BESIDE_MIN, false),
            (WRITE_BESIDE_TURN, false),
            (4096, true),
        ] {
            let written = b.dirty.written.load(Ordering::Acquire);
            b.dirty.synced(written);
            assert!(b.dirty.sync_target().is_none(), "nothing left to sync");
            let data = Bytes::from(vec![7u8; size]).into();
            assert!(
                block_on(b.write(0, data, fua)).is_err(),
                "a write of {size} over a read-only descriptor fails"
            );
            assert!(
                b.dirty.sync_target().is_some(),
                "a failed write of {size} (FUA {fua}) leaves the export to sync"
            );
        }
    }

    /// Overlapping changes land in the order started, whichever path each takes. A
    /// change started after a write beside waits for its copy: an inline write (it
    /// declines `write_inline`, and `write` waits), a write beside on either path, a TRIM
    /// and a zeroing. And a write beside started after that change waits for it in turn.
    /// Before (review, session 75), a small write made at once on its own thread was
    /// overwritten by the earlier copy still queued beside; in session 76's first form,
    /// the change in the middle waited for the later copy too, and landed last.
    #[test]
    fn overlapping_changes_land_in_the_order_started() {
        #[derive(Debug, Clone, Copy)]
        enum Change {
            InlineWrite,
            WriteOnWriterThread,
            WriteOnBlockingPool,
            Trim,
            Zeroing,
        }
        use std::future::Future;
        type Pending<'a> = std::pin::Pin<Box<BackendFuture<'a, ()>>>;
        let poll_once = |f: &mut Pending<'_>| {
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            f.as_mut().poll(&mut cx).is_ready()
        };
        let (_dir, _path, b) = new_export(32 << 20, Some(CacheMode::Writeback));
        let changes = [
            Change::InlineWrite,
            Change::WriteOnWriterThread,
            Change::WriteOnBlockingPool,
            Change::Trim,
            Change::Zeroing,
        ];
        let cases = [WRITE_BESIDE_MIN, WRITE_BESIDE_TURN]
            .into_iter()
            .flat_map(|first| changes.map(|middle| (first, middle)));
        for (case, (first_size, middle)) in cases.enumerate() {
            let base = case as u64 * (2 << 20);
            let at = base + 4096;
            let landed = |byte: u8| {
                let r = block_on(b.read(at, 4096)).unwrap();
                r.bytes().iter().all(|&x| x == byte)
            };
            // Received first, not yet handed to its thread.
            let mut first: Pending<'_> =
                Box::pin(b.write(base, Bytes::from(vec![1u8; first_size]).into(), false));
            let write = |size: usize| b.write(at, Bytes::from(vec![2u8; size]).into(), false);
            let mut then: Pending<'_> = match middle {
                Change::InlineWrite => {
                    assert!(
                        b.write_inline(at, &[2u8; 4096], false).is_none(),
                        "an inline write over a queued copy is declined"
                    );
                    Box::pin(write(4096))
                }
                Change::WriteOnWriterThread => Box::pin(write(WRITE_BESIDE_MIN)),
                Change::WriteOnBlockingPool => Box::pin(write(WRITE_BESIDE_TURN)),
                Change::Trim => Box::pin(b.trim(at, 65536, false)),
                Change::Zeroing => Box::pin(b.write_zeroes(at, 65536, ZeroFlags::default())),
            };
            // Received last, over the middle change.
            let mut last: Pending<'_> =
                Box::pin(b.write(at, Bytes::from(vec![3u8; WRITE_BESIDE_MIN]).into(), false));
            assert!(
                !poll_once(&mut then),
                "{middle:?} after {first_size}: waits"
            );
            assert!(
                !poll_once(&mut last),
                "a write beside after {middle:?} waits"
            );
            assert!(landed(0), "{middle:?}: nothing landed before the first");
            block_on(&mut first).unwrap();
            assert!(landed(1), "{middle:?}: the first landed first");
            block_on(&mut then).unwrap();
            let expect = match middle {
                Change::Trim | Change::Zeroing => 0,
                _ => 2,
            };
            assert!(landed(expect), "{middle:?} after a {first_size}-byte copy");
            block_on(&mut last).unwrap();
            assert!(landed(3), "the last write landed before {middle:?}");
            assert_eq!(b.change_order.registered(), 0);
        }
    }

    #[test]
    fn writes_trims_and_zeroes_read_back_in_both_cache_modes() {
        for mode in MODES {
            let (_dir, path, b) = new_export(4 << 20, Some(mode));
            block_on(async {
                b.write(4096, Bytes::from(vec![9u8; 1 << 20]).into(), false)
                    .await
                    .unwrap();
                b.write(0, Bytes::from(vec![1u8; 512]).into(), true)
                    .await
                    .unwrap();
                let r = b.read(0, 2 << 20).await.unwrap();
                assert!(r.bytes()[..512].iter().all(|&x| x == 1), "{mode}");
                assert!(r.bytes()[512..4096].iter().all(|&x| x == 0), "{mode}");
                assert!(r.bytes()[4096..4096 + (1 << 20)].iter().all(|&x| x == 9));
                assert_eq!(r.runs.iter().map(|r| r.0).sum::<usize>(), 2 << 20);
                b.trim(1 << 20, 1 << 20, false).await.unwrap();
                let zero = ZeroFlags {
                    may_trim: false,
                    fast: false,
                    fua: true,
                };
                b.write_zeroes(4096, 4096, zero).await.unwrap();
                let r = b.read(0, 2 << 20).await.unwrap();
                assert!(r.bytes()[4096..8192].iter().all(|&x| x == 0), "{mode}");
                assert!(r.bytes()[8192..1 << 20].iter().all(|&x| x == 9), "{mode}");
                assert!(r.bytes()[1 << 20..].iter().all(|&x| x == 0), "{mode}");
                // Only the page cache is read at once; direct I/O always goes to the ring.
                match b.read_at_once(8192, 4096) {
                    Some(read) => {
                        assert_eq!(mode, CacheMode::Writeback);
                        assert!(read.unwrap().bytes().iter().all(|&x| x == 9));
                    }
                    None => assert_eq!(mode, CacheMode::None),
                }
                let extents = b.extents(0, 4 << 20).await.unwrap();
                assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), 4 << 20);
                assert!(extents.last().unwrap().hole);
                b.flush().await.unwrap();
            });
            // What the backend wrote is what the file holds.
            let on_disk = std::fs::read(&path).unwrap();
            assert!(on_disk[..512].iter().all(|&x| x == 1), "{mode}");
            assert!(on_disk[8192..1 << 20].iter().all(|&x| x == 9), "{mode}");
        }
    }

    /// Fills `b` with 0x5a from 0 to 1 MiB, then trims to zeroes an unaligned range in
    /// it, which must read back as zeroes with every byte around it kept.
    fn trim_to_zeroes_reads_back_zeroes(b: &FileBackend, what: &str) {
        block_on(async {
            b.write(0, Bytes::from(vec![0x5au8; 1 << 20]).into(), true)
                .await
                .unwrap();
            b.trim_to_zeroes(1000, 300_000, true).await.unwrap();
            let r = b.read(0, 1 << 20).await.unwrap().bytes();
            assert!(r[..1000].iter().all(|&x| x == 0x5a), "{what}: before");
            assert!(
                r[1000..301_000].iter().all(|&x| x == 0),
                "{what}: the range"
            );
            assert!(r[301_000..].iter().all(|&x| x == 0x5a), "{what}: after");
        });
    }

    #[test]
    fn a_trim_to_zeroes_leaves_zeroes_on_a_file() {
        for mode in MODES {
            let (_dir, _path, b) = new_export(4 << 20, Some(mode));
            assert!(b.capabilities().zeroing_trim, "a file punches a hole");
            trim_to_zeroes_reads_back_zeroes(&b, &format!("file, {mode}"));
        }
    }

    /// Discard requests and sectors a block device completed so far (fields 12 and 14 of
    /// its sysfs `stat`).
    fn discards_done(device: &str) -> (u64, u64) {
        let name = device.trim_start_matches("/dev/");
        let stat = std::fs::read_to_string(format!("/sys/block/{name}/stat")).unwrap();
        let field = |n: usize| {
            stat.split_whitespace()
                .nth(n)
                .unwrap()
                .parse::<u64>()
                .unwrap()
        };
        (field(11), field(13))
    }

    /// A loop device over a 4 MiB file, detached on drop; `None` without root, losetup or
    /// a free loop device.
    struct LoopDevice {
        path: String,
        _dir: tempfile::TempDir,
    }

    impl LoopDevice {
        fn attach() -> Option<LoopDevice> {
            if !rustix::process::geteuid().is_root() {
                return None;
            }
            let dir = tempfile::tempdir().unwrap();
            let image = dir.path().join("device.img");
            File::create(&image).unwrap().set_len(4 << 20).unwrap();
            let out = std::process::Command::new("losetup")
                .args(["-f", "--show"])
                .arg(&image)
                .output()
                .ok()
                .filter(|o| o.status.success())?;
            let path = String::from_utf8(out.stdout).unwrap().trim().to_string();
            Some(LoopDevice { path, _dir: dir })
        }
    }

    impl Drop for LoopDevice {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup")
                .arg("-d")
                .arg(&self.path)
                .status();
        }
    }

    #[test]
    fn whole_discard_granules_are_found_within_a_range() {
        let thin = DiscardGranules {
            granule: 65536,
            alignment: 0,
        };
        assert_eq!(thin.within(1000, 300_000), (65536, 262_144));
        assert_eq!(thin.within(65536, 65536), (65536, 131_072), "exactly one");
        assert_eq!(
            thin.within(1000, 65536),
            (66536, 66536),
            "none: the end, empty"
        );
        assert_eq!(thin.within(0, 1000), (1000, 1000));
        // A partition 1 MiB + 16 KiB into a disk of 64 KiB granules: the kernel says 48 KiB
        // (to the next granule's start), so whole granules lie at 48 KiB + 64 KiB × n.
        let partition = DiscardGranules {
            granule: 65536,
            alignment: 49152,
        };
        assert_eq!(partition.within(0, 300_000), (49152, 245_760));
        assert_eq!(partition.within(49152, 65536), (49152, 114_688));
        assert_eq!(
            partition.within(0, 100),
            (100, 100),
            "before the first boundary"
        );
        assert_eq!(partition.within(0, 49152), (49152, 49152));
        assert_eq!(partition.within(1000, 48000), (49000, 49000));
    }

    /// On a device that discards, the whole granules of the range are discarded (not
    /// zeroed: a thin volume gets its space back) and the partial ones written as zeroes;
    /// on one that does not, the range is zeroed, and TRIM is not said to be cheap there.
    #[test]
    fn a_trim_to_zeroes_discards_whole_granules_of_a_device_and_zeroes_the_rest() {
        let Some(device) = LoopDevice::attach() else {
            eprintln!("skipped: needs root, losetup and a free loop device");
            return;
        };
        let name = device.path.trim_start_matches("/dev/").to_string();
        let sysfs = std::fs::read_to_string(format!("/sys/block/{name}/queue/discard_max_bytes"));
        if sysfs.map_or(true, |max| max.trim() == "0") {
            eprintln!("skipped: this loop device takes no discards");
            return;
        }
        // (what the device pretends, bytes discarded): what sysfs says; a thin volume's
        // 64 KiB chunk; the same in a partition whose first whole chunk starts 16 KiB in;
        // a device without discard.
        let granules = |granule, alignment| Some(Some(DiscardGranules { granule, alignment }));
        let cases = [
            (None, None),
            (granules(65536, 0), Some(262_144 - 65536)),
            (granules(65536, 16384), Some(278_528 - 16384)),
            (Some(None), None),
        ];
        for (pretended, expected) in cases {
            let what = format!("pretended {pretended:?}");
            let b = FileBackend::open(Path::new(&device.path), None, false, None).unwrap();
            assert!(b.discards.is_some(), "sysfs says this loop device discards");
            *b.pretend_discards.lock().unwrap() = pretended;
            let no_discard = pretended == Some(None);
            assert_eq!(b.capabilities().zeroing_trim, !no_discard, "{what}");
            let (requests, sectors) = discards_done(&device.path);
            trim_to_zeroes_reads_back_zeroes(&b, &what);
            let (requests_after, sectors_after) = discards_done(&device.path);
            assert_eq!(requests_after > requests, !no_discard, "{what}");
            if let Some(expected) = expected {
                // 1000..301000 holds the whole granules from 65536 to 262144, or with
                // the partition's 16 KiB, those from 16384 to 278528.
                assert_eq!((sectors_after - sectors) * 512, expected, "{what}");
            }
        }
    }

    #[test]
    fn only_a_page_cache_export_says_it_can_splice_and_only_it_does() {
        for mode in MODES {
            let (_dir, _path, b) = new_export(4 << 20, Some(mode));
            block_on(async {
                b.write(0, Bytes::from(vec![7u8; 1 << 20]).into(), false)
                    .await
                    .unwrap();
            });
            assert_eq!(b.can_splice(), mode == CacheMode::Writeback, "{mode}");
            let length = super::super::splice::SPLICE_MIN;
            let spliced = b.read_to_pipe(0, length);
            if !b.can_splice() {
                assert!(spliced.is_none(), "{mode}");
            } else if super::super::splice::cached(&b.file, 0, length as u64) == Some(true) {
                // Just written through the page cache: spliced, where the kernel can say
                // that it is cached (`cachestat`, Linux 6.5).
                assert!(spliced.is_some(), "{mode}");
            }
        }
    }

    #[test]
    fn only_cached_ranges_of_a_page_or_more_of_a_page_cache_export_are_read_from_its_mapping() {
        let length = MAPPED_READ_MIN;
        for mode in MODES {
            let (_dir, _path, b) = new_export(4 << 20, Some(mode));
            let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i % 253) as u8).collect();
            block_on(async {
                b.write(0, Bytes::from(data.clone()).into(), false)
                    .await
                    .unwrap();
                b.flush().await.unwrap();
            });
            if mode == CacheMode::None {
                assert!(b.read_mapped(0, length).is_none());
                continue;
            }
            if super::super::splice::cached(&b.file, 0, 4096).is_none() {
                return; // no `cachestat` (before Linux 6.5): nothing is ever mapped
            }
            // Dropped from the page cache (clean after the flush): not read from the mapping.
            rustix::fs::fadvise(&*b.file, 0, 0, rustix::fs::Advice::DontNeed).unwrap();
            assert!(b.read_mapped(0, length).is_none(), "uncached");
            // Read back into the cache: now it is, with the file's bytes.
            block_on(b.read(0, 1 << 20)).unwrap();
            let mapped = b.read_mapped(4096, length).expect("cached");
            assert!(matches!(mapped.data, Pieces::Mapped(_)));
            assert_eq!(mapped.runs.as_slice(), &[(length, false)]);
            assert!(mapped.bytes()[..] == data[4096..4096 + length]);
            // Less than a page, or past the end: not mapped.
            assert!(b.read_mapped(0, length - 1).is_none());
            assert!(b.read_mapped((4 << 20) - 4096, 8192).is_none());
            // Once a send from the mapping failed, never again: copied reads say EIO for a
            // page that cannot be read, where a mapped one costs the connection.
            assert!(b.all_cached(0, 1 << 20));
            b.mapped_send_failed(&std::io::Error::from_raw_os_error(libc::EFAULT));
            assert!(b.read_mapped(4096, length).is_none());
            assert!(!b.all_cached(0, 1 << 20));
        }
    }

    #[test]
    fn unaligned_direct_writes_are_read_modified_written_without_losing_neighbours() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        let b = Arc::new(
            FileBackend::open(&path, Some(1 << 20), false, Some(CacheMode::None)).unwrap(),
        );
        assert!(b.block > 1, "direct I/O has a block size");
        let mut model = vec![0u8; 1 << 20];
        block_on(async {
            // Odd offsets and lengths: inside one block, across two, across many; and a
            // payload that does not start on an aligned address.
            let cases: [(u64, usize); 5] =
                [(1, 10), (500, 30), (4000, 200), (7, 70_000), (4096, 4096)];
            for (i, (offset, len)) in cases.into_iter().enumerate() {
                let payload = Bytes::from(vec![i as u8 + 1; len + 1]).slice(1..);
                b.write(offset, payload.into(), i % 2 == 0).await.unwrap();
                model[offset as usize..offset as usize + len].fill(i as u8 + 1);
            }
            let r = b.read(0, 1 << 20).await.unwrap();
            assert!(
                r.bytes()[..] == model[..],
                "an unaligned write damaged its neighbours"
            );
            let r = b.read(3, 5000).await.unwrap();
            assert_eq!(&r.bytes()[..], &model[3..5003]);
            // Many small unaligned writes into the same blocks at once, each to its own
            // bytes: a read-modify-write that raced another would lose some of them.
            let tasks: Vec<_> = (0..256u64)
                .map(|i| {
                    let b = Arc::clone(&b);
                    tokio::spawn(async move {
                        let data = Bytes::from(vec![(i % 200) as u8 + 50; 16]);
                        b.write(100_000 + i * 16, data.into(), false).await.unwrap();
                    })
                })
                .collect();
            for task in tasks {
                task.await.unwrap();
            }
            for i in 0..256usize {
                let at = 100_000 + i * 16;
                model[at..at + 16].fill((i % 200) as u8 + 50);
            }
            let r = b.read(0, 1 << 20).await.unwrap();
            assert!(
                r.bytes()[..] == model[..],
                "concurrent partial writes lost data"
            );
            b.flush().await.unwrap();
        });
        assert!(std::fs::read(&path).unwrap() == model);
    }

    #[test]
    fn cached_small_reads_take_the_non_blocking_path_and_agree_with_the_ring() {
        let (_dir, _path, b) = new_export(1 << 20, None);
        b.file.write_all_at(&[6u8; 4096], 8192).unwrap();
        let fast = read_without_blocking(&b.file, 8192, 4096)
            .expect("a cached page reads without blocking");
        assert_eq!(fast.as_ref(), &[6u8; 4096][..]);
        let at_once = b.read_at_once(8192, 4096).expect("cached: read at once");
        assert_eq!(&at_once.unwrap().bytes()[..], &[6u8; 4096][..]);
        assert!(
            b.read_at_once(0, NOWAIT_READ_MAX).is_none(),
            "long reads go through the ring or a pipe"
        );
        block_on(async {
            b.write(65536, Bytes::from(vec![2u8; 512 * 1024]).into(), false)
                .await
                .unwrap();
            assert_eq!(
                &b.read(8192, 4096).await.unwrap().bytes()[..],
                &[6u8; 4096][..]
            );
            let big = b.read(0, 1 << 20).await.unwrap();
            assert!(big.bytes()[65536..65536 + 512 * 1024]
                .iter()
                .all(|&x| x == 2));
            assert!(big.bytes()[8192..12288].iter().all(|&x| x == 6));
        });
    }

    #[test]
    fn a_declined_read_does_not_try_the_page_cache_again() {
        let (_dir, _path, b) = new_export(1 << 20, None);
        b.file.write_all_at(&[4u8; 4096], 0).unwrap();
        let tries = || b.nowait_tries.load(std::sync::atomic::Ordering::Relaxed);
        block_on(async {
            // `read` tries the page cache once, then (on a miss) the ring.
            assert_eq!(
                &b.read(0, 4096).await.unwrap().bytes()[..],
                &[4u8; 4096][..]
            );
            assert_eq!(tries(), 1);
            // After `read_at_once` declined, the ring at once, with the same data.
            assert_eq!(
                &b.read_declined(0, 4096).await.unwrap().bytes()[..],
                &[4u8; 4096][..]
            );
            assert_eq!(tries(), 1, "a declined read tried the page cache again");
            assert_eq!(b.read_at_once(512, 512).map(|r| r.is_ok()), Some(true));
            assert_eq!(tries(), 2);
        });
    }

    #[test]
    fn lost_writeback_keeps_the_first_failure() {
        let lost = LostWriteback::default();
        assert!(lost.error().is_none());
        assert!(lost.record(&std::io::Error::from_raw_os_error(libc::ENOSPC)));
        assert!(!lost.record(&std::io::Error::from_raw_os_error(libc::EIO)));
        assert!(!lost.record(&std::io::Error::other("no errno")));
        assert_eq!(lost.error().unwrap().raw_os_error(), Some(libc::ENOSPC));
        // An error without an errno counts as EIO.
        let other = LostWriteback::default();
        assert!(other.record(&std::io::Error::other("no errno")));
        assert_eq!(other.error().unwrap().raw_os_error(), Some(libc::EIO));
    }

    /// A sync the ring could not take never reached the file, so it says nothing of the
    /// writes before it: that FLUSH fails, and the next one syncs and succeeds (until
    /// session 68 the first stopped FLUSH for good, as a failed sync does).
    #[test]
    fn a_sync_that_never_reached_the_kernel_does_not_stop_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        for mode in MODES {
            let _ = std::fs::remove_file(&path);
            let b = FileBackend::open(&path, Some(1 << 20), false, Some(mode)).unwrap();
            block_on(async {
                let data = || WriteData::from(Bytes::from(vec![3u8; 4096]));
                b.write(0, data(), false).await.unwrap();
                b.ring.refuse_next_pushes(1);
                let refused = b.flush().await.expect_err("the ring refused the sync");
                let cause = refused.source.as_ref().expect("an I/O error");
                assert!(!super::super::uring::reached_the_kernel(cause), "{mode}");
                b.flush().await.expect("the next FLUSH syncs");
                b.write(4096, data(), true).await.unwrap();
                b.flush().await.unwrap();
            });
        }
    }

    /// What reaches the kernel: a FLUSH after a write is one sync, a FLUSH with nothing
    /// written none, a FUA write one durable request (a sync of its range in page-cache
    /// mode, a sync of the file with direct I/O), and FLUSHes sent together after a write sync at
    /// most once each. (The crash tests' volatile cache sits above this backend, so they
    /// cannot see a backend that skips its syncs: this test can.)
    #[test]
    fn flush_and_fua_ask_the_kernel_for_durability() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        for mode in MODES {
            let _ = std::fs::remove_file(&path);
            let b = FileBackend::open(&path, Some(1 << 20), false, Some(mode)).unwrap();
            let durable = || b.ring.durable_requests.load(Ordering::Relaxed);
            block_on(async {
                let data = || WriteData::from(Bytes::from(vec![3u8; 4096]));
                b.write(0, data(), false).await.unwrap();
                let before = durable();
                b.flush().await.unwrap();
                assert_eq!(durable() - before, 1, "{mode}: FLUSH after a write");
                b.flush().await.unwrap();
                assert_eq!(durable() - before, 1, "{mode}: FLUSH with nothing written");
                b.write(4096, data(), true).await.unwrap();
                assert_eq!(durable() - before, 2, "{mode}: FUA write");
                b.write(8192, data(), false).await.unwrap();
                let together = futures_util::future::join_all((0..4).map(|_| b.flush())).await;
                assert!(together.iter().all(|r| r.is_ok()), "{mode}");
                let synced = durable() - before - 2;
                assert!(
                    (1..=4).contains(&synced),
                    "{mode}: {synced} syncs for four FLUSHes"
                );
                b.flush().await.unwrap();
                assert_eq!(
                    durable() - before - 2,
                    synced,
                    "{mode}: nothing written since"
                );
            });
        }
    }

    /// A sync that ended waits for every sync that was in flight beside it (started
    /// before it ended), and for no later one; a ticket dropped unended ends its sync.
    #[test]
    fn a_sync_waits_for_the_syncs_beside_it_only() {
        use std::future::Future;
        let syncs = SyncsInFlight::default();
        let earlier = syncs.start();
        let this = syncs.start();
        let end = this.end();
        let later = syncs.start();
        let mut wait = Box::pin(syncs.wait_for_those_before(end));
        let waker = futures_util::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        assert!(
            wait.as_mut().poll(&mut cx).is_pending(),
            "the earlier sync runs"
        );
        drop(earlier);
        assert!(
            wait.as_mut().poll(&mut cx).is_ready(),
            "only the later one runs"
        );
        later.end();
        assert!(syncs.state.lock().unwrap().1.is_empty());
    }

    #[test]
    fn flush_syncs_only_when_something_was_written() {
        let tracker = DirtyTracker::default();
        assert_eq!(tracker.sync_target(), None);
        tracker.mark();
        let target = tracker.sync_target().expect("a write makes it dirty");
        // A write completing while the sync runs is not covered by it.
        tracker.mark();
        tracker.synced(target);
        let second = tracker
            .sync_target()
            .expect("the later write is still dirty");
        tracker.synced(second);
        assert_eq!(tracker.sync_target(), None);
        // Through the backend: FUA writes leave nothing to flush, plain ones do.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        for mode in MODES {
            let _ = std::fs::remove_file(&path);
            let b = FileBackend::open(&path, Some(1 << 20), false, Some(mode)).unwrap();
            block_on(async {
                b.write(0, Bytes::from(vec![1u8; 4096]).into(), true)
                    .await
                    .unwrap();
                assert_eq!(b.dirty.sync_target(), None, "{mode}");
                b.write(0, Bytes::from(vec![2u8; 4096]).into(), false)
                    .await
                    .unwrap();
                assert!(b.dirty.sync_target().is_some(), "{mode}");
                b.flush().await.unwrap();
                assert_eq!(b.dirty.sync_target(), None, "{mode}");
            });
        }
    }
}
