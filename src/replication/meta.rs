//! The per-node metadata file: identity, generation identifiers, role and disk flags, the
//! activity log of hot extents and the out-of-sync bitmap, all updated crash-safely.
//!
//! Layout (every record is checksummed with CRC32C and carries a sequence number):
//!
//! ```text
//! 0        superblock slot 0      (4 KiB)  \ written alternately; the valid one with
//! 4 KiB    superblock slot 1      (4 KiB)  / the higher sequence number wins
//! 8 KiB    activity-log ring      (16 records of 4 KiB, newest valid record wins)
//! 72 KiB   out-of-sync bitmaps    (one per peer, each a bit per 64 KiB region,
//!                                  little-endian u64 words, 4 KiB-aligned)
//! ```
//!
//! A superblock or activity-log write that is torn by a crash fails its checksum, so the
//! previous record, still intact in the other slot, is used. The invariant that makes
//! resync after any crash complete: every region that may differ from a peer is either
//! set in the on-disk bitmap or inside an extent of the on-disk activity log. Writes go
//! only to extents that are in the log on disk ([`Metadata::activate`] fdatasyncs first),
//! and an extent leaves the log only after its bitmap bits are on disk. Opening metadata
//! that was not closed cleanly marks every logged extent out of sync.
//!
//! The invariant holds only while every write and sync succeeds, so the first one that
//! fails stops the metadata: it takes no more changes, and no more extents are entered in
//! the log, so writes to the data stop too, until the node restarts ([`MetaError::Stopped`]).

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::generation::Generations;
use super::wire::DiskState;

/// Bytes covered by one bitmap bit: small enough that a write marks little for resync,
/// large enough that a 1 TiB device needs only a 2 MiB bitmap per peer.
pub const REGION_SIZE: u64 = 64 << 10;
/// Bytes covered by one activity-log slot: sequential writes need a log update only every
/// 4 MiB.
pub const EXTENT_SIZE: u64 = 4 << 20;
/// Extents the activity log holds. 256 slots × 4 MiB bound the resync after a crash to
/// 1 GiB (DRBD's default, 1237 extents, is about 4.8 GiB) while a 1 GiB working set of
/// random writes needs no log transaction at all: with 64 slots, random 4 KiB FUA writes
/// over 2 GiB paid a log update (two metadata fdatasyncs) on most writes, which doubled
/// their latency. A record of 256 extents still fits one 4 KiB log record.
pub const AL_SLOTS: usize = 256;
/// Records in the activity-log ring.
const AL_RING: u64 = 16;
const RECORD_SIZE: u64 = 4096;
const SUPERBLOCK_MAGIC: u64 = 0x4e42_4c4b_4d45_5441; // "NBLKMETA"
const AL_MAGIC: u32 = 0x4e42_414c; // "NBAL"
const FORMAT_VERSION: u32 = 2;
const AL_OFFSET: u64 = 2 * RECORD_SIZE;
const BITMAP_OFFSET: u64 = AL_OFFSET + AL_RING * RECORD_SIZE;
const REGIONS_PER_EXTENT: u64 = EXTENT_SIZE / REGION_SIZE;
const BITMAP_PAGE: u64 = 4096;

/// The kind of [`BackingIdentity`] a superblock records after its peers.
mod backing_tag {
    pub const FILE: u8 = 1;
    pub const DEVICE: u8 = 2;
}

/// The longest device identity a superblock keeps, in bytes.
const MAX_SERIAL: usize = 256;

mod flag {
    pub const PRIMARY: u32 = 1 << 0;
    /// The node shut down cleanly: the activity log needs no recovery.
    pub const CLEAN: u32 = 1 << 1;
    /// See [`super::Superblock::created_blank`].
    pub const CREATED_BLANK: u32 = 1 << 2;
    pub const DISK_SHIFT: u32 = 8;
}

/// A metadata failure, with the file it concerns.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// The cause is in the message and is not the error's `source`: `netblk` prints the
    /// chain of sources, and the cause came out twice ("…: Permission denied: Permission
    /// denied"), while status lines that show the message alone need it there.
    #[error("metadata {path}: {op}: {cause}")]
    Io {
        path: PathBuf,
        op: &'static str,
        cause: std::io::Error,
    },
    #[error(
        "metadata {path}: no valid superblock (not netblk metadata, or both copies are damaged)"
    )]
    NoSuperblock { path: PathBuf },
    #[error("metadata {path} belongs to {what} {found:?}, not {expected:?}")]
    WrongIdentity {
        path: PathBuf,
        what: &'static str,
        found: String,
        expected: String,
    },
    #[error("metadata {path} is for a device of {found} bytes, the backing has {expected}")]
    WrongSize {
        path: PathBuf,
        found: u64,
        expected: u64,
    },
    /// An earlier write or sync of this file failed, so what it holds on disk is not known
    /// (a failed sync may have lost records, and the kernel reports that only once): the
    /// metadata takes no more changes until the node restarts and reads it again.
    #[error("metadata {path}: stopped since {op} failed ({cause}); restart the node")]
    Stopped {
        path: PathBuf,
        op: &'static str,
        cause: std::io::Error,
    },
    /// Another process (or handle) holds the file: two nodes writing one metadata file
    /// would each overwrite the other's records.
    #[error("metadata {path} is in use by another netblk process (is this node already running?)")]
    InUse { path: PathBuf },
    #[error("the activity log is full of extents with writes in flight")]
    ActivityLogBusy,
    /// Room in the log needs an extent evicted whose last writes are not yet known to be
    /// durable everywhere: flush (locally and on every peer), then retry.
    #[error("the activity log needs a flush before it can evict an extent")]
    ActivityLogNeedsFlush,
}

/// What the superblock holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Superblock {
    pub node: String,
    pub resource: String,
    /// The peers, in the order of their bitmaps.
    pub peers: Vec<String>,
    pub size: u64,
    pub generations: Generations,
    pub primary: bool,
    pub disk: DiskState,
    pub clean: bool,
    /// The metadata was created together with a blank backing (a memory backing, or a
    /// file the same start created). Only read at the just-created generation: such a node
    /// holds nothing a peer lacks and may take the first primary role alone, where fresh
    /// metadata over a backing that already held data (recreated metadata, say) may hide
    /// data older than a peer's.
    pub created_blank: bool,
    /// The backing this metadata describes, as far as it can be told apart from another
    /// at the same path (none: a memory backing, one not yet looked at, or metadata older
    /// than this field).
    pub backing: Option<BackingIdentity>,
    /// A file backing's modification time (nanoseconds since the epoch) when the node
    /// last closed cleanly; 0 if unknown. The node is its file's only writer, so a change
    /// by the next start means another tool rewrote it in place (`cp`, `qemu-img create`,
    /// `truncate`, `dd`), which the inode and birth time do not show.
    pub backing_modified_ns: u64,
}

/// What tells the backing this metadata vouches for from another disk or image put at the
/// same path: the metadata is a separate file, so a replaced disk, or an image deleted
/// and created anew, would otherwise inherit its generation and be taken for up to date
/// (a session 70 Left item).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackingIdentity {
    /// A regular file: its inode number and birth time (nanoseconds since the epoch, 0
    /// where the file system keeps none). A file deleted and created anew often gets the
    /// freed inode number back, so the birth time is what tells them apart. The device
    /// number is left out: btrfs subvolumes and network file systems may get another one
    /// at each mount.
    File { inode: u64, born_ns: u64 },
    /// A block device: the disk's WWID or serial number from sysfs, and for a partition
    /// its number and first sector. The device number is left out: disks may be numbered
    /// in another order at the next boot.
    Device { serial: String },
}

impl BackingIdentity {
    /// The identity of the backing at `path`, or `None` if it has none to tell (a block
    /// device without a serial number in sysfs, such as a loop device) or cannot be read.
    pub fn of(path: &Path) -> Option<BackingIdentity> {
        use std::os::unix::fs::{FileTypeExt, MetadataExt};
        let stat = std::fs::metadata(path).ok()?;
        if stat.file_type().is_block_device() {
            return device_serial(stat.rdev()).map(|serial| BackingIdentity::Device { serial });
        }
        if !stat.is_file() {
            return None;
        }
        let born_ns = stat
            .created()
            .ok()
            .and_then(|born| born.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |since| since.as_nanos() as u64);
        Some(BackingIdentity::File {
            inode: stat.ino(),
            born_ns,
        })
    }

    /// Whether `self` (recorded) and `now` name different backings. A birth time of 0 on
    /// either side (not kept) compares the inode alone.
    fn differs_from(&self, now: &BackingIdentity) -> bool {
        match (self, now) {
            (
                BackingIdentity::File { inode, born_ns },
                BackingIdentity::File {
                    inode: inode_now,
                    born_ns: born_now,
                },
            ) => inode != inode_now || (*born_ns != 0 && *born_now != 0 && born_ns != born_now),
            (BackingIdentity::Device { serial }, BackingIdentity::Device { serial: now }) => {
                serial != now
            }
            _ => true,
        }
    }
}

impl std::fmt::Display for BackingIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackingIdentity::File { inode, born_ns: 0 } => write!(f, "inode {inode}"),
            BackingIdentity::File { inode, born_ns } => {
                write!(f, "inode {inode} created {}", format_ns(*born_ns))
            }
            BackingIdentity::Device { serial } => write!(f, "disk {serial}"),
        }
    }
}

/// The modification time of the file at `path`, in nanoseconds since the epoch; 0 if
/// unknown.
fn modified_ns(path: &Path) -> u64 {
    std::fs::metadata(path)
        .and_then(|stat| stat.modified())
        .ok()
        .and_then(|modified| modified.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |since| since.as_nanos() as u64)
}

/// A time in nanoseconds since the epoch, as RFC 3339.
fn format_ns(ns: u64) -> String {
    humantime::format_rfc3339_nanos(std::time::UNIX_EPOCH + std::time::Duration::from_nanos(ns))
        .to_string()
}

/// The WWID or serial number sysfs shows for block device `device`'s disk, with the
/// partition's number and first sector for a partition.
fn device_serial(device: u64) -> Option<String> {
    let (major, minor) = (rustix::fs::major(device), rustix::fs::minor(device));
    let node = std::fs::canonicalize(format!("/sys/dev/block/{major}:{minor}")).ok()?;
    let read = |path: PathBuf| {
        std::fs::read_to_string(path)
            .ok()
            .map(|text| text.trim().to_string())
            .filter(|text| !text.is_empty())
    };
    let partition = read(node.join("partition"));
    let disk = match partition {
        Some(_) => node.parent()?.to_path_buf(),
        None => node.clone(),
    };
    let serial = ["wwid", "device/wwid", "serial", "device/serial"]
        .into_iter()
        .find_map(|name| read(disk.join(name)))?;
    let mut serial = match partition {
        Some(number) => format!(
            "{serial} partition {number} at sector {}",
            read(node.join("start")).unwrap_or_default()
        ),
        None => serial,
    };
    // Cut to what a superblock keeps, the same way at every start.
    while serial.len() > MAX_SERIAL {
        serial.pop();
    }
    Some(serial)
}

