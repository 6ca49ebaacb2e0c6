//! The bucket's layout, in one place: every key and prefix quire writes or
//! lists, and the media type each object is stored and served with.
//!
//! - `reports/{stream}/{partition:05}-{first_offset:020}.xml` (`.xml.gz`
//!   or `.xml.zst` when the definition asks for gzip or zstd): one document, keyed by where it
//!   begins in the log, zero-padded so keys sort in log order; a
//!   definition's `key_template` places it elsewhere under `reports/`
//!   ([`document_key`]);
//! - `manifests/{report_id}.json`: what a report holds, written after its
//!   document, so a manifest always names a complete object;
//! - `definitions/{stream}.json`: the API's readable copy of a stream's
//!   definition (the log holds the authoritative one);
//! - `logs/{records topic}.json`: the first log quire ran on under that
//!   topic name (`LogRegistry`); keys and report ids of every later log
//!   carry its tag (`…-{first_offset}~{tag}.xml`).
//!
//! quire-s3 knows none of this: its callers give it keys, content types and
//! retention prefixes from here.

use crate::compression::{Compression, report_extension, strip_report_extension};
use crate::key_template::{self, KeyParts};
use crate::window::CivilHour;
use crate::{Definition, LogTag, ReportId, StreamName};

/// Where documents live.
pub const REPORTS_PREFIX: &str = "reports/";
/// Where manifests live.
pub const MANIFESTS_PREFIX: &str = "manifests/";
/// Where the API keeps definitions' readable copies.
pub const DEFINITIONS_PREFIX: &str = "definitions/";
/// Where the bucket remembers the first log of each records topic name.
pub const LOGS_PREFIX: &str = "logs/";

/// Where windowed reports are indexed by window: a copy of each manifest
/// under `windows/{stream}/{window_start_ms:020}/{report_id}.json`, so a
/// window's reports are one listing away however long the stream.
pub const WINDOWS_PREFIX: &str = "windows/";

/// What retention deletes, in the order it deletes: a report before its
/// manifest (a manifest never names a deleted report before it goes too),
/// then the window index's copies.
pub const RETENTION_PREFIXES: [&str; 3] = [REPORTS_PREFIX, MANIFESTS_PREFIX, WINDOWS_PREFIX];

pub use crate::compression::{
    GZIP_CONTENT_TYPE, XML_CONTENT_TYPE, ZSTD_CONTENT_TYPE, report_content_type,
};
/// The media type of manifests and definitions.
pub const JSON_CONTENT_TYPE: &str = "application/json";
/// The media type of a typed definition's XML Schema (`schemas/{stream}/{digest}.xsd`).
pub const XSD_CONTENT_TYPE: &str = "application/xml";

/// A document's S3 key, fixed when it opens. A log other than the first
/// (`log`: the records topic was deleted and created again) puts its tag
/// before the extension, so no key of an earlier log is written again.
pub fn report_key(
    stream: &StreamName,
    partition: i32,
    first_offset: i64,
    compression: Option<Compression>,
    log: Option<&LogTag>,
) -> String {
    format!(
        "{REPORTS_PREFIX}{stream}/{partition:05}-{first_offset:020}{}{}",
        log_suffix(log),
        report_extension(compression)
    )
}

/// `~{tag}` for a log other than the first, else nothing.
fn log_suffix(log: Option<&LogTag>) -> String {
    log.map_or_else(String::new, |tag| format!("~{tag}"))
}

/// Where the bucket remembers the first log quire ran on under the records
/// topic's name `topic` ([`crate::LogRegistry`]). Kafka topic names are
/// `[A-Za-z0-9._-]`, 1 to 249 of them; `None` for any other name.
pub fn log_registry_key(topic: &str) -> Option<String> {
    let valid = !topic.is_empty()
        && topic.len() <= 249
        && topic != "."
        && topic != ".."
        && topic
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-'));
    valid.then(|| format!("{LOGS_PREFIX}{topic}.json"))
}

/// A document's S3 key under its definition: the definition's
/// `key_template` rendered with `hour` (the window's start in its zone, or
/// the first message's log time in UTC), or [`report_key`]. A template the
/// rules of [`key_template::validate`] refuse (one an older release
/// accepted, kept in a watermark) is not rendered: its document takes the
/// default key, so it stays in its stream's space. A log other than the
/// first puts its tag before the extension.
pub fn document_key(
    stream: &StreamName,
    partition: i32,
    first_offset: i64,
    definition: &Definition,
    hour: CivilHour,
    log: Option<&LogTag>,
) -> String {
    match &definition.key_template {
        Some(template) if key_template::validate(template, definition.compression()).is_ok() => {
            tagged(
                key_template::render(
                    template,
                    &KeyParts {
                        stream: stream.as_str(),
                        year: hour.year,
                        month: hour.month,
                        day: hour.day,
                        hour: hour.hour,
                        partition,
                        first_offset,
                    },
                ),
                log,
            )
        }
        _ => report_key(
            stream,
            partition,
            first_offset,
            definition.compression(),
            log,
        ),
    }
}

