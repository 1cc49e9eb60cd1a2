//! A pool of reusable large I/O buffers, so the hot path does not allocate per request.
//!
//! Why: glibc serves allocations of about 1 MiB and more with `mmap` and returns them with
//! `munmap`, so every 1 MiB read paid 256 fresh page faults. Measured on the memory export,
//! 1 MiB sequential reads ran at 740–830 MB/s that way and at 1,700–2,500 MB/s once the
//! allocator was told not to unmap (nbdkit: 1,900–2,400 MB/s in the same session).
//!
//! Buffers come in power-of-two classes from [`SMALLEST_CLASS`] to [`MAX_POOLED`], and every
//! buffer starts on an [`ALIGN`] boundary, so `O_DIRECT` I/O can use it as it is. A buffer
//! handed out holds **old data**: whoever takes one must overwrite every byte it exposes.

use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;

/// Payloads at least this long are gathered straight into a pooled buffer by the pipeline
/// (shorter ones stay in its read buffer).
pub const MIN_POOLED: usize = 64 * 1024;
/// The smallest pooled class: one page, the common direct-I/O block.
pub const SMALLEST_CLASS: usize = 4096;
/// Every buffer's first byte is aligned to this (the largest direct-I/O memory alignment
/// Linux block devices ask for).
pub const ALIGN: usize = 4096;
/// The largest pooled class: the largest payload the server accepts.
pub const MAX_POOLED: usize = crate::wire::MAX_PAYLOAD as usize;
/// Bytes each class may keep idle...
const IDLE_BYTES_PER_CLASS: usize = 64 * 1024 * 1024;
/// ...or this many buffers, if that is more: as many as a client at iodepth 8 holds at once.
/// With two, 32 MiB reads at iodepth 8 freed six of every eight buffers and faulted fresh
/// ones in, a third of the server's CPU (`perf`: `exc_page_fault`, `clear_page_erms`,
/// `unmap_page_range`, the page allocator).
const IDLE_BUFFERS_PER_CLASS: usize = 8;

/// Whether a class holding `idle` buffers of `storage` bytes each keeps one more.
fn may_keep_another(idle: usize, storage: usize) -> bool {
    (idle + 1) * storage <= IDLE_BYTES_PER_CLASS.max(storage * IDLE_BUFFERS_PER_CLASS)
}

const CLASSES: usize = (MAX_POOLED / SMALLEST_CLASS).trailing_zeros() as usize + 1;

struct Pool {
    classes: [Mutex<Vec<Arc<Storage>>>; CLASSES],
}

/// The bytes of one buffer, allocated once and reused: the pool keeps them behind the
/// `Arc` that [`SharedBuffer`] shares, so neither taking nor sharing a buffer allocates.
struct Storage {
    bytes: Vec<u8>,
    /// Where the aligned bytes begin inside `bytes`.
    start: usize,
}

impl Storage {
    fn aligned(&self) -> &[u8] {
        &self.bytes[self.start..]
    }
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        classes: std::array::from_fn(|_| Mutex::new(Vec::new())),
    })
}

fn class_of(len: usize) -> Option<usize> {
    if len > MAX_POOLED {
        return None;
    }
    let rounded = len.max(SMALLEST_CLASS).next_power_of_two();
    Some((rounded / SMALLEST_CLASS).trailing_zeros() as usize)
}

/// Room for `capacity` bytes starting on an [`ALIGN`] boundary.
fn aligned_storage(capacity: usize) -> Arc<Storage> {
    let bytes = vec![0u8; capacity + ALIGN];
    let start = bytes.as_ptr().align_offset(ALIGN);
    Arc::new(Storage { bytes, start })
}

