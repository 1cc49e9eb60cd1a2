//! Page buffers for the memory export, carved from regions aligned to 2 MiB: pages written
//! whole come from regions the kernel is asked to back with transparent huge pages
//! (`MADV_HUGEPAGE`), pages written in part from regions kept to small pages
//! (`MADV_NOHUGEPAGE`).
//!
//! Measured reason for huge pages: a memory export's random 4 KiB reads each touch a random
//! page, which with small pages means an address translation the CPU has most likely not
//! cached (on a VM, a two-level page walk) where the socket copies the page. This machine's
//! THP setting is `madvise`, so pages from the ordinary heap never got huge pages
//! (`AnonHugePages` 0 kB, even with THP set to `always`: the heap grows a little at a time).
//! With the pages in advised 2 MiB regions (scratch build, fio 4 KiB random reads at QD32 on
//! a prefilled 512 MiB export, three alternations): 217.0–224.3k IOPS at 3.30–3.36 µs of
//! server CPU per read, against 188.5–194.1k at 4.10–4.24 µs. (The VM has no PMU to count
//! the TLB misses themselves.) Session 77, another VM: 260.8k at 2.61 µs against 244.1k at
//! 2.79 µs with small pages throughout.
//!
//! Measured reason for small pages where a page is written in part: the first touch of a
//! huge page makes the kernel zero all 2 MiB of it, 64 KiB for every page carved from it,
//! where a 4 KiB write into a small-page region touches 4 KiB. On a VM whose free memory
//! goes back to the host (virtio_balloon's free page reporting) that memory is cold, and
//! touching it is slow: 534–547 MB/s with huge pages, 757–811 MB/s with small ones
//! (session 77, 6 GiB by hand; 3.4 GB/s for the small pages the kernel still had warm). 4 KiB
//! random writes at QD32 into a fresh `memory:4G` export: 8.8k and 8.9k IOPS with every
//! region huge, 65.2k and 153.9k with pages for partial writes small (nbdkit: 49.0k and
//! 113.4k). Pages written whole keep huge pages, at a cost when the memory is cold: copying
//! 1 GiB into a fresh export took 1.51–1.63 s and 2.3–2.6 s of server CPU, against
//! 0.47–1.09 s and 0.5–1.6 s with small pages throughout (nbdkit 0.61–1.37 s). Collapsing
//! small pages into huge ones later (`MADV_COLLAPSE`) cost as much as faulting them
//! (433–514 MB/s), so it would only move that cost, not save it.
//!
//! Regions are never unmapped: a page that is dropped goes back to the pool for the next
//! page of either use (zeroed again when taken as a page of zeroes). A page released by
//! TRIM gives its memory back to the kernel instead ([`PageBuf::give_back`]). So an export
//! filled by partial writes keeps small pages (review, session 77: about 7% more CPU per
//! random read than one filled whole), and after churn a page's kind is whichever slice
//! came back last.

#![allow(unsafe_code)]

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::Mutex;

/// Bytes per page buffer.
pub const PAGE_BYTES: usize = 64 * 1024;
/// Alignment of the regions the pool maps: one huge page.
const HUGE_PAGE_BYTES: usize = 2 * 1024 * 1024;
/// Bytes per region the pool maps at once. Each region is a mapping of its own, and the
/// kernel limits how many a process has (`vm.max_map_count`, 65,530 by default): at 64 MiB
/// a region that allows about 4 TiB of pages, at 2 MiB only 128 GiB. Untouched parts of a
/// region cost address space, not memory.
const REGION_BYTES: usize = 32 * HUGE_PAGE_BYTES;

/// A [`PAGE_BYTES`] buffer from the pool, owned like a `Box<[u8]>`; back to the pool on drop.
pub struct PageBuf {
    start: NonNull<u8>,
}

// SAFETY: a `PageBuf` is the only handle to its bytes: the pool hands each slice to one
// `PageBuf` at a time and takes it back only from that buffer's drop or `give_back`, and the
// region under it is never unmapped. So it may move between threads and be shared by
// reference, as a `Box<[u8]>` may.
unsafe impl Send for PageBuf {}
// SAFETY: as for `Send`: shared access is only through `&[u8]`.
unsafe impl Sync for PageBuf {}

/// How a page taken from the pool will be written, which decides the kind of memory a
/// fresh page comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Use {
    /// Every byte is written at once: a region backed by huge pages.
    Whole,
    /// Starts as zeroes and is written in part: a region of small pages.
    Part,
}

