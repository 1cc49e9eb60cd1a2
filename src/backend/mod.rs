//! The one storage interface every export goes through, and its implementations.
//!
//! A [`Backend`] takes owned buffers and returns type-erased futures ([`BackendFuture`],
//! held inline, not boxed, when they fit), so an engine can keep a buffer while the I/O
//! is in flight (io_uring) and layers (replication, fault injection) can wrap any backend
//! the way nbdkit filters wrap plugins. What a backend can do is described by
//! [`Capabilities`], which map one-to-one onto NBD transmission flags in
//! [`Capabilities::transmission_flags`].

/// For test disks that wrap another backend in a field `inner` and change only some
/// methods: the named methods, passed on to `self.inner` unchanged.
#[cfg(test)]
macro_rules! pass_to_inner {
    ($($method:ident),* $(,)?) => { $( $crate::backend::pass_to_inner!(@one $method); )* };
    (@one size) => {
        fn size(&self) -> u64 {
            self.inner.size()
        }
    };
    (@one capabilities) => {
        fn capabilities(&self) -> $crate::backend::Capabilities {
            self.inner.capabilities()
        }
    };
    (@one read) => {
        fn read(&self, offset: u64, length: usize) -> $crate::backend::BackendFuture<'_, $crate::backend::ReadData> {
            self.inner.read(offset, length)
        }
    };
    (@one write) => {
        fn write(&self, offset: u64, data: $crate::backend::WriteData, fua: bool) -> $crate::backend::BackendFuture<'_, ()> {
            self.inner.write(offset, data, fua)
        }
    };
    (@one flush) => {
        fn flush(&self) -> $crate::backend::BackendFuture<'_, ()> {
            self.inner.flush()
        }
    };
    (@one trim) => {
        fn trim(&self, offset: u64, length: u64, fua: bool) -> $crate::backend::BackendFuture<'_, ()> {
            self.inner.trim(offset, length, fua)
        }
    };
    (@one write_zeroes) => {
        fn write_zeroes(&self, offset: u64, length: u64, flags: $crate::backend::ZeroFlags) -> $crate::backend::BackendFuture<'_, ()> {
            self.inner.write_zeroes(offset, length, flags)
        }
    };
    (@one cache) => {
        fn cache(&self, offset: u64, length: u64) -> $crate::backend::BackendFuture<'_, ()> {
            self.inner.cache(offset, length)
        }
    };
    (@one extents) => {
        fn extents(&self, offset: u64, length: u64) -> $crate::backend::BackendFuture<'_, Vec<$crate::backend::Extent>> {
            self.inner.extents(offset, length)
        }
    };
}
#[cfg(test)]
pub(crate) use pass_to_inner;

mod answer;
mod beside;
mod change_order;
pub mod file;
pub mod mapping;
pub mod memory;
pub mod page_pool;
pub mod powercut;
pub mod range_lock;
pub mod splice;
mod stream_copy;
pub mod uring;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use stackfuture::StackFuture;

use crate::buffer::SharedBuffer;
use crate::idle::Idle;
use crate::size::parse_size;
use crate::wire::{transmission_flags as tf, NbdError};
use page_pool::PageBuf;

/// The future a backend operation returns: held inline in [`BACKEND_FUTURE_ROOM`] bytes
/// (`stackfuture`), so that an operation allocates nothing for it, or on the heap when it
/// is larger (see [`backend_future`]).
pub type BackendFuture<'a, T> = StackFuture<'a, Result<T, BackendError>, BACKEND_FUTURE_ROOM>;

/// Bytes a [`BackendFuture`] holds inline: room for the file backend's read, write and
/// flush under `--cache=none`, which run once per request (a read takes 552 bytes, a
/// write 744, a flush 288). Wrapping layers (replication, fault injection) hold a whole
/// inner `BackendFuture` and go on the heap.
pub const BACKEND_FUTURE_ROOM: usize = 768;

/// `future` as a [`BackendFuture`]: inline when it fits, else boxed.
pub fn backend_future<'a, T>(
    future: impl Future<Output = Result<T, BackendError>> + Send + 'a,
) -> BackendFuture<'a, T> {
    StackFuture::from_or_box(future)
}

/// `future` as a [`BackendFuture`] that must fit inline: a future of the hot path that
/// grew past [`BACKEND_FUTURE_ROOM`] fails to compile instead of quietly allocating.
pub fn inline_backend_future<'a, T>(
    future: impl Future<Output = Result<T, BackendError>> + Send + 'a,
) -> BackendFuture<'a, T> {
    StackFuture::from(future)
}

/// An I/O failure with what was being done when it happened, and why when that is known
/// (the system call's error, or a layer's reason): the one line logged for a failed
/// request, and the message its error reply carries.
#[derive(Debug, thiserror::Error)]
#[error(
    "{op} of {length} bytes at offset {offset} failed ({errno}){}",
    .source.as_ref().map_or(String::new(), |why| format!(": {why}"))
)]
pub struct BackendError {
    pub op: &'static str,
    pub offset: u64,
    pub length: u64,
    /// What the client is told.
    pub errno: NbdError,
    #[source]
    pub source: Option<std::io::Error>,
    /// A refusal the protocol provides for, not a failure: a fast zero that would not be
    /// fast ([`BackendError::fast_zero_refused`]). It is answered without a warning, and
    /// says so.
    pub refused_fast_zero: bool,
}

impl BackendError {
    /// The same error, said of the client's request `op` of `length` bytes at `offset`
    /// (where the backend worked on a wider range: the blocks around an unaligned direct
    /// request), so the log names what the client sent.
    pub fn of_request(self, op: &'static str, offset: u64, length: u64) -> BackendError {
        BackendError {
            op,
            offset,
            length,
            ..self
        }
    }

