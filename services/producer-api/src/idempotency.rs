//! `Idempotency-Key` (IETF httpapi draft "The Idempotency-Key HTTP Header
//! Field"): a retried request is answered with the first answer, and
//! publishes nothing again.
//!
//! A key is scoped by the bearer token that sent it (when authentication is
//! on) and by the request's method and path (route and stream). Its request
//! is fingerprinted (SHA-256 of method, path and body). The store is in
//! memory, in this process: a key survives neither a restart nor a request
//! that lands on another replica. It holds at most `api.idempotency_max_keys`
//! keys and `api.idempotency_max_bytes` bytes of answers, each for
//! `api.idempotency_ttl_ms`; the oldest keys are forgotten first.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::http::{HeaderValue, StatusCode};
use bytes::Bytes;
use sha2::{Digest, Sha256};

use crate::errors::ApiError;

/// The request header.
pub const HEADER: &str = "idempotency-key";
/// The header on a replayed answer.
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
/// Longest key accepted.
pub const MAX_KEY_LENGTH: usize = 255;

pub type Digest32 = [u8; 32];

/// Checks an `Idempotency-Key` value: 1-255 visible ASCII characters. The
/// draft's structured-field quotes (`"abc"`) are taken off.
pub fn parse_key(value: &HeaderValue) -> Result<String, ApiError> {
    let raw = value.as_bytes();
    let unquoted = match raw {
        [b'"', inner @ .., b'"'] => inner,
        other => other,
    };
    if unquoted.is_empty() || unquoted.len() > MAX_KEY_LENGTH {
        return Err(ApiError::InvalidIdempotencyKey(format!(
            "it is {} characters long; it must be 1 to {MAX_KEY_LENGTH}",
            unquoted.len()
        )));
    }
    if let Some(position) = unquoted.iter().position(|byte| !byte.is_ascii_graphic()) {
        return Err(ApiError::InvalidIdempotencyKey(format!(
            "character {} is not a visible ASCII character",
            position + 1
        )));
    }
    // Visible ASCII: valid UTF-8.
    Ok(String::from_utf8_lossy(unquoted).into_owned())
}

/// SHA-256 of method, path and body, each length-prefixed so that no two
/// different requests share a fingerprint by moving bytes between parts.
pub fn fingerprint(method: &str, path: &str, body: &[u8]) -> Digest32 {
    let mut hasher = Sha256::new();
    for part in [method.as_bytes(), path.as_bytes(), body] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hasher.finalize().into()
}

/// What a key is remembered under.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ScopedKey {
    /// SHA-256 of the bearer token (all zeros when authentication is off).
    pub principal: Digest32,
    pub method: String,
    pub path: String,
    pub key: String,
}

impl ScopedKey {
    fn size(&self) -> usize {
        32 + self.method.len() + self.path.len() + self.key.len()
    }
}

