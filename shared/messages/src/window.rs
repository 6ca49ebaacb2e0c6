//! Time windows of a stream's reports: `"window": {"every": "1d",
//! "time_zone": "Europe/Paris", "grace": "30s"}` in its definition.
//!
//! Windows are aligned to the zone's calendar. A day runs from one local
//! midnight to the next (23 or 25 hours on the days clocks change, and from
//! the first instant of the day where midnight itself does not exist).
//! Shorter windows (`every` must divide a day: `1h`, `15m`, `5s`) are cut
//! from the local day's start in elapsed time, and the day's last window
//! ends with the day: a DST day has 23 or 25 hourly windows, each an hour
//! of real time, and no window spans two local days.
//!
//! Times are log times (the records topic's `LogAppendTime`, ms since the
//! epoch), so the window of a message is decided by the log alone and every
//! replay cuts at the same message. The zone database is jiff's bundled
//! copy, so the arithmetic does not depend on the host.

use jiff::tz::TimeZone;
use jiff::{Timestamp, Zoned};
use serde::{Deserialize, Serialize};

/// A day, in milliseconds: the longest `every`, and what it must divide.
const DAY_MS: i64 = 86_400_000;
/// The longest `grace`.
const MAX_GRACE_MS: i64 = DAY_MS;

/// A definition's `window`, as the client wrote it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowSpec {
    /// The window's length: `<n>s`, `<n>m`, `<n>h` or `1d`, dividing a day.
    pub every: String,
    /// An IANA time zone (`Europe/Paris`); `UTC` when absent.
    #[serde(default = "utc")]
    pub time_zone: String,
    /// How long after a window's end a worker waits before it closes a
    /// window no later message has closed (a marker in the log).
    #[serde(default = "default_grace")]
    pub grace: String,
    /// A window without a record yields no report (instead of an empty one).
    #[serde(default, skip_serializing_if = "is_false")]
    pub skip_empty: bool,
}

fn utc() -> String {
    "UTC".to_owned()
}

fn default_grace() -> String {
    "30s".to_owned()
}

fn is_false(flag: &bool) -> bool {
    !*flag
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    #[error(
        "window {field} {value:?} is not a duration: write a whole number and a unit, s, m, h or d (\"15m\", \"1d\")"
    )]
    NotADuration { field: &'static str, value: String },
    #[error(
        "window every {0:?} does not divide a day: windows are cut from each local day's start, so use a length such as 5s, 15m, 1h, 6h or 1d"
    )]
    DoesNotDivideADay(String),
    #[error("window grace {0:?} is longer than a day")]
    GraceTooLong(String),
    #[error(
        "window time_zone {0:?} is not an IANA time zone (such as \"Europe/Paris\" or \"UTC\")"
    )]
    UnknownTimeZone(String),
}

impl WindowSpec {
    /// Checks the spec and compiles it into the arithmetic.
    pub fn schedule(&self) -> Result<Schedule, WindowError> {
        let every_ms = parse_duration("every", &self.every)?;
        if every_ms == 0 || every_ms > DAY_MS || DAY_MS % every_ms != 0 {
            return Err(WindowError::DoesNotDivideADay(self.every.clone()));
        }
        let grace_ms = parse_duration("grace", &self.grace)?;
        if grace_ms > MAX_GRACE_MS {
            return Err(WindowError::GraceTooLong(self.grace.clone()));
        }
        let zone = TimeZone::get(&self.time_zone)
            .map_err(|_| WindowError::UnknownTimeZone(self.time_zone.clone()))?;
        Ok(Schedule {
            every_ms,
            grace_ms,
            zone,
            skip_empty: self.skip_empty,
        })
    }
}

/// `<n><unit>` in milliseconds.
fn parse_duration(field: &'static str, value: &str) -> Result<i64, WindowError> {
    let not_a_duration = || WindowError::NotADuration {
        field,
        value: value.to_owned(),
    };
    let unit_at = value
        .find(|character: char| !character.is_ascii_digit())
        .ok_or_else(not_a_duration)?;
    let (number, unit) = value.split_at(unit_at);
    if number.is_empty() || number.len() > 9 {
        return Err(not_a_duration());
    }
    let number: i64 = number.parse().map_err(|_| not_a_duration())?;
    let unit_ms = match unit {
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => DAY_MS,
        _ => return Err(not_a_duration()),
    };
    Ok(number * unit_ms)
}

/// A compiled [`WindowSpec`].
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    every_ms: i64,
    grace_ms: i64,
    zone: TimeZone,
    skip_empty: bool,
}

/// One window: `[start_ms, end_ms)` in ms since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Window {
    pub start_ms: i64,
    pub end_ms: i64,
}

/// A local date and hour, for key templates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CivilHour {
    pub year: i16,
    pub month: i8,
    pub day: i8,
    pub hour: i8,
}

impl Schedule {
    /// How long after a window's end its closing marker is published.
    pub fn grace_ms(&self) -> i64 {
        self.grace_ms
    }

    /// Whether a window without a record yields no report.
    pub fn skip_empty(&self) -> bool {
        self.skip_empty
    }

