//! The API's OpenAPI 3.1 document: `openapi.yaml`, written by hand beside
//! this crate, embedded in the binary and served at `GET /openapi.yaml` and
//! (converted once) `GET /openapi.json`. A test checks that it describes
//! exactly [`crate::routes::ROUTES`].

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
}