/// The open metadata of one node. Its methods do blocking file I/O.
#[derive(Debug)]
pub struct Metadata {
    file: File,
    path: PathBuf,
    superblock: Superblock,
    superblock_seq: u64,
    /// The backing file this metadata describes, once [`Self::check_backing`] was told
    /// it: its modification time is recorded at each clean close.
    backing_path: Option<PathBuf>,
    /// Extents in the on-disk log, in least-recently-used-first order.
    al_extents: Vec<u64>,
    /// Writes in flight per logged extent (same order as `al_extents`).
    al_refs: Vec<u32>,
    /// Per logged extent, the flush generation in which its last write finished (same
    /// order as `al_extents`). An extent may leave the log only once a flush that began
    /// after that write finished has completed (generation below `flushed_below`): until
    /// then its data may be in a volatile cache, here or on a peer, and a crash must find
    /// the extent in the log to resync it.
    al_released: Vec<u64>,
    /// The generation writes finishing now are stamped with.
    flush_generation: u64,
    /// Writes stamped below this are durable everywhere.
    flushed_below: u64,
    al_seq: u64,
    /// One bitmap per peer: the regions that peer misses.
    bitmaps: Vec<Vec<u64>>,
    /// Per peer, the regions set in its bitmap; and the regions some peer misses. Kept as
    /// bits change, so that `netblk status` does not count a whole bitmap under the lock
    /// client writes take (review, session 66: on a 16 TiB export, status took 11 ms and a
    /// client polling it cut QD1 writes from 7,956 to 2,181 a second).
    set_regions: Vec<u64>,
    any_regions: u64,
    /// Per peer, in memory only: the regions marked out of sync since a resync pass last
    /// read them ([`Metadata::copying`]). A pass clears a region's bit only if it was not
    /// marked again after it was copied ([`Metadata::mark_copied_in_sync`]): a write the
    /// peer missed in between (it failed here, or its link went) must stay marked.
    remarked: Vec<Vec<u64>>,
    regions: u64,
    /// Bytes of one peer's bitmap on disk.
    bitmap_bytes: u64,
    /// Changed pages as (peer, page).
    dirty_pages: BTreeSet<(usize, u64)>,
    /// Extents the log held when metadata that was not closed cleanly was opened.
    recovered_extents: usize,
    /// The first write or sync that failed, as (what was being done, errno): the metadata
    /// is stopped ([`MetaError::Stopped`]).
    failed: Option<(&'static str, i32)>,
}

/// Removes `temporary`, a file a crashed create left, unless a running create holds its
/// lock (then the metadata is in use).
fn remove_unlocked_leftover(temporary: &Path, path: &Path) -> Result<(), MetaError> {
    let leftover = match File::open(temporary) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(temporary, "opening a leftover")(e)),
    };
    lock_exclusively(&leftover, path)?;
    std::fs::remove_file(temporary).map_err(io_err(temporary, "removing a leftover"))
}

/// The `op` of the error [`Metadata::create`] returns when the file appeared meanwhile.
const NAMING: &str = "naming";

/// Gives the complete file at `temporary` the name `path`, unless `path` exists (then
/// AlreadyExists, with `op` [`NAMING`]): `renameat2(RENAME_NOREPLACE)`, or on a file system
/// without it (NFS: EINVAL) a hard link and an unlink, which are as atomic.
fn name_without_replacing(temporary: &Path, path: &Path) -> Result<(), MetaError> {
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    match renameat_with(CWD, temporary, CWD, path, RenameFlags::NOREPLACE) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS) => name_by_link(temporary, path),
        Err(e) => Err(io_err(path, NAMING)(e.into())),
    }
}

/// [`name_without_replacing`] by a hard link and an unlink.
fn name_by_link(temporary: &Path, path: &Path) -> Result<(), MetaError> {
    std::fs::hard_link(temporary, path).map_err(io_err(path, NAMING))?;
    std::fs::remove_file(temporary).map_err(io_err(temporary, "removing"))
}

/// Takes an exclusive lock on the metadata file for as long as `file` stays open, before
/// anything is read or written: a second start of the same node (or a mistyped `--node`)
/// must not write records that outrank the running node's (review, session 66: a second
/// `serve --node alpha` marked its hot extents, took the primary role and wrote a newer
/// superblock before it failed on the taken port, and the running node's clean close was
/// lost).
fn lock_exclusively(file: &File, path: &Path) -> Result<(), MetaError> {
    use rustix::fs::{flock, FlockOperation};
    match flock(file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::WOULDBLOCK) => Err(MetaError::InUse {
            path: path.to_path_buf(),
        }),
        Err(e) => Err(MetaError::Io {
            path: path.to_path_buf(),
            op: "locking",
            cause: e.into(),
        }),
    }
}

impl Metadata {
    /// Opens the metadata at `path`, creating it for a fresh node if there is none
    /// (`blank_backing`: the backing holds no data yet, see [`Superblock::created_blank`]).
    /// An existing file must name the same node, resource, peers and size.
    pub fn open_or_create(
        path: &Path,
        node: &str,
        resource: &str,
        peers: &[String],
        size: u64,
        blank_backing: bool,
    ) -> Result<Metadata, MetaError> {
        let metadata = if path.exists() {
            Metadata::open(path)?
        } else {
            match Metadata::create(path, node, resource, peers, size, blank_backing) {
                // Another start created it meanwhile (naming it failed: it exists): open
                // it (it is locked while that node runs).
                Err(MetaError::Io {
                    op: NAMING, cause, ..
                }) if cause.kind() == std::io::ErrorKind::AlreadyExists => Metadata::open(path)?,
                created => created?,
            }
        };
        let check = |what, found: &str, expected: &str| {
            if found == expected {
                Ok(())
            } else {
                Err(MetaError::WrongIdentity {
                    path: path.to_path_buf(),
                    what,
                    found: found.to_string(),
                    expected: expected.to_string(),
                })
            }
        };
        check("node", &metadata.superblock.node, node)?;
        check("resource", &metadata.superblock.resource, resource)?;
        check(
            "peers",
            &metadata.superblock.peers.join(","),
            &peers.join(","),
        )?;
        if metadata.superblock.size != size {
            return Err(MetaError::WrongSize {
                path: path.to_path_buf(),
                found: metadata.superblock.size,
                expected: size,
            });
        }
        Ok(metadata)
    }

    /// Creates fresh metadata: just-created generation, secondary, nothing out of sync.
    /// It is written in full under a temporary name and then renamed into place, so a
    /// crash or a second start in the middle never leaves an empty or half-written file
    /// under the real name (which every later start would refuse).
    pub fn create(
        path: &Path,
        node: &str,
        resource: &str,
        peers: &[String],
        size: u64,
        blank_backing: bool,
    ) -> Result<Metadata, MetaError> {
        let mut temporary = path.as_os_str().to_owned();
        temporary.push(format!(".creating.{}", std::process::id()));
        let temporary = std::path::PathBuf::from(temporary);
        // A start with this PID that crashed mid-create left it (a PID 1 in a container
        // has the same PID every time). Removed only if nobody holds its lock: another
        // start with this PID (in another PID namespace) may be writing it right now, and
        // unlinking its file let it name ours and run on an unlinked one (re-review,
        // session 67). Unlinking never touches the real file, even when a crash between
        // `link` and `unlink` below left the two linked.
        remove_unlocked_leftover(&temporary, path)?;
        let created =
            Metadata::create_at(&temporary, path, node, resource, peers, size, blank_backing)
                .and_then(|metadata| name_without_replacing(&temporary, path).map(|()| metadata));
        let metadata = match created {
            Ok(metadata) => metadata,
            Err(e) => {
                let _ = std::fs::remove_file(&temporary);
                return Err(e);
            }
        };
        // The new name must survive a power cut too, or the next start would create fresh
        // metadata over data this node already took writes into.
        let directory = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        File::open(directory)
            .and_then(|d| d.sync_all())
            .map_err(io_err(directory, "syncing the directory of"))?;
        Ok(metadata)
    }

