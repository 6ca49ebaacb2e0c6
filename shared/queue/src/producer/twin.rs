//! The release of a producer's partitions: in place, or by a twin.

use std::sync::Arc;
use std::time::{Duration, Instant};

use quire_config::KafkaSettings;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::Producer;

use super::state::{Event, Owed, State};
use super::transaction::Budget;
use super::{Locked, initialised};
use crate::{OutMessage, QueueError};

/// The transaction timeout of the producer that commits a release after a
/// connect or a disconnection (see [`Release`]): long, so that neither the
/// coordinator nor our own patience ends it with an ABORT while a broker
/// that just came back is still slow. The brokers' default
/// `transaction.max.timeout.ms` (15 min) allows it.
pub const RELEASE_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(60);

/// What a producer commits to release its partitions, and how long it may
/// wait for that.
///
/// A broker SIGKILLed right after a commit can come back with its
/// transaction coordinator having skipped a partition's COMMIT marker
/// (it found no leader for it at that moment) while marking the
/// transaction complete: a hanging transaction. Every read_committed
/// reader of that partition then stops at the committed records. Only a
/// marker of the same producer ends it, and whichever comes first decides
/// the records' fate: the next COMMIT keeps them, but an ABORT (any later
/// transaction of that producer that touched the partition and failed)
/// throws away records that were acknowledged. So a producer with a
/// release never runs another transaction after connecting, or after the
/// brokers were gone, before its release has committed: one message to
/// every partition it may have written, sent only once each of them has a
/// leader, with patience instead of the caller's short send timeout.
///
/// That patience must outlast a slow restart, and the producer's own
/// transaction timeout (seconds, so that a crashed producer holds readers
/// back only briefly) cannot: a release that overran it was ended by the
/// coordinator, or by our abort, with an ABORT marker, and about one crash
/// round in sixty lost its array that way. So a release after a connect or
/// a disconnection is committed by a twin: a producer with the same
/// transactional id and `RELEASE_TRANSACTION_TIMEOUT`. Its
/// `init_transactions` bumps the epoch (a marker of a later epoch still
/// ends the earlier epoch's hanging transaction), and a fresh producer with
/// the ordinary timeout takes over after it. A periodic release (nothing
/// seen, [`TransactionalProducer::request_release`]) runs in place.
///
/// [`TransactionalProducer::request_release`]: super::TransactionalProducer::request_release
#[derive(Clone, Default)]
pub struct Release {
    /// One message per partition the producer may have written; readers
    /// recognise and skip them.
    pub messages: Vec<OutMessage>,
    /// How long waiting for leaders, and then sending and committing a
    /// release, may each take (see [`Release::patience_for`]).
    pub patience: Duration,
    /// Called after each release that committed (a metric).
    pub on_release: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl Release {
    /// The patience that fits `settings`: three quarters of the twin's
    /// transaction timeout (the longer of `RELEASE_TRANSACTION_TIMEOUT` and
    /// the producer's own), under which neither it nor the coordinator gives
    /// up on the release. A release in place gets at most three quarters of
    /// the producer's own timeout.
    pub fn patience_for(settings: &KafkaSettings) -> Duration {
        three_quarters(release_transaction_timeout(settings))
    }
}

/// Three quarters of a transaction timeout, at least one second: how long a
/// transaction may take before the coordinator's clock becomes a risk.
fn three_quarters(timeout: Duration) -> Duration {
    (timeout * 3 / 4).max(Duration::from_secs(1))
}

/// The twin's transaction timeout for `settings` (see [`Release`]).
pub(super) fn release_transaction_timeout(settings: &KafkaSettings) -> Duration {
    RELEASE_TRANSACTION_TIMEOUT.max(settings.transaction_timeout)
}

impl Locked<'_> {
    /// Commits the release if one is owed. Nothing is sent until every
    /// partition to release has a leader: a release that failed would be
    /// aborted, and its ABORT marker would end a hanging transaction by
    /// throwing its records away. On failure the release stays owed, by a
    /// twin.
    pub(super) fn release_if_due(&mut self) -> Result<(), QueueError> {
        // A release is a transaction too: a put-off abort goes first.
        self.finish_pending_abort();
        let inner = self.inner;
        let Some(release) = &inner.release else {
            return Ok(());
        };
        // Applied now, so a disconnection during the release asks again.
        self.apply_events_from_outside();
        if self.state().owed() == Owed::Nothing {
            return Ok(());
        }
        if !self.state().is_usable() {
            return Err(self.fatal_error());
        }
        self.apply(Event::ReleaseBegins);
        let by_twin = matches!(self.state(), State::Releasing { by_twin: true });
        debug_assert!(matches!(self.state(), State::Releasing { .. }));
        let started = Instant::now();
        let led = match self.commit_release(release, by_twin) {
            Ok(led) => led,
            Err(error) => {
                self.apply(Event::ReleaseFailed);
                return Err(error);
            }
        };
        self.apply(Event::Released);
        if let Some(on_release) = &release.on_release {
            on_release();
        }
        tracing::info!(
            transactional_id = %inner.transactional_id,
            partitions = release.messages.len(),
            by_twin,
            leaders_ms = led.as_millis() as u64,
            transaction_ms = (started.elapsed() - led).as_millis() as u64,
            "partitions released: no transaction of this producer stays open there"
        );
        Ok(())
    }

