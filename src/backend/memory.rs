//! A sparse in-memory backend: pages are allocated on first write and released by TRIM
//! and WRITE_ZEROES; page tables are sharded so concurrent requests rarely share a lock.
//!
//! Reads are not copied: a read hands out its pages by reference (one piece per page, see
//! [`super::Pieces`]), and the socket copies them straight from here. A write to a page
//! that a read still holds copies the page first (copy on write), so data handed out never
//! changes under the reader. Measured reason: copying into a read buffer was a quarter of
//! the server's CPU on 1 MiB reads (`memmove`, 23% of samples) and 6% on 4 KiB reads.
//!
//! Whole-page writes are not copied either: a connection receives a page-aligned payload
//! into spare pages and hands them over ([`PageStore`]); pages that writes replace and no
//! read holds become the spares.
//!
//! Pages come from [`super::page_pool`], which backs pages written whole with huge pages
//! (random reads then do not pay a page walk each) and pages written in part with small
//! ones (a first 4 KiB write then touches 4 KiB, not 2 MiB); ARCHITECTURE.md, "Data path".

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;

use super::page_pool::PageBuf;
use super::{
    backend_future, Backend, BackendFuture, Capabilities, Extent, PagePart, PageStore, Piece,
    PieceList, Pieces, ReadData, WriteData, ZeroFlags,
};

/// Bytes per page: the allocation and hole granularity.
pub const PAGE_SIZE: u64 = 64 * 1024;
const SHARDS: u64 = 64;
/// Replaced pages kept for payloads to be received into ([`PageStore::spare_page`]), 32
/// MiB at most. Only pages that writes replace become spares (a write that takes a spare
/// gives one back, so the count holds steady); pages that TRIM releases are freed.
const MAX_SPARE_PAGES: usize = 512;

/// A page, shared with the reads that hold it; writable in place only when nobody else does.
///
/// The reference count lives in a small allocation of its own rather than at the head of
/// the 64 KiB page. Measured reason: on random 4 KiB reads the count's increment was two
/// thirds of the page lookup (a cache miss on a line the read does not otherwise touch);
/// with the count apart, the lookup's share of the server's CPU fell from 8.3–8.9% to
/// 6.7–7.4% (perf, memory export, QD32, two profiles each).
type Page = Arc<PageBuf>;

/// What unwritten memory reads as.
static ZERO_PAGE: [u8; PAGE_SIZE as usize] = [0; PAGE_SIZE as usize];

/// `len` bytes of a hole, read from the static page of zeroes.
fn hole_bytes(len: usize) -> Bytes {
    Bytes::from_static(&ZERO_PAGE[..len])
}

/// A new page of zeroes, for a write of part of it ([`super::page_pool`]).
fn zero_page() -> Page {
    Arc::new(PageBuf::zeroed())
}

// The pool's buffers are this export's pages.
const _: () = assert!(super::page_pool::PAGE_BYTES as u64 == PAGE_SIZE);

/// The page's bytes to write into: in place when no read holds it, else a copy that
/// replaces it in the table (the reads keep the old one).
fn writable(page: &mut Page) -> &mut [u8] {
    if Arc::get_mut(page).is_none() {
        *page = Arc::new(PageBuf::copy_of(&page[..]));
    }
    Arc::get_mut(page).expect("a page just copied has no other holder")
}

/// Sparse memory export.
pub struct MemoryBackend {
    size: u64,
    read_only: bool,
    shards: Vec<RwLock<HashMap<u64, Page>>>,
    /// Pages that writes replaced and no read held, reused as receive buffers.
    spare_pages: Mutex<Vec<PageBuf>>,
    /// Pages taken over from connections ([`PageStore::adopt_page`]).
    pages_adopted: AtomicU64,
    /// Where the last write ended: a small write that starts there is copied plainly
    /// ([`MemoryBackend::write_now`]).
    last_write_end: AtomicU64,
}

