//! `Idempotency-Key` (IETF httpapi draft "The Idempotency-Key HTTP Header
//! Field"): a retried request is answered with the first answer, and
//! publishes nothing again.
//!
//! A key is scoped by the bearer token that sent it (when authentication is
//! on) and by the request's method and percent-decoded path (route and
//! stream). Its request is fingerprinted (SHA-256 of method, path and
//! body). Only answers that published (2xx) are remembered: an error
//! published nothing, so a retry is answered afresh.
//!
//! A key whose request is still running, or whose commit's outcome Kafka
//! did not confirm (settled in the background from the log, see
//! [`Unsettled`]), is never forgotten: a retry meanwhile gets 409, never a
//! second publish. Answered keys are forgotten after
//! `api.idempotency_ttl_ms`, or, past `api.idempotency_max_keys` keys or
//! `api.idempotency_max_bytes` bytes, oldest first from the principal that
//! holds the most, so one client's flood pushes out its own keys, not
//! another's.
//!
//! The store is in memory; [`crate::key_log`] writes each answer that
//! published to Kafka in the array's own transaction, loads them at
//! start-up and catches up before a key unknown here is handled, so a key
//! survives a restart and is shared by the replicas.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use bytes::Bytes;
use futures::future::BoxFuture;
use sha2::{Digest, Sha256};

use crate::errors::ApiError;

/// Attached (as a response extension) to an answer whose commit outcome
/// is unknown: how to learn it. `settle` reads the log; it gives the
/// answer the request would have had once the outcome is known (the
/// success answer if committed, an error if aborted), `None` while it
/// cannot tell yet.
#[derive(Clone)]
pub struct Unsettled {
    pub settle: Arc<dyn Fn() -> BoxFuture<'static, Option<Response>> + Send + Sync>,
}

/// Put on a keyed request that proceeds (a request extension): the route
/// stores its answer in Kafka, in the array's transaction, under this key.
#[derive(Debug, Clone)]
pub struct KeyedRequest {
    pub key: ScopedKey,
    pub fingerprint: Digest32,
}

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

/// Whether an answer is remembered: only those that published (2xx). An
/// error published nothing, so answering a retry afresh is exact, and a
/// flood of cheap error answers fills nothing.
pub fn is_definite(status: StatusCode) -> bool {
    status.is_success()
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
    /// The first request with this key is still being handled, or its
    /// commit's outcome is being settled from the log.
    InProgress,
}

#[derive(Debug)]
enum State {
    InProgress,
    /// Published with a commit whose outcome Kafka did not confirm; a task
    /// reads the log until it knows.
    Settling,
    Done(Arc<StoredResponse>),
}

#[derive(Debug)]
struct Entry {
    generation: u64,
    fingerprint: Digest32,
    state: State,
    bytes: usize,
}

impl Entry {
    /// Keys whose request may still publish are never forgotten.
    fn pinned(&self) -> bool {
        !matches!(self.state, State::Done(_))
    }
}

/// One principal's keys, in the order they were first seen, with their
/// generation (an entry removed and created again has a new one; stale
/// items are skipped).
#[derive(Debug, Default)]
struct PrincipalKeys {
    order: VecDeque<(ScopedKey, u64, Instant)>,
    keys: usize,
    bytes: usize,
}

#[derive(Debug, Default)]
struct Inner {
    entries: HashMap<ScopedKey, Entry>,
    principals: HashMap<Digest32, PrincipalKeys>,
    bytes: usize,
    next_generation: u64,
}

/// What the store must let go of.
#[derive(Debug, Clone, Copy)]
enum Pressure {
    Expired(Instant),
    Keys,
    Bytes,
}

impl Inner {
    fn remove(&mut self, key: &ScopedKey) {
        if let Some(entry) = self.entries.remove(key) {
            self.bytes -= entry.bytes;
            if let Some(keys) = self.principals.get_mut(&key.principal) {
                keys.keys -= 1;
                keys.bytes -= entry.bytes;
            }
        }
    }

    fn add_bytes(&mut self, principal: &Digest32, bytes: usize) {
        self.bytes += bytes;
        if let Some(keys) = self.principals.get_mut(principal) {
            keys.bytes += bytes;
        }
    }

