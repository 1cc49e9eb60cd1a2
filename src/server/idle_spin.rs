//! The idle spin: a connection whose client keeps few requests in flight busy-polls its
//! socket for a few tens of microseconds before its task sleeps, because on a VM the
//! wake-up costs more than the spin (see [`IdleSpin`] for the measurements and the rules).

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;

use super::receive::{receive_into_spare_room, Received, RECEIVE_MOST};
use crate::backend::Backend;

/// Longest busy-poll of an idle connection's socket before its task sleeps.
const SPIN_MAX: Duration = Duration::from_micros(50);
/// First window once requests are seen to follow each other closely.
const SPIN_START: Duration = Duration::from_micros(25);
/// Idle periods up to this long could have been caught by a spin (the wake-up itself adds
/// tens of microseconds to an idle period that ends in a sleep): they widen the window;
/// longer ones narrow it.
const SPIN_WORTH: Duration = Duration::from_micros(100);
/// Connections spinning at once, across the server.
static SPINNERS: AtomicUsize = AtomicUsize::new(0);
/// Connections in the transmission phase, across the server.
pub(super) static CONNECTIONS: AtomicUsize = AtomicUsize::new(0);
/// Longest poll for the completion of the one request a connection waits on.
const SPIN_IO_MAX: Duration = Duration::from_micros(200);
/// A spin needs this many short busy periods in a row before it (and running a lone
/// request on the connection's thread, this many single-request periods).
const SPIN_AFTER_PERIODS: u32 = 8;
/// A busy period of at most this many requests is short: the client keeps few requests in
/// flight and waits for replies before it sends more, so the server's wake-up is on its
/// critical path.
const SPIN_BUSY_MAX: u32 = 16;
/// Waits a closed I/O window stays closed before it is tried again.
const IO_SPIN_RETRY: u32 = 512;

/// What an idle spin ended with.
pub(super) enum SpinOutcome {
    /// Request bytes arrived and are in the read buffer.
    Bytes,
    /// The client closed its side.
    Closed,
    /// The receive failed.
    Failed(std::io::Error),
    /// No spin, or nothing came within the window: sleep until the reactor wakes the task.
    Sleep,
}

