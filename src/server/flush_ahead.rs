//! Flushing ahead: when a client follows each write with a FLUSH and waits for each reply
//! (a database committing one transaction at a time, a journal commit), the connection
//! syncs the write as soon as its reply is out. The sync then runs while the reply and
//! the client's FLUSH cross the network, and the FLUSH finds nothing left to sync.
//!
//! Measured reason: 4 KiB write + FLUSH at iodepth 1 to a `--cache=none` file took
//! 108 µs a pair, of which the device took 52 µs (31 µs write, 21 µs sync) and the two
//! round trips the rest (fio `--fsync=1` against the same job on the file, session 37).
//! A sync started at the write's reply overlaps the second round trip.
//!
//! Only in that pattern: a sync nobody asks for costs the device a cache flush, so a
//! client that writes more than once between FLUSHes, or sends its FLUSH before the
//! write's reply, gets none. And only for backends that say it pays
//! ([`Backend::flush_ahead_pays`](crate::backend::Backend::flush_ahead_pays)): a file,
//! whose FLUSH skips the sync when no write completed since the last one.

use smallvec::SmallVec;

use crate::backend::BackendError;
use crate::log_limit::{warn_limited, FAILED_REQUESTS};
use crate::wire::transmission::ReplyEncoder;

use super::validate::Command;

/// FLUSHes in a row, each after exactly one write, before writes are flushed ahead.
const STREAK_BEFORE_FLUSHING_AHEAD: u32 = 8;

/// The pattern of one connection's requests, and the state of its flush ahead.
pub(super) struct FlushAhead {
    /// The backend's FLUSH is cheap after a sync (see the module's note).
    pays: bool,
    /// Writes (and other requests that leave data to sync) since the last FLUSH.
    writes_since_flush: u32,
    /// FLUSHes in a row that each came after exactly one write.
    streak: u32,
    /// A write in the pattern was parsed: flush once it is answered, if nothing else
    /// came meanwhile.
    armed: bool,
    /// A flush ahead is in flight.
    running: bool,
    /// The client's FLUSHes that came while it was: each waits for it (a sync of their own
    /// could succeed after it failed, see `failed`), then flushes as usual.
    waiting: SmallVec<[ReplyEncoder; 2]>,
    /// A flush ahead failed: the client's next FLUSH is answered with its error. The
    /// sync that failed may have consumed the file's error, so that a sync now could
    /// succeed although the data is lost.
    failed: Option<BackendError>,
}

/// What becomes of the client's FLUSH.
pub(super) enum FlushVerdict {
    /// Flush as usual.
    Flush,
    /// Answer with this error: a flush ahead failed since the last FLUSH.
    Fail(BackendError),
    /// A flush ahead is in flight: the FLUSH waits for it
    /// ([`FlushAhead::finished`] gives it back).
    Wait,
}

impl FlushAhead {
    pub(super) fn new(pays: bool) -> FlushAhead {
        FlushAhead {
            pays,
            writes_since_flush: 0,
            streak: 0,
            armed: false,
            running: false,
            waiting: SmallVec::new(),
            failed: None,
        }
    }

    /// A request was parsed and validated. Nothing to count on an export where a flush
    /// ahead does not pay: it never arms.
    pub(super) fn request(&mut self, command: &Command) {
        if !self.pays {
            return;
        }
        match *command {
            Command::Flush => {
                self.streak = if self.writes_since_flush == 1 {
                    self.streak.saturating_add(1)
                } else {
                    0
                };
                self.writes_since_flush = 0;
                self.armed = false;
            }
            Command::Write { fua, .. }
            | Command::Trim { fua, .. }
            | Command::WriteZeroes { fua, .. } => {
                self.writes_since_flush = self.writes_since_flush.saturating_add(1);
                let first_write = self.writes_since_flush == 1;
                if !first_write {
                    self.streak = 0;
                }
                let is_write = matches!(command, Command::Write { .. });
                self.armed = first_write && is_write && !fua && self.in_pattern();
            }
            Command::Read { .. }
            | Command::Cache { .. }
            | Command::BlockStatus { .. }
            | Command::Disconnect => {}
        }
    }

