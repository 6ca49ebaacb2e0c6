//! The API's bearer tokens as configuration: who may do what, and never the
//! token itself. A token is written as one line,
//!
//! ```text
//! <name>:<sha256 of the token, hex>:<scopes>:<stream prefixes>
//! ci-loader:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08:write:orders-+billing-
//! ```
//!
//! with scopes `read`, `write` or `read+write`, and stream-name prefixes
//! joined by `+` (`*` for every stream). `:` and `+` never occur in a
//! stream name, so the line splits without quoting, and it fits in an
//! environment variable (`QUIRE_API__TOKENS`, comma-separated). `quire
//! token new` makes a token and prints its line.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// What a token may do: read (status, content, listings, definitions) and
/// write (records, cuts, definitions).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    Read,
    Write,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Write => "write",
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(self.as_str())
    }
}

/// One accepted token: its name (for logs and errors), the SHA-256 of its
/// text, its scopes and the stream-name prefixes it reaches.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ApiToken {
    pub name: String,
    pub sha256: [u8; 32],
    pub read: bool,
    pub write: bool,
    /// Stream-name prefixes; an empty prefix (written `*`) is every stream.
    pub streams: Vec<String>,
}

impl ApiToken {
    /// The SHA-256 of a token's text, as the table holds it.
    pub fn digest_of(token: &str) -> [u8; 32] {
        use sha2::Digest;
        sha2::Sha256::digest(token.as_bytes()).into()
    }

    pub fn allows(&self, scope: Scope) -> bool {
        match scope {
            Scope::Read => self.read,
            Scope::Write => self.write,
        }
    }

    /// Whether the token reaches the stream `stream`.
    pub fn reaches(&self, stream: &str) -> bool {
        self.streams.iter().any(|prefix| stream.starts_with(prefix))
    }

    fn scopes_text(&self) -> &'static str {
        match (self.read, self.write) {
            (true, true) => "read+write",
            (true, false) => "read",
            (false, true) => "write",
            (false, false) => "",
        }
    }

    /// The prefixes as written in the table (`*` for every stream).
    pub fn streams_text(&self) -> String {
        self.streams
            .iter()
            .map(|prefix| if prefix.is_empty() { "*" } else { prefix })
            .collect::<Vec<_>>()
            .join("+")
    }
}

/// The line form; the digest is not a secret, but it is all that is kept.
impl fmt::Display for ApiToken {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "{}:{}:{}:{}",
            self.name,
            hex::encode(self.sha256),
            self.scopes_text(),
            self.streams_text()
        )
    }
}

impl fmt::Debug for ApiToken {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "ApiToken({self})")
    }
}

/// Why a token line is refused. No variant quotes the line: if someone
/// pastes a token where its digest belongs, the error must not echo it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenLineError {
    #[error(
        "an api.tokens entry is not of the form <name>:<sha256 hex>:<read|write|read+write>:<stream prefixes joined by + or *> (it has {0} `:`-separated parts; `quire token new` prints one)"
    )]
    Parts(usize),
    #[error("api.tokens entry {0:?}: the name must be 1-64 letters, digits, '.', '_' or '-'")]
    Name(String),
    #[error(
        "api.tokens entry {0:?}: the digest must be the 64 hex digits of the token's SHA-256 (the token itself never goes in the configuration)"
    )]
    Digest(String),
    #[error("api.tokens entry {name:?}: unknown scopes {scopes:?}; use read, write or read+write")]
    Scopes { name: String, scopes: String },
    #[error(
        "api.tokens entry {name:?}: stream prefix {prefix:?} is not part of a stream name (letters, digits, '.', '_', '-'; `*` for every stream)"
    )]
    Prefix { name: String, prefix: String },
}

impl FromStr for ApiToken {
    type Err = TokenLineError;

    fn from_str(line: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = line.trim().split(':').collect();
        let [name, digest, scopes, streams] = parts[..] else {
            return Err(TokenLineError::Parts(parts.len()));
        };
        let name_ok = (1..=64).contains(&name.len())
            && name
                .bytes()
                .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-'));
        if !name_ok {
            return Err(TokenLineError::Name(
                name.chars().take(64).collect::<String>(),
            ));
        }
        let mut sha256 = [0u8; 32];
        if digest.len() != 64 || hex::decode_to_slice(digest, &mut sha256).is_err() {
            return Err(TokenLineError::Digest(name.to_owned()));
        }
        let (read, write) = match scopes {
            "read" => (true, false),
            "write" => (false, true),
            "read+write" | "write+read" => (true, true),
            other => {
                return Err(TokenLineError::Scopes {
                    name: name.to_owned(),
                    scopes: other.to_owned(),
                });
            }
        };
        let mut prefixes = Vec::new();
        for prefix in streams.split('+') {
            if prefix == "*" {
                prefixes.push(String::new());
                continue;
            }
            let prefix_ok = !prefix.is_empty()
                && prefix.len() <= 128
                && prefix
                    .bytes()
                    .all(|byte| byte.is_ascii_alphanumeric() || matches!(byte, b'.' | b'_' | b'-'));
            if !prefix_ok {
                return Err(TokenLineError::Prefix {
                    name: name.to_owned(),
                    prefix: prefix.to_owned(),
                });
            }
            prefixes.push(prefix.to_owned());
        }
        Ok(ApiToken {
            name: name.to_owned(),
            sha256,
            read,
            write,
            streams: prefixes,
        })
    }
}

