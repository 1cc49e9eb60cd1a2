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
//!
//! Once a direct-I/O ring asks for it ([`registered_arena`]), buffers of up to
//! [`ARENA_MAX_CLASS_BYTES`] are carved from one arena that lives as long as the process, so
//! the ring can register it with the kernel once and read and write it as a fixed buffer:
//! the kernel then skips pinning each request's pages (local fio, 4 KiB `O_DIRECT` random
//! reads at QD32 on this machine: 4.5–4.9 µs of CPU per read, 3.9–4.3 with `fixedbufs`).

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

/// Bytes of the registered arena: eight 4 MiB requests in flight and the 512 KiB pieces of
/// eight large reads, or thousands of small requests. The kernel pins all of it when a
/// ring registers it. (32 MiB with classes up to 1 MiB: 4 MiB `--cache=none` writes at
/// QD8 308–316 IOPS at 1,275–1,281 µs of server CPU each; 64 MiB with classes up to 4 MiB:
/// 422–435 at 888–1,061 µs, and 4 MiB reads 1,414–1,535 → 1,019–1,138 µs.)
const ARENA_BYTES: usize = 64 << 20;
/// The largest class carved from the arena; larger buffers are allocated on their own.
pub const ARENA_MAX_CLASS_BYTES: usize = 4 << 20;
/// Arena bytes one class may take, so that one request size cannot use up the arena (two
/// large classes, a large write's payloads and a large read's pieces, fit side by side).
const ARENA_BYTES_PER_CLASS: usize = ARENA_BYTES / 2;

struct Pool {
    classes: [Mutex<Vec<Arc<Storage>>>; CLASSES],
}

/// The bytes of one buffer, allocated once and reused: the pool keeps them behind the
/// `Arc` that [`SharedBuffer`] shares, so neither taking nor sharing a buffer allocates.
enum Storage {
    /// Allocated for this buffer alone; freed if its class keeps enough idle.
    Heap {
        bytes: Vec<u8>,
        /// Where the aligned bytes begin inside `bytes`.
        start: usize,
    },
    /// A piece of the registered arena, aligned; always kept by its class.
    Arena(&'static mut [u8]),
}

impl Storage {
    fn aligned(&self) -> &[u8] {
        match self {
            Storage::Heap { bytes, start } => &bytes[*start..],
            Storage::Arena(piece) => piece,
        }
    }

    fn aligned_mut(&mut self) -> &mut [u8] {
        match self {
            Storage::Heap { bytes, start } => &mut bytes[*start..],
            Storage::Arena(piece) => piece,
        }
    }

    /// Memory this buffer holds, alignment slack included.
    fn footprint(&self) -> usize {
        match self {
            Storage::Heap { bytes, .. } => bytes.len(),
            Storage::Arena(piece) => piece.len(),
        }
    }

