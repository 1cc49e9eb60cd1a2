//! Generation identifiers (DRBD's data UUIDs): which node's data is newer, and whether two
//! nodes' histories diverged (split brain), decided from four numbers per node.
//!
//! - `current` names the data as it is now. A primary that starts writing without a peer
//!   (or is promoted) starts a new generation: the old `current` moves to `bitmap`.
//! - `bitmap` is the generation the out-of-sync bitmap is relative to: while it is set,
//!   the bitmap holds every region written since the peer last had generation `bitmap`.
//! - `history` holds the two generations before that, for telling "older, needs a full
//!   resync" from "unrelated".

/// A node's generation identifiers. Zero means "none".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Generations {
    pub current: u64,
    pub bitmap: u64,
    pub history: [u64; 2],
}

/// The `current` of a node whose metadata was just created: its data is not known to
/// equal anybody's.
pub const JUST_CREATED: u64 = 4;

/// What two nodes must do about their data when they connect, seen from "mine".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncDecision {
    /// Same generation: only regions set in either bitmap need resync.
    InSync,
    /// My data is newer: I am the resync source; the peer's data is a known ancestor, so
    /// my bitmap covers every difference.
    SourceFromBitmap,
    /// The peer's data is newer and my bitmap covers the differences: I am the target.
    TargetFromBitmap,
    /// My data is newer but the bitmap does not cover the difference: resync everything.
    SourceFull,
    /// The peer's data is newer; resync everything to me.
    TargetFull,
    /// Both wrote since they last agreed: refuse to connect until an operator decides.
    SplitBrain,
    /// No common history: refuse to connect.
    Unrelated,
}

impl Generations {
    /// Fresh metadata.
    pub fn just_created() -> Generations {
        Generations {
            current: JUST_CREATED,
            ..Generations::default()
        }
    }

    /// Starts a new data generation (a primary writing without its peers, or a forced
    /// promotion): `current` moves to `bitmap` unless a bitmap generation is already
    /// open, in which case the bitmap keeps tracking since that older point.
    pub fn start_new(&mut self, new_current: u64) {
        if self.bitmap == 0 {
            self.bitmap = self.current;
        } else {
            self.push_history(self.current);
        }
        self.current = new_current;
    }

    /// A resync target's primary started generation `new_current` in the middle of the
    /// target's pass: the writes that follow are of the new generation, and this node's
    /// bitmaps do not track them for the peers that miss them. So no bitmap generation
    /// stays open here: the old ones go to history, and a node that still holds one of
    /// them later compares as older without a bitmap (a full resync from this node), never
    /// as equal.
    pub fn take_primary_generation(&mut self, new_current: u64) {
        if new_current == self.current || new_current == 0 {
            return;
        }
        let (old_current, old_bitmap) = (self.current, self.bitmap);
        self.bitmap = 0;
        self.push_history(old_bitmap);
        if old_current != JUST_CREATED {
            self.push_history(old_current);
        }
        self.current = new_current;
    }

    /// The peers are in sync again: the bitmap generation becomes history.
    pub fn close_bitmap(&mut self) {
        if self.bitmap != 0 {
            let old = self.bitmap;
            self.bitmap = 0;
            self.push_history(old);
        }
    }

    /// After a full or bitmap resync as target: take the source's identifiers.
    pub fn adopt(&mut self, source: &Generations) {
        let mine = self.current;
        self.current = source.current;
        self.bitmap = 0;
        self.history = source.history;
        if self.history[0] != mine && mine != JUST_CREATED {
            self.push_history(mine);
        }
    }

    fn push_history(&mut self, generation: u64) {
        if generation == 0 || self.history[0] == generation {
            return;
        }
        self.history = [generation, self.history[0]];
    }

    /// Compares my identifiers with a peer's.
    pub fn compare(&self, peer: &Generations) -> SyncDecision {
        let (me, them) = (self, peer);
        if me.current == JUST_CREATED && them.current == JUST_CREATED {
            return SyncDecision::InSync;
        }
        if me.current == JUST_CREATED {
            return SyncDecision::TargetFull;
        }
        if them.current == JUST_CREATED {
            return SyncDecision::SourceFull;
        }
        if me.current == them.current {
            return SyncDecision::InSync;
        }
        let me_ahead_by_bitmap = me.bitmap != 0 && me.bitmap == them.current;
        let them_ahead_by_bitmap = them.bitmap != 0 && them.bitmap == me.current;
        match (me_ahead_by_bitmap, them_ahead_by_bitmap) {
            (true, false) => return SyncDecision::SourceFromBitmap,
            (false, true) => return SyncDecision::TargetFromBitmap,
            _ => {}
        }
        // Both opened a new generation from the same one: both wrote alone.
        if me.bitmap != 0 && me.bitmap == them.bitmap {
            return SyncDecision::SplitBrain;
        }
        let known = |history: &[u64; 2], gen: u64| gen != 0 && history.contains(&gen);
        let i_know_theirs = known(&me.history, them.current) || me.bitmap == them.current;
        let they_know_mine = known(&them.history, me.current) || them.bitmap == me.current;
        match (i_know_theirs, they_know_mine) {
            (true, false) => SyncDecision::SourceFull,
            (false, true) => SyncDecision::TargetFull,
            (true, true) => SyncDecision::SplitBrain,
            (false, false) => {
                let shared = |a: &Generations, b: &Generations| {
                    [a.bitmap, a.history[0], a.history[1]]
                        .iter()
                        .any(|&g| g != 0 && [b.bitmap, b.history[0], b.history[1]].contains(&g))
                };
                if shared(me, them) {
                    SyncDecision::SplitBrain
                } else {
                    SyncDecision::Unrelated
                }
            }
        }
    }
}

