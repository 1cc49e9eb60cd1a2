//! Keeps changes to a page-cache export landing in the order the server received them
//! while some writes are copied beside the connections' threads
//! ([`FileBackend::write_beside`](super::file::FileBackend)).
//!
//! A write copied beside is registered when it is received and stays registered until its
//! copy ends (or until it is dropped before the copy began). A change received later that
//! overlaps it waits for that copy before it begins: a later write beside before it is
//! handed to its thread, and a write, trim or zeroing on the connection's own path before
//! it touches the file. So of two overlapping changes, the one received first lands first,
//! on whichever path each goes, as when every copy was made on the connection's thread.
//!
//! Why it matters (review, session 75): a client that sent writes and went away left them
//! queued on the export's writer thread, and another connection's later write over the
//! same bytes, made at once on its own thread and acknowledged, was then overwritten by
//! the gone client's copy: 5 of 40 trials. NBD leaves the order of overlapping requests
//! that are in flight together to the server, but a client taking over a device expects
//! what it wrote after the other client was gone to stay.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// A copy still queued or in progress: its order of arrival and its byte range.
#[derive(Debug, Clone, Copy)]
struct Queued {
    id: u64,
    start: u64,
    end: u64,
}

/// The copies of one export that are queued or in progress beside.
#[derive(Default)]
pub struct QueuedCopies {
    /// The next id to give, and the copies registered (in order of arrival).
    state: Mutex<(u64, Vec<Queued>)>,
    /// How many copies are registered: lets a change that overlaps none skip the lock.
    count: AtomicUsize,
    /// Woken whenever a copy ends.
    ended: Notify,
}

/// A registered copy, removed from the register when dropped.
pub struct Registered {
    copies: Arc<QueuedCopies>,
    id: u64,
    start: u64,
    end: u64,
}

impl QueuedCopies {
    /// Registers a copy of `[start, end)` received now; never waits.
    pub fn register(self: &Arc<Self>, start: u64, end: u64) -> Registered {
        let mut state = self.lock();
        let id = state.0;
        state.0 += 1;
        state.1.push(Queued { id, start, end });
        self.count.fetch_add(1, Ordering::AcqRel);
        Registered {
            copies: Arc::clone(self),
            id,
            start,
            end,
        }
    }

    /// Whether a registered copy received before `before` (any, with `u64::MAX`)
    /// overlaps `[start, end)`.
    fn overlaps(&self, start: u64, end: u64, before: u64) -> bool {
        if self.count.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.lock()
            .1
            .iter()
            .any(|q| q.id < before && q.start < end && start < q.end)
    }

    /// Whether a registered copy overlaps `[start, end)`: a change to that range must
    /// then wait ([`QueuedCopies::wait_for`]) rather than be made at once.
    pub fn any_over(&self, start: u64, end: u64) -> bool {
        self.overlaps(start, end, u64::MAX)
    }

    /// Waits until no copy registered so far overlaps `[start, end)`: for a change that
    /// is not itself a registered copy.
    pub async fn wait_for(&self, start: u64, end: u64) {
        self.wait_for_earlier(start, end, u64::MAX).await;
    }

    /// Waits until no copy registered before `before` overlaps `[start, end)`.
    async fn wait_for_earlier(&self, start: u64, end: u64, before: u64) {
        // Most changes meet no copy: they look without a wake-up to wait for.
        if !self.overlaps(start, end, before) {
            return;
        }
        loop {
            let ended = self.ended.notified();
            tokio::pin!(ended);
            // Registered for the wake-up before looking, so an end in between is not missed.
            ended.as_mut().enable();
            if !self.overlaps(start, end, before) {
                return;
            }
            ended.await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, Vec<Queued>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    pub(crate) fn registered(&self) -> usize {
        self.lock().1.len()
    }
}

impl Registered {
    /// Waits until every overlapping copy received before this one has ended.
    pub async fn wait_for_earlier(&self) {
        self.copies
            .wait_for_earlier(self.start, self.end, self.id)
            .await;
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut state = self.copies.lock();
        if let Some(at) = state.1.iter().position(|q| q.id == self.id) {
            state.1.remove(at);
        }
        self.copies.count.fetch_sub(1, Ordering::AcqRel);
        drop(state);
        self.copies.ended.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Polls `future` once: whether it is ready at once.
    fn ready_at_once(future: impl std::future::Future<Output = ()>) -> bool {
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        std::pin::pin!(future).poll(&mut cx).is_ready()
    }

    #[test]
    fn a_change_waits_only_for_overlapping_copies_received_before_it() {
        let copies = Arc::new(QueuedCopies::default());
        assert!(!copies.any_over(0, u64::MAX), "nothing registered");
        let first = copies.register(0, 4096);
        let second = copies.register(8192, 12288);
        assert!(copies.any_over(4095, 4096));
        assert!(!copies.any_over(4096, 8192), "the gap between them");
        assert!(copies.any_over(0, 1 << 20));
        // A later copy over the first waits for it; one over neither does not.
        let third = copies.register(2048, 6144);
        let fourth = copies.register(6144, 8192);
        assert!(!ready_at_once(third.wait_for_earlier()));
        assert!(ready_at_once(fourth.wait_for_earlier()));
        // The first does not wait for the later third that overlaps it.
        assert!(ready_at_once(first.wait_for_earlier()));
        assert!(!ready_at_once(copies.wait_for(0, 1)));
        drop(first);
        assert!(ready_at_once(third.wait_for_earlier()));
        assert!(
            !ready_at_once(copies.wait_for(0, 4096)),
            "the third still holds 2048.."
        );
        drop((second, third, fourth));
        assert_eq!(copies.registered(), 0);
        assert!(!copies.any_over(0, u64::MAX));
        assert!(ready_at_once(copies.wait_for(0, u64::MAX)));
    }

    #[test]
    fn a_waiting_change_goes_on_when_the_copy_ends() {
        crate::test_runtime().block_on(async {
            let copies = Arc::new(QueuedCopies::default());
            let copy = copies.register(0, 1 << 20);
            let waiter = {
                let copies = Arc::clone(&copies);
                tokio::spawn(async move { copies.wait_for(4096, 8192).await })
            };
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!waiter.is_finished(), "the copy has not ended");
            // Another copy's end, disjoint, does not let it go.
            drop(copies.register(1 << 20, 2 << 20));
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!waiter.is_finished());
            drop(copy);
            tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("the change goes on once the copy ended")
                .unwrap();
        });
    }
}
