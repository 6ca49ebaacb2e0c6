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
//! A replica loads the topic at start-up (answers younger than
//! `api.idempotency_ttl_ms`) into its in-memory store, and before it
//! handles a key it does not know, it catches up on that key's partition:
//! it waits until every transaction there has ended (the last stable offset
//! reaches the high watermark it saw) and reads what is new. An answer that
//! another replica, or this one before a restart, committed before the
//! retry arrived is therefore found, and replayed, instead of publishing
//! again.
//!
//! What remains possible: two requests with one key reaching two replicas
//! within one publish of each other (each looks before the other's answer
//! is written) both publish. The window is the time from the look-up to
//! the first delivery of the answer, a few milliseconds to tens of them.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::{HeaderValue, StatusCode};
use quire_config::KafkaSettings;
use quire_queue::{InMessage, OutMessage, PartitionReader, ReadError, ReaderOptions};
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

/// The topic, its partitions, and how far this replica has read each.
pub struct KeyLog {
    topic: String,
    partitions: i32,
    reader: Mutex<PartitionReader>,
    /// Next offset to read, per partition.
    next: Mutex<Vec<i64>>,
    /// How long a look-up may wait for open transactions to end.
    stable_wait: Duration,
    ttl: Duration,
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
    pub fn new(
        settings: &KafkaSettings,
        partitions: i32,
        group_id: &str,
        ttl: Duration,
    ) -> Result<Self, quire_queue::QueueError> {
        let reader = PartitionReader::new(settings, group_id, ReaderOptions::default())?;
        Ok(KeyLog {
            topic: settings.topics.idempotency.clone(),
            partitions,
            reader: Mutex::new(reader),
            next: Mutex::new(vec![0; partitions.max(1) as usize]),
            stable_wait: Duration::from_millis(settings.transaction_timeout_ms),
            ttl,
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

    /// Reads every partition to its end into `store`; the answers found.
    pub async fn load(self: &Arc<Self>, store: &Arc<IdempotencyStore>) -> Result<usize, ReadError> {
        let partitions: Vec<i32> = (0..self.partitions).collect();
        self.catch_up(store, partitions, Duration::from_secs(300))
            .await
    }

    /// Reads what is new on `key`'s partition into `store`, once every
    /// transaction there has ended.
    pub async fn catch_up_for(
        self: &Arc<Self>,
        store: &Arc<IdempotencyStore>,
        key: &ScopedKey,
    ) -> Result<usize, ReadError> {
        let partition = self.partition_of(key);
        self.catch_up(store, vec![partition], self.stable_wait)
            .await
    }

    async fn catch_up(
        self: &Arc<Self>,
        store: &Arc<IdempotencyStore>,
        partitions: Vec<i32>,
        limit: Duration,
    ) -> Result<usize, ReadError> {
        let log = Arc::clone(self);
        let store = Arc::clone(store);
        tokio::task::spawn_blocking(move || log.catch_up_blocking(&store, &partitions, limit))
            .await
            .unwrap_or_else(|error| {
                Err(ReadError::TimedOut {
                    topic: format!("(the look-up task ended: {error})"),
                    partition: -1,
                    offset: -1,
                    waited: Duration::ZERO,
                })
            })
    }

    fn catch_up_blocking(
        &self,
        store: &IdempotencyStore,
        partitions: &[i32],
        limit: Duration,
    ) -> Result<usize, ReadError> {
        // One reader: catch-ups of one replica take turns.
        let reader = self.reader.lock().unwrap_or_else(PoisonError::into_inner);
        let deadline = Instant::now() + limit;
        let mut starts = Vec::with_capacity(partitions.len());
        for &partition in partitions {
            // Transactions open now may hold an answer: wait for them.
            let (_, high) = reader.watermarks(&self.topic, partition, deadline)?;
            if high > 0 {
                reader.wait_until_stable_past(
                    &self.topic,
                    partition,
                    high - 1,
                    deadline.saturating_duration_since(Instant::now()),
                )?;
            }
            let next = self.next.lock().unwrap_or_else(PoisonError::into_inner)[partition as usize];
            starts.push((partition, next));
        }
        let now = now_ms();
        let ttl_ms = self.ttl.as_millis() as u64;
        let mut found = 0;
        let ends = reader.read_range(
            &self.topic,
            &starts,
            deadline.saturating_duration_since(Instant::now()),
            |message| {
                if let Some((key, fingerprint, answer, age)) = decode(&message, now)
                    && age < ttl_ms
                {
                    store.insert_answered(key, fingerprint, answer, Duration::from_millis(age));
                    found += 1;
                }
            },
        )?;
        let mut next = self.next.lock().unwrap_or_else(PoisonError::into_inner);
        for (partition, end) in ends {
            let slot = &mut next[partition as usize];
            *slot = (*slot).max(end);
        }
        Ok(found)
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