/// A remembered answer.
#[derive(Debug, Clone)]
pub struct StoredResponse {
    pub status: StatusCode,
    /// The headers worth replaying (Content-Type, Location).
    pub headers: Vec<(&'static str, HeaderValue)>,
    pub body: Bytes,
}

impl StoredResponse {
    fn size(&self) -> usize {
        self.body.len()
            + self
                .headers
                .iter()
                .map(|(name, value)| name.len() + value.len())
                .sum::<usize>()
    }
}

/// Whether an answer is definite and so remembered: 2xx, and the 4xx that
/// judge the request itself (not 401, 408, 409, 429, which a retry may change).
pub fn is_definite(status: StatusCode) -> bool {
    status.is_success()
        || (status.is_client_error()
            && !matches!(
                status,
                StatusCode::UNAUTHORIZED
                    | StatusCode::FORBIDDEN
                    | StatusCode::REQUEST_TIMEOUT
                    | StatusCode::CONFLICT
                    | StatusCode::TOO_MANY_REQUESTS
            ))
}

/// Bounds of the store.
#[derive(Debug, Clone, Copy)]
pub struct StoreLimits {
    pub max_keys: usize,
    pub max_bytes: usize,
    pub ttl: Duration,
}

/// What to do with a request that carries a key.
#[derive(Debug)]
pub enum Begin {
    /// First time: go on; finish the claim with the answer.
    Proceed(Claim),
    /// Answered before: send this again.
    Replay(Arc<StoredResponse>),
    /// The key was used for another request.
    Mismatch,
    /// The first request with this key is still being handled.
    InProgress,
}

#[derive(Debug)]
enum State {
    InProgress,
    Done(Arc<StoredResponse>),
}

#[derive(Debug)]
struct Entry {
    generation: u64,
    fingerprint: Digest32,
    state: State,
    bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<ScopedKey, Entry>,
    /// Keys in the order they were first seen, with their generation (an
    /// entry removed and created again has a new one; stale items are
    /// skipped).
    order: VecDeque<(ScopedKey, u64, Instant)>,
    bytes: usize,
    next_generation: u64,
}

/// The in-memory key store.
#[derive(Debug)]
pub struct IdempotencyStore {
    limits: StoreLimits,
    inner: Mutex<Inner>,
}

impl IdempotencyStore {
    pub fn new(limits: StoreLimits) -> Arc<Self> {
        Arc::new(IdempotencyStore {
            limits,
            inner: Mutex::new(Inner::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Looks the key up; claims it when it is new (or expired).
    pub fn begin(self: &Arc<Self>, key: ScopedKey, fingerprint: Digest32) -> Begin {
        let now = Instant::now();
        let mut inner = self.lock();
        self.evict(&mut inner, now);
        if let Some(entry) = inner.entries.get(&key) {
            if entry.fingerprint != fingerprint {
                return Begin::Mismatch;
            }
            return match &entry.state {
                State::InProgress => Begin::InProgress,
                State::Done(response) => Begin::Replay(Arc::clone(response)),
            };
        }
        let generation = inner.next_generation;
        inner.next_generation += 1;
        let bytes = key.size();
        inner.bytes += bytes;
        inner.order.push_back((key.clone(), generation, now));
        inner.entries.insert(
            key.clone(),
            Entry {
                generation,
                fingerprint,
                state: State::InProgress,
                bytes,
            },
        );
        // Room for the new key: evict again with it counted.
        self.evict(&mut inner, now);
        Begin::Proceed(Claim {
            store: Arc::clone(self),
            key: Some(key),
            generation,
        })
    }

    /// Keys remembered (answered or in progress).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn evict(&self, inner: &mut Inner, now: Instant) {
        while let Some((_, _, created)) = inner.order.front() {
            let expired = now.duration_since(*created) >= self.limits.ttl;
            let over =
                inner.entries.len() > self.limits.max_keys || inner.bytes > self.limits.max_bytes;
            if !expired && !over {
                break;
            }
            let Some((key, generation, _)) = inner.order.pop_front() else {
                break;
            };
            if inner
                .entries
                .get(&key)
                .is_some_and(|entry| entry.generation == generation)
                && let Some(entry) = inner.entries.remove(&key)
            {
                inner.bytes -= entry.bytes;
            }
        }
        // Abandoned keys leave stale items behind; keep the line bounded.
        if inner.order.len() > 2 * inner.entries.len() + 1024 {
            let Inner { entries, order, .. } = inner;
            order.retain(|(key, generation, _)| {
                entries
                    .get(key)
                    .is_some_and(|entry| entry.generation == *generation)
            });
        }
    }

    fn complete(&self, key: &ScopedKey, generation: u64, response: StoredResponse) {
        let mut inner = self.lock();
        let added = response.size();
        let Some(entry) = inner.entries.get_mut(key) else {
            return;
        };
        if entry.generation != generation {
            return;
        }
        entry.state = State::Done(Arc::new(response));
        entry.bytes += added;
        inner.bytes += added;
        self.evict(&mut inner, Instant::now());
    }

    fn abandon(&self, key: &ScopedKey, generation: u64) {
        let mut inner = self.lock();
        if inner
            .entries
            .get(key)
            .is_some_and(|entry| entry.generation == generation)
            && let Some(entry) = inner.entries.remove(key)
        {
            inner.bytes -= entry.bytes;
        }
    }
}

/// A key claimed by the request handling it. [`Claim::complete`] remembers
/// the answer; dropping the claim without it forgets the key, so a retry is
/// handled afresh (used for answers that published nothing).
#[derive(Debug)]
pub struct Claim {
    store: Arc<IdempotencyStore>,
    key: Option<ScopedKey>,
    generation: u64,
}

impl Claim {
    pub fn complete(mut self, response: StoredResponse) {
        if let Some(key) = self.key.take() {
            self.store.complete(&key, self.generation, response);
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.store.abandon(&key, self.generation);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(max_keys: usize, max_bytes: usize, ttl: Duration) -> Arc<IdempotencyStore> {
        IdempotencyStore::new(StoreLimits {
            max_keys,
            max_bytes,
            ttl,
        })
    }

    fn key(name: &str) -> ScopedKey {
        ScopedKey {
            principal: [0; 32],
            method: "POST".into(),
            path: "/v1/streams/s/records".into(),
            key: name.into(),
        }
    }

    fn answer(body: &'static str) -> StoredResponse {
        StoredResponse {
            status: StatusCode::OK,
            headers: vec![],
            body: Bytes::from_static(body.as_bytes()),
        }
    }

    #[test]
    fn keys_are_one_to_255_visible_ascii_characters() {
        let ok = |text: &str| parse_key(&HeaderValue::from_str(text).unwrap());
        assert_eq!(ok("abc-123").unwrap(), "abc-123");
        assert_eq!(ok("\"quoted\"").unwrap(), "quoted");
        assert_eq!(ok(&"k".repeat(255)).unwrap().len(), 255);
        for bad in ["", "\"\"", "a b", "tab\there"] {
            let error = ok(bad).unwrap_err();
            assert_eq!(error.status(), StatusCode::BAD_REQUEST, "{bad:?}");
            assert!(error.to_string().contains("Idempotency-Key"), "{error}");
        }
        assert!(ok(&"k".repeat(256)).is_err());
        let latin = HeaderValue::from_bytes("é".as_bytes()).unwrap();
        assert!(parse_key(&latin).is_err());
    }

    #[test]
    fn fingerprints_tell_method_path_and_body_apart() {
        let base = fingerprint("POST", "/a", b"body");
        assert_eq!(base, fingerprint("POST", "/a", b"body"));
        assert_ne!(base, fingerprint("POST", "/a", b"bodx"));
        assert_ne!(base, fingerprint("PUT", "/a", b"body"));
        assert_ne!(
            fingerprint("POST", "/ab", b"c"),
            fingerprint("POST", "/a", b"bc")
        );
    }

    #[test]
    fn the_first_answer_is_replayed_and_a_new_body_is_a_mismatch() {
        let store = store(10, 1 << 20, Duration::from_secs(60));
        let Begin::Proceed(claim) = store.begin(key("k"), [1; 32]) else {
            panic!("new key")
        };
        assert!(matches!(store.begin(key("k"), [1; 32]), Begin::InProgress));
        assert!(matches!(store.begin(key("k"), [2; 32]), Begin::Mismatch));
        claim.complete(answer("first"));
        let Begin::Replay(replayed) = store.begin(key("k"), [1; 32]) else {
            panic!("answered key")
        };
        assert_eq!(replayed.body, "first");
        assert!(matches!(store.begin(key("k"), [2; 32]), Begin::Mismatch));
        // Another token or path is another key.
        let mut other = key("k");
        other.principal = [9; 32];
        assert!(matches!(store.begin(other, [2; 32]), Begin::Proceed(_)));
    }

    #[test]
    fn an_abandoned_claim_lets_a_retry_proceed() {
        let store = store(10, 1 << 20, Duration::from_secs(60));
        let Begin::Proceed(claim) = store.begin(key("k"), [1; 32]) else {
            panic!("new key")
        };
        drop(claim);
        assert!(store.is_empty());
        assert!(matches!(store.begin(key("k"), [1; 32]), Begin::Proceed(_)));
    }

    #[test]
    fn the_oldest_keys_go_first_past_the_bounds() {
        let store = store(2, 1 << 20, Duration::from_secs(60));
        for name in ["a", "b", "c"] {
            let Begin::Proceed(claim) = store.begin(key(name), [1; 32]) else {
                panic!("new key {name}")
            };
            claim.complete(answer("x"));
        }
        assert_eq!(store.len(), 2);
        assert!(matches!(store.begin(key("b"), [1; 32]), Begin::Replay(_)));
        let Begin::Proceed(_forgotten) = store.begin(key("a"), [1; 32]) else {
            panic!("a was the oldest and is forgotten")
        };

        let small = self::store(100, 200, Duration::from_secs(60));
        for name in ["a", "b", "c"] {
            let Begin::Proceed(claim) = small.begin(key(name), [1; 32]) else {
                panic!("new key {name}")
            };
            claim.complete(StoredResponse {
                status: StatusCode::OK,
                headers: vec![],
                body: Bytes::from(vec![b'x'; 80]),
            });
        }
        assert!(matches!(small.begin(key("c"), [1; 32]), Begin::Replay(_)));
        assert!(matches!(small.begin(key("a"), [1; 32]), Begin::Proceed(_)));
    }

    #[test]
    fn keys_expire_after_their_ttl() {
        let store = store(10, 1 << 20, Duration::ZERO);
        let Begin::Proceed(claim) = store.begin(key("k"), [1; 32]) else {
            panic!("new key")
        };
        claim.complete(answer("x"));
        assert!(matches!(store.begin(key("k"), [2; 32]), Begin::Proceed(_)));
    }

    #[test]
    fn only_definite_answers_are_remembered() {
        for status in [200, 202, 400, 413, 415, 422] {
            assert!(
                is_definite(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
        for status in [401, 409, 429, 500, 503] {
            assert!(
                !is_definite(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
    }
}
