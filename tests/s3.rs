//! S3 helpers for the integration tests: settings from the running local
//! stack, a bucket per test that deletes itself with everything in it, and a
//! fault-injecting proxy in front of the real server (chosen UploadPart
//! requests, or every request by a mode switched while it runs).
//!
//! Nothing here skips: a test that needs S3 and cannot reach it fails, with a
//! message that says how to start the stack.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quire_config::S3Settings;
use quire_s3::aws_sdk_s3::Client;
use quire_s3::{PendingUpload, S3Bucket};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::unique;

/// Where the stack's S3 server is, from `eval "$(deploy/local/stack env)"`.
/// The bucket is the stack's; tests make their own with [`TestBucket`].
pub fn s3_settings() -> S3Settings {
    let variable = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!(
                "{name} is not set: start the stack with `deploy/local/stack up` and \
                 `eval \"$(deploy/local/stack env)\"`, or run the tests through `deploy/local/test`"
            )
        })
    };
    // The credentials come from the standard AWS chain; check them here so a
    // missing export fails with this message rather than a signing error.
    variable("AWS_ACCESS_KEY_ID");
    variable("AWS_SECRET_ACCESS_KEY");
    S3Settings {
        endpoint: variable("QUIRE_S3__ENDPOINT"),
        region: variable("QUIRE_S3__REGION"),
        bucket: variable("QUIRE_S3__BUCKET"),
        ..quire_config::defaults().s3
    }
}

/// A bucket made for one test and deleted, with its objects and pending
/// uploads, when dropped.
pub struct TestBucket {
    pub name: String,
    pub client: Client,
    pub settings: S3Settings,
    deleted: bool,
}

impl TestBucket {
    pub async fn create(prefix: &str) -> TestBucket {
        let mut settings = s3_settings();
        let name = unique(&format!("test-{prefix}"));
        settings.bucket = name.clone();
        let client = quire_s3::build_client(&settings).await;
        client
            .create_bucket()
            .bucket(&name)
            .send()
            .await
            .unwrap_or_else(|error| {
                panic!(
                    "cannot create test bucket {name}; is the stack up (deploy/local/stack up)? {}",
                    quire_s3::aws_sdk_s3::error::DisplayErrorContext(error)
                )
            });
        TestBucket {
            name,
            client,
            settings,
            deleted: false,
        }
    }

    /// Deletes the bucket now, with its objects and pending uploads, and says
    /// why it could not: a server refuses to delete a bucket that still holds
    /// anything, even a stray part no listing shows, so this checks that a
    /// test left nothing behind.
    pub async fn delete(mut self) -> Result<(), String> {
        self.deleted = true;
        delete_bucket_and_contents(self.client.clone(), self.name.clone()).await
    }

    /// A handle on this bucket for writers and sweeps, with fresh counters.
    pub fn handle(&self) -> S3Bucket {
        S3Bucket::new(self.client.clone(), &self.name)
    }

    /// A handle on this bucket whose requests go through `proxy`.
    pub async fn handle_through(&self, proxy: &FaultProxy) -> S3Bucket {
        let mut settings = self.settings.clone();
        settings.endpoint = proxy.endpoint.clone();
        S3Bucket::new(quire_s3::build_client(&settings).await, &self.name)
    }

    /// The object's bytes, or `None` if there is no object at `key`.
    pub async fn read(&self, key: &str) -> Option<Vec<u8>> {
        match self
            .client
            .get_object()
            .bucket(&self.name)
            .key(key)
            .send()
            .await
        {
            Ok(object) => Some(
                object
                    .body
                    .collect()
                    .await
                    .expect("read object body")
                    .into_bytes()
                    .to_vec(),
            ),
            Err(error)
                if error
                    .as_service_error()
                    .is_some_and(|service_error| service_error.is_no_such_key()) =>
            {
                None
            }
            Err(error) => panic!(
                "GetObject {key}: {}",
                quire_s3::aws_sdk_s3::error::DisplayErrorContext(error)
            ),
        }
    }

