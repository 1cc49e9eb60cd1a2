//! Choosing, per connection, between splicing cached file reads into the socket and
//! copying them, by measuring which one the client takes faster.
//!
//! A spliced read hands the socket the page cache's own pages, so the client's copy reads
//! from each page at the file offset's place in it. On some CPUs that copy is an order of
//! magnitude slower when the client's buffer lies a few bytes past that place within a
//! page: on the AMD EPYC VM of session 39, `rep movsb` copied 2–3 GB/s instead of 27–36
//! with the destination 4 to 28 bytes past the source, and fio's buffers lie 16 bytes past
//! a page (glibc's `malloc` for large blocks). Against fio, copying read 1.6–2.1× faster
//! than splicing at every size from 64 KiB to 32 MiB; against nbd-load, whose data lands
//! at positions that move with each reply, splicing read 3.4× faster, and it costs the
//! server a third of the CPU (`bench/RESULTS.md`, session 39). The server cannot see the
//! client's buffers, so it measures, as request coalescing does (`super::coalesce`), in
//! the cycle the two share (`super::probe`). Copying means one copy since session 51: the
//! socket's `writev` takes the data from the export's mapping of its file
//! (`crate::backend::mapping`), not from a buffer the page cache was first read into.
//!
//! A probe runs four epochs: splicing, copying, copying, splicing, so that a steady drift
//! weighs on both sides alike. An epoch lets [`SETTLE_READS`] large reads pass, then
//! measures the rate of at least [`EPOCH_READS`] more and [`EPOCH_BYTES`]. Copying is chosen
//! when the two copying epochs together read faster than the two splicing ones by
//! [`COPY_MARGIN`]; otherwise splicing, the cheaper for the server, stays. The verdict
//! holds for a number of epochs that doubles while probes agree, then the connection
//! probes again.
//!
//! Until session 48 copying needed each copying epoch to beat both splicing ones by the
//! margin. An epoch lasts tens of milliseconds, and on the 2-vCPU VM one epoch in a probe
//! often fell short however large the gap: against fio's 1 MiB reads, whose copying epochs
//! read 1.47× faster on average (1.85 and 1.79 GB/s against 1.21 and 1.27), only 14 of 39
//! probes chose copying; the summed rates would have chosen it in 27. With `ab.py` (3
//! rounds, reads a second, fio QD8) the sums read 64 KiB at 29,057 against 22,194, 256 KiB
//! at 9,705 against 7,471, 1 MiB at 2,425 against 1,889 (copying always: 32,252, 9,097,
//! 2,481; `bench/RESULTS.md`, session 48).

use std::time::Instant;

use super::probe::{Probe, BLOCK_EPOCHS};

/// Epochs in a probe: one block.
const PROBE_EPOCHS: usize = BLOCK_EPOCHS;

/// Reads of at least this many bytes count: smaller ones are never spliced.
const LARGE_READ: u32 = crate::backend::splice::SPLICE_MIN as u32;
/// Large reads at the start of an epoch that are not measured: the client sends them as
/// replies of the epoch before arrive, so their pace is that epoch's.
const SETTLE_READS: u32 = 8;
/// Large reads measured per epoch, at least.
const EPOCH_READS: u32 = 16;
/// Bytes of large reads measured per epoch, at least.
const EPOCH_BYTES: u64 = 32 << 20;
/// The copying epochs together must read this much faster than the splicing ones.
const COPY_MARGIN: f64 = 1.25;
/// Epochs a first verdict holds before the next probe.
const MIN_HOLD_EPOCHS: u32 = 4;
/// The longest hold, reached by doubling while probes agree.
const MAX_HOLD_EPOCHS: u32 = 256;

/// One connection's choice between splicing and copying large cached reads.
#[derive(Debug)]
pub(super) struct SpliceProbe {
    /// The probe's cycle; its alternative is copying. Each epoch measures bytes a second.
    cycle: Probe<f64, PROBE_EPOCHS>,
    /// Large reads in the current epoch so far, settling ones included.
    epoch_reads: u32,
    /// When the current epoch's last settling read came: its measured span starts there.
    epoch_start: Option<Instant>,
    /// Bytes of the measured reads.
    epoch_bytes: u64,
}

impl Default for SpliceProbe {
    fn default() -> Self {
        SpliceProbe {
            cycle: Probe::new(MIN_HOLD_EPOCHS, MAX_HOLD_EPOCHS),
            epoch_reads: 0,
            epoch_start: None,
            epoch_bytes: 0,
        }
    }
}

impl SpliceProbe {
    /// Whether large cached reads are spliced now.
    pub(super) fn splicing(&self) -> bool {
        !self.cycle.alternative()
    }