impl TryFrom<String> for ApiToken {
    type Error = TokenLineError;
    fn try_from(line: String) -> Result<Self, Self::Error> {
        line.parse()
    }
}

impl From<ApiToken> for String {
    fn from(token: ApiToken) -> String {
        token.to_string()
    }
}

/// A secret as it travels through configuration and arguments: its Debug
/// and Display print `[redacted]`; only [`Secret::expose`] gives the text.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(text: impl Into<String>) -> Self {
        Secret(text.into())
    }

    /// An empty secret, for showing where one was.
    pub const fn redacted() -> Self {
        Secret(String::new())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("[redacted]")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("[redacted]")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Ok(Secret(text.to_owned()))
    }
}

/// Whether a librdkafka property holds a secret (SASL and SSL passwords,
/// private keys, OAuth client secrets and configs): its value is shown as
/// `[redacted]` in Debug output and in errors.
pub fn is_secret_property(key: &str) -> bool {
    let key = key.replace('_', ".").to_ascii_lowercase();
    [
        "password",
        "secret",
        "ssl.key.pem",
        "oauthbearer.config",
        "sasl.jaas",
        "token",
    ]
    .iter()
    .any(|word| key.contains(word))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    #[test]
    fn a_line_reads_back_as_written() {
        let line = format!("ci-loader:{DIGEST}:write:orders-+billing-");
        let token: ApiToken = line.parse().unwrap();
        assert_eq!(token.name, "ci-loader");
        assert_eq!(token.sha256, ApiToken::digest_of("test"));
        assert!(token.write && !token.read);
        assert!(token.reaches("orders-eu") && token.reaches("billing-1"));
        assert!(!token.reaches("order") && !token.reaches("hr"));
        assert_eq!(token.to_string(), line);
        let everything: ApiToken = format!("ops:{DIGEST}:read+write:*").parse().unwrap();
        assert!(everything.allows(Scope::Read) && everything.allows(Scope::Write));
        assert!(everything.reaches("anything"));
        assert_eq!(everything.to_string(), format!("ops:{DIGEST}:read+write:*"));
    }

    #[test]
    fn malformed_lines_are_refused_without_echoing_them() {
        let pasted_token = "ops:hunter2-the-actual-token:read:*";
        let error = pasted_token.parse::<ApiToken>().unwrap_err();
        assert!(matches!(error, TokenLineError::Digest(_)), "{error}");
        assert!(!error.to_string().contains("hunter2"), "{error}");
        let just_a_token = "hunter2-the-actual-token";
        let error = just_a_token.parse::<ApiToken>().unwrap_err();
        assert_eq!(error, TokenLineError::Parts(1));
        assert!(!error.to_string().contains("hunter2"), "{error}");
        for (line, wanted) in [
            (format!(":{DIGEST}:read:*"), "name"),
            (format!("a b:{DIGEST}:read:*"), "name"),
            (format!("ops:{DIGEST}:admin:*"), "scopes"),
            (format!("ops:{DIGEST}:read:"), "prefix"),
            (format!("ops:{DIGEST}:read:a/b"), "prefix"),
            (format!("ops:{DIGEST}:read:a++b"), "prefix"),
            (format!("ops:{}:read:*", &DIGEST[..63]), "digest"),
        ] {
            let error = line.parse::<ApiToken>().unwrap_err().to_string();
            assert!(error.contains(wanted), "{line}: {error}");
        }
    }

    #[test]
    fn secrets_print_redacted() {
        let secret = Secret::new("hunter2");
        assert_eq!(format!("{secret:?} {secret}"), "[redacted] [redacted]");
        assert_eq!(secret.expose(), "hunter2");
        for key in [
            "sasl.password",
            "sasl_password",
            "ssl.key.password",
            "ssl_keystore_password",
            "ssl.key.pem",
            "sasl.oauthbearer.client.secret",
            "sasl.oauthbearer.config",
        ] {
            assert!(is_secret_property(key), "{key}");
        }
        for key in [
            "linger.ms",
            "security.protocol",
            "ssl.ca.location",
            "sasl.username",
        ] {
            assert!(!is_secret_property(key), "{key}");
        }
    }
}
