//! A thread of an export's own that runs its mid-sized page-cache writes (256 KiB to
//! below 1 MiB) one at a time, in the order they came, while the connections' threads
//! receive the next payloads: a queue the thread drains whole each time it wakes, so that
//! a run of writes costs one wake-up, not one each, and completion slots that are reused,
//! so that a write allocates nothing.
//!
//! A write whose future is dropped before the thread reaches it (its connection went) is
//! skipped: it was never answered, and should the client retry it on another connection
//! and have that answered, the stale copy must not land over it later. One the thread has
//! begun runs to its end.
//!
//! Why a thread of its own rather than tokio's blocking pool, and which writes go to it, is
//! measured in [`super::file::FileBackend`]'s `write_beside`.

use std::collections::VecDeque;
use std::fs::File;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

/// Completion slots kept for reuse; more are allocated when more copies are queued at once.
const SPARE_SLOTS: usize = 64;

/// One write for the writer thread: what to write where, and whatever must live until it is
/// written (it is dropped on the writer's thread once `run` returns).
pub trait Job: Send + 'static {
    fn run(self, file: &File) -> io::Result<()>;
}

/// The handle of a writer thread; dropping it lets the thread finish what is queued and end.
pub struct Writer<C: Job> {
    shared: Arc<Shared<C>>,
}

struct Shared<C> {
    state: Mutex<State<C>>,
    work_came: Condvar,
}

struct State<C> {
    queue: VecDeque<(C, Arc<Slot>)>,
    /// The writer is waiting on `work_came` (so a new copy must wake it).
    waiting: bool,
    /// The handle was dropped: end once the queue is empty.
    closed: bool,
    /// Completion slots of copies that ran, for the next ones (under the queue's lock, so
    /// that a submission takes one lock).
    spare_slots: Vec<Arc<Slot>>,
}

/// Where a copy's result waits for its future.
#[derive(Default)]
struct Slot {
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    result: Option<io::Result<()>>,
    waker: Option<Waker>,
    /// The future was dropped before its result came: skip the copy if not yet begun.
    abandoned: bool,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing here panics while holding a lock; should a copy panic, it does so unlocked.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<C: Job> Writer<C> {
    /// Starts the thread, named `name`, writing into `file`.
    pub fn start(file: Arc<File>, name: &str) -> io::Result<Writer<C>> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                waiting: false,
                closed: false,
                spare_slots: Vec::new(),
            }),
            work_came: Condvar::new(),
        });
        let writer = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || writer.run(&file))?;
        Ok(Writer { shared })
    }

    /// Queues `copy` behind those queued before it. The future is ready with the copy's
    /// result once it ran. Dropping the future before the copy began skips it (it is
    /// dropped unrun); after, the copy runs to its end.
    pub fn submit(&self, copy: C) -> Copied<C> {
        let mut state = lock(&self.shared.state);
        let slot = state.spare_slots.pop().unwrap_or_default();
        state.queue.push_back((copy, Arc::clone(&slot)));
        if state.waiting {
            state.waiting = false;
            self.shared.work_came.notify_one();
        }
        drop(state);
        Copied {
            slot: Some(slot),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<C: Job> Drop for Writer<C> {
    fn drop(&mut self) {
        lock(&self.shared.state).closed = true;
        self.shared.work_came.notify_one();
    }
}

impl<C: Job> Shared<C> {
    /// The writer thread: takes everything queued with one lock, runs it in order, and
    /// sleeps only when the queue is empty.
    fn run(&self, file: &File) {
        let mut batch = VecDeque::new();
        loop {
            {
                let mut state = lock(&self.state);
                while state.queue.is_empty() {
                    if state.closed {
                        return;
                    }
                    state.waiting = true;
                    state = self
                        .work_came
                        .wait(state)
                        .unwrap_or_else(|poisoned| poisoned.into_inner());
                }
                // The two queues trade places, each keeping its capacity: no allocation.
                std::mem::swap(&mut state.queue, &mut batch);
            }
            for (copy, slot) in batch.drain(..) {
                if lock(&slot.state).abandoned {
                    continue;
                }
                let result =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| copy.run(file)))
                        .unwrap_or_else(|_| {
                            Err(io::Error::other("a copy into the page cache panicked"))
                        });
                finish(slot, result);
            }
        }
    }
}

