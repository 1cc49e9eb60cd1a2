//! The requests in flight on one connection: a set of futures, polled when woken, that
//! finish in any order, and whose slots (the future's box and its waker) are reused by
//! the requests that come after, so a request that has to wait allocates nothing here.
//!
//! Why not `FuturesUnordered` with a boxed future per request: that is two allocations
//! and two frees per request (the box and the set's task), and with the `Vec` of replies
//! they were most of the 6 allocations per `--cache=none` 4 KiB read that a probe on
//! `malloc` counted (`perf probe`, session 32). Here a slot keeps its box
//! ([`ReusableBoxFuture`] reuses it for a future of the same layout) and its waker, made
//! once, and a new future goes to an idle slot whose box fits it: requests of one kind
//! reuse each other's boxes, and so do kinds that take turns (session 38).

use std::alloc::Layout;
use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;
use tokio_util::sync::ReusableBoxFuture;

/// Idle slots [`InFlight::push`] tries for a box that fits, most recently freed first.
const SLOTS_SEARCHED: usize = 8;
/// Idle slots below which a future that fits none of them gets a new slot, not the box
/// of an idle one: the slots then exceed the most futures ever in flight by at most this.
const SPARE_SLOTS: usize = 4;

/// Futures in flight, each in a slot of its own until it finishes.
pub struct InFlight<T> {
    slots: Vec<Slot<T>>,
    /// Slots with no future, to be reused first.
    idle: Vec<usize>,
    /// Slots to poll in this call or the next: woken ones, and new futures (which have
    /// not been polled yet).
    to_poll: VecDeque<usize>,
    shared: Arc<Shared>,
    running: usize,
    /// Futures pushed and not yet polled (see [`InFlight::any_unpolled`]).
    unpolled: usize,
    /// Futures that needed a box of their own (a new slot, or one whose box had another
    /// layout).
    #[cfg(test)]
    boxes_made: usize,
}

struct Slot<T> {
    future: Option<ReusableBoxFuture<'static, T>>,
    /// The layout of the future's box, which a future must have to reuse it.
    layout: Option<Layout>,
    running: bool,
    /// Pushed and not yet polled.
    unpolled: bool,
    /// Wakes this slot: made once, so a future that keeps its waker (`will_wake`) sees
    /// the same one on every poll.
    waker: Waker,
    wake: Arc<SlotWake>,
}

/// What the wakers of all slots share with the set.
struct Shared {
    /// Slots woken since the set last looked, in the order they were woken.
    woken: Mutex<Vec<usize>>,
    /// The task that polls the set.
    owner: AtomicWaker,
}

struct SlotWake {
    index: usize,
    /// Set while the slot is listed as woken, so it is listed once however often it wakes.
    listed: AtomicBool,
    shared: Arc<Shared>,
}

impl Wake for SlotWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.listed.swap(true, Ordering::AcqRel) {
            self.shared
                .woken
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(self.index);
            self.shared.owner.wake();
        }
    }
}

impl<T> Default for InFlight<T> {
    fn default() -> Self {
        InFlight {
            slots: Vec::new(),
            idle: Vec::new(),
            to_poll: VecDeque::new(),
            shared: Arc::new(Shared {
                woken: Mutex::new(Vec::new()),
                owner: AtomicWaker::new(),
            }),
            running: 0,
            unpolled: 0,
            #[cfg(test)]
            boxes_made: 0,
        }
    }
}

