//! Keeps changes to a page-cache export landing in the order the connections started them
//! while some writes are copied beside the connections' threads
//! ([`FileBackend::write_beside`](super::file::FileBackend)).
//!
//! Each change that may still be under way when a later one starts registers its range
//! when it starts and stays registered until it has landed: a write copied beside (until
//! its copy ends, or until it is dropped before the copy began), a TRIM or a zeroing, and
//! a write that found a registered change over its range. Before it begins, each waits
//! for the registered changes started before it that overlap it, and for no later one.
//! So of two overlapping changes, the one started first lands first, on whichever path
//! each goes, as when every copy was made on the connection's thread. A write over
//! nothing registered is made at once, unregistered.
//!
//! "Started" is when the connection hands the request to the export: the first poll of
//! its future, in the order the connection read the requests. A write whose payload is
//! whole in the read buffer is made as it is parsed, before requests read earlier whose
//! futures are not yet polled, unless it overlaps one of those changes: then it goes as a
//! future behind them (the pipeline's `changes_not_started`, session 78; before, a TRIM
//! then a 512-byte write over it, sent together, landed TRIM last: review, session 76).
//!
//! Why it matters (review, session 75): a client that sent writes and went away left them
//! queued on the export's writer thread, and another connection's later write over the
//! same bytes, made at once on its own thread and acknowledged, was then overwritten by
//! the gone client's copy: 5 of 40 trials. NBD leaves the order of overlapping requests
//! that are in flight together to the server, but a client taking over a device expects
//! what it wrote after the other client was gone to stay. (A first form, session 76,
//! registered only the copies beside and had every other change wait for any copy over
//! it, later ones too: a TRIM started before a later write beside then landed after it,
//! 20 of 20 times in review, and a hot range could hold a small write back for 185 ms.)

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// A registered change: its order of starting and its byte range.
#[derive(Debug, Clone, Copy)]
struct Change {
    id: u64,
    start: u64,
    end: u64,
}

/// The registered changes of one export.
#[derive(Default)]
pub struct ChangeOrder {
    /// The next id to give, and the changes registered (in the order they started).
    state: Mutex<(u64, Vec<Change>)>,
    /// How many changes are registered: lets a change when there are none skip the lock.
    count: AtomicUsize,
    /// Woken whenever a registered change ends.
    ended: Notify,
}

/// A registered change, removed from the register when dropped (once it has landed).
pub struct Registered {
    order: Arc<ChangeOrder>,
    id: u64,
    start: u64,
    end: u64,
    /// Whether a change registered before it overlapped it when it registered: if not,
    /// none ever will (later ones are not waited for), and it need not look again.
    after_overlapping: bool,
}

impl ChangeOrder {
    /// Registers a change of `[start, end)` starting now; never waits.
    pub fn register(self: &Arc<Self>, start: u64, end: u64) -> Registered {
        let mut state = self.lock();
        // Every change registered now started before this one.
        let after_overlapping = overlapped(&state.1, start, end);
        self.push(&mut state, start, end, after_overlapping)
    }

    /// Registers a change of `[start, end)` starting now if a registered change overlaps
    /// it (it must then wait, [`Registered::wait_for_earlier`]); `None` when it may be
    /// made at once. The look and the registration are one step under the lock.
    pub fn register_if_over(self: &Arc<Self>, start: u64, end: u64) -> Option<Registered> {
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut state = self.lock();
        let over = overlapped(&state.1, start, end);
        over.then(|| self.push(&mut state, start, end, true))
    }

    fn push(
        self: &Arc<Self>,
        state: &mut (u64, Vec<Change>),
        start: u64,
        end: u64,
        after_overlapping: bool,
    ) -> Registered {
        let id = state.0;
        state.0 += 1;
        state.1.push(Change { id, start, end });
        self.count.fetch_add(1, Ordering::AcqRel);
        Registered {
            order: Arc::clone(self),
            id,
            start,
            end,
            after_overlapping,
        }
    }

    /// Whether a registered change started before `before` (any, with `u64::MAX`)
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