    /// The window holding the instant `time_ms`.
    pub fn window_of(&self, time_ms: i64) -> Window {
        let (day_start, next_day_start) = self.day_around(time_ms);
        if self.every_ms == DAY_MS {
            // The local day, whatever its length.
            return Window {
                start_ms: day_start,
                end_ms: next_day_start,
            };
        }
        let start = day_start + (time_ms - day_start).div_euclid(self.every_ms) * self.every_ms;
        Window {
            start_ms: start,
            end_ms: (start + self.every_ms).min(next_day_start),
        }
    }

    /// The window after `window`.
    pub fn next(&self, window: Window) -> Window {
        self.window_of(window.end_ms)
    }

    /// The local day holding `time_ms`: its first instant and the next
    /// day's, in ms.
    fn day_around(&self, time_ms: i64) -> (i64, i64) {
        let zoned = self.zoned(time_ms);
        let day = zoned
            .start_of_day()
            .expect("a day within jiff's range has a start");
        let next = day
            .tomorrow()
            .and_then(|tomorrow| tomorrow.start_of_day())
            .expect("a day within jiff's range has a next one");
        (
            day.timestamp().as_millisecond(),
            next.timestamp().as_millisecond(),
        )
    }

    fn zoned(&self, time_ms: i64) -> Zoned {
        // Log times are well inside jiff's range (years -9999 to 9999);
        // anything else is clamped rather than a panic in the worker.
        let timestamp = Timestamp::from_millisecond(time_ms).unwrap_or(if time_ms < 0 {
            Timestamp::MIN
        } else {
            Timestamp::MAX
        });
        timestamp.to_zoned(self.zone.clone())
    }

    /// `time_ms` in RFC 3339 with the zone's offset at that instant
    /// (`2026-03-29T03:00:00+02:00`).
    pub fn format(&self, time_ms: i64) -> String {
        let zoned = self.zoned(time_ms);
        zoned
            .timestamp()
            .display_with_offset(zoned.offset())
            .to_string()
    }

    /// The local date and hour at `time_ms`.
    pub fn civil_hour(&self, time_ms: i64) -> CivilHour {
        civil_hour(&self.zoned(time_ms))
    }
}

fn civil_hour(zoned: &Zoned) -> CivilHour {
    CivilHour {
        year: zoned.year(),
        month: zoned.month(),
        day: zoned.day(),
        hour: zoned.hour(),
    }
}

/// The UTC date and hour at `time_ms` (key templates of unwindowed streams).
pub fn utc_civil_hour(time_ms: i64) -> CivilHour {
    let timestamp = Timestamp::from_millisecond(time_ms).unwrap_or(Timestamp::UNIX_EPOCH);
    civil_hour(&timestamp.to_zoned(TimeZone::UTC))
}