    /// Writes fresh metadata to `temporary`, locked, for [`Self::create`] to name `path`.
    fn create_at(
        temporary: &Path,
        path: &Path,
        node: &str,
        resource: &str,
        peers: &[String],
        size: u64,
        blank_backing: bool,
    ) -> Result<Metadata, MetaError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(temporary)
            .map_err(io_err(path, "creating"))?;
        lock_exclusively(&file, path)?;
        let regions = size.div_ceil(REGION_SIZE);
        let bitmap_bytes = bitmap_bytes(regions);
        file.set_len(BITMAP_OFFSET + bitmap_bytes * peers.len() as u64)
            .map_err(io_err(path, "sizing"))?;
        let mut metadata = Metadata {
            file,
            path: path.to_path_buf(),
            superblock: Superblock {
                node: node.to_string(),
                resource: resource.to_string(),
                peers: peers.to_vec(),
                size,
                generations: Generations::just_created(),
                primary: false,
                disk: DiskState::Outdated,
                clean: true,
                created_blank: blank_backing,
                backing: None,
                backing_modified_ns: 0,
            },
            backing_path: None,
            superblock_seq: 0,
            al_extents: Vec::new(),
            al_refs: Vec::new(),
            al_released: Vec::new(),
            flush_generation: 1,
            flushed_below: 0,
            al_seq: 0,
            bitmaps: vec![vec![0; regions.div_ceil(64) as usize]; peers.len()],
            set_regions: vec![0; peers.len()],
            any_regions: 0,
            remarked: vec![vec![0; regions.div_ceil(64) as usize]; peers.len()],
            regions,
            bitmap_bytes,
            dirty_pages: BTreeSet::new(),
            recovered_extents: 0,
            failed: None,
        };
        // Both slots, so a torn first update still finds a valid superblock.
        metadata.write_superblock()?;
        metadata.write_superblock()?;
        metadata.write_activity_log()?;
        Ok(metadata)
    }

    /// Opens existing metadata. If it was not closed cleanly, every extent in the
    /// activity log is marked out of sync (and that is made durable).
    pub fn open(path: &Path) -> Result<Metadata, MetaError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_err(path, "opening"))?;
        lock_exclusively(&file, path)?;
        let mut best: Option<(u64, Superblock)> = None;
        for slot in 0..2 {
            let mut record = vec![0u8; RECORD_SIZE as usize];
            if read_record(&file, slot * RECORD_SIZE, &mut record)
                .map_err(io_err(path, "reading"))?
            {
                if let Some((seq, superblock)) = decode_superblock(&record) {
                    if best.as_ref().map_or(true, |(best_seq, _)| seq > *best_seq) {
                        best = Some((seq, superblock));
                    }
                }
            }
        }
        let Some((superblock_seq, superblock)) = best else {
            return Err(MetaError::NoSuperblock {
                path: path.to_path_buf(),
            });
        };
        let mut al: Option<(u64, Vec<u64>)> = None;
        for index in 0..AL_RING {
            let mut record = vec![0u8; RECORD_SIZE as usize];
            if read_record(&file, AL_OFFSET + index * RECORD_SIZE, &mut record)
                .map_err(io_err(path, "reading"))?
            {
                if let Some((seq, extents)) = decode_activity_log(&record) {
                    if al.as_ref().map_or(true, |(best_seq, _)| seq > *best_seq) {
                        al = Some((seq, extents));
                    }
                }
            }
        }
        let (al_seq, mut al_extents) = al.unwrap_or_default();
        // Only a damaged file names extents past the end (whose offsets could overflow).
        let size = superblock.size;
        al_extents.retain(|extent| {
            let inside = extent
                .checked_mul(EXTENT_SIZE)
                .is_some_and(|offset| offset < size);
            if !inside {
                tracing::warn!(
                    "metadata {}: activity log names extent {extent}, past the end: ignored",
                    path.display()
                );
            }
            inside
        });
        let regions = superblock.size.div_ceil(REGION_SIZE);
        let bitmap_bytes = bitmap_bytes(regions);
        let words = regions.div_ceil(64) as usize;
        let mut bitmaps = Vec::new();
        for peer in 0..superblock.peers.len() as u64 {
            let mut raw = vec![0u8; words * 8];
            file.read_exact_at(&mut raw, BITMAP_OFFSET + peer * bitmap_bytes)
                .map_err(io_err(path, "reading the bitmap"))?;
            let mut bitmap: Vec<u64> = raw
                .chunks_exact(8)
                .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
                .collect();
            // Bits past the last region (only a damaged file has them) would count as out
            // of sync for ever, as no resync visits them, and keep the bitmap generation
            // open.
            if regions % 64 != 0 {
                if let Some(last) = bitmap.last_mut() {
                    let past_the_end = *last & !((1u64 << (regions % 64)) - 1);
                    if past_the_end != 0 {
                        tracing::warn!(
                            "metadata {}: bitmap bits past the last region cleared",
                            path.display()
                        );
                        *last &= !past_the_end;
                    }
                }
            }
            bitmaps.push(bitmap);
        }
        let was_clean = superblock.clean;
        let mut metadata = Metadata {
            file,
            path: path.to_path_buf(),
            superblock,
            superblock_seq,
            al_refs: vec![0; al_extents.len()],
            // Recovered extents count as written in generation 1: the first flush after
            // opening makes them evictable.
            al_released: vec![1; al_extents.len()],
            flush_generation: 1,
            flushed_below: 0,
            al_extents,
            al_seq,
            remarked: vec![vec![0; words]; bitmaps.len()],
            set_regions: bitmaps
                .iter()
                .map(|b| b.iter().map(|w| u64::from(w.count_ones())).sum())
                .collect(),
            any_regions: (0..words)
                .map(|w| u64::from(bitmaps.iter().fold(0, |acc, b| acc | b[w]).count_ones()))
                .sum(),
            bitmaps,
            regions,
            bitmap_bytes,
            dirty_pages: BTreeSet::new(),
            recovered_extents: 0,
            failed: None,
            backing_path: None,
        };
        if !was_clean {
            let extents = metadata.al_extents.clone();
            for extent in &extents {
                metadata.mark_out_of_sync_for_all(extent * EXTENT_SIZE, EXTENT_SIZE);
            }
            metadata.recovered_extents = extents.len();
            metadata.flush_bitmap()?;
        }
        Ok(metadata)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn superblock(&self) -> &Superblock {
        &self.superblock
    }

    /// Extents marked out of sync because the last shutdown was not clean.
    pub fn recovered_extents(&self) -> usize {
        self.recovered_extents
    }

    /// Changes the superblock and makes the change durable.
    pub fn update(&mut self, change: impl FnOnce(&mut Superblock)) -> Result<(), MetaError> {
        change(&mut self.superblock);
        self.write_superblock()
    }

    /// Marks the metadata in use (not clean) or, after writing the bitmap, cleanly closed.
    pub fn set_clean(&mut self, clean: bool) -> Result<(), MetaError> {
        if clean {
            self.flush_bitmap()?;
        }
        // After the node's last write: compared at the next start (see
        // [`Superblock::backing_modified_ns`]).
        let modified = match (&self.superblock.backing, &self.backing_path) {
            (Some(BackingIdentity::File { .. }), Some(path)) if clean => modified_ns(path),
            _ => 0,
        };
        self.update(|sb| {
            sb.clean = clean;
            if clean {
                sb.backing_modified_ns = modified;
            }
        })
    }

    fn write_superblock(&mut self) -> Result<(), MetaError> {
        self.superblock_seq += 1;
        let record = encode_superblock(self.superblock_seq, &self.superblock);
        let slot = self.superblock_seq % 2;
        self.disk("writing the superblock", |file| {
            file.write_all_at(&record, slot * RECORD_SIZE)
        })?;
        self.sync()
    }

    /// Runs `io` on the file, unless an earlier write or sync failed; a failure of this
    /// one stops the metadata (see [`MetaError::Stopped`]).
    fn disk<T>(
        &mut self,
        op: &'static str,
        io: impl FnOnce(&File) -> std::io::Result<T>,
    ) -> Result<T, MetaError> {
        self.usable()?;
        io(&self.file).map_err(|source| {
            let errno = source.raw_os_error().unwrap_or(libc::EIO);
            self.failed = Some((op, errno));
            tracing::error!(
                "metadata {}: {op} failed ({source}): stopped, no more writes until the \
                 node restarts",
                self.path.display()
            );
            io_err(&self.path, op)(source)
        })
    }

    /// Why the metadata stopped ([`MetaError::Stopped`]), once a write or sync has failed.
    pub fn stopped(&self) -> Option<MetaError> {
        self.usable().err()
    }

    /// Makes every later write of the file fail as a failing disk would: the file is
    /// swapped for a read-only handle, so the kernel refuses writes (EBADF).
    #[cfg(test)]
    pub fn refuse_writes(&mut self) {
        self.file = File::open(&self.path).unwrap();
    }

    /// Fails with [`MetaError::Stopped`] once a write or sync of the file has failed.
    fn usable(&self) -> Result<(), MetaError> {
        match self.failed {
            None => Ok(()),
            Some((op, errno)) => Err(MetaError::Stopped {
                path: self.path.clone(),
                op,
                cause: std::io::Error::from_raw_os_error(errno),
            }),
        }
    }

    // ---- activity log ----

    /// The extents a byte range touches.
    pub fn extents_of(offset: u64, length: u64) -> std::ops::RangeInclusive<u64> {
        let last = offset + length.max(1) - 1;
        offset / EXTENT_SIZE..=last / EXTENT_SIZE
    }

    /// Whether every extent of the range is already in the on-disk log (so a write there
    /// needs no log update). Does not take a reference.
    pub fn is_active(&self, extents: &std::ops::RangeInclusive<u64>) -> bool {
        extents.clone().all(|e| self.al_extents.contains(&e))
    }

    /// Takes a reference on every extent of the range for a write about to be submitted,
    /// logging (and fdatasyncing) any that are not in the log yet. Extents without writes
    /// in flight whose writes a completed flush made durable are evicted, least recently
    /// used first, after their bitmap bits are durable.
    /// [`MetaError::ActivityLogBusy`] means: wait for writes to finish, retry;
    /// [`MetaError::ActivityLogNeedsFlush`]: flush everywhere, retry.
    pub fn activate(&mut self, extents: std::ops::RangeInclusive<u64>) -> Result<(), MetaError> {
        // Extents entered in memory whose log record failed are not in the log on disk.
        self.usable()?;
        let missing: Vec<u64> = extents
            .clone()
            .filter(|e| !self.al_extents.contains(e))
            .collect();
        let free = AL_SLOTS - self.al_extents.len();
        let idle = |i: &usize| self.al_refs[*i] == 0 && !extents.contains(&self.al_extents[*i]);
        let evictable: Vec<usize> = (0..self.al_extents.len())
            .filter(idle)
            .filter(|&i| self.al_released[i] < self.flushed_below)
            .collect();
        if missing.len() > free + evictable.len() {
            let idle_count = (0..self.al_extents.len()).filter(idle).count();
            return Err(if missing.len() <= free + idle_count {
                MetaError::ActivityLogNeedsFlush
            } else {
                MetaError::ActivityLogBusy
            });
        }
        if !missing.is_empty() {
            let evict_count = missing.len().saturating_sub(free);
            let victims: Vec<usize> = evictable.into_iter().take(evict_count).collect();
            for &i in &victims {
                self.flush_bitmap_extent(self.al_extents[i])?;
            }
            if !victims.is_empty() {
                self.sync()?;
            }
            for &i in victims.iter().rev() {
                self.al_extents.remove(i);
                self.al_refs.remove(i);
                self.al_released.remove(i);
            }
            for extent in missing {
                self.al_extents.push(extent);
                self.al_refs.push(0);
                self.al_released.push(0);
            }
            self.write_activity_log()?;
        }
        // Most recently used moves to the back.
        for extent in extents {
            let i = self
                .al_extents
                .iter()
                .position(|&e| e == extent)
                .expect("activated above");
            let refs = self.al_refs.remove(i) + 1;
            let released = self.al_released.remove(i);
            self.al_extents.remove(i);
            self.al_extents.push(extent);
            self.al_refs.push(refs);
            self.al_released.push(released);
        }
        Ok(())
    }

    /// Drops the references [`Metadata::activate`] took, once the write finished (here and
    /// on the peers it waits for).
    /// Makes room in a full log for `extents` without a flush (a secondary cannot start
    /// one): the least recently used idle extents leave the log, each first marked out
    /// of sync for every peer, with the bits on disk before the log record that drops
    /// them. Nothing they may differ in is forgotten; it costs a resync check later.
    pub fn make_room_marking_out_of_sync(
        &mut self,
        extents: &std::ops::RangeInclusive<u64>,
    ) -> Result<(), MetaError> {
        self.usable()?;
        let missing = extents
            .clone()
            .filter(|e| !self.al_extents.contains(e))
            .count();
        let free = AL_SLOTS - self.al_extents.len();
        let needed = missing.saturating_sub(free);
        let victims: Vec<usize> = (0..self.al_extents.len())
            .filter(|&i| self.al_refs[i] == 0 && !extents.contains(&self.al_extents[i]))
            .take(needed)
            .collect();
        if victims.is_empty() {
            return Ok(());
        }
        for &i in &victims {
            let extent = self.al_extents[i];
            self.mark_out_of_sync_for_all(extent * EXTENT_SIZE, EXTENT_SIZE);
            self.flush_bitmap_extent(extent)?;
        }
        self.sync()?;
        for &i in victims.iter().rev() {
            self.al_extents.remove(i);
            self.al_refs.remove(i);
            self.al_released.remove(i);
        }
        self.write_activity_log()
    }

    pub fn release(&mut self, extents: std::ops::RangeInclusive<u64>) {
        for extent in extents {
            if let Some(i) = self.al_extents.iter().position(|&e| e == extent) {
                self.al_refs[i] = self.al_refs[i].saturating_sub(1);
                self.al_released[i] = self.flush_generation;
            }
        }
    }

    /// A flush (local and on every peer) is about to start: writes that finished before
    /// now are covered by it. Returns the generation to pass to [`Metadata::flush_done`].
    pub fn begin_flush(&mut self) -> u64 {
        let generation = self.flush_generation;
        self.flush_generation += 1;
        generation
    }

    /// The flush begun as `generation` completed: the extents whose writes it covered may
    /// leave the log.
    pub fn flush_done(&mut self, generation: u64) {
        self.flushed_below = self.flushed_below.max(generation + 1);
    }

    /// Marks out of sync for every peer the extents that no flush completed everywhere
    /// covers (those with writes in flight, or written since the last such flush), and
    /// answers how many it marked. Used where those writes may be on some replicas and
    /// not others: a local flush failed (they may be lost here while the peers hold
    /// them), or a secondary's primary left (they may have reached this node and not
    /// another). The extents whose writes a barrier made durable on every replica are
    /// left unmarked, as their eviction from the log leaves them.
    pub fn mark_unflushed_out_of_sync(&mut self) -> usize {
        let unflushed = self.unflushed_extents();
        for extent in &unflushed {
            self.mark_out_of_sync_for_all(extent * EXTENT_SIZE, EXTENT_SIZE);
        }
        unflushed.len()
    }

    /// The logged extents that no flush completed everywhere covers: writes in flight
    /// there, or finished since the last such flush began.
    pub fn unflushed_extents(&self) -> Vec<u64> {
        (0..self.al_extents.len())
            .filter(|&i| self.al_refs[i] > 0 || self.al_released[i] >= self.flushed_below)
            .map(|i| self.al_extents[i])
            .collect()
    }

    /// Extents in the on-disk log.
    pub fn logged_extents(&self) -> &[u64] {
        &self.al_extents
    }

    fn write_activity_log(&mut self) -> Result<(), MetaError> {
        self.al_seq += 1;
        let record = encode_activity_log(self.al_seq, &self.al_extents);
        let offset = AL_OFFSET + (self.al_seq % AL_RING) * RECORD_SIZE;
        self.disk("writing the activity log", |file| {
            file.write_all_at(&record, offset)
        })?;
        self.sync()
    }

    // ---- bitmap ----

    /// Number of regions (bits).
    pub fn regions(&self) -> u64 {
        self.regions
    }

    /// Number of peers (bitmaps).
    pub fn peer_count(&self) -> usize {
        self.bitmaps.len()
    }

    /// Marks every region a byte range touches as missed by `peer` (in memory; durable
    /// at the latest when its extent leaves the activity log or at
    /// [`Metadata::flush_bitmap`]).
    pub fn mark_out_of_sync(&mut self, peer: usize, offset: u64, length: u64) {
        if length == 0 || offset >= self.superblock.size {
            return;
        }
        let end = offset.saturating_add(length).min(self.superblock.size);
        for region in offset / REGION_SIZE..end.div_ceil(REGION_SIZE) {
            self.set_bit(peer, region, true);
        }
    }

    /// Marks a byte range as missed by every peer.
    pub fn mark_out_of_sync_for_all(&mut self, offset: u64, length: u64) {
        for peer in 0..self.peer_count() {
            self.mark_out_of_sync(peer, offset, length);
        }
    }

    /// Marks every region of the device as missed by `peer` (a full resync).
    pub fn mark_all_out_of_sync(&mut self, peer: usize) {
        for region in 0..self.regions {
            self.set_bit(peer, region, true);
        }
    }

    /// Clears every bitmap (this node now equals its resync source).
    pub fn mark_all_in_sync(&mut self) {
        for peer in 0..self.peer_count() {
            for region in 0..self.regions {
                self.set_bit(peer, region, false);
            }
        }
    }

    /// Records that the backing lost every byte this metadata describes (a memory
    /// backing after a restart, or a backing file created anew under old metadata): the
    /// node becomes a just-created one, not primary, with an inconsistent disk (it holds
    /// nothing it can vouch for). A peer with data then resyncs it in full, and it is
    /// promoted only by force before that.
    /// Kept as it was, the old generation would have matched the peers' and the node
    /// would have served zeroes as up to date (review, session 70). The superblock goes
    /// to disk before the cleared bits, so a crash between the two leaves a just-created
    /// node with bits set, which a full resync covers anyway.
    pub fn forget_data(&mut self) -> Result<(), MetaError> {
        self.update(|sb| {
            sb.generations = Generations::just_created();
            sb.primary = false;
            sb.disk = DiskState::Inconsistent;
            sb.created_blank = false;
        })?;
        self.mark_all_in_sync();
        self.flush_bitmap()
    }

    /// Compares the backing now at the node's path with the one this metadata describes.
    /// Another backing (a replaced disk, an image deleted and created anew, one restored
    /// from a copy) holds data of unknown age: its data is forgotten ([`Self::forget_data`])
    /// and the new identity recorded in the same superblock write, and the recorded one is
    /// returned. Where none was recorded (new or older metadata), `now` is recorded; where
    /// `now` is unknown, the record stays.
    /// Also, where the last close was clean, a file modified since (rewritten in place by
    /// another tool) counts as another backing. Returns why the backing counts as another
    /// one, if it does; remembers `path` for the modification time of the next clean
    /// close.
    pub fn check_backing(&mut self, path: Option<&Path>) -> Result<Option<String>, MetaError> {
        self.backing_path = path.map(Path::to_path_buf);
        let Some(path) = path else {
            return Ok(None);
        };
        self.check_backing_identity(BackingIdentity::of(path), modified_ns(path))
    }

    /// [`Self::check_backing`] with the backing's identity and modification time given.
    fn check_backing_identity(
        &mut self,
        now: Option<BackingIdentity>,
        modified_now: u64,
    ) -> Result<Option<String>, MetaError> {
        let Some(now) = now else {
            return Ok(None);
        };
        let sb = &self.superblock;
        let replaced = match &sb.backing {
            Some(recorded) if recorded.differs_from(&now) => {
                Some(format!("{recorded} then, {now} now"))
            }
            Some(BackingIdentity::File { .. })
                if sb.clean
                    && sb.backing_modified_ns != 0
                    && modified_now != 0
                    && modified_now != sb.backing_modified_ns =>
            {
                Some(format!(
                    "modified {} since the node's clean stop, which it left at {}",
                    format_ns(modified_now),
                    format_ns(sb.backing_modified_ns)
                ))
            }
            _ => None,
        };
        match replaced {
            Some(why) => {
                self.superblock.backing = Some(now);
                self.superblock.backing_modified_ns = 0;
                self.forget_data()?;
                Ok(Some(why))
            }
            None if sb.backing.as_ref() == Some(&now) => Ok(None),
            // New metadata, older metadata, or a birth time that is now known.
            None => {
                self.update(|sb| sb.backing = Some(now))?;
                Ok(None)
            }
        }
    }

    /// Marks one region in sync with `peer`.
    pub fn mark_in_sync(&mut self, peer: usize, region: u64) {
        self.set_bit(peer, region, false);
    }

    /// A resync pass is about to read the regions a byte range touches, to copy them to
    /// `peer`: marks made from now on are newer than the copy.
    pub fn copying(&mut self, peer: usize, offset: u64, length: u64) {
        let end = offset.saturating_add(length).min(self.superblock.size);
        for region in offset / REGION_SIZE..end.div_ceil(REGION_SIZE) {
            self.remarked[peer][(region / 64) as usize] &= !(1 << (region % 64));
        }
    }

    /// Marks a region a resync pass copied in sync with `peer`, unless it was marked out
    /// of sync again since the copy (see [`Metadata::copying`]); returns whether it did.
    pub fn mark_copied_in_sync(&mut self, peer: usize, region: u64) -> bool {
        let remarked = self.remarked[peer][(region / 64) as usize] & (1 << (region % 64)) != 0;
        if !remarked {
            self.set_bit(peer, region, false);
        }
        !remarked
    }

    pub fn is_out_of_sync(&self, peer: usize, region: u64) -> bool {
        region < self.regions
            && self.bitmaps[peer][(region / 64) as usize] & (1 << (region % 64)) != 0
    }

    /// Whether any peer misses the region.
    fn is_out_of_sync_for_any(&self, region: u64) -> bool {
        (0..self.peer_count()).any(|peer| self.is_out_of_sync(peer, region))
    }

    /// The first region at or after `from` that `peer` misses.
    pub fn next_out_of_sync(&self, peer: usize, from: u64) -> Option<u64> {
        (from..self.regions).find(|&r| self.is_out_of_sync(peer, r))
    }

    /// Regions `peer` misses.
    pub fn out_of_sync_regions(&self, peer: usize) -> u64 {
        self.set_regions[peer]
    }

    /// Bytes `peer` misses (the last region may be partial).
    pub fn out_of_sync_bytes(&self, peer: usize) -> u64 {
        self.bytes_of(
            self.out_of_sync_regions(peer),
            self.is_out_of_sync(peer, self.regions - 1),
        )
    }

    /// Bytes some peer misses.
    pub fn out_of_sync_bytes_for_any(&self) -> u64 {
        self.bytes_of(
            self.any_regions,
            self.is_out_of_sync_for_any(self.regions - 1),
        )
    }

    fn bytes_of(&self, regions: u64, last_is_set: bool) -> u64 {
        let mut bytes = regions * REGION_SIZE;
        let tail = self.superblock.size % REGION_SIZE;
        if tail != 0 && last_is_set {
            bytes -= REGION_SIZE - tail;
        }
        bytes
    }

    /// Runs of bytes some peer misses, as (offset, length), in order.
    pub fn out_of_sync_runs(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut region = 0;
        while let Some(first) = (region..self.regions).find(|&r| self.is_out_of_sync_for_any(r)) {
            let mut end = first + 1;
            while end < self.regions && self.is_out_of_sync_for_any(end) {
                end += 1;
            }
            let offset = first * REGION_SIZE;
            let length = (end * REGION_SIZE).min(self.superblock.size) - offset;
            runs.push((offset, length));
            region = end;
        }
        runs
    }

    fn set_bit(&mut self, peer: usize, region: u64, value: bool) {
        let word = (region / 64) as usize;
        let mask = 1u64 << (region % 64);
        if value {
            self.remarked[peer][word] |= mask;
        }
        let bitmap = &mut self.bitmaps[peer];
        let old = bitmap[word];
        bitmap[word] = if value { old | mask } else { old & !mask };
        if bitmap[word] != old {
            self.dirty_pages
                .insert((peer, word as u64 * 8 / BITMAP_PAGE));
            let others = (0..self.bitmaps.len())
                .any(|other| other != peer && self.bitmaps[other][word] & mask != 0);
            if value {
                self.set_regions[peer] += 1;
                self.any_regions += u64::from(!others);
            } else {
                self.set_regions[peer] -= 1;
                self.any_regions -= u64::from(!others);
            }
        }
    }

    fn write_bitmap_page(&mut self, peer: usize, page: u64) -> Result<(), MetaError> {
        let words_per_page = (BITMAP_PAGE / 8) as usize;
        let bitmap = &self.bitmaps[peer];
        let first = page as usize * words_per_page;
        let last = (first + words_per_page).min(bitmap.len());
        let bytes: Vec<u8> = bitmap[first..last]
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        let offset = BITMAP_OFFSET + peer as u64 * self.bitmap_bytes + page * BITMAP_PAGE;
        self.disk("writing the bitmap", |file| {
            file.write_all_at(&bytes, offset)
        })
    }

    fn flush_bitmap_extent(&mut self, extent: u64) -> Result<(), MetaError> {
        let word = extent * REGIONS_PER_EXTENT / 64;
        let page = word * 8 / BITMAP_PAGE;
        for peer in 0..self.peer_count() {
            if self.dirty_pages.remove(&(peer, page)) {
                self.write_bitmap_page(peer, page)?;
            }
        }
        Ok(())
    }

    /// Writes every changed bitmap page and fdatasyncs.
    pub fn flush_bitmap(&mut self) -> Result<(), MetaError> {
        let pages = std::mem::take(&mut self.dirty_pages);
        for (peer, page) in pages {
            self.write_bitmap_page(peer, page)?;
        }
        self.sync()
    }

    fn sync(&mut self) -> Result<(), MetaError> {
        self.disk("syncing", File::sync_data)
    }
}

