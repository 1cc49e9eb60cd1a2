//! Request coalescing for a connection that keeps many requests in flight: a short nap
//! before reading lets the requests the client is still sending gather, so one round of
//! system calls (one receive, one vectored send of the replies) serves many of them. It
//! is the adaptive interrupt moderation of network cards (the kernel's `net_dim`), done on
//! the socket, and it is chosen by measuring, not by rule.
//!
//! Measured reason: fio+libnbd at iodepth 32 sends one request per system call, and a
//! memory export answers each as it arrives, so every round served 1.3–1.5 requests at
//! the cost of a receive, a send and an `epoll_wait` (0.65–0.8 `writev` per request).
//! With a 20 µs nap after the replies, a round served about ten and the server's CPU per
//! 4 KiB read fell from 10–12 µs to 6 µs, while IOPS rose from 75–88k to 96–98k (the
//! client got the CPU the server no longer spent). But the same nap halved IOPS at
//! iodepth 4 and 8, where the nap gathers every request the client has and then waits for
//! nothing. No fixed rule tells the two apart from the server's side, so the connection
//! measures: it alternates epochs with and without naps ([`Coalesce::replied`]) and naps
//! only while napping saves CPU per request without losing throughput.
//!
//! The probe's epochs run without, with, with, without naps, and napping must win both
//! pairs: a workload that grows cheaper as it warms up would otherwise favour whichever
//! epochs came later. That happened with 4 KiB random writes at iodepth 32 to a file
//! whose page cache was clean: the first probe saw 46 µs of CPU per write and later ones
//! 24, a plain alternation chose naps, and naps cost those writes about a third of their
//! rate for the whole hold (naps forced on and off in alternating runs: 24–39k/s with,
//! 37–48k/s without). A verdict therefore holds briefly at first and longer each time a
//! probe repeats it.
//!
//! A nap only ever happens when the read right after the replies found requests already
//! waiting, or when the round just answered held at least [`NAP_WITHOUT_LOOKING`] requests
//! (then requests are waiting, and looking first would only cost a receive): a client that
//! waits for each reply (iodepth 1) never sees one. It blocks the worker thread, so it
//! happens only while the server has a single connection.

use std::cell::Cell;
use std::num::NonZeroU64;
use std::os::fd::BorrowedFd;
use std::time::Duration;

use bytes::BytesMut;
use rustix::io::Errno;
use rustix::net::RecvFlags;

use super::probe::{Probe, PROBE_EPOCHS};

/// How long a nap lasts.
pub const NAP: Duration = Duration::from_micros(20);
/// Requests per measuring epoch.
const EPOCH_REQUESTS: u32 = 1024;
/// Epochs a new verdict holds before the next probe ...
const MIN_HOLD_EPOCHS: u32 = 8;
/// ... doubling each time a probe repeats it, up to this many.
const MAX_HOLD_EPOCHS: u32 = 128;
/// A round of at least this many requests means the client streams them: the next
/// gather naps without first receiving to see whether requests wait.
///
/// Measured with fio 4 KiB random reads at iodepth 32 on a memory export: 7–10 requests
/// wait when the replies have gone (session 24), so the first receive always finds some,
/// and skipping it saves one of a round's three receives. Server CPU per read 2.96–3.12
/// µs looking first, 2.83–2.91 without (at 8), with the rate 232–244k against 246–254k;
/// random writes at iodepth 32 2.96–2.99 against 2.79–2.83 µs, at 243k against 264–267k.
/// Thresholds of 4 and 16 did the same (RESULTS, session 25).
const NAP_WITHOUT_LOOKING: u32 = 8;
/// Bytes one receive of [`Coalesce::gather`] takes at most.
const SCRATCH: usize = 64 * 1024;
/// Napping epochs with fewer naps than one per this many requests did not nap.
const MAX_REQUESTS_PER_NAP: u64 = 32;
/// Napping is kept when it loses at most this share of the request rate ...
const MAX_RATE_LOSS: f64 = 0.03;
/// ... and saves at least this share of the CPU time per request.
const MIN_CPU_SAVING: f64 = 0.10;

/// Wall-clock and CPU time, in nanoseconds, at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Clocks {
    pub wall: u64,
    pub cpu: u64,
}

impl Clocks {
    /// Now: monotonic wall time and the process's CPU time.
    pub fn now() -> Clocks {
        use rustix::time::{clock_gettime, ClockId};
        let ns = |t: rustix::time::Timespec| t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64;
        Clocks {
            wall: ns(clock_gettime(ClockId::Monotonic)),
            cpu: ns(clock_gettime(ClockId::ProcessCPUTime)),
        }
    }
}

