//! How much resync data may be on its way to a target at once: sized from the link's
//! measured delivery rate, so that a client write queued behind resync data on the peer
//! connection waits about [`QUEUE_TARGET`], however slow the link.
//!
//! The window covers data only. Checksum requests are small and take no range lock, so
//! they need no window of their own beyond the resync's run limit. Measured reasons:
//! - a window sized from the configured rate alone (8 MiB at 100M) queued seconds of data
//!   on a 10 Mbit/s link, and client writes waited behind it (7.93 s, session 68 review);
//! - a window in regions, sized from how long whole runs took (session 69, reverted),
//!   counted the checksum round trip as if it were data and stayed at one region over a
//!   30 ms round trip (32 MiB took 33 s, not 1 s), while runs of matching checksums, quick
//!   as they are, opened it to its full size in front of data that then flooded the link.
//!
//! Sizing follows BBR's idea: the delivery rate is the bytes acknowledged while a message
//! was on its way over the time it took (its best recent value), and the round trip is the
//! shortest one seen. The window is rate × (shortest round trip + [`QUEUE_TARGET`]): on a
//! link faster than the window can fill it grows by (1 + 100 ms / round trip) per round
//! trip; on a slow link it settles where about 100 ms of data waits in the queue.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// The queueing delay the window aims for, beyond the shortest round trip.
pub const QUEUE_TARGET: Duration = Duration::from_millis(100);
/// The window before any measurement: 0.2 s of a 10 Mbit/s link, and on a fast link the
/// first acknowledgement (within a millisecond) opens it to the cap.
const INITIAL_BYTES: u64 = 256 << 10;
/// The smallest window: two 64 KiB messages, so one is on the wire while the next waits.
const MIN_BYTES: u64 = 128 << 10;
/// How long the best rate sample is kept before a lower one may replace it.
const RATE_MEMORY: Duration = Duration::from_secs(1);

/// The resync data a pass has on its way to one target, and the window that bounds it.
pub struct DataWindow {
    state: Mutex<State>,
    freed: Notify,
    max_bytes: u64,
}

struct State {
    in_flight: u64,
    limit: u64,
    /// Bytes acknowledged in this pass.
    delivered: u64,
    min_round_trip: Option<Duration>,
    /// Bytes per second, and when it was measured.
    best_rate: Option<(f64, Instant)>,
}

/// Room for one message's bytes in the window, given back on drop. [`Credit::acked`]
/// also takes the message's measurement.
pub struct Credit<'a> {
    window: &'a DataWindow,
    bytes: u64,
    sent_at: Instant,
    delivered_at_send: u64,
}

impl DataWindow {
    /// A window of at most `max_bytes`.
    pub fn new(max_bytes: u64) -> DataWindow {
        DataWindow {
            state: Mutex::new(State {
                in_flight: 0,
                limit: INITIAL_BYTES.min(max_bytes),
                delivered: 0,
                min_round_trip: None,
                best_rate: None,
            }),
            freed: Notify::new(),
            max_bytes: max_bytes.max(MIN_BYTES),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The window now, in bytes.
    pub fn limit(&self) -> u64 {
        self.state().limit
    }

    /// The largest message worth sending now: a quarter of the window, so that several
    /// are on their way and an acknowledgement comes every quarter window, in whole 64 KiB
    /// regions between `region` and `most`.
    pub fn message_bytes(&self, region: u64, most: u64) -> u64 {
        (self.limit() / 4 / region * region).clamp(region, most.max(region))
    }

    /// Waits for room for `bytes` (always given when nothing is in flight, so a message
    /// larger than the window still goes, alone).
    pub async fn acquire(&self, bytes: u64) -> Credit<'_> {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            {
                let mut state = self.state();
                if state.in_flight == 0 || state.in_flight + bytes <= state.limit {
                    state.in_flight += bytes;
                    return Credit {
                        window: self,
                        bytes,
                        sent_at: Instant::now(),
                        delivered_at_send: state.delivered,
                    };
                }
            }
            freed.await;
        }
    }

    fn give_back(&self, bytes: u64) {
        self.state().in_flight -= bytes;
        self.freed.notify_waiters();
    }
}

impl Credit<'_> {
    /// The message leaves now: its round trip starts here, not at [`DataWindow::acquire`]
    /// (the pacer and a range lock may have held it since).
    pub fn sending(&mut self) {
        self.sent_at = Instant::now();
        self.delivered_at_send = self.window.state().delivered;
    }

    /// The message arrived: its round trip and the delivery rate while it travelled size
    /// the window.
    pub fn acked(self) {
        let now = Instant::now();
        {
            let mut state = self.window.state();
            state.delivered += self.bytes;
            let took = now
                .duration_since(self.sent_at)
                .max(Duration::from_micros(1));
            let min_round_trip = state.min_round_trip.map_or(took, |m| m.min(took));
            state.min_round_trip = Some(min_round_trip);
            let rate = (state.delivered - self.delivered_at_send) as f64 / took.as_secs_f64();
            let best = match state.best_rate {
                Some((best, at)) if best >= rate && now.duration_since(at) < RATE_MEMORY => best,
                _ => {
                    state.best_rate = Some((rate, now));
                    rate
                }
            };
            let wanted = best * (min_round_trip + QUEUE_TARGET).as_secs_f64();
            state.limit = (wanted as u64).clamp(MIN_BYTES, self.window.max_bytes);
        }
        // Dropped now: the bytes go back once.
    }
}

