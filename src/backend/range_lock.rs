//! Byte-range locks that keep a read-modify-write of a partial direct-I/O block from
//! racing with other writes to the same block.
//!
//! Writes, trims and zeroes take their block-aligned range *shared*: they may overlap each
//! other (NBD leaves the order of concurrent overlapping writes to the server, and the
//! kernel keeps each one whole). A read-modify-write takes its range *exclusive*, because
//! it rewrites bytes of the block that the client did not send, and a write to those bytes
//! that slipped in between its read and its write would be lost.

use std::sync::Mutex;

use tokio::sync::Notify;

#[derive(Debug, Clone, Copy)]
struct Held {
    id: u64,
    start: u64,
    end: u64,
    exclusive: bool,
}

impl Held {
    fn conflicts(&self, start: u64, end: u64, exclusive: bool) -> bool {
        self.start < end && start < self.end && (self.exclusive || exclusive)
    }
}

/// The ranges currently held.
#[derive(Default)]
pub struct RangeLocks {
    held: Mutex<(u64, Vec<Held>)>,
    released: Notify,
}

/// A held range, released when dropped.
pub struct RangeGuard<'a> {
    locks: &'a RangeLocks,
    id: u64,
}

impl RangeLocks {
    /// Waits until `[start, end)` can be held in the given mode, then holds it.
    pub async fn lock(&self, start: u64, end: u64, exclusive: bool) -> RangeGuard<'_> {
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            // Register for the wake-up before looking, so a release in between is not missed.
            released.as_mut().enable();
            {
                let mut guard = self.held.lock().unwrap_or_else(|e| e.into_inner());
                let (next_id, held) = &mut *guard;
                if !held.iter().any(|h| h.conflicts(start, end, exclusive)) {
                    *next_id += 1;
                    let id = *next_id;
                    held.push(Held {
                        id,
                        start,
                        end,
                        exclusive,
                    });
                    return RangeGuard { locks: self, id };
                }
            }
            released.await;
        }
    }

    #[cfg(test)]
    fn held_count(&self) -> usize {
        self.held.lock().unwrap().1.len()
    }
}

impl Drop for RangeGuard<'_> {
    fn drop(&mut self) {
        let mut guard = self.locks.held.lock().unwrap_or_else(|e| e.into_inner());
        guard.1.retain(|h| h.id != self.id);
        drop(guard);
        self.locks.released.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn shared_ranges_overlap_and_exclusive_ones_wait() {
        crate::test_runtime().block_on(async {
            let locks = Arc::new(RangeLocks::default());
            let a = locks.lock(0, 4096, false).await;
            let b = locks.lock(0, 8192, false).await;
            assert_eq!(locks.held_count(), 2);
            // An exclusive lock over part of them must wait for both.
            let waiter = {
                let locks = Arc::clone(&locks);
                tokio::spawn(async move {
                    let _g = locks.lock(4096, 8192, true).await;
                })
            };
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!waiter.is_finished());
            drop(a);
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!waiter.is_finished(), "b still overlaps");
            drop(b);
            tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("the exclusive lock is granted once the range is free")
                .unwrap();
            // A disjoint exclusive range never waits.
            let _c = locks.lock(0, 4096, true).await;
            let _d = locks.lock(4096, 8192, true).await;
            assert_eq!(locks.held_count(), 2);
        });
    }

    #[test]
    fn exclusive_holders_of_one_block_take_turns() {
        crate::test_runtime().block_on(async {
            let locks = Arc::new(RangeLocks::default());
            let inside = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let tasks: Vec<_> = (0..50)
                .map(|_| {
                    let locks = Arc::clone(&locks);
                    let inside = Arc::clone(&inside);
                    tokio::spawn(async move {
                        let _g = locks.lock(100, 200, true).await;
                        let now = inside.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        assert_eq!(now, 0, "two exclusive holders at once");
                        tokio::task::yield_now().await;
                        inside.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    })
                })
                .collect();
            for task in tasks {
                task.await.unwrap();
            }
            assert_eq!(locks.held_count(), 0);
        });
    }
}