/// Busy-polling of an idle connection whose client keeps few requests in flight, adaptive
/// in the manner of the kernel's haltpoll cpuidle governor.
///
/// At iodepth 1 every request costs two cross-CPU wake-ups: the client's when its reply
/// arrives, and the server's when the next request does. On a VM each is an IPI and a
/// vCPU exit; on the 2-vCPU benchmark machine that is most of a 55 µs round trip (pinned to
/// the client's CPU, the same server answers in 17 µs). Receiving without blocking for a
/// few tens of microseconds after the last reply catches the next request without the
/// second wake-up: 4 KiB reads at iodepth 1 went from 53–59 µs to 24–26 µs.
///
/// Moving the connection's thread to the client's CPU (which `SO_INCOMING_CPU` names on
/// loopback) would save both wake-ups, and with both pinned by hand it did (29k reads a
/// second at 17 µs of server CPU each, against 20k at 42 µs, on the AMD VM of session
/// 42). But with only the server pinned the rate fell to 8k: the scheduler wakes the
/// unpinned client on the idle CPU, away from the server, so a server that followed the
/// client would chase it (`bench/RESULTS.md`, session 42).
///
/// The same holds at iodepth 4 to 16: the server answers everything it has, sleeps, and
/// is woken when the client, having taken in the replies, sends again; by then most of the
/// client's next requests have arrived, so the two sides take turns and the machine idles
/// (4 KiB sequential writes at iodepth 8: server 57%, fio 75%, machine 38% idle; nbdkit,
/// whose threads answer each request as it comes, kept both CPUs busy at 1.3–1.4× the
/// rate). With the spin the server catches each request as it arrives and the client
/// takes each reply as it leaves (`bench/ab.py`, 3 rounds, memory / file, IOPS without →
/// with: 4 KiB reads at iodepth 8 127k → 173k / 137k → 172k, writes 119k → 147k /
/// 88k → 113k; random reads at iodepth 256 148k → 171k / 167k → 188k; at iodepth 32
/// 183k → 179k / 189k → 191k, and over 5 rounds the same server CPU per request either
/// way: 5.04 / 5.05 µs memory, 4.11 / 4.07 µs file).
///
/// A spin burns a CPU that the client or another connection may need, so it happens only
///   * when the busy period before it was short, at most [`SPIN_BUSY_MAX`] requests, and
///     [`SPIN_AFTER_PERIODS`] of them came in a row. (Sessions 7 and 8 allowed only single
///     requests, and paused spinning when most spins caught a request within 8 µs: at
///     iodepth 32, before request coalescing, spinning through a CPU-bound client's
///     2–8 µs gaps raised the server's CPU per request from 5.7 to 8.2 µs. With coalescing
///     it no longer does, see above, and that pause is what kept iodepth 8 from spinning:
///     its client answers within a few microseconds, which a sleep turns into a wake-up);
///   * only while the server has no more connections than half its workers, and for at
///     most that many at once: a spinning task holds its worker, and four connections at
///     iodepth 1 fell from 92k to 61–75k IOPS when one of them spun;
///   * with a window that doubles (from [`SPIN_START`] to [`SPIN_MAX`]) after each idle
///     period shorter than [`SPIN_WORTH`] and halves, down to no spin at all, after each
///     longer one, so an idle or slow client costs almost nothing.
pub(super) struct IdleSpin {
    window: Duration,
    /// When the connection last went idle, until the next request bytes arrive.
    idle_since: Option<Instant>,
    /// Requests parsed since the connection was last idle.
    requests_since_idle: u32,
    /// Busy periods in a row that were a single request each.
    singles: u32,
    /// Busy periods in a row of at most [`SPIN_BUSY_MAX`] requests each.
    short_periods: u32,
    /// How long to poll the backend for the completion of a lone request.
    io_window: Duration,
    /// Waits left before a closed I/O window is tried again.
    io_retry: u32,
    /// How many connections may spin at once.
    max_spinners: usize,
    /// Reads the time: `Instant::now`, except in tests, whose clock does not depend on
    /// how the test thread is scheduled.
    now: fn() -> Instant,
}

impl IdleSpin {
    pub(super) fn new() -> Self {
        // Connection threads of their own count as workers (see `ConnectionThreads`).
        let workers = tokio::runtime::Handle::try_current()
            .map(|h| h.metrics().num_workers())
            .unwrap_or(1)
            .max(super::CONNECTION_THREADS.load(Ordering::Acquire));
        IdleSpin {
            window: Duration::ZERO,
            idle_since: None,
            requests_since_idle: 0,
            singles: 0,
            short_periods: 0,
            io_window: SPIN_IO_MAX,
            io_retry: 0,
            max_spinners: workers / 2,
            now: Instant::now,
        }
    }

    /// The connection has nothing in flight and nothing to send: spins on `fd` for the
    /// current window if this idle period qualifies, appending what arrives to `inbuf`.
    /// `connections` is how many the server has now.
    pub(super) fn wait(
        &mut self,
        fd: Option<BorrowedFd<'_>>,
        inbuf: &mut BytesMut,
        connections: usize,
    ) -> SpinOutcome {
        let started = (self.now)();
        self.idle_since = Some(started);
        self.busy_period_ended();
        let qualifies = self.few_in_flight(connections) && !self.window.is_zero();
        let Some(fd) = fd.filter(|_| qualifies) else {
            return SpinOutcome::Sleep;
        };
        let Some(_slot) = SpinSlot::take(self.max_spinners) else {
            return SpinOutcome::Sleep;
        };
        loop {
            match receive_into_spare_room(fd, inbuf, RECEIVE_MOST) {
                Ok(Received::Closed) => return SpinOutcome::Closed,
                Ok(Received::Bytes(_)) => {
                    self.got_bytes();
                    return SpinOutcome::Bytes;
                }
                Ok(Received::Nothing) => {}
                Err(e) => return SpinOutcome::Failed(e),
            }
            if self.since(started) >= self.window {
                return SpinOutcome::Sleep;
            }
            std::hint::spin_loop();
        }
    }