impl Drop for Credit<'_> {
    fn drop(&mut self) {
        self.window.give_back(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::stream::{FuturesUnordered, StreamExt};

    const CAP: u64 = 8 << 20;
    const REGION: u64 = 64 << 10;

    /// What a simulated resync saw on a link.
    struct Seen {
        /// Link time used over the run, after the first second.
        utilisation: f64,
        /// The longest a message waited behind others for the link, after the first second:
        /// what a client write sent then would wait.
        worst_queue: Duration,
    }

    /// Sends messages as the window allows over a link of `rate` bytes/s with one-way
    /// `delay`, for `duration` of paused time. Messages are a quarter window, as the
    /// resync sends them.
    async fn over_a_link(rate: f64, delay: Duration, duration: Duration) -> Seen {
        let window = DataWindow::new(CAP);
        let start = Instant::now();
        let warm = start + Duration::from_secs(1);
        let end = start + duration;
        let mut link_free = start;
        let (mut busy_after_warm, mut worst_queue) = (Duration::ZERO, Duration::ZERO);
        let mut acks = FuturesUnordered::new();
        while Instant::now() < end {
            let bytes = window.message_bytes(REGION, 16 * REGION);
            tokio::select! {
                credit = window.acquire(bytes) => {
                    let now = Instant::now();
                    let begins = link_free.max(now);
                    let serialise = Duration::from_secs_f64(bytes as f64 / rate);
                    link_free = begins + serialise;
                    if now >= warm {
                        worst_queue = worst_queue.max(begins - now);
                        busy_after_warm += serialise;
                    }
                    let acked_at = link_free + 2 * delay;
                    acks.push(async move {
                        tokio::time::sleep_until(acked_at).await;
                        credit.acked();
                    });
                }
                Some(()) = acks.next(), if !acks.is_empty() => {}
            }
        }
        Seen {
            utilisation: busy_after_warm.as_secs_f64() / (end - warm).as_secs_f64(),
            worst_queue,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn on_a_slow_link_the_queue_stays_near_the_target_and_the_link_busy() {
        // 10 Mbit/s, 0.1 ms each way.
        let seen = over_a_link(1.25e6, Duration::from_micros(100), Duration::from_secs(6)).await;
        assert!(seen.utilisation > 0.9, "{}", seen.utilisation);
        // 100 ms, plus the shortest round trip (a 64 KiB message takes 52 ms to send).
        assert!(
            seen.worst_queue < Duration::from_millis(200),
            "{:?}",
            seen.worst_queue
        );
    }

    #[tokio::test(start_paused = true)]
    async fn over_a_long_round_trip_the_window_opens_to_fill_the_link() {
        // 1 Gbit/s, 30 ms round trip: 3.75 MB in flight fill it.
        let seen = over_a_link(125e6, Duration::from_millis(15), Duration::from_secs(4)).await;
        assert!(seen.utilisation > 0.9, "{}", seen.utilisation);
        assert!(
            seen.worst_queue < Duration::from_millis(150),
            "{:?}",
            seen.worst_queue
        );
    }

    #[tokio::test(start_paused = true)]
    async fn on_a_fast_short_link_the_window_reaches_its_cap() {
        let window = DataWindow::new(CAP);
        let credit = window.acquire(INITIAL_BYTES).await;
        tokio::time::advance(Duration::from_micros(500)).await;
        credit.acked();
        assert_eq!(window.limit(), CAP);
        assert_eq!(window.message_bytes(REGION, 16 * REGION), 16 * REGION);
        assert_eq!(window.state().in_flight, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_larger_than_the_window_goes_alone_and_dropped_credit_comes_back() {
        let window = DataWindow::new(CAP);
        let big = window.acquire(4 * INITIAL_BYTES).await;
        // The window is full: the next waits until the big one is given back.
        let waiting = window.acquire(REGION);
        tokio::pin!(waiting);
        let early = tokio::time::timeout(Duration::from_secs(1), waiting.as_mut()).await;
        assert!(early.is_err(), "room given while the window was full");
        drop(big);
        let small = waiting.await;
        assert_eq!(window.state().in_flight, REGION);
        drop(small);
        assert_eq!(window.state().in_flight, 0);
        // No measurement was taken from dropped credit.
        assert_eq!(window.limit(), INITIAL_BYTES);
    }
}
