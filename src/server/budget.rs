//! The server-wide byte budget: what all connections together may hold in write payloads
//! and unsent read data, beyond one request each.
//!
//! Each connection's own budget (`pipeline::BYTE_BUDGET`, 256 MiB) bounds one client, but
//! not one client with many connections: twelve connections that never read their replies
//! held 3.2 GB. Now a connection holding nothing may always admit one request (so none
//! starves, and a request of the largest size is never refused outright), and anything
//! more comes from the shared [`SERVER_BYTE_BUDGET`], taken and given back in [`CHUNK`]s:
//! one atomic operation per 8 MiB of traffic, none per request. All connections together
//! hold at most the shared budget plus one request (up to 32 MiB) each, and
//! `--max-connections` (default 128) bounds how many they are: 5 GiB in all by default.
//!
//! A connection refused more waits on its own replies: it holds something, so its own
//! progress wakes it to try again. The last [`FIRST_CHUNK_RESERVE`] of the shared budget
//! goes only to connections taking their first chunk, so those holding a lot cannot leave
//! a small client with one request in flight.

use std::sync::atomic::{AtomicU64, Ordering};

/// Budget bytes all connections together may hold beyond one request each.
pub const SERVER_BYTE_BUDGET: u64 = 1 << 30;
/// The unit in which a connection takes from and gives back to the shared budget.
pub const CHUNK: u64 = 8 << 20;
/// The part of the shared budget only a connection's first chunk may take: connections
/// that hold a lot (slow readers of large replies) cannot spend it, so a client with
/// small requests still gets more than one in flight beside them (soak review, session
/// 67: beside 8 connections that queued 32 MiB reads and never read, a 4 KiB reader at
/// QD8 was held to one request at a time).
pub const FIRST_CHUNK_RESERVE: u64 = 8 * CHUNK;

/// The bytes taken from the shared budget by all connections.
static SERVER_TAKEN: AtomicU64 = AtomicU64::new(0);

/// One connection's part of the shared budget, given back when dropped.
pub struct BudgetShare {
    taken: u64,
    pool: &'static AtomicU64,
    limit: u64,
    /// The last part of `limit` only a first chunk may take.
    reserve: u64,
}

impl Default for BudgetShare {
    fn default() -> BudgetShare {
        BudgetShare::of(&SERVER_TAKEN, SERVER_BYTE_BUDGET, FIRST_CHUNK_RESERVE)
    }
}

impl BudgetShare {
    /// A share of `pool` (bytes taken by all), which may not pass `limit`, nor `limit -
    /// reserve` but for a first chunk.
    fn of(pool: &'static AtomicU64, limit: u64, reserve: u64) -> BudgetShare {
        BudgetShare {
            taken: 0,
            pool,
            limit,
            reserve,
        }
    }

    /// Whether a connection holding `held` bytes may admit another request: holding
    /// nothing, or less than it took from the pool, or after taking from the pool the
    /// chunks that cover what it holds, if the pool has them. (A request may take a
    /// connection past what it had covered; the next call covers it.)
    pub fn may_admit(&mut self, held: u64) -> bool {
        if held == 0 || held < self.taken {
            return true;
        }
        let want = (held + 1 - self.taken).div_ceil(CHUNK) * CHUNK;
        let limit = if self.taken == 0 && want == CHUNK {
            self.limit
        } else {
            self.limit.saturating_sub(self.reserve)
        };
        let before = self.pool.fetch_add(want, Ordering::AcqRel);
        if before + want > limit {
            self.pool.fetch_sub(want, Ordering::AcqRel);
            return false;
        }
        self.taken += want;
        true
    }

