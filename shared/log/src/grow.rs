//! Growing the partition layout from N to M partitions, losing and splitting
//! no report: `report-generator partitions grow --to M`.
//!
//! A stream whose partition among M differs from its partition among N
//! moves. Its records must never be on two partitions at once, and every
//! record accepted before one of its cuts must be in that report or an
//! earlier one. The procedure:
//!
//! 1. **Freeze**: record the layout `{partitions: N, moving_to: M}`. Every
//!    API replica answers 503 `partitions_moving` (with `Retry-After`) for
//!    the moving streams as soon as it reads it; a replica that could not
//!    read the layout for [`stale_after`] publishes nothing at all.
//! 2. Grow the watermark topic, then the records topic, to M partitions,
//!    and have the workers' group rebalance onto them (a member joins and
//!    leaves: a group rebalances when a member joins, never when a static
//!    member rejoins, so a worker restarted since could otherwise keep an
//!    assignment made for N partitions).
//! 3. **Settle**: wait until nothing a replica admitted before it saw the
//!    freeze can still land: the staleness bound, plus `api.publish_timeout_ms`
//!    (the longest an admitted array waits for its transaction), plus
//!    `kafka.transaction_timeout_ms` (the longest a transaction stays open).
//! 4. **Mark**: a move marker on every old partition. The worker of each
//!    completes the moving streams' open documents there (trigger `move`),
//!    sends each moving stream's definition and window progress to its new
//!    partition (a handover), and records on the watermark topic that the
//!    partition moved, all in one transaction.
//! 5. **Wait** until every old partition recorded it.
//! 6. **Switch**: record the layout `{partitions: M}`. The API routes the
//!    moving streams to their new partitions, behind their handovers.
//!
//! Invariant: every record accepted before a cut is in that report or an
//! earlier one, across the growth: a moving stream's records and cuts
//! before the freeze are on its old partition, before its move marker (the
//! settle wait), so in reports completed there at the latest by the marker;
//! after the switch they are on its new partition, after its handover.
//! Between the two nothing of the stream is accepted. Running the command
//! again after an interruption resumes it (a second marker moves nothing new
//! and hands over the same state again).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use quire_config::Settings;
use quire_messages::{LogLayout, PartitionMove, PartitionMoved, records, watermarks};
use quire_queue::{OutMessage, TopicTail};

use crate::LogError;
use crate::layout::{read_layout, record_layout, resolve_layout};

/// The most partitions a layout may have.
pub const MAX_PARTITIONS: i32 = 10_000;

/// How long an API replica keeps publishing on a layout it last read this
/// long ago (it re-reads it every `api.kafka_check_interval_ms`); past it,
/// publishing requests are answered 503 `layout_unknown`.
pub fn stale_after(check_interval: Duration) -> Duration {
    (check_interval * 3).max(Duration::from_secs(3))
}

/// How long the procedure waits between the freeze and the markers.
pub fn settle_time(settings: &Settings) -> Duration {
    stale_after(
        settings
            .api
            .kafka_check_interval
            .max(Duration::from_millis(1)),
    ) + settings.api.publish_timeout
        + settings.kafka.transaction_timeout
        + Duration::from_secs(2)
}

/// What the operator asked.
#[derive(Debug, Clone)]
pub struct GrowOptions {
    pub to: i32,
    /// How long to wait for the workers to process every move marker
    /// before giving up (the command can be run again: it resumes).
    pub timeout: Duration,
    /// The settle wait; [`settle_time`] unless the operator knows the
    /// API's settings differ from the command's.
    pub settle: Duration,
}

/// How far the procedure is, for the operator.
pub trait Progress {
    fn step(&mut self, text: &str);
}

impl<F: FnMut(&str)> Progress for F {
    fn step(&mut self, text: &str) {
        self(text)
    }
}

/// What a finished growth did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grown {
    pub from: i32,
    pub to: i32,
    /// The move markers, per old partition: (partition, offset).
    pub markers: Vec<(i32, i64)>,
}