    fn in_arena(&self) -> bool {
        matches!(self, Storage::Arena(_))
    }
}

impl Drop for Storage {
    /// A piece of the arena is never lost: two holders of a buffer that let go at the same
    /// moment may each see the other and neither give it back (see [`SharedBuffer`]'s
    /// drop), and then its piece goes back to its class from here.
    fn drop(&mut self) {
        if let Storage::Arena(piece) = self {
            let piece = std::mem::take(piece);
            if let Some(class) = class_of(piece.len()).filter(|_| !piece.is_empty()) {
                give_back(class, Arc::new(Storage::Arena(piece)));
            }
        }
    }
}

/// Where the registered arena lies, for a ring to register it with the kernel.
#[derive(Clone, Copy, Debug)]
pub struct ArenaRegion {
    /// Address of its first byte, aligned to [`ALIGN`].
    pub start: usize,
    pub len: usize,
}

struct Arena {
    region: ArenaRegion,
    carving: Mutex<Carving>,
}

/// What is left of the arena to carve buffers from, and what each class took.
struct Carving {
    rest: &'static mut [u8],
    taken: [usize; CLASSES],
}

static ARENA: OnceLock<Arena> = OnceLock::new();

/// The arena that pooled buffers of up to [`ARENA_MAX_CLASS_BYTES`] are carved from from
/// now on, set up on the first call. It is never freed, so a ring may keep it registered
/// for as long as the process runs; [`Buffer::in_arena`] tells which buffers lie in it.
pub fn registered_arena() -> ArenaRegion {
    ARENA
        .get_or_init(|| {
            // Leaked on purpose: the arena lives as long as the process.
            let whole: &'static mut [u8] = Vec::leak(vec![0u8; ARENA_BYTES + ALIGN]);
            let start = whole.as_ptr().align_offset(ALIGN);
            let aligned = &mut whole[start..start + ARENA_BYTES];
            Arena {
                region: ArenaRegion {
                    start: aligned.as_ptr() as usize,
                    len: ARENA_BYTES,
                },
                carving: Mutex::new(Carving {
                    rest: aligned,
                    taken: [0; CLASSES],
                }),
            }
        })
        .region
}

/// Whether the `len` bytes at `start` lie in the registered arena (so a ring may read or
/// write them as a fixed buffer): true for pooled buffers carved from it, and for `Bytes`
/// made from them.
pub fn in_arena(start: *const u8, len: usize) -> bool {
    ARENA.get().is_some_and(|arena| {
        let region = arena.region;
        let start = start as usize;
        start >= region.start && start.saturating_add(len) <= region.start + region.len
    })
}

/// A new buffer of class `class` carved from the arena, if there is one and the class has
/// not taken its share of it.
fn carve_from_arena(class: usize) -> Option<Arc<Storage>> {
    let bytes = SMALLEST_CLASS << class;
    if bytes > ARENA_MAX_CLASS_BYTES {
        return None;
    }
    let mut carving = ARENA
        .get()?
        .carving
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if carving.taken[class] + bytes > ARENA_BYTES_PER_CLASS || carving.rest.len() < bytes {
        return None;
    }
    carving.taken[class] += bytes;
    let (piece, rest) = std::mem::take(&mut carving.rest).split_at_mut(bytes);
    carving.rest = rest;
    Some(Arc::new(Storage::Arena(piece)))
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
    Arc::new(Storage::Heap { bytes, start })
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
    if storage.in_arena() || may_keep_another(idle.len(), storage.footprint()) {
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
            .or_else(|| class.and_then(carve_from_arena))
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

    /// Whether the buffer lies in the registered arena ([`registered_arena`]).
    pub fn in_arena(&self) -> bool {
        self.whole.in_arena()
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
        &mut storage.aligned_mut()[..len]
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

    /// Whether the buffer lies in the registered arena ([`registered_arena`]): what a ring
    /// asks before it names the arena's registered index for these bytes.
    pub fn in_arena(&self) -> bool {
        in_arena(self.as_ptr(), self.len)
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

/// The shared bytes as `Bytes`, for what takes only `Bytes`: this boxes the buffer as the
/// owner (one allocation), where sharing a [`SharedBuffer`] allocates nothing.
impl From<SharedBuffer> for Bytes {
    fn from(shared: SharedBuffer) -> Bytes {
        Bytes::from_owner(shared)
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

/// A buffer of `len` bytes from the registered arena, for tests: the pool may first hand
/// out buffers allocated before the arena existed, and those are held until one comes.
#[cfg(test)]
pub(crate) fn arena_buffer(len: usize) -> Buffer {
    registered_arena();
    let mut held = Vec::new();
    loop {
        let buffer = Buffer::take(len);
        if buffer.in_arena() {
            return buffer;
        }
        assert!(held.len() < 10_000, "no buffer of {len} bytes in the arena");
        held.push(buffer);
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
        drop(first.share());
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
                Bytes::from(buffer.share()).as_ptr() as usize % ALIGN,
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
    fn arena_pieces_are_aligned_disjoint_inside_the_region_within_their_share_and_never_lost() {
        let region = registered_arena();
        assert_eq!(region.start % ALIGN, 0);
        assert_eq!(registered_arena().start, region.start, "one arena");
        // 512 KiB: a class no other test takes, but carving straight from the arena (not
        // through the pool's idle lists) keeps this test right even if one did.
        let len = 512 * 1024;
        let class = class_of(len).unwrap();
        let share = ARENA_BYTES_PER_CLASS / len;
        let mut pieces = Vec::new();
        while let Some(storage) = carve_from_arena(class) {
            pieces.push(storage);
            assert!(pieces.len() <= share, "carved past the class's share");
        }
        let carving = ARENA.get().unwrap().carving.lock().unwrap();
        assert!(carving.taken[class] == share * len || carving.rest.len() < len);
        drop(carving);
        let mut spans: Vec<(usize, usize)> = pieces
            .iter()
            .map(|storage| {
                assert!(storage.in_arena());
                let piece = storage.aligned();
                (piece.as_ptr() as usize, piece.len())
            })
            .collect();
        spans.sort_unstable();
        for &(start, length) in &spans {
            assert_eq!(length, len);
            assert_eq!(start % ALIGN, 0);
            assert!(in_arena(start as *const u8, length));
        }
        for pair in spans.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "pieces overlap");
        }
        assert!(!in_arena((region.start + region.len - 1) as *const u8, 2));
        assert!(!in_arena(std::ptr::null(), 1));
        // Dropped as a storage (as when its last two holders let go at once, so neither
        // gave it back), every piece still goes back to its class.
        let before = GIVEN_BACK_HERE.with(|n| n.get());
        let count = pieces.len();
        drop(pieces);
        assert_eq!(GIVEN_BACK_HERE.with(|n| n.get()), before + count);
    }

    #[test]
    fn buffers_taken_once_the_arena_exists_come_from_it_and_heap_ones_do_not_claim_to() {
        registered_arena();
        let heap = Buffer {
            whole: SharedBuffer {
                storage: Some(aligned_storage(4096)),
                start: 0,
                len: 4096,
                class: None,
            },
        };
        assert!(!heap.in_arena());
        assert!(!heap.share().in_arena());
        let bytes = Bytes::from(arena_buffer(3 * 4096).share());
        assert!(
            in_arena(bytes.as_ptr(), bytes.len()),
            "Bytes made from it too"
        );
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