    /// An error caused by an operating-system call.
    pub fn io(op: &'static str, offset: u64, length: u64, source: std::io::Error) -> BackendError {
        BackendError {
            op,
            offset,
            length,
            errno: NbdError::from_io(&source),
            source: Some(source),
            refused_fast_zero: false,
        }
    }

    /// An error with no underlying cause.
    pub fn plain(op: &'static str, offset: u64, length: u64, errno: NbdError) -> BackendError {
        BackendError {
            op,
            offset,
            length,
            errno,
            source: None,
            refused_fast_zero: false,
        }
    }

    /// An error with a reason of the backend's own (a replication layer's: no peer
    /// holds the data), said in the one line logged for it.
    pub fn because(
        op: &'static str,
        offset: u64,
        length: u64,
        errno: NbdError,
        why: impl std::fmt::Display,
    ) -> BackendError {
        BackendError {
            source: Some(std::io::Error::other(why.to_string())),
            ..BackendError::plain(op, offset, length, errno)
        }
    }

    /// The answer to a write of zeroes with `NBD_CMD_FLAG_FAST_ZERO` that this backend
    /// could not do faster than writing them: `NBD_ENOTSUP`, which tells the client to
    /// zero some other way. A refusal, not a failure.
    pub fn fast_zero_refused(offset: u64, length: u64) -> BackendError {
        BackendError {
            refused_fast_zero: true,
            ..BackendError::plain("fast write of zeroes", offset, length, NbdError::NotSup)
        }
    }
}

/// What a backend supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Writes are refused.
    pub read_only: bool,
    /// FLUSH is meaningful (data can sit in a volatile cache).
    pub flush: bool,
    /// Per-request forced unit access.
    pub fua: bool,
    pub trim: bool,
    pub write_zeroes: bool,
    /// WRITE_ZEROES can answer quickly whether it will be fast.
    pub fast_zero: bool,
    /// [`Backend::trim_to_zeroes`] costs about what a TRIM does: it writes zeroes by hand
    /// at most for the partial blocks (or a device's discard granules) at the range's
    /// ends. A replicated export offers TRIM only where this holds (`replication::layer`).
    pub zeroing_trim: bool,
    pub cache: bool,
    /// FLUSH and FUA on one connection are visible to every connection.
    pub multi_conn: bool,
    pub rotational: bool,
}

impl Capabilities {
    /// A backend that takes every kind of request (FLUSH and FUA, trims, zeroes with fast
    /// zeroing, cache hints), whose FLUSH on one connection holds for every connection, on
    /// media that is not rotational: the memory and the file export.
    pub fn full_store(read_only: bool) -> Capabilities {
        Capabilities {
            read_only,
            flush: true,
            fua: true,
            trim: true,
            write_zeroes: true,
            fast_zero: true,
            zeroing_trim: true,
            cache: true,
            multi_conn: true,
            rotational: false,
        }
    }

    /// Whether `NBD_FLAG_SEND_FAST_ZERO` is advertised: zeroing on a writable export that
    /// can say whether it will be fast.
    pub fn fast_zero_offered(&self) -> bool {
        !self.read_only && self.write_zeroes && self.fast_zero
    }

    /// The NBD transmission flags for these capabilities. `chunked_replies` says whether
    /// structured replies or extended headers were negotiated (DF needs them).
    pub fn transmission_flags(&self, chunked_replies: bool) -> u16 {
        let mut flags = tf::HAS_FLAGS;
        // A read-only export offers nothing that changes data (as nbdkit and qemu-nbd do):
        // a client that asked would be refused with EPERM anyway.
        let writable = !self.read_only;
        let pairs = [
            (self.read_only, tf::READ_ONLY),
            (self.flush, tf::SEND_FLUSH),
            (writable && self.fua, tf::SEND_FUA),
            (writable && self.trim, tf::SEND_TRIM),
            (writable && self.write_zeroes, tf::SEND_WRITE_ZEROES),
            (self.fast_zero_offered(), tf::SEND_FAST_ZERO),
            (self.cache, tf::SEND_CACHE),
            (self.multi_conn, tf::CAN_MULTI_CONN),
            (self.rotational, tf::ROTATIONAL),
            (chunked_replies, tf::SEND_DF),
        ];
        for (on, flag) in pairs {
            if on {
                flags |= flag;
            }
        }
        flags
    }
}

/// Most extents one [`Backend::extents`] query returns: a badly fragmented range is
/// reported in parts (a block-status reply may cover less than was asked, and clients
/// ask again from where it ended). Bounds the work and memory of one query and the
/// size of its reply.
pub const MAX_EXTENTS: usize = 16 * 1024;

/// A run of the export with one allocation state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub length: u64,
    /// Not allocated in the backing store.
    pub hole: bool,
    /// Reads as zeroes.
    pub zero: bool,
}

impl Extent {
    /// The `base:allocation` status flags.
    pub fn status(&self) -> u32 {
        let mut status = 0;
        if self.hole {
            status |= crate::wire::state::HOLE;
        }
        if self.zero {
            status |= crate::wire::state::ZERO;
        }
        status
    }
}

