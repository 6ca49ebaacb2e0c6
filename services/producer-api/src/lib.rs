//! quire's producer API: records in (arrays, all or nothing, one Kafka
//! transaction per array, shared between concurrent requests by group
//! commit), cuts, definitions, report status and download.
//!
//! [`Application::build`] binds the listener first (port 0 picks a free
//! one), checks every setting, then connects (topics, producers, the log's
//! readers, S3), then starts the background loops, each with the
//! application's `CancellationToken`; [`Application::run_until_stopped`]
//! serves until SIGTERM or ctrl-c and cancels them. Routes are listed in
//! [`routes::ROUTES`] (and described by `openapi.yaml`, served at
//! `/openapi.yaml` and `/openapi.json`); errors, and their HTTP status
//! codes, in [`errors::ApiError`]. What runs before a publishing route's
//! handler (in-flight bytes, `Idempotency-Key`, the Kafka gate) is in
//! [`admission`]; reading bodies and their in-flight bytes in [`body`].
//!
//! The modules import one way: `body`, `auth`, `idempotency`, `validation`,
//! `storage` and `log_reader` know only `errors`; `metrics` knows nothing of
//! the state; `kafka_health` and `publish` build on those; `admission`
//! takes a narrow [`admission::Gate`]; `placement` routes each stream to
//! its partition by the recorded layout and names the log of report ids;
//! `state` cuts what the handlers share into the parts each takes
//! ([`state::Publishing`], [`state::Reports`], ...); `routes` holds the
//! handlers and builds the router; and `startup` wires it all.

pub mod admission;
pub mod auth;
pub mod body;
pub mod errors;
pub mod idempotency;
pub mod in_force;
pub mod kafka_health;
pub mod key_log;
pub mod log_reader;
pub mod metrics;
pub mod openapi;
pub mod placement;
pub mod publish;
pub mod rate;
pub mod reported;
pub mod routes;
pub mod serve;
pub mod startup;
pub mod state;
pub mod storage;
pub mod validation;

pub use errors::ApiError;
pub use startup::{Application, StartupError};
