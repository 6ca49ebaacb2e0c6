//! Where each stream's messages go, and which log a report id names.
//!
//! The API sets the partition of every message it publishes itself:
//! `quire_log::partition_of(stream, layout.partitions)`, by the partition
//! layout recorded on the watermark topic, never by the topic's live count.
//! So `kafka-topics --alter` alone moves no stream, and a growth (see
//! `quire_log::grow`) moves streams only through its procedure: while the
//! layout says a growth is under way, the streams that move are answered
//! 503 `partitions_moving`. A layout this replica could not read for
//! [`quire_log::grow::stale_after`] its check interval routes nothing (503
//! `layout_unknown`): that bound is what the growth's settle wait counts on.
//!
//! The view is refreshed every `api.kafka_check_interval_ms`: the records
//! topic's identity (a topic deleted and created again is a new log; its
//! report ids carry its tag, from the bucket's registry), the layout (read
//! to the end of its partition), and the partitions the producers know.

use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use quire_log::{LayoutFollower, LogError, LogIdentity};
use quire_messages::{LogLayout, ReportId, StreamName};
use quire_queue::TopicIdentity;

use tokio_util::sync::CancellationToken;

use crate::errors::ApiError;
use crate::log_reader::LogReader;
use crate::publish::Publisher;

/// See the module documentation.
pub struct Placement {
    view: RwLock<View>,
    stale_after: Duration,
}

#[derive(Debug, Default)]
struct View {
    records: Option<TopicIdentity>,
    /// The identity of the log `records` names, once read from the bucket.
    identity: Option<LogIdentity>,
    layout: Option<LogLayout>,
    /// Every layout write before this instant is in `layout`.
    fresh_as_of: Option<Instant>,
    /// The fewest records partitions any of this replica's producers knows.
    producer_partitions: i32,
    /// Why there is no layout, when there is none.
    problem: Option<String>,
}

/// What a refresh reads from.
pub struct Sources {
    pub kafka: KafkaSettings,
    pub follower: LayoutFollower,
    pub s3: aws_sdk_s3::Client,
    pub bucket: String,
    pub check_interval: Duration,
}

impl Placement {
    pub fn new(check_interval: Duration) -> Self {
        Placement {
            view: RwLock::new(View::default()),
            stale_after: quire_log::grow::stale_after(check_interval),
        }
    }

    /// The partition `stream`'s messages go to now.
    pub fn place(&self, stream: &StreamName) -> Result<i32, ApiError> {
        let view = self.view.read().unwrap_or_else(PoisonError::into_inner);
        let (Some(layout), Some(fresh_as_of)) = (&view.layout, view.fresh_as_of) else {
            return Err(ApiError::LayoutUnknown(
                view.problem
                    .clone()
                    .unwrap_or_else(|| "not read yet".to_owned()),
            ));
        };
        let age = fresh_as_of.elapsed();
        if age > self.stale_after {
            return Err(ApiError::LayoutUnknown(format!(
                "last read {} ms ago{}",
                age.as_millis(),
                view.problem
                    .as_deref()
                    .map(|problem| format!(": {problem}"))
                    .unwrap_or_default()
            )));
        }
        if layout.is_moving(|count| quire_log::partition_of(stream, count)) {
            return Err(ApiError::PartitionsMoving {
                stream: stream.to_string(),
            });
        }
        let partition = quire_log::partition_of(stream, layout.partitions);
        if partition >= view.producer_partitions {
            return Err(ApiError::LayoutUnknown(format!(
                "the producers do not know partition {partition} yet"
            )));
        }
        Ok(partition)
    }

    /// The log a new report id is cut from (its tag), once known.
    pub fn identity(&self) -> Result<LogIdentity, ApiError> {
        let view = self.view.read().unwrap_or_else(PoisonError::into_inner);
        view.identity.clone().ok_or_else(|| {
            ApiError::LogUnknown(
                view.problem
                    .clone()
                    .unwrap_or_else(|| "not read yet".to_owned()),
            )
        })
    }

    /// The id of the report whose cut marker landed at `partition` and
    /// `offset` now.
    pub fn report_id(
        &self,
        stream: StreamName,
        partition: i32,
        offset: i64,
    ) -> Result<ReportId, ApiError> {
        Ok(self.identity()?.report_id(stream, partition, offset))
    }

    /// The records topic's live partition count, as last read.
    pub fn records_partitions(&self) -> i32 {
        self.view
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .records
            .as_ref()
            .map_or(0, |records| records.partitions)
    }

    /// The layout as last read, for `/readyz`.
    pub fn layout(&self) -> Option<LogLayout> {
        self.view
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .layout
            .clone()
    }

    /// Reads the records topic, the log's identity, the layout and what the
    /// producers know, and takes them as the view. A layout that cannot be
    /// settled (topics and a recorded layout that disagree) is an error an
    /// operator must act on; the view then routes nothing.
    pub async fn refresh(&self, sources: &Sources, publisher: &Publisher) -> Result<(), LogError> {
        let outcome = self.read(sources, publisher).await;
        let mut view = self.view.write().unwrap_or_else(PoisonError::into_inner);
        match outcome {
            Ok(read) => {
                if view.layout.as_ref() != Some(&read.layout) {
                    tracing::info!(log = %read.layout.log, partitions = read.layout.partitions, moving_to = ?read.layout.moving_to, "partition layout in force");
                }
                view.layout = Some(read.layout);
                view.fresh_as_of = Some(read.asked);
                view.producer_partitions = read.producer_partitions;
                view.problem = read.identity_problem;
                if let Some(identity) = read.identity {
                    view.identity = Some(identity);
                }
                view.records = Some(read.records);
                Ok(())
            }
            Err(error) => {
                let text = error.to_string();
                if view.problem.as_deref() != Some(text.as_str()) {
                    tracing::warn!(error = %text, "the partition layout could not be read");
                }
                view.problem = Some(text);
                if matches!(error, LogError::Layout(_)) {
                    view.layout = None;
                }
                Err(error)
            }
        }
    }

