//! `Idempotency-Key` answers in Kafka, shared by every API replica and kept
//! across restarts.
//!
//! Each answer that published is written to `kafka.topics.idempotency` in
//! the same transaction as the array it answers (a follower of the array,
//! see `quire_queue::TransactionalProducer::transact_then`), so it exists
//! exactly when the records do: a committed array always has its answer,
//! an aborted one never. The message's key is the SHA-256 of the scoped
//! key, and its partition is taken from that digest, so one partition holds
//! every answer a key could have.
//!
//! Every replica follows the topic for its whole life (a
//! `quire_queue::TopicTail`: one read_committed client, its own thread),
//! feeding each answer younger than `api.idempotency_ttl_ms` into its
//! in-memory store; start-up waits until the tail has read what was there.
//! Before a replica handles a key it does not know, it catches up on that
//! key's partition: it asks the partition's high watermark and waits until
//! the tail has covered it (every transaction below it has ended and been
//! read), at most `api.idempotency_lookup_timeout_ms` (2 s). An answer that another replica,
//! or this one before a restart, committed before the retry arrived is
//! therefore found, and replayed, instead of publishing again. A catch-up
//! that cannot finish (Kafka away, a leader moving, a transaction left
//! open) is answered 503 with `Retry-After` and publishes nothing.
//!
//! What remains possible: two requests with one key reaching two replicas
//! within one publish of each other (each looks before the other's answer
//! is written) both publish. The window is the time from the look-up to
//! the first delivery of the answer, a few milliseconds to tens of them.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderValue, StatusCode};
use quire_config::KafkaSettings;
use quire_queue::{InMessage, OutMessage, QueueError, ReadError, TopicTail};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::idempotency::{Digest32, IdempotencyStore, ScopedKey, StoredResponse};

/// One stored answer, as JSON on the topic.
#[derive(Debug, Serialize, Deserialize)]
struct StoredEntry {
    v: u32,
    principal: String,
    method: String,
    path: String,
    key: String,
    fingerprint: String,
    status: u16,
    content_type: Option<String>,
    location: Option<String>,
    body: String,
    created_ms: u64,
}

/// The topic, its partitions, and this replica's tail of it.
pub struct KeyLog {
    topic: String,
    partitions: i32,
    /// Feeds every answer committed to the topic into the store.
    tail: TopicTail,
    /// Answers handed to the store by the tail since start-up.
    loaded: Arc<AtomicUsize>,
    /// How long a look-up may wait for the tail
    /// (`api.idempotency_lookup_timeout_ms`).
    catch_up_limit: Duration,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64)
}

/// The SHA-256 of a scoped key: the message key, and where it goes.
pub fn key_digest(key: &ScopedKey) -> Digest32 {
    let mut hasher = Sha256::new();
    for part in [
        &key.principal[..],
        key.method.as_bytes(),
        key.path.as_bytes(),
        key.key.as_bytes(),
    ] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hasher.finalize().into()
}

