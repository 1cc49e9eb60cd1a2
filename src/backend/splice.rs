//! Zero-copy reads from the page cache: the pages of a cached file range are spliced into a
//! kernel pipe by reference, and from the pipe into the client's socket, so the server never
//! copies the data (a copied read costs two copies: page cache → buffer → socket).
//!
//! Measured reason: a 1 MiB sequential read through the page cache spent about half of the
//! server's CPU in those two copies (`_copy_to_iter` reading the file, `_copy_from_iter`
//! writing the socket), and with one connection the server was the bottleneck.
//!
//! Only ranges that are wholly in the page cache are spliced: a splice from a file reads
//! uncached pages synchronously, even with `SPLICE_F_NONBLOCK`, which would stall the
//! worker thread. `cachestat(2)` (Linux 6.5) says whether a range is cached; without it,
//! nothing is spliced. The data enters the pipe before the reply header is sent, so a read
//! error is still reported as an NBD error, never as a broken reply.
//!
//! Pipes are pooled: one is taken per spliced read, and goes back to the pool once the
//! socket has taken all of it. At most [`MAX_PIPES`] exist at once (each costs two file
//! descriptors); past that, reads are copied as before.

#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use rustix::pipe::{PipeFlags, SpliceFlags};

/// Pipes in existence at once, pooled or in use.
pub const MAX_PIPES: usize = 256;
/// Capacity asked of each pipe: a streamed read piece (512 KiB) not aligned to pages needs
/// one more page than its length, and 1 MiB is the largest size an unprivileged process
/// may ask for by default (`fs.pipe-max-size`).
const PIPE_SIZE: usize = 1 << 20;
/// The longest range one spliced read may hold.
pub const MAX_SPLICE: usize = PIPE_SIZE / 2;
/// Reads at least this long, in writeback mode, are sent from the page cache by splicing
/// when the range is cached instead of being copied twice (shorter ones are copied: the
/// two extra system calls cost more than the copy).
pub const SPLICE_MIN: usize = 64 * 1024;

static POOL: Mutex<Vec<Pipe>> = Mutex::new(Vec::new());
static PIPES: AtomicUsize = AtomicUsize::new(0);

/// An empty pipe, counted in [`PIPES`] while it exists.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl Pipe {
    /// A pipe from the pool, or a new one while fewer than [`MAX_PIPES`] exist.
    fn take() -> Option<Pipe> {
        if let Some(pipe) = POOL.lock().unwrap_or_else(|e| e.into_inner()).pop() {
            return Some(pipe);
        }
        PIPES
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_PIPES).then_some(n + 1)
            })
            .ok()?;
        let made = rustix::pipe::pipe_with(PipeFlags::CLOEXEC | PipeFlags::NONBLOCK).and_then(
            |(read, write)| {
                rustix::pipe::fcntl_setpipe_size(&write, PIPE_SIZE)?;
                Ok(Pipe { read, write })
            },
        );
        match made {
            Ok(pipe) => Some(pipe),
            Err(e) => {
                PIPES.fetch_sub(1, Ordering::AcqRel);
                tracing::debug!("no pipe for a spliced read: {e}");
                None
            }
        }
    }

    /// Back to the pool (only an empty pipe may go back).
    fn give_back(self) {
        POOL.lock().unwrap_or_else(|e| e.into_inner()).push(self);
    }
}

