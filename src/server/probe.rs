//! The measuring cycle behind the per-connection choices that only trying both ways can
//! settle (request coalescing's naps, `super::coalesce`; splicing against copying,
//! `super::splice_probe`): a probe of one or more blocks of four epochs (the usual way, the
//! alternative, the alternative, the usual way, so that a steady drift weighs on both sides
//! alike), then a verdict that holds for a number of epochs that doubles while probes agree.

/// Epochs in one block of a probe: the usual way, the alternative, the alternative, the
/// usual way.
pub(super) const BLOCK_EPOCHS: usize = 4;

/// Where a connection is in its cycle of probing and holding.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Phase {
    /// Measuring epoch `n` of a probe; the middle two of each block take the alternative.
    Probing(usize),
    /// Taking the alternative or not, as the last probe decided, for `epochs_left` more
    /// epochs.
    Holding { alternative: bool, epochs_left: u32 },
}

/// What a probe decided, returned as it ends.
#[derive(Debug, PartialEq)]
pub(super) struct Verdict<M, const N: usize> {
    /// Whether the alternative is taken from now on.
    pub alternative: bool,
    /// For this many epochs, after which the next probe starts.
    pub hold: u32,
    /// What the probe's epochs measured, in order.
    pub measured: [M; N],
}

/// Whether epoch `n` of a probe takes the alternative: the middle two of each block.
pub(super) fn takes_alternative(n: usize) -> bool {
    matches!(n % BLOCK_EPOCHS, 1 | 2)
}

/// One choice's cycle; `M` is what an epoch measured, and a probe runs `N` epochs, a
/// multiple of [`BLOCK_EPOCHS`].
#[derive(Debug)]
pub(super) struct Probe<M, const N: usize> {
    phase: Phase,
    /// What each epoch of the current probe measured.
    measured: [M; N],
    /// The last verdict and how many epochs it held.
    last_verdict: Option<(bool, u32)>,
    /// Epochs a new verdict holds ...
    min_hold: u32,
    /// ... doubling each time a probe repeats it, up to this many.
    max_hold: u32,
}

impl<M: Copy + Default, const N: usize> Probe<M, N> {
    pub(super) fn new(min_hold: u32, max_hold: u32) -> Self {
        const { assert!(N > 0 && N % BLOCK_EPOCHS == 0) };
        Probe {
            phase: Phase::Probing(0),
            measured: [M::default(); N],
            last_verdict: None,
            min_hold,
            max_hold,
        }
    }

    #[cfg(test)]
    pub(super) fn phase(&self) -> Phase {
        self.phase
    }

    /// Whether the current epoch takes the alternative.
    pub(super) fn alternative(&self) -> bool {
        match self.phase {
            Phase::Probing(n) => takes_alternative(n),
            Phase::Holding { alternative, .. } => alternative,
        }
    }

    /// Forgets every measurement and verdict; the next epoch starts a probe.
    pub(super) fn restart(&mut self) {
        *self = Probe::new(self.min_hold, self.max_hold);
    }

    /// Ends the current epoch, which measured `measured` (kept only while probing). At the
    /// end of a probe, `pays` judges its epochs (in order: usual, alternative, alternative,
    /// usual, and so on for each block) and its verdict is returned.
    pub(super) fn end_epoch(
        &mut self,
        measured: M,
        pays: impl FnOnce(&[M; N]) -> bool,
    ) -> Option<Verdict<M, N>> {
        let mut verdict = None;
        self.phase = match self.phase {
            Phase::Probing(n) => {
                self.measured[n] = measured;
                if n + 1 < N {
                    Phase::Probing(n + 1)
                } else {
                    let measured = std::mem::replace(&mut self.measured, [M::default(); N]);
                    let alternative = pays(&measured);
                    let hold = match self.last_verdict {
                        Some((last, held)) if last == alternative => (held * 2).min(self.max_hold),
                        _ => self.min_hold,
                    };
                    self.last_verdict = Some((alternative, hold));
                    verdict = Some(Verdict {
                        alternative,
                        hold,
                        measured,
                    });
                    Phase::Holding {
                        alternative,
                        epochs_left: hold,
                    }
                }
            }
            Phase::Holding { epochs_left: 0, .. } => Phase::Probing(0),
            Phase::Holding {
                alternative,
                epochs_left,
            } => Phase::Holding {
                alternative,
                epochs_left: epochs_left - 1,
            },
        };
        verdict
    }