    /// Waits for the leaders, then commits `release`; returns how long the
    /// leaders took.
    fn commit_release(&mut self, release: &Release, by_twin: bool) -> Result<Duration, QueueError> {
        let started = Instant::now();
        self.wait_for_leaders(&release.messages, release.patience)?;
        let led = started.elapsed();
        if by_twin {
            self.release_by_twin(release)?;
        } else {
            let patience = release
                .patience
                .min(three_quarters(self.inner.transaction_timeout));
            self.transact_locked(
                &release.messages,
                None,
                None,
                Budget::patient(patience),
                false,
            )?;
        }
        Ok(led)
    }

    /// Commits `release` with a twin (see [`Release`]): a producer with the
    /// same transactional id and the long release transaction timeout, whose
    /// `init_transactions` fences the current producer; then a fresh
    /// producer with the ordinary timeout replaces both, whatever the
    /// release's outcome. If that replacement cannot be made, the producer
    /// is unusable (its owner recreates it, and the release stays due).
    fn release_by_twin(&mut self, release: &Release) -> Result<(), QueueError> {
        let inner = self.inner;
        let mut twin_config = inner.config.clone();
        twin_config.set(
            "transaction.timeout.ms",
            inner.release_transaction_timeout.as_millis().to_string(),
        );
        let released = match initialised(&twin_config, inner.statistics.clone(), inner.timeout) {
            // Nothing was sent: like any transaction that failed to send.
            Err(error) => Err(QueueError::TransactionAborted(error)),
            Ok(twin) => {
                // The twin's epoch fenced the producer: it has nothing left
                // to send.
                self.replace_producer(twin);
                let budget = Budget::patient(release.patience);
                self.transact_locked(&release.messages, None, None, budget, false)
                    .map(drop)
            }
        };
        // Whether or not the twin got as far as its init, the current
        // producer may be fenced: replace it with an ordinary one.
        if let Err(error) = self.renew() {
            self.mark_unusable("no producer after a release by a twin", &error);
        }
        released
    }

    /// Puts a fresh producer with the ordinary timeout in place of the
    /// current one; its `init_transactions` ends whatever the coordinator
    /// still holds of the current one's transaction.
    pub(super) fn renew(&mut self) -> Result<(), KafkaError> {
        let inner = self.inner;
        let fresh = initialised(&inner.config, inner.statistics.clone(), inner.timeout)?;
        self.replace_producer(fresh);
        self.apply(Event::Replaced);
        Ok(())
    }

    /// Waits until every partition `messages` go to has a leader in the
    /// brokers' metadata, at most `patience`.
    fn wait_for_leaders(
        &self,
        messages: &[OutMessage],
        patience: Duration,
    ) -> Result<(), QueueError> {
        let deadline = Instant::now() + patience;
        let mut wanted: std::collections::BTreeMap<&str, Vec<i32>> = Default::default();
        for message in messages {
            if let Some(partition) = message.partition {
                wanted
                    .entry(message.topic.as_str())
                    .or_default()
                    .push(partition);
            }
        }
        for (topic, partitions) in wanted {
            loop {
                let remaining = deadline.saturating_duration_since(Instant::now());
                let led = self
                    .producer()
                    .client()
                    .fetch_metadata(Some(topic), remaining.max(Duration::from_millis(100)))
                    .map(|metadata| {
                        metadata.topics().iter().any(|found| {
                            found.name() == topic
                                && found.error().is_none()
                                && partitions.iter().all(|wanted| {
                                    found.partitions().iter().any(|partition| {
                                        partition.id() == *wanted && partition.leader() >= 0
                                    })
                                })
                        })
                    });
                match led {
                    Ok(true) => break,
                    Ok(false) | Err(_) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Ok(false) => {
                        return Err(QueueError::TransactionAborted(
                            KafkaError::MessageProduction(RDKafkaErrorCode::LeaderNotAvailable),
                        ));
                    }
                    Err(error) => return Err(QueueError::TransactionAborted(error)),
                }
            }
        }
        Ok(())
    }
}
