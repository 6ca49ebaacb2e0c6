//! How a report's bytes are stored: plain XML, or compressed while it
//! streams (gzip or Zstandard). The object is the compressed file itself,
//! with the media type of that file and no `Content-Encoding`, so what a
//! client downloads is byte for byte what the manifest's digests cover,
//! whatever its HTTP stack decodes on its own.

use std::fmt;

/// A report's compression, from its definition (`gzip` or `zstd`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    /// `.xml.gz`, `application/gzip` (RFC 1952).
    Gzip,
    /// `.xml.zst`, `application/zstd` (RFC 8878).
    Zstd,
}

/// The media type of a plain report.
pub const XML_CONTENT_TYPE: &str = "application/xml";
/// The media type of a gzip-compressed report.
pub const GZIP_CONTENT_TYPE: &str = "application/gzip";
/// The media type of a Zstandard-compressed report.
pub const ZSTD_CONTENT_TYPE: &str = "application/zstd";

/// Every extension a report key ends with, the compressed ones first (a
/// key is matched against them in this order).
pub const REPORT_EXTENSIONS: [&str; 3] = [".xml.gz", ".xml.zst", ".xml"];

impl Compression {
    /// Every compression, for tests and listings.
    pub const ALL: [Compression; 2] = [Compression::Gzip, Compression::Zstd];

    /// The definition's field that asks for it.
    pub fn field(self) -> &'static str {
        match self {
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }

    /// The media type of a report stored with it.
    pub fn content_type(self) -> &'static str {
        match self {
            Compression::Gzip => GZIP_CONTENT_TYPE,
            Compression::Zstd => ZSTD_CONTENT_TYPE,
        }
    }

    /// The compression a report key's extension says, if any.
    pub fn of_key(key: &str) -> Option<Compression> {
        if key.ends_with(".xml.gz") {
            Some(Compression::Gzip)
        } else if key.ends_with(".xml.zst") {
            Some(Compression::Zstd)
        } else {
            None
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.field())
    }
}

/// The extension of a report stored with `compression` (or none).
pub fn report_extension(compression: Option<Compression>) -> &'static str {
    match compression {
        None => ".xml",
        Some(Compression::Gzip) => ".xml.gz",
        Some(Compression::Zstd) => ".xml.zst",
    }
}

/// `key` without its report extension, if it has one.
pub fn strip_report_extension(key: &str) -> Option<&str> {
    REPORT_EXTENSIONS
        .iter()
        .find_map(|extension| key.strip_suffix(extension))
}

/// The media type a report is stored and served with, from its key.
pub fn report_content_type(key: &str) -> &'static str {
    Compression::of_key(key).map_or(XML_CONTENT_TYPE, Compression::content_type)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_compression_has_its_own_extension_and_media_type() {
        for compression in [None, Some(Compression::Gzip), Some(Compression::Zstd)] {
            let key = format!(
                "reports/orders/00001-{:020}{}",
                7,
                report_extension(compression)
            );
            assert_eq!(Compression::of_key(&key), compression, "{key}");
            assert_eq!(
                strip_report_extension(&key),
                Some("reports/orders/00001-00000000000000000007"),
                "{key}"
            );
            let expected = compression.map_or(XML_CONTENT_TYPE, Compression::content_type);
            assert_eq!(report_content_type(&key), expected, "{key}");
        }
        assert_eq!(report_content_type("x.xml.zst"), "application/zstd");
        assert_eq!(strip_report_extension("manifests/a.json"), None);
        assert_eq!(
            Compression::of_key("a.zst"),
            None,
            "only report extensions count"
        );
    }
}