impl KeyLog {
    /// Starts following the topic into `store`: answers younger than `ttl`
    /// are remembered as they are committed, by any replica. Blocks for the
    /// partitions' low watermarks: call it from the blocking pool.
    pub fn start(
        settings: &KafkaSettings,
        partitions: i32,
        group_id: &str,
        ttl: Duration,
        catch_up_limit: Duration,
        store: Arc<IdempotencyStore>,
    ) -> Result<Self, QueueError> {
        let loaded = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&loaded);
        let ttl_ms = ttl.as_millis() as u64;
        let tail = TopicTail::start(
            settings,
            group_id,
            &settings.topics.idempotency,
            partitions,
            move |message| {
                if let Some((key, fingerprint, answer, age)) = decode(&message, now_ms())
                    && age < ttl_ms
                {
                    store.insert_answered(key, fingerprint, answer, Duration::from_millis(age));
                    counted.fetch_add(1, Ordering::Relaxed);
                }
            },
        )?;
        Ok(KeyLog {
            topic: settings.topics.idempotency.clone(),
            partitions,
            tail,
            loaded,
            catch_up_limit,
        })
    }

    /// The partition of a key's answers.
    pub fn partition_of(&self, key: &ScopedKey) -> i32 {
        let digest = key_digest(key);
        let head = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
        (head % self.partitions.max(1) as u32) as i32
    }

    /// The message that stores `answer` for `key` (written in the
    /// transaction of the array it answers).
    pub fn entry(
        &self,
        key: &ScopedKey,
        fingerprint: &Digest32,
        answer: &StoredResponse,
    ) -> OutMessage {
        let header = |name: &str| {
            answer
                .headers
                .iter()
                .find(|(header, _)| *header == name)
                .and_then(|(_, value)| value.to_str().ok())
                .map(str::to_owned)
        };
        let entry = StoredEntry {
            v: 1,
            principal: hex::encode(key.principal),
            method: key.method.clone(),
            path: key.path.clone(),
            key: key.key.clone(),
            fingerprint: hex::encode(fingerprint),
            status: answer.status.as_u16(),
            content_type: header("content-type"),
            location: header("location"),
            body: String::from_utf8_lossy(&answer.body).into_owned(),
            created_ms: now_ms(),
        };
        OutMessage::new(
            &self.topic,
            Some(hex::encode(key_digest(key)).into_bytes()),
            serde_json::to_vec(&entry).expect("an entry serializes"),
        )
        .to_partition(self.partition_of(key))
    }

    /// What the API's producers commit to release the topic's partitions
    /// (see `quire_queue::Release`): a hanging transaction here would stop
    /// every look-up of the keys of its partition. Not an entry: ignored.
    pub fn release_messages(&self) -> Vec<OutMessage> {
        (0..self.partitions)
            .map(|partition| {
                OutMessage::new(&self.topic, None, br#"{"release":1}"#.to_vec())
                    .to_partition(partition)
            })
            .collect()
    }

    /// Waits until the tail has read every partition as far as it was
    /// written when the call began (at start-up: every stored answer is in
    /// memory before the first request); the answers read so far.
    pub async fn load(&self, limit: Duration) -> Result<usize, ReadError> {
        self.tail.catch_up_all(self.partitions, limit).await?;
        Ok(self.loaded.load(Ordering::Relaxed))
    }

    /// Waits until every answer committed on `key`'s partition before this
    /// call (by any replica) is in the store: a transaction still open
    /// there may hold the key's answer, so it is waited for too. At most
    /// `api.idempotency_lookup_timeout_ms`.
    pub async fn catch_up_for(&self, key: &ScopedKey) -> Result<(), ReadError> {
        self.tail
            .catch_up(self.partition_of(key), self.catch_up_limit)
            .await
    }
}

/// An entry's key, fingerprint, answer and age (ms); `None` for a message
/// that is not one (a newer format, garbage).
fn decode(message: &InMessage, now_ms: u64) -> Option<(ScopedKey, Digest32, StoredResponse, u64)> {
    let entry: StoredEntry = serde_json::from_slice(message.payload.as_deref()?).ok()?;
    if entry.v != 1 {
        return None;
    }
    let mut principal = [0u8; 32];
    hex::decode_to_slice(&entry.principal, &mut principal).ok()?;
    let mut fingerprint = [0u8; 32];
    hex::decode_to_slice(&entry.fingerprint, &mut fingerprint).ok()?;
    let mut headers = Vec::new();
    if let Some(value) = entry
        .content_type
        .and_then(|text| HeaderValue::from_str(&text).ok())
    {
        headers.push(("content-type", value));
    }
    if let Some(value) = entry
        .location
        .and_then(|text| HeaderValue::from_str(&text).ok())
    {
        headers.push(("location", value));
    }
    let answer = StoredResponse {
        status: StatusCode::from_u16(entry.status).ok()?,
        headers,
        body: bytes::Bytes::from(entry.body),
    };
    let key = ScopedKey {
        principal,
        method: entry.method,
        path: entry.path,
        key: entry.key,
    };
    Some((
        key,
        fingerprint,
        answer,
        now_ms.saturating_sub(entry.created_ms),
    ))
}