#[cfg(test)]
thread_local! {
    /// Buffers given back to the pool by this thread (tests run on threads of their own).
    static GIVEN_BACK_HERE: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Gives `storage` back to its class, unless the class keeps enough idle.
fn give_back(class: usize, storage: Arc<Storage>) {
    #[cfg(test)]
    GIVEN_BACK_HERE.with(|n| n.set(n.get() + 1));
    let mut idle = pool().classes[class]
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if may_keep_another(idle.len(), storage.bytes.len()) {
        idle.push(storage);
    }
}

/// A buffer of a requested length, returned to the pool when dropped.
pub struct Buffer {
    /// A view of the whole buffer that nothing else shares (so it can be written); its
    /// drop gives the buffer back.
    whole: SharedBuffer,
}

impl Buffer {
    /// A buffer of `len` bytes whose contents are unspecified (possibly an earlier
    /// request's data): the caller must overwrite all of it.
    pub fn take(len: usize) -> Buffer {
        let class = class_of(len);
        let storage = class
            .and_then(|c| {
                pool().classes[c]
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .pop()
            })
            .unwrap_or_else(|| aligned_storage(class.map_or(len, |c| SMALLEST_CLASS << c)));
        Buffer {
            whole: SharedBuffer {
                storage: Some(storage),
                start: 0,
                len,
                class,
            },
        }
    }

    /// A buffer of `len` zero bytes.
    pub fn zeroed(len: usize) -> Buffer {
        let mut buffer = Buffer::take(len);
        buffer.as_mut().fill(0);
        buffer
    }

    pub fn len(&self) -> usize {
        self.whole.len
    }

    pub fn is_empty(&self) -> bool {
        self.whole.len == 0
    }

    /// Shares the buffer as `Bytes`; it returns to the pool when the last clone is dropped.
    /// (`Bytes` boxes its owner: [`Buffer::share`] does not allocate.)
    pub fn into_bytes(self) -> Bytes {
        Bytes::from_owner(self.whole)
    }

    /// Shares the buffer read-only, without an allocation; it returns to the pool when
    /// the last [`SharedBuffer`] made from it is dropped.
    pub fn share(self) -> SharedBuffer {
        self.whole
    }
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        self.whole.as_ref()
    }
}

impl AsMut<[u8]> for Buffer {
    fn as_mut(&mut self) -> &mut [u8] {
        let len = self.whole.len;
        let storage = self
            .whole
            .storage
            .as_mut()
            .and_then(Arc::get_mut)
            .expect("a Buffer's storage is its own");
        let start = storage.start;
        &mut storage.bytes[start..start + len]
    }
}

/// Bytes of a pooled buffer shared read-only by several holders (the replies to reads
/// merged into one), like `Bytes` but with no allocation to share or slice it. The
/// buffer returns to the pool when the last holder is dropped.
pub struct SharedBuffer {
    /// `None` only inside `drop`.
    storage: Option<Arc<Storage>>,
    /// This view's bytes: `[start, start + len)` of the aligned storage.
    start: usize,
    len: usize,
    class: Option<usize>,
}

impl SharedBuffer {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes `[start, start + length)` of this view, sharing the buffer.
    pub fn slice(&self, start: usize, length: usize) -> SharedBuffer {
        assert!(
            start + length <= self.len,
            "{start}+{length} is outside a view of {} bytes",
            self.len
        );
        SharedBuffer {
            storage: self.storage.clone(),
            start: self.start + start,
            len: length,
            class: self.class,
        }
    }
}

impl Clone for SharedBuffer {
    fn clone(&self) -> SharedBuffer {
        self.slice(0, self.len)
    }
}

impl std::fmt::Debug for SharedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedBuffer({} bytes)", self.len)
    }
}

impl AsRef<[u8]> for SharedBuffer {
    fn as_ref(&self) -> &[u8] {
        let storage = self.storage.as_ref().expect("present until dropped");
        &storage.aligned()[self.start..self.start + self.len]
    }
}

impl std::ops::Deref for SharedBuffer {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.as_ref()
    }
}