/// Bytes held in one or more buffers back to back: a backend can hand out its own storage
/// by reference (the memory backend gives a read one piece per page) instead of copying it
/// into one buffer.
#[derive(Debug, Clone)]
pub enum Pieces {
    One(Bytes),
    /// Several buffers in order: one list for the whole read, whatever each piece is.
    Many(PieceList),
    /// Part of one memory-export page, held by the page's own reference count: a read
    /// within one page (every 4 KiB read) allocates nothing. As a `Bytes` the part needs a
    /// boxed owner per read; its allocation, free and reference counting were 1.4% of the
    /// server's samples on 4 KiB random reads at QD32 (`perf`), where dropping a `Pieces`
    /// is now 0.25%.
    Page(PagePart),
    /// Part of a pooled buffer a backend read into (a file export's read), shared by the
    /// replies to reads merged into it: as a `Bytes` it too needed a boxed owner per read.
    Pooled(SharedBuffer),
    /// Part of a page-cache export's file mapping ([`Backend::read_mapped`]): its bytes
    /// are for the kernel to copy into a socket, not to be read here (see [`mapping`]).
    Mapped(mapping::MappedPart),
}

/// One buffer of [`Pieces::Many`]. A page is held as a [`PagePart`], not as a `Bytes`,
/// for the reason [`Pieces::Page`] gives: a 1 MiB read of the memory export allocated a
/// boxed owner for each of its 16 pages (21 allocations per read in `tests/allocations.rs`,
/// session 35).
#[derive(Debug, Clone)]
pub enum Piece {
    Shared(Bytes),
    Page(PagePart),
}

impl Piece {
    fn bytes(&self) -> &[u8] {
        match self {
            Piece::Shared(bytes) => bytes,
            Piece::Page(part) => part.bytes(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Piece::Shared(bytes) => bytes.len(),
            Piece::Page(part) => part.len,
        }
    }

    /// The bytes `[start, end)` of this piece, sharing its buffer.
    fn slice(&self, start: usize, end: usize) -> Piece {
        match self {
            Piece::Shared(bytes) => Piece::Shared(bytes.slice(start..end)),
            Piece::Page(part) => Piece::Page(part.slice(start, end - start)),
        }
    }
}

/// The list of a [`Pieces::Many`]: when dropped, it goes back emptied to a small pool of
/// its thread's, from which [`PieceList::with_capacity`] takes lists.
///
/// Measured reason: a memory read over one page built a list of its pages, and a 1 MiB
/// read (two 512 KiB pieces) allocated two, all it still allocated per read
/// (`tests/allocations.rs`, session 36). Lists are made and dropped on the connection's
/// thread: the read when it is parsed or by its piece's future, the drop when its reply
/// has been sent.
#[derive(Debug)]
pub struct PieceList(Vec<Piece>);

thread_local! {
    /// Emptied lists of pieces, to be used again (see [`PieceList`]): at most the reads
    /// of a few connections' queues.
    static IDLE_PIECE_LISTS: std::cell::RefCell<Idle<Vec<Piece>, 64>> =
        const { std::cell::RefCell::new(Idle::new()) };
}

impl PieceList {
    /// Lists longer than this (a read of over 4 MiB of 64 KiB pages) are not kept.
    const KEEP_CAPACITY: usize = 72;

    /// An empty list with room for `capacity` pieces, from the pool when it has one.
    pub fn with_capacity(capacity: usize) -> PieceList {
        let mut list = IDLE_PIECE_LISTS
            .try_with(|idle| idle.borrow_mut().take())
            .ok()
            .flatten()
            .unwrap_or_default();
        list.reserve(capacity);
        PieceList(list)
    }

    pub fn push(&mut self, piece: Piece) {
        self.0.push(piece);
    }
}

impl std::ops::Deref for PieceList {
    type Target = [Piece];

    fn deref(&self) -> &[Piece] {
        &self.0
    }
}

impl Clone for PieceList {
    fn clone(&self) -> PieceList {
        let mut list = PieceList::with_capacity(self.len());
        list.0.extend(self.iter().cloned());
        list
    }
}

impl Drop for PieceList {
    fn drop(&mut self) {
        let capacity = self.0.capacity();
        if capacity == 0 || capacity > Self::KEEP_CAPACITY {
            return;
        }
        let mut list = std::mem::take(&mut self.0);
        // The pieces let go of their pages and buffers here, before the list is kept.
        list.clear();
        let _ = IDLE_PIECE_LISTS.try_with(|idle| idle.borrow_mut().keep(list));
    }
}

/// `len` bytes of a page from `start` on.
#[derive(Debug, Clone)]
pub struct PagePart {
    pub page: Arc<PageBuf>,
    pub start: usize,
    pub len: usize,
}

impl PagePart {
    fn bytes(&self) -> &[u8] {
        &self.page[self.start..self.start + self.len]
    }

    /// The `length` bytes from `start` on of this part, holding the same page.
    fn slice(&self, start: usize, length: usize) -> PagePart {
        PagePart {
            page: Arc::clone(&self.page),
            start: start_of_slice(self.start, self.len, start, length),
            len: length,
        }
    }
}

/// Where the `length` bytes from `start` on of a part begin in what the part holds, when
/// the part is the `part_len` bytes from `part_start` on; panics when they reach past the
/// part (a caller's arithmetic gone wrong, which must not hand out other bytes).
pub(crate) fn start_of_slice(
    part_start: usize,
    part_len: usize,
    start: usize,
    length: usize,
) -> usize {
    assert!(
        start.checked_add(length).is_some_and(|end| end <= part_len),
        "{start}+{length} is outside the part"
    );
    part_start + start
}

/// The buffers of [`Pieces`], in order.
pub struct Slices<'a> {
    buffers: std::slice::Iter<'a, Piece>,
    single: Option<&'a [u8]>,
}