/// Bytes of one peer's bitmap on disk: a bit per region, whole pages.
fn bitmap_bytes(regions: u64) -> u64 {
    regions.div_ceil(8).next_multiple_of(BITMAP_PAGE)
}

/// Wraps an I/O error with the metadata path and what was being done.
fn io_err(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> MetaError {
    let path = path.to_path_buf();
    move |cause| MetaError::Io { path, op, cause }
}

/// Reads one record; `false` if the file is too short to hold it.
fn read_record(file: &File, offset: u64, record: &mut [u8]) -> std::io::Result<bool> {
    match file.read_exact_at(record, offset) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// Appends the CRC32C of `body` and pads to a record.
fn seal(mut body: Vec<u8>) -> Vec<u8> {
    let crc = crc32c::crc32c(&body);
    body.extend_from_slice(&crc.to_be_bytes());
    assert!(body.len() <= RECORD_SIZE as usize, "record overflow");
    body.resize(RECORD_SIZE as usize, 0);
    body
}

/// The checked body of a sealed record whose body is `len` bytes long.
fn unseal(record: &[u8], len: usize) -> Option<&[u8]> {
    let crc = u32::from_be_bytes(record.get(len..len + 4)?.try_into().ok()?);
    (crc32c::crc32c(&record[..len]) == crc).then(|| &record[..len])
}

fn encode_superblock(seq: u64, sb: &Superblock) -> Vec<u8> {
    let mut body = Vec::with_capacity(256);
    body.extend_from_slice(&SUPERBLOCK_MAGIC.to_be_bytes());
    body.extend_from_slice(&FORMAT_VERSION.to_be_bytes());
    body.extend_from_slice(&seq.to_be_bytes());
    body.extend_from_slice(&(REGION_SIZE as u32).to_be_bytes());
    body.extend_from_slice(&(EXTENT_SIZE as u32).to_be_bytes());
    body.extend_from_slice(&sb.size.to_be_bytes());
    let disk = match sb.disk {
        DiskState::UpToDate => 1,
        DiskState::Outdated => 2,
        DiskState::Inconsistent => 3,
    };
    let mut flags = disk << flag::DISK_SHIFT;
    if sb.primary {
        flags |= flag::PRIMARY;
    }
    if sb.clean {
        flags |= flag::CLEAN;
    }
    if sb.created_blank {
        flags |= flag::CREATED_BLANK;
    }
    body.extend_from_slice(&flags.to_be_bytes());
    for g in [
        sb.generations.current,
        sb.generations.bitmap,
        sb.generations.history[0],
        sb.generations.history[1],
    ] {
        body.extend_from_slice(&g.to_be_bytes());
    }
    body.push(sb.peers.len() as u8);
    for text in [&sb.node, &sb.resource].into_iter().chain(&sb.peers) {
        body.extend_from_slice(&(text.len() as u16).to_be_bytes());
        body.extend_from_slice(text.as_bytes());
    }
    // Last, and only when known: metadata written before this field ends at the peers.
    match &sb.backing {
        None => {}
        Some(BackingIdentity::File { inode, born_ns }) => {
            body.push(backing_tag::FILE);
            body.extend_from_slice(&inode.to_be_bytes());
            body.extend_from_slice(&born_ns.to_be_bytes());
            body.extend_from_slice(&sb.backing_modified_ns.to_be_bytes());
        }
        Some(BackingIdentity::Device { serial }) => {
            body.push(backing_tag::DEVICE);
            body.extend_from_slice(&(serial.len() as u16).to_be_bytes());
            body.extend_from_slice(serial.as_bytes());
        }
    }
    let len = body.len() as u16;
    let mut record = len.to_be_bytes().to_vec();
    record.extend(body);
    seal(record)
}

fn decode_superblock(record: &[u8]) -> Option<(u64, Superblock)> {
    let len = usize::from(u16::from_be_bytes(record.get(..2)?.try_into().ok()?));
    let body = unseal(record, 2 + len)?;
    let mut r = &body[2..];
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, tail) = r.split_at_checked(n)?;
        r = tail;
        Some(head)
    };
    let u64_of = |b: &[u8]| u64::from_be_bytes(b.try_into().expect("8 bytes"));
    let u32_of = |b: &[u8]| u32::from_be_bytes(b.try_into().expect("4 bytes"));
    if u64_of(take(8)?) != SUPERBLOCK_MAGIC || u32_of(take(4)?) != FORMAT_VERSION {
        return None;
    }
    let seq = u64_of(take(8)?);
    if u32_of(take(4)?) as u64 != REGION_SIZE || u32_of(take(4)?) as u64 != EXTENT_SIZE {
        return None;
    }
    let size = u64_of(take(8)?);
    let flags = u32_of(take(4)?);
    let disk = match flags >> flag::DISK_SHIFT & 0xff {
        1 => DiskState::UpToDate,
        2 => DiskState::Outdated,
        3 => DiskState::Inconsistent,
        _ => return None,
    };
    let generations = Generations {
        current: u64_of(take(8)?),
        bitmap: u64_of(take(8)?),
        history: [u64_of(take(8)?), u64_of(take(8)?)],
    };
    let peer_count = usize::from(*take(1)?.first()?);
    let mut text = || -> Option<String> {
        let n = usize::from(u16::from_be_bytes(take(2)?.try_into().ok()?));
        String::from_utf8(take(n)?.to_vec()).ok()
    };
    let node = text()?;
    let resource = text()?;
    let peers = (0..peer_count)
        .map(|_| text())
        .collect::<Option<Vec<_>>>()?;
    let mut backing_modified_ns = 0;
    let backing = match take(1).map(|tag| tag[0]) {
        None => None,
        Some(backing_tag::FILE) => {
            let identity = BackingIdentity::File {
                inode: u64_of(take(8)?),
                born_ns: u64_of(take(8)?),
            };
            // Absent from records written before it was kept.
            backing_modified_ns = take(8).map_or(0, u64_of);
            Some(identity)
        }
        Some(backing_tag::DEVICE) => {
            let n = usize::from(u16::from_be_bytes(take(2)?.try_into().ok()?));
            let serial = String::from_utf8(take(n)?.to_vec()).ok()?;
            Some(BackingIdentity::Device { serial })
        }
        Some(_) => return None,
    };
    Some((
        seq,
        Superblock {
            node,
            resource,
            peers,
            size,
            generations,
            primary: flags & flag::PRIMARY != 0,
            disk,
            clean: flags & flag::CLEAN != 0,
            created_blank: flags & flag::CREATED_BLANK != 0,
            backing,
            backing_modified_ns,
        },
    ))
}

