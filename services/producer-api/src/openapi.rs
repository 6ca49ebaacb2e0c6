//! The API's OpenAPI 3.1 document: `openapi.yaml`, written by hand beside
//! this crate, embedded in the binary and served at `GET /openapi.yaml` and
//! (converted once) `GET /openapi.json`. Tests check that it describes
//! exactly [`crate::routes::ROUTES`], and that it and the README's
//! status-code table name every error code the API can answer.

use std::sync::LazyLock;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// The document, as written.
pub const YAML: &str = include_str!("../openapi.yaml");

static JSON: LazyLock<Result<String, String>> = LazyLock::new(|| {
    let document: serde_json::Value =
        serde_norway::from_str(YAML).map_err(|error| error.to_string())?;
    serde_json::to_string_pretty(&document).map_err(|error| error.to_string())
});

/// The document as JSON, or why the YAML does not parse.
pub fn json_text() -> Result<&'static str, String> {
    JSON.as_deref().map_err(Clone::clone)
}

/// Start-up refuses a document that does not parse.
pub fn check() -> Result<(), String> {
    json_text().map(|_| ())
}

/// `GET /openapi.yaml`.
pub async fn yaml() -> Response {
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/yaml"),
        )],
        YAML,
    )
        .into_response()
}

/// `GET /openapi.json`.
pub async fn json() -> Response {
    match json_text() {
        Ok(text) => (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            text,
        )
            .into_response(),
        Err(error) => (StatusCode::INTERNAL_SERVER_ERROR, error).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::Value;

    use super::*;
    use crate::routes::ROUTES;

    fn document() -> Value {
        serde_json::from_str(json_text().unwrap()).unwrap()
    }

    #[test]
    fn the_document_is_openapi_3_1_and_describes_exactly_the_routes() {
        let document = document();
        assert!(document["openapi"].as_str().unwrap().starts_with("3.1"));
        let mut documented = BTreeSet::new();
        for (path, item) in document["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                if method != "parameters" {
                    documented.insert((method.to_uppercase(), path.clone()));
                }
            }
        }
        let served: BTreeSet<(String, String)> = ROUTES
            .iter()
            .map(|route| (route.method.to_owned(), route.path.to_owned()))
            .collect();
        assert_eq!(documented, served);
    }

    /// Each token route states the scope it needs, and its 401 and 403.
    #[test]
    fn every_guarded_operation_names_its_scope_and_its_refusals() {
        use crate::routes::Access;
        let document = document();
        for route in ROUTES {
            let operation = &document["paths"][route.path][route.method.to_lowercase()];
            let responses = &operation["responses"];
            match route.access {
                Access::Token(scope) => {
                    assert_eq!(
                        operation["x-quire-scope"].as_str(),
                        Some(scope.as_str()),
                        "{} {}",
                        route.method,
                        route.path
                    );
                    for status in ["401", "403"] {
                        assert!(
                            responses[status].is_object(),
                            "{} {} lists no {status}",
                            route.method,
                            route.path
                        );
                    }
                }
                Access::Open => assert_eq!(
                    operation["security"],
                    serde_json::json!([]),
                    "{} {} is open",
                    route.method,
                    route.path
                ),
            }
        }
    }

    #[test]
    fn every_operation_lists_its_answers_and_every_reference_resolves() {
        let document = document();
        let text = document.to_string();
        for (path, item) in document["paths"].as_object().unwrap() {
            for (method, operation) in item.as_object().unwrap() {
                assert!(
                    operation["responses"]
                        .as_object()
                        .is_some_and(|responses| !responses.is_empty()),
                    "{method} {path} lists no response"
                );
                assert!(operation["operationId"].is_string(), "{method} {path}");
            }
        }
        for reference in text.split("\"$ref\":\"").skip(1) {
            let target = &reference[..reference.find('"').unwrap()];
            let pointer = target.trim_start_matches('#');
            assert!(
                document.pointer(pointer).is_some(),
                "unresolved reference {target}"
            );
        }
    }

    /// Every (status, code) the one table from errors to answers
    /// (`ApiError::kind` in errors.rs) can give, read from its source: a
    /// code added there is seen here without a list to keep by hand.
    fn answerable_codes() -> BTreeSet<(u16, String)> {
        let source = include_str!("errors.rs");
        let start = source.find("fn kind(&self)").expect("ApiError::kind");
        let end = start + source[start..].find("\n    }\n").expect("the end of kind");
        let statuses = [
            ("BAD_REQUEST", 400),
            ("UNAUTHORIZED", 401),
            ("FORBIDDEN", 403),
            ("NOT_FOUND", 404),
            ("METHOD_NOT_ALLOWED", 405),
            ("REQUEST_TIMEOUT", 408),
            ("CONFLICT", 409),
            ("GONE", 410),
            ("PAYLOAD_TOO_LARGE", 413),
            ("UNSUPPORTED_MEDIA_TYPE", 415),
            ("UNPROCESSABLE_ENTITY", 422),
            ("TOO_MANY_REQUESTS", 429),
            ("INTERNAL_SERVER_ERROR", 500),
            ("SERVICE_UNAVAILABLE", 503),
        ];
        let codes: BTreeSet<(u16, String)> = source[start..end]
            .split("(S::")
            .skip(1)
            .map(|arm| {
                let (name, rest) = arm.split_once(',').expect("(S::STATUS, \"code\")");
                let status = statuses
                    .iter()
                    .find(|(known, _)| *known == name.trim())
                    .unwrap_or_else(|| panic!("a status this test does not know: {name}"))
                    .1;
                let code = rest.split('"').nth(1).expect("a quoted code");
                (status, code.to_owned())
            })
            .collect();
        assert!(codes.len() > 40, "the table was not read: {codes:?}");
        codes
    }

    #[test]
    fn every_error_code_is_in_the_readme_table_and_the_document() {
        let readme = include_str!("../README.md");
        let document = document();
        let enumerated: BTreeSet<String> = document["components"]["schemas"]["Error"]["properties"]
            ["error"]["properties"]["code"]["enum"]
            .as_array()
            .expect("the Error schema enumerates its codes")
            .iter()
            .map(|code| code.as_str().expect("a code").to_owned())
            .collect();
        let answerable = answerable_codes();
        for (status, code) in &answerable {
            let row = readme
                .lines()
                .find(|line| line.starts_with(&format!("| {status} |")))
                .unwrap_or_else(|| panic!("the README's status table has no {status} row"));
            assert!(
                row.contains(&format!("`{code}`")),
                "the README's {status} row does not name `{code}`"
            );
            assert!(
                enumerated.contains(code),
                "openapi.yaml's Error codes do not name {code}"
            );
        }
        let codes: BTreeSet<String> = answerable.into_iter().map(|(_, code)| code).collect();
        assert_eq!(
            enumerated, codes,
            "openapi.yaml names exactly the codes the API can answer"
        );
    }
}