impl<'a> Iterator for Slices<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        self.single
            .take()
            .or_else(|| self.buffers.next().map(Piece::bytes))
    }
}

impl Pieces {
    /// The buffers, in order.
    pub fn slices(&self) -> Slices<'_> {
        let (buffers, single): (&[Piece], _) = match self {
            Pieces::One(one) => (&[], Some(&one[..])),
            Pieces::Many(many) => (many, None),
            Pieces::Page(part) => (&[], Some(part.bytes())),
            Pieces::Pooled(shared) => (&[], Some(&shared[..])),
            Pieces::Mapped(part) => (&[], Some(part.bytes())),
        };
        Slices {
            buffers: buffers.iter(),
            single,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Pieces::One(one) => one.len(),
            Pieces::Many(many) => many.iter().map(Piece::len).sum(),
            Pieces::Page(part) => part.len,
            Pieces::Pooled(shared) => shared.len(),
            Pieces::Mapped(part) => part.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes in one buffer: free for one piece, a copy for several.
    pub fn to_bytes(&self) -> Bytes {
        match self {
            Pieces::One(one) => one.clone(),
            Pieces::Page(part) => Bytes::from(part.clone()),
            Pieces::Pooled(shared) => shared.clone().into(),
            // Read here only by tests: a mapped part goes to a socket alone (`mapping`).
            Pieces::Mapped(part) => Bytes::copy_from_slice(part.bytes()),
            Pieces::Many(many) => {
                let mut all = Vec::with_capacity(self.len());
                for piece in many.iter() {
                    all.extend_from_slice(piece.bytes());
                }
                all.into()
            }
        }
    }

    /// The bytes `[start, start + length)`, sharing the buffers.
    pub fn slice(&self, start: usize, length: usize) -> Pieces {
        let end = start + length;
        match self {
            // A merged read's parts, one per request: no list to build for each.
            Pieces::One(one) => Pieces::One(one.slice(start..end)),
            Pieces::Page(part) => Pieces::Page(part.slice(start, length)),
            Pieces::Pooled(shared) => Pieces::Pooled(shared.slice(start, length)),
            Pieces::Mapped(part) => Pieces::Mapped(part.slice(start, length)),
            Pieces::Many(many) => {
                // Each piece that overlaps the range, with the range's part of it.
                let mut at = 0usize;
                let mut overlapping = many.iter().filter_map(|piece| {
                    let piece_start = at;
                    at += piece.len();
                    let (from, to) = (piece_start.max(start), at.min(end));
                    (from < to).then(|| (piece, from - piece_start, to - piece_start))
                });
                let Some(first) = overlapping.next() else {
                    return Pieces::One(Bytes::new());
                };
                let Some(second) = overlapping.next() else {
                    // A part within one piece (a merged read's reply within one page) is
                    // that piece's part, without a list to build and free.
                    let (piece, from, to) = first;
                    return Pieces::from(piece.slice(from, to));
                };
                let mut out = PieceList::with_capacity(many.len());
                for (piece, from, to) in [first, second].into_iter().chain(overlapping) {
                    out.push(piece.slice(from, to));
                }
                Pieces::Many(out)
            }
        }
    }
}

/// A page part as the owner of a `Bytes`.
struct PageOwner(PagePart);

impl AsRef<[u8]> for PageOwner {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl From<PagePart> for Bytes {
    fn from(part: PagePart) -> Bytes {
        Bytes::from_owner(PageOwner(part))
    }
}

impl From<Bytes> for Pieces {
    fn from(bytes: Bytes) -> Pieces {
        Pieces::One(bytes)
    }
}

impl From<SharedBuffer> for Pieces {
    fn from(shared: SharedBuffer) -> Pieces {
        Pieces::Pooled(shared)
    }
}

impl From<Piece> for Pieces {
    fn from(piece: Piece) -> Pieces {
        match piece {
            Piece::Shared(bytes) => Pieces::One(bytes),
            Piece::Page(part) => Pieces::Page(part),
        }
    }
}

/// A list of one piece is kept as that piece, without the list.
impl From<PieceList> for Pieces {
    fn from(mut pieces: PieceList) -> Pieces {
        match pieces.len() {
            0 => Pieces::One(Bytes::new()),
            1 => Pieces::from(pieces.0.pop().expect("one piece")),
            _ => Pieces::Many(pieces),
        }
    }
}

/// Equal when they hold the same bytes, however they are split.
impl PartialEq for Pieces {
    fn eq(&self, other: &Pieces) -> bool {
        self.len() == other.len() && self.slices().flatten().eq(other.slices().flatten())
    }
}

impl Eq for Pieces {}

/// The bytes a write takes: shared `Bytes` (a payload as it arrived in the connection's
/// read buffer), or a pooled buffer (a payload gathered into one, or copied into
/// alignment for direct I/O), which is shared without an allocation: as a `Bytes` it
/// needed a boxed owner per write (session 35).
#[derive(Debug, Clone)]
pub enum WriteData {
    Shared(Bytes),
    Pooled(SharedBuffer),
}

impl WriteData {
    /// The bytes `[start, start + length)`, sharing the buffer.
    pub fn slice(&self, start: usize, length: usize) -> WriteData {
        match self {
            WriteData::Shared(bytes) => WriteData::Shared(bytes.slice(start..start + length)),
            WriteData::Pooled(shared) => WriteData::Pooled(shared.slice(start, length)),
        }
    }

