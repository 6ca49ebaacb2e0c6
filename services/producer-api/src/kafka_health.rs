//! Whether Kafka answers, known before a request needs it.
//!
//! A background task asks for the records topic's metadata every
//! `api.kafka_check_interval_ms`, with that as its timeout. While the last
//! check failed, requests that publish (records, cuts, definitions) are
//! answered 503 with `Retry-After` at once instead of waiting for a
//! transaction to time out, and `/readyz` says why. The first check that
//! succeeds again lets them through: no restart is needed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::log_reader::LogReader;
use crate::metrics::Metrics;

/// The latest verdict of the Kafka check.
#[derive(Debug, Default)]
pub struct KafkaHealth {
    /// Starts true: start-up has just reached Kafka (topics, producers).
    available: AtomicBool,
    /// Why the last check failed (Kafka errors, no secrets in them).
    last_error: Mutex<Option<String>>,
}

impl KafkaHealth {
    pub fn new() -> Arc<Self> {
        Arc::new(KafkaHealth {
            available: AtomicBool::new(true),
            last_error: Mutex::new(None),
        })
    }

    pub fn is_available(&self) -> bool {
        self.available.load(Ordering::Acquire)
    }

    /// Why Kafka is taken to be away, while it is.
    pub fn unavailable_because(&self) -> Option<String> {
        if self.is_available() {
            return None;
        }
        let reason = self
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Some(reason.unwrap_or_else(|| "kafka did not answer".to_owned()))
    }

    /// Records a check's outcome; logs only the changes.
    pub fn record(&self, outcome: Result<(), String>, metrics: &Metrics) {
        let was_available = self.is_available();
        match outcome {
            Ok(()) => {
                self.available.store(true, Ordering::Release);
                if !was_available {
                    tracing::info!("kafka answers again; publishing requests are let through");
                }
            }
            Err(error) => {
                if was_available {
                    tracing::warn!(error = %error, "kafka does not answer; publishing requests are answered 503 until it does");
                }
                *self
                    .last_error
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = Some(error);
                self.available.store(false, Ordering::Release);
            }
        }
        metrics.set_kafka_available(self.is_available());
    }
}

/// Checks Kafka every `interval` (with that as the check's timeout) and
/// records the verdict in `health`, until `stop`.
pub async fn run(
    health: Arc<KafkaHealth>,
    log: Arc<LogReader>,
    metrics: Arc<Metrics>,
    interval: Duration,
    stop: CancellationToken,
) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = ticks.tick() => {}
        }
        let outcome = tokio::select! {
            () = stop.cancelled() => return,
            outcome = log.check_reachable(interval) => outcome.map_err(|error| error.to_string()),
        };
        health.record(outcome, &metrics);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_check_closes_and_a_good_one_reopens() {
        let metrics = Metrics::new();
        let health = KafkaHealth::new();
        assert!(health.is_available());
        assert_eq!(health.unavailable_because(), None);
        health.record(Err("all brokers are down".into()), &metrics);
        assert!(!health.is_available());
        assert_eq!(
            health.unavailable_because().as_deref(),
            Some("all brokers are down")
        );
        assert!(metrics.encode().contains("quire_api_kafka_available 0"));
        health.record(Ok(()), &metrics);
        assert!(health.is_available());
        assert!(metrics.encode().contains("quire_api_kafka_available 1"));
    }
}