    /// Ends the connection's busy period: counts whether it was a single request, and a
    /// short one. Idling does; so does a flush ahead of the client's
    /// (`super::flush_ahead`), after which the connection waits for the client's FLUSH.
    pub(super) fn busy_period_ended(&mut self) {
        let busy = std::mem::take(&mut self.requests_since_idle);
        let run = |count: &mut u32, counts: bool| {
            *count = if counts { count.saturating_add(1) } else { 0 };
        };
        run(&mut self.singles, busy <= 1);
        run(&mut self.short_periods, busy <= SPIN_BUSY_MAX);
    }

    /// Whether the connection is in the pattern an idle spin pays for: a run of short busy
    /// periods, and few enough connections on the server.
    pub(super) fn few_in_flight(&self, connections: usize) -> bool {
        self.short_periods >= SPIN_AFTER_PERIODS && connections <= self.max_spinners
    }

    /// Whether the connection has sent one request per busy period for a while, and the
    /// server has few enough connections: a client that waits for each reply.
    pub(super) fn one_at_a_time(&self, connections: usize) -> bool {
        self.singles >= SPIN_AFTER_PERIODS && self.few_connections(connections)
    }

    /// Whether the server has few enough connections for one of them to keep a worker
    /// busy with a spin, or with a system call of its own (`uring::alone`).
    pub(super) fn few_connections(&self, connections: usize) -> bool {
        connections <= self.max_spinners
    }

    /// The connection waits on a single request in the backend: in the pattern of one
    /// request at a time ([`IdleSpin::one_at_a_time`]), polls the backend's completions for
    /// up to the I/O window
    /// instead of sleeping until the reaper wakes the task; true when some were handed
    /// out (the caller polls its request again).
    ///
    /// An O_DIRECT read or an fdatasync at iodepth 1 otherwise ends in two wake-ups
    /// before its reply leaves: the reactor's for the ring's eventfd, then the
    /// connection's. The window narrows after each miss (a device slower than it is not
    /// worth a CPU) and, once closed, is tried again after [`IO_SPIN_RETRY`] waits.
    pub(super) fn wait_for_backend(&mut self, backend: &dyn Backend, connections: usize) -> bool {
        if self.io_window.is_zero() {
            self.io_retry = self.io_retry.saturating_sub(1);
            if self.io_retry > 0 {
                return false;
            }
            self.io_window = SPIN_START;
        }
        if !self.one_at_a_time(connections) {
            return false;
        }
        let Some(_slot) = SpinSlot::take(self.max_spinners) else {
            return false;
        };
        let Some(before) = backend.poll_completions() else {
            return false;
        };
        let started = (self.now)();
        loop {
            // A change means a completion was handed out, by this poll or by the reaper;
            // perhaps another connection's, and then the caller comes back.
            if backend.poll_completions() != Some(before) {
                self.io_window = (self.io_window * 2).min(SPIN_IO_MAX);
                return true;
            }
            if self.since(started) >= self.io_window {
                self.io_window /= 2;
                if self.io_window < SPIN_START {
                    self.io_window = Duration::ZERO;
                    self.io_retry = IO_SPIN_RETRY;
                }
                return false;
            }
            std::hint::spin_loop();
        }
    }

    /// Time passed since `then`, by the spin's clock.
    fn since(&self, then: Instant) -> Duration {
        (self.now)().saturating_duration_since(then)
    }

    /// A request header was parsed.
    pub(super) fn request(&mut self) {
        self.requests_since_idle += 1;
    }

    /// Request bytes arrived: adapts the window to how long the connection was idle.
    pub(super) fn got_bytes(&mut self) {
        let Some(since) = self.idle_since.take() else {
            return;
        };
        let idle = self.since(since);
        if idle <= self.window {
            return;
        }
        if idle <= SPIN_WORTH {
            self.window = (self.window * 2).clamp(SPIN_START, SPIN_MAX);
        } else {
            self.window /= 2;
            if self.window < SPIN_START {
                self.window = Duration::ZERO;
            }
        }
    }
}