impl<T: 'static> InFlight<T> {
    /// How many futures have not finished.
    pub fn len(&self) -> usize {
        self.running
    }

    pub fn is_empty(&self) -> bool {
        self.running == 0
    }

    /// Whether a future pushed has not been polled yet: the connection's requests start
    /// (reach the export) at their first poll, in the order they were pushed.
    pub fn any_unpolled(&self) -> bool {
        self.unpolled > 0
    }

    /// Adds a future; it is first polled by the next [`InFlight::poll_next`].
    ///
    /// It goes into the box of an idle slot that fits it, looking among the
    /// [`SLOTS_SEARCHED`] most recently freed; if none fits, into a new slot while fewer
    /// than [`SPARE_SLOTS`] are idle, else into a new box in the most recently freed one.
    /// So a connection whose requests take turns between kinds (a write, then a FLUSH or
    /// a flush ahead of it: two future types at iodepth 1) keeps a box for each instead of
    /// replacing one box at every turn.
    pub fn push<F>(&mut self, future: F)
    where
        F: Future<Output = T> + Send + 'static,
    {
        // Compared here, not by trying: `try_set` frees the box when the layouts differ.
        let layout = Layout::new::<F>();
        let top = self.idle.len();
        let fitting = (top.saturating_sub(SLOTS_SEARCHED)..top)
            .rev()
            .find(|&position| self.slots[self.idle[position]].layout == Some(layout));
        if let Some(position) = fitting {
            let index = self.idle.remove(position);
            if let Some(boxed) = self.slots[index].future.as_mut() {
                // The layouts match, so this reuses the box.
                boxed.set(future);
            }
            self.start(index);
            return;
        }
        let index = if self.idle.len() < SPARE_SLOTS {
            self.new_slot()
        } else {
            self.idle.pop().expect("SPARE_SLOTS idle slots")
        };
        self.slots[index].future = Some(ReusableBoxFuture::new(future));
        self.slots[index].layout = Some(layout);
        #[cfg(test)]
        {
            self.boxes_made += 1;
        }
        self.start(index);
    }

    /// A slot with no future, its waker made.
    fn new_slot(&mut self) -> usize {
        let index = self.slots.len();
        let wake = Arc::new(SlotWake {
            index,
            listed: AtomicBool::new(false),
            shared: Arc::clone(&self.shared),
        });
        self.slots.push(Slot {
            future: None,
            layout: None,
            running: false,
            unpolled: false,
            waker: Waker::from(Arc::clone(&wake)),
            wake,
        });
        index
    }

    /// Marks slot `index`, its future just set, running and due for its first poll.
    fn start(&mut self, index: usize) {
        let slot = &mut self.slots[index];
        slot.running = true;
        slot.unpolled = true;
        self.running += 1;
        self.unpolled += 1;
        // Listed now, so that a wake before the first poll does not list it twice.
        slot.wake.listed.store(true, Ordering::Release);
        self.to_poll.push_back(index);
    }

    /// The output of a future that finished, `Ready(None)` when none is running, or
    /// `Pending` (with the caller's task woken when one of them is).
    ///
    /// Polls at most as many futures as are running before it returns `Pending` and
    /// wakes the caller, so a future that wakes itself at once (as tokio's cooperative
    /// budget makes them do) cannot keep this call from returning.
    pub fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        if self.running == 0 {
            return Poll::Ready(None);
        }
        self.shared.owner.register(cx.waker());
        let mut budget = self.running;
        loop {
            if self.to_poll.is_empty() {
                let mut woken = self.shared.woken.lock().unwrap_or_else(|e| e.into_inner());
                self.to_poll.extend(woken.drain(..));
            }
            let Some(index) = self.to_poll.pop_front() else {
                return Poll::Pending;
            };
            let slot = &mut self.slots[index];
            if !slot.running {
                // Woken after it finished (its waker was still held somewhere).
                continue;
            }
            if budget == 0 {
                self.to_poll.push_front(index);
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            budget -= 1;
            if slot.unpolled {
                slot.unpolled = false;
                self.unpolled -= 1;
            }
            slot.wake.listed.store(false, Ordering::Release);
            let future = slot
                .future
                .as_mut()
                .expect("a running slot holds its future");
            if let Poll::Ready(output) = future.poll(&mut Context::from_waker(&slot.waker)) {
                slot.running = false;
                self.running -= 1;
                self.idle.push(index);
                return Poll::Ready(Some(output));
            }
        }
    }

    /// The output of the next future to finish, or `None` when none is running.
    pub async fn next(&mut self) -> Option<T> {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::sync::oneshot;

    #[test]
    fn a_future_counts_as_unpolled_until_its_first_poll_whether_or_not_it_finished() {
        let mut set = InFlight::default();
        assert!(!set.any_unpolled());
        let (tx, rx) = oneshot::channel::<u32>();
        set.push(async move { rx.await.unwrap() });
        set.push(std::future::pending::<u32>());
        assert!(set.any_unpolled());
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(set.poll_next(&mut cx).is_pending());
        assert!(!set.any_unpolled(), "both were polled, neither finished");
        set.push(std::future::ready(7));
        assert!(set.any_unpolled());
        assert_eq!(set.poll_next(&mut cx), Poll::Ready(Some(7)));
        assert!(!set.any_unpolled());
        tx.send(1).unwrap();
        assert_eq!(set.poll_next(&mut cx), Poll::Ready(Some(1)));
        assert_eq!(set.len(), 1);
    }

    #[tokio::test]
    async fn futures_finish_in_the_order_they_are_done_not_pushed() {
        let mut set = InFlight::default();
        let mut senders = Vec::new();
        for i in 0..5u32 {
            let (tx, rx) = oneshot::channel::<u32>();
            senders.push(Some(tx));
            set.push(async move { rx.await.unwrap() * 10 + i });
        }
        assert_eq!(set.len(), 5);
        // None is done yet.
        let waker = futures_util::task::noop_waker();
        assert!(set.poll_next(&mut Context::from_waker(&waker)).is_pending());
        for i in [3usize, 0, 4, 1, 2] {
            senders[i].take().unwrap().send(i as u32).unwrap();
            let out = set.next().await.unwrap();
            assert_eq!(out, i as u32 * 10 + i as u32);
        }
        assert!(set.is_empty());
        assert_eq!(set.next().await, None);
    }

    /// A request of one kind: the same future type every time.
    async fn job(n: u64) -> u64 {
        tokio::task::yield_now().await;
        n
    }

    #[tokio::test]
    async fn slots_are_reused_and_keep_their_boxes() {
        let mut set = InFlight::default();
        for round in 0..100u64 {
            for i in 0..8u64 {
                set.push(job(round * 8 + i));
            }
            let mut sum = 0;
            while let Some(v) = set.next().await {
                sum += v;
            }
            assert_eq!(sum, (0..8).map(|i| round * 8 + i).sum::<u64>());
        }
        assert_eq!(set.slots.len(), 8, "eight at a time need eight slots");
        assert_eq!(set.boxes_made, 8, "one box per slot, reused 99 times");
        // A future of another layout gets a box of its own, and the set still works.
        let big = [1u64; 64];
        set.push(async move {
            tokio::task::yield_now().await;
            big.iter().sum::<u64>()
        });
        assert_eq!(set.boxes_made, 9);
        assert_eq!(set.next().await, Some(64));
    }

    /// Futures of three kinds taking turns one at a time, as a write, the flush ahead of
    /// it and the client's FLUSH do at iodepth 1, keep a box each; past the spare slots,
    /// a kind that fits no idle box takes over the most recently freed.
    #[tokio::test]
    async fn kinds_that_take_turns_keep_a_box_each() {
        let mut set = InFlight::default();
        for round in 0..100u64 {
            set.push(job(round));
            assert_eq!(set.next().await, Some(round));
            let small = [round; 4];
            set.push(async move {
                tokio::task::yield_now().await;
                small.iter().sum::<u64>()
            });
            assert_eq!(set.next().await, Some(4 * round));
            let large = [round; 32];
            set.push(async move {
                tokio::task::yield_now().await;
                large.iter().sum::<u64>()
            });
            assert_eq!(set.next().await, Some(32 * round));
        }
        assert_eq!((set.slots.len(), set.boxes_made), (3, 3));
        // Two more kinds: the fourth still gets a slot of its own, the fifth (four slots
        // idle) a new box in the fourth's slot.
        for n in [8usize, 16] {
            let values = vec![1u64; n];
            let padding = [0u8; 512];
            set.push(async move {
                tokio::task::yield_now().await;
                values.iter().sum::<u64>() + u64::from(padding[0]) * n as u64
            });
            assert_eq!(set.next().await, Some(n as u64));
            if n == 8 {
                let padding = [0u16; 512];
                set.push(async move {
                    tokio::task::yield_now().await;
                    u64::from(padding[0])
                });
                assert_eq!(set.next().await, Some(0));
            }
        }
        assert_eq!(set.slots.len(), 4, "no slot beyond the spare ones");
        assert_eq!(set.boxes_made, 6);
    }

    #[tokio::test]
    async fn wakes_from_other_threads_reach_the_owner() {
        let mut set = InFlight::default();
        for i in 0..64u64 {
            let (tx, rx) = oneshot::channel::<u64>();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_micros(50 * (64 - i)));
                tx.send(i).unwrap();
            });
            set.push(async move { rx.await.unwrap() });
        }
        let mut seen = Vec::new();
        while let Some(v) = tokio::time::timeout(Duration::from_secs(10), set.next())
            .await
            .expect("every wake reaches the owner")
        {
            seen.push(v);
        }
        seen.sort();
        assert_eq!(seen, (0..64).collect::<Vec<_>>());
    }

    /// A future that wakes itself and stays pending `left` times before it finishes.
    struct Restless {
        left: u32,
    }

    impl Future for Restless {
        type Output = u32;
        fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u32> {
            if self.left == 0 {
                return Poll::Ready(7);
            }
            self.left -= 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    #[test]
    fn a_future_that_wakes_itself_does_not_hold_the_caller() {
        let mut set = InFlight::default();
        set.push(Restless { left: 1_000 });
        set.push(Restless { left: 3 });
        let owner_woken = Arc::new(Counted::default());
        let waker = Waker::from(Arc::clone(&owner_woken));
        let mut cx = Context::from_waker(&waker);
        let mut pendings = 0;
        let mut outputs = 0;
        while outputs < 2 {
            match set.poll_next(&mut cx) {
                Poll::Ready(Some(v)) => {
                    assert_eq!(v, 7);
                    outputs += 1;
                }
                Poll::Ready(None) => unreachable!("two were running"),
                Poll::Pending => pendings += 1,
            }
            assert!(
                pendings < 10_000,
                "each call returns after a bounded number of polls"
            );
        }
        assert!(
            pendings >= 500,
            "the restless one was polled at most twice per call"
        );
        assert!(owner_woken.0.load(Ordering::Relaxed) >= pendings);
        assert!(matches!(set.poll_next(&mut cx), Poll::Ready(None)));
    }

    #[derive(Default)]
    struct Counted(std::sync::atomic::AtomicUsize);

    impl Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.wake_by_ref();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[tokio::test]
    async fn a_late_wake_of_a_finished_future_polls_nothing_wrong() {
        let mut set = InFlight::default();
        let kept: Arc<Mutex<Option<Waker>>> = Arc::default();
        let keep = Arc::clone(&kept);
        set.push(std::future::poll_fn(move |cx| {
            *keep.lock().unwrap() = Some(cx.waker().clone());
            Poll::Ready(1u32)
        }));
        assert_eq!(set.next().await, Some(1));
        let (tx, rx) = oneshot::channel::<u32>();
        set.push(async move { rx.await.unwrap() });
        // The first future's waker now names the slot the second one took: a spurious
        // poll, which a future must bear, and nothing more.
        kept.lock().unwrap().take().unwrap().wake();
        let waker = futures_util::task::noop_waker();
        assert!(set.poll_next(&mut Context::from_waker(&waker)).is_pending());
        tx.send(2).unwrap();
        assert_eq!(set.next().await, Some(2));
        assert_eq!(set.next().await, None);
    }
}