/// Free slices and the rest of the newest region of each kind.
struct Pool {
    /// Addresses of returned slices, and whether each is known to hold zeroes.
    free: Vec<(usize, bool)>,
    /// The untouched rest of the newest huge-page region (fresh anonymous memory reads as
    /// zeroes), for pages written whole.
    fresh_whole: std::ops::Range<usize>,
    /// The untouched rest of the newest small-page region, for pages written in part.
    fresh_part: std::ops::Range<usize>,
}

static POOL: Mutex<Pool> = Mutex::new(Pool {
    free: Vec::new(),
    fresh_whole: 0..0,
    fresh_part: 0..0,
});

impl PageBuf {
    /// A page of zeroes.
    pub fn zeroed() -> PageBuf {
        let (mut page, zeroed) = PageBuf::take(Use::Part);
        if !zeroed {
            page.fill(0);
        }
        page
    }

    /// A page whose bytes are unspecified (old data of an earlier page, or zeroes): for a
    /// receiver that overwrites every byte.
    pub fn any() -> PageBuf {
        PageBuf::take(Use::Whole).0
    }

    /// A page holding `data` (which must be [`PAGE_BYTES`] long).
    pub fn copy_of(data: &[u8]) -> PageBuf {
        let mut page = PageBuf::any();
        page.copy_from_slice(data);
        page
    }

    /// Returns the page's memory to the kernel and the slice to the pool (where it reads
    /// as zeroes again). For pages that TRIM releases; a dropped page keeps its memory.
    pub fn give_back(self) {
        let start = self.start.as_ptr();
        // SAFETY: the range is this buffer's own slice inside a mapping the pool never
        // unmaps, and nothing else refers to it (we own `self`); after `MADV_DONTNEED` a
        // private anonymous range reads as zeroes, which is all the pool assumes of it.
        let advised = unsafe { libc::madvise(start.cast(), PAGE_BYTES, libc::MADV_DONTNEED) };
        let address = start as usize;
        std::mem::forget(self);
        lock().free.push((address, advised == 0));
    }

    fn take(use_: Use) -> (PageBuf, bool) {
        let mut pool = lock();
        let (address, zeroed) = match pool.free.pop() {
            Some(free) => free,
            None => {
                let fresh = match use_ {
                    Use::Whole => &mut pool.fresh_whole,
                    Use::Part => &mut pool.fresh_part,
                };
                if fresh.start == fresh.end {
                    *fresh = map_region(use_);
                }
                let address = fresh.start;
                fresh.start += PAGE_BYTES;
                (address, true)
            }
        };
        let start = NonNull::new(address as *mut u8).expect("pool addresses are not null");
        (PageBuf { start }, zeroed)
    }
}

impl Deref for PageBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: `start` points at PAGE_BYTES bytes of a live mapping (never unmapped)
        // that only this buffer refers to; anonymous memory is always initialized.
        unsafe { std::slice::from_raw_parts(self.start.as_ptr(), PAGE_BYTES) }
    }
}

impl DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.start.as_ptr(), PAGE_BYTES) }
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        let address = self.start.as_ptr() as usize;
        lock().free.push((address, false));
    }
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageBuf")
            .field("start", &self.start)
            .finish()
    }
}