    async fn read(&self, sources: &Sources, publisher: &Publisher) -> Result<Read, LogError> {
        let kafka = &sources.kafka;
        let records = quire_queue::describe_topic(kafka, &kafka.topics.records).await?;
        let known = {
            let view = self.view.read().unwrap_or_else(PoisonError::into_inner);
            view.identity
                .clone()
                .filter(|identity| identity.records.id == records.id)
        };
        let (identity, identity_problem) = match known {
            Some(identity) => (Some(identity), None),
            None => match quire_log::identify(kafka, &sources.s3, &sources.bucket).await {
                Ok(identity) => (Some(identity), None),
                // Records need no tag: they go on; cuts wait for it.
                Err(error) => (None, Some(error.to_string())),
            },
        };
        let (recorded, asked) = sources.follower.fresh(sources.check_interval).await?;
        let layout = match recorded {
            Some(layout) if layout.log == records.id => layout,
            recorded => {
                let watermarks =
                    quire_queue::describe_topic(kafka, &kafka.topics.watermarks).await?;
                let resolved = quire_log::resolve_layout(
                    recorded,
                    &records,
                    watermarks.partitions,
                    kafka.partitions,
                )?;
                if resolved.unrecorded {
                    quire_log::record_layout(kafka, &kafka.topics.watermarks, &resolved.layout)
                        .await?;
                }
                resolved.layout
            }
        };
        let mut producer_partitions = publisher.known_partitions();
        if producer_partitions < layout.partitions {
            producer_partitions = publisher.refresh_partitions(&kafka.topics.records).await?;
        }
        Ok(Read {
            records,
            identity,
            identity_problem,
            layout,
            asked,
            producer_partitions,
        })
    }
}

struct Read {
    records: TopicIdentity,
    identity: Option<LogIdentity>,
    identity_problem: Option<String>,
    layout: LogLayout,
    asked: Instant,
    producer_partitions: i32,
}

/// Refreshes `placement` every `sources.check_interval` until `stop`, and
/// tells the report look-ups (`log`) how many partitions the log has.
pub async fn run(
    placement: Arc<Placement>,
    sources: Sources,
    publisher: Arc<Publisher>,
    log: Arc<LogReader>,
    stop: CancellationToken,
) {
    let mut ticks = tokio::time::interval(sources.check_interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let refreshed = tokio::select! {
            () = stop.cancelled() => return,
            refreshed = placement.refresh(&sources, &publisher) => refreshed,
        };
        // Failures are logged when they change and shown by place().
        if refreshed.is_ok() {
            log.set_partitions(placement.records_partitions());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(layout: LogLayout, producer_partitions: i32) -> Placement {
        let placement = Placement::new(Duration::from_millis(100));
        {
            let mut view = placement.view.write().unwrap();
            view.layout = Some(layout);
            view.fresh_as_of = Some(Instant::now());
            view.producer_partitions = producer_partitions;
        }
        placement
    }

    /// A stream that lands on `from` among 12 partitions and elsewhere
    /// among 16 (or on the same one, `moves = false`).
    fn stream_that(moves: bool) -> StreamName {
        (0..)
            .map(|n| StreamName::new(&format!("s{n}")).unwrap())
            .find(|stream| {
                (quire_log::partition_of(stream, 12) != quire_log::partition_of(stream, 16))
                    == moves
            })
            .unwrap()
    }

    #[test]
    fn streams_go_where_the_layout_says_and_moving_ones_wait() {
        let mut layout = LogLayout::new("log", 12);
        let (moving, staying) = (stream_that(true), stream_that(false));
        let placement = fresh(layout.clone(), 16);
        assert_eq!(
            placement.place(&moving).unwrap(),
            quire_log::partition_of(&moving, 12),
            "a live count of 16 changes nothing while the layout says 12"
        );
        layout.moving_to = Some(16);
        let placement = fresh(layout.clone(), 16);
        assert!(matches!(
            placement.place(&moving),
            Err(ApiError::PartitionsMoving { .. })
        ));
        assert_eq!(
            placement.place(&staying).unwrap(),
            quire_log::partition_of(&staying, 12)
        );
        layout.partitions = 16;
        layout.moving_to = None;
        let placement = fresh(layout.clone(), 12);
        assert!(
            (0..100)
                .map(|n| StreamName::new(&format!("s{n}")).unwrap())
                .filter(|stream| quire_log::partition_of(stream, 16) >= 12)
                .all(|stream| matches!(placement.place(&stream), Err(ApiError::LayoutUnknown(_)))),
            "nothing goes to a partition the producers do not know"
        );
    }

    #[test]
    fn a_layout_not_read_for_too_long_routes_nothing() {
        let placement = Placement::new(Duration::from_millis(100));
        assert!(matches!(
            placement.place(&stream_that(false)),
            Err(ApiError::LayoutUnknown(_))
        ));
        {
            let mut view = placement.view.write().unwrap();
            view.layout = Some(LogLayout::new("log", 12));
            view.producer_partitions = 12;
            view.fresh_as_of = Instant::now().checked_sub(Duration::from_secs(10));
        }
        assert!(matches!(
            placement.place(&stream_that(false)),
            Err(ApiError::LayoutUnknown(_))
        ));
    }
}