/// Hands `result` to the slot's future and wakes it. The writer's reference goes before
/// the wake-up, so that the future usually finds the slot its own and can reuse it.
fn finish(slot: Arc<Slot>, result: io::Result<()>) {
    let waker = {
        let mut state = lock(&slot.state);
        state.result = Some(result);
        state.waker.take()
    };
    drop(slot);
    if let Some(waker) = waker {
        waker.wake();
    }
}

/// The result of a copy queued with [`Writer::submit`].
pub struct Copied<C: Job> {
    slot: Option<Arc<Slot>>,
    shared: Arc<Shared<C>>,
}

impl<C: Job> Copied<C> {
    /// Lets go of the slot: back to the spares once the writer let go of it too (its copy
    /// ran); else marked abandoned, so that a copy not yet begun is skipped.
    fn let_go(&self, mut slot: Arc<Slot>) {
        let Some(unshared) = Arc::get_mut(&mut slot) else {
            lock(&slot.state).abandoned = true;
            return;
        };
        *unshared
            .state
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = SlotState::default();
        let mut state = lock(&self.shared.state);
        if state.spare_slots.len() < SPARE_SLOTS {
            state.spare_slots.push(slot);
        }
    }
}

impl<C: Job> Future for Copied<C> {
    type Output = io::Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let Some(slot) = self.slot.as_ref() else {
            return Poll::Ready(Err(io::Error::other("a copy polled after its result")));
        };
        let result = {
            let mut state = lock(&slot.state);
            let Some(result) = state.result.take() else {
                match &state.waker {
                    Some(waker) if waker.will_wake(cx.waker()) => {}
                    _ => state.waker = Some(cx.waker().clone()),
                }
                return Poll::Pending;
            };
            result
        };
        if let Some(slot) = self.slot.take() {
            self.let_go(slot);
        }
        Poll::Ready(result)
    }
}

