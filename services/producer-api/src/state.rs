//! What the handlers share, cut by what each uses: a handler or middleware
//! takes its part of [`AppState`] (axum's `FromRef`), never the whole, so
//! a reader sees at its signature what it can touch.
//!
//! - [`Publishing`], for the routes that publish (records, cuts, definitions);
//! - [`Reports`], for the report look-ups and downloads;
//! - [`ReadinessSources`], for `/readyz`;
//! - [`Gate`], for admission in front of the publishing routes;
//! - [`Limits`] (`/v1/limits`), [`Storage`] (definitions' reads) and
//!   [`MetricsOnly`] (`/metrics`).

use std::sync::Arc;

use quire_queue::{Followers, MessageId, OutMessage, QueueError};

use axum::extract::FromRef;
use axum::response::{IntoResponse, Response};
use futures::future::BoxFuture;

use crate::admission::Gate;
use crate::errors::ApiError;
use crate::idempotency::{KeyedRequest, StoredResponse, Unsettled};
use crate::in_force::DefinitionsInForce;
use crate::kafka_health::KafkaHealth;
use crate::key_log::KeyLog;
use crate::log_reader::LogReader;
use crate::metrics::{Metrics, MetricsOnly};
use crate::placement::Placement;
use crate::publish::{Publisher, RecordsTopic};
use crate::rate::ControlLimits;
use crate::reported::Reported;
use crate::storage::{DownloadUrls, Storage};
use crate::validation::Limits;

/// The API's connections and settings, built once at start-up, as the
/// parts the handlers take.
#[derive(Clone)]
pub struct AppState {
    pub publishing: Publishing,
    pub reports: Reports,
    pub readiness: ReadinessSources,
    pub gate: Gate,
}

/// What the routes that publish use.
#[derive(Clone)]
pub struct Publishing {
    pub limits: Limits,
    pub records_topic: RecordsTopic,
    /// Where each stream's messages go, and which log report ids name.
    pub placement: Arc<Placement>,
    pub publisher: Arc<Publisher>,
    /// Settles a commit of unknown outcome.
    pub log: Arc<LogReader>,
    /// Idempotency-Key answers in Kafka, shared by the replicas.
    pub key_log: Arc<KeyLog>,
    pub metrics: Arc<Metrics>,
    /// Cuts and definition changes per stream and per principal.
    pub control_limits: Arc<ControlLimits>,
    /// Each stream's definition in force, for the typed check at the door.
    pub definitions: Arc<DefinitionsInForce>,
    /// Whether bearer tokens are checked (the rate's principal is then the
    /// token).
    pub tokens_enabled: bool,
}

/// What the report routes use.
#[derive(Clone)]
pub struct Reports {
    pub storage: Storage,
    /// Presigned download URLs, unless `api.download_url_expiry_ms` is 0.
    pub downloads: Option<DownloadUrls>,
    /// Which log a report id names.
    pub placement: Arc<Placement>,
    /// Whether a report id was ever issued.
    pub log: Arc<LogReader>,
    /// How far each stream is reported (the watermarks), to tell an
    /// expired report from a pending one.
    pub reported: Arc<Reported>,
    pub metrics: Arc<Metrics>,
}

/// What `/readyz` reads (and never changes).
#[derive(Clone)]
pub struct ReadinessSources {
    pub storage: Storage,
    /// The background Kafka check's verdict.
    pub kafka_health: Arc<KafkaHealth>,
    pub publisher: Arc<Publisher>,
    /// `api.replica_id`, named when a producer is fenced.
    pub replica_id: Arc<str>,
}

impl Publishing {
    /// Publishes `messages` in one transaction, settling an unknown commit
    /// outcome from the log (see [`Publisher::publish_settled`]).
    pub async fn publish(&self, messages: Vec<OutMessage>) -> Result<Vec<MessageId>, QueueError> {
        self.publisher
            .publish_settled(&self.log, messages, None)
            .await
    }

