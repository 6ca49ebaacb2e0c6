//! Serving connections with bounds a hostile client cannot stretch.
//!
//! `axum::serve` runs hyper without a timer, so it has no header-read
//! timeout, no idle timeout and no connection cap: a client that opens
//! sockets and sends a header byte now and then holds each one forever.
//! Here hyper gets tokio's timer and:
//! - `api.header_read_timeout_ms`: a request head (HTTP/1) must arrive
//!   whole within it, counted from when the connection starts waiting for
//!   one, so it also closes a kept-alive connection left idle;
//! - `api.idle_timeout_ms`: a connection on which no byte moves either way
//!   for that long is closed (HTTP/1 and HTTP/2, whatever state it is in);
//! - `api.max_connections`: past it, the listener stops accepting until a
//!   connection ends (new ones wait in the kernel's backlog).
//!
//! The connections open (accepted, not yet closed) are counted in a gauge
//! (`quire_api_open_connections`), by a guard each connection's task owns:
//! whichever way it ends (answered, reset, timed out, the task dropped at
//! shutdown), the count goes down.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::time::{Instant, Sleep};

/// The bounds of every connection (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
}

/// Serves `router` on `listener` until `shutdown` completes, then stops
/// accepting and waits for the connections' requests to finish. Each open
/// connection counts one in `open_connections`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    open_connections: Gauge,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let service = TowerToHyperService::new(router);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = Arc::clone(&slots).acquire_owned() => slot.expect("the semaphore is never closed"),
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(error) => {
                    // Out of file descriptors, or a connection reset before
                    // it was accepted: keep serving the others.
                    tracing::warn!(%error, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let open = OpenConnection::count(&open_connections);
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(IdleTimeout::new(stream, limits.idle_timeout));
        let connection = builder
            .serve_connection_with_upgrades(io, service.clone())
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A client that goes away, or a bound that closes it, ends the
            // connection with an error: nothing to report but at debug.
            if let Err(error) = connection.await {
                tracing::debug!(error = %error, "connection ended");
            }
            drop(open);
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// One open connection in the gauge, until dropped.
struct OpenConnection(Gauge);

impl OpenConnection {
    fn count(gauge: &Gauge) -> Self {
        gauge.inc();
        OpenConnection(gauge.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A stream that fails with `TimedOut` once no byte has moved either way
/// for `limit`, so the connection serving it ends.
struct IdleTimeout<S> {
    stream: S,
    limit: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<S> IdleTimeout<S> {
    fn new(stream: S, limit: Duration) -> Self {
        IdleTimeout {
            stream,
            limit,
            deadline: Box::pin(tokio::time::sleep(limit)),
        }
    }

    fn moved(&mut self) {
        self.deadline.as_mut().reset(Instant::now() + self.limit);
    }

    fn expired(&mut self, context: &mut Context<'_>) -> bool {
        self.deadline.as_mut().poll(context).is_ready()
    }

    /// A write that moved bytes resets the deadline; one that stalls past
    /// it (a client that stops reading) fails: that is idle too.
    fn after_write(
        &mut self,
        context: &mut Context<'_>,
        written: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match written {
            Poll::Ready(result) => {
                if matches!(result, Ok(count) if count > 0) {
                    self.moved();
                }
                Poll::Ready(result)
            }
            Poll::Pending if self.expired(context) => Poll::Ready(Err(idle_error())),
            Poll::Pending => Poll::Pending,
        }
    }
}

fn idle_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "connection idle past api.idle_timeout_ms",
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for IdleTimeout<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffer: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buffer.filled().len();
        match Pin::new(&mut this.stream).poll_read(context, buffer) {
            Poll::Ready(result) => {
                if buffer.filled().len() > before {
                    this.moved();
                }
                Poll::Ready(result)
            }
            Poll::Pending if this.expired(context) => Poll::Ready(Err(idle_error())),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for IdleTimeout<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write(context, data);
        this.after_write(context, written)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buffers: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write_vectored(context, buffers);
        this.after_write(context, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(context)
    }

    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(context)
    }
}