    /// The keys of every object under `prefix`, all pages.
    pub async fn list(&self, prefix: &str) -> Vec<String> {
        let mut keys = Vec::new();
        let mut pages = self
            .client
            .list_objects_v2()
            .bucket(&self.name)
            .prefix(prefix)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.unwrap_or_else(|error| {
                panic!(
                    "ListObjectsV2 {prefix}: {}",
                    quire_s3::aws_sdk_s3::error::DisplayErrorContext(error)
                )
            });
            keys.extend(
                page.contents()
                    .iter()
                    .filter_map(|object| object.key().map(str::to_owned)),
            );
        }
        keys
    }

    /// The object's size as the server reports it, or `None` if absent.
    pub async fn size(&self, key: &str) -> Option<i64> {
        match self
            .client
            .head_object()
            .bucket(&self.name)
            .key(key)
            .send()
            .await
        {
            Ok(head) => head.content_length(),
            Err(error) if error.raw_response().map(|raw| raw.status().as_u16()) == Some(404) => {
                None
            }
            Err(error) => panic!(
                "HeadObject {key}: {}",
                quire_s3::aws_sdk_s3::error::DisplayErrorContext(error)
            ),
        }
    }

    /// Pending multipart uploads whose key starts with `prefix`.
    pub async fn pending_uploads(&self, prefix: &str) -> Vec<PendingUpload> {
        self.handle()
            .list_pending_uploads(prefix)
            .await
            .expect("ListMultipartUploads")
    }

    /// Waits (at most `limit`) until no multipart upload is pending for `key`,
    /// for aborts that run in the background; false if some still is.
    pub async fn no_pending_upload_within(&self, key: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.pending_uploads(key).await.is_empty() {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for TestBucket {
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        let client = self.client.clone();
        let name = self.name.clone();
        // Drop cannot await; a short-lived runtime on its own thread can.
        let cleanup = std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("cleanup runtime")
                .block_on(delete_bucket_and_contents(client, name))
        });
        if let Ok(Err(error)) = cleanup.join() {
            eprintln!(
                "warning: could not delete test bucket {}: {error}",
                self.name
            );
        }
    }
}

async fn delete_bucket_and_contents(client: Client, name: String) -> Result<(), String> {
    let describe = |error: &dyn std::error::Error| error.to_string();
    S3Bucket::new(client.clone(), &name)
        .abort_pending_uploads("")
        .await
        .map_err(|error| describe(&error))?;
    let mut continuation: Option<String> = None;
    loop {
        let page = client
            .list_objects_v2()
            .bucket(&name)
            .set_continuation_token(continuation.clone())
            .send()
            .await
            .map_err(|error| describe(&error))?;
        // One by one: DeleteObjects needs a checksum header that not every
        // S3-compatible server accepts.
        for object in page.contents() {
            if let Some(key) = object.key() {
                client
                    .delete_object()
                    .bucket(&name)
                    .key(key)
                    .send()
                    .await
                    .map_err(|error| describe(&error))?;
            }
        }
        match page.next_continuation_token() {
            Some(token) if page.is_truncated() == Some(true) => {
                continuation = Some(token.to_owned())
            }
            _ => break,
        }
    }
    client
        .delete_bucket()
        .bucket(&name)
        .send()
        .await
        .map_err(|error| describe(&error))?;
    Ok(())
}

/// What the proxy does to a request it was told to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Reads the request and answers 503 ServiceUnavailable (S3's XML error),
    /// without forwarding it.
    ServiceUnavailable,
    /// Reads the request and answers 500 InternalError, without forwarding it.
    InternalError,
    /// Resets the connection (TCP RST) after the request line and headers.
    ResetConnection,
    /// Forwards the request with one bit of its body flipped (the middle
    /// byte's lowest bit): bytes corrupted between the writer and the
    /// server, which only a checksum of the body can tell.
    FlipBit,
}

/// What the proxy does to every request (after the UploadPart rule, which
/// wins), switched with [`FaultProxy::set_mode`] while it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Every request is forwarded.
    PassThrough,
    /// About `percent` of the requests, drawn at random, fail with `fault`.
    Failing { fault: Fault, percent: u32 },
    /// Every request waits `delay` before it is forwarded.
    Slow { delay: Duration },
    /// Every UploadPart waits `delay` before it is forwarded (a brownout of
    /// the data path: slow, still succeeding); other requests pass.
    SlowParts { delay: Duration },
    /// Every request fails: new connections are reset as soon as they are
    /// accepted, open ones at their next request, as if the server were gone.
    Down,
}