/// What a set of epochs took.
#[derive(Clone, Copy, Debug, Default)]
struct Totals {
    wall: u64,
    cpu: u64,
    requests: u64,
    naps: u64,
}

impl Totals {
    /// An epoch from `from` to `to` of `requests` requests and `naps` naps.
    fn between(from: Clocks, to: Clocks, requests: u32, naps: u32) -> Totals {
        Totals {
            wall: to.wall.saturating_sub(from.wall),
            cpu: to.cpu.saturating_sub(from.cpu),
            requests: u64::from(requests),
            naps: u64::from(naps),
        }
    }

    fn plus(self, other: Totals) -> Totals {
        Totals {
            wall: self.wall + other.wall,
            cpu: self.cpu + other.cpu,
            requests: self.requests + other.requests,
            naps: self.naps + other.naps,
        }
    }
}

/// Whether napping paid in a probe whose epochs ran without, with, with and without
/// naps: naps happened (at least one per [`MAX_REQUESTS_PER_NAP`] requests; at iodepth 1
/// there is never anything to nap for, and a difference between the epochs is noise), the
/// napping epochs together lost no more than [`MAX_RATE_LOSS`] of the request rate, and
/// each napping epoch saved at least [`MIN_CPU_SAVING`] of the CPU per request against
/// its neighbour without naps.
///
/// The rate is judged on the sums because one epoch's rate varies by ±10% on its own
/// (measured at iodepth 32, 5 ms epochs), and the sums in this order cancel a steady
/// drift. The CPU saving is judged pair by pair, so that a drift that is not steady (a
/// warm-up) cannot pass for a saving: it would favour one pair and not the other.
fn napping_pays(probe: &[Totals; PROBE_EPOCHS]) -> bool {
    let [first, second, third, fourth] = *probe;
    if probe.iter().any(|t| t.requests == 0 || t.wall == 0) {
        return false;
    }
    let (without, with) = (first.plus(fourth), second.plus(third));
    if with.naps * MAX_REQUESTS_PER_NAP < with.requests {
        return false;
    }
    let rate = |t: Totals| t.requests as f64 / t.wall as f64;
    let cpu = |t: Totals| t.cpu as f64 / t.requests as f64;
    let saves = |without: Totals, with: Totals| cpu(with) <= cpu(without) * (1.0 - MIN_CPU_SAVING);
    rate(with) >= rate(without) * (1.0 - MAX_RATE_LOSS)
        && saves(first, second)
        && saves(fourth, third)
}

/// One connection's coalescing state.
pub struct Coalesce {
    /// The probe's cycle; its alternative is napping.
    cycle: Probe<Totals>,
    /// When the current epoch began (`None`: not measuring, for example while other
    /// connections exist).
    epoch_start: Option<Clocks>,
    epoch_requests: u32,
    epoch_naps: u32,
    /// Receive buffer for [`Coalesce::gather`], which reads past the reactor.
    scratch: Vec<u8>,
    /// Requests parsed since every reply was last written.
    round_requests: u32,
    /// The round that just ended held at least [`NAP_WITHOUT_LOOKING`] requests.
    streaming: bool,
}

/// What [`Coalesce::gather`] found.
pub enum Gathered {
    /// No requests were waiting: no nap.
    Nothing,
    /// Request bytes were appended to the read buffer.
    Bytes,
    /// The client closed its side.
    Closed,
    /// The receive failed.
    Failed(std::io::Error),
}

impl Default for Coalesce {
    fn default() -> Self {
        Coalesce {
            cycle: Probe::new(MIN_HOLD_EPOCHS, MAX_HOLD_EPOCHS),
            epoch_start: None,
            epoch_requests: 0,
            epoch_naps: 0,
            scratch: Vec::new(),
            round_requests: 0,
            streaming: false,
        }
    }
}

impl Coalesce {
    /// A request was parsed.
    pub fn request(&mut self) {
        self.epoch_requests = self.epoch_requests.saturating_add(1);
        self.round_requests = self.round_requests.saturating_add(1);
    }