    /// The bytes as `Bytes`, for what keeps or sends them on (replication): free for
    /// shared bytes, a boxed owner for a pooled buffer.
    pub fn into_bytes(self) -> Bytes {
        match self {
            WriteData::Shared(bytes) => bytes,
            WriteData::Pooled(shared) => shared.into(),
        }
    }
}

impl std::ops::Deref for WriteData {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            WriteData::Shared(bytes) => bytes,
            WriteData::Pooled(shared) => shared,
        }
    }
}

impl From<Bytes> for WriteData {
    fn from(bytes: Bytes) -> WriteData {
        WriteData::Shared(bytes)
    }
}

impl From<SharedBuffer> for WriteData {
    fn from(shared: SharedBuffer) -> WriteData {
        WriteData::Pooled(shared)
    }
}

/// No bytes.
impl Default for WriteData {
    fn default() -> WriteData {
        WriteData::Shared(Bytes::new())
    }
}

/// Data returned by a read: the bytes, and which runs of them are holes (zeroes the
/// backend did not have to store), so structured replies can send `OFFSET_HOLE` for them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadData {
    pub data: Pieces,
    /// Consecutive runs covering `data`: (length, is_hole).
    pub runs: Runs,
}

/// Runs of data and holes: (length, is_hole). One run (a read without holes, the common
/// case) is kept without an allocation.
pub type Runs = smallvec::SmallVec<[(usize, bool); 1]>;

impl ReadData {
    /// The part `[start, start + length)` of this data, with its runs cut to match.
    pub fn slice(&self, start: usize, length: usize) -> ReadData {
        let end = start + length;
        let mut runs = Runs::new();
        let mut at = 0usize;
        for &(len, hole) in &self.runs {
            let (from, to) = (at.max(start), (at + len).min(end));
            if from < to {
                runs.push((to - from, hole));
            }
            at += len;
        }
        ReadData {
            data: self.data.slice(start, length),
            runs,
        }
    }

    /// Data with no holes.
    pub fn dense(data: impl Into<Pieces>) -> ReadData {
        let data = data.into();
        let len = data.len();
        ReadData {
            data,
            runs: smallvec::smallvec![(len, false)],
        }
    }

    /// All the bytes in one buffer (a copy when the backend gave several).
    pub fn bytes(&self) -> Bytes {
        self.data.to_bytes()
    }
}

/// Flags of a WRITE_ZEROES request, as the backend sees them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// The range may be deallocated (NO_HOLE was not set).
    pub may_trim: bool,
    /// Fail with ENOTSUP unless zeroing is faster than writing.
    pub fast: bool,
    pub fua: bool,
}