/// An UploadPart request as the proxy sees it.
#[derive(Debug, Clone, Copy)]
pub struct UploadPartSeen {
    /// 1 for the first UploadPart the proxy saw, across all connections.
    pub ordinal: u32,
    pub part_number: u32,
}

type FaultRule = dyn Fn(UploadPartSeen) -> Option<Fault> + Send + Sync;

/// A small HTTP/1.1 proxy in front of the real S3 server that fails chosen
/// UploadPart requests, and any request as its [`ProxyMode`] says (errors on
/// a share, delays, resets, down). Everything else is forwarded byte for
/// byte, the Host header included, so SigV4 signatures (made for the proxy's
/// address) stay valid. Requests are framed by Content-Length, as the SDK
/// sends them.
pub struct FaultProxy {
    /// `http://127.0.0.1:<port>`: use it as the S3 endpoint.
    pub endpoint: String,
    upload_parts_seen: Arc<AtomicU32>,
    faults_injected: Arc<AtomicU32>,
    requests_seen: Arc<AtomicU32>,
    mode: Arc<Mutex<ProxyMode>>,
    uploads_created: Arc<Mutex<BTreeMap<String, u32>>>,
    accept_task: JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy to `upstream_endpoint` (`http://host:port`) on
    /// 127.0.0.1:0; `rule` decides, for each UploadPart, whether to fail it.
    pub async fn start(
        upstream_endpoint: &str,
        rule: impl Fn(UploadPartSeen) -> Option<Fault> + Send + Sync + 'static,
    ) -> FaultProxy {
        let upstream = upstream_endpoint
            .strip_prefix("http://")
            .unwrap_or_else(|| panic!("the fault proxy speaks plain http, not {upstream_endpoint}"))
            .trim_end_matches('/')
            .to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let endpoint = format!("http://{}", listener.local_addr().expect("proxy address"));
        let upload_parts_seen = Arc::new(AtomicU32::new(0));
        let faults_injected = Arc::new(AtomicU32::new(0));
        let requests_seen = Arc::new(AtomicU32::new(0));
        let mode = Arc::new(Mutex::new(ProxyMode::PassThrough));
        let uploads_created = Arc::new(Mutex::new(BTreeMap::new()));
        let shared = Arc::new(ProxyState {
            uploads_created: uploads_created.clone(),
            upstream,
            rule: Box::new(rule),
            upload_parts_seen: upload_parts_seen.clone(),
            faults_injected: faults_injected.clone(),
            requests_seen: requests_seen.clone(),
            mode: mode.clone(),
        });
        let accept_task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(proxy_connection(client, shared.clone()));
            }
        });
        FaultProxy {
            endpoint,
            upload_parts_seen,
            faults_injected,
            requests_seen,
            mode,
            uploads_created,
            accept_task,
        }
    }

    /// CreateMultipartUpload requests seen so far, by object path
    /// (`/bucket/key`): an upload started twice for one key shows as 2.
    pub fn uploads_created(&self) -> BTreeMap<String, u32> {
        self.uploads_created.lock().expect("upload counts").clone()
    }

    /// A proxy that forwards everything until [`FaultProxy::set_mode`] says
    /// otherwise.
    pub async fn switchable(upstream_endpoint: &str) -> FaultProxy {
        Self::start(upstream_endpoint, |_| None).await
    }

    /// What the proxy does to the requests that arrive from now on.
    pub fn set_mode(&self, mode: ProxyMode) {
        *self.mode.lock().expect("proxy mode") = mode;
    }

    /// Requests seen so far, of any kind (failed or forwarded).
    pub fn requests_seen(&self) -> u32 {
        self.requests_seen.load(Ordering::SeqCst)
    }

    /// UploadPart requests seen so far (failed or forwarded).
    pub fn upload_parts_seen(&self) -> u32 {
        self.upload_parts_seen.load(Ordering::SeqCst)
    }

    /// Requests the proxy failed so far.
    pub fn faults_injected(&self) -> u32 {
        self.faults_injected.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

struct ProxyState {
    upstream: String,
    rule: Box<FaultRule>,
    upload_parts_seen: Arc<AtomicU32>,
    faults_injected: Arc<AtomicU32>,
    requests_seen: Arc<AtomicU32>,
    mode: Arc<Mutex<ProxyMode>>,
    uploads_created: Arc<Mutex<BTreeMap<String, u32>>>,
}

impl ProxyState {
    fn mode(&self) -> ProxyMode {
        *self.mode.lock().expect("proxy mode")
    }
}

/// True for about `percent` of the calls.
fn drawn(percent: u32) -> bool {
    (uuid::Uuid::new_v4().as_u128() % 100) < u128::from(percent)
}

async fn proxy_connection(client: TcpStream, state: Arc<ProxyState>) {
    if state.mode() == ProxyMode::Down {
        state.faults_injected.fetch_add(1, Ordering::SeqCst);
        // A zero linger turns the close into a reset.
        let _ = client.set_zero_linger();
        return;
    }
    let Ok(upstream) = TcpStream::connect(&state.upstream).await else {
        return;
    };
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    let client_write = Arc::new(tokio::sync::Mutex::new(client_write));
    // Answers flow back untouched. The SDK never pipelines, so when the next
    // request arrives the previous answer has been written in full.
    let answers = tokio::spawn(copy_answers(upstream_read, client_write.clone()));
    forward_requests(client_read, upstream_write, client_write, &state).await;
    answers.abort();
}

async fn copy_answers(
    mut upstream_read: OwnedReadHalf,
    client_write: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let read = match upstream_read.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if client_write
            .lock()
            .await
            .write_all(&buffer[..read])
            .await
            .is_err()
        {
            break;
        }
    }
    let _ = client_write.lock().await.shutdown().await;
}