    /// Every reply has been written and nothing is in flight; `connections` is how many
    /// the server has. At the end of an epoch, reads the clocks and moves the probe on.
    /// Returns whether to [`Coalesce::gather`] now.
    pub fn replied(&mut self, connections: usize) -> bool {
        self.streaming = std::mem::take(&mut self.round_requests) >= NAP_WITHOUT_LOOKING;
        if connections != 1 {
            self.epoch_start = None;
            self.cycle.restart();
            return false;
        }
        if self.epoch_start.is_none() {
            self.epoch_start = Some(Clocks::now());
            self.epoch_requests = 0;
        } else if self.epoch_requests >= EPOCH_REQUESTS {
            self.end_epoch(Clocks::now());
        }
        self.napping()
    }

    /// Reads what requests are waiting on `fd`, without the reactor; if there were some,
    /// naps so that those the client is still sending join them, and reads again. After a
    /// round of [`NAP_WITHOUT_LOOKING`] requests or more, naps first and reads once.
    pub fn gather(&mut self, fd: BorrowedFd<'_>, inbuf: &mut BytesMut) -> Gathered {
        if self.scratch.is_empty() {
            self.scratch = vec![0; SCRATCH];
        }
        // After a long round requests are waiting for sure: no need to look first.
        let found_before = if self.streaming {
            false
        } else {
            match self.receive(fd, inbuf) {
                // A full buffer is a round's work already (a large write's payload, which
                // takes longer to arrive than a nap lasts): napping would only delay it. At
                // 1 MiB writes, iodepth 8, naps cost a third of the rate.
                Ok(SCRATCH) => return Gathered::Bytes,
                Ok(_) => true,
                Err(done) => return done,
            }
        };
        self.epoch_naps = self.epoch_naps.saturating_add(1);
        nap();
        match self.receive(fd, inbuf) {
            Ok(_) => Gathered::Bytes,
            Err(Gathered::Nothing) if found_before => Gathered::Bytes,
            Err(done) => done,
        }
    }

    /// Appends what waits on `fd` to `inbuf` and returns how many bytes that was, or
    /// [`Gathered::Nothing`], [`Gathered::Closed`] or [`Gathered::Failed`].
    fn receive(&mut self, fd: BorrowedFd<'_>, inbuf: &mut BytesMut) -> Result<usize, Gathered> {
        match rustix::net::recv(fd, &mut self.scratch, RecvFlags::DONTWAIT) {
            Ok(0) => Err(Gathered::Closed),
            Ok(n) => {
                inbuf.extend_from_slice(&self.scratch[..n]);
                Ok(n)
            }
            Err(Errno::AGAIN) | Err(Errno::INTR) => Err(Gathered::Nothing),
            Err(e) => Err(Gathered::Failed(e.into())),
        }
    }

    /// Whether the current epoch naps.
    fn napping(&self) -> bool {
        self.cycle.alternative()
    }

    fn end_epoch(&mut self, now: Clocks) {
        let start = self.epoch_start.replace(now).unwrap_or(now);
        let requests = std::mem::take(&mut self.epoch_requests);
        let naps = std::mem::take(&mut self.epoch_naps);
        let took = Totals::between(start, now, requests, naps);
        if let Some(verdict) = self.cycle.end_epoch(took, napping_pays) {
            let (nap, hold, probe) = (verdict.alternative, verdict.hold, verdict.measured);
            tracing::debug!(nap, hold, ?probe, "request coalescing probed");
        }
    }
}

