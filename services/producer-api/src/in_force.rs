//! The definition in force for each stream, as this replica knows it, so
//! the records route can run the definition's typed check before it
//! publishes (the worker runs the same check before it renders).
//!
//! A replica learns a definition two ways: from its own `PUT` at once, and
//! from the readable copy in the bucket (`definitions/{stream}.json`),
//! read again once it is older than `api.definition_refresh_ms`. So a
//! definition put through another replica is enforced here within that
//! time; a record accepted in between against the older definition, and
//! refused by the newer one, becomes a dead letter at the worker, named by
//! the same check. When the bucket cannot be read, the last definition
//! known stays in force; a stream never read successfully is not checked
//! at the door (the worker still checks), and a warning says so, because
//! refusing every record while S3 is away would stop ingestion for a
//! check the worker makes anyway.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lru::LruCache;
use quire_messages::StreamName;
use quire_xml::TypedCheck;

use crate::routes::definitions::StoredDefinition;
use crate::storage::{Storage, definition_key};

/// The most streams whose definitions one replica keeps; the least recently
/// used is dropped (and read again when next needed), so a client naming
/// many streams costs bounded memory.
pub const MAX_STREAMS: usize = 10_000;

/// A stream's definition as last learned.
#[derive(Clone)]
struct Known {
    /// `None`: no definition, or one without typed fields.
    check: Option<Arc<TypedCheck>>,
    /// The control message's position, to keep the later of two.
    position: Option<(i32, i64)>,
    learned: Instant,
}

pub struct DefinitionsInForce {
    storage: Storage,
    refresh: Duration,
    known: Mutex<LruCache<StreamName, Known>>,
}

impl DefinitionsInForce {
    pub fn new(storage: Storage, refresh: Duration) -> Self {
        Self {
            storage,
            refresh,
            known: Mutex::new(LruCache::new(
                NonZeroUsize::new(MAX_STREAMS).expect("MAX_STREAMS is not 0"),
            )),
        }
    }

    /// The typed check records of `stream` pass, if its definition has one.
    pub async fn check_for(&self, stream: &StreamName) -> Option<Arc<TypedCheck>> {
        let cached = self.lock().get(stream).cloned();
        if let Some(known) = &cached
            && known.learned.elapsed() < self.refresh
        {
            return known.check.clone();
        }
        let key = definition_key(stream);
        let read = match self.storage.get_small(&key).await {
            Ok(None) => Ok(None),
            Ok(Some(bytes)) => serde_json::from_slice::<StoredDefinition>(&bytes)
                .map(Some)
                .map_err(|error| format!("{key} cannot be read: {error}")),
            Err(error) => Err(error.to_string()),
        };
        let learned = match read {
            Ok(stored) => Known {
                check: stored
                    .as_ref()
                    .and_then(|stored| TypedCheck::new(&stored.definition))
                    .map(Arc::new),
                position: stored.as_ref().and_then(StoredDefinition::position),
                learned: Instant::now(),
            },
            Err(error) => {
                tracing::warn!(
                    %stream,
                    %error,
                    "the definition in force could not be read; {} until the next try",
                    if cached.as_ref().is_some_and(|known| known.check.is_some()) {
                        "the last one known is enforced"
                    } else {
                        "records are checked by the worker only"
                    }
                );
                Known {
                    learned: Instant::now(),
                    ..cached.unwrap_or(Known {
                        check: None,
                        position: None,
                        learned: Instant::now(),
                    })
                }
            }
        };
        self.learn(stream.clone(), learned).check
    }

    /// This replica's own `PUT`: in force here at once.
    pub fn published(&self, stored: &StoredDefinition) {
        self.learn(
            stored.stream.clone(),
            Known {
                check: TypedCheck::new(&stored.definition).map(Arc::new),
                position: stored.position(),
                learned: Instant::now(),
            },
        );
    }

    /// Keeps `learned` unless what is known is of a later control message
    /// (a copy read before this replica's own later PUT landed there);
    /// returns what is then known.
    fn learn(&self, stream: StreamName, learned: Known) -> Known {
        let mut known = self.lock();
        let kept = match known.get(&stream) {
            Some(existing)
                if existing.position.is_some() && existing.position > learned.position =>
            {
                Known {
                    learned: learned.learned,
                    ..existing.clone()
                }
            }
            _ => learned,
        };
        known.put(stream, kept.clone());
        kept
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LruCache<StreamName, Known>> {
        self.known
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