/// The request line and headers of one request, as received.
struct RequestHead {
    raw: Vec<u8>,
    method: String,
    target: String,
    content_length: Option<u64>,
    chunked: bool,
}

async fn read_request_head(reader: &mut BufReader<OwnedReadHalf>) -> Option<RequestHead> {
    let mut raw = Vec::new();
    loop {
        let before = raw.len();
        let read = reader.read_until(b'\n', &mut raw).await.ok()?;
        if read == 0 {
            return None;
        }
        let line = &raw[before..];
        if line == b"\r\n" || line == b"\n" {
            break;
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let mut lines = text.lines();
    let mut request_line = lines.next()?.split_whitespace();
    let method = request_line.next()?.to_owned();
    let target = request_line.next()?.to_owned();
    let mut content_length = None;
    let mut chunked = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            content_length = value.parse().ok();
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        }
    }
    Some(RequestHead {
        raw,
        method,
        target,
        content_length,
        chunked,
    })
}

/// The object path of a CreateMultipartUpload request: a POST whose query
/// is `uploads` (with or without a value).
fn created_upload_path(head: &RequestHead) -> Option<&str> {
    if head.method != "POST" {
        return None;
    }
    let (path, query) = head.target.split_once('?')?;
    query
        .split('&')
        .any(|pair| pair == "uploads" || pair == "uploads=")
        .then_some(path)
}

/// `Some(part number)` for an UploadPart request: a PUT with `partNumber=`
/// and `uploadId=` in its query.
fn upload_part_number(head: &RequestHead) -> Option<u32> {
    if head.method != "PUT" {
        return None;
    }
    let (_, query) = head.target.split_once('?')?;
    let mut part_number = None;
    let mut has_upload_id = false;
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("partNumber", value)) => part_number = value.parse().ok(),
            Some(("uploadId", _)) => has_upload_id = true,
            _ => {}
        }
    }
    part_number.filter(|_| has_upload_id)
}