impl MemoryBackend {
    pub fn new(size: u64, read_only: bool) -> MemoryBackend {
        let shards = (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect();
        MemoryBackend {
            size,
            read_only,
            shards,
            spare_pages: Mutex::new(Vec::new()),
            pages_adopted: AtomicU64::new(0),
            last_write_end: AtomicU64::new(u64::MAX),
        }
    }

    /// How many pages writes have handed over whole so far (see [`PageStore`]).
    pub fn pages_adopted(&self) -> u64 {
        self.pages_adopted.load(Ordering::Relaxed)
    }

    /// Keeps a page that left the table, and that no read holds, for reuse as a receive
    /// buffer when the spare list has room.
    fn keep_spare(&self, page: PageBuf) {
        let mut spares = self.spare_pages.lock().unwrap_or_else(|e| e.into_inner());
        if spares.len() < MAX_SPARE_PAGES {
            spares.push(page);
        }
    }

    fn shard(&self, page: u64) -> &RwLock<HashMap<u64, Page>> {
        &self.shards[(page % SHARDS) as usize]
    }

    /// Calls `f(page_index, offset_in_page, buffer_offset, len)` for every page piece of a range.
    fn for_each_piece(offset: u64, length: u64, mut f: impl FnMut(u64, usize, usize, usize)) {
        let mut done = 0u64;
        while done < length {
            let at = offset + done;
            let page = at / PAGE_SIZE;
            let in_page = (at % PAGE_SIZE) as usize;
            let len = (PAGE_SIZE - at % PAGE_SIZE).min(length - done) as usize;
            f(page, in_page, done as usize, len);
            done += len as u64;
        }
    }

    /// `len` bytes of page `page` from `in_page` on, by reference; `None` for a page never
    /// written (a hole, which reads as zeroes).
    fn page_part(&self, page: u64, in_page: usize, len: usize) -> Option<PagePart> {
        let held = self
            .shard(page)
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&page)
            .map(Arc::clone)?;
        Some(PagePart {
            page: held,
            start: in_page,
            len,
        })
    }

    fn read_now(&self, offset: u64, length: usize) -> ReadData {
        let in_page = (offset % PAGE_SIZE) as usize;
        if in_page + length <= PAGE_SIZE as usize {
            // Within one page (every 4 KiB read): no list of pieces to build, and no
            // allocation (`Pieces::Page`).
            let (data, hole) = match self.page_part(offset / PAGE_SIZE, in_page, length) {
                Some(part) => (Pieces::Page(part), false),
                None => (hole_bytes(length).into(), true),
            };
            return ReadData {
                data,
                runs: smallvec::smallvec![(length, hole)],
            };
        }
        let mut pieces = PieceList::with_capacity(length.div_ceil(PAGE_SIZE as usize) + 1);
        let mut runs = super::Runs::new();
        Self::for_each_piece(offset, length as u64, |page, in_page, _, len| {
            let part = self.page_part(page, in_page, len);
            let hole = part.is_none();
            pieces.push(part.map_or_else(|| Piece::Shared(hole_bytes(len)), Piece::Page));
            match runs.last_mut() {
                Some((run_len, run_hole)) if *run_hole == hole => *run_len += len,
                _ => runs.push((len, hole)),
            }
        });
        ReadData {
            data: pieces.into(),
            runs,
        }
    }

    /// Copies a write into its pages. Into memory the CPU is not about to read, the copy
    /// streams ([`super::stream_copy`]): every write but a small one that continues the
    /// last, whose lines the CPU's prefetcher has already brought in.
    ///
    /// Measured reason (`bench/ab.py`, memory export, 3 rounds, against plain copies in
    /// the same run; nbdkit-mem beside): 64 KiB sequential writes at QD8 78.5k against
    /// 58.4k IOPS at 12.4 against 16.7 µs of server CPU a write (nbdkit 53.9k); 4 KiB
    /// random writes at QD32 2.91 against 3.01 µs (another run: 2.84 against 3.35). A
    /// plain copy of 4 KiB into a cold page read every line in first, and the lock's
    /// release after it waited for those reads: 22% of the server's samples sat on that
    /// release and 9% in `memmove`, against 22% in all with streaming stores. Streaming
    /// every write cost 4 KiB sequential writes 3–8% (159.8k against 164.0k, and
    /// 155.0k against 168.4k); kept plain, they are level (167.1k).
    fn write_now(&self, offset: u64, data: &[u8]) {
        // A plain load and store, not a swap: when connections race, the worst is a wrong
        // guess (a copy streamed or not); a swap is a locked instruction on a line that
        // every connection shares, on every write.
        let end = offset + data.len() as u64;
        let continues = self.last_write_end.load(Ordering::Relaxed) == offset;
        self.last_write_end.store(end, Ordering::Relaxed);
        let stream = !continues || data.len() as u64 >= PAGE_SIZE;
        Self::for_each_piece(offset, data.len() as u64, |page, in_page, at, len| {
            let mut shard = self.shard(page).write().unwrap_or_else(|e| e.into_inner());
            // A page written whole needs no zeroes first (and takes memory meant for it).
            let new_page = || {
                if len as u64 == PAGE_SIZE {
                    Arc::new(PageBuf::any())
                } else {
                    zero_page()
                }
            };
            let bytes = writable(shard.entry(page).or_insert_with(new_page));
            let (into, from) = (&mut bytes[in_page..in_page + len], &data[at..at + len]);
            if stream {
                super::stream_copy::copy_streaming(into, from);
            } else {
                into.copy_from_slice(from);
            }
        });
    }