fn encode_activity_log(seq: u64, extents: &[u64]) -> Vec<u8> {
    let mut body = Vec::with_capacity(16 + extents.len() * 8);
    body.extend_from_slice(&AL_MAGIC.to_be_bytes());
    body.extend_from_slice(&seq.to_be_bytes());
    body.extend_from_slice(&(extents.len() as u32).to_be_bytes());
    for extent in extents {
        body.extend_from_slice(&extent.to_be_bytes());
    }
    seal(body)
}

fn decode_activity_log(record: &[u8]) -> Option<(u64, Vec<u64>)> {
    if u32::from_be_bytes(record.get(..4)?.try_into().ok()?) != AL_MAGIC {
        return None;
    }
    let count = u32::from_be_bytes(record.get(12..16)?.try_into().ok()?) as usize;
    if count > AL_SLOTS {
        return None;
    }
    let body = unseal(record, 16 + count * 8)?;
    let seq = u64::from_be_bytes(body[4..12].try_into().ok()?);
    let extents = body[16..]
        .chunks_exact(8)
        .map(|c| u64::from_be_bytes(c.try_into().expect("8 bytes")))
        .collect();
    Some((seq, extents))
}

#[cfg(test)]
mod tests {
    use super::*;

    mod records {
        use super::*;
        use proptest::prelude::*;

        fn name() -> impl Strategy<Value = String> {
            // Names are at most 64 bytes (the resource file's limit), any UTF-8.
            proptest::string::string_regex("[a-zé0-9_-]{1,32}").expect("valid regex")
        }

        fn disk() -> impl Strategy<Value = DiskState> {
            prop_oneof![
                Just(DiskState::UpToDate),
                Just(DiskState::Outdated),
                Just(DiskState::Inconsistent)
            ]
        }

        fn backing() -> impl Strategy<Value = Option<BackingIdentity>> {
            prop_oneof![
                Just(None),
                any::<(u64, u64)>()
                    .prop_map(|(inode, born_ns)| Some(BackingIdentity::File { inode, born_ns })),
                proptest::string::string_regex("[ -~é]{0,120}")
                    .expect("valid regex")
                    .prop_map(|serial| Some(BackingIdentity::Device { serial })),
            ]
        }

