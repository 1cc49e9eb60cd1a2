//! A bounded stack of values kept idle for reuse (emptied lists, boxes), so that a hot
//! path takes one instead of allocating it again.

/// Up to `KEEP` idle values; what comes back beyond that is dropped.
#[derive(Debug)]
pub struct Idle<T, const KEEP: usize> {
    values: Vec<T>,
}

impl<T, const KEEP: usize> Idle<T, KEEP> {
    pub const fn new() -> Self {
        Idle { values: Vec::new() }
    }

    /// An idle value, when one is kept.
    pub fn take(&mut self) -> Option<T> {
        self.values.pop()
    }

    /// Keeps `value` for the next [`Idle::take`], unless `KEEP` are kept already.
    pub fn keep(&mut self, value: T) {
        if self.values.len() < KEEP {
            if self.values.capacity() == 0 {
                // Once, so that keeping a value never grows the stack itself.
                self.values.reserve_exact(KEEP);
            }
            self.values.push(value);
        }
    }
}

impl<T, const KEEP: usize> Default for Idle<T, KEEP> {
    fn default() -> Self {
        Idle::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_at_most_its_bound_and_hands_back_the_last_kept() {
        let mut idle: Idle<u32, 2> = Idle::new();
        assert_eq!(idle.take(), None);
        for value in 1..=3 {
            idle.keep(value);
        }
        assert_eq!(idle.take(), Some(2));
        assert_eq!(idle.take(), Some(1));
        assert_eq!(idle.take(), None, "the third was dropped");
    }
}