    /// The connection now holds `held` bytes: chunks it no longer needs (keeping one
    /// spare, so a steady flow does not take and give back the same chunk) go back, and
    /// all of them once it holds nothing: idle connections kept a chunk each for good, and
    /// ten of them held the whole reserve (re-review, session 67).
    pub fn release(&mut self, held: u64) {
        if held == 0 && self.taken > 0 {
            self.pool.fetch_sub(self.taken, Ordering::AcqRel);
            self.taken = 0;
            return;
        }
        while self.taken >= CHUNK && held + 2 * CHUNK <= self.taken {
            self.taken -= CHUNK;
            self.pool.fetch_sub(CHUNK, Ordering::AcqRel);
        }
    }
}

impl Drop for BudgetShare {
    fn drop(&mut self) {
        self.pool.fetch_sub(self.taken, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_share_the_pool_and_one_holding_nothing_is_never_refused() {
        static POOL: AtomicU64 = AtomicU64::new(0);
        let limit = 3 * CHUNK;
        let mut first = BudgetShare::of(&POOL, limit, 0);
        let mut second = BudgetShare::of(&POOL, limit, 0);
        // Holding nothing, a request is admitted without the pool.
        assert!(first.may_admit(0));
        assert_eq!(POOL.load(Ordering::Acquire), 0);
        // Holding something, chunks covering it come from the pool until it is spent.
        assert!(first.may_admit(1));
        assert!(first.may_admit(CHUNK));
        assert!(second.may_admit(CHUNK - 1));
        assert_eq!(POOL.load(Ordering::Acquire), 3 * CHUNK);
        assert!(!second.may_admit(CHUNK), "the pool is spent");
        assert!(!first.may_admit(2 * CHUNK));
        // A connection the pool refuses still admits when it holds nothing.
        let mut third = BudgetShare::of(&POOL, limit, 0);
        assert!(third.may_admit(0));
        // One far past what it covered is covered whole at the next call, or refused.
        assert!(!third.may_admit(4 * CHUNK), "more than the pool holds");
        assert_eq!(third.taken, 0);
        // Given back as the holder drains, one chunk kept spare while it holds something,
        // all of it when it holds nothing or is dropped.
        first.release(1);
        assert_eq!(first.taken, 2 * CHUNK);
        first.release(0);
        assert_eq!(first.taken, 0);
        assert!(second.may_admit(CHUNK));
        drop(first);
        drop(second);
        drop(third);
        assert_eq!(POOL.load(Ordering::Acquire), 0);
    }

    #[test]
    fn the_reserve_goes_only_to_first_chunks() {
        static POOL: AtomicU64 = AtomicU64::new(0);
        let (limit, reserve) = (6 * CHUNK, 2 * CHUNK);
        let mut big = BudgetShare::of(&POOL, limit, reserve);
        // A connection holding a lot takes the pool up to the reserve, and no further.
        assert!(big.may_admit(4 * CHUNK - 1));
        assert_eq!(POOL.load(Ordering::Acquire), 4 * CHUNK);
        assert!(!big.may_admit(5 * CHUNK - 1), "the reserve is not for it");
        // Its first chunk still comes out of the reserve for a new one, for two of them.
        let mut small = BudgetShare::of(&POOL, limit, reserve);
        let mut other = BudgetShare::of(&POOL, limit, reserve);
        assert!(small.may_admit(4096));
        assert!(other.may_admit(4096));
        // But not a second chunk, nor a first one past the whole pool.
        assert!(!small.may_admit(CHUNK + 4096));
        let mut late = BudgetShare::of(&POOL, limit, reserve);
        assert!(!late.may_admit(4096), "the pool is spent");
        assert!(
            late.may_admit(0),
            "holding nothing, one request is always admitted"
        );
        // A first request larger than a chunk is no first chunk: not from the reserve.
        drop(small);
        let mut large = BudgetShare::of(&POOL, limit, reserve);
        assert!(!large.may_admit(2 * CHUNK));
        // An idle connection gives its chunk back: idle ones cannot sit on the reserve.
        other.release(0);
        assert!(late.may_admit(4096));
        drop((big, other, large, late));
        assert_eq!(POOL.load(Ordering::Acquire), 0);
    }
}
