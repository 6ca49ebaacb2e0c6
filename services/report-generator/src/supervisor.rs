//! Runs worker sessions until the work is done, rebuilding after failures.
//!
//! A Kafka error the loop cannot handle (a failed or fenced transaction, a
//! broker away for too long, a watermark partition that never became
//! stable) or an S3 failure after the writer's retries ends the session.
//! The supervisor then aborts the session's open documents, closes its
//! clients, waits (`worker.restart_backoff_initial_ms`, doubling up to
//! `worker.restart_backoff_max_ms`, cut short by the stop flag) and builds a
//! new session. The new producer has the same transactional id, so it fences
//! the old epoch and aborts any transaction left open; the new consumer
//! rejoins under the same static member id and starts at the committed
//! offsets; partitions are taken over from their watermarks as usual. So
//! everything after the last committed transaction is read and rendered
//! again: exactly once holds.
//!
//! Errors a restart cannot cure ([`Recovery::Exit`]) end the run with the
//! error, and the process exits non-zero. So does being fenced
//! [`FENCED_IN_A_ROW_LIMIT`] sessions in a row: one fencing is cured by a new
//! session, but two processes with the same `worker.replica_id` fence each
//! other at every restart, forever. Only a fencing counts (a producer fenced
//! by a newer epoch of its transactional id, told by librdkafka's error
//! code, or the consumer fenced as a static member); any other fatal
//! producer error restarts the session and is logged as what it is.

use std::time::{Duration, Instant};

use backon::{BackoffBuilder, ExponentialBackoff, ExponentialBuilder};
use quire_config::{Settings, WorkerSettings};

use quire_queue::QueueError;
use quire_queue::{KafkaError, RDKafkaErrorCode};

use crate::error::Recovery;
use crate::monitoring::{Monitor, SessionState};
use crate::{Mode, RunSummary, Worker, WorkerError};
use tokio_util::sync::CancellationToken;

/// How often a backoff wait tells `/healthz` the supervisor is alive.
const HEALTH_TICK: Duration = Duration::from_millis(100);

/// Sessions ended by fencing one after the other before the worker gives up:
/// its own transaction timeout or a replacement starting early fence it once;
/// a second process with the same replica id fences it at every session.
pub const FENCED_IN_A_ROW_LIMIT: u32 = 3;

/// A session that ran this long before it was fenced starts the count again.
const FENCED_COUNT_RESET: Duration = Duration::from_secs(600);

/// Runs sessions until serve mode is stopped, drain mode has drained, or an
/// error that a restart cannot cure. Returns what every session did together.
pub async fn run(
    settings: &Settings,
    mode: Mode,
    stop: &CancellationToken,
    monitor: &Monitor,
) -> Result<RunSummary, WorkerError> {
    let mut total = RunSummary::default();
    let mut backoff = RestartBackoff::new(&settings.worker);
    let mut restarts: u64 = 0;
    let mut fencing = FencingCount::default();
    loop {
        monitor.health.set_state(SessionState::Starting);
        let started = Instant::now();
        let outcome = tokio::select! {
            built = Worker::build(settings, monitor) => match built {
                Ok(mut worker) => {
                    monitor.health.set_state(SessionState::Running);
                    if restarts > 0 {
                        tracing::info!(restarts, "worker session rebuilt; resuming from the last committed offsets");
                    }
                    let result = worker.run(mode, stop).await;
                    total.add(worker.summary());
                    let dropped = worker.open_documents();
                    if dropped > 0 {
                        tracing::info!(
                            documents = dropped,
                            ended = if result.is_ok() { "stop" } else { "error" },
                            "open documents dropped: their next owner renders them again"
                        );
                    }
                    monitor.health.set_state(SessionState::Stopping);
                    worker.shut_down().await;
                    result
                }
                Err(error) => Err(error),
            },
            () = stop.cancelled() => {
                tracing::info!("stop requested while connecting");
                Ok(())
            }
        };
        let error = match outcome {
            Ok(()) => {
                monitor.health.set_state(SessionState::Stopping);
                return Ok(total);
            }
            Err(error) => error,
        };
        let error = match fencing.session_ended(&error, started.elapsed()) {
            Some(fenced) => WorkerError::ReplicaIdInUse {
                replica_id: settings.worker.replica_id.clone(),
                fenced,
            },
            None => error,
        };
        if error.recovery() == Recovery::Exit {
            tracing::error!(
                error = %error,
                cause = error.cause(),
                "worker cannot continue: restarting would meet the same error"
            );
            monitor.health.set_state(SessionState::Stopping);
            return Err(error);
        }
        if stop.is_cancelled() {
            // SIGTERM arrived while the session failed: nothing to resume.
            tracing::warn!(error = %error, cause = error.cause(), "worker session failed while stopping");
            return Ok(total);
        }
        restarts += 1;
        monitor.metrics.restarted();
        monitor.health.set_state(SessionState::Restarting);
        let delay = backoff.next_delay(started.elapsed());
        tracing::warn!(
            error = %error,
            cause = error.cause(),
            hint = hint(&error),
            restarts,
            backoff_ms = delay.as_millis() as u64,
            "worker session failed; restarting after a backoff"
        );
        if !wait_unless_stopped(delay, stop, monitor).await {
            tracing::info!("stop requested during the restart backoff");
            return Ok(total);
        }
    }
}