        proptest! {
            #[test]
            fn superblocks_round_trip_in_one_record_and_any_damage_is_refused(
                seq in any::<u64>(),
                (node, resource) in (name(), name()),
                peers in proptest::collection::vec(name(), 1..=2),
                size in any::<u64>(),
                gens in any::<[u64; 4]>(),
                (primary, clean, created_blank) in any::<(bool, bool, bool)>(),
                disk in disk(),
                backing in backing(),
                modified in any::<u64>(),
                flip in any::<(usize, u8)>(),
            ) {
                // Kept only beside a file's identity.
                let backing_modified_ns = match backing {
                    Some(BackingIdentity::File { .. }) => modified,
                    _ => 0,
                };
                let sb = Superblock {
                    node, resource, peers, size,
                    generations: Generations {
                        current: gens[0], bitmap: gens[1], history: [gens[2], gens[3]],
                    },
                    primary, disk, clean, created_blank, backing, backing_modified_ns,
                };
                let record = encode_superblock(seq, &sb);
                prop_assert!(record.len() as u64 <= RECORD_SIZE);
                prop_assert_eq!(decode_superblock(&record), Some((seq, sb)));
                // One changed byte anywhere in what the checksum seals (the length, the
                // body, the checksum) is refused; the padding after it is not read.
                let sealed = 2 + usize::from(u16::from_be_bytes([record[0], record[1]])) + 4;
                let mut damaged = record.clone();
                damaged[flip.0 % sealed] ^= flip.1.max(1);
                prop_assert_eq!(decode_superblock(&damaged), None);
            }

            #[test]
            fn activity_log_records_round_trip_and_damage_is_refused(
                seq in any::<u64>(),
                extents in proptest::collection::vec(any::<u64>(), 0..=AL_SLOTS),
                flip in any::<(usize, u8)>(),
            ) {
                let record = encode_activity_log(seq, &extents);
                prop_assert!(record.len() as u64 <= RECORD_SIZE);
                let sealed = 16 + 8 * extents.len() + 4;
                prop_assert_eq!(decode_activity_log(&record), Some((seq, extents)));
                let mut damaged = record.clone();
                damaged[flip.0 % sealed] ^= flip.1.max(1);
                prop_assert_eq!(decode_activity_log(&damaged), None);
            }
        }
    }

    // 512 extents: room to fill the activity log (256) and more.
    const SIZE: u64 = 2 << 30;

    fn peers() -> Vec<String> {
        vec!["beta".into(), "gamma".into()]
    }

    fn fresh(dir: &tempfile::TempDir) -> (PathBuf, Metadata) {
        let path = dir.path().join("node.meta");
        let metadata =
            Metadata::open_or_create(&path, "alpha", "r0", &peers(), SIZE, true).unwrap();
        (path, metadata)
    }

    #[test]
    fn another_backing_at_the_path_makes_the_node_forget_its_data() {
        let dir = tempfile::tempdir().unwrap();
        let (path, mut metadata) = fresh(&dir);
        let first = BackingIdentity::File {
            inode: 12,
            born_ns: 1_700_000_000_000_000_000,
        };
        // Nothing recorded yet (new, or older metadata): recorded, nothing forgotten.
        assert_eq!(
            metadata
                .check_backing_identity(Some(first.clone()), 0)
                .unwrap(),
            None
        );
        metadata
            .update(|sb| {
                sb.generations.current = 0x1234;
                sb.disk = DiskState::UpToDate;
            })
            .unwrap();
        // The same backing, or one that cannot be told now: nothing changes.
        assert_eq!(
            metadata
                .check_backing_identity(Some(first.clone()), 0)
                .unwrap(),
            None
        );
        assert_eq!(metadata.check_backing_identity(None, 0).unwrap(), None);
        // A birth time not kept on one side compares the inode alone.
        let no_birth = BackingIdentity::File {
            inode: 12,
            born_ns: 0,
        };
        assert_eq!(
            metadata.check_backing_identity(Some(no_birth), 0).unwrap(),
            None
        );
        assert_eq!(metadata.superblock().generations.current, 0x1234);
        assert_eq!(
            metadata
                .check_backing_identity(Some(first.clone()), 0)
                .unwrap(),
            None
        );
        // The same inode number born later: a file deleted and created anew.
        let recreated = BackingIdentity::File {
            inode: 12,
            born_ns: 1_800_000_000_000_000_000,
        };
        assert_eq!(
            metadata
                .check_backing_identity(Some(recreated.clone()), 0)
                .unwrap(),
            Some(format!("{first} then, {recreated} now"))
        );
        drop(metadata);
        let mut metadata = Metadata::open(&path).unwrap();
        let sb = metadata.superblock();
        assert_eq!(sb.generations, Generations::just_created());
        assert_eq!(sb.disk, DiskState::Inconsistent);
        assert_eq!(sb.backing, Some(recreated.clone()));
        // A block device where a file was, and another disk's serial.
        let disk = BackingIdentity::Device {
            serial: "0x5000c500a1b2c3d4".into(),
        };
        assert_eq!(
            metadata
                .check_backing_identity(Some(disk.clone()), 0)
                .unwrap(),
            Some(format!("{recreated} then, {disk} now"))
        );
        let other = BackingIdentity::Device {
            serial: "0x5000c500ffffffff".into(),
        };
        assert_eq!(
            metadata
                .check_backing_identity(Some(other.clone()), 0)
                .unwrap(),
            Some(format!("{disk} then, {other} now"))
        );
    }

