//! `/healthz` (the process answers) and `/readyz` (Kafka and S3 answer, and
//! every producer is usable). Both stay open when authentication is on.
//! Kafka's state is the background check's ([`crate::kafka_health`]), the
//! same verdict that answers publishing requests 503 while Kafka is away.
//! `/readyz` only reads: unusable producers are recreated by the
//! publisher's upkeep loop ([`crate::publish::Publisher::run_upkeep`]).

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Serialize;

use crate::state::ReadinessSources;

/// How long each readiness check may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Debug, Serialize)]
pub struct Health {
    pub status: &'static str,
}

/// `GET /healthz`.
pub async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

#[derive(Debug, Serialize)]
pub struct Readiness {
    /// `ready` or `not_ready`.
    pub status: &'static str,
    pub checks: Checks,
}

#[derive(Debug, Serialize)]
pub struct Checks {
    pub kafka: Check,
    pub s3: Check,
    pub producers: Check,
}

#[derive(Debug, Serialize)]
pub struct Check {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Check {
    /// A passed check, or a failed one whose answer says only `public`:
    /// `/readyz` stays open when authentication is on, so the reason
    /// itself (broker addresses, the bucket, the endpoint) goes to the log.
    fn from_result<E: std::fmt::Display>(
        what: &'static str,
        public: &'static str,
        result: Result<(), E>,
    ) -> Self {
        match result {
            Ok(()) => Check {
                ok: true,
                error: None,
            },
            Err(error) => {
                tracing::warn!(check = what, reason = %error, "readiness check failed");
                Check {
                    ok: false,
                    error: Some(format!("{public} (the API's log has the details)")),
                }
            }
        }
    }
}

/// `GET /readyz`: 200 when every check passes, 503 naming the failed ones.
pub async fn readyz(State(state): State<ReadinessSources>) -> (StatusCode, Json<Readiness>) {
    let s3 = state.storage.check_bucket(CHECK_TIMEOUT).await;
    let kafka = match state.kafka_health.unavailable_because() {
        None => Ok(()),
        Some(reason) => Err(format!(
            "kafka does not answer ({reason}); publishing requests are answered 503"
        )),
    };
    let unusable = state.publisher.unusable_producers();
    let producers = if unusable.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "producers {} are unusable and being recreated (fenced: does another replica use api.replica_id {}? or kafka went away during a transaction)",
            unusable.join(", "),
            state.replica_id
        ))
    };
    let checks = Checks {
        kafka: Check::from_result(
            "kafka",
            "kafka does not answer; publishing requests are answered 503",
            kafka,
        ),
        s3: Check::from_result("s3", "the report store does not answer", s3),
        producers: Check::from_result(
            "producers",
            "some kafka producers are unusable and being recreated",
            producers,
        ),
    };
    let ready = checks.kafka.ok && checks.s3.ok && checks.producers.ok;
    if !ready {
        tracing::warn!(
            kafka = checks.kafka.ok,
            s3 = checks.s3.ok,
            producers = checks.producers.ok,
            "not ready"
        );
    }
    let (status, word) = if ready {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not_ready")
    };
    (
        status,
        Json(Readiness {
            status: word,
            checks,
        }),
    )
}