/// Runs (or resumes) the growth to `options.to` partitions.
pub async fn grow(
    settings: &Settings,
    options: &GrowOptions,
    progress: &mut dyn Progress,
) -> Result<Grown, LogError> {
    let kafka = &settings.kafka;
    let topics = &kafka.topics;
    if options.to < 1 || options.to > MAX_PARTITIONS {
        return Err(LogError::Layout(format!(
            "--to {} is not a partition count quire grows to (1..={MAX_PARTITIONS})",
            options.to
        )));
    }
    let records = quire_queue::describe_topic(kafka, &topics.records).await?;
    let watermarks = quire_queue::describe_topic(kafka, &topics.watermarks).await?;
    let recorded = read_layout(kafka, &topics.watermarks).await?;
    let resolved = resolve_layout(recorded, &records, watermarks.partitions, kafka.partitions)?;
    if resolved.unrecorded {
        record_layout(kafka, &topics.watermarks, &resolved.layout).await?;
    }
    let mut layout = resolved.layout;
    let from = layout.partitions;
    match layout.moving_to {
        Some(target) if target != options.to => {
            return Err(LogError::Layout(format!(
                "a growth from {from} to {target} partitions is under way; finish it first with --to {target}"
            )));
        }
        None if options.to <= from => {
            return Err(LogError::Layout(format!(
                "the layout already routes streams among {from} partitions; a layout only grows (--to more than {from})"
            )));
        }
        _ => {}
    }
    let to = options.to;

    // 1. Freeze.
    let frozen_at = Instant::now();
    if layout.moving_to.is_none() {
        layout.moving_to = Some(to);
        layout.since_ms = Some(now_ms());
        record_layout(kafka, &topics.watermarks, &layout).await?;
        progress.step(&format!(
            "froze the streams that move from {from} to {to} partitions (the API answers them 503 partitions_moving until the switch)"
        ));
    } else {
        progress.step(&format!(
            "resuming the growth from {from} to {to} partitions"
        ));
    }

    // 2. The topics.
    quire_queue::grow_topic(kafka, &topics.watermarks, to).await?;
    quire_queue::grow_topic(kafka, &topics.records, to).await?;
    progress.step(&format!(
        "{} and {} have {to} partitions",
        topics.watermarks, topics.records
    ));
    rebalance_group(settings).await?;
    progress.step(&format!(
        "the workers' group {} rebalanced onto {to} partitions",
        settings.worker.group_id
    ));

    // 3. Settle.
    let settle_until = frozen_at + options.settle;
    if let Some(wait) = settle_until.checked_duration_since(Instant::now()) {
        progress.step(&format!(
            "waiting {:.0} s for what API replicas admitted before the freeze to land",
            wait.as_secs_f64()
        ));
        tokio::time::sleep(wait).await;
    }

    // 4. Mark every old partition.
    let marker = PartitionMove::new(from, to);
    let messages: Vec<OutMessage> = (0..from)
        .map(|partition| {
            let message = records::partition_move(partition, &marker);
            OutMessage::from_parts(
                &topics.records,
                message.key,
                message.payload,
                message.headers,
                message.partition,
            )
        })
        .collect();
    let ids = quire_queue::send_acknowledged(kafka, &messages).await?;
    let markers: Vec<(i32, i64)> = ids.iter().map(|id| (id.partition, id.offset)).collect();
    progress.step(&format!(
        "published a move marker on each of the {from} old partitions"
    ));

    // 5. Wait for the workers.
    wait_until_moved(settings, &markers, to, options.timeout, progress).await?;

    // 6. Switch.
    let switched = LogLayout {
        partitions: to,
        moving_to: None,
        since_ms: None,
        ..layout
    };
    record_layout(kafka, &topics.watermarks, &switched).await?;
    progress.step(&format!(
        "switched: streams are routed among {to} partitions"
    ));
    Ok(Grown { from, to, markers })
}