    /// A read of `length` bytes was parsed; only large ones count. `clock` tells the time,
    /// and is asked only where an epoch's measured span starts or ends (twice an epoch),
    /// not for every read.
    pub(super) fn read(&mut self, length: u32, clock: impl FnOnce() -> Instant) {
        if length < LARGE_READ {
            return;
        }
        self.epoch_reads += 1;
        if self.epoch_reads <= SETTLE_READS {
            if self.epoch_reads == SETTLE_READS {
                self.epoch_start = Some(clock());
            }
            return;
        }
        self.epoch_bytes += u64::from(length);
        if self.epoch_reads < SETTLE_READS + EPOCH_READS || self.epoch_bytes < EPOCH_BYTES {
            return;
        }
        let now = clock();
        let start = self.epoch_start.unwrap_or(now);
        let seconds = now.duration_since(start).as_secs_f64().max(1e-9);
        let rate = self.epoch_bytes as f64 / seconds;
        self.epoch_reads = 0;
        self.epoch_start = None;
        self.epoch_bytes = 0;
        self.end_epoch(rate);
    }

    fn end_epoch(&mut self, rate: f64) {
        if let Some(verdict) = self.cycle.end_epoch(rate, copying_pays) {
            let (splice, hold, rates) = (!verdict.alternative, verdict.hold, verdict.measured);
            tracing::debug!(splice, hold, ?rates, "splice probed");
        }
    }
}

/// Whether a probe's two copying epochs together read faster than its two splicing
/// epochs by [`COPY_MARGIN`].
fn copying_pays(rates: &[f64; PROBE_EPOCHS]) -> bool {
    rates[1] + rates[2] > (rates[0] + rates[3]) * COPY_MARGIN
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::probe::Phase;
    use std::time::Duration;

    /// Feeds one epoch of 1 MiB reads taking `seconds` in all, from `*clock` on.
    fn epoch(probe: &mut SpliceProbe, clock: &mut Instant, seconds: f64) {
        let reads = SETTLE_READS + EPOCH_READS.max((EPOCH_BYTES >> 20) as u32);
        let step = Duration::from_secs_f64(seconds / f64::from(reads - 1));
        for i in 0..reads {
            if i > 0 {
                *clock += step;
            }
            let now = *clock;
            probe.read(1 << 20, || now);
        }
        *clock += step;
    }

    #[test]
    fn small_reads_do_not_count() {
        let mut probe = SpliceProbe::default();
        let now = Instant::now();
        for _ in 0..100_000 {
            probe.read(LARGE_READ - 1, || now);
        }
        assert_eq!(probe.cycle.phase(), Phase::Probing(0));
        assert_eq!((probe.epoch_reads, probe.epoch_bytes), (0, 0));
    }

    #[test]
    fn a_client_that_takes_copies_faster_gets_copies_and_is_probed_again() {
        let mut probe = SpliceProbe::default();
        let mut clock = Instant::now();
        // Splicing epochs take 2 s, copying ones 1 s: the client reads copies twice as fast.
        for n in 0..PROBE_EPOCHS {
            assert_eq!(probe.splicing(), n == 0 || n == 3, "epoch {n}");
            let seconds = if probe.splicing() { 2.0 } else { 1.0 };
            epoch(&mut probe, &mut clock, seconds);
        }
        assert!(!probe.splicing());
        assert_eq!(
            probe.cycle.phase(),
            Phase::Holding {
                alternative: true,
                epochs_left: MIN_HOLD_EPOCHS
            }
        );
        for _ in 0..=MIN_HOLD_EPOCHS {
            epoch(&mut probe, &mut clock, 1.0);
        }
        assert_eq!(probe.cycle.phase(), Phase::Probing(0));
        assert!(probe.splicing());
    }

    #[test]
    fn splicing_stays_unless_the_copying_epochs_together_win_by_the_margin() {
        // Level, copies faster by less than the margin, and one copying epoch fast only
        // as far as the other is slow: splicing stays.
        for rates in [
            [2.0, 2.0, 2.0, 2.0],
            [2.0, 2.4, 2.4, 2.0],
            [2.0, 3.0, 1.9, 2.0],
            [1.0, 2.0, 2.0, 2.5],
        ] {
            assert!(!copying_pays(&rates), "{rates:?}");
        }
        // Copies faster by the margin, though one copying epoch fell short of a splicing
        // one (fio's 1 MiB reads, session 48): copying.
        for rates in [[1.0, 2.0, 2.0, 1.2], [1.24, 1.21, 1.78, 1.12]] {
            assert!(copying_pays(&rates), "{rates:?}");
        }
    }

    #[test]
    fn agreeing_probes_hold_longer_up_to_the_cap() {
        let mut probe = SpliceProbe::default();
        let mut clock = Instant::now();
        let mut holds = Vec::new();
        for _ in 0..10 {
            for _ in 0..PROBE_EPOCHS {
                epoch(&mut probe, &mut clock, 1.0);
            }
            let Phase::Holding {
                alternative,
                epochs_left,
            } = probe.cycle.phase()
            else {
                panic!("not holding after a probe: {:?}", probe.cycle.phase());
            };
            assert!(!alternative, "level rates keep splicing");
            holds.push(epochs_left);
            for _ in 0..=epochs_left {
                epoch(&mut probe, &mut clock, 1.0);
            }
        }
        assert_eq!(holds, [4, 8, 16, 32, 64, 128, 256, 256, 256, 256]);
    }
}