impl Drop for Pipe {
    fn drop(&mut self) {
        PIPES.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Bytes of a file held in a pipe by reference, waiting to be spliced into a socket.
pub struct Spliced {
    pipe: Option<Pipe>,
    len: usize,
    left: usize,
}

impl Spliced {
    /// How many bytes the pipe held at first.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: an empty read is never spliced.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many bytes are still in the pipe.
    pub fn left(&self) -> usize {
        self.left
    }

    /// The pipe's read end, to splice from.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.pipe
            .as_ref()
            .expect("a pipe until dropped")
            .read
            .as_fd()
    }

    /// Records that `n` bytes left the pipe.
    pub fn consumed(&mut self, n: usize) {
        self.left -= n.min(self.left);
    }

    /// Reads what is left in the pipe into memory: for a socket that cannot take a splice.
    pub fn drain(mut self) -> io::Result<bytes::Bytes> {
        let mut out = vec![0u8; self.left];
        let mut filled = 0;
        while filled < out.len() {
            match rustix::io::read(self.fd(), &mut out[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        out.truncate(filled);
        self.consumed(filled);
        Ok(out.into())
    }
}

impl Drop for Spliced {
    fn drop(&mut self) {
        if let Some(pipe) = self.pipe.take() {
            if self.left == 0 {
                pipe.give_back();
            }
            // A pipe with data in it (a connection that ended mid-reply) is closed.
        }
    }
}

/// Splices `length` bytes of `file` at `offset` into a pipe, if every page of the range is
/// in the page cache now; `None` when it is not (or cannot be told), when no pipe is free,
/// or when the splice fails or comes up short, and the caller reads by copying instead
/// (which also reports any error properly).
pub fn splice_cached(file: &File, offset: u64, length: usize) -> Option<Spliced> {
    if length == 0 || length > MAX_SPLICE || !cached(file, offset, length as u64)? {
        return None;
    }
    let pipe = Pipe::take()?;
    let mut at = offset;
    let mut left = length;
    while left > 0 {
        match rustix::pipe::splice(
            file,
            Some(&mut at),
            &pipe.write,
            None,
            left,
            SpliceFlags::NONBLOCK,
        ) {
            Ok(0) => return None, // end of file: the pipe is closed with its partial data
            Ok(n) => left -= n,
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return None,
        }
    }
    Some(Spliced {
        pipe: Some(pipe),
        len: length,
        left: length,
    })
}

/// The `cachestat(2)` system call number, where it is known.
#[cfg(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "riscv64"
))]
const SYS_CACHESTAT: Option<libc::c_long> = Some(451);
#[cfg(not(any(
    target_arch = "x86_64",
    target_arch = "aarch64",
    target_arch = "riscv64"
)))]
const SYS_CACHESTAT: Option<libc::c_long> = None;

/// `struct cachestat_range` of `<linux/mman.h>`.
#[repr(C)]
struct CachestatRange {
    off: u64,
    len: u64,
}

/// `struct cachestat` of `<linux/mman.h>`: the page-cache state of a file range, in pages.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Cachestat {
    pub nr_cache: u64,
    pub nr_dirty: u64,
    pub nr_writeback: u64,
    pub nr_evicted: u64,
    pub nr_recently_evicted: u64,
}

/// Whether every page of `[offset, offset + length)` is in the page cache; `None` when the
/// kernel cannot say (no `cachestat`, before Linux 6.5).
pub fn cached(file: &File, offset: u64, length: u64) -> Option<bool> {
    let page = rustix::param::page_size() as u64;
    let pages = (offset + length).div_ceil(page) - offset / page;
    Some(cachestat(file, offset, length)?.nr_cache >= pages)
}

