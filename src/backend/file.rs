//! A backend over a regular file or a block device with positional I/O on tokio's
//! blocking pool. TRIM punches holes, WRITE_ZEROES uses `fallocate`, block status comes
//! from `SEEK_DATA`/`SEEK_HOLE`, FUA writes use `RWF_DSYNC`, and FLUSH syncs only when a
//! write completed since the last sync.

use std::fs::{File, OpenOptions};
use std::io::{IoSlice, Seek, SeekFrom};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context};
use bytes::Bytes;
use rustix::fs::FallocateFlags;

use super::{Backend, BackendError, BackendFuture, Capabilities, Extent, ReadData, ZeroFlags};
use crate::buffer::Buffer;
use crate::wire::NbdError;

/// Writes up to this long (and reads shorter than [`HOLE_QUERY_MIN`]) first try the page
/// cache without blocking (`RWF_NOWAIT`) on the calling worker; only when the kernel says it
/// would block do they go to the blocking pool. Each trip through the pool costs two thread wake-ups, which on this class of
/// machine was half the server's CPU per 4 KiB request.
const NOWAIT_MAX: usize = 256 * 1024;
/// Reads at least this long ask the file system where its holes are first.
const HOLE_QUERY_MIN: usize = 64 * 1024;
/// Chunk used when zeroes must be written out by hand.
const ZERO_CHUNK: u64 = 1024 * 1024;

/// A file or block device export.
pub struct FileBackend {
    path: PathBuf,
    file: Arc<File>,
    size: u64,
    read_only: bool,
    block_device: bool,
    dirty: Arc<DirtyTracker>,
    /// Cleared when the file system turns down non-blocking buffered writes.
    nowait_writes: std::sync::atomic::AtomicBool,
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

    /// Runs `sync` unless every write completed so far is already covered.
    fn flush(&self, sync: impl FnOnce() -> std::io::Result<()>) -> std::io::Result<bool> {
        let target = self.written.load(Ordering::Acquire);
        if self.synced.load(Ordering::Acquire) >= target {
            return Ok(false);
        }
        sync()?;
        self.synced.fetch_max(target, Ordering::AcqRel);
        Ok(true)
    }
}