/// Storage behind an export. Every method may run concurrently with every other.
pub trait Backend: Send + Sync + 'static {
    /// Size of the export in bytes.
    fn size(&self) -> u64;
    fn capabilities(&self) -> Capabilities;
    /// Reads `length` bytes at `offset` (the range is within the export).
    fn read(&self, offset: u64, length: usize) -> BackendFuture<'_, ReadData>;
    /// Reads `length` bytes at `offset` at once, on the calling thread, when this backend
    /// can do that without waiting on a device (memory; a page-cache hit), and returns the
    /// result; `None` means it cannot, and [`Backend::read`] is the way. Lets a connection
    /// answer such a read as it parses it, without a future to allocate, queue and poll.
    fn read_at_once(&self, _offset: u64, _length: usize) -> Option<Result<ReadData, BackendError>> {
        None
    }
    /// [`Backend::read`] for a range that [`Backend::read_at_once`] has just declined. A
    /// backend whose `read` begins with what `read_at_once` tried (a file export's
    /// non-blocking `preadv2`) skips that try here: it would fail again.
    fn read_declined(&self, offset: u64, length: usize) -> BackendFuture<'_, ReadData> {
        self.read(offset, length)
    }
    /// Writes `data` at `offset`; with `fua` the data is durable when this returns.
    fn write(&self, offset: u64, data: WriteData, fua: bool) -> BackendFuture<'_, ()>;
    /// Writes `data` at `offset` at once, on the calling thread, when this backend can do
    /// that without waiting on a device (memory; a page-cache write without FUA), and
    /// returns the result; `None` means it cannot, and [`Backend::write`] is the way. Lets a
    /// connection copy a payload that arrived whole straight from its read buffer into
    /// place, instead of first into a buffer of its own for [`Backend::write`].
    fn write_inline(
        &self,
        _offset: u64,
        _data: &[u8],
        _fua: bool,
    ) -> Option<Result<(), BackendError>> {
        None
    }
    /// Makes every completed write durable.
    fn flush(&self) -> BackendFuture<'_, ()>;

    /// The flush of a server's stop, which no client's request waits for: a FLUSH, but a
    /// replicated backend leaves out what only a client's acknowledgement needs (fencing
    /// a peer it goes without).
    fn final_flush(&self) -> BackendFuture<'_, ()> {
        self.flush()
    }

    /// The error every FLUSH fails with from now on, once a sync failed and data the
    /// kernel had accepted may be lost (a file export: see `backend::file`); `None` while
    /// FLUSH can still succeed. Lets a node's status say so, not only its log.
    fn flush_stopped(&self) -> Option<std::io::Error> {
        None
    }
    /// Discards a range; afterwards it reads as zeroes or as its old contents.
    fn trim(&self, offset: u64, length: u64, fua: bool) -> BackendFuture<'_, ()>;
    /// Makes a range read as zeroes.
    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BackendFuture<'_, ()>;
    /// A TRIM after which the range reads as zeroes: the store may deallocate it, as a
    /// TRIM lets it, but may not leave old or unknown bytes (a plain TRIM may). Each node
    /// of a replicated export applies a client's TRIM this way, so that they all hold the
    /// same bytes after it. Where [`Capabilities::zeroing_trim`] does not hold it may
    /// write the zeroes.
    fn trim_to_zeroes(&self, offset: u64, length: u64, fua: bool) -> BackendFuture<'_, ()> {
        let flags = ZeroFlags {
            may_trim: true,
            fast: false,
            fua,
        };
        self.write_zeroes(offset, length, flags)
    }
    /// A hint that a range will be read soon.
    fn cache(&self, offset: u64, length: u64) -> BackendFuture<'_, ()>;
    /// Allocation state from `offset`, covering at least one byte and at most about
    /// `length` bytes (the last extent may run further).
    fn extents(&self, offset: u64, length: u64) -> BackendFuture<'_, Vec<Extent>>;
    /// Hands out, without blocking, completions the device has posted but nobody has
    /// collected yet, and returns how many completions were handed out so far, by anyone;
    /// `None` for a backend whose requests complete without a device to poll. Lets a
    /// connection that waits on one request poll for its completion instead of sleeping
    /// (see the pipeline's spin).
    fn poll_completions(&self) -> Option<u64> {
        None
    }
    /// Puts the `length` bytes at `offset` into a kernel pipe by reference, for a reply that
    /// the socket takes straight from the pipe (see [`splice`]), when that is possible now
    /// without blocking; `None` means read with [`Backend::read`] instead. The range is
    /// within the export and holds no holes the reply must report.
    fn read_to_pipe(&self, _offset: u64, _length: usize) -> Option<splice::Spliced> {
        None
    }
    /// The `length` bytes at `offset` as a part of the backend's mapping of its page cache
    /// ([`Pieces::Mapped`]), when all of them are cached now; `None` means read with
    /// [`Backend::read`] instead. For a reply whose data the kernel copies into a socket,
    /// and for nothing that reads the bytes itself (see [`mapping`]): the pipeline asks for
    /// this only for a socket, never a layer that keeps or checks data. The range is within
    /// the export and holds no holes the reply must report.
    fn read_mapped(&self, _offset: u64, _length: usize) -> Option<ReadData> {
        None
    }
    /// A socket's `writev` of data from [`Backend::read_mapped`] failed with `error`
    /// (`EFAULT`: a page of the mapping could not be read): the backend should stop
    /// handing out mapped data, whose failure costs the connection.
    fn mapped_send_failed(&self, _error: &std::io::Error) {}
    /// Whether [`Backend::read_to_pipe`] can ever hand out a pipe. A connection measures
    /// whether its client takes spliced or copied reads faster only when it can
    /// (`server::splice_probe`).
    fn can_splice(&self) -> bool {
        false
    }
    /// Whether every byte of `[offset, offset + length)` is in the page cache now, so that
    /// [`Backend::read_to_pipe`] can be expected to take each piece of it and a read of it
    /// cannot fail for want of the device. A reply that must commit to its data before all
    /// of it is read (a long read with a simple reply, see the pipeline) asks this first.
    /// False when the backend cannot tell.
    fn all_cached(&self, _offset: u64, _length: u64) -> bool {
        false
    }
    /// Whether most requests complete through a device's io_uring ring (direct I/O),
    /// whose completions a reaper task hands out. A server that runs connections on
    /// threads of their own keeps these on its shared runtime instead, where an idle
    /// worker runs the reaper beside the connection (see `server::ConnectionThreads`).
    fn completes_through_ring(&self) -> bool {
        false
    }
    /// Whether [`Backend::write`] wants every payload in a pooled, aligned buffer
    /// ([`crate::buffer::Buffer`]), however short: direct I/O, which must copy a payload
    /// that is not aligned into such a buffer anyway. A connection then gathers even a
    /// short payload from its read buffer into a pooled buffer as it arrives, instead of
    /// sharing it out of the read buffer: the copy is the same one, made earlier, the
    /// payload goes to the ring as a fixed buffer, and the read buffer, which no payload
    /// then holds, is reused when it fills instead of replaced.
    fn wants_pooled_payloads(&self) -> bool {
        false
    }
    /// Whether a FLUSH right after a lone write, before the client's own FLUSH comes, pays
    /// (see `server::flush_ahead`): the client's FLUSH then costs nothing, because this
    /// backend's FLUSH skips the sync when no write completed since the last one.
    fn flush_ahead_pays(&self) -> bool {
        false
    }
    /// The backend's page store, when it keeps data in page-sized buffers it can take over
    /// whole: a connection then receives a page-aligned write's payload from the socket
    /// straight into such buffers and hands them over ([`PageStore`]), instead of reading
    /// it into a buffer of its own for [`Backend::write`] to copy into place. `None` for
    /// backends that copy (files, devices) and for layers that must see every write
    /// (replication, fault injection).
    fn page_store(&self) -> Option<&dyn PageStore> {
        None
    }
}

/// Storage kept as page-sized buffers that a write can replace whole (the memory backend).
///
/// Measured reason: a 1 MiB write to the memory export was copied twice, from the socket
/// into a pooled buffer and from there into its pages, with the server at a full core
/// (235–262 µs of CPU per MiB); received into the pages themselves it is copied once.
pub trait PageStore: Send + Sync {
    /// Bytes per page. Only writes whose offset and length are multiples of it are taken
    /// this way.
    fn page_size(&self) -> usize;
    /// A buffer of [`PageStore::page_size`] bytes to receive a page of payload into. Its
    /// contents are unspecified (a replaced page's old data), so the receiver must fill
    /// every byte before handing it over.
    fn spare_page(&self) -> PageBuf;
    /// Puts `page`, filled with the data for `offset` (a multiple of the page size inside
    /// the export), in place of what was stored there. Reads that hold the old page keep
    /// it; the write is visible to every read that starts after this returns.
    fn adopt_page(&self, offset: u64, page: PageBuf);
}