/// Sleeps for [`NAP`]. The thread's timer slack is set to 1 µs first (once per thread):
/// the default slack of 50 µs would stretch a 20 µs nap to 70.
pub fn nap() {
    thread_local! {
        static SLACK_SET: Cell<bool> = const { Cell::new(false) };
    }
    SLACK_SET.with(|set| {
        if !set.get() {
            set.set(true);
            let _ = rustix::thread::set_current_timer_slack(NonZeroU64::new(1_000));
        }
    });
    std::thread::sleep(NAP);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::probe::Phase;

    fn totals(wall_us: u64, cpu_us: u64, requests: u64) -> Totals {
        Totals {
            wall: wall_us * 1_000,
            cpu: cpu_us * 1_000,
            requests,
            naps: requests / 10,
        }
    }

    /// Whether napping pays in a probe whose epochs without naps took `without` and those
    /// with naps `with`.
    fn pays(without: Totals, with: Totals) -> bool {
        napping_pays(&[without, with, with, without])
    }

    #[test]
    fn napping_pays_only_when_it_saves_cpu_without_losing_rate() {
        // iodepth 32 as measured: more requests per second, far less CPU each.
        assert!(pays(
            totals(10_000, 10_000, 880),
            totals(10_000, 6_000, 980)
        ));
        // iodepth 8 as measured: the nap halves the rate, even though CPU falls.
        assert!(!pays(
            totals(10_000, 10_000, 900),
            totals(10_000, 5_000, 490)
        ));
        // The same rate, but too small a saving to be worth a nap's latency.
        assert!(!pays(
            totals(10_000, 10_000, 1000),
            totals(10_000, 9_500, 1000)
        ));
        // A rate within the tolerance and a real saving: napping is kept.
        assert!(pays(
            totals(10_000, 10_000, 1000),
            totals(10_000, 8_000, 980)
        ));
        // Epochs that were to nap but found nothing waiting (iodepth 1): their
        // difference is noise.
        let mut no_naps = totals(10_000, 5_000, 1000);
        no_naps.naps = 0;
        assert!(!pays(totals(10_000, 10_000, 1000), no_naps));
        // Nothing measured: no nap.
        assert!(!pays(Totals::default(), totals(10_000, 1_000, 100)));
    }

    /// Drives `c` through one epoch that took `wall_ms` and `cpu_ms`, starting at `at`.
    fn epoch(c: &mut Coalesce, at: &mut Clocks, wall_ms: u64, cpu_ms: u64, requests: u32) {
        for _ in 0..requests {
            c.request();
        }
        if c.napping() {
            c.epoch_naps = requests / 10;
        }
        at.wall += wall_ms * 1_000_000;
        at.cpu += cpu_ms * 1_000_000;
        c.end_epoch(*at);
    }

    fn started() -> (Coalesce, Clocks) {
        let mut c = Coalesce::default();
        let at = Clocks {
            wall: 1_000_000_000,
            cpu: 1_000_000_000,
        };
        c.epoch_start = Some(at);
        (c, at)
    }

    /// Runs one probe where napping epochs take `nap_cpu_ms` of CPU and the others 6 ms,
    /// each in 6 ms of wall time; returns which epochs napped.
    fn probe(c: &mut Coalesce, at: &mut Clocks, nap_cpu_ms: u64) -> Vec<bool> {
        let mut naps = Vec::new();
        for _ in 0..PROBE_EPOCHS {
            naps.push(c.napping());
            let cpu = if c.napping() { nap_cpu_ms } else { 6 };
            epoch(c, at, 6, cpu, EPOCH_REQUESTS);
        }
        naps
    }

    #[test]
    fn a_probe_naps_in_its_middle_epochs_and_a_repeated_verdict_holds_longer() {
        let (mut c, mut at) = started();
        // Napping epochs: the same requests in the same time for half the CPU.
        assert_eq!(probe(&mut c, &mut at, 3), [false, true, true, false]);
        let mut holds = Vec::new();
        for _ in 0..6 {
            let Phase::Holding {
                alternative: nap,
                epochs_left,
            } = c.cycle.phase()
            else {
                panic!("{:?}", c.cycle.phase())
            };
            assert!(nap);
            holds.push(epochs_left);
            for _ in 0..=epochs_left {
                assert!(c.napping());
                epoch(&mut c, &mut at, 6, 3, EPOCH_REQUESTS);
            }
            assert_eq!(c.cycle.phase(), Phase::Probing(0));
            probe(&mut c, &mut at, 3);
        }
        assert_eq!(holds, [8, 16, 32, 64, 128, 128]);
        // A changed verdict holds briefly again.
        for _ in 0..=MAX_HOLD_EPOCHS {
            epoch(&mut c, &mut at, 6, 3, EPOCH_REQUESTS);
        }
        probe(&mut c, &mut at, 6);
        assert_eq!(
            c.cycle.phase(),
            Phase::Holding {
                alternative: false,
                epochs_left: MIN_HOLD_EPOCHS
            }
        );
    }

    #[test]
    fn a_probe_where_naps_cost_throughput_turns_them_off() {
        let (mut c, mut at) = started();
        for _ in 0..PROBE_EPOCHS {
            // Napping epochs take twice as long for the same requests.
            let wall = if c.napping() { 12 } else { 6 };
            epoch(&mut c, &mut at, wall, 4, EPOCH_REQUESTS);
        }
        assert!(!c.napping());
        assert!(!c.replied(1));
    }

    #[test]
    fn a_workload_that_grows_cheaper_as_it_warms_up_does_not_look_like_naps_paying() {
        let (mut c, mut at) = started();
        // Each epoch costs 20% less CPU than the one before, naps or not.
        let mut cpu = 20.0_f64;
        for _ in 0..PROBE_EPOCHS {
            epoch(&mut c, &mut at, 6, cpu as u64, EPOCH_REQUESTS);
            cpu *= 0.8;
        }
        assert!(matches!(
            c.cycle.phase(),
            Phase::Holding {
                alternative: false,
                ..
            }
        ));
    }

    #[test]
    fn another_connection_stops_naps_and_restarts_the_probe() {
        let mut c = Coalesce {
            cycle: Probe::new(MIN_HOLD_EPOCHS, MAX_HOLD_EPOCHS).holding(true, MAX_HOLD_EPOCHS),
            ..Coalesce::default()
        };
        assert!(c.replied(1));
        assert!(!c.replied(2), "another connection shares the workers");
        assert_eq!(c.cycle.phase(), Phase::Probing(0));
        assert!(!c.replied(1), "the probe starts with an epoch without naps");
    }

    #[test]
    fn gather_naps_only_when_requests_are_waiting_and_collects_what_follows() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (server, mut client) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut c = Coalesce::default();
        let mut inbuf = BytesMut::new();
        assert!(matches!(
            c.gather(server.as_fd(), &mut inbuf),
            Gathered::Nothing
        ));
        assert_eq!(c.epoch_naps, 0, "no nap when nothing waits");
        // A request waiting, and another sent while the server naps.
        client.write_all(b"first").unwrap();
        let sender = std::thread::spawn(move || {
            std::thread::sleep(NAP / 4);
            client.write_all(b"second").unwrap();
            client
        });
        std::thread::sleep(NAP / 8);
        assert!(matches!(
            c.gather(server.as_fd(), &mut inbuf),
            Gathered::Bytes
        ));
        assert_eq!(c.epoch_naps, 1);
        let client = sender.join().unwrap();
        // The second write may land after the nap on a loaded machine; whatever came
        // is in order and complete up to where it stops.
        assert!(b"firstsecond".starts_with(&inbuf), "{inbuf:?}");
        assert!(inbuf.starts_with(b"first"));
        drop(client);
        inbuf.clear();
        let _ = c.gather(server.as_fd(), &mut inbuf);
        assert!(matches!(
            c.gather(server.as_fd(), &mut inbuf),
            Gathered::Closed
        ));
    }

    /// Ends a round of `requests` requests, then gathers.
    fn gather_after_round(
        c: &mut Coalesce,
        requests: u32,
        fd: BorrowedFd<'_>,
        inbuf: &mut BytesMut,
    ) -> Gathered {
        for _ in 0..requests {
            c.request();
        }
        c.replied(1);
        c.gather(fd, inbuf)
    }

    #[test]
    fn after_a_long_round_gather_naps_without_looking_first() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (server, mut client) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut c = Coalesce::default();
        let mut inbuf = BytesMut::new();
        let long = NAP_WITHOUT_LOOKING;
        // Nothing waits, yet the nap happens: the round said requests would.
        let gathered = gather_after_round(&mut c, long, server.as_fd(), &mut inbuf);
        assert!(matches!(gathered, Gathered::Nothing));
        assert_eq!(c.epoch_naps, 1);
        let gathered = gather_after_round(&mut c, 1, server.as_fd(), &mut inbuf);
        assert!(matches!(gathered, Gathered::Nothing));
        assert_eq!(c.epoch_naps, 1, "a round of one request looks first");
        // What waits is read by the one receive after the nap.
        client.write_all(b"request").unwrap();
        let gathered = gather_after_round(&mut c, long, server.as_fd(), &mut inbuf);
        assert!(matches!(gathered, Gathered::Bytes));
        assert_eq!((c.epoch_naps, &inbuf[..]), (2, &b"request"[..]));
    }

    #[test]
    fn gather_does_not_nap_when_a_full_buffer_waits() {
        use std::io::Write;
        use std::os::fd::AsFd;
        let (server, mut client) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut c = Coalesce::default();
        let mut inbuf = BytesMut::new();
        let payload = vec![7u8; SCRATCH + 100];
        client.write_all(&payload).unwrap();
        assert!(matches!(
            c.gather(server.as_fd(), &mut inbuf),
            Gathered::Bytes
        ));
        assert_eq!(c.epoch_naps, 0, "a large write's payload is work enough");
        assert_eq!(inbuf.len(), SCRATCH);
    }

    #[test]
    fn the_nap_lasts_about_as_long_as_asked() {
        let started = std::time::Instant::now();
        for _ in 0..10 {
            nap();
        }
        let took = started.elapsed();
        assert!(took >= NAP * 10, "{took:?}");
    }
}