    /// Forgets `principal`'s oldest answered key (expired ones only, for
    /// `Expired`); keys in progress or settling stay, in their place.
    /// Whether one was forgotten.
    fn forget_oldest(&mut self, principal: &Digest32, pressure: Pressure, ttl: Duration) -> bool {
        let Some(keys) = self.principals.get_mut(principal) else {
            return false;
        };
        let mut kept = Vec::new();
        let mut forgotten = None;
        while let Some((key, generation, created)) = keys.order.pop_front() {
            let Some(entry) = self.entries.get(&key) else {
                continue; // removed since: a stale item
            };
            if entry.generation != generation {
                continue;
            }
            if let Pressure::Expired(now) = pressure
                && now.duration_since(created) < ttl
            {
                kept.push((key, generation, created));
                break;
            }
            if entry.pinned() {
                kept.push((key, generation, created));
                continue;
            }
            forgotten = Some(key);
            break;
        }
        for item in kept.into_iter().rev() {
            keys.order.push_front(item);
        }
        match forgotten {
            Some(key) => {
                self.remove(&key);
                true
            }
            None => false,
        }
    }
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
                State::InProgress | State::Settling => Begin::InProgress,
                State::Done(response) => Begin::Replay(Arc::clone(response)),
            };
        }
        let generation = inner.next_generation;
        inner.next_generation += 1;
        let bytes = key.size();
        let keys = inner.principals.entry(key.principal).or_default();
        keys.order.push_back((key.clone(), generation, now));
        keys.keys += 1;
        inner.add_bytes(&key.principal, bytes);
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

    /// Remembers an answer read from the log (another replica's, or this
    /// one's before a restart), given `age` ago, unless the key is known
    /// here already.
    pub fn insert_answered(
        &self,
        key: ScopedKey,
        fingerprint: Digest32,
        answer: StoredResponse,
        age: Duration,
    ) {
        let now = Instant::now();
        let created = now.checked_sub(age).unwrap_or(now);
        let mut inner = self.lock();
        if inner.entries.contains_key(&key) {
            return;
        }
        let generation = inner.next_generation;
        inner.next_generation += 1;
        let bytes = key.size() + answer.size();
        let keys = inner.principals.entry(key.principal).or_default();
        keys.order.push_back((key.clone(), generation, created));
        keys.keys += 1;
        inner.add_bytes(&key.principal, bytes);
        inner.entries.insert(
            key,
            Entry {
                generation,
                fingerprint,
                state: State::Done(Arc::new(answer)),
                bytes,
            },
        );
        self.evict(&mut inner, now);
    }

    /// Whether the key is known here (answered, in progress or settling).
    pub fn contains(&self, key: &ScopedKey) -> bool {
        self.lock().entries.contains_key(key)
    }

    /// Keys remembered (answered, in progress or settling).
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Expired keys go; then, past a bound, the oldest answered keys of
    /// whoever holds the most, so one client's flood of keys pushes out
    /// its own, not another's. A key in progress or settling never goes.
    fn evict(&self, inner: &mut Inner, now: Instant) {
        let ttl = self.limits.ttl;
        let principals: Vec<Digest32> = inner.principals.keys().copied().collect();
        for principal in &principals {
            while inner.forget_oldest(principal, Pressure::Expired(now), ttl) {}
        }
        for pressure in [Pressure::Keys, Pressure::Bytes] {
            loop {
                let over = match pressure {
                    Pressure::Bytes => inner.bytes > self.limits.max_bytes,
                    _ => inner.entries.len() > self.limits.max_keys,
                };
                if !over {
                    break;
                }
                // The largest holder first; if all of its keys are pinned,
                // the next, and so on.
                let mut candidates: Vec<(usize, Digest32)> = inner
                    .principals
                    .iter()
                    .map(|(principal, keys)| {
                        let size = match pressure {
                            Pressure::Bytes => keys.bytes,
                            _ => keys.keys,
                        };
                        (size, *principal)
                    })
                    .collect();
                candidates.sort_unstable_by(|a, b| b.cmp(a));
                let forgot = candidates
                    .iter()
                    .any(|(_, principal)| inner.forget_oldest(principal, pressure, ttl));
                if !forgot {
                    break; // only pinned keys are left
                }
            }
        }
        // Principals with nothing left, and stale items, do not pile up.
        inner.principals.retain(|_, keys| keys.keys > 0);
        let Inner {
            entries,
            principals,
            ..
        } = inner;
        for keys in principals.values_mut() {
            if keys.order.len() > 2 * keys.keys + 1024 {
                keys.order.retain(|(key, generation, _)| {
                    entries
                        .get(key)
                        .is_some_and(|entry| entry.generation == *generation)
                });
            }
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
        inner.add_bytes(&key.principal, added);
        self.evict(&mut inner, Instant::now());
    }

    fn mark_settling(&self, key: &ScopedKey, generation: u64) {
        let mut inner = self.lock();
        if let Some(entry) = inner.entries.get_mut(key)
            && entry.generation == generation
        {
            entry.state = State::Settling;
        }
    }

    fn abandon(&self, key: &ScopedKey, generation: u64) {
        let mut inner = self.lock();
        if inner
            .entries
            .get(key)
            .is_some_and(|entry| entry.generation == generation)
        {
            inner.remove(key);
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

    /// The request's commit has an unknown outcome: the key stays, and
    /// retries get 409, until the claim is completed (committed) or dropped
    /// (aborted: nothing was published).
    pub fn settling(&self) {
        if let Some(key) = &self.key {
            self.store.mark_settling(key, self.generation);
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
    fn only_answers_that_published_are_remembered() {
        for status in [200, 202] {
            assert!(
                is_definite(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
        for status in [400, 401, 403, 409, 413, 422, 429, 500, 503] {
            assert!(
                !is_definite(StatusCode::from_u16(status).unwrap()),
                "{status}"
            );
        }
    }

    fn principal_key(principal: u8, name: &str) -> ScopedKey {
        ScopedKey {
            principal: [principal; 32],
            ..key(name)
        }
    }

    #[test]
    fn keys_in_progress_or_settling_are_never_forgotten() {
        let store = store(2, 1 << 20, Duration::ZERO);
        let Begin::Proceed(running) = store.begin(key("running"), [1; 32]) else {
            panic!("new key")
        };
        let Begin::Proceed(settling) = store.begin(key("settling"), [1; 32]) else {
            panic!("new key")
        };
        settling.settling();
        // Past the key bound and the TTL (zero), with answered keys coming in.
        for name in ["a", "b", "c"] {
            let Begin::Proceed(claim) = store.begin(key(name), [1; 32]) else {
                panic!("new key {name}")
            };
            claim.complete(answer("x"));
        }
        assert!(matches!(
            store.begin(key("running"), [1; 32]),
            Begin::InProgress
        ));
        assert!(matches!(
            store.begin(key("settling"), [1; 32]),
            Begin::InProgress
        ));
        // Settled as committed: answered from now on.
        settling.complete(answer("committed"));
        drop(running);
        let store = self::store(2, 1 << 20, Duration::from_secs(60));
        let Begin::Proceed(settling) = store.begin(key("s"), [1; 32]) else {
            panic!("new key")
        };
        settling.settling();
        assert!(matches!(store.begin(key("s"), [1; 32]), Begin::InProgress));
        settling.complete(answer("committed"));
        let Begin::Replay(replayed) = store.begin(key("s"), [1; 32]) else {
            panic!("settled key")
        };
        assert_eq!(replayed.body, "committed");
    }

    #[test]
    fn one_principals_flood_pushes_out_its_own_keys_not_anothers() {
        let store = store(100, 1 << 20, Duration::from_secs(60));
        for index in 0..10 {
            let Begin::Proceed(claim) =
                store.begin(principal_key(1, &format!("quiet-{index}")), [1; 32])
            else {
                panic!("new key")
            };
            claim.complete(answer("mine"));
        }
        for index in 0..1_000 {
            let Begin::Proceed(claim) =
                store.begin(principal_key(2, &format!("flood-{index}")), [1; 32])
            else {
                panic!("new key")
            };
            claim.complete(answer("flood"));
        }
        assert_eq!(store.len(), 100);
        for index in 0..10 {
            assert!(
                matches!(
                    store.begin(principal_key(1, &format!("quiet-{index}")), [1; 32]),
                    Begin::Replay(_)
                ),
                "the quiet principal lost key {index}"
            );
        }
        // The flood kept its newest keys.
        assert!(matches!(
            store.begin(principal_key(2, "flood-999"), [1; 32]),
            Begin::Replay(_)
        ));
        assert!(matches!(
            store.begin(principal_key(2, "flood-0"), [1; 32]),
            Begin::Proceed(_)
        ));
    }
}
