//! The bucket's layout, in one place: every key and prefix quire writes or
//! lists, and the media type each object is stored and served with.
//!
//! - `reports/{stream}/{partition:05}-{first_offset:020}.xml` (`.xml.gz`
//!   when the definition asks for gzip): one document, keyed by where it
//!   begins in the log, zero-padded so keys sort in log order;
//! - `manifests/{report_id}.json`: what a report holds, written after its
//!   document, so a manifest always names a complete object;
//! - `definitions/{stream}.json`: the API's readable copy of a stream's
//!   definition (the log holds the authoritative one).
//!
//! quire-s3 knows none of this: its callers give it keys, content types and
//! retention prefixes from here.

use crate::{ReportId, StreamName};

/// Where documents live.
pub const REPORTS_PREFIX: &str = "reports/";
/// Where manifests live.
pub const MANIFESTS_PREFIX: &str = "manifests/";
/// Where the API keeps definitions' readable copies.
pub const DEFINITIONS_PREFIX: &str = "definitions/";

/// What retention deletes, in the order it deletes: a report before its
/// manifest (a manifest never names a deleted report before it goes too).
pub const RETENTION_PREFIXES: [&str; 2] = [REPORTS_PREFIX, MANIFESTS_PREFIX];

/// The media type of a plain report.
pub const XML_CONTENT_TYPE: &str = "application/xml";
/// The media type of a gzip-compressed report: the object is the gzip file
/// itself (not XML with a `Content-Encoding`), so what a client downloads is
/// byte for byte what the manifest's SHA-256 covers, whatever its HTTP stack
/// decodes on its own.
pub const GZIP_CONTENT_TYPE: &str = "application/gzip";
/// The media type of manifests and definitions.
pub const JSON_CONTENT_TYPE: &str = "application/json";

/// A document's S3 key, fixed when it opens.
pub fn report_key(stream: &StreamName, partition: i32, first_offset: i64, gzip: bool) -> String {
    let extension = if gzip { "xml.gz" } else { "xml" };
    format!("{REPORTS_PREFIX}{stream}/{partition:05}-{first_offset:020}.{extension}")
}

/// Whether `key` is a document of record partition `partition` (of any
/// stream): what a worker taking the partition sweeps.
pub fn report_key_belongs_to(key: &str, partition: i32) -> bool {
    let Some(rest) = key.strip_prefix(REPORTS_PREFIX) else {
        return false;
    };
    let Some((_stream, file)) = rest.rsplit_once('/') else {
        return false;
    };
    file.strip_prefix(&format!("{partition:05}-"))
        .is_some_and(|tail| tail.len() > 20 && tail.as_bytes()[..20].iter().all(u8::is_ascii_digit))
}

/// Where a report's manifest lives.
pub fn manifest_key(id: &ReportId) -> String {
    format!("{MANIFESTS_PREFIX}{id}.json")
}

/// The prefix under which a stream's manifests are listed.
pub fn manifest_prefix(stream: &StreamName) -> String {
    format!("{MANIFESTS_PREFIX}{stream}~")
}

/// Where the API keeps the readable copy of a stream's definition.
pub fn definition_key(stream: &StreamName) -> String {
    format!("{DEFINITIONS_PREFIX}{stream}.json")
}

/// The media type a report is stored and served with, from its key.
pub fn report_content_type(key: &str) -> &'static str {
    if key.ends_with(".gz") {
        GZIP_CONTENT_TYPE
    } else {
        XML_CONTENT_TYPE
    }
}

/// The media type of any object quire stores, from its key's extension
/// (a report's `.xml` or `.xml.gz`, a manifest's or definition's `.json`);
/// `None` for keys quire does not make.
pub fn content_type_for_key(key: &str) -> Option<&'static str> {
    let (_, extension) = key.rsplit_once('.')?;
    match extension {
        "gz" => Some(GZIP_CONTENT_TYPE),
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
            report_key(&stream, 3, 42, false),
            "reports/orders/00003-00000000000000000042.xml"
        );
        assert!(report_key(&stream, 3, 9, false) < report_key(&stream, 3, 10, false));
        let compressed = report_key(&stream, 3, 9, true);
        assert_eq!(
            compressed,
            "reports/orders/00003-00000000000000000009.xml.gz"
        );
        assert_eq!(report_content_type(&compressed), GZIP_CONTENT_TYPE);
        assert_eq!(
            report_content_type(&report_key(&stream, 3, 9, false)),
            XML_CONTENT_TYPE
        );
    }

    #[test]
    fn manifests_and_definitions_have_their_keys() {
        let id = ReportId {
            stream: orders(),
            partition: 3,
            offset: 1042,
        };
        assert_eq!(manifest_key(&id), "manifests/orders~3-1042.json");
        assert!(manifest_key(&id).starts_with(&manifest_prefix(&orders())));
        assert_eq!(definition_key(&orders()), "definitions/orders.json");
    }

    #[test]
    fn a_report_key_belongs_to_the_partition_it_names() {
        let key = report_key(&StreamName::new("a.b-c").unwrap(), 7, 12, true);
        assert!(report_key_belongs_to(&key, 7));
        assert!(!report_key_belongs_to(&key, 3));
        assert!(!report_key_belongs_to(&key, 70));
        assert!(!report_key_belongs_to("manifests/a~7-12.json", 7));
        assert!(!report_key_belongs_to("reports/a/00007-x.xml", 7));
    }

    #[test]
    fn objects_are_stored_with_the_content_type_of_their_extension() {
        assert_eq!(
            content_type_for_key("reports/orders/00003-00000000000000000009.xml.gz"),
            Some(GZIP_CONTENT_TYPE)
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
