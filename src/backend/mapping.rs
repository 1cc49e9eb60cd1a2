//! A read-only shared mapping of a page-cache export's file, so that a cached read can
//! leave through the socket with one copy (the kernel's, from the page cache into the
//! socket) instead of two (page cache → buffer → socket).
//!
//! Measured reason: ARCHITECTURE.md, "Cached file reads copied once, from a mapping".
//!
//! The mapped bytes are only ever handed to the kernel (a `writev` into a socket), never
//! read by the server's own code, and only for ranges the page cache holds. That is what
//! makes a mapping safe against what mappings are feared for: should the file shrink under
//! the export (someone else truncating it) or a page be evicted and fail to read back, the
//! kernel's copy of a mapped page that is gone fails that one `writev` with `EFAULT`, and
//! the connection closes; a read by the process itself would have been a `SIGBUS` for the
//! whole server. A test below holds the kernel to it.

#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

/// A file mapped read-only and shared (it sees every write to the file at once), for as
/// long as any part handed out lives.
pub struct Mapping {
    start: NonNull<u8>,
    length: usize,
}

// SAFETY: the mapping is plain memory owned by this value (unmapped only in `drop`, when no
// part holds it any more); nothing in it is tied to a thread.
unsafe impl Send for Mapping {}
// SAFETY: as above; it is never written through, so sharing it among threads is sound.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `length` bytes of `file`, read-only and shared.
    pub fn of(file: &File, length: u64) -> io::Result<Mapping> {
        let length = usize::try_from(length)
            .ok()
            .filter(|&l| l > 0)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "nothing to map"))?;
        // SAFETY: a new mapping at an address the kernel picks, so no existing memory is
        // replaced; the file descriptor is valid for the call (the mapping outlives it
        // independently). What the mapping holds may change as the file does: its bytes are
        // never read by this process's code, only handed to the kernel (see the module).
        let start = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                length,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::SHARED,
                file,
                0,
            )
        }?;
        let start = NonNull::new(start.cast::<u8>()).expect("mmap never maps address 0");
        Ok(Mapping { start, length })
    }

    /// The mapped length.
    pub fn len(&self) -> usize {
        self.length
    }

    pub fn is_empty(&self) -> bool {
        self.length == 0
    }

    /// The `length` bytes at `offset` as a part that holds the mapping; `None` when the
    /// range is not all mapped.
    pub fn part(self: &Arc<Self>, offset: u64, length: usize) -> Option<MappedPart> {
        let start = usize::try_from(offset).ok()?;
        (start.checked_add(length)? <= self.length).then(|| MappedPart {
            mapping: Arc::clone(self),
            start,
            len: length,
        })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `start` and `length` are exactly what `mmap` returned and was given, and
        // no part refers to the mapping any more (each part holds it).
        let _ = unsafe { rustix::mm::munmap(self.start.as_ptr().cast(), self.length) };
    }
}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping")
            .field("length", &self.length)
            .finish()
    }
}

/// `len` bytes of a [`Mapping`] from `start` on, holding the mapping.
#[derive(Debug, Clone)]
pub struct MappedPart {
    mapping: Arc<Mapping>,
    start: usize,
    len: usize,
}

impl MappedPart {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The part's bytes, to hand to the kernel (a socket's `writev`). Reading them here
    /// would be a `SIGBUS` if the file shrank underneath (see the module).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `part` checked that `[start, start + len)` lies within the mapping, which
        // this part keeps mapped for the borrow's length, and the memory is readable
        // (`PROT_READ`). Its contents may change under the borrow (the server's own writes
        // to the file, through a shared mapping), which Rust's rules for a `&[u8]` do not
        // allow; what keeps that harmless is the contract above: the slice only goes to the
        // kernel (`writev`), which reads the memory itself, as for any buffer shared with
        // a device, and no code of the server loads through it (tests compare parts only
        // on files nobody writes meanwhile). A reader sees the range as a concurrent write
        // left it, as `pread` would.
        unsafe { std::slice::from_raw_parts(self.mapping.start.as_ptr().add(self.start), self.len) }
    }

    /// The `length` bytes from `start` on of this part, holding the same mapping.
    pub fn slice(&self, start: usize, length: usize) -> MappedPart {
        MappedPart {
            mapping: Arc::clone(&self.mapping),
            start: super::start_of_slice(self.start, self.len, start, length),
            len: length,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_of(bytes: &[u8]) -> tempfile::NamedTempFile {
        let mut file = tempfile::NamedTempFile::new().unwrap();
        file.write_all(bytes).unwrap();
        file
    }

    #[test]
    fn a_part_is_the_file_s_bytes_and_sees_later_writes() {
        let data: Vec<u8> = (0..3 * 4096u32).map(|i| (i % 251) as u8).collect();
        let file = file_of(&data);
        let mapping = Arc::new(Mapping::of(file.as_file(), data.len() as u64).unwrap());
        assert_eq!(mapping.len(), data.len());
        let part = mapping.part(100, 5000).unwrap();
        assert_eq!(part.bytes(), &data[100..5100]);
        assert_eq!(part.slice(10, 20).bytes(), &data[110..130]);
        // A shared mapping shows what is written to the file afterwards.
        use std::os::unix::fs::FileExt;
        file.as_file().write_all_at(b"new", 200).unwrap();
        assert_eq!(&part.bytes()[100..103], b"new");
        // Outside the mapping there is no part.
        assert!(mapping.part(8000, 5000).is_none());
        assert!(mapping.part(u64::MAX, 1).is_none());
        // A part keeps the mapping alive after the last other holder lets go.
        drop(mapping);
        assert_eq!(part.bytes()[0], data[100]);
    }

    #[test]
    fn an_empty_file_is_not_mapped() {
        let file = file_of(b"");
        assert!(Mapping::of(file.as_file(), 0).is_err());
    }

    /// The property the module rests on: the kernel's copy out of a mapped page that the
    /// file no longer has fails the send with `EFAULT`, where a read in user space would
    /// kill the process with `SIGBUS`.
    #[test]
    fn sending_a_part_the_file_lost_fails_the_send_and_not_the_process() {
        let data = vec![7u8; 4 * 4096];
        let file = file_of(&data);
        let mapping = Arc::new(Mapping::of(file.as_file(), data.len() as u64).unwrap());
        let part = mapping.part(2 * 4096, 2 * 4096).unwrap();
        file.as_file().set_len(4096).unwrap();
        let (mut sender, _receiver) = std::os::unix::net::UnixStream::pair().unwrap();
        let sent = sender.write_vectored(&[io::IoSlice::new(part.bytes())]);
        let error = sent.expect_err("the send must fail");
        assert_eq!(error.raw_os_error(), Some(libc::EFAULT));
        // The part still within the file is sent as it is.
        let head = mapping.part(0, 100).unwrap();
        assert_eq!(
            sender
                .write_vectored(&[io::IoSlice::new(head.bytes())])
                .unwrap(),
            100
        );
    }
}