impl Drop for SharedBuffer {
    fn drop(&mut self) {
        let (Some(class), Some(mut storage)) = (self.class, self.storage.take()) else {
            return;
        };
        // The last holder gives the buffer back. Two holders dropping at the same moment
        // may each see the other and neither give it back: then it is freed, which is
        // correct, only not reused.
        if Arc::get_mut(&mut storage).is_some() {
            give_back(class, storage);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_cover_the_pooled_range() {
        assert_eq!(class_of(1), Some(0));
        assert_eq!(class_of(SMALLEST_CLASS), Some(0));
        assert_eq!(class_of(SMALLEST_CLASS + 1), Some(1));
        assert_eq!(class_of(1 << 20), Some(8));
        assert_eq!(class_of(MAX_POOLED), Some(CLASSES - 1));
        assert_eq!(class_of(MAX_POOLED + 1), None);
    }

    #[test]
    fn a_class_keeps_64_mib_or_eight_buffers_whichever_is_more() {
        let small = 64 * 1024 + ALIGN;
        assert!(may_keep_another(IDLE_BYTES_PER_CLASS / small - 1, small));
        assert!(!may_keep_another(IDLE_BYTES_PER_CLASS / small, small));
        let largest = MAX_POOLED + ALIGN;
        assert!(
            may_keep_another(7, largest),
            "eight 32 MiB buffers for iodepth 8"
        );
        assert!(!may_keep_another(8, largest));
    }

    #[test]
    fn buffers_are_reused_and_keep_their_length() {
        let len = 3 * MIN_POOLED + 5;
        let mut first = Buffer::take(len);
        first.as_mut().fill(7);
        let address = first.as_ref().as_ptr();
        drop(first.into_bytes());
        let second = Buffer::take(len - 100);
        assert_eq!(second.len(), len - 100);
        // Same class, so (on this thread, with nothing else taking it) the same storage:
        // which is why callers must overwrite what they expose.
        if second.as_ref().as_ptr() == address {
            assert!(second.as_ref().iter().all(|&b| b == 7));
        }
        assert!(Buffer::zeroed(len).as_ref().iter().all(|&b| b == 0));
    }

    #[test]
    fn huge_buffers_bypass_the_pool_and_every_buffer_is_aligned() {
        assert_eq!(Buffer::take(10).len(), 10);
        assert_eq!(Buffer::take(MAX_POOLED + 1).len(), MAX_POOLED + 1);
        for len in [1, 512, 4096, 5000, 1 << 20, MAX_POOLED + 1] {
            let buffer = Buffer::take(len);
            assert_eq!(buffer.as_ref().as_ptr() as usize % ALIGN, 0, "len {len}");
            assert_eq!(
                buffer.into_bytes().as_ptr() as usize % ALIGN,
                0,
                "len {len}"
            );
        }
    }

    #[test]
    fn a_shared_buffer_slices_without_copying_and_returns_once_the_last_view_goes() {
        let len = (1 << 20) + 1;
        let mut buffer = Buffer::take(len);
        for (i, b) in buffer.as_mut().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let address = buffer.as_ref().as_ptr();
        let shared = buffer.share();
        assert_eq!(shared.len(), len);
        assert_eq!(shared.as_ptr(), address, "shared, not copied");
        let middle = shared.slice(1000, 5000);
        let inner = middle.slice(10, 20);
        assert_eq!(inner.as_ptr(), address.wrapping_add(1010));
        assert!(inner
            .iter()
            .enumerate()
            .all(|(i, &b)| b == ((i + 1010) % 251) as u8));
        let given_back = || GIVEN_BACK_HERE.with(|n| n.get());
        let before = given_back();
        drop(shared);
        drop(middle);
        assert_eq!(given_back(), before, "a view is still held");
        drop(inner);
        assert_eq!(
            given_back(),
            before + 1,
            "the last view gave the buffer back"
        );
        // Reused (unless a test on another thread took it first) and writable again.
        let mut again = Buffer::take(len);
        if again.as_ref().as_ptr() == address {
            assert!(again.as_ref()[..251]
                .iter()
                .enumerate()
                .all(|(i, &b)| b == i as u8));
        }
        again.as_mut().fill(1);
    }

    #[test]
    #[should_panic(expected = "outside a view")]
    fn a_slice_past_the_view_is_refused() {
        Buffer::take(100).share().slice(50, 51);
    }

    #[test]
    fn views_dropped_on_several_threads_at_once_leave_every_pooled_buffer_writable() {
        // A buffer is given back only by the holder that finds itself the last one, so a
        // buffer taken from the pool is never still shared: writing it would panic.
        let len = 3 * 4096;
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(move || {
                    for round in 0..5_000u32 {
                        let mut buffer = Buffer::take(len);
                        buffer.as_mut().fill(round as u8);
                        let shared = buffer.share();
                        let other = shared.slice(4096, 4096);
                        let handle = std::thread::spawn(move || drop(other));
                        drop(shared);
                        handle.join().unwrap();
                    }
                });
            }
        });
    }
}
