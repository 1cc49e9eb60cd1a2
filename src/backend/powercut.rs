//! A fault-injection layer that behaves like a disk with a volatile write cache, so tests
//! can cut the power and check what survives.
//!
//! Writes, trims and zeroes without FUA are held in a volatile set and answered at once;
//! reads see them. FLUSH writes the whole set to the layer below, in order, and syncs it.
//! A FUA write goes to the layer below durably at once, and older cached writes to the same
//! bytes are dropped from the set (a cache holds the newest data for a sector).
//! [`PowerCut::cut`] freezes the layer (every later request fails with EIO) and writes an
//! arbitrary subset of the volatile set, in an arbitrary order chosen by a seed, to the
//! layer below: what a disk may have written back before it lost power.
//!
//! Used by the crash tests in-process, and by `netblk serve --fault-injection powercut`,
//! where SIGKILL drops the whole volatile set.

use std::sync::Arc;

use bytes::BytesMut;
use tokio::sync::Mutex;

use super::{
    backend_future, Backend, BackendError, BackendFuture, Capabilities, Extent, ReadData,
    WriteData, ZeroFlags,
};
use crate::wire::NbdError;

/// One cached change: data, or zeroes when `data` is `None`.
#[derive(Debug, Clone)]
struct Cached {
    offset: u64,
    length: u64,
    data: Option<WriteData>,
}

impl Cached {
    fn end(&self) -> u64 {
        self.offset + self.length
    }

    /// What is left of this change outside `[start, end)`: zero, one or two pieces.
    fn without(&self, start: u64, end: u64) -> Vec<Cached> {
        if end <= self.offset || start >= self.end() {
            return vec![self.clone()];
        }
        let mut left = Vec::new();
        for (from, to) in [(self.offset, start), (end, self.end())] {
            let (from, to) = (from.max(self.offset), to.min(self.end()));
            if from < to {
                let skip = (from - self.offset) as usize;
                left.push(Cached {
                    offset: from,
                    length: to - from,
                    data: self
                        .data
                        .as_ref()
                        .map(|d| d.slice(skip, (to - from) as usize)),
                });
            }
        }
        left
    }
}

#[derive(Default)]
struct State {
    cache: Vec<Cached>,
    cut: bool,
}

/// A volatile write cache over another backend.
pub struct PowerCut {
    inner: Arc<dyn Backend>,
    state: Mutex<State>,
}

/// A small deterministic generator (splitmix64), so a failing seed can be replayed.
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

impl PowerCut {
    pub fn new(inner: Arc<dyn Backend>) -> PowerCut {
        PowerCut {
            inner,
            state: Mutex::new(State::default()),
        }
    }

    /// Bytes written but not yet flushed.
    pub async fn volatile_bytes(&self) -> u64 {
        self.state.lock().await.cache.iter().map(|c| c.length).sum()
    }

    /// Cuts the power: from now on every request fails; of the cached changes, a subset
    /// chosen by `seed` is written below in an order chosen by `seed`, and synced. Returns
    /// how many cached changes there were and how many were written.
    pub async fn cut(&self, seed: u64) -> Result<(usize, usize), BackendError> {
        let mut state = self.state.lock().await;
        state.cut = true;
        let mut cached = std::mem::take(&mut state.cache);
        let total = cached.len();
        let mut dice = Dice(seed);
        // Fisher–Yates, then keep each with probability one half.
        for i in (1..cached.len()).rev() {
            let j = (dice.next() % (i as u64 + 1)) as usize;
            cached.swap(i, j);
        }
        let survivors: Vec<Cached> = cached
            .into_iter()
            .filter(|_| dice.next() & 1 == 1)
            .collect();
        let written = survivors.len();
        for change in survivors {
            self.apply(change).await?;
        }
        self.inner.flush().await?;
        Ok((total, written))
    }

    async fn apply(&self, change: Cached) -> Result<(), BackendError> {
        match change.data {
            Some(data) => self.inner.write(change.offset, data, false).await,
            None => {
                let flags = ZeroFlags {
                    may_trim: true,
                    fast: false,
                    fua: false,
                };
                self.inner
                    .write_zeroes(change.offset, change.length, flags)
                    .await
            }
        }
    }