    /// [`publish`](Self::publish), answered by `answer` from the ids. For a
    /// keyed request, the answer is also written to the key log in the
    /// array's transaction. An outcome still unknown is answered 500
    /// `publish_outcome_unknown`, with an [`Unsettled`] extension that keeps
    /// reading the log for it, so an `Idempotency-Key` retry is answered
    /// from the outcome instead of publishing again.
    pub async fn publish_answered(
        &self,
        messages: Vec<OutMessage>,
        keyed: Option<KeyedRequest>,
        answer: impl Fn(Vec<MessageId>) -> Result<StoredResponse, ApiError> + Send + Sync + 'static,
    ) -> Response {
        let key = messages.first().and_then(|message| message.key.clone());
        let answer = Arc::new(answer);
        let followers = keyed.map(|keyed| {
            let (answer, key_log) = (Arc::clone(&answer), Arc::clone(&self.key_log));
            Box::new(move |ids: &[MessageId]| match answer(ids.to_vec()) {
                Ok(stored) if stored.status.is_success() => {
                    vec![key_log.entry(&keyed.key, &keyed.fingerprint, &stored)]
                }
                _ => Vec::new(),
            }) as Followers
        });
        let (source, ids) = match self
            .publisher
            .publish_settled(&self.log, messages, followers)
            .await
        {
            Ok(ids) => return respond(answer(ids)),
            Err(QueueError::CommitOutcomeUnknown { source, ids }) => (source, ids),
            Err(error) => return ApiError::Publish(error).into_response(),
        };
        let mut response = ApiError::Publish(QueueError::CommitOutcomeUnknown {
            source: source.clone(),
            ids: ids.clone(),
        })
        .into_response();
        let (Some(key), Some(&first)) = (key, ids.first()) else {
            return response; // no delivery report: nothing to read
        };
        let log = Arc::clone(&self.log);
        let settle = move || -> BoxFuture<'static, Option<Response>> {
            let (log, key, ids, answer, source) = (
                Arc::clone(&log),
                key.clone(),
                ids.clone(),
                Arc::clone(&answer),
                source.clone(),
            );
            Box::pin(async move {
                match log.settle(&key, first, log.transaction_wait()).await {
                    Ok(true) => Some(respond(answer(ids))),
                    Ok(false) => Some(
                        ApiError::Publish(QueueError::TransactionAborted(source)).into_response(),
                    ),
                    Err(error) => {
                        tracing::debug!(error = %error, "the commit outcome cannot be read yet");
                        None
                    }
                }
            })
        };
        response.extensions_mut().insert(Unsettled {
            settle: Arc::new(settle),
        });
        response
    }
}

/// An answer as a response.
pub fn respond(answer: Result<StoredResponse, ApiError>) -> Response {
    match answer {
        Ok(stored) => {
            let mut response = (stored.status, stored.body).into_response();
            for (name, value) in stored.headers {
                response.headers_mut().insert(name, value);
            }
            response
        }
        Err(error) => error.into_response(),
    }
}

impl FromRef<AppState> for Publishing {
    fn from_ref(state: &AppState) -> Self {
        state.publishing.clone()
    }
}

impl FromRef<AppState> for Reports {
    fn from_ref(state: &AppState) -> Self {
        state.reports.clone()
    }
}

impl FromRef<AppState> for ReadinessSources {
    fn from_ref(state: &AppState) -> Self {
        state.readiness.clone()
    }
}

impl FromRef<AppState> for Gate {
    fn from_ref(state: &AppState) -> Self {
        state.gate.clone()
    }
}

impl FromRef<AppState> for Limits {
    fn from_ref(state: &AppState) -> Self {
        state.publishing.limits
    }
}

impl FromRef<AppState> for Storage {
    fn from_ref(state: &AppState) -> Self {
        state.reports.storage.clone()
    }
}

impl FromRef<AppState> for MetricsOnly {
    fn from_ref(state: &AppState) -> Self {
        MetricsOnly(Arc::clone(&state.publishing.metrics))
    }
}
