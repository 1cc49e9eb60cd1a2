//! The server-wide byte budget: what all connections together may hold in write payloads
//! and unsent read data, beyond a share each connection always has.
//!
//! Each connection's own budget (`pipeline::BYTE_BUDGET`, 256 MiB) bounds one client, but
//! not one client with many connections: twelve connections that never read their replies
//! held 3.2 GB. Now a connection holds up to [`GUARANTEED`] whatever the others do (so
//! none starves, and each still takes a request of the largest size), and more only from
//! the shared [`SERVER_BYTE_BUDGET`], taken and given back in [`CHUNK`]s: one atomic
//! operation per 8 MiB of traffic, none per request.
//!
//! A connection refused more waits on its own replies: it holds at least [`GUARANTEED`],
//! so its own progress wakes it to try again.

use std::sync::atomic::{AtomicU64, Ordering};

/// Budget bytes every connection may hold beyond its guaranteed share, together.
pub const SERVER_BYTE_BUDGET: u64 = 1 << 30;
/// What a connection may hold whatever the others hold: a request of the largest size
/// (32 MiB) with room to spare.
pub const GUARANTEED: u64 = 48 << 20;
/// The unit in which a connection takes from and gives back to the shared budget.
pub const CHUNK: u64 = 8 << 20;

/// The bytes taken from the shared budget by all connections.
static SERVER_TAKEN: AtomicU64 = AtomicU64::new(0);

/// One connection's part of the shared budget, given back when dropped.
pub struct BudgetShare {
    taken: u64,
    pool: &'static AtomicU64,
    limit: u64,
}

impl Default for BudgetShare {
    fn default() -> BudgetShare {
        BudgetShare::of(&SERVER_TAKEN, SERVER_BYTE_BUDGET)
    }
}

impl BudgetShare {
    /// A share of `pool` (bytes taken by all), which may not pass `limit`.
    fn of(pool: &'static AtomicU64, limit: u64) -> BudgetShare {
        BudgetShare {
            taken: 0,
            pool,
            limit,
        }
    }

    /// Whether a connection holding `held` bytes may admit another request: below its
    /// guaranteed share plus what it took from the pool, or after taking from the pool
    /// the chunks that cover what it holds, if the pool has them. (A request may take a
    /// connection past what it had covered; the next call covers it.)
    pub fn may_admit(&mut self, held: u64) -> bool {
        let covered = GUARANTEED + self.taken;
        if held < covered {
            return true;
        }
        let want = (held + 1 - covered).div_ceil(CHUNK) * CHUNK;
        let before = self.pool.fetch_add(want, Ordering::AcqRel);
        if before + want > self.limit {
            self.pool.fetch_sub(want, Ordering::AcqRel);
            return false;
        }
        self.taken += want;
        true
    }

    /// The connection now holds `held` bytes: chunks it no longer needs (keeping one
    /// spare, so a steady flow does not take and give back the same chunk) go back.
    pub fn release(&mut self, held: u64) {
        while self.taken >= CHUNK && held + 2 * CHUNK <= GUARANTEED + self.taken {
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
    fn connections_share_the_pool_beyond_their_guaranteed_part() {
        static POOL: AtomicU64 = AtomicU64::new(0);
        let limit = 3 * CHUNK;
        let mut first = BudgetShare::of(&POOL, limit);
        let mut second = BudgetShare::of(&POOL, limit);
        // Below the guaranteed part nothing is taken from the pool.
        assert!(first.may_admit(GUARANTEED - 1));
        assert_eq!(POOL.load(Ordering::Acquire), 0);
        // Past it, chunks come from the pool until it is spent.
        assert!(first.may_admit(GUARANTEED));
        assert!(first.may_admit(GUARANTEED + CHUNK));
        assert!(second.may_admit(GUARANTEED));
        assert_eq!(POOL.load(Ordering::Acquire), 3 * CHUNK);
        assert!(!second.may_admit(GUARANTEED + CHUNK), "the pool is spent");
        assert!(!first.may_admit(GUARANTEED + 2 * CHUNK));
        // A connection the pool refuses still admits within its guaranteed part.
        let mut third = BudgetShare::of(&POOL, limit);
        assert!(third.may_admit(0));
        // A request that took the holder far past what it had covered is covered whole
        // at the next call, or refused.
        let mut fourth = BudgetShare::of(&POOL, limit);
        assert!(
            !fourth.may_admit(GUARANTEED + 4 * CHUNK),
            "more than the pool holds"
        );
        assert_eq!(fourth.taken, 0);
        // Given back as the holder drains, one chunk kept spare; all of it when dropped.
        first.release(GUARANTEED);
        assert_eq!(first.taken, CHUNK);
        assert!(second.may_admit(GUARANTEED + CHUNK));
        drop(first);
        drop(second);
        drop(third);
        drop(fourth);
        assert_eq!(POOL.load(Ordering::Acquire), 0);
    }
}