/// `key` with `~{tag}` before its extension (`.xml`, `.xml.gz` or
/// `.xml.zst`, which every template ends with).
fn tagged(key: String, log: Option<&LogTag>) -> String {
    let Some(tag) = log else {
        return key;
    };
    let at = strip_report_extension(&key).map_or(key.len(), str::len);
    format!("{}~{tag}{}", &key[..at], &key[at..])
}

/// Whether `key` is a document of record partition `partition` (of any
/// stream): what a worker taking the partition sweeps. Strict, because
/// aborting an upload that is not the partition's kills a live document of
/// another owner: the key must be
/// `reports/{stream}/[{segment}/...]{partition:05}-{20 digits}.xml` (or
/// `.xml.gz`, `.xml.zst`), with a valid stream name as its first segment, no empty
/// segment, and the file name exactly that, nothing before or after but a
/// later log's `~{tag}` (12 lowercase hex digits) before the extension:
/// quire alone puts a `~` in a key (no template and no stream name holds
/// one).
///
/// Why a key of that shape proves its partition, whatever definitions the
/// streams have (the argument rests on `key_template::validate`, which both
/// the API and the worker apply to every template):
/// - every template starts with `reports/{stream}/`, and a stream name holds
///   no `/`, so a document's first segment is its own stream's name: no
///   template places a document in another stream's folder, or in a folder
///   that is no stream's;
/// - a template's file name is either exactly `{partition}-{first_offset}`
///   with the extension, which renders the document's own partition, or one
///   that no stream name and no placeholder value can render into this
///   shape (rule 8 there), so it is never taken for any partition's. Such a
///   document's leftover upload is aborted when its document opens again,
///   on its exact key (`OpenDocument::open` in the worker);
/// - a definition in the log that an older release accepted and these rules
///   refuse is a dead letter to the worker, and [`document_key`] does not
///   render such a template should one come back with a watermark.
///
/// What remains is what no key can tell: an object written under `reports/`
/// by something other than quire, in this shape, is taken as partition
/// `partition`'s; quire's bucket is quire's.
pub fn report_key_belongs_to(key: &str, partition: i32) -> bool {
    let Some(rest) = key.strip_prefix(REPORTS_PREFIX) else {
        return false;
    };
    let Some((stream, below_stream)) = rest.split_once('/') else {
        return false;
    };
    if StreamName::new(stream).is_err() || below_stream.split('/').any(str::is_empty) {
        return false;
    }
    let file_name = below_stream
        .rsplit_once('/')
        .map_or(below_stream, |(_, file_name)| file_name);
    let Some(stem) = strip_report_extension(file_name) else {
        return false;
    };
    let stem = match stem.split_once('~') {
        Some((stem, tag)) if tag.parse::<LogTag>().is_ok() => stem,
        Some(_) => return false,
        None => stem,
    };
    let Some((named_partition, offset)) = stem.split_once('-') else {
        return false;
    };
    named_partition == format!("{partition:05}")
        && offset.len() == 20
        && offset.bytes().all(|byte| byte.is_ascii_digit())
}

/// Where a report's manifest lives.
pub fn manifest_key(id: &ReportId) -> String {
    format!("{MANIFESTS_PREFIX}{id}.json")
}

/// The prefix under which a stream's manifests are listed.
pub fn manifest_prefix(stream: &StreamName) -> String {
    format!("{MANIFESTS_PREFIX}{stream}~")
}

/// The prefix under which the reports of `stream`'s window starting at
/// `window_start_ms` are indexed.
pub fn window_index_prefix(stream: &StreamName, window_start_ms: i64) -> String {
    // Log times are after 1970: a negative start is written as 0 (no
    // window of a log can start there).
    let start = window_start_ms.max(0);
    format!("{WINDOWS_PREFIX}{stream}/{start:020}/")
}

/// Where a windowed report's manifest copy is indexed.
pub fn window_index_key(stream: &StreamName, window_start_ms: i64, id: &ReportId) -> String {
    format!("{}{id}.json", window_index_prefix(stream, window_start_ms))
}