/// How a file or block device export uses the kernel's page cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// `O_DIRECT`: data goes straight between the device and the server's buffers. The
    /// default for block devices, whose page cache would only duplicate the guest's own.
    None,
    /// Through the page cache: the default for regular files.
    Writeback,
}

impl std::str::FromStr for CacheMode {
    type Err = String;

    fn from_str(text: &str) -> Result<CacheMode, String> {
        match text {
            "none" => Ok(CacheMode::None),
            "writeback" => Ok(CacheMode::Writeback),
            other => Err(format!(
                "unknown cache mode {other:?} (expected \"none\" or \"writeback\")"
            )),
        }
    }
}

impl std::fmt::Display for CacheMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CacheMode::None => "none",
            CacheMode::Writeback => "writeback",
        })
    }
}

/// Where an export's data lives, as given on the command line or in a config file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackingSpec {
    /// `memory:SIZE`
    Memory { size: u64 },
    /// A regular file or a block device.
    Path(PathBuf),
}

impl BackingSpec {
    /// Parses `memory:SIZE` or a path.
    pub fn parse(text: &str) -> Result<BackingSpec, String> {
        if let Some(size) = text.strip_prefix("memory:") {
            let size = parse_size(size).map_err(|e| format!("bad size in {text:?}: {e}"))?;
            if size == 0 {
                return Err(format!("{text:?}: a memory export needs a size above zero"));
            }
            return Ok(BackingSpec::Memory { size });
        }
        if text.is_empty() {
            return Err("the backing path is empty".to_string());
        }
        Ok(BackingSpec::Path(PathBuf::from(text)))
    }

    /// Opens the backing. `size` creates a missing file of that size (and must match an
    /// existing one); `read_only` opens without write access; `cache` chooses direct or
    /// page-cache I/O for files and block devices (memory exports have no page cache).
    pub fn open(
        &self,
        size: Option<u64>,
        read_only: bool,
        cache: Option<CacheMode>,
    ) -> anyhow::Result<Arc<dyn Backend>> {
        match self {
            BackingSpec::Memory { size: mem } => {
                if let Some(size) = size {
                    anyhow::ensure!(size == *mem, "--size {size} does not match memory:{mem}");
                }
                Ok(Arc::new(memory::MemoryBackend::new(*mem, read_only)))
            }
            BackingSpec::Path(path) => Ok(Arc::new(file::FileBackend::open(
                path, size, read_only, cache,
            )?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backing_specs_parse() {
        assert_eq!(
            BackingSpec::parse("memory:1G").unwrap(),
            BackingSpec::Memory { size: 1 << 30 }
        );
        assert_eq!(
            BackingSpec::parse("/dev/sdb").unwrap(),
            BackingSpec::Path("/dev/sdb".into())
        );
        assert!(BackingSpec::parse("memory:0").is_err());
        assert!(BackingSpec::parse("memory:lots").is_err());
        assert!(BackingSpec::parse("").is_err());
    }

    #[test]
    fn read_data_slices_keep_their_runs() {
        let whole = ReadData {
            data: Bytes::from((0..100u8).collect::<Vec<_>>()).into(),
            runs: smallvec::smallvec![(10, false), (30, true), (60, false)],
        };
        let part = whole.slice(5, 40);
        assert_eq!(part.bytes()[0], 5);
        assert_eq!(part.data.len(), 40);
        assert_eq!(part.runs[..], [(5, false), (30, true), (5, false)]);
        assert_eq!(whole.slice(12, 5).runs[..], [(5, true)]);
        assert_eq!(whole.slice(0, 100), whole);
    }

    #[test]
    fn pieces_slice_across_their_buffers_and_compare_by_content() {
        let all: Vec<u8> = (0..=255u8).collect();
        // A page whose byte i is i % 256, so parts of it match `all` at the same offsets.
        let page_bytes: Vec<u8> = (0..page_pool::PAGE_BYTES).map(|i| i as u8).collect();
        let page = Arc::new(PageBuf::copy_of(&page_bytes));
        let part = |start, len| {
            Piece::Page(PagePart {
                page: Arc::clone(&page),
                start,
                len,
            })
        };
        let mut list = PieceList::with_capacity(3);
        list.push(Piece::Shared(Bytes::copy_from_slice(&all[..100])));
        list.push(part(100, 1));
        list.push(part(101, 155));
        let split = Pieces::from(list);
        assert!(matches!(&split, Pieces::Many(list) if list.len() == 3));
        assert_eq!(split.len(), 256);
        assert_eq!(split, Pieces::from(Bytes::from(all.clone())));
        for (start, len) in [(0, 256), (0, 100), (99, 3), (100, 1), (150, 0), (101, 155)] {
            let part = split.slice(start, len);
            assert_eq!(part.len(), len);
            assert_eq!(&part.to_bytes()[..], &all[start..start + len]);
        }
        assert_eq!(split.slice(99, 3).slices().count(), 3, "shares the buffers");
        assert_eq!(split.slice(10, 5).slices().count(), 1);
        // A part within one piece is that piece's part, not a list of one.
        assert!(matches!(split.slice(10, 5), Pieces::One(_)));
        assert!(matches!(split.slice(120, 30), Pieces::Page(_)));
        let one = Pieces::from(Bytes::from(all.clone()));
        for (start, len) in [(0, 256), (10, 20), (255, 1), (256, 0)] {
            assert_eq!(
                &one.slice(start, len).to_bytes()[..],
                &all[start..start + len]
            );
        }
    }

    #[test]
    fn a_dropped_piece_list_lets_go_of_its_pages_and_is_used_again() {
        let page = Arc::new(PageBuf::copy_of(&vec![3u8; page_pool::PAGE_BYTES]));
        let part = |start| {
            Piece::Page(PagePart {
                page: Arc::clone(&page),
                start,
                len: 100,
            })
        };
        // A thread of its own: its pool starts empty.
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let mut list = PieceList::with_capacity(4);
                list.push(part(0));
                list.push(part(100));
                let storage = list.as_ptr();
                let pieces = Pieces::from(list);
                assert!(matches!(&pieces, Pieces::Many(many) if many.len() == 2));
                assert_eq!(Arc::strong_count(&page), 3);
                drop(pieces);
                assert_eq!(Arc::strong_count(&page), 1, "the kept list holds no page");
                let again = PieceList::with_capacity(4);
                assert_eq!(again.as_ptr(), storage, "the same list, not a new one");
                assert!(again.is_empty());
                // A list of one piece becomes that piece; its list is kept too.
                let mut one = again;
                one.push(part(200));
                assert!(matches!(Pieces::from(one), Pieces::Page(_)));
                assert_eq!(PieceList::with_capacity(1).as_ptr(), storage);
            });
        });
    }