/// Has the workers' group assign the records topic as it is now: a member
/// of its own joins (the group rebalances, its leader reading the topic's
/// metadata afresh) and leaves (it rebalances again, without it). It reads
/// nothing and commits nothing. Bounded: a group that does not answer is
/// left to its members' own metadata refresh.
async fn rebalance_group(settings: &Settings) -> Result<(), LogError> {
    let mut options = quire_queue::ConsumerOptions::new(
        &settings.worker.group_id,
        &settings.kafka.topics.records,
    );
    options.cooperative = true;
    let consumer = quire_queue::ArrayConsumer::new(&settings.kafka, &options)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let array = consumer.next_array(1, Duration::from_millis(500)).await?;
        if array
            .rebalances
            .iter()
            .any(|event| matches!(event, quire_queue::RebalanceEvent::Assigned(_)))
        {
            break;
        }
        if Instant::now() >= deadline {
            tracing::warn!(group = %settings.worker.group_id, "the workers' group did not take a new member within 60 s; its members' metadata refresh assigns the new partitions");
            break;
        }
    }
    // Closing leaves the group (a member without a static id), on the
    // blocking pool: it waits for the group.
    tokio::task::spawn_blocking(move || drop(consumer)).await?;
    Ok(())
}

/// Waits until the watermark topic says every partition of `markers`
/// processed its marker (a `quire:moved` record at or past it).
async fn wait_until_moved(
    settings: &Settings,
    markers: &[(i32, i64)],
    to: i32,
    timeout: Duration,
    progress: &mut dyn Progress,
) -> Result<(), LogError> {
    let kafka = &settings.kafka;
    let moved: Arc<Mutex<BTreeMap<i32, i64>>> = Arc::default();
    let partitions = markers
        .iter()
        .map(|(partition, _)| partition + 1)
        .max()
        .unwrap_or(0);
    let tail = {
        let (kafka, topic, moved) = (
            kafka.clone(),
            kafka.topics.watermarks.clone(),
            Arc::clone(&moved),
        );
        tokio::task::spawn_blocking(move || {
            TopicTail::start(&kafka, "quire-growth", &topic, partitions, move |message| {
                if message.key.as_deref() != Some(watermarks::MOVED_KEY.as_bytes()) {
                    return;
                }
                let Some(Ok(record)) = message.payload.as_deref().map(|payload| {
                    quire_messages::decode::<PartitionMoved>("partition moved", payload)
                }) else {
                    return;
                };
                if record.to == to {
                    let mut moved = moved.lock().unwrap_or_else(PoisonError::into_inner);
                    let seen = moved.entry(message.partition).or_insert(record.offset);
                    *seen = (*seen).max(record.offset);
                }
            })
        })
        .await??
    };
    let deadline = Instant::now() + timeout;
    let mut last_count = usize::MAX;
    loop {
        let done = {
            let moved = moved.lock().unwrap_or_else(PoisonError::into_inner);
            markers
                .iter()
                .filter(|(partition, offset)| {
                    moved.get(partition).is_some_and(|seen| seen >= offset)
                })
                .count()
        };
        if done == markers.len() {
            drop(tail);
            return Ok(());
        }
        if done != last_count {
            progress.step(&format!(
                "{done} of {} old partitions have moved their streams",
                markers.len()
            ));
            last_count = done;
        }
        if Instant::now() >= deadline {
            let waiting: Vec<i32> = {
                let moved = moved.lock().unwrap_or_else(PoisonError::into_inner);
                markers
                    .iter()
                    .filter(|(partition, offset)| {
                        moved.get(partition).is_none_or(|seen| seen < offset)
                    })
                    .map(|(partition, _)| *partition)
                    .collect()
            };
            return Err(LogError::Layout(format!(
                "the workers did not process the move markers of partitions {waiting:?} within {} s (are report generators running? a partition stuck behind a hanging transaction?); the moving streams stay frozen: run the same command again to resume",
                timeout.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_settle_wait_covers_staleness_an_admitted_array_and_an_open_transaction() {
        let settings = quire_config::defaults();
        let settle = settle_time(&settings);
        let at_least = stale_after(settings.api.kafka_check_interval)
            + settings.api.publish_timeout
            + settings.kafka.transaction_timeout;
        assert!(settle > at_least, "{settle:?}");
        assert_eq!(
            stale_after(Duration::from_millis(100)),
            Duration::from_secs(3)
        );
        assert_eq!(stale_after(Duration::from_secs(2)), Duration::from_secs(6));
    }
}
