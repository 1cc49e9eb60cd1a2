//! A one-shot hand-off of a value from one task to another (the io_uring reaper to the
//! request waiting on its completion) in cells that are pooled, so a request allocates
//! nothing for it.
//!
//! It does what `tokio::sync::oneshot` does for the ring, which allocated a channel per
//! request: the last allocation but one that a `--cache=none` request made (ARCHITECTURE,
//! "No allocation per request"). A cell is an `Arc` holding a small mutex; the pool keeps
//! cells whose value was taken, and a cell goes back to it only when its last holder lets
//! go of it (`Arc::get_mut`), so a cell in use is never handed out twice. When both holders
//! let go at the same moment, neither may see itself as the last; the cell is then freed,
//! not reused, which costs an allocation and nothing else.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

/// The cells an [`AnswerPool`] keeps at most.
const POOL_LIMIT: usize = 4096;

/// Where one value waits for its taker.
struct Cell<T> {
    state: Mutex<State<T>>,
}

struct State<T> {
    value: Option<T>,
    /// The sender went away without sending.
    dropped: bool,
    waker: Option<Waker>,
}

impl<T> Cell<T> {
    fn new() -> Cell<T> {
        Cell {
            state: Mutex::new(State {
                value: None,
                dropped: false,
                waker: None,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // The state is consistent at every step; a panic elsewhere leaves nothing half done.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Cells for one-shot hand-offs, reused.
pub struct AnswerPool<T> {
    cells: Mutex<Vec<Arc<Cell<T>>>>,
}

impl<T> Default for AnswerPool<T> {
    fn default() -> Self {
        AnswerPool {
            cells: Mutex::new(Vec::new()),
        }
    }
}

impl<T> AnswerPool<T> {
    /// A sender and its receiver, sharing a pooled cell (a new one when the pool is empty).
    pub fn channel(&self) -> (AnswerSender<T>, AnswerReceiver<'_, T>) {
        let cell = self.lock().pop().unwrap_or_else(|| Arc::new(Cell::new()));
        let sender = AnswerSender {
            cell: Some(Arc::clone(&cell)),
        };
        let receiver = AnswerReceiver {
            pool: self,
            cell: Some(cell),
        };
        (sender, receiver)
    }

    /// Cells waiting to be reused.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Arc<Cell<T>>>> {
        self.cells.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes `cell` back if nothing else holds it.
    fn give_back(&self, mut cell: Arc<Cell<T>>) {
        let Some(only) = Arc::get_mut(&mut cell) else {
            // The sender still holds it (a receiver dropped before its answer): the cell
            // is freed when the sender lets go.
            return;
        };
        let state = only.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        state.value = None;
        state.dropped = false;
        state.waker = None;
        let mut cells = self.lock();
        if cells.len() < POOL_LIMIT {
            if cells.capacity() == 0 {
                // Once, so that giving back never grows the list.
                cells.reserve_exact(POOL_LIMIT);
            }
            cells.push(cell);
        }
    }
}

/// The sending half: [`AnswerSender::send`] once; dropping it unsent tells the receiver
/// that no answer will come.
pub struct AnswerSender<T> {
    cell: Option<Arc<Cell<T>>>,
}

impl<T> AnswerSender<T> {
    /// Hands `value` to the receiver (dropped at once if the receiver has gone).
    pub fn send(mut self, value: T) {
        if let Some(cell) = self.cell.take() {
            finish(cell, Some(value));
        }
    }
}

impl<T> Drop for AnswerSender<T> {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            finish(cell, None);
        }
    }
}

/// Posts `value` (or that none will come), lets go of the cell, then wakes the receiver,
/// so that the receiver, once woken, is normally the cell's last holder and can pool it.
fn finish<T>(cell: Arc<Cell<T>>, value: Option<T>) {
    if Arc::strong_count(&cell) == 1 {
        // The receiver has gone: nobody takes the value, so drop it here and now.
        return;
    }
    let waker = {
        let mut state = cell.lock();
        match value {
            Some(value) => state.value = Some(value),
            None => state.dropped = true,
        }
        state.waker.take()
    };
    drop(cell);
    if let Some(waker) = waker {
        waker.wake();
    }
}

/// The receiving half: a future of the value, or of `Err(Dropped)` when the sender went
/// away without sending.
pub struct AnswerReceiver<'pool, T> {
    pool: &'pool AnswerPool<T>,
    cell: Option<Arc<Cell<T>>>,
}

/// The sender went away without sending.
#[derive(Debug, PartialEq, Eq)]
pub struct Dropped;

impl<T> Future for AnswerReceiver<'_, T> {
    type Output = Result<T, Dropped>;

    fn poll(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let Some(cell) = &this.cell else {
            return Poll::Ready(Err(Dropped));
        };
        let answer = {
            let mut state = cell.lock();
            if let Some(value) = state.value.take() {
                Ok(value)
            } else if state.dropped {
                Err(Dropped)
            } else {
                match &mut state.waker {
                    Some(waker) => waker.clone_from(context.waker()),
                    None => state.waker = Some(context.waker().clone()),
                }
                return Poll::Pending;
            }
        };
        if let Some(cell) = this.cell.take() {
            this.pool.give_back(cell);
        }
        Poll::Ready(answer)
    }
}

impl<T> Drop for AnswerReceiver<'_, T> {
    fn drop(&mut self) {
        if let Some(cell) = self.cell.take() {
            self.pool.give_back(cell);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Wake;

    struct CountWakes(std::sync::atomic::AtomicUsize);

    impl Wake for CountWakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn poll_once<T>(
        receiver: &mut AnswerReceiver<'_, T>,
        waker: &Waker,
    ) -> Poll<Result<T, Dropped>> {
        Pin::new(receiver).poll(&mut Context::from_waker(waker))
    }

    #[test]
    fn a_value_sent_before_or_after_the_first_poll_arrives_and_the_cell_is_reused() {
        let pool = AnswerPool::default();
        let wakes = Arc::new(CountWakes(Default::default()));
        let waker = Waker::from(Arc::clone(&wakes));

        let (sender, mut receiver) = pool.channel();
        sender.send(7);
        assert_eq!(poll_once(&mut receiver, &waker), Poll::Ready(Ok(7)));
        assert_eq!(
            pool.idle(),
            1,
            "the cell went back when its value was taken"
        );

        let (sender, mut receiver) = pool.channel();
        assert_eq!(pool.idle(), 0, "the pooled cell was handed out again");
        assert_eq!(poll_once(&mut receiver, &waker), Poll::Pending);
        sender.send(8);
        assert_eq!(wakes.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(poll_once(&mut receiver, &waker), Poll::Ready(Ok(8)));
        drop(receiver);
        assert_eq!(pool.idle(), 1);
    }

    #[test]
    fn a_sender_dropped_unsent_ends_the_wait_with_an_error() {
        let pool = AnswerPool::<u32>::default();
        let wakes = Arc::new(CountWakes(Default::default()));
        let waker = Waker::from(Arc::clone(&wakes));
        let (sender, mut receiver) = pool.channel();
        assert_eq!(poll_once(&mut receiver, &waker), Poll::Pending);
        drop(sender);
        assert_eq!(wakes.0.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert_eq!(poll_once(&mut receiver, &waker), Poll::Ready(Err(Dropped)));
        // A cell that answered "dropped" is clean when it is handed out again.
        let (sender, mut receiver) = pool.channel();
        assert_eq!(pool.idle(), 0);
        assert_eq!(poll_once(&mut receiver, &waker), Poll::Pending);
        sender.send(3);
        assert_eq!(poll_once(&mut receiver, &waker), Poll::Ready(Ok(3)));
    }

    #[test]
    fn a_value_sent_to_a_receiver_that_went_away_is_dropped_and_its_cell_not_pooled_in_use() {
        let pool = AnswerPool::default();
        let value = Arc::new(());
        let (sender, receiver) = pool.channel();
        drop(receiver);
        assert_eq!(pool.idle(), 0, "the sender still holds the cell");
        sender.send(Arc::clone(&value));
        assert_eq!(
            Arc::strong_count(&value),
            1,
            "the value was dropped, not kept"
        );
        assert_eq!(pool.idle(), 0);
    }

    #[test]
    fn threads_that_send_and_receive_at_once_never_share_a_cell() {
        // Senders on another thread, receivers polled by tokio; every value arrives at its
        // own receiver, whatever order the two halves let go in.
        let runtime = crate::test_runtime();
        let pool: &'static AnswerPool<u64> = Box::leak(Box::default());
        runtime.block_on(async move {
            for round in 0..2_000u64 {
                let mut senders = Vec::new();
                let mut receivers = Vec::new();
                for i in 0..8 {
                    let (sender, receiver) = pool.channel();
                    senders.push((round * 8 + i, sender));
                    receivers.push((round * 8 + i, receiver));
                }
                let sending = std::thread::spawn(move || {
                    for (value, sender) in senders {
                        sender.send(value);
                    }
                });
                for (expected, receiver) in receivers {
                    assert_eq!(receiver.await, Ok(expected));
                }
                sending.join().unwrap();
            }
        });
        assert!(pool.idle() <= 8, "at most one round's cells are idle");
    }
}
