//! A rate limit for warnings that every failed request would otherwise log: a disk that
//! fails, or a node whose metadata stopped, can fail thousands of requests a second, and a
//! line for each would flood the log (and spend the server's CPU on formatting) while
//! saying nothing new. Like the kernel's `printk_ratelimit`: a burst passes, the rest of
//! the window is counted, and the next warning that passes says how many were left out
//! (`suppressed=N`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Warnings logged per window before the rest of it is only counted.
const BURST: u32 = 10;
/// The window.
const WINDOW: Duration = Duration::from_secs(1);

/// One kind of warning's rate limit.
#[derive(Debug)]
pub struct LogLimit {
    state: Mutex<LimitState>,
}

#[derive(Debug)]
struct LimitState {
    /// When the current window began (`None` before the first warning).
    window_start: Option<Instant>,
    /// Warnings let through in the current window.
    passed: u32,
    /// Warnings left out since the last one that passed.
    left_out: u64,
}

/// `tracing::warn!` at the call site (its module stays the log line's target) when the
/// [`LogLimit`] given first admits it; a line that passes after some were left out carries
/// their number as the field `suppressed`.
macro_rules! warn_limited {
    ($limit:expr, $($arg:tt)+) => {
        if let Some(suppressed) = $limit.admit_now() {
            if suppressed == 0 {
                tracing::warn!($($arg)+);
            } else {
                tracing::warn!(suppressed, $($arg)+);
            }
        }
    };
}
pub(crate) use warn_limited;

/// Warnings about failed requests (backend errors answered to a client), server-wide.
pub static FAILED_REQUESTS: LogLimit = LogLimit::new();

/// Warnings about requests and options refused as invalid (a client's mistakes, which a
/// broken or hostile client can send as fast as the socket carries them), server-wide.
pub static REFUSED_REQUESTS: LogLimit = LogLimit::new();

/// Warnings about handshakes cut by the connection (a reset, an I/O error) or by the
/// handshake timeout: a client connecting and resetting in a loop logged a line each,
/// 5,000 in 0.8 s (review, session 67), server-wide.
pub static FAILED_HANDSHAKES: LogLimit = LogLimit::new();

/// Warnings about handshakes the server ended for what the client asked (a broken
/// option, an export that does not exist): limited apart from [`FAILED_HANDSHAKES`], so
/// that a flood of resets does not hide a misconfigured client (re-review, session 67).
pub static REFUSED_HANDSHAKES: LogLimit = LogLimit::new();

/// Warnings about connections closed because the server serves its most already (a
/// client reconnecting in a loop would otherwise log a line per attempt), server-wide.
pub static REFUSED_CONNECTIONS: LogLimit = LogLimit::new();

impl LogLimit {
    pub const fn new() -> LogLimit {
        LogLimit {
            state: Mutex::new(LimitState {
                window_start: None,
                passed: 0,
                left_out: 0,
            }),
        }
    }

    /// Whether a warning now is logged: `Some(suppressed)` with the number left out since
    /// the last one logged, `None` when this one is left out. [`warn_limited!`] is the
    /// way to use it.
    pub fn admit_now(&self) -> Option<u64> {
        self.admit(Instant::now())
    }

    /// Whether a warning at `now` is logged: `Some(left_out)` with the number left out
    /// since the last one logged, `None` when this one is left out.
    fn admit(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let window_over = match state.window_start {
            None => true,
            Some(start) => now.saturating_duration_since(start) >= WINDOW,
        };
        if window_over {
            state.window_start = Some(now);
            state.passed = 0;
        }
        if state.passed < BURST {
            state.passed += 1;
            Some(std::mem::take(&mut state.left_out))
        } else {
            state.left_out += 1;
            None
        }
    }
}

impl Default for LogLimit {
    fn default() -> Self {
        LogLimit::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_the_rest_of_the_window_is_counted_and_reported() {
        let limit = LogLimit::new();
        let start = Instant::now();
        for _ in 0..BURST {
            assert_eq!(limit.admit(start), Some(0));
        }
        let later = start + WINDOW / 2;
        for _ in 0..25 {
            assert_eq!(limit.admit(later), None);
        }
        let next_window = start + WINDOW;
        assert_eq!(limit.admit(next_window), Some(25));
        assert_eq!(limit.admit(next_window), Some(0));
    }

    #[test]
    fn warnings_spread_out_all_pass() {
        let limit = LogLimit::new();
        let start = Instant::now();
        for n in 0..100u32 {
            assert_eq!(limit.admit(start + WINDOW / BURST * n), Some(0));
        }
    }
}