    /// A cycle already holding `alternative` for `epochs_left` epochs (for tests).
    #[cfg(test)]
    pub(super) fn holding(mut self, alternative: bool, epochs_left: u32) -> Self {
        self.phase = Phase::Holding {
            alternative,
            epochs_left,
        };
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a probe whose alternative epochs measure `alternative` and the others 1;
    /// returns which epochs took the alternative, and what `pays` saw.
    fn probe(cycle: &mut Probe<u32, 4>, alternative: u32) -> (Vec<bool>, [u32; 4]) {
        let mut taken = Vec::new();
        let mut seen = [0; 4];
        for _ in 0..BLOCK_EPOCHS {
            taken.push(cycle.alternative());
            let measured = if cycle.alternative() { alternative } else { 1 };
            cycle.end_epoch(measured, |m| {
                seen = *m;
                m[1] > m[0] && m[2] > m[3]
            });
        }
        (taken, seen)
    }

    #[test]
    fn a_probe_takes_the_alternative_in_its_middle_epochs_and_is_judged_in_order() {
        let mut cycle = Probe::new(2, 8);
        assert_eq!(
            probe(&mut cycle, 5),
            (vec![false, true, true, false], [1, 5, 5, 1])
        );
        assert_eq!(
            cycle.phase(),
            Phase::Holding {
                alternative: true,
                epochs_left: 2
            }
        );
    }

    #[test]
    fn a_probe_of_several_blocks_repeats_the_order_in_each() {
        let mut cycle = Probe::<u32, 12>::new(2, 8);
        let mut taken = Vec::new();
        let mut seen = [0; 12];
        for _ in 0..12 {
            taken.push(cycle.alternative());
            let measured = taken.len() as u32;
            cycle.end_epoch(measured, |m| {
                seen = *m;
                false
            });
        }
        let block = [false, true, true, false];
        assert_eq!(taken, block.repeat(3));
        assert_eq!(
            seen,
            std::array::from_fn(|n| n as u32 + 1),
            "every epoch, in order"
        );
        assert_eq!(
            cycle.phase(),
            Phase::Holding {
                alternative: false,
                epochs_left: 2
            }
        );
    }

    #[test]
    fn a_repeated_verdict_holds_twice_as_long_up_to_the_cap_and_a_new_one_briefly() {
        let mut cycle = Probe::new(2, 8);
        let mut holds = Vec::new();
        for _ in 0..5 {
            probe(&mut cycle, 5);
            let Phase::Holding { epochs_left, .. } = cycle.phase() else {
                panic!("{:?}", cycle.phase());
            };
            holds.push(epochs_left);
            for _ in 0..=epochs_left {
                assert!(cycle.alternative());
                assert_eq!(cycle.end_epoch(0, |_| unreachable!()), None);
            }
            assert_eq!(cycle.phase(), Phase::Probing(0));
        }
        assert_eq!(holds, [2, 4, 8, 8, 8]);
        probe(&mut cycle, 1);
        assert_eq!(
            cycle.phase(),
            Phase::Holding {
                alternative: false,
                epochs_left: 2
            }
        );
    }

    #[test]
    fn a_restart_forgets_the_probe_and_the_last_verdict() {
        let mut cycle = Probe::new(2, 8);
        probe(&mut cycle, 5);
        cycle.end_epoch(0, |_| unreachable!());
        cycle.restart();
        assert_eq!(cycle.phase(), Phase::Probing(0));
        assert!(!cycle.alternative());
        let (_, seen) = probe(&mut cycle, 5);
        assert_eq!(
            seen,
            [1, 5, 5, 1],
            "nothing left of the measurements before"
        );
        assert_eq!(
            cycle.phase(),
            Phase::Holding {
                alternative: true,
                epochs_left: 2
            },
            "the same verdict again, but after a restart it holds only briefly"
        );
    }
}
