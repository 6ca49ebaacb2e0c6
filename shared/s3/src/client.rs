//! The one place the S3 client is configured for S3-compatible servers.

use aws_config::BehaviorVersion;
use aws_sdk_s3::Client;
use aws_sdk_s3::config::{Region, RequestChecksumCalculation, ResponseChecksumValidation};
use quire_config::S3Settings;

/// Builds the S3 client for the server in `settings`.
///
/// - endpoint and region from the settings, path-style addressing
///   (`http://host/bucket/key`), which every S3-compatible server accepts and
///   which needs no wildcard DNS;
/// - credentials from the standard AWS chain (`AWS_ACCESS_KEY_ID` /
///   `AWS_SECRET_ACCESS_KEY`, profiles, instance roles...);
/// - checksums only when an operation requires them: since early 2025 the
///   SDK sends CRC checksums by default, which servers that do not know them
///   reject (aws-sdk-rust issue 1240).
///
/// The SDK's standard retries stay on for other callers of this client (a
/// download, say); the writer and the sweep turn them off per call and retry
/// themselves, so each attempt is traced and counted.
pub async fn build_client(settings: &S3Settings) -> Client {
    let shared_config = aws_config::defaults(BehaviorVersion::latest())
        .region(Region::new(settings.region.clone()))
        .endpoint_url(&settings.endpoint)
        .load()
        .await;
    let s3_config = aws_sdk_s3::config::Builder::from(&shared_config)
        .force_path_style(true)
        .request_checksum_calculation(RequestChecksumCalculation::WhenRequired)
        .response_checksum_validation(ResponseChecksumValidation::WhenRequired)
        .build();
    Client::from_conf(s3_config)
}