    #[test]
    fn a_file_rewritten_in_place_after_a_clean_close_makes_the_node_forget_its_data() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("disk.img");
        std::fs::write(&image, [7u8; 4096]).unwrap();
        let (path, mut metadata) = fresh(&dir);
        assert_eq!(metadata.check_backing(Some(&image)).unwrap(), None);
        let with_data = |metadata: &mut Metadata| {
            metadata
                .update(|sb| {
                    sb.generations.current = 0x1234;
                    sb.disk = DiskState::UpToDate;
                })
                .unwrap()
        };
        with_data(&mut metadata);
        // Closed cleanly: the file's modification time is recorded.
        metadata.set_clean(true).unwrap();
        drop(metadata);
        let mut metadata = Metadata::open(&path).unwrap();
        assert_ne!(metadata.superblock().backing_modified_ns, 0);
        assert_eq!(metadata.check_backing(Some(&image)).unwrap(), None);
        metadata.set_clean(true).unwrap();
        drop(metadata);
        // Rewritten in place (the same inode and birth time), as `cp` or `dd` do.
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&image, [0u8; 4096]).unwrap();
        let mut metadata = Metadata::open(&path).unwrap();
        let why = metadata.check_backing(Some(&image)).unwrap();
        assert!(why.is_some_and(|why| why.contains("modified")));
        assert_eq!(
            metadata.superblock().generations,
            Generations::just_created()
        );
        // Not compared after a close that was not clean: the node's own writes may have
        // changed the time since it was recorded.
        with_data(&mut metadata);
        metadata.set_clean(true).unwrap();
        metadata.set_clean(false).unwrap();
        drop(metadata);
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::write(&image, [1u8; 4096]).unwrap();
        let mut metadata = Metadata::open(&path).unwrap();
        assert_eq!(metadata.check_backing(Some(&image)).unwrap(), None);
        assert_eq!(metadata.superblock().generations.current, 0x1234);
    }

    #[test]
    fn a_files_identity_changes_when_it_is_created_anew_at_the_same_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let first = BackingIdentity::of(&path).expect("a file has an identity");
        assert_eq!(BackingIdentity::of(&path), Some(first.clone()));
        // Rewritten in place: the same file.
        std::fs::write(&path, [1u8; 4096]).unwrap();
        assert_eq!(BackingIdentity::of(&path), Some(first.clone()));
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, [0u8; 4096]).unwrap();
        let second = BackingIdentity::of(&path).unwrap();
        assert!(first.differs_from(&second), "{first} against {second}");
        assert_eq!(BackingIdentity::of(&dir.path().join("missing")), None);
    }

    #[test]
    fn whether_the_backing_started_blank_is_kept_and_forgetting_data_resets_the_node() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.meta");
        let metadata = Metadata::open_or_create(&path, "alpha", "r0", &peers(), SIZE, false);
        assert!(!metadata.unwrap().superblock().created_blank);
        std::fs::remove_file(&path).unwrap();
        let (path, mut metadata) = fresh(&dir);
        assert!(metadata.superblock().created_blank);
        metadata
            .update(|sb| {
                sb.generations.current = 0x1234;
                sb.primary = true;
                sb.disk = DiskState::UpToDate;
            })
            .unwrap();
        metadata.mark_out_of_sync(1, 0, 1 << 20);
        metadata.flush_bitmap().unwrap();
        metadata.forget_data().unwrap();
        drop(metadata);
        // What `forget_data` recorded is what the next start reads.
        let metadata = Metadata::open(&path).unwrap();
        let sb = metadata.superblock();
        assert_eq!(sb.generations, Generations::just_created());
        assert!(!sb.primary && !sb.created_blank);
        assert_eq!(sb.disk, DiskState::Inconsistent);
        assert_eq!(metadata.out_of_sync_bytes(1), 0);
    }

    #[test]
    fn fresh_metadata_reopens_with_the_same_identity_and_state() {
        let dir = tempfile::tempdir().unwrap();
        let (path, mut metadata) = fresh(&dir);
        assert_eq!(
            metadata.superblock().generations,
            Generations::just_created()
        );
        assert_eq!(metadata.out_of_sync_bytes(0), 0);
        metadata
            .update(|sb| {
                sb.generations.current = 99;
                sb.primary = true;
                sb.disk = DiskState::UpToDate;
            })
            .unwrap();
        metadata.mark_out_of_sync(0, REGION_SIZE * 3 + 1, 10);
        metadata.set_clean(true).unwrap();
        drop(metadata);
        let metadata =
            Metadata::open_or_create(&path, "alpha", "r0", &peers(), SIZE, true).unwrap();
        let sb = metadata.superblock();
        assert_eq!(sb.generations.current, 99);
        assert!(sb.primary && sb.clean);
        assert_eq!(sb.disk, DiskState::UpToDate);
        assert!(metadata.is_out_of_sync(0, 3));
        assert_eq!(metadata.out_of_sync_regions(0), 1);
        assert_eq!(metadata.recovered_extents(), 0);
    }

    /// The kept counts of regions out of sync agree with a count of the bitmaps after any
    /// marks and clears, and after the file is read again.
    #[test]
    fn the_kept_out_of_sync_counts_match_the_bitmaps() {
        use proptest::test_runner::{Config, TestRunner};
        let mut runner = TestRunner::new(Config::with_cases(32));
        let op = (0..2usize, 0..200u64, proptest::prelude::any::<bool>());
        runner
            .run(&proptest::collection::vec(op, 0..200), |ops| {
                let dir = tempfile::tempdir().unwrap();
                let (path, mut metadata) = fresh(&dir);
                for (peer, region, set) in ops {
                    if set {
                        metadata.mark_out_of_sync(peer, region * REGION_SIZE, 1);
                    } else {
                        metadata.mark_in_sync(peer, region);
                    }
                }
                let counted = |m: &Metadata, peer: usize| {
                    (0..m.regions)
                        .filter(|&r| m.is_out_of_sync(peer, r))
                        .count() as u64
                };
                let any = |m: &Metadata| {
                    (0..m.regions)
                        .filter(|&r| m.is_out_of_sync_for_any(r))
                        .count() as u64
                };
                for peer in 0..2 {
                    proptest::prop_assert_eq!(
                        metadata.out_of_sync_regions(peer),
                        counted(&metadata, peer)
                    );
                }
                proptest::prop_assert_eq!(
                    metadata.out_of_sync_bytes_for_any(),
                    any(&metadata) * REGION_SIZE
                );
                metadata.flush_bitmap().unwrap();
                drop(metadata);
                let again =
                    Metadata::open_or_create(&path, "alpha", "r0", &peers(), SIZE, true).unwrap();
                for peer in 0..2 {
                    proptest::prop_assert_eq!(
                        again.out_of_sync_regions(peer),
                        counted(&again, peer)
                    );
                }
                proptest::prop_assert_eq!(
                    again.out_of_sync_bytes_for_any(),
                    any(&again) * REGION_SIZE
                );
                Ok(())
            })
            .unwrap();
    }

    /// Fresh metadata is written under a temporary name and then named (so that a crash in
    /// the middle cannot leave an empty file under the real name, which every later start
    /// refused: review, session 66); only the real name is left. A create over an existing
    /// file changes nothing and leaves no temporary file behind.
    #[test]
    fn fresh_metadata_leaves_only_its_name_and_never_replaces_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let (path, metadata) = fresh(&dir);
        let names = |dir: &tempfile::TempDir| {
            let mut names: Vec<_> = std::fs::read_dir(dir.path())
                .unwrap()
                .map(|entry| entry.unwrap().file_name())
                .collect();
            names.sort();
            names
        };
        assert_eq!(names(&dir), vec![path.file_name().unwrap().to_owned()]);
        let before = std::fs::read(&path).unwrap();
        match Metadata::create(&path, "alpha", "r0", &peers(), SIZE, true) {
            Err(MetaError::Io { cause, .. })
                if cause.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("created over existing metadata"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), before);
        assert_eq!(names(&dir), vec![path.file_name().unwrap().to_owned()]);
        drop(metadata);
        let reopened = Metadata::open(&path).unwrap();
        assert_eq!(reopened.superblock().node, "alpha");
    }

    /// A temporary file a crashed create left under this process's name (a PID 1 in a
    /// container has the same PID every start) does not stop the next create: it failed
    /// with a misleading "No such file or directory" once (re-review, session 67). One a
    /// running create holds is left alone (its node is starting).
    #[test]
    fn a_leftover_temporary_file_does_not_stop_a_create() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("node.meta");
        let leftover = dir
            .path()
            .join(format!("node.meta.creating.{}", std::process::id()));
        std::fs::write(&leftover, b"half written").unwrap();
        // Locked, it is another start's (with this PID, in another PID namespace), still
        // writing: the metadata is in use, and the file stays.
        let writing = std::fs::File::open(&leftover).unwrap();
        lock_exclusively(&writing, &path).unwrap();
        assert!(matches!(
            Metadata::open_or_create(&path, "alpha", "r0", &peers(), SIZE, true),
            Err(MetaError::InUse { .. })
        ));
        assert!(leftover.exists() && !path.exists());
        drop(writing);
        let metadata =
            Metadata::open_or_create(&path, "alpha", "r0", &peers(), SIZE, true).unwrap();
        assert_eq!(metadata.superblock().node, "alpha");
        assert!(!leftover.exists());
    }

    /// On a file system without `RENAME_NOREPLACE` the file is named by a link and an
    /// unlink, which refuse an existing name just as well.
    #[test]
    fn naming_by_link_never_replaces_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("from"), dir.path().join("to"));
        std::fs::write(&from, b"new").unwrap();
        std::fs::write(&to, b"old").unwrap();
        match name_by_link(&from, &to) {
            Err(MetaError::Io {
                op: NAMING, cause, ..
            }) if cause.kind() == std::io::ErrorKind::AlreadyExists => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(std::fs::read(&to).unwrap(), b"old");
        std::fs::remove_file(&to).unwrap();
        name_by_link(&from, &to).unwrap();
        assert_eq!(std::fs::read(&to).unwrap(), b"new");
        assert!(!from.exists());
    }

    /// A second open of metadata in use is refused before it reads or writes anything, and
    /// the file's bytes stay as they were; once the first is closed, it opens.
    #[test]
    fn metadata_in_use_is_refused_to_a_second_open() {
        let dir = tempfile::tempdir().unwrap();
        let (path, metadata) = fresh(&dir);
        let before = std::fs::read(&path).unwrap();
        match Metadata::open_or_create(&path, "alpha", "r0", &peers(), SIZE, true) {
            Err(MetaError::InUse { .. }) => {}
            Err(e) => panic!("refused for another reason: {e}"),
            Ok(_) => panic!("a second open of metadata in use succeeded"),
        }
        assert_eq!(std::fs::read(&path).unwrap(), before);
        drop(metadata);
        Metadata::open_or_create(&path, "alpha", "r0", &peers(), SIZE, true).unwrap();
    }

    /// After a write of the file fails (here: the file swapped for a read-only handle, so
    /// the kernel refuses the next write), nothing more is entered in the log, not even an
    /// extent the failed record was to add, and no other change is taken.
    #[test]
    fn the_first_failed_write_stops_the_metadata() {
        let dir = tempfile::tempdir().unwrap();
        let (path, mut metadata) = fresh(&dir);
        metadata.activate(0..=0).unwrap();
        assert!(metadata.stopped().is_none());
        metadata.refuse_writes();
        let first = metadata.activate(5..=5).unwrap_err();
        assert!(
            matches!(
                first,
                MetaError::Io {
                    op: "writing the activity log",
                    ..
                }
            ),
            "{first}"
        );
        let stopped = |result: Result<(), MetaError>| match result {
            Err(MetaError::Stopped { op, cause, .. }) => {
                assert_eq!(op, "writing the activity log");
                assert_eq!(cause.raw_os_error(), Some(libc::EBADF));
            }
            other => panic!("{other:?}"),
        };
        // Extent 5 is in the log in memory, not on disk: a write there must not go ahead.
        stopped(metadata.activate(5..=5));
        stopped(metadata.activate(0..=0));
        stopped(metadata.make_room_marking_out_of_sync(&(9..=9)));
        stopped(metadata.update(|sb| sb.primary = true));
        metadata.mark_out_of_sync(0, 0, 10);
        stopped(metadata.flush_bitmap());
        stopped(metadata.stopped().map_or(Ok(()), Err));
        drop(metadata);
        let reopened = Metadata::open(&path).unwrap();
        assert_eq!(reopened.logged_extents(), &[0]);
    }

    #[test]
    fn identity_mismatches_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (path, metadata) = fresh(&dir);
        drop(metadata);
        let e = Metadata::open_or_create(&path, "beta", "r0", &peers(), SIZE, true).unwrap_err();
        assert!(e.to_string().contains("\"alpha\""), "{e}");
        let e = Metadata::open_or_create(&path, "alpha", "r1", &peers(), SIZE, true).unwrap_err();
        assert!(e.to_string().contains("resource"), "{e}");
        let e =
            Metadata::open_or_create(&path, "alpha", "r0", &peers(), SIZE * 2, true).unwrap_err();
        assert!(matches!(e, MetaError::WrongSize { .. }), "{e}");
        std::fs::write(dir.path().join("junk"), vec![7u8; 100_000]).unwrap();
        let e = Metadata::open(&dir.path().join("junk")).unwrap_err();
        assert!(matches!(e, MetaError::NoSuperblock { .. }), "{e}");
    }

    #[test]
    fn a_torn_superblock_write_recovers_the_previous_state() {
        let dir = tempfile::tempdir().unwrap();
        let (path, mut metadata) = fresh(&dir);
        metadata.update(|sb| sb.generations.current = 11).unwrap();
        let seq = metadata.superblock_seq;
        metadata.update(|sb| sb.generations.current = 22).unwrap();
        drop(metadata);
        // Tear the newest slot: its second half never reached the disk.
        let newest_slot = (seq + 1) % 2;
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&[0xee; 2048], newest_slot * RECORD_SIZE + 40)
            .unwrap();
        let metadata = Metadata::open(&path).unwrap();
        assert_eq!(metadata.superblock().generations.current, 11);
    }

    #[test]
    fn a_file_cut_short_is_an_error_not_an_empty_bitmap() {
        let dir = tempfile::tempdir().unwrap();
        let (path, metadata) = fresh(&dir);
        drop(metadata);
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(BITMAP_OFFSET + 100).unwrap();
        drop(file);
        let e = Metadata::open(&path).unwrap_err();
        assert!(matches!(e, MetaError::Io { .. }), "{e}");
    }

    #[test]
    fn a_failed_flush_marks_only_extents_no_completed_flush_covers() {
        let dir = tempfile::tempdir().unwrap();
        let (_path, mut metadata) = fresh(&dir);
        let flushed = Metadata::extents_of(0, 4096);
        let written_after = Metadata::extents_of(EXTENT_SIZE, 4096);
        let in_flight = Metadata::extents_of(2 * EXTENT_SIZE, 4096);
        metadata.activate(flushed.clone()).unwrap();
        metadata.release(flushed);
        let covering = metadata.begin_flush();
        metadata.flush_done(covering);
        metadata.activate(written_after.clone()).unwrap();
        metadata.release(written_after);
        metadata.activate(in_flight).unwrap();
        let _failed = metadata.begin_flush();
        assert_eq!(metadata.mark_unflushed_out_of_sync(), 2);
        for peer in 0..metadata.peer_count() {
            assert!(!metadata.is_out_of_sync(peer, 0));
            assert_eq!(metadata.out_of_sync_bytes(peer), 2 * EXTENT_SIZE);
            assert!(metadata.is_out_of_sync(peer, EXTENT_SIZE / REGION_SIZE));
            assert!(metadata.is_out_of_sync(peer, 2 * EXTENT_SIZE / REGION_SIZE));
        }
    }

    #[test]
    fn bits_past_the_last_region_and_extents_past_the_end_are_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m");
        // 17 MiB: 272 regions, so the last bitmap word has 16 bits in use.
        let size = 17 << 20;
        let metadata = Metadata::create(&path, "alpha", "r0", &peers(), size, true).unwrap();
        let regions = metadata.regions();
        assert_eq!(regions % 64, 16);
        drop(metadata);
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        // Bit 287 of the first peer's bitmap: past region 271.
        file.write_all_at(&[0x80], BITMAP_OFFSET + 35).unwrap();
        drop(file);
        let mut metadata = Metadata::open(&path).unwrap();
        assert_eq!(metadata.out_of_sync_bytes(0), 0);
        assert_eq!(metadata.out_of_sync_bytes_for_any(), 0);
        // An unclean stop with a log record naming an extent far past the end (whose
        // offset overflows): only extent 0 is marked.
        metadata.set_clean(false).unwrap();
        drop(metadata);
        let record = encode_activity_log(1000, &[0, u64::MAX / 3]);
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        file.write_all_at(&record, AL_OFFSET + (1000 % AL_RING) * RECORD_SIZE)
            .unwrap();
        drop(file);
        let metadata = Metadata::open(&path).unwrap();
        assert_eq!(metadata.logged_extents(), &[0]);
        assert_eq!(metadata.out_of_sync_bytes(0), EXTENT_SIZE);
    }

    #[test]
    fn an_unclean_shutdown_marks_every_logged_extent_out_of_sync() {
        let dir = tempfile::tempdir().unwrap();
        let (path, mut metadata) = fresh(&dir);
        metadata.set_clean(false).unwrap();
        let first = Metadata::extents_of(0, 4096);
        let spanning = Metadata::extents_of(3 * EXTENT_SIZE - 512, 1024);
        metadata.activate(first.clone()).unwrap();
        metadata.activate(spanning.clone()).unwrap();
        metadata.release(first);
        assert_eq!(metadata.logged_extents(), &[0, 2, 3]);
        // Crash: no clean close.
        drop(metadata);
        let metadata = Metadata::open(&path).unwrap();
        assert_eq!(metadata.recovered_extents(), 3);
        assert_eq!(
            metadata.out_of_sync_bytes(0),
            3 * EXTENT_SIZE,
            "exactly the logged extents, not the whole device"
        );
        assert!(metadata.is_out_of_sync(0, 0));
        assert!(!metadata.is_out_of_sync(0, REGIONS_PER_EXTENT));
        assert!(metadata.is_out_of_sync(0, 2 * REGIONS_PER_EXTENT));
    }

    #[test]
    fn a_torn_activity_log_record_falls_back_to_the_previous_one() {
        let dir = tempfile::tempdir().unwrap();
        let (path, mut metadata) = fresh(&dir);
        metadata.set_clean(false).unwrap();
        metadata.activate(Metadata::extents_of(0, 1)).unwrap();
        let torn_seq = metadata.al_seq + 1;
        metadata
            .activate(Metadata::extents_of(5 * EXTENT_SIZE, 1))
            .unwrap();
        drop(metadata);
        // The second transaction was torn: the write to extent 5 was never submitted
        // (activate returns before it), so the previous record is the truth.
        let file = OpenOptions::new().write(true).open(&path).unwrap();
        let offset = AL_OFFSET + (torn_seq % AL_RING) * RECORD_SIZE;
        file.write_all_at(&[0xff; 8], offset + 24).unwrap();
        let metadata = Metadata::open(&path).unwrap();
        assert_eq!(metadata.logged_extents(), &[0]);
        assert_eq!(metadata.out_of_sync_bytes(0), EXTENT_SIZE);
    }

    #[test]
    fn evicted_extents_keep_their_bits_through_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let (path, mut metadata) = fresh(&dir);
        metadata.set_clean(false).unwrap();
        // A degraded write to extent 0: the bit is set only in memory.
        let first = Metadata::extents_of(0, 4096);
        metadata.activate(first.clone()).unwrap();
        metadata.mark_out_of_sync(0, 0, 4096);
        metadata.release(first);
        // Fill the log until extent 0 is evicted (after a flush made its write durable).
        for extent in 1..=AL_SLOTS as u64 {
            let range = Metadata::extents_of(extent * EXTENT_SIZE, 1);
            if extent == AL_SLOTS as u64 {
                assert!(matches!(
                    metadata.activate(range.clone()),
                    Err(MetaError::ActivityLogNeedsFlush)
                ));
                let flush = metadata.begin_flush();
                metadata.flush_done(flush);
            }
            metadata.activate(range.clone()).unwrap();
            metadata.release(range);
        }
        assert!(!metadata.logged_extents().contains(&0));
        drop(metadata);
        let metadata = Metadata::open(&path).unwrap();
        assert!(
            metadata.is_out_of_sync(0, 0),
            "the evicted extent's bit was made durable"
        );
        assert_eq!(metadata.recovered_extents(), AL_SLOTS);
    }

    #[test]
    fn a_secondary_makes_room_by_marking_evicted_extents_out_of_sync_durably() {
        let dir = tempfile::tempdir().unwrap();
        let (path, mut metadata) = fresh(&dir);
        // Every other extent, so that evicted ones are told apart from logged ones.
        for i in 0..AL_SLOTS as u64 {
            let extents = Metadata::extents_of(2 * i * EXTENT_SIZE, 1);
            metadata.activate(extents.clone()).unwrap();
            metadata.release(extents);
        }
        // Extent 10 is still being written: it must stay.
        metadata
            .activate(Metadata::extents_of(10 * EXTENT_SIZE, 1))
            .unwrap();
        let next = Metadata::extents_of(2 * AL_SLOTS as u64 * EXTENT_SIZE, 2 * EXTENT_SIZE);
        assert!(matches!(
            metadata.activate(next.clone()),
            Err(MetaError::ActivityLogNeedsFlush)
        ));
        metadata.make_room_marking_out_of_sync(&next).unwrap();
        metadata.activate(next).unwrap();
        // The two least recently used idle extents (0 and 2) left, marked for every peer.
        assert!(!metadata.logged_extents().contains(&0));
        assert!(!metadata.logged_extents().contains(&2));
        assert!(metadata.logged_extents().contains(&10));
        for peer in 0..metadata.peer_count() {
            assert_eq!(metadata.out_of_sync_bytes(peer), 2 * EXTENT_SIZE);
        }
        // A crash now: the evicted extents' bits were on disk before they left the log.
        drop(metadata);
        let reopened = Metadata::open(&path).unwrap();
        let region_of = |extent: u64| extent * EXTENT_SIZE / REGION_SIZE;
        for peer in 0..reopened.peer_count() {
            assert!(reopened.is_out_of_sync(peer, region_of(0)));
            assert!(reopened.is_out_of_sync(peer, region_of(2)));
            assert!(
                !reopened.is_out_of_sync(peer, region_of(1)),
                "never written"
            );
        }
    }

    #[test]
    fn a_log_full_of_busy_extents_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let (_path, mut metadata) = fresh(&dir);
        for extent in 0..AL_SLOTS as u64 {
            metadata
                .activate(Metadata::extents_of(extent * EXTENT_SIZE, 1))
                .unwrap();
        }
        let next = Metadata::extents_of(AL_SLOTS as u64 * EXTENT_SIZE, 1);
        assert!(matches!(
            metadata.activate(next.clone()),
            Err(MetaError::ActivityLogBusy)
        ));
        metadata.release(Metadata::extents_of(0, 1));
        // Extent 0 is idle, but its write may not be durable yet.
        assert!(matches!(
            metadata.activate(next.clone()),
            Err(MetaError::ActivityLogNeedsFlush)
        ));
        let flush = metadata.begin_flush();
        metadata.release(Metadata::extents_of(EXTENT_SIZE, 1));
        metadata.flush_done(flush);
        metadata.activate(next).unwrap();
        assert!(
            metadata.logged_extents().contains(&1),
            "a write that finished after the flush began keeps its extent logged"
        );
        assert!(!metadata.logged_extents().contains(&0));
        // Re-activating a logged extent needs no log write.
        let seq = metadata.al_seq;
        metadata
            .activate(Metadata::extents_of(EXTENT_SIZE, 1))
            .unwrap();
        assert_eq!(metadata.al_seq, seq);
    }

    #[test]
    fn each_peer_has_its_own_bitmap_and_a_crash_marks_all_of_them() {
        let dir = tempfile::tempdir().unwrap();
        let (path, mut metadata) = fresh(&dir);
        assert_eq!(metadata.peer_count(), 2);
        metadata.set_clean(false).unwrap();
        // Gamma is away for one write, beta for another.
        metadata.mark_out_of_sync(1, 0, 4096);
        metadata.mark_out_of_sync(0, 10 * EXTENT_SIZE, 4096);
        assert_eq!(metadata.out_of_sync_bytes(0), REGION_SIZE);
        assert_eq!(metadata.out_of_sync_bytes(1), REGION_SIZE);
        assert_eq!(metadata.out_of_sync_bytes_for_any(), 2 * REGION_SIZE);
        assert_eq!(
            metadata.out_of_sync_runs(),
            [(0, REGION_SIZE), (10 * EXTENT_SIZE, REGION_SIZE)]
        );
        // Resyncing beta clears only beta's bits.
        metadata.mark_in_sync(0, 10 * EXTENT_SIZE / REGION_SIZE);
        assert_eq!(metadata.out_of_sync_bytes(0), 0);
        assert_eq!(metadata.out_of_sync_bytes(1), REGION_SIZE);
        let hot = Metadata::extents_of(EXTENT_SIZE, 1);
        metadata.activate(hot).unwrap();
        metadata.flush_bitmap().unwrap();
        drop(metadata);
        // After a crash, the logged extent is missed by both peers; gamma's bit stayed.
        let metadata = Metadata::open(&path).unwrap();
        assert_eq!(metadata.out_of_sync_bytes(0), EXTENT_SIZE);
        assert_eq!(metadata.out_of_sync_bytes(1), EXTENT_SIZE + REGION_SIZE);
        drop(metadata);
        let e = Metadata::open_or_create(&path, "alpha", "r0", &["beta".into()], SIZE, true)
            .unwrap_err();
        assert!(e.to_string().contains("peers"), "{e}");
    }

    #[test]
    fn a_region_marked_again_after_a_resync_copied_it_stays_out_of_sync() {
        let dir = tempfile::tempdir().unwrap();
        let (_path, mut metadata) = fresh(&dir);
        let region = |r: u64| r * REGION_SIZE;
        for r in [3, 4] {
            metadata.mark_out_of_sync(0, region(r), REGION_SIZE);
        }
        // A pass copies both; then a write to region 4 fails here (or its link goes), so
        // beta may lack it again, and it is marked: the pass clears region 3 only.
        metadata.copying(0, region(3), 2 * REGION_SIZE);
        metadata.mark_out_of_sync(0, region(4), 4096);
        assert!(metadata.mark_copied_in_sync(0, 3));
        assert!(!metadata.mark_copied_in_sync(0, 4));
        assert!(!metadata.is_out_of_sync(0, 3));
        assert!(metadata.is_out_of_sync(0, 4));
        // The next pass copies it again, and nothing marks it meanwhile: cleared.
        metadata.copying(0, region(4), REGION_SIZE);
        assert!(metadata.mark_copied_in_sync(0, 4));
        assert_eq!(metadata.out_of_sync_bytes(0), 0);
        // Marks for another peer are that peer's alone.
        metadata.mark_out_of_sync(1, region(5), 1);
        metadata.copying(0, region(5), REGION_SIZE);
        assert!(metadata.mark_copied_in_sync(0, 5));
        assert!(metadata.is_out_of_sync(1, 5));
    }

    #[test]
    fn bitmap_counts_and_partial_last_region() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small.meta");
        let size = 3 * REGION_SIZE + 512;
        let mut metadata = Metadata::create(&path, "a", "r", &peers(), size, true).unwrap();
        assert_eq!(metadata.regions(), 4);
        metadata.mark_all_out_of_sync(0);
        assert_eq!(metadata.out_of_sync_bytes(0), size);
        metadata.mark_in_sync(0, 1);
        assert_eq!(metadata.next_out_of_sync(0, 1), Some(2));
        assert_eq!(metadata.out_of_sync_regions(0), 3);
        metadata.mark_out_of_sync(0, size, 100);
        assert_eq!(metadata.out_of_sync_regions(0), 3);
        assert_eq!(
            metadata.out_of_sync_runs(),
            [(0, REGION_SIZE), (2 * REGION_SIZE, REGION_SIZE + 512)]
        );
        assert_eq!(
            metadata.out_of_sync_bytes(1),
            0,
            "the other peer misses nothing"
        );
        metadata.mark_all_in_sync();
        assert_eq!(metadata.out_of_sync_runs(), []);
    }
}