/// Parses an RFC 3339 time with an offset (`2026-12-03T00:00:00+01:00`, or
/// `Z`) into ms since the epoch.
pub fn parse_time(text: &str) -> Result<i64, String> {
    text.parse::<Timestamp>()
        .map(|timestamp| timestamp.as_millisecond())
        .map_err(|error| format!("{text:?} is not an RFC 3339 time with an offset: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(every: &str, zone: &str) -> Schedule {
        WindowSpec {
            every: every.into(),
            time_zone: zone.into(),
            grace: "30s".into(),
            skip_empty: false,
        }
        .schedule()
        .unwrap()
    }

    fn at(text: &str) -> i64 {
        parse_time(text).unwrap()
    }

    const HOUR: i64 = 3_600_000;

    #[test]
    fn a_day_in_paris_is_23_hours_in_march_and_25_in_october() {
        let paris = schedule("1d", "Europe/Paris");
        // Clocks go forward at 02:00 on 2026-03-29, back at 03:00 on 2026-10-25.
        let spring = paris.window_of(at("2026-03-29T12:00:00+02:00"));
        assert_eq!(spring.start_ms, at("2026-03-29T00:00:00+01:00"));
        assert_eq!(spring.end_ms, at("2026-03-30T00:00:00+02:00"));
        assert_eq!(spring.end_ms - spring.start_ms, 23 * HOUR);
        let autumn = paris.window_of(at("2026-10-25T23:59:59.999+01:00"));
        assert_eq!(autumn.start_ms, at("2026-10-25T00:00:00+02:00"));
        assert_eq!(autumn.end_ms - autumn.start_ms, 25 * HOUR);
        assert_eq!(paris.format(spring.start_ms), "2026-03-29T00:00:00+01:00");
        assert_eq!(paris.format(spring.end_ms), "2026-03-30T00:00:00+02:00");
        // An ordinary day, and the windows follow one another.
        let ordinary = paris.next(spring);
        assert_eq!(ordinary.start_ms, spring.end_ms);
        assert_eq!(ordinary.end_ms - ordinary.start_ms, 24 * HOUR);
    }

    #[test]
    fn hourly_windows_on_dst_days_are_hours_of_real_time() {
        let paris = schedule("1h", "Europe/Paris");
        let mut window = paris.window_of(at("2026-03-29T00:00:00+01:00"));
        let mut starts = Vec::new();
        while window.start_ms < at("2026-03-30T00:00:00+02:00") {
            assert_eq!(window.end_ms - window.start_ms, HOUR);
            starts.push(paris.format(window.start_ms));
            window = paris.next(window);
        }
        assert_eq!(starts.len(), 23, "{starts:?}");
        assert_eq!(starts[1], "2026-03-29T01:00:00+01:00");
        assert_eq!(
            starts[2], "2026-03-29T03:00:00+02:00",
            "02:00 does not exist"
        );

        let mut window = paris.window_of(at("2026-10-25T00:00:00+02:00"));
        let mut starts = Vec::new();
        while window.start_ms < at("2026-10-26T00:00:00+01:00") {
            starts.push(paris.format(window.start_ms));
            window = paris.next(window);
        }
        assert_eq!(starts.len(), 25);
        assert_eq!(starts[2], "2026-10-25T02:00:00+02:00");
        assert_eq!(
            starts[3], "2026-10-25T02:00:00+01:00",
            "02:00 happens twice"
        );
    }

    #[test]
    fn a_window_that_does_not_divide_the_day_ends_with_it() {
        // 6-hour windows on a 25-hour day: the last is 1 hour long.
        let paris = schedule("6h", "Europe/Paris");
        let last = paris.window_of(at("2026-10-25T23:30:00+01:00"));
        assert_eq!(last.start_ms, at("2026-10-25T23:00:00+01:00"));
        assert_eq!(last.end_ms, at("2026-10-26T00:00:00+01:00"));
    }

    #[test]
    fn short_windows_in_utc_and_their_boundaries() {
        let utc = schedule("5s", "UTC");
        let window = utc.window_of(at("2026-12-03T10:00:07.250Z"));
        assert_eq!(window.start_ms, at("2026-12-03T10:00:05Z"));
        assert_eq!(window.end_ms, at("2026-12-03T10:00:10Z"));
        assert_eq!(
            utc.window_of(window.end_ms).start_ms,
            window.end_ms,
            "end is exclusive"
        );
        assert_eq!(utc.window_of(window.end_ms - 1), window);
        assert_eq!(utc.format(window.start_ms), "2026-12-03T10:00:05+00:00");
        let hour = utc.civil_hour(window.start_ms);
        assert_eq!(
            (hour.year, hour.month, hour.day, hour.hour),
            (2026, 12, 3, 10)
        );
    }

    #[test]
    fn a_zone_whose_midnight_does_not_exist_starts_its_day_at_one() {
        // Santiago moved its clocks from 00:00 to 01:00 on 2026-09-06.
        let santiago = schedule("1d", "America/Santiago");
        let day = santiago.window_of(at("2026-09-06T12:00:00-03:00"));
        assert_eq!(santiago.format(day.start_ms), "2026-09-06T01:00:00-03:00");
        assert_eq!(day.end_ms - day.start_ms, 23 * HOUR);
    }

    #[test]
    fn bad_specs_are_refused_by_name() {
        let spec = |every: &str, zone: &str, grace: &str| WindowSpec {
            every: every.into(),
            time_zone: zone.into(),
            grace: grace.into(),
            skip_empty: false,
        };
        assert!(matches!(
            spec("7m", "UTC", "1s").schedule(),
            Err(WindowError::DoesNotDivideADay(_))
        ));
        assert!(matches!(
            spec("2d", "UTC", "1s").schedule(),
            Err(WindowError::DoesNotDivideADay(_))
        ));
        assert!(matches!(
            spec("0s", "UTC", "1s").schedule(),
            Err(WindowError::DoesNotDivideADay(_))
        ));
        for bad in ["", "h", "1", "1w", "1.5h", "-1h", " 1h", "99999999999s"] {
            assert!(
                matches!(
                    spec(bad, "UTC", "1s").schedule(),
                    Err(WindowError::NotADuration { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            spec("1h", "Europe/Pariss", "1s").schedule(),
            Err(WindowError::UnknownTimeZone(_))
        ));
        assert!(matches!(
            spec("1h", "UTC", "2d").schedule(),
            Err(WindowError::GraceTooLong(_))
        ));
        spec("1h", "UTC", "0s").schedule().unwrap();
        let parsed: WindowSpec = serde_json::from_str(r#"{"every":"1d"}"#).unwrap();
        assert_eq!(parsed.time_zone, "UTC");
        assert_eq!(parsed.grace, "30s");
        assert!(serde_json::from_str::<WindowSpec>(r#"{"every":"1d","zone":"UTC"}"#).is_err());
    }

    #[test]
    fn times_parse_with_their_offset() {
        assert_eq!(
            parse_time("2026-12-03T01:00:00+01:00"),
            parse_time("2026-12-03T00:00:00Z")
        );
        assert!(parse_time("2026-12-03 00:00").is_err());
        assert!(parse_time("2026-12-03T00:00:00").is_err(), "no offset");
    }
}