async fn forward_requests(
    client_read: OwnedReadHalf,
    mut upstream_write: OwnedWriteHalf,
    client_write: Arc<tokio::sync::Mutex<OwnedWriteHalf>>,
    state: &ProxyState,
) {
    let mut reader = BufReader::with_capacity(64 * 1024, client_read);
    while let Some(head) = read_request_head(&mut reader).await {
        if head.chunked {
            // Not framed by Content-Length: forward the rest of the
            // connection as it is, without looking at it any more.
            if upstream_write.write_all(&head.raw).await.is_err() {
                return;
            }
            let _ = tokio::io::copy(&mut reader, &mut upstream_write).await;
            return;
        }
        let body_length = head.content_length.unwrap_or(0);
        state.requests_seen.fetch_add(1, Ordering::SeqCst);
        if let Some(path) = created_upload_path(&head) {
            *state
                .uploads_created
                .lock()
                .expect("upload counts")
                .entry(path.to_owned())
                .or_default() += 1;
        }
        let is_upload_part = upload_part_number(&head).is_some();
        let ruled = upload_part_number(&head).and_then(|part_number| {
            let ordinal = state.upload_parts_seen.fetch_add(1, Ordering::SeqCst) + 1;
            (state.rule)(UploadPartSeen {
                ordinal,
                part_number,
            })
        });
        let fault = match (ruled, state.mode()) {
            (Some(fault), _) => Some(fault),
            (None, ProxyMode::PassThrough) => None,
            (None, ProxyMode::Failing { fault, percent }) => drawn(percent).then_some(fault),
            (None, ProxyMode::Slow { delay }) => {
                tokio::time::sleep(delay).await;
                None
            }
            (None, ProxyMode::SlowParts { delay }) => {
                if is_upload_part {
                    tokio::time::sleep(delay).await;
                }
                None
            }
            (None, ProxyMode::Down) => Some(Fault::ResetConnection),
        };
        match fault {
            None => {
                if upstream_write.write_all(&head.raw).await.is_err() {
                    return;
                }
                let mut body = (&mut reader).take(body_length);
                match tokio::io::copy(&mut body, &mut upstream_write).await {
                    Ok(copied) if copied == body_length => {}
                    _ => return,
                }
            }
            Some(fault @ (Fault::ServiceUnavailable | Fault::InternalError)) => {
                state.faults_injected.fetch_add(1, Ordering::SeqCst);
                let mut body = (&mut reader).take(body_length);
                let _ = tokio::io::copy(&mut body, &mut tokio::io::sink()).await;
                let (status_line, code) = if fault == Fault::ServiceUnavailable {
                    ("503 Service Unavailable", "ServiceUnavailable")
                } else {
                    ("500 Internal Server Error", "InternalError")
                };
                let error = format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code>\
                     <Message>injected by the test proxy</Message></Error>"
                );
                let answer = format!(
                    "HTTP/1.1 {status_line}\r\nContent-Type: application/xml\r\n\
                     Content-Length: {}\r\nConnection: close\r\n\r\n{error}",
                    error.len()
                );
                let mut client_write = client_write.lock().await;
                let _ = client_write.write_all(answer.as_bytes()).await;
                let _ = client_write.shutdown().await;
                return;
            }
            Some(Fault::FlipBit) => {
                state.faults_injected.fetch_add(1, Ordering::SeqCst);
                let mut body = Vec::with_capacity(body_length as usize);
                if (&mut reader)
                    .take(body_length)
                    .read_to_end(&mut body)
                    .await
                    .is_err()
                    || body.len() as u64 != body_length
                {
                    return;
                }
                let middle = body.len() / 2;
                if let Some(middle) = body.get_mut(middle) {
                    *middle ^= 1;
                }
                if upstream_write.write_all(&head.raw).await.is_err()
                    || upstream_write.write_all(&body).await.is_err()
                {
                    return;
                }
            }
            Some(Fault::ResetConnection) => {
                state.faults_injected.fetch_add(1, Ordering::SeqCst);
                let client_write = client_write.lock().await;
                // A zero linger turns the close into a reset.
                let _ = AsRef::<TcpStream>::as_ref(&*client_write).set_zero_linger();
                drop(client_write);
                drop(reader);
                return;
            }
        }
    }
    let _ = upstream_write.shutdown().await;
}