    #[test]
    fn a_page_part_slices_shares_its_page_and_compares_by_content() {
        let all: Vec<u8> = (0..page_pool::PAGE_BYTES)
            .map(|i| (i % 251) as u8)
            .collect();
        let page = Arc::new(PageBuf::copy_of(&all));
        let part = Pieces::Page(PagePart {
            page: Arc::clone(&page),
            start: 1000,
            len: 4096,
        });
        assert_eq!(part.len(), 4096);
        assert_eq!(part.slices().collect::<Vec<_>>(), [&all[1000..5096]]);
        assert_eq!(part, Pieces::from(Bytes::copy_from_slice(&all[1000..5096])));
        let inner = part.slice(96, 4000);
        assert!(
            matches!(inner, Pieces::Page(_)),
            "a part of a part is a part"
        );
        assert_eq!(&inner.to_bytes()[..], &all[1096..5096]);
        // The page is held by reference, not copied: the part, its slice, the test's own.
        assert_eq!(Arc::strong_count(&page), 3);
        drop((part, inner));
        assert_eq!(Arc::strong_count(&page), 1);
    }

    #[test]
    fn a_pooled_part_slices_shares_its_buffer_and_compares_by_content() {
        let all: Vec<u8> = (0..3 * 4096).map(|i| (i % 251) as u8).collect();
        let mut buffer = crate::buffer::Buffer::take(all.len());
        buffer.as_mut().copy_from_slice(&all);
        let address = buffer.as_ref().as_ptr();
        let whole = Pieces::from(buffer.share());
        assert_eq!(whole.len(), all.len());
        assert_eq!(whole, Pieces::from(Bytes::copy_from_slice(&all)));
        let part = whole.slice(1000, 4096);
        assert!(
            matches!(&part, Pieces::Pooled(shared) if shared.as_ptr() == address.wrapping_add(1000)),
            "a part of a pooled buffer points into it"
        );
        assert_eq!(part.slices().collect::<Vec<_>>(), [&all[1000..5096]]);
        assert_eq!(&part.slice(96, 4000).to_bytes()[..], &all[1096..5096]);
        assert_eq!(
            ReadData::dense(Bytes::copy_from_slice(&all)).slice(1000, 4096),
            ReadData::dense(part)
        );
    }

    #[test]
    fn cache_modes_parse_and_print() {
        for mode in [CacheMode::None, CacheMode::Writeback] {
            assert_eq!(mode.to_string().parse::<CacheMode>().unwrap(), mode);
        }
        assert!("unsafe".parse::<CacheMode>().is_err());
    }

    #[test]
    fn a_slice_of_a_part_starts_within_it() {
        assert_eq!(start_of_slice(100, 50, 0, 50), 100);
        assert_eq!(start_of_slice(100, 50, 10, 20), 110);
        assert_eq!(start_of_slice(100, 50, 50, 0), 150);
    }

    #[test]
    #[should_panic(expected = "outside the part")]
    fn a_slice_past_the_part_s_end_panics() {
        start_of_slice(100, 50, 40, 11);
    }

    #[test]
    #[should_panic(expected = "outside the part")]
    fn a_slice_whose_end_overflows_panics() {
        start_of_slice(0, 50, usize::MAX, 2);
    }

    #[test]
    fn flags_follow_capabilities() {
        let caps = Capabilities {
            read_only: true,
            flush: true,
            fua: true,
            trim: false,
            write_zeroes: true,
            fast_zero: true,
            zeroing_trim: true,
            cache: true,
            multi_conn: true,
            rotational: false,
        };
        let flags = caps.transmission_flags(false);
        assert_eq!(flags & tf::HAS_FLAGS, tf::HAS_FLAGS);
        assert_eq!(flags & tf::READ_ONLY, tf::READ_ONLY);
        assert_eq!(flags & tf::SEND_TRIM, 0);
        assert_eq!(flags & tf::SEND_DF, 0);
        assert_eq!(caps.transmission_flags(true) & tf::SEND_DF, tf::SEND_DF);
        let no_zero = Capabilities {
            write_zeroes: false,
            ..caps
        };
        assert_eq!(no_zero.transmission_flags(true) & tf::SEND_FAST_ZERO, 0);
    }
}