    /// Whether the client has followed each write with a FLUSH for a while.
    pub(super) fn in_pattern(&self) -> bool {
        self.pays && self.streak >= STREAK_BEFORE_FLUSHING_AHEAD
    }

    /// Every request so far is answered and its reply written: whether to flush now (the
    /// caller then does), only if `quiet` (no request bytes came meanwhile: the client's
    /// FLUSH may be among them). Disarms.
    pub(super) fn start_if_due(&mut self, quiet: bool) -> bool {
        let due = std::mem::take(&mut self.armed) && quiet && !self.running;
        self.running |= due;
        due
    }

    /// The client's FLUSH `enc` came.
    pub(super) fn flush(&mut self, enc: ReplyEncoder) -> FlushVerdict {
        if self.running {
            self.waiting.push(enc);
            return FlushVerdict::Wait;
        }
        match self.failed.take() {
            Some(failed) => FlushVerdict::Fail(failed),
            None => FlushVerdict::Flush,
        }
    }

    /// The flush ahead finished with `result`: hands each FLUSH that waited for it to
    /// `answer`, with the error it is to be answered with (`None`: flush as usual).
    pub(super) fn finished(
        &mut self,
        result: Result<(), BackendError>,
        mut answer: impl FnMut(ReplyEncoder, Option<BackendError>),
    ) {
        self.running = false;
        if let Err(e) = result {
            // Within the failed requests' limit: once FLUSH fails for good, each commit's
            // flush ahead fails (review, session 68: 3,248 lines in 3 s, unlimited).
            warn_limited!(
                FAILED_REQUESTS,
                "{e} (a flush ahead of the client's; its next FLUSH fails)"
            );
            self.failed.get_or_insert(e);
        }
        if self.waiting.is_empty() {
            // A failure stays for the client's next FLUSH.
            return;
        }
        // Every FLUSH that waited is answered with the failure, which is then reported.
        let failed = self.failed.take();
        for enc in std::mem::take(&mut self.waiting) {
            let error = failed
                .as_ref()
                .map(|e| BackendError::plain(e.op, e.offset, e.length, e.errno));
            answer(enc, error);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::transmission::ReplyStyle;
    use crate::wire::NbdError;

    fn write(fua: bool) -> Command {
        Command::Write {
            offset: 0,
            length: 4096,
            fua,
        }
    }

    fn read() -> Command {
        Command::Read {
            offset: 0,
            length: 4096,
            df: false,
        }
    }

    fn enc(cookie: u64) -> ReplyEncoder {
        ReplyEncoder {
            style: ReplyStyle::Structured,
            cookie,
            offset: 0,
        }
    }

    fn error(offset: u64) -> BackendError {
        BackendError::plain("flush", offset, 0, NbdError::Io)
    }

    /// Writes and FLUSHes in the pattern until the streak allows flushing ahead.
    fn in_the_pattern() -> FlushAhead {
        let mut ahead = FlushAhead::new(true);
        for _ in 0..STREAK_BEFORE_FLUSHING_AHEAD {
            assert!(!ahead.in_pattern());
            ahead.request(&write(false));
            assert!(!ahead.start_if_due(true), "flushed ahead before the streak");
            ahead.request(&Command::Flush);
        }
        assert!(ahead.in_pattern());
        ahead
    }

    /// What `finished` handed back: each waiting FLUSH's cookie and whether it failed.
    fn finish(ahead: &mut FlushAhead, result: Result<(), BackendError>) -> Vec<(u64, bool)> {
        let mut answered = Vec::new();
        ahead.finished(result, |enc, failed| {
            answered.push((enc.cookie, failed.is_some()))
        });
        answered
    }

    #[test]
    fn a_write_after_a_streak_of_write_flush_pairs_is_flushed_ahead_once() {
        let mut ahead = in_the_pattern();
        ahead.request(&read());
        ahead.request(&write(false));
        assert!(ahead.start_if_due(true));
        assert!(!ahead.start_if_due(true), "once per write");
        assert!(finish(&mut ahead, Ok(())).is_empty());
        assert!(matches!(ahead.flush(enc(1)), FlushVerdict::Flush));
        ahead.request(&Command::Flush);
        ahead.request(&write(false));
        assert!(ahead.start_if_due(true), "the streak goes on");
    }

    #[test]
    fn request_bytes_that_came_first_a_second_write_or_a_fua_write_disarm() {
        let mut ahead = in_the_pattern();
        ahead.request(&write(false));
        assert!(!ahead.start_if_due(false), "bytes came: perhaps the FLUSH");
        ahead.request(&Command::Flush);
        ahead.request(&write(false));
        ahead.request(&write(false));
        assert!(!ahead.start_if_due(true));
        ahead.request(&Command::Flush);
        assert!(
            !ahead.in_pattern(),
            "two writes before a FLUSH end the streak"
        );
        // Trims and zeroes count as writes too.
        let mut ahead = in_the_pattern();
        ahead.request(&Command::Trim {
            offset: 0,
            length: 4096,
            fua: false,
        });
        ahead.request(&write(false));
        assert!(!ahead.start_if_due(true));
        let mut ahead = in_the_pattern();
        ahead.request(&write(true));
        assert!(!ahead.start_if_due(true), "a FUA write is durable already");
        ahead.request(&write(false));
        ahead.request(&Command::Flush);
        assert!(
            !ahead.start_if_due(true),
            "the client's FLUSH was parsed already"
        );
    }

    #[test]
    fn a_backend_it_does_not_pay_for_never_flushes_ahead() {
        let mut ahead = FlushAhead::new(false);
        for _ in 0..2 * STREAK_BEFORE_FLUSHING_AHEAD {
            ahead.request(&write(false));
            assert!(!ahead.start_if_due(true));
            ahead.request(&Command::Flush);
        }
        assert!(!ahead.in_pattern());
    }

    #[test]
    fn flushes_that_come_while_it_runs_wait_for_it_and_take_its_failure() {
        let mut ahead = in_the_pattern();
        ahead.request(&write(false));
        assert!(ahead.start_if_due(true));
        ahead.request(&Command::Flush);
        assert!(matches!(ahead.flush(enc(1)), FlushVerdict::Wait));
        ahead.request(&Command::Flush);
        assert!(matches!(ahead.flush(enc(2)), FlushVerdict::Wait));
        assert_eq!(finish(&mut ahead, Ok(())), [(1, false), (2, false)]);
        ahead.request(&Command::Flush);
        assert!(matches!(ahead.flush(enc(3)), FlushVerdict::Flush));
        // Failed: every FLUSH that waited fails, and the next one does not.
        ahead.request(&write(false));
        assert!(
            !ahead.start_if_due(true),
            "two FLUSHes after one write end the streak"
        );
        let mut ahead = in_the_pattern();
        ahead.request(&write(false));
        assert!(ahead.start_if_due(true));
        ahead.request(&Command::Flush);
        assert!(matches!(ahead.flush(enc(4)), FlushVerdict::Wait));
        assert!(matches!(ahead.flush(enc(5)), FlushVerdict::Wait));
        assert_eq!(finish(&mut ahead, Err(error(1))), [(4, true), (5, true)]);
        assert!(matches!(ahead.flush(enc(6)), FlushVerdict::Flush));
    }

    #[test]
    fn a_failure_with_no_flush_waiting_fails_the_next_flush_only() {
        let mut ahead = in_the_pattern();
        ahead.request(&write(false));
        assert!(ahead.start_if_due(true));
        assert!(finish(&mut ahead, Err(error(1))).is_empty());
        ahead.request(&Command::Flush);
        match ahead.flush(enc(1)) {
            FlushVerdict::Fail(failed) => assert_eq!(failed.offset, 1),
            _ => panic!("the failure was not reported"),
        }
        assert!(
            matches!(ahead.flush(enc(2)), FlushVerdict::Flush),
            "reported once"
        );
    }
}
