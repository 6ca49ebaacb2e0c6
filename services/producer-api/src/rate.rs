//! Rate limits on the requests that cost the most for the bytes they take:
//! a cut (a transaction; for a stream with nothing new, two S3 objects)
//! and a definition change (a transaction and an S3 write). Each is
//! counted against its stream and against its principal (GCRA buckets of
//! `governor`, refilled continuously); past either, the request is answered
//! 429 with `Retry-After` and nothing is published. Replays of an
//! `Idempotency-Key` are answered before this and cost nothing.

use std::num::NonZeroU32;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};

use crate::auth::TokenDigest;
use crate::errors::ApiError;

/// Keys kept before the buckets that are full again are forgotten.
const PRUNE_PAST: usize = 10_000;

/// The per-stream and per-principal buckets of control requests.
pub struct ControlLimits {
    per_stream: DefaultKeyedRateLimiter<String>,
    per_principal: DefaultKeyedRateLimiter<TokenDigest>,
    clock: DefaultClock,
}

impl ControlLimits {
    /// `per_stream` and `per_principal` requests a minute, each also the
    /// burst allowed at once.
    pub fn new(per_stream: NonZeroU32, per_principal: NonZeroU32) -> Self {
        ControlLimits {
            per_stream: RateLimiter::keyed(Quota::per_minute(per_stream)),
            per_principal: RateLimiter::keyed(Quota::per_minute(per_principal)),
            clock: DefaultClock::default(),
        }
    }

    /// Lets one control request of `principal` on `stream` through, or says
    /// (429) how long until one would be.
    pub fn check(&self, principal: &TokenDigest, stream: &str) -> Result<(), ApiError> {
        let refused = |scope: &'static str, wait: Duration| ApiError::RateLimited {
            scope,
            retry_after_secs: wait.as_secs_f64().ceil().max(1.0) as u64,
        };
        self.per_principal
            .check_key(principal)
            .map_err(|not_until| {
                refused("principal", not_until.wait_time_from(self.clock.now()))
            })?;
        let stream = stream.to_owned();
        self.per_stream
            .check_key(&stream)
            .map_err(|not_until| refused("stream", not_until.wait_time_from(self.clock.now())))?;
        // A client naming ever new streams must not grow this without end.
        if self.per_stream.len() > PRUNE_PAST {
            self.per_stream.retain_recent();
        }
        if self.per_principal.len() > PRUNE_PAST {
            self.per_principal.retain_recent();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(per_stream: u32, per_principal: u32) -> ControlLimits {
        ControlLimits::new(
            NonZeroU32::new(per_stream).unwrap(),
            NonZeroU32::new(per_principal).unwrap(),
        )
    }

    #[test]
    fn a_stream_past_its_rate_is_refused_with_a_wait_and_others_go_on() {
        let limits = limits(2, 100);
        let someone = [1; 32];
        limits.check(&someone, "a").unwrap();
        limits.check(&someone, "a").unwrap();
        let refused = limits.check(&someone, "a").unwrap_err();
        assert!(
            matches!(refused, ApiError::RateLimited { scope: "stream", retry_after_secs } if (1..=30).contains(&retry_after_secs)),
            "{refused:?}"
        );
        limits.check(&someone, "b").unwrap();
    }

    #[test]
    fn a_principal_past_its_rate_is_refused_on_every_stream() {
        let limits = limits(100, 3);
        let greedy = [2; 32];
        for stream in ["a", "b", "c"] {
            limits.check(&greedy, stream).unwrap();
        }
        let refused = limits.check(&greedy, "d").unwrap_err();
        assert!(
            matches!(
                refused,
                ApiError::RateLimited {
                    scope: "principal",
                    ..
                }
            ),
            "{refused:?}"
        );
        limits.check(&[3; 32], "d").unwrap();
    }
}