/// The page-cache state of `[offset, offset + length)` (`length` 0: to the end of the file)
/// from `cachestat(2)`; `None` when the kernel has no such call.
pub fn cachestat(file: &File, offset: u64, length: u64) -> Option<Cachestat> {
    static UNSUPPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if UNSUPPORTED.load(Ordering::Relaxed) {
        return None;
    }
    let number = SYS_CACHESTAT?;
    let range = CachestatRange {
        off: offset,
        len: length,
    };
    let mut stat = Cachestat::default();
    // SAFETY: cachestat(fd, range, cstat, flags) reads one `struct cachestat_range` and
    // writes one `struct cachestat`; both pointers are to live, properly aligned `repr(C)`
    // values of exactly those layouts (two and five u64 fields), and the file descriptor is
    // open for as long as `file` is borrowed.
    let result = unsafe {
        libc::syscall(
            number,
            file.as_raw_fd(),
            &range as *const CachestatRange,
            &mut stat as *mut Cachestat,
            0u32,
        )
    };
    if result != 0 {
        if io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
            UNSUPPORTED.store(true, Ordering::Relaxed);
        }
        return None;
    }
    Some(stat)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    /// The pool and the pipe count are process-wide: these tests take turns.
    static SERIAL: Mutex<()> = Mutex::new(());

    /// A file of `len` patterned bytes, written through the page cache (so cached).
    fn patterned(len: usize) -> (tempfile::NamedTempFile, Vec<u8>) {
        let mut tmp = tempfile::NamedTempFile::new().unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        tmp.write_all(&data).unwrap();
        tmp.flush().unwrap();
        (tmp, data)
    }

    fn read_out(mut spliced: Spliced) -> Vec<u8> {
        let mut out = vec![0u8; spliced.left()];
        let mut filled = 0;
        while filled < out.len() {
            let n = rustix::io::read(spliced.fd(), &mut out[filled..]).unwrap();
            filled += n;
        }
        spliced.consumed(filled);
        out
    }

    #[test]
    fn a_cached_range_arrives_in_the_pipe_whole_and_the_pipe_is_reused() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (tmp, data) = patterned(3 << 20);
        let file = File::open(tmp.path()).unwrap();
        if cached(&file, 0, 4096).is_none() {
            eprintln!("no cachestat on this kernel: nothing is spliced");
            assert!(splice_cached(&file, 0, 65536).is_none());
            return;
        }
        let spliced = splice_cached(&file, 12_345, MAX_SPLICE).expect("a cached range splices");
        assert_eq!(spliced.len(), MAX_SPLICE);
        assert_eq!(read_out(spliced), data[12_345..12_345 + MAX_SPLICE]);
        // The emptied pipe went back to the pool, and the next read takes it again.
        let pooled = POOL.lock().unwrap().len();
        assert!(pooled >= 1);
        let again = splice_cached(&file, 1 << 20, 65536).unwrap();
        assert_eq!(read_out(again), data[1 << 20..(1 << 20) + 65536]);
    }

    #[test]
    fn a_range_not_in_the_page_cache_is_not_spliced() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (tmp, _) = patterned(2 << 20);
        let file = File::open(tmp.path()).unwrap();
        if cached(&file, 0, 4096).is_none() {
            return;
        }
        // Written back and dropped from the cache: the splice would have to read the disk.
        file.sync_all().unwrap();
        rustix::fs::fadvise(&file, 0, 0, rustix::fs::Advice::DontNeed).unwrap();
        if cached(&file, 0, 2 << 20) == Some(true) {
            eprintln!("this file system kept the pages: nothing to check");
            return;
        }
        assert!(splice_cached(&file, 0, 256 << 10).is_none());
        // Read back in, the same range splices.
        let mut buf = vec![0u8; 256 << 10];
        file.read_exact_at(&mut buf, 0).unwrap();
        assert!(splice_cached(&file, 0, 256 << 10).is_some());
    }

    #[test]
    fn a_pipe_dropped_with_data_in_it_is_closed_not_pooled_and_drain_copies_the_rest() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (tmp, data) = patterned(1 << 20);
        let file = File::open(tmp.path()).unwrap();
        let Some(spliced) = splice_cached(&file, 0, 128 << 10) else {
            return;
        };
        let before = PIPES.load(Ordering::Acquire);
        drop(spliced);
        assert_eq!(PIPES.load(Ordering::Acquire), before - 1, "closed");
        let mut spliced = splice_cached(&file, 4096, 128 << 10).unwrap();
        let mut head = [0u8; 100];
        assert_eq!(rustix::io::read(spliced.fd(), &mut head).unwrap(), 100);
        spliced.consumed(100);
        let rest = spliced.drain().unwrap();
        assert_eq!(&head[..], &data[4096..4196]);
        assert_eq!(&rest[..], &data[4196..4096 + (128 << 10)]);
    }

    #[test]
    fn ranges_past_the_end_or_too_long_are_refused() {
        let _turn = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let (tmp, _) = patterned(1 << 20);
        let file = File::open(tmp.path()).unwrap();
        assert!(
            splice_cached(&file, (1 << 20) - 4096, 65536).is_none(),
            "short"
        );
        assert!(
            splice_cached(&file, 0, MAX_SPLICE + 1).is_none(),
            "too long"
        );
        assert!(splice_cached(&file, 0, 0).is_none(), "empty");
    }
}