impl<C: Job> Drop for Copied<C> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            self.let_go(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A copy that records its turn, then writes its byte at its offset.
    struct Mark {
        at: u64,
        byte: u8,
        order: Arc<Mutex<Vec<u64>>>,
    }

    impl Job for Mark {
        fn run(self, file: &File) -> io::Result<()> {
            use std::os::unix::fs::FileExt;
            lock(&self.order).push(self.at);
            file.write_all_at(&[self.byte], self.at)
        }
    }

    fn block_on<F: Future>(future: F) -> F::Output {
        crate::test_runtime().block_on(future)
    }

    fn temp_file() -> (tempfile::TempDir, Arc<File>) {
        let dir = tempfile::tempdir().unwrap();
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("w"))
            .unwrap();
        (dir, Arc::new(file))
    }

    /// Copies run in the order they were queued, and each future sees its own result.
    #[test]
    fn copies_run_in_order() {
        let (_dir, file) = temp_file();
        let writer = Writer::start(Arc::clone(&file), "test-writer").unwrap();
        let order = Arc::new(Mutex::new(Vec::new()));
        let mark = |at: u64| Mark {
            at,
            byte: at as u8 + 1,
            order: Arc::clone(&order),
        };
        block_on(async {
            let futures: Vec<Copied<Mark>> = (0..100).map(|at| writer.submit(mark(at))).collect();
            for copied in futures {
                copied.await.unwrap();
            }
        });
        assert_eq!(*lock(&order), (0..100).collect::<Vec<u64>>());
        let mut bytes = vec![0u8; 100];
        use std::os::unix::fs::FileExt;
        file.read_exact_at(&mut bytes, 0).unwrap();
        assert_eq!(bytes, (1..=100).collect::<Vec<u8>>());
    }

    /// A copy whose future is dropped while it waits in the queue is skipped (dropped
    /// unrun), and the next runs; one whose future is dropped after it began runs to its
    /// end.
    #[test]
    fn a_copy_dropped_before_it_began_is_skipped_and_one_begun_runs_to_its_end() {
        use std::sync::mpsc::{channel, Receiver, Sender};
        /// Says it began, then waits for the gate, then counts itself run.
        struct Gated {
            began: Sender<()>,
            gate: Receiver<()>,
            ran: Arc<AtomicUsize>,
            dropped: Arc<AtomicUsize>,
        }
        impl Job for Gated {
            fn run(self, _: &File) -> io::Result<()> {
                let _ = self.began.send(());
                let _ = self.gate.recv();
                self.ran.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        }
        impl Drop for Gated {
            fn drop(&mut self) {
                self.dropped.fetch_add(1, Ordering::SeqCst);
            }
        }
        let (_dir, file) = temp_file();
        let writer = Writer::start(file, "test-writer").unwrap();
        let (ran, dropped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let gated = || {
            let (began_tx, began_rx) = channel();
            let (gate_tx, gate_rx) = channel();
            let job = Gated {
                began: began_tx,
                gate: gate_rx,
                ran: Arc::clone(&ran),
                dropped: Arc::clone(&dropped),
            };
            (job, began_rx, gate_tx)
        };
        let (first, first_began, open_first) = gated();
        let (second, _second_began, open_second) = gated();
        let (third, _third_began, open_third) = gated();
        block_on(async {
            let first = writer.submit(first);
            first_began.recv().unwrap();
            let second = writer.submit(second);
            let third = writer.submit(third);
            // The first has begun: dropped, it still runs to its end. The second waits
            // behind it: dropped, it is skipped.
            drop(first);
            drop(second);
            drop((open_second, open_third));
            open_first.send(()).unwrap();
            third.await.unwrap();
        });
        assert_eq!(ran.load(Ordering::SeqCst), 2, "the first and the third ran");
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            3,
            "every job was dropped once"
        );
    }

    /// A failed copy's error reaches its future, a panicking copy fails only itself, and
    /// the writer goes on with the next.
    #[test]
    fn a_failed_or_panicking_copy_fails_only_its_own_future() {
        enum Outcome {
            Fails,
            Panics,
            Works,
        }
        impl Job for Outcome {
            fn run(self, _: &File) -> io::Result<()> {
                match self {
                    Outcome::Fails => Err(io::Error::from_raw_os_error(libc::ENOSPC)),
                    Outcome::Panics => panic!("a copy that panics (expected by this test)"),
                    Outcome::Works => Ok(()),
                }
            }
        }
        let (_dir, file) = temp_file();
        let writer = Writer::start(file, "test-writer").unwrap();
        block_on(async {
            let failed = writer.submit(Outcome::Fails).await.unwrap_err();
            assert_eq!(failed.raw_os_error(), Some(libc::ENOSPC));
            let panicked = writer.submit(Outcome::Panics).await.unwrap_err();
            assert!(panicked.to_string().contains("panicked"), "{panicked}");
            writer.submit(Outcome::Works).await.unwrap();
        });
    }

    /// Once running, submitting and awaiting copies allocates no slot: each is reused.
    #[test]
    fn slots_are_reused() {
        static RUNS: AtomicUsize = AtomicUsize::new(0);
        struct Count;
        impl Job for Count {
            fn run(self, _: &File) -> io::Result<()> {
                RUNS.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
        }
        let (_dir, file) = temp_file();
        let writer = Writer::start(file, "test-writer").unwrap();
        block_on(async {
            let mut first: Option<*const Slot> = None;
            let mut reused = 0;
            for _ in 0..200 {
                let copied = writer.submit(Count);
                let slot = Arc::as_ptr(copied.slot.as_ref().unwrap());
                copied.await.unwrap();
                match first {
                    None => first = Some(slot),
                    Some(seen) if seen == slot => reused += 1,
                    Some(_) => {}
                }
            }
            // The writer usually lets go before its future is woken; allow a few misses.
            assert!(reused >= 150, "one slot reused {reused} times of 199");
        });
        assert_eq!(RUNS.load(Ordering::Relaxed), 200);
    }
}