/// One of the [`SPINNERS`] places, given back when dropped.
struct SpinSlot;

impl SpinSlot {
    fn take(max: usize) -> Option<SpinSlot> {
        SPINNERS
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| SpinSlot)
    }
}

/// Counts a connection in [`CONNECTIONS`] while it lives.
pub(super) struct CountedConnection;

impl CountedConnection {
    pub(super) fn new() -> Self {
        CONNECTIONS.fetch_add(1, Ordering::Relaxed);
        CountedConnection
    }
}

impl Drop for CountedConnection {
    fn drop(&mut self) {
        CONNECTIONS.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Drop for SpinSlot {
    fn drop(&mut self) {
        SPINNERS.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::RecvFlags;
    use std::cell::Cell;
    use std::io::Write;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    /// Room for every test spinning at once: the slots are server-wide.
    const TEST_SPINNERS: usize = 64;

    /// How far the tests' clock moves at each reading.
    const TICK: Duration = Duration::from_micros(1);

    thread_local! {
        /// The time by the tests' clock, on this test's thread.
        static TEST_TIME: Cell<Option<Instant>> = const { Cell::new(None) };
    }

    /// A clock that moves [`TICK`] at each reading and otherwise only when a test moves
    /// it: a spin that waits for bytes ends after `window / TICK` readings, and a test
    /// thread preempted while the other tests run sees no idle time it did not ask for.
    fn ticking_now() -> Instant {
        TEST_TIME.with(|time| {
            let now = time.get().unwrap_or_else(Instant::now) + TICK;
            time.set(Some(now));
            now
        })
    }

    /// Moves the tests' clock on by `by`, as a client that stays idle that long.
    fn pass(by: Duration) {
        TEST_TIME.with(|time| time.set(Some(ticking_now() + by)));
    }

    fn spinner() -> IdleSpin {
        IdleSpin {
            max_spinners: TEST_SPINNERS,
            window: SPIN_MAX,
            now: ticking_now,
            ..IdleSpin::new()
        }
    }

    /// Idle periods of one request each, with nothing arriving: spins that time out.
    fn single_periods(spin: &mut IdleSpin, fd: &UnixStream, n: u32) {
        periods_of(spin, fd, 1, n);
    }

    /// Busy periods of `requests` requests each, with nothing arriving after them.
    fn periods_of(spin: &mut IdleSpin, fd: &UnixStream, requests: u32, n: u32) {
        for _ in 0..n {
            for _ in 0..requests {
                spin.request();
            }
            let mut inbuf = BytesMut::new();
            assert!(matches!(
                spin.wait(Some(fd.as_fd()), &mut inbuf, 1),
                SpinOutcome::Sleep
            ));
            assert!(inbuf.is_empty());
        }
    }

    #[test]
    fn spins_only_after_a_run_of_short_busy_periods() {
        let (server, mut client) = UnixStream::pair().unwrap();
        let mut spin = spinner();
        client.write_all(b"request").unwrap();
        let mut inbuf = BytesMut::new();
        // Bytes are waiting, but no pattern yet: the task sleeps and the reactor reads.
        spin.request();
        assert!(matches!(
            spin.wait(Some(server.as_fd()), &mut inbuf, 1),
            SpinOutcome::Sleep
        ));
        assert!(inbuf.is_empty());
        let _ = rustix::net::recv(&server, &mut [0; 16], RecvFlags::DONTWAIT).unwrap();
        single_periods(&mut spin, &server, SPIN_AFTER_PERIODS - 1);
        spin.request();
        client.write_all(b"next").unwrap();
        assert!(matches!(
            spin.wait(Some(server.as_fd()), &mut inbuf, 1),
            SpinOutcome::Bytes
        ));
        assert_eq!(&inbuf[..], b"next");
        // A busy period of more than SPIN_BUSY_MAX requests breaks the run.
        for _ in 0..=SPIN_BUSY_MAX {
            spin.request();
        }
        client.write_all(b"more").unwrap();
        let mut inbuf = BytesMut::new();
        assert!(matches!(
            spin.wait(Some(server.as_fd()), &mut inbuf, 1),
            SpinOutcome::Sleep
        ));
        assert!(inbuf.is_empty());
    }

    #[test]
    fn no_spin_with_more_connections_than_spinners_or_without_a_socket() {
        let (server, mut client) = UnixStream::pair().unwrap();
        let mut spin = spinner();
        single_periods(&mut spin, &server, SPIN_AFTER_PERIODS);
        client.write_all(b"x").unwrap();
        let mut inbuf = BytesMut::new();
        spin.request();
        let crowd = TEST_SPINNERS + 1;
        assert!(matches!(
            spin.wait(Some(server.as_fd()), &mut inbuf, crowd),
            SpinOutcome::Sleep
        ));
        spin.request();
        assert!(matches!(spin.wait(None, &mut inbuf, 1), SpinOutcome::Sleep));
        spin.request();
        assert!(matches!(
            spin.wait(Some(server.as_fd()), &mut inbuf, 1),
            SpinOutcome::Bytes
        ));
    }

    #[test]
    fn a_closed_peer_ends_the_spin() {
        let (server, client) = UnixStream::pair().unwrap();
        let mut spin = spinner();
        single_periods(&mut spin, &server, SPIN_AFTER_PERIODS);
        drop(client);
        spin.request();
        let mut inbuf = BytesMut::new();
        assert!(matches!(
            spin.wait(Some(server.as_fd()), &mut inbuf, 1),
            SpinOutcome::Closed
        ));
    }

    #[test]
    fn the_window_narrows_for_slow_clients_and_widens_for_quick_ones() {
        let (server, _client) = UnixStream::pair().unwrap();
        let mut spin = spinner();
        single_periods(&mut spin, &server, 1);
        pass(SPIN_WORTH * 3);
        spin.got_bytes();
        assert_eq!(spin.window, SPIN_MAX / 2);
        single_periods(&mut spin, &server, 1);
        pass(SPIN_WORTH * 3);
        spin.got_bytes();
        assert_eq!(
            spin.window,
            Duration::ZERO,
            "below the first window: no spin at all"
        );
        // No spin now; a request soon after going idle opens the window again.
        single_periods(&mut spin, &server, 1);
        spin.got_bytes();
        assert_eq!(spin.window, SPIN_START);
    }

    #[test]
    fn short_periods_of_several_requests_qualify_a_spin_but_not_a_lone_request_run() {
        // iodepth 8: eight requests per busy period. The idle spin takes them; running a
        // lone request on the connection's thread (`uring::alone`) still needs single ones.
        let (server, mut client) = UnixStream::pair().unwrap();
        let mut spin = spinner();
        periods_of(&mut spin, &server, 8, SPIN_AFTER_PERIODS);
        assert!(spin.few_in_flight(1));
        assert!(!spin.one_at_a_time(1));
        for _ in 0..8 {
            spin.request();
        }
        client.write_all(b"next").unwrap();
        let mut inbuf = BytesMut::new();
        assert!(matches!(
            spin.wait(Some(server.as_fd()), &mut inbuf, 1),
            SpinOutcome::Bytes
        ));
        assert_eq!(&inbuf[..], b"next");
        periods_of(&mut spin, &server, 1, SPIN_AFTER_PERIODS);
        assert!(spin.one_at_a_time(1));
    }

    #[test]
    fn requests_that_follow_at_once_keep_the_spin_going() {
        // A client that answers within microseconds is exactly one a sleep would cost a
        // wake-up: however many spins catch a request at once, the next one still spins.
        // (By the wall clock, a test thread preempted twice while the others ran saw idle
        // periods long enough to close the window, and the test failed now and then.)
        let (server, mut client) = UnixStream::pair().unwrap();
        let mut spin = spinner();
        single_periods(&mut spin, &server, SPIN_AFTER_PERIODS);
        let mut inbuf = BytesMut::new();
        for _ in 0..1000 {
            client.write_all(b"r").unwrap();
            spin.request();
            assert!(matches!(
                spin.wait(Some(server.as_fd()), &mut inbuf, 1),
                SpinOutcome::Bytes
            ));
        }
        assert_eq!(inbuf.len(), 1000);
    }
}