    fn powered_off(op: &'static str, offset: u64, length: u64) -> BackendError {
        BackendError::plain(op, offset, length, NbdError::Io)
    }

    /// Caches a change, or (FUA) writes it through and drops what it supersedes.
    async fn change(
        &self,
        op: &'static str,
        change: Cached,
        fua: bool,
    ) -> Result<(), BackendError> {
        let mut state = self.state.lock().await;
        if state.cut {
            return Err(Self::powered_off(op, change.offset, change.length));
        }
        if !fua {
            state.cache.push(change);
            return Ok(());
        }
        let (start, end) = (change.offset, change.end());
        let written = match change.data {
            Some(data) => self.inner.write(start, data, true).await,
            None => {
                let flags = ZeroFlags {
                    may_trim: true,
                    fast: false,
                    fua: true,
                };
                self.inner.write_zeroes(start, end - start, flags).await
            }
        };
        // Only a write that went through supersedes the older cached ones: had they gone
        // first, a failed one would leave the range older than writes that completed.
        if written.is_ok() {
            state.cache = std::mem::take(&mut state.cache)
                .into_iter()
                .flat_map(|c| c.without(start, end))
                .collect();
        }
        written
    }
}

impl Backend for PowerCut {
    fn size(&self) -> u64 {
        self.inner.size()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            flush: true,
            fua: true,
            fast_zero: false,
            ..self.inner.capabilities()
        }
    }

    fn read(&self, offset: u64, length: usize) -> BackendFuture<'_, ReadData> {
        backend_future(async move {
            let state = self.state.lock().await;
            if state.cut {
                return Err(Self::powered_off("read", offset, length as u64));
            }
            let below = self.inner.read(offset, length).await?;
            let end = offset + length as u64;
            let covering: Vec<&Cached> = state
                .cache
                .iter()
                .filter(|c| c.offset < end && offset < c.end())
                .collect();
            if covering.is_empty() {
                return Ok(below);
            }
            let mut data = BytesMut::from(&below.bytes()[..]);
            for change in covering {
                let from = change.offset.max(offset);
                let to = change.end().min(end);
                let target = &mut data[(from - offset) as usize..(to - offset) as usize];
                match &change.data {
                    Some(bytes) => {
                        let skip = (from - change.offset) as usize;
                        target.copy_from_slice(&bytes[skip..skip + target.len()]);
                    }
                    None => target.fill(0),
                }
            }
            Ok(ReadData::dense(data.freeze()))
        })
    }

    fn write(&self, offset: u64, data: WriteData, fua: bool) -> BackendFuture<'_, ()> {
        let change = Cached {
            offset,
            length: data.len() as u64,
            data: Some(data),
        };
        backend_future(self.change("write", change, fua))
    }

    fn flush(&self) -> BackendFuture<'_, ()> {
        backend_future(async move {
            let mut state = self.state.lock().await;
            if state.cut {
                return Err(Self::powered_off("flush", 0, 0));
            }
            // Each change leaves the cache once applied: after a failure, it and the ones
            // after it stay (reads go on seeing them, the next FLUSH tries them again),
            // where taking them all first lost them.
            let mut applied = 0;
            let mut failed = None;
            for change in state.cache.clone() {
                if let Err(e) = self.apply(change).await {
                    failed = Some(e);
                    break;
                }
                applied += 1;
            }
            state.cache.drain(..applied);
            match failed {
                Some(e) => Err(e),
                None => self.inner.flush().await,
            }
        })
    }

    fn trim(&self, offset: u64, length: u64, fua: bool) -> BackendFuture<'_, ()> {
        // A trimmed range may read as zeroes afterwards: the cache zeroes it.
        let change = Cached {
            offset,
            length,
            data: None,
        };
        backend_future(self.change("trim", change, fua))
    }

    fn write_zeroes(&self, offset: u64, length: u64, flags: ZeroFlags) -> BackendFuture<'_, ()> {
        let change = Cached {
            offset,
            length,
            data: None,
        };
        backend_future(self.change("write zeroes", change, flags.fua))
    }

    fn cache(&self, offset: u64, length: u64) -> BackendFuture<'_, ()> {
        self.inner.cache(offset, length)
    }

    fn extents(&self, offset: u64, length: u64) -> BackendFuture<'_, Vec<Extent>> {
        backend_future(async move {
            let state = self.state.lock().await;
            let end = offset + length;
            if state
                .cache
                .iter()
                .any(|c| c.offset < end && offset < c.end())
            {
                // Cached changes are not visible below: call the range allocated data.
                return Ok(vec![Extent {
                    length,
                    hole: false,
                    zero: false,
                }]);
            }
            self.inner.extents(offset, length).await
        })
    }

    /// A flush empties the cache, so a flush with nothing written since costs what one
    /// costs the layer below. Forwarded so that the crash tests see flushes ahead.
    fn flush_ahead_pays(&self) -> bool {
        self.inner.flush_ahead_pays()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::memory::MemoryBackend;
    use bytes::Bytes;

    fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }

    fn layer() -> (Arc<MemoryBackend>, PowerCut) {
        let media = Arc::new(MemoryBackend::new(1 << 20, false));
        let layer = PowerCut::new(Arc::clone(&media) as Arc<dyn Backend>);
        (media, layer)
    }

    async fn media_byte(media: &MemoryBackend, at: u64) -> u8 {
        media.read(at, 1).await.unwrap().bytes()[0]
    }

    /// Media whose writes at offset 0 fail while `failing` is set.
    struct FailingAtZero {
        inner: MemoryBackend,
        failing: std::sync::atomic::AtomicBool,
    }

    impl Backend for FailingAtZero {
        crate::backend::pass_to_inner!(
            size,
            capabilities,
            read,
            flush,
            trim,
            write_zeroes,
            cache,
            extents
        );
        fn write(&self, offset: u64, data: WriteData, fua: bool) -> BackendFuture<'_, ()> {
            if offset == 0 && self.failing.load(std::sync::atomic::Ordering::Acquire) {
                let length = data.len() as u64;
                return backend_future(async move {
                    Err(BackendError::plain("write", 0, length, NbdError::Io))
                });
            }
            self.inner.write(offset, data, fua)
        }
    }

    /// A FLUSH that fails part-way keeps the writes it did not get down: they still read
    /// back, and the next FLUSH (the media working again) puts them on the media. A FUA
    /// write that fails keeps the older cached writes it would have superseded.
    #[test]
    fn a_failed_flush_or_fua_write_loses_no_completed_write() {
        block_on(async {
            let media = Arc::new(FailingAtZero {
                inner: MemoryBackend::new(1 << 20, false),
                failing: std::sync::atomic::AtomicBool::new(true),
            });
            let layer = PowerCut::new(Arc::clone(&media) as Arc<dyn Backend>);
            let block = |byte: u8| Bytes::from(vec![byte; 4096]);
            layer.write(0, block(1).into(), false).await.unwrap();
            layer.write(4096, block(2).into(), false).await.unwrap();
            assert!(layer.flush().await.is_err());
            assert_eq!(layer.read(4096, 4096).await.unwrap().bytes(), block(2));
            assert_eq!(layer.read(0, 4096).await.unwrap().bytes(), block(1));
            // A FUA write over the first block fails: the cached one still reads.
            assert!(layer.write(0, block(3).into(), true).await.is_err());
            assert_eq!(layer.read(0, 4096).await.unwrap().bytes(), block(1));
            media
                .failing
                .store(false, std::sync::atomic::Ordering::Release);
            layer.flush().await.unwrap();
            assert_eq!(media.inner.read(0, 4096).await.unwrap().bytes(), block(1));
            assert_eq!(
                media.inner.read(4096, 4096).await.unwrap().bytes(),
                block(2)
            );
        });
    }

    /// Over a file the layer flushes ahead as the file does, so that the crash tests'
    /// committing connection sees flushes ahead (`server::flush_ahead`); over memory not.
    #[test]
    fn flushes_ahead_when_the_layer_below_does() {
        let (_, over_memory) = layer();
        assert!(!over_memory.flush_ahead_pays());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk");
        std::fs::write(&path, vec![0u8; 1 << 20]).unwrap();
        let file = crate::backend::file::FileBackend::open(&path, None, false, None).unwrap();
        assert!(PowerCut::new(Arc::new(file)).flush_ahead_pays());
    }

    #[test]
    fn unflushed_writes_are_readable_but_not_on_the_media_until_a_flush() {
        block_on(async {
            let (media, layer) = layer();
            layer
                .write(0, Bytes::from(vec![1u8; 4096]).into(), false)
                .await
                .unwrap();
            assert_eq!(
                layer.read(0, 4096).await.unwrap().bytes()[..],
                [1u8; 4096][..]
            );
            assert_eq!(
                media_byte(&media, 0).await,
                0,
                "a cached write reached the media"
            );
            layer.flush().await.unwrap();
            assert_eq!(media_byte(&media, 0).await, 1);
            assert_eq!(layer.volatile_bytes().await, 0);
        });
    }

    #[test]
    fn a_cut_drops_or_keeps_each_cached_write_and_keeps_everything_flushed_or_fua() {
        let mut dropped_some = false;
        let mut kept_some = false;
        for seed in 0..20 {
            block_on(async {
                let (media, layer) = layer();
                layer
                    .write(0, Bytes::from(vec![9u8; 512]).into(), false)
                    .await
                    .unwrap();
                layer.flush().await.unwrap();
                layer
                    .write(4096, Bytes::from(vec![7u8; 512]).into(), true)
                    .await
                    .unwrap();
                for i in 0..8u64 {
                    let data = Bytes::from(vec![i as u8 + 10; 512]);
                    layer
                        .write(8192 + i * 512, data.into(), false)
                        .await
                        .unwrap();
                }
                let (total, written) = layer.cut(seed).await.unwrap();
                assert_eq!(total, 8);
                dropped_some |= written < total;
                kept_some |= written > 0;
                assert_eq!(media_byte(&media, 0).await, 9, "a flushed write was lost");
                assert_eq!(media_byte(&media, 4096).await, 7, "a FUA write was lost");
                for i in 0..8u64 {
                    let byte = media_byte(&media, 8192 + i * 512).await;
                    assert!(
                        byte == 0 || byte == i as u8 + 10,
                        "neither old nor new: {byte}"
                    );
                }
                assert!(
                    layer.read(0, 1).await.is_err(),
                    "the layer is off after a cut"
                );
                assert!(layer
                    .write(0, Bytes::from_static(b"x").into(), true)
                    .await
                    .is_err());
            });
        }
        assert!(
            dropped_some && kept_some,
            "cuts must both drop and keep cached writes"
        );
    }

    #[test]
    fn a_fua_write_supersedes_older_cached_writes_to_the_same_bytes() {
        for seed in 0..10 {
            block_on(async {
                let (media, layer) = layer();
                layer
                    .write(0, Bytes::from(vec![1u8; 4096]).into(), false)
                    .await
                    .unwrap();
                layer
                    .write(1024, Bytes::from(vec![2u8; 1024]).into(), true)
                    .await
                    .unwrap();
                layer.cut(seed).await.unwrap();
                let data = media.read(0, 4096).await.unwrap().bytes();
                // The FUA bytes always survive; the rest of the older write may or may not.
                assert!(data[1024..2048].iter().all(|&b| b == 2), "seed {seed}");
                assert!(data[..1024].iter().all(|&b| b == data[0]));
                assert!(data[0] == 0 || data[0] == 1);
            });
        }
    }

    #[test]
    fn cached_zeroes_and_trims_read_as_zeroes() {
        block_on(async {
            let (_media, layer) = layer();
            layer
                .write(0, Bytes::from(vec![5u8; 8192]).into(), true)
                .await
                .unwrap();
            layer.trim(0, 100, false).await.unwrap();
            let flags = ZeroFlags {
                may_trim: false,
                fast: false,
                fua: false,
            };
            layer.write_zeroes(4000, 200, flags).await.unwrap();
            let data = layer.read(0, 8192).await.unwrap().bytes();
            assert!(data[..100].iter().all(|&b| b == 0));
            assert!(data[100..4000].iter().all(|&b| b == 5));
            assert!(data[4000..4200].iter().all(|&b| b == 0));
            assert!(data[4200..].iter().all(|&b| b == 5));
        });
    }
}