    /// Makes a range read as zeroes. With `punch`, whole pages are released (a hole);
    /// without it every page stays or becomes allocated (NBD_CMD_FLAG_NO_HOLE: the range
    /// must be fully provisioned afterwards).
    /// Pages held (written and not trimmed since).
    fn present_pages(&self) -> u64 {
        self.shards
            .iter()
            .map(|shard| shard.read().unwrap_or_else(|e| e.into_inner()).len() as u64)
            .sum()
    }

    /// Zeroes a range; with `punch`, whole pages are dropped. A punch over more pages than
    /// the export holds goes through the held pages, not the range: a trim of a terabyte
    /// walked 16 million page slots on the connection's thread (0.26 s), stalling the
    /// other connections there.
    fn zero_now(&self, offset: u64, length: u64, punch: bool) {
        let first_whole = offset.div_ceil(PAGE_SIZE);
        let end_whole = (offset + length) / PAGE_SIZE;
        // Counting the held pages takes every shard's lock: only for large punches.
        let large = end_whole.saturating_sub(first_whole) > SHARDS * 64;
        if punch && large && end_whole - first_whole > self.present_pages() {
            // The partial pages at the ends: zeroed where held, never allocated.
            self.zero_walk(offset, first_whole * PAGE_SIZE - offset, true);
            for shard in &self.shards {
                let mut shard = shard.write().unwrap_or_else(|e| e.into_inner());
                let doomed: Vec<u64> = shard
                    .keys()
                    .copied()
                    .filter(|page| (first_whole..end_whole).contains(page))
                    .collect();
                for page in doomed {
                    if let Some(Ok(buffer)) = shard.remove(&page).map(Arc::try_unwrap) {
                        buffer.give_back();
                    }
                }
            }
            let tail = end_whole * PAGE_SIZE;
            self.zero_walk(tail, offset + length - tail, true);
            return;
        }
        self.zero_walk(offset, length, punch);
    }

    /// [`MemoryBackend::zero_now`] page by page.
    fn zero_walk(&self, offset: u64, length: u64, punch: bool) {
        Self::for_each_piece(offset, length, |page, in_page, _, len| {
            let mut shard = self.shard(page).write().unwrap_or_else(|e| e.into_inner());
            if punch && len as u64 == PAGE_SIZE {
                // Released, not kept as a spare: a trim gives the memory back (a page a
                // read still holds goes back to the pool when the read drops it).
                if let Some(released) = shard.remove(&page) {
                    if let Ok(buffer) = Arc::try_unwrap(released) {
                        buffer.give_back();
                    }
                }
            } else if let Some(bytes) = shard.get_mut(&page) {
                writable(bytes)[in_page..in_page + len].fill(0);
            } else if !punch {
                shard.insert(page, zero_page());
            }
        });
    }

    fn extents_now(&self, offset: u64, length: u64) -> Vec<Extent> {
        let mut extents: Vec<Extent> = Vec::new();
        let mut full = false;
        Self::for_each_piece(offset, length, |page, _, _, len| {
            // Past the limit the rest is reported by a later query.
            if full {
                return;
            }
            let present = self
                .shard(page)
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(&page);
            let hole = !present;
            let count = extents.len();
            match extents.last_mut() {
                Some(last) if last.hole == hole => last.length += len as u64,
                _ if count == super::MAX_EXTENTS => full = true,
                _ => extents.push(Extent {
                    length: len as u64,
                    hole,
                    zero: hole,
                }),
            }
        });
        extents
    }
}

impl PageStore for MemoryBackend {
    fn page_size(&self) -> usize {
        PAGE_SIZE as usize
    }

    fn spare_page(&self) -> PageBuf {
        let spare = self
            .spare_pages
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        spare.unwrap_or_else(PageBuf::any)
    }