impl FileBackend {
    /// Opens `path`. With `size`, a missing file is created sparse at that size and an
    /// existing one must already have it; an existing file is never truncated.
    pub fn open(path: &Path, size: Option<u64>, read_only: bool) -> anyhow::Result<FileBackend> {
        let exists = path.exists();
        if !exists {
            let Some(size) = size else {
                bail!(
                    "{} does not exist (give --size to create it)",
                    path.display()
                );
            };
            if read_only {
                bail!(
                    "{} does not exist, and a read-only export cannot create it",
                    path.display()
                );
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                .open(path)
                .with_context(|| format!("creating {}", path.display()))?;
            file.set_len(size)
                .with_context(|| format!("sizing {} to {size} bytes", path.display()))?;
        }
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
                    "{} is {actual} bytes but --size asks for {size}; netblk never resizes existing storage",
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
        Ok(FileBackend {
            path: path.to_path_buf(),
            file: Arc::new(file),
            size: actual,
            read_only,
            block_device,
            dirty: Arc::new(DirtyTracker::default()),
            nowait_writes: std::sync::atomic::AtomicBool::new(true),
        })
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

fn errno(e: rustix::io::Errno) -> std::io::Error {
    std::io::Error::from_raw_os_error(e.raw_os_error())
}

/// Most runs one allocation query returns; a badly fragmented file is reported in parts
/// (block status may cover less than was asked, and clients ask again from there).
const MAX_RUNS: usize = 1 << 16;

/// Where data and holes lie from `offset`, as (length, is_hole) runs covering at most
/// `length` bytes and at least one byte (fewer than `length` past [`MAX_RUNS`] runs).
fn allocation_runs(file: &File, offset: u64, length: u64) -> std::io::Result<Vec<(u64, bool)>> {
    let end = offset + length;
    let mut runs: Vec<(u64, bool)> = Vec::new();
    let mut at = offset;
    while at < end && runs.len() < MAX_RUNS {
        let data_start = match rustix::fs::seek(file, rustix::fs::SeekFrom::Data(at as i64)) {
            Ok(pos) => pos.min(end),
            Err(rustix::io::Errno::NXIO) => end, // no data after `at`
            Err(e) => return Err(errno(e)),
        };
        if data_start > at {
            runs.push((data_start - at, true));
            at = data_start;
            continue;
        }
        let hole_start = match rustix::fs::seek(file, rustix::fs::SeekFrom::Hole(at as i64)) {
            Ok(pos) => pos.min(end),
            Err(rustix::io::Errno::NXIO) => end,
            Err(e) => return Err(errno(e)),
        };
        let hole_start = hole_start.max(at + 1).min(end);
        runs.push((hole_start - at, false));
        at = hole_start;
    }
    Ok(runs)
}

/// Reads from the page cache if that needs no waiting; `None` if it would block, came up
/// short, or the kernel does not support `RWF_NOWAIT` here.
fn read_without_blocking(file: &File, offset: u64, length: usize) -> Option<Vec<u8>> {
    let mut data = vec![0u8; length];
    let mut slices = [std::io::IoSliceMut::new(&mut data)];
    match rustix::io::preadv2(
        file,
        &mut slices,
        offset,
        rustix::io::ReadWriteFlags::NOWAIT,
    ) {
        Ok(n) if n == length => Some(data),
        _ => None,
    }
}

/// What a non-blocking write attempt did.
#[derive(Debug, PartialEq, Eq)]
enum NoWait {
    Done,
    WouldBlock,
    Unsupported,
}

/// Writes into the page cache if that needs no waiting. A partial write is finished with
/// blocking calls (still correct, just slower); nothing written means try the pool.
fn write_without_blocking(file: &File, offset: u64, data: &[u8]) -> NoWait {
    let slices = [IoSlice::new(data)];
    match rustix::io::pwritev2(file, &slices, offset, rustix::io::ReadWriteFlags::NOWAIT) {
        Ok(n) if n == data.len() => NoWait::Done,
        Ok(n) if n > 0 && file.write_all_at(&data[n..], offset + n as u64).is_ok() => NoWait::Done,
        Err(rustix::io::Errno::OPNOTSUPP) => NoWait::Unsupported,
        _ => NoWait::WouldBlock,
    }
}

fn write_zeroes_by_hand(file: &File, offset: u64, length: u64) -> std::io::Result<()> {
    let zeroes = vec![0u8; ZERO_CHUNK.min(length) as usize];
    let mut done = 0;
    while done < length {
        let n = (length - done).min(ZERO_CHUNK) as usize;
        file.write_all_at(&zeroes[..n], offset + done)?;
        done += n as u64;
    }
    Ok(())
}

fn write_durably(file: &File, offset: u64, data: &[u8]) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < data.len() {
        let slice = [IoSlice::new(&data[done..])];
        match rustix::io::pwritev2(
            file,
            &slice,
            offset + done as u64,
            rustix::io::ReadWriteFlags::DSYNC,
        ) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(errno(e)),
        }
    }
    Ok(())
}

impl Backend for FileBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: self.read_only,
            flush: true,
            fua: true,
            trim: true,
            write_zeroes: true,
            fast_zero: true,
            cache: true,
            multi_conn: true,
            rotational: false,
        }
    }

    fn read(&self, offset: u64, length: usize) -> BackendFuture<'_, ReadData> {
        if length < HOLE_QUERY_MIN {
            if let Some(data) = read_without_blocking(&self.file, offset, length) {
                return Box::pin(std::future::ready(Ok(ReadData::dense(Bytes::from(data)))));
            }
        }
        Box::pin(self.blocking("read", offset, length as u64, move |file| {
            let dense = vec![(length as u64, false)];
            let runs = if length >= HOLE_QUERY_MIN {
                match allocation_runs(file, offset, length as u64) {
                    Ok(runs) if runs.iter().map(|r| r.0).sum::<u64>() == length as u64 => runs,
                    _ => dense,
                }
            } else {
                dense
            };
            // A pooled buffer holds old data: every byte below is either read or zeroed.
            let mut buffer = Buffer::take(length);
            let data = buffer.as_mut();
            let mut at = 0usize;
            for &(len, hole) in &runs {
                let len = len as usize;
                if hole {
                    data[at..at + len].fill(0);
                } else {
                    file.read_exact_at(&mut data[at..at + len], offset + at as u64)?;
                }
                at += len;
            }
            let runs = runs
                .into_iter()
                .map(|(len, hole)| (len as usize, hole))
                .collect();
            Ok(ReadData {
                data: buffer.into_bytes(),
                runs,
            })
        }))
    }

    fn write(&self, offset: u64, data: Bytes, fua: bool) -> BackendFuture<'_, ()> {
        if !fua && data.len() <= NOWAIT_MAX && self.nowait_writes.load(Ordering::Relaxed) {
            match write_without_blocking(&self.file, offset, &data) {
                NoWait::Done => {
                    self.dirty.mark();
                    return Box::pin(std::future::ready(Ok(())));
                }
                // ext4 (at least up to 6.18) has no non-blocking buffered writes: stop asking.
                NoWait::Unsupported => self.nowait_writes.store(false, Ordering::Relaxed),
                NoWait::WouldBlock => {}
            }
        }
        let dirty = Arc::clone(&self.dirty);
        let length = data.len() as u64;
        Box::pin(self.blocking("write", offset, length, move |file| {
            if fua {
                write_durably(file, offset, &data)
            } else {
                file.write_all_at(&data, offset)?;
                dirty.mark();
                Ok(())
            }
        }))
    }

    fn flush(&self) -> BackendFuture<'_, ()> {
        let dirty = Arc::clone(&self.dirty);
        Box::pin(self.blocking("flush", 0, 0, move |file| {
            dirty
                .flush(|| rustix::fs::fdatasync(file).map_err(errno))
                .map(|_| ())
        }))
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> BackendFuture<'_, ()> {
        let dirty = Arc::clone(&self.dirty);
        Box::pin(self.blocking("trim", offset, length, move |file| {
            let flags = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
            match rustix::fs::fallocate(file, flags, offset, length) {
                Ok(()) => {}
                // TRIM is advisory: a store that cannot discard keeps the data.
                Err(rustix::io::Errno::OPNOTSUPP) => return Ok(()),
                Err(e) => return Err(errno(e)),
            }
            if fua {
                rustix::fs::fdatasync(file).map_err(errno)
            } else {
                dirty.mark();
                Ok(())
            }
        }))
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BackendFuture<'_, ()> {
        let dirty = Arc::clone(&self.dirty);
        let block_device = self.block_device;
        Box::pin(async move {
            let result = self
                .blocking("write zeroes", offset, length, move |file| {
                    let mode = if flags.may_trim {
                        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE
                    } else {
                        FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE
                    };
                    let mode = if block_device {
                        FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE
                    } else {
                        mode
                    };
                    match rustix::fs::fallocate(file, mode, offset, length) {
                        Ok(()) => {}
                        Err(rustix::io::Errno::OPNOTSUPP) if flags.fast => {
                            return Ok(false);
                        }
                        Err(rustix::io::Errno::OPNOTSUPP) => {
                            write_zeroes_by_hand(file, offset, length)?
                        }
                        Err(e) => return Err(errno(e)),
                    }
                    if flags.fua {
                        rustix::fs::fdatasync(file).map_err(errno)?;
                    } else {
                        dirty.mark();
                    }
                    Ok(true)
                })
                .await?;
            if result {
                Ok(())
            } else {
                Err(BackendError::plain(
                    "write zeroes",
                    offset,
                    length,
                    NbdError::NotSup,
                ))
            }
        })
    }

    fn cache(&self, offset: u64, length: u64) -> BackendFuture<'_, ()> {
        Box::pin(self.blocking("cache", offset, length, move |file| {
            rustix::fs::fadvise(file, offset, length, rustix::fs::Advice::WillNeed).map_err(errno)
        }))
    }

    fn extents(&self, offset: u64, length: u64) -> BackendFuture<'_, Vec<Extent>> {
        let block_device = self.block_device;
        Box::pin(self.blocking("block status", offset, length, move |file| {
            if block_device {
                return Ok(vec![Extent {
                    length,
                    hole: false,
                    zero: false,
                }]);
            }
            let runs = allocation_runs(file, offset, length)?;
            Ok(runs
                .into_iter()
                .map(|(length, hole)| Extent {
                    length,
                    hole,
                    zero: hole,
                })
                .collect())
        }))
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

    fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn a_missing_file_is_created_sparse_and_an_existing_one_is_never_resized() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        assert!(FileBackend::open(&path, None, false).is_err());
        let b = FileBackend::open(&path, Some(1 << 20), false).unwrap();
        assert_eq!(b.size(), 1 << 20);
        let err = FileBackend::open(&path, Some(2 << 20), false).unwrap_err();
        assert!(err.to_string().contains("never resizes"), "{err}");
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
    }

    #[test]
    fn writes_trims_and_zeroes_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        let b = FileBackend::open(&path, Some(4 << 20), false).unwrap();
        block_on(b.write(4096, Bytes::from(vec![9u8; 1 << 20]), false)).unwrap();
        block_on(b.write(0, Bytes::from(vec![1u8; 512]), true)).unwrap();
        let r = block_on(b.read(0, 2 << 20)).unwrap();
        assert!(r.data[..512].iter().all(|&x| x == 1));
        assert!(r.data[4096..4096 + (1 << 20)].iter().all(|&x| x == 9));
        assert_eq!(r.runs.iter().map(|r| r.0).sum::<usize>(), 2 << 20);
        block_on(b.trim(1 << 20, 1 << 20, false)).unwrap();
        block_on(b.write_zeroes(
            4096,
            4096,
            ZeroFlags {
                may_trim: false,
                fast: false,
                fua: true,
            },
        ))
        .unwrap();
        let r = block_on(b.read(0, 2 << 20)).unwrap();
        assert!(r.data[4096..8192].iter().all(|&x| x == 0));
        assert!(r.data[8192..1 << 20].iter().all(|&x| x == 9));
        assert!(r.data[1 << 20..].iter().all(|&x| x == 0));
        let extents = block_on(b.extents(0, 4 << 20)).unwrap();
        assert_eq!(extents.iter().map(|e| e.length).sum::<u64>(), 4 << 20);
        assert!(extents.last().unwrap().hole);
        block_on(b.flush()).unwrap();
    }

    #[test]
    fn cached_reads_and_writes_take_the_non_blocking_path_and_agree_with_the_blocking_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        let b = FileBackend::open(&path, Some(1 << 20), false).unwrap();
        // Whether the file system takes non-blocking writes varies (ext4 does not); a cached
        // page is always readable without blocking.
        b.file.write_all_at(&[6u8; 4096], 8192).unwrap();
        assert_ne!(
            write_without_blocking(&b.file, 8192, &[6u8; 4096]),
            NoWait::WouldBlock
        );
        let fast = read_without_blocking(&b.file, 8192, 4096)
            .expect("a cached page reads without blocking");
        assert_eq!(fast, vec![6u8; 4096]);
        // Through the trait: small requests (fast path) and large ones (blocking pool) agree.
        block_on(b.write(0, Bytes::from(vec![1u8; 4096]), false)).unwrap();
        block_on(b.write(65536, Bytes::from(vec![2u8; 512 * 1024]), false)).unwrap();
        assert_eq!(
            &block_on(b.read(0, 4096)).unwrap().data[..],
            &[1u8; 4096][..]
        );
        let big = block_on(b.read(0, 1 << 20)).unwrap();
        assert!(big.data[65536..65536 + 512 * 1024].iter().all(|&x| x == 2));
        assert!(big.data[8192..12288].iter().all(|&x| x == 6));
        // A write on the fast path still counts as dirty for FLUSH.
        let before = b.dirty.written.load(Ordering::Acquire);
        block_on(b.write(4096, Bytes::from(vec![3u8; 4096]), false)).unwrap();
        assert!(b.dirty.written.load(Ordering::Acquire) > before);
    }

    #[test]
    fn flush_syncs_only_when_something_was_written() {
        let tracker = DirtyTracker::default();
        let mut syncs = 0;
        assert!(!tracker
            .flush(|| {
                syncs += 1;
                Ok(())
            })
            .unwrap());
        tracker.mark();
        assert!(tracker
            .flush(|| {
                syncs += 1;
                Ok(())
            })
            .unwrap());
        assert!(!tracker
            .flush(|| {
                syncs += 1;
                Ok(())
            })
            .unwrap());
        assert_eq!(syncs, 1);
    }
}