    /// Whether a registered change overlaps `[start, end)`: a write there must not be
    /// made at once (it goes through [`ChangeOrder::register_if_over`]).
    pub fn any_over(&self, start: u64, end: u64) -> bool {
        self.overlaps(start, end, u64::MAX)
    }

    /// Waits until no change registered before `before` overlaps `[start, end)`.
    async fn wait_for_earlier(&self, start: u64, end: u64, before: u64) {
        // Most changes meet none: they look without a wake-up to wait for.
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

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, Vec<Change>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(test)]
    pub(crate) fn registered(&self) -> usize {
        self.lock().1.len()
    }
}

/// Whether a change of `changes` overlaps `[start, end)`.
fn overlapped(changes: &[Change], start: u64, end: u64) -> bool {
    changes.iter().any(|q| q.start < end && start < q.end)
}

impl Registered {
    /// Waits until every overlapping change started before this one has landed.
    pub async fn wait_for_earlier(&self) {
        if !self.after_overlapping {
            return;
        }
        self.order
            .wait_for_earlier(self.start, self.end, self.id)
            .await;
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        let mut state = self.order.lock();
        if let Some(at) = state.1.iter().position(|q| q.id == self.id) {
            state.1.remove(at);
        }
        self.order.count.fetch_sub(1, Ordering::AcqRel);
        drop(state);
        self.order.ended.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Polls `future` once: whether it is ready at once.
    fn ready_at_once(future: impl std::future::Future<Output = ()>) -> bool {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        std::pin::pin!(future).poll(&mut cx).is_ready()
    }

    #[test]
    fn a_change_waits_only_for_overlapping_changes_started_before_it() {
        let order = Arc::new(ChangeOrder::default());
        assert!(!order.any_over(0, u64::MAX), "nothing registered");
        assert!(order.register_if_over(0, 4096).is_none(), "over nothing");
        let first = order.register(0, 4096);
        let second = order.register(8192, 12288);
        assert!(order.any_over(4095, 4096));
        assert!(!order.any_over(4096, 8192), "the gap between them");
        assert!(order.register_if_over(4096, 8192).is_none());
        assert!(order.any_over(0, 1 << 20));
        // A later change over the first waits for it; one over neither does not.
        let third = order.register_if_over(2048, 6144).expect("over the first");
        let fourth = order.register(6144, 8192);
        assert!(!ready_at_once(third.wait_for_earlier()));
        assert!(ready_at_once(fourth.wait_for_earlier()));
        // The first does not wait for the later third that overlaps it.
        assert!(ready_at_once(first.wait_for_earlier()));
        drop(first);
        assert!(ready_at_once(third.wait_for_earlier()));
        // A change after the third waits for it, and the third not for it.
        let fifth = order.register(0, 4096);
        assert!(!ready_at_once(fifth.wait_for_earlier()));
        assert!(ready_at_once(third.wait_for_earlier()));
        drop((second, third, fourth));
        assert!(ready_at_once(fifth.wait_for_earlier()));
        drop(fifth);
        assert_eq!(order.registered(), 0);
        assert!(!order.any_over(0, u64::MAX));
    }

    #[test]
    fn a_waiting_change_goes_on_when_the_earlier_one_lands() {
        crate::test_runtime().block_on(async {
            let order = Arc::new(ChangeOrder::default());
            let earlier = order.register(0, 1 << 20);
            let waiter = {
                let order = Arc::clone(&order);
                tokio::spawn(async move {
                    let turn = order.register_if_over(4096, 8192).expect("over the first");
                    turn.wait_for_earlier().await;
                })
            };
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!waiter.is_finished(), "the earlier change has not landed");
            // The end of another change, disjoint, does not let it go; nor does a later
            // one over it hold it back.
            drop(order.register(1 << 20, 2 << 20));
            let later = order.register(0, 1 << 20);
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!waiter.is_finished());
            drop(earlier);
            tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("the change goes on once the earlier one landed")
                .unwrap();
            drop(later);
        });
    }
}
