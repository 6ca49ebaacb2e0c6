//! How settings that are not plain numbers are written in the file: the
//! [`serde_with`] adapters quire adds to the library's own.
//!
//! One policy for zero: a count or duration that must be positive is
//! refused at 0 (a `NonZero*` type, or a start-up check naming the key);
//! where 0 has a meaning it is "off" or "forever", and the setting is an
//! `Option` ([`OffWhenZero`]), never a zero length.

use std::marker::PhantomData;
use std::time::Duration;

use serde::de::value::U64Deserializer;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_with::{DeserializeAs, SerializeAs};

/// `0` in the file is `None` (off, or forever); any other number is read
/// as `U` reads it.
pub struct OffWhenZero<U>(PhantomData<U>);

impl<'de, T, U> DeserializeAs<'de, Option<T>> for OffWhenZero<U>
where
    U: DeserializeAs<'de, T>,
{
    fn deserialize_as<D: Deserializer<'de>>(deserializer: D) -> Result<Option<T>, D::Error> {
        match u64::deserialize(deserializer)? {
            0 => Ok(None),
            value => U::deserialize_as(U64Deserializer::<D::Error>::new(value)).map(Some),
        }
    }
}

impl<T, U> SerializeAs<Option<T>> for OffWhenZero<U>
where
    U: SerializeAs<T>,
{
    fn serialize_as<S: Serializer>(value: &Option<T>, serializer: S) -> Result<S::Ok, S::Error> {
        match value {
            None => 0u64.serialize(serializer),
            Some(value) => U::serialize_as(value, serializer),
        }
    }
}

/// A duration written as whole minutes.
pub struct DurationMinutes;

impl<'de> DeserializeAs<'de, Duration> for DurationMinutes {
    fn deserialize_as<D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let minutes = u64::deserialize(deserializer)?;
        minutes
            .checked_mul(60)
            .map(Duration::from_secs)
            .ok_or_else(|| serde::de::Error::custom(format!("{minutes} minutes is too long")))
    }
}

impl SerializeAs<Duration> for DurationMinutes {
    fn serialize_as<S: Serializer>(value: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        (value.as_secs() / 60).serialize(serializer)
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use serde::{Deserialize, Serialize};
    use serde_with::{DurationMilliSeconds, Same, serde_as};

    use super::*;

    #[serde_as]
    #[derive(Debug, PartialEq, Deserialize, Serialize)]
    struct Example {
        #[serde_as(as = "OffWhenZero<DurationMilliSeconds<u64>>")]
        expiry: Option<Duration>,
        #[serde_as(as = "OffWhenZero<Same>")]
        days: Option<NonZeroU32>,
        #[serde_as(as = "DurationMinutes")]
        every: Duration,
    }

    #[test]
    fn zero_is_off_and_other_values_read_and_write_back_as_given() {
        let off: Example = toml::from_str("expiry = 0\ndays = 0\nevery = 0").unwrap();
        assert_eq!(
            off,
            Example {
                expiry: None,
                days: None,
                every: Duration::ZERO
            }
        );
        let on: Example = toml::from_str("expiry = 1500\ndays = 30\nevery = 60").unwrap();
        assert_eq!(
            on,
            Example {
                expiry: Some(Duration::from_millis(1500)),
                days: NonZeroU32::new(30),
                every: Duration::from_secs(3600)
            }
        );
        let written = toml::to_string(&on).unwrap();
        assert_eq!(toml::from_str::<Example>(&written).unwrap(), on);
        assert_eq!(
            toml::from_str::<Example>(&toml::to_string(&off).unwrap()).unwrap(),
            off
        );
        let error = toml::from_str::<Example>("expiry = 1\ndays = 5000000000\nevery = 1")
            .unwrap_err()
            .to_string();
        assert!(error.contains("days"), "{error}");
    }
}