/// Something for the operator to check, for the errors that have one.
fn hint(error: &WorkerError) -> &'static str {
    match error.cause() {
        "kafka-fenced" => {
            "the producer was fenced: by this worker's own timeout, or by another process with the same worker.replica_id"
        }
        "kafka-producer-fatal" => {
            "the kafka producer hit a fatal error that is not a fencing (see error); the new session makes a new producer"
        }
        "watermarks-unstable" => {
            "a transaction on the watermark partition stays open: a stuck worker or a hanging transaction"
        }
        "s3" => "the S3 server failed after the writer's retries; is it reachable?",
        _ => "",
    }
}

/// Whether a session ended because another process took this worker's
/// identity: its producer fenced (a newer epoch of its transactional id:
/// [`QueueError::is_fencing`], by librdkafka's error code), or its consumer
/// fenced (librdkafka's only fatal consumer error: a static member with the
/// same `group.instance.id` joined). A producer fatal for another reason
/// (marked unusable after an abort that did not finish, an authorization
/// refused) is not: counting it would end in `ReplicaIdInUse`, a false
/// accusation that sends the operator looking for a twin.
fn ended_by_fencing(error: &WorkerError) -> bool {
    match error {
        WorkerError::Queue(error) if error.is_fencing() => true,
        WorkerError::Queue(QueueError::Consume(KafkaError::MessageConsumptionFatal(_))) => true,
        WorkerError::Queue(QueueError::GroupRefused(error)) => {
            error.rdkafka_error_code() == Some(RDKafkaErrorCode::FencedInstanceId)
        }
        _ => false,
    }
}

/// Sessions ended by fencing one after the other.
#[derive(Debug, Default)]
struct FencingCount {
    in_a_row: u32,
}

impl FencingCount {
    /// Counts a session's end; `Some(count)` once the limit is reached.
    fn session_ended(&mut self, error: &WorkerError, lasted: Duration) -> Option<u32> {
        if !ended_by_fencing(error) {
            self.in_a_row = 0;
            return None;
        }
        if lasted > FENCED_COUNT_RESET {
            self.in_a_row = 0;
        }
        self.in_a_row += 1;
        (self.in_a_row >= FENCED_IN_A_ROW_LIMIT).then_some(self.in_a_row)
    }
}

/// Sleeps `delay` in short steps, keeping `/healthz` alive; false when
/// `stop` was raised meanwhile.
async fn wait_unless_stopped(delay: Duration, stop: &CancellationToken, monitor: &Monitor) -> bool {
    let deadline = Instant::now() + delay;
    loop {
        if stop.is_cancelled() {
            return false;
        }
        monitor.health.turned();
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return true;
        }
        tokio::select! {
            () = tokio::time::sleep(remaining.min(HEALTH_TICK)) => {}
            () = stop.cancelled() => return false,
        }
    }
}