/// A new random generation identifier (never 0 or [`JUST_CREATED`]). From `getrandom`,
/// which needs no file descriptor: a node out of descriptors must still be able to start
/// a generation when it loses a peer.
pub fn random_generation() -> std::io::Result<u64> {
    let mut bytes = [0u8; 8];
    let mut filled = 0;
    while filled < bytes.len() {
        filled +=
            rustix::rand::getrandom(&mut bytes[filled..], rustix::rand::GetRandomFlags::empty())?;
    }
    // The low bit is set so the value is never one of the small reserved ones.
    Ok(u64::from_le_bytes(bytes) | 1 << 63 | 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gens(current: u64, bitmap: u64, history: [u64; 2]) -> Generations {
        Generations {
            current,
            bitmap,
            history,
        }
    }

    #[test]
    fn a_primary_that_wrote_alone_is_the_bitmap_source() {
        let mut primary = gens(10, 0, [0, 0]);
        let secondary = primary;
        primary.start_new(20);
        assert_eq!(primary, gens(20, 10, [0, 0]));
        assert_eq!(primary.compare(&secondary), SyncDecision::SourceFromBitmap);
        assert_eq!(secondary.compare(&primary), SyncDecision::TargetFromBitmap);
        // A second new generation while still degraded keeps the bitmap base.
        primary.start_new(30);
        assert_eq!(primary.bitmap, 10);
        assert_eq!(primary.compare(&secondary), SyncDecision::SourceFromBitmap);
    }

    #[test]
    fn resync_completion_makes_both_equal() {
        let mut primary = gens(20, 10, [0, 0]);
        let mut secondary = gens(10, 0, [0, 0]);
        primary.close_bitmap();
        secondary.adopt(&primary);
        assert_eq!(primary, gens(20, 0, [10, 0]));
        assert_eq!(secondary.current, 20);
        assert_eq!(primary.compare(&secondary), SyncDecision::InSync);
    }

    #[test]
    fn both_writing_alone_is_split_brain_seen_from_both_sides() {
        let base = gens(10, 0, [0, 0]);
        let mut a = base;
        let mut b = base;
        a.start_new(20);
        b.start_new(30);
        assert_eq!(a.compare(&b), SyncDecision::SplitBrain);
        assert_eq!(b.compare(&a), SyncDecision::SplitBrain);
    }

    /// A target that took its primary's new generation mid-pass, and a node still at the
    /// old one: the target is the source of a full resync, never "in sync".
    #[test]
    fn a_target_that_took_a_new_generation_mid_pass_is_a_full_source_for_the_old_one() {
        let old = gens(0x100, 0, [0, 0]);
        let mut target = old;
        target.take_primary_generation(0x200);
        assert_eq!(target, gens(0x200, 0, [0x100, 0]));
        assert_eq!(target.compare(&old), SyncDecision::SourceFull);
        assert_eq!(old.compare(&target), SyncDecision::TargetFull);
        // The primary that started it (bitmap base 0x100) and the target agree.
        let mut primary = old;
        primary.start_new(0x200);
        assert_eq!(target.compare(&primary), SyncDecision::InSync);
        // Taking the generation it already has changes nothing.
        let before = target;
        target.take_primary_generation(0x200);
        assert_eq!(target, before);
    }

    #[test]
    fn fresh_and_old_and_unrelated_nodes() {
        let fresh = Generations::just_created();
        assert_eq!(fresh.compare(&fresh), SyncDecision::InSync);
        let used = gens(10, 0, [0, 0]);
        assert_eq!(fresh.compare(&used), SyncDecision::TargetFull);
        assert_eq!(used.compare(&fresh), SyncDecision::SourceFull);
        // The peer's current is in my history: it is older and I have no bitmap for it.
        let newer = gens(30, 0, [20, 10]);
        assert_eq!(newer.compare(&used), SyncDecision::SourceFull);
        assert_eq!(used.compare(&newer), SyncDecision::TargetFull);
        let stranger = gens(99, 0, [98, 0]);
        assert_eq!(newer.compare(&stranger), SyncDecision::Unrelated);
    }

    #[test]
    fn random_generations_avoid_reserved_values() {
        let a = random_generation().unwrap();
        let b = random_generation().unwrap();
        assert_ne!(a, b);
        for g in [a, b] {
            assert!(g != 0 && g != JUST_CREATED);
        }
    }
}
