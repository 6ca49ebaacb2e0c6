//! The report generator as a value: built (its monitoring port bound first,
//! so port 0 works and the caller learns the port), then run until a
//! shutdown future resolves or, in drain mode, until everything queued is
//! reported. `main.rs` adds only the command line and the signals; tests
//! start it in process the same way.

use std::future::Future;
use std::net::SocketAddr;

use quire_config::Settings;
use tokio_util::sync::CancellationToken;

use crate::{Mode, Monitor, RunSummary, WorkerError, supervisor};

/// A report generator whose `/metrics`, `/healthz` and `/readyz` already
/// serve (readiness says "starting" until a session holds partitions).
pub struct Application {
    settings: Settings,
    mode: Mode,
    monitor: Monitor,
    metrics_address: SocketAddr,
}

impl Application {
    /// Checks what can be checked without Kafka and binds
    /// `worker.metrics_listen`. Kafka and S3 are reached by the sessions
    /// [`run_until`](Self::run_until) starts, which retry them.
    pub async fn build(settings: Settings, mode: Mode) -> Result<Self, WorkerError> {
        settings
            .worker
            .check_replica_id()
            .map_err(WorkerError::Config)?;
        let monitor = Monitor::new(&settings.worker);
        let metrics_address = monitor.serve(&settings.worker.metrics_listen).await?;
        Ok(Application {
            settings,
            mode,
            monitor,
            metrics_address,
        })
    }

    /// The port `/metrics`, `/healthz` and `/readyz` answer on.
    pub fn port(&self) -> u16 {
        self.metrics_address.port()
    }

    pub fn metrics_address(&self) -> SocketAddr {
        self.metrics_address
    }

    /// The metrics and health the application reports.
    pub fn monitor(&self) -> &Monitor {
        &self.monitor
    }

    /// Runs sessions (see `supervisor.rs`) until `shutdown` resolves (serve
    /// mode: finish the array in hand, commit, abort what is open) or, in
    /// drain mode, until everything queued is reported. Returns what every
    /// session did; an error only for what a restart cannot cure.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<RunSummary, WorkerError> {
        let stop = CancellationToken::new();
        let raise = {
            let stop = stop.clone();
            tokio::spawn(async move {
                shutdown.await;
                stop.cancel();
            })
        };
        // Report retention (s3.report_retention_days): a bucket lifecycle
        // rule where the server has them, else a periodic sweep. It only
        // logs errors, and ends on the stop flag.
        let retention = quire_s3::start_retention(
            &self.settings.s3,
            &quire_messages::layout::RETENTION_PREFIXES,
            stop.clone(),
        )
        .await;
        let summary = supervisor::run(&self.settings, self.mode, &stop, &self.monitor).await;
        // A drain ends without the shutdown future: stop what runs beside.
        stop.cancel();
        raise.abort();
        retention.abort();
        summary
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The replica id becomes a path segment of the spill directory (which
    /// start-up empties), the transactional id and the group member id: a
    /// value that is not a plain name stops start-up, naming the setting,
    /// before anything is touched.
    #[tokio::test]
    async fn a_replica_id_that_is_not_a_plain_name_stops_start_up() {
        for bad in ["../other", ".", "", "a/b"] {
            let mut settings = quire_config::defaults();
            settings.worker.metrics_listen = "127.0.0.1:0".into();
            settings.worker.replica_id = bad.into();
            let error = Application::build(settings, Mode::Serve)
                .await
                .err()
                .unwrap_or_else(|| panic!("{bad:?} was accepted"));
            assert!(matches!(error, WorkerError::Config(_)), "{error}");
            assert!(error.to_string().contains("worker.replica_id"), "{error}");
        }
    }
}