fn lock() -> std::sync::MutexGuard<'static, Pool> {
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Maps a new region of [`REGION_BYTES`], aligned to a huge page, and asks for huge pages
/// there for pages written whole, small pages for pages written in part; returns its
/// address range. Aborts like the global allocator when memory is out.
fn map_region(use_: Use) -> std::ops::Range<usize> {
    // A huge page more than the region, so that an aligned region fits whatever address
    // comes back.
    let mapped = REGION_BYTES + HUGE_PAGE_BYTES;
    // SAFETY: a new private anonymous mapping at an address of the kernel's choosing
    // touches no existing memory.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            mapped,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        let layout = std::alloc::Layout::from_size_align(REGION_BYTES, HUGE_PAGE_BYTES)
            .expect("a valid layout");
        std::alloc::handle_alloc_error(layout);
    }
    let raw = raw as usize;
    let start = (raw + HUGE_PAGE_BYTES - 1) & !(HUGE_PAGE_BYTES - 1);
    // SAFETY: both ranges lie inside the mapping just made and outside the region kept;
    // nothing refers to them.
    unsafe {
        if start > raw {
            libc::munmap(raw as *mut libc::c_void, start - raw);
        }
        let end = start + REGION_BYTES;
        if raw + mapped > end {
            libc::munmap(end as *mut libc::c_void, raw + mapped - end);
        }
    }
    let advice = match use_ {
        Use::Whole => libc::MADV_HUGEPAGE,
        Use::Part => libc::MADV_NOHUGEPAGE,
    };
    // SAFETY: advice about the region just mapped, which nothing touched yet; if the kernel
    // refuses it, the region still works, with the pages the system's setting gives.
    unsafe { libc::madvise(start as *mut libc::c_void, REGION_BYTES, advice) };
    start..start + REGION_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_start_zeroed_hold_what_is_written_and_come_back_zeroed() {
        let mut pages: Vec<PageBuf> = (0..40).map(|_| PageBuf::zeroed()).collect();
        for (i, page) in pages.iter_mut().enumerate() {
            assert_eq!(page.len(), PAGE_BYTES);
            assert!(page.iter().all(|&b| b == 0), "a new page holds zeroes");
            page.fill(i as u8 + 1);
        }
        for (i, page) in pages.iter().enumerate() {
            assert!(
                page.iter().all(|&b| b == i as u8 + 1),
                "page {i} was overwritten"
            );
        }
        drop(pages);
        // Taken again from what was dropped, still zeroes.
        let again: Vec<PageBuf> = (0..40).map(|_| PageBuf::zeroed()).collect();
        assert!(again.iter().all(|page| page.iter().all(|&b| b == 0)));
    }

    #[test]
    fn copies_hold_their_data_and_pages_given_back_read_as_zeroes() {
        let data: Vec<u8> = (0..PAGE_BYTES).map(|i| (i % 251) as u8).collect();
        let copy = PageBuf::copy_of(&data);
        assert_eq!(&copy[..], &data[..]);
        copy.give_back();
        let pages: Vec<PageBuf> = (0..8).map(|_| PageBuf::zeroed()).collect();
        assert!(pages.iter().all(|page| page.iter().all(|&b| b == 0)));
    }

    #[test]
    fn pages_taken_on_many_threads_never_overlap() {
        let threads: Vec<_> = (0..8u8)
            .map(|t| {
                std::thread::spawn(move || {
                    let mut held = Vec::new();
                    for round in 0..200usize {
                        let mut page = PageBuf::any();
                        page.fill(t);
                        held.push(page);
                        if round % 3 == 0 {
                            held.swap_remove(round % held.len());
                        }
                        if round % 7 == 0 {
                            if let Some(page) = held.pop() {
                                page.give_back();
                            }
                        }
                    }
                    for page in &held {
                        assert!(page.iter().all(|&b| b == t), "another thread wrote here");
                    }
                    held.len()
                })
            })
            .collect();
        for thread in threads {
            assert!(thread.join().unwrap() > 0);
        }
    }

    /// The `VmFlags` line of `/proc/self/smaps` for the mapping that holds `address`.
    fn vm_flags_of(address: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps is readable");
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((start, end)) = range.split_once('-') {
                if let (Ok(start), Ok(end)) = (
                    usize::from_str_radix(start, 16),
                    usize::from_str_radix(end, 16),
                ) {
                    inside = (start..end).contains(&address);
                    continue;
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return flags.to_string();
                }
            }
        }
        panic!("no mapping with a VmFlags line holds {address:#x}");
    }

    #[test]
    fn regions_are_aligned_and_ask_for_huge_pages_only_for_pages_written_whole() {
        // `hg` is MADV_HUGEPAGE, `nh` MADV_NOHUGEPAGE: what was asked, whatever the
        // system's setting gives.
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists() {
            eprintln!("skipped: this kernel has no transparent huge pages to advise");
            return;
        }
        for (use_, flag) in [(Use::Whole, "hg"), (Use::Part, "nh")] {
            let region = map_region(use_);
            assert_eq!(region.start % HUGE_PAGE_BYTES, 0);
            assert_eq!(region.len(), REGION_BYTES);
            for address in [region.start, region.end - 1] {
                let flags = vm_flags_of(address);
                assert!(
                    flags.split_whitespace().any(|f| f == flag),
                    "a region for {use_:?} pages has flags {flags}"
                );
            }
            // Give it to the pool, so that the test leaks nothing the pool cannot reuse.
            let mut pool = lock();
            for address in region.step_by(PAGE_BYTES) {
                pool.free.push((address, true));
            }
        }
    }
}
