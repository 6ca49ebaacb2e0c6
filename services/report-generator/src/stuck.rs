//! Partitions held back by a hanging transaction.
//!
//! A transaction whose COMMIT or ABORT marker never reached a partition
//! (a broker crash can make a restarted coordinator skip one) keeps the
//! partition's last stable offset where that transaction began: every
//! read_committed reader stops there, the worker included. The producers'
//! releases end what they left themselves (see `quire_queue::Release`);
//! this is the detection for whatever they cannot reach, such as a
//! producer that never comes back. A partition is stuck when its last
//! stable offset stays behind its high watermark, unmoved, for longer than
//! the transaction timeout: no live transaction lasts that long, the
//! coordinator aborts it first.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use quire_queue::PartitionProgress;

/// A partition whose last stable offset has not moved for too long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stuck {
    pub partition: i32,
    /// Where the hanging transaction begins.
    pub last_stable_offset: i64,
    pub high_watermark: i64,
    pub for_how_long: Duration,
}

/// Watches the last stable offsets from one statistics snapshot to the next.
pub struct StuckWatch {
    limit: Duration,
    /// Per partition held back: its last stable offset, since when, and
    /// whether that was reported.
    behind: BTreeMap<i32, (i64, Instant, bool)>,
}

impl StuckWatch {
    /// `limit`: the transaction timeout.
    pub fn new(limit: Duration) -> Self {
        StuckWatch {
            limit,
            behind: BTreeMap::new(),
        }
    }

    /// Takes one snapshot; returns the partitions stuck now, and logs a WARN
    /// the first time each one is found stuck at an offset (and an INFO when
    /// it moves on).
    pub fn observe(
        &mut self,
        topic: &str,
        progress: &[PartitionProgress],
        now: Instant,
    ) -> Vec<Stuck> {
        let mut stuck = Vec::new();
        let mut still_behind = BTreeMap::new();
        for partition in progress {
            if partition.unstable() == 0 {
                if let Some((offset, _, true)) = self.behind.get(&partition.partition) {
                    tracing::info!(
                        topic,
                        partition = partition.partition,
                        last_stable_offset = partition.last_stable_offset,
                        was_stuck_at = offset,
                        "partition no longer held back by a hanging transaction"
                    );
                }
                continue;
            }
            // The clock starts afresh whenever the stable offset moves.
            let (offset, since, mut reported) = match self.behind.get(&partition.partition) {
                Some(&(offset, since, reported)) if offset == partition.last_stable_offset => {
                    (offset, since, reported)
                }
                _ => (partition.last_stable_offset, now, false),
            };
            let for_how_long = now.saturating_duration_since(since);
            if for_how_long > self.limit {
                if !reported {
                    tracing::warn!(
                        topic,
                        partition = partition.partition,
                        offset,
                        high_watermark = partition.high_watermark,
                        stuck_for_s = for_how_long.as_secs(),
                        inspect = %format_args!(
                            "kafka-transactions.sh describe-producers --topic {topic} --partition {}",
                            partition.partition
                        ),
                        "partition held back by a hanging transaction: no read_committed reader gets past this offset; \
                         `inspect` names the producer whose CurrentTransactionStartOffset it is \
                         (README.md: a partition stuck behind a hanging transaction)"
                    );
                    reported = true;
                }
                stuck.push(Stuck {
                    partition: partition.partition,
                    last_stable_offset: offset,
                    high_watermark: partition.high_watermark,
                    for_how_long,
                });
            }
            still_behind.insert(partition.partition, (offset, since, reported));
        }
        self.behind = still_behind;
        stuck
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(partition: i32, stable: i64, high: i64) -> PartitionProgress {
        PartitionProgress {
            partition,
            high_watermark: high,
            last_stable_offset: stable,
            position: stable,
        }
    }

    #[test]
    fn stuck_only_once_the_stable_offset_has_not_moved_for_longer_than_the_limit() {
        let mut watch = StuckWatch::new(Duration::from_secs(10));
        let start = Instant::now();
        assert!(
            watch
                .observe("t", &[at(0, 5, 9), at(1, 3, 3)], start)
                .is_empty()
        );
        assert!(
            watch
                .observe("t", &[at(0, 5, 12)], start + Duration::from_secs(9))
                .is_empty()
        );
        let stuck = watch.observe(
            "t",
            &[at(0, 5, 14), at(1, 3, 3)],
            start + Duration::from_secs(11),
        );
        assert_eq!(
            stuck,
            vec![Stuck {
                partition: 0,
                last_stable_offset: 5,
                high_watermark: 14,
                for_how_long: Duration::from_secs(11),
            }]
        );
    }

    #[test]
    fn a_moving_stable_offset_is_busy_not_stuck() {
        let mut watch = StuckWatch::new(Duration::from_secs(10));
        let start = Instant::now();
        for second in 0..30 {
            let stable = 100 + second;
            let found = watch.observe(
                "t",
                &[at(0, stable, stable + 50)],
                start + Duration::from_secs(second as u64),
            );
            assert!(found.is_empty(), "second {second}: {found:?}");
        }
    }

    #[test]
    fn a_partition_that_catches_up_or_goes_away_is_forgotten() {
        let mut watch = StuckWatch::new(Duration::from_secs(1));
        let start = Instant::now();
        watch.observe("t", &[at(0, 5, 9), at(1, 2, 4)], start);
        assert_eq!(
            watch
                .observe(
                    "t",
                    &[at(0, 5, 9), at(1, 2, 4)],
                    start + Duration::from_secs(2)
                )
                .len(),
            2
        );
        // 0 caught up, 1 no longer held.
        assert!(
            watch
                .observe("t", &[at(0, 9, 9)], start + Duration::from_secs(3))
                .is_empty()
        );
        // Behind again later: the clock starts afresh.
        assert!(
            watch
                .observe(
                    "t",
                    &[at(0, 9, 12), at(1, 2, 4)],
                    start + Duration::from_secs(4)
                )
                .is_empty()
        );
    }
}