/// Where the API keeps the readable copy of a stream's definition.
pub fn definition_key(stream: &StreamName) -> String {
    format!("{DEFINITIONS_PREFIX}{stream}.json")
}

/// The media type of any object quire stores, from its key's extension
/// (a report's `.xml`, `.xml.gz` or `.xml.zst`, a manifest's or definition's `.json`);
/// `None` for keys quire does not make.
pub fn content_type_for_key(key: &str) -> Option<&'static str> {
    let (_, extension) = key.rsplit_once('.')?;
    match extension {
        "gz" => Some(GZIP_CONTENT_TYPE),
        "zst" => Some(ZSTD_CONTENT_TYPE),
        "xml" => Some(XML_CONTENT_TYPE),
        "json" => Some(JSON_CONTENT_TYPE),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn orders() -> StreamName {
        StreamName::new("orders").unwrap()
    }

    #[test]
    fn report_keys_sort_in_log_order() {
        let stream = orders();
        assert_eq!(
            report_key(&stream, 3, 42, None, None),
            "reports/orders/00003-00000000000000000042.xml"
        );
        assert!(report_key(&stream, 3, 9, None, None) < report_key(&stream, 3, 10, None, None));
        let compressed = report_key(&stream, 3, 9, Some(Compression::Gzip), None);
        assert_eq!(
            compressed,
            "reports/orders/00003-00000000000000000009.xml.gz"
        );
        assert_eq!(report_content_type(&compressed), GZIP_CONTENT_TYPE);
        assert_eq!(
            report_content_type(&report_key(&stream, 3, 9, None, None)),
            XML_CONTENT_TYPE
        );
    }

    #[test]
    fn manifests_and_definitions_have_their_keys() {
        let id = ReportId::new(orders(), 3, 1042, None);
        assert_eq!(manifest_key(&id), "manifests/orders~3-1042.json");
        assert!(manifest_key(&id).starts_with(&manifest_prefix(&orders())));
        assert_eq!(definition_key(&orders()), "definitions/orders.json");
        assert_eq!(
            window_index_key(&orders(), 1_764_720_000_000, &id),
            "windows/orders/00000001764720000000/orders~3-1042.json"
        );
        assert!(
            window_index_key(&orders(), 1_764_720_000_000, &id)
                .starts_with(&window_index_prefix(&orders(), 1_764_720_000_000))
        );
    }

    #[test]
    fn a_report_key_belongs_to_the_partition_it_names() {
        let key = report_key(
            &StreamName::new("a.b-c").unwrap(),
            7,
            12,
            Some(Compression::Gzip),
            None,
        );
        assert!(report_key_belongs_to(&key, 7));
        let zstd = report_key(
            &StreamName::new("a.b-c").unwrap(),
            7,
            12,
            Some(Compression::Zstd),
            None,
        );
        assert!(
            zstd.ends_with("00007-00000000000000000012.xml.zst"),
            "{zstd}"
        );
        assert!(report_key_belongs_to(&zstd, 7));
        assert!(!report_key_belongs_to(&zstd, 8));
        let later = report_key(
            &StreamName::new("a.b-c").unwrap(),
            7,
            12,
            Some(Compression::Gzip),
            Some(&LogTag::of("later")),
        );
        assert!(later.ends_with(&format!(
            "00007-00000000000000000012~{}.xml.gz",
            LogTag::of("later")
        )));
        assert!(report_key_belongs_to(&later, 7));
        assert!(!report_key_belongs_to(&key, 3));
        assert!(!report_key_belongs_to(&key, 70));
        assert!(!report_key_belongs_to("manifests/a~7-12.json", 7));
        assert!(!report_key_belongs_to("reports/a/00007-x.xml", 7));
    }

    #[test]
    fn a_later_log_tags_its_keys_before_their_extension_and_still_owns_them() {
        let tag = LogTag::of("later");
        assert_eq!(
            tagged("reports/o/dt=2026/00001-x.xml".into(), Some(&tag)),
            format!("reports/o/dt=2026/00001-x~{tag}.xml")
        );
        assert_eq!(
            tagged("reports/o/x.xml.gz".into(), Some(&tag)),
            format!("reports/o/x~{tag}.xml.gz")
        );
        assert_eq!(tagged("reports/o/x.xml".into(), None), "reports/o/x.xml");
        let stream = StreamName::new("a.b-c").unwrap();
        let later = report_key(&stream, 7, 12, Some(Compression::Gzip), Some(&tag));
        assert!(later.ends_with(&format!("00007-00000000000000000012~{tag}.xml.gz")));
        assert!(report_key_belongs_to(&later, 7));
        assert!(!report_key_belongs_to(&later, 8));
        let offset = "00000000000000000012";
        for bad in [
            format!("reports/a/00007-{offset}~.xml"),
            format!("reports/a/00007-{offset}~ABCDEF012345.xml"),
            format!("reports/a/00007-{offset}~{tag}~{tag}.xml"),
            format!("reports/a/00007~{tag}-{offset}.xml"),
        ] {
            assert!(!report_key_belongs_to(&bad, 7), "{bad}");
        }
        assert_eq!(
            log_registry_key("quire.records").as_deref(),
            Some("logs/quire.records.json")
        );
        for bad in ["", "..", "a/b", "a b", &"x".repeat(250)] {
            assert_eq!(log_registry_key(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn only_a_key_of_the_exact_shape_belongs_to_a_partition() {
        let offset = "00000000000000000012";
        for key in [
            format!("reports/orders/00007-{offset}.xml"),
            format!("reports/orders/00007-{offset}.xml.gz"),
            format!("reports/orders/dt=2026-03-29/hh=05/00007-{offset}.xml"),
            format!("reports/a.b-c_d/x/00007-{offset}.xml.gz"),
        ] {
            assert!(report_key_belongs_to(&key, 7), "{key}");
            assert!(!report_key_belongs_to(&key, 8), "{key}");
        }
        for key in [
            // Something before or after the file name's shape.
            format!("reports/orders/x00007-{offset}.xml"),
            format!("reports/orders/00007-{offset}0.xml"),
            format!("reports/orders/00007-{offset}.xml.bak"),
            format!("reports/orders/00007-{offset}.xml.gz.tmp"),
            format!("reports/orders/00007-{offset}-{offset}.xml"),
            format!("reports/orders/00007-{offset}.json"),
            format!("reports/orders/00007-{offset}"),
            "reports/orders/00007-0000000000000000012.xml".to_owned(),
            format!("reports/orders/0007-{offset}.xml"),
            format!("reports/orders/00007_{offset}.xml"),
            // Not in a stream's space.
            format!("reports/00007-{offset}.xml"),
            format!("reports/-bad/00007-{offset}.xml"),
            format!("reports/not~a~stream/00007-{offset}.xml"),
            format!("reports/orders//00007-{offset}.xml"),
            format!("reports//orders/00007-{offset}.xml"),
            format!("Reports/orders/00007-{offset}.xml"),
            format!("windows/orders/00007-{offset}.xml"),
            format!("reports/orders/00007-{offset}.xml/"),
        ] {
            assert!(!report_key_belongs_to(&key, 7), "{key}");
        }
    }

    #[test]
    fn a_template_the_rules_refuse_renders_the_default_key() {
        let stream = StreamName::new("evil-x").unwrap();
        let hour = CivilHour {
            year: 2026,
            month: 3,
            day: 29,
            hour: 5,
        };
        let hostile = Definition {
            key_template: Some("reports/orders/{partition}-{first_offset}.xml".to_owned()),
            ..Definition::default()
        };
        assert_eq!(
            document_key(&stream, 3, 42, &hostile, hour, None),
            report_key(&stream, 3, 42, None, None)
        );
        let hive = Definition {
            key_template: Some(
                "reports/{stream}/dt={yyyy}-{mm}-{dd}/{partition}-{first_offset}.xml".to_owned(),
            ),
            ..Definition::default()
        };
        assert_eq!(
            document_key(&stream, 3, 42, &hive, hour, None),
            "reports/evil-x/dt=2026-03-29/00003-00000000000000000042.xml"
        );
    }

    #[test]
    fn objects_are_stored_with_the_content_type_of_their_extension() {
        assert_eq!(
            content_type_for_key("reports/orders/00003-00000000000000000009.xml.gz"),
            Some(GZIP_CONTENT_TYPE)
        );
        assert_eq!(
            content_type_for_key("reports/orders/00003-00000000000000000009.xml.zst"),
            Some(ZSTD_CONTENT_TYPE)
        );
        assert_eq!(
            content_type_for_key("reports/orders.eu/00003-00000000000000000009.xml"),
            Some(XML_CONTENT_TYPE)
        );
        assert_eq!(
            content_type_for_key("manifests/orders~3-9.json"),
            Some(JSON_CONTENT_TYPE)
        );
        assert_eq!(content_type_for_key("bench/a.b/object"), None);
        assert_eq!(content_type_for_key("object"), None);
    }
}