/// Exponential backoff between sessions: initial, doubling, up to the
/// maximum; back to the initial delay after a session that lasted longer
/// than the maximum (it was working, this is a new failure).
struct RestartBackoff {
    builder: ExponentialBuilder,
    maximum: Duration,
    delays: ExponentialBackoff,
}

impl RestartBackoff {
    fn new(settings: &WorkerSettings) -> Self {
        let maximum = settings.restart_backoff_max.max(Duration::from_millis(1));
        let initial = settings
            .restart_backoff_initial
            .max(Duration::from_millis(1))
            .min(maximum);
        let builder = ExponentialBuilder::default()
            .with_min_delay(initial)
            .with_max_delay(maximum)
            .with_factor(2.0)
            .without_max_times();
        RestartBackoff {
            builder,
            maximum,
            delays: builder.build(),
        }
    }

    /// The wait before the next session, given how long the failed one ran.
    fn next_delay(&mut self, session_lasted: Duration) -> Duration {
        if session_lasted > self.maximum {
            self.delays = self.builder.build();
        }
        self.delays.next().unwrap_or(self.maximum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(initial_ms: u64, max_ms: u64) -> WorkerSettings {
        let mut settings = quire_config::load(None).expect("defaults load").worker;
        settings.restart_backoff_initial = Duration::from_millis(initial_ms);
        settings.restart_backoff_max = Duration::from_millis(max_ms);
        settings
    }

    #[test]
    fn the_backoff_doubles_up_to_its_maximum() {
        let mut backoff = RestartBackoff::new(&settings(1000, 30_000));
        let quick = Duration::from_millis(10);
        let delays: Vec<u64> = (0..8)
            .map(|_| backoff.next_delay(quick).as_millis() as u64)
            .collect();
        assert_eq!(
            delays,
            [1000, 2000, 4000, 8000, 16_000, 30_000, 30_000, 30_000]
        );
    }

    #[test]
    fn a_session_that_worked_for_a_while_resets_the_backoff() {
        let mut backoff = RestartBackoff::new(&settings(1000, 30_000));
        let quick = Duration::from_millis(10);
        backoff.next_delay(quick);
        backoff.next_delay(quick);
        assert_eq!(backoff.next_delay(quick), Duration::from_secs(4));
        assert_eq!(
            backoff.next_delay(Duration::from_secs(31)),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn an_initial_delay_above_the_maximum_is_capped() {
        let mut backoff = RestartBackoff::new(&settings(60_000, 5_000));
        assert_eq!(backoff.next_delay(Duration::ZERO), Duration::from_secs(5));
    }

    fn fenced() -> WorkerError {
        WorkerError::Queue(QueueError::ProducerFatal(KafkaError::MessageProduction(
            RDKafkaErrorCode::Fenced,
        )))
    }

    #[test]
    fn fatal_producer_errors_that_are_not_fencings_never_add_up_to_a_replica_id_in_use() {
        let quick = Duration::from_secs(5);
        let not_fencings = [
            // Marked unusable by quire: an abort that did not finish.
            WorkerError::Queue(QueueError::ProducerFatal(KafkaError::MessageProduction(
                RDKafkaErrorCode::Fatal,
            ))),
            WorkerError::Queue(QueueError::ProducerFatal(KafkaError::MessageProduction(
                RDKafkaErrorCode::TransactionalIdAuthorizationFailed,
            ))),
            WorkerError::Queue(QueueError::CommitOutcomeUnknown {
                source: KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut),
                ids: Vec::new(),
            }),
        ];
        for error in &not_fencings {
            let mut count = FencingCount::default();
            for session in 0..10 {
                assert_eq!(
                    count.session_ended(error, quick),
                    None,
                    "session {session} ended by {error}"
                );
            }
            assert_eq!(error.recovery(), Recovery::Restart, "{error}");
            assert_ne!(error.cause(), "kafka-fenced", "{error}");
        }
        // The real thing, however it surfaced, still counts.
        let fencings = [
            RDKafkaErrorCode::Fenced,
            RDKafkaErrorCode::ProducerFenced,
            RDKafkaErrorCode::InvalidProducerEpoch,
        ]
        .map(|code| {
            WorkerError::Queue(QueueError::ProducerFatal(KafkaError::MessageProduction(
                code,
            )))
        });
        for error in &fencings {
            let mut count = FencingCount::default();
            for _ in 1..FENCED_IN_A_ROW_LIMIT {
                assert_eq!(count.session_ended(error, quick), None);
            }
            assert_eq!(
                count.session_ended(error, quick),
                Some(FENCED_IN_A_ROW_LIMIT),
                "{error}"
            );
        }
        let mut count = FencingCount::default();
        let fenced_commit = WorkerError::Queue(QueueError::CommitOutcomeUnknown {
            source: KafkaError::Flush(RDKafkaErrorCode::Fenced),
            ids: Vec::new(),
        });
        for _ in 1..FENCED_IN_A_ROW_LIMIT {
            assert_eq!(count.session_ended(&fenced_commit, quick), None);
        }
        assert!(count.session_ended(&fenced_commit, quick).is_some());
    }

    #[test]
    fn being_fenced_once_restarts_and_again_and_again_gives_up() {
        let mut count = FencingCount::default();
        let quick = Duration::from_secs(5);
        assert_eq!(count.session_ended(&fenced(), quick), None);
        let other = WorkerError::S3("timeout".into());
        assert_eq!(
            count.session_ended(&other, quick),
            None,
            "another failure breaks the row"
        );
        assert_eq!(count.session_ended(&fenced(), quick), None);
        assert_eq!(count.session_ended(&fenced(), quick), None);
        assert_eq!(
            count.session_ended(&fenced(), quick),
            Some(FENCED_IN_A_ROW_LIMIT)
        );
        let consumer_fenced = WorkerError::Queue(QueueError::Consume(
            KafkaError::MessageConsumptionFatal(RDKafkaErrorCode::Fatal),
        ));
        let mut count = FencingCount::default();
        for _ in 1..FENCED_IN_A_ROW_LIMIT {
            assert_eq!(count.session_ended(&consumer_fenced, quick), None);
        }
        assert!(count.session_ended(&consumer_fenced, quick).is_some());
    }

    #[test]
    fn a_session_that_worked_for_long_starts_the_fencing_count_again() {
        let mut count = FencingCount::default();
        let quick = Duration::from_secs(5);
        count.session_ended(&fenced(), quick);
        count.session_ended(&fenced(), quick);
        assert_eq!(
            count.session_ended(&fenced(), FENCED_COUNT_RESET + quick),
            None
        );
    }

    #[test]
    fn the_replica_id_in_use_exits_naming_the_setting() {
        let error = WorkerError::ReplicaIdInUse {
            replica_id: "worker-7".into(),
            fenced: 3,
        };
        assert_eq!(error.recovery(), Recovery::Exit);
        let message = error.to_string();
        assert!(message.contains("worker.replica_id"), "{message}");
        assert!(message.contains("worker-7"), "{message}");
    }

    #[tokio::test]
    async fn a_stop_cuts_the_backoff_short() {
        let monitor = Monitor::new(&settings(1000, 30_000));
        let stop = CancellationToken::new();
        stop.cancel();
        assert!(!wait_unless_stopped(Duration::from_secs(30), &stop, &monitor).await);
        let stop = CancellationToken::new();
        assert!(wait_unless_stopped(Duration::from_millis(1), &stop, &monitor).await);
        // A stop while waiting ends the wait at once.
        let stop = CancellationToken::new();
        let cancel = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            cancel.cancel();
        });
        let started = Instant::now();
        assert!(!wait_unless_stopped(Duration::from_secs(30), &stop, &monitor).await);
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