    fn adopt_page(&self, offset: u64, page: PageBuf) {
        assert!(
            offset % PAGE_SIZE == 0 && page.len() == PAGE_SIZE as usize,
            "a page handed over must be one whole, aligned page"
        );
        let index = offset / PAGE_SIZE;
        // A page no read holds takes the new bytes in place: its reference count is
        // reused, so a write of whole pages allocates nothing (a 1 MiB write allocated
        // one count per page: 16 per write in `tests/allocations.rs`, session 35).
        let replaced = {
            let mut shard = self.shard(index).write().unwrap_or_else(|e| e.into_inner());
            match shard.get_mut(&index).and_then(Arc::get_mut) {
                Some(unshared) => Ok(std::mem::replace(unshared, page)),
                None => Err(shard.insert(index, Arc::new(page))),
            }
        };
        // The old page, when no read holds it (a read that does frees it when done).
        let replaced = match replaced {
            Ok(unshared) => Some(unshared),
            Err(old) => old.and_then(|old| Arc::try_unwrap(old).ok()),
        };
        self.pages_adopted.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = replaced {
            self.keep_spare(old);
        }
    }
}

impl Backend for MemoryBackend {
    fn size(&self) -> u64 {
        self.size
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::full_store(self.read_only)
    }

    fn read(&self, offset: u64, length: usize) -> BackendFuture<'_, ReadData> {
        backend_future(async move { Ok(self.read_now(offset, length)) })
    }

    fn read_at_once(
        &self,
        offset: u64,
        length: usize,
    ) -> Option<Result<ReadData, super::BackendError>> {
        Some(Ok(self.read_now(offset, length)))
    }

    fn write(&self, offset: u64, data: WriteData, _fua: bool) -> BackendFuture<'_, ()> {
        backend_future(async move {
            self.write_now(offset, &data);
            Ok(())
        })
    }

    fn write_inline(
        &self,
        offset: u64,
        data: &[u8],
        _fua: bool,
    ) -> Option<Result<(), super::BackendError>> {
        self.write_now(offset, data);
        Some(Ok(()))
    }

    fn flush(&self) -> BackendFuture<'_, ()> {
        backend_future(async { Ok(()) })
    }

    fn trim(&self, offset: u64, length: u64, _fua: bool) -> BackendFuture<'_, ()> {
        backend_future(async move {
            self.zero_now(offset, length, true);
            Ok(())
        })
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BackendFuture<'_, ()> {
        backend_future(async move {
            // Dropping pages is faster than writing; provisioning zeroed pages is not.
            if flags.fast && !flags.may_trim {
                return Err(super::BackendError::fast_zero_refused(offset, length));
            }
            self.zero_now(offset, length, flags.may_trim);
            Ok(())
        })
    }

    fn cache(&self, _offset: u64, _length: u64) -> BackendFuture<'_, ()> {
        backend_future(async { Ok(()) })
    }

    fn extents(&self, offset: u64, length: u64) -> BackendFuture<'_, Vec<Extent>> {
        backend_future(async move { Ok(self.extents_now(offset, length)) })
    }

    fn page_store(&self) -> Option<&dyn PageStore> {
        Some(self)
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
    fn a_trim_larger_than_what_is_held_drops_the_held_pages_and_zeroes_the_ends() {
        let size = 1u64 << 40;
        let m = MemoryBackend::new(size, false);
        let ones = |len: usize| Bytes::from(vec![1u8; len]);
        for at in [0, 5 * PAGE_SIZE, size / 2, size - 2 * PAGE_SIZE] {
            block_on(m.write(at, ones(2 * PAGE_SIZE as usize).into(), false)).unwrap();
        }
        assert_eq!(m.present_pages(), 8);
        // Leaves the first 100 bytes and the last 100: the pages at the ends stay, zeroed
        // in part; every page between goes, without a walk over 16 million page slots.
        block_on(m.trim(100, size - 200, false)).unwrap();
        assert_eq!(m.present_pages(), 2);
        let head = block_on(m.read(0, 2 * PAGE_SIZE as usize)).unwrap().bytes();
        assert!(head[..100].iter().all(|&b| b == 1));
        assert!(head[100..].iter().all(|&b| b == 0));
        let tail = block_on(m.read(size - PAGE_SIZE, PAGE_SIZE as usize))
            .unwrap()
            .bytes();
        let kept = PAGE_SIZE as usize - 100;
        assert!(tail[..kept].iter().all(|&b| b == 0));
        assert!(tail[kept..].iter().all(|&b| b == 1));
        // A trim of nothing held allocates nothing.
        let empty = MemoryBackend::new(size, false);
        block_on(empty.trim(7, size - 7, false)).unwrap();
        assert_eq!(empty.present_pages(), 0);
    }

    #[test]
    fn unwritten_memory_reads_as_a_hole_of_zeroes() {
        let m = MemoryBackend::new(1 << 20, false);
        let r = block_on(m.read(1000, 5000)).unwrap();
        assert!(r.bytes().iter().all(|&b| b == 0));
        assert_eq!(r.runs[..], [(5000, true)]);
    }

    #[test]
    fn writes_across_pages_read_back() {
        let m = MemoryBackend::new(1 << 20, false);
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        block_on(m.write(PAGE_SIZE - 7, Bytes::from(data.clone()).into(), false)).unwrap();
        let r = block_on(m.read(PAGE_SIZE - 7, data.len())).unwrap();
        assert_eq!(&r.bytes()[..], &data[..]);
        assert!(r.runs.iter().all(|&(_, hole)| !hole));
        // Memory pages are copied into the socket, never spliced: no connection to a
        // memory export measures which of the two its client takes faster.
        assert!(!m.can_splice());
        assert!(m.read_to_pipe(0, 1 << 20).is_none());
        // Pages 0..=4 were touched; page 5 is still a hole.
        let ext = block_on(m.extents(0, 6 * PAGE_SIZE)).unwrap();
        assert_eq!(
            ext,
            vec![
                Extent {
                    length: 5 * PAGE_SIZE,
                    hole: false,
                    zero: false
                },
                Extent {
                    length: PAGE_SIZE,
                    hole: true,
                    zero: true
                },
            ]
        );
    }

    #[test]
    fn a_read_keeps_what_it_saw_while_later_writes_change_the_page() {
        let m = MemoryBackend::new(4 * PAGE_SIZE, false);
        block_on(m.write(
            0,
            Bytes::from(vec![1u8; 2 * PAGE_SIZE as usize]).into(),
            false,
        ))
        .unwrap();
        let held = block_on(m.read(100, PAGE_SIZE as usize)).unwrap();
        assert_eq!(
            held.data.slices().count(),
            2,
            "a piece per page, by reference"
        );
        // A write into a held page copies it; a partial zeroing of the other page too.
        block_on(m.write(200, Bytes::from(vec![2u8; 300]).into(), false)).unwrap();
        let partial = ZeroFlags {
            may_trim: true,
            ..ZeroFlags::default()
        };
        block_on(m.write_zeroes(PAGE_SIZE, 50, partial)).unwrap();
        assert!(
            held.bytes().iter().all(|&b| b == 1),
            "the read saw the old data"
        );
        let now = block_on(m.read(0, 2 * PAGE_SIZE as usize)).unwrap().bytes();
        assert!(now[..200].iter().all(|&b| b == 1));
        assert!(now[200..500].iter().all(|&b| b == 2));
        assert!(now[500..PAGE_SIZE as usize].iter().all(|&b| b == 1));
        assert!(now[PAGE_SIZE as usize..PAGE_SIZE as usize + 50]
            .iter()
            .all(|&b| b == 0));
        assert!(now[PAGE_SIZE as usize + 50..].iter().all(|&b| b == 1));
        // Once the read is gone, a write goes into the page in place.
        drop(held);
        let before = Arc::as_ptr(&m.shard(0).read().unwrap()[&0]);
        block_on(m.write(0, Bytes::from(vec![3u8; 10]).into(), false)).unwrap();
        assert_eq!(Arc::as_ptr(&m.shard(0).read().unwrap()[&0]), before);
    }

    #[test]
    fn pages_handed_over_replace_whole_pages_and_readers_keep_the_old_ones() {
        let m = MemoryBackend::new(4 * PAGE_SIZE, false);
        block_on(m.write(
            0,
            Bytes::from(vec![1u8; 2 * PAGE_SIZE as usize]).into(),
            false,
        ))
        .unwrap();
        let held = block_on(m.read(0, 100)).unwrap();
        let held_page = Arc::as_ptr(&m.shard(0).read().unwrap()[&0]);
        let unheld = Arc::as_ptr(&m.shard(1).read().unwrap()[&1]);
        let unheld_bytes = m.shard(1).read().unwrap()[&1].as_ptr();

        let store = m.page_store().expect("memory keeps whole pages");
        assert_eq!(store.page_size(), PAGE_SIZE as usize);
        for index in [0u64, 3, 1] {
            let mut page = store.spare_page();
            page.fill(9 + index as u8);
            store.adopt_page(index * PAGE_SIZE, page);
        }
        assert_eq!(m.pages_adopted(), 3);

        assert!(
            held.bytes().iter().all(|&b| b == 1),
            "the read kept its page"
        );
        let now = block_on(m.read(0, 4 * PAGE_SIZE as usize)).unwrap();
        let now_bytes = now.bytes();
        let page = |i: usize| &now_bytes[i * PAGE_SIZE as usize..(i + 1) * PAGE_SIZE as usize];
        assert!(page(0).iter().all(|&b| b == 9));
        assert!(page(1).iter().all(|&b| b == 10));
        assert!(page(2).iter().all(|&b| b == 0));
        assert!(page(3).iter().all(|&b| b == 12));
        assert_eq!(
            now.runs[..],
            [
                (2 * PAGE_SIZE as usize, false),
                (PAGE_SIZE as usize, true),
                (PAGE_SIZE as usize, false)
            ]
        );
        // Page 1, which no read held, took its new buffer under the same reference count;
        // page 0, which a read holds, got a new one.
        let table_page = |i: u64| Arc::clone(&m.shard(i).read().unwrap()[&i]);
        assert_eq!(Arc::as_ptr(&table_page(1)), unheld, "the count is reused");
        assert_ne!(table_page(1).as_ptr(), unheld_bytes, "around the new bytes");
        assert_ne!(Arc::as_ptr(&table_page(0)), held_page);

        // Page 1's old buffer, which no read held, is handed out again to be received
        // into; page 0's stays with the read until it is dropped.
        drop(now);
        let reused = store.spare_page();
        assert_eq!(reused.as_ptr(), unheld_bytes, "the replaced page is reused");
        assert!(reused.iter().all(|&b| b == 1), "with its old data");
    }

    #[test]
    fn zeroing_with_no_hole_leaves_the_range_allocated() {
        let m = MemoryBackend::new(4 * PAGE_SIZE, false);
        block_on(m.write(0, Bytes::from(vec![5u8; PAGE_SIZE as usize]).into(), false)).unwrap();
        let keep = ZeroFlags {
            may_trim: false,
            fast: false,
            fua: false,
        };
        block_on(m.write_zeroes(0, 3 * PAGE_SIZE, keep)).unwrap();
        let r = block_on(m.read(0, 3 * PAGE_SIZE as usize)).unwrap();
        assert!(r.bytes().iter().all(|&b| b == 0));
        assert_eq!(r.runs[..], [(3 * PAGE_SIZE as usize, false)], "no holes");
        let ext = block_on(m.extents(0, 4 * PAGE_SIZE)).unwrap();
        assert_eq!(
            ext[0],
            Extent {
                length: 3 * PAGE_SIZE,
                hole: false,
                zero: false
            }
        );
        let fast = ZeroFlags { fast: true, ..keep };
        let err = block_on(m.write_zeroes(0, PAGE_SIZE, fast)).unwrap_err();
        assert_eq!(err.errno, crate::wire::NbdError::NotSup);
    }

    #[test]
    fn zeroing_whole_pages_makes_holes_and_partial_pages_zero() {
        let m = MemoryBackend::new(4 * PAGE_SIZE, false);
        block_on(m.write(
            0,
            Bytes::from(vec![7u8; 4 * PAGE_SIZE as usize]).into(),
            false,
        ))
        .unwrap();
        block_on(m.write_zeroes(
            100,
            2 * PAGE_SIZE,
            ZeroFlags {
                may_trim: true,
                ..ZeroFlags::default()
            },
        ))
        .unwrap();
        let r = block_on(m.read(0, 4 * PAGE_SIZE as usize)).unwrap();
        let r = r.bytes();
        assert!(r[..100].iter().all(|&b| b == 7));
        assert!(r[100..100 + 2 * PAGE_SIZE as usize].iter().all(|&b| b == 0));
        assert!(r[100 + 2 * PAGE_SIZE as usize..].iter().all(|&b| b == 7));
        let ext = block_on(m.extents(0, 4 * PAGE_SIZE)).unwrap();
        assert_eq!(
            ext,
            vec![
                Extent {
                    length: PAGE_SIZE,
                    hole: false,
                    zero: false
                },
                Extent {
                    length: PAGE_SIZE,
                    hole: true,
                    zero: true
                },
                Extent {
                    length: 2 * PAGE_SIZE,
                    hole: false,
                    zero: false
                },
            ]
        );
    }
}
