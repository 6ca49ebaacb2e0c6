//! A writer that gets killed: starts a multipart upload of `KEY` in `BUCKET`,
//! waits until its first part is stored, prints `part uploaded`, then waits
//! to be killed (the take-over sweep test sends SIGKILL, so no abort runs).
//!
//! Usage: `abandoned-upload BUCKET KEY`, with the stack's environment
//! (`eval "$(deploy/local/stack env)"`).

use std::time::{Duration, Instant};

use quire_s3::{S3Bucket, UploadPolicy};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut arguments = std::env::args().skip(1);
    let (Some(bucket), Some(key)) = (arguments.next(), arguments.next()) else {
        anyhow::bail!("usage: abandoned-upload BUCKET KEY");
    };
    let settings = quire_tests::s3::s3_settings();
    let bucket = S3Bucket::new(quire_s3::build_client(&settings).await, bucket);
    let policy = UploadPolicy::for_max_object_size(64 * 1024 * 1024);
    let mut writer = bucket.writer(key, &policy)?;
    // One full part and one byte more: the full part goes up.
    writer.append(&vec![b'x'; writer.part_size() + 1]).await?;

    let deadline = Instant::now() + Duration::from_secs(60);
    while bucket.counters().snapshot().parts_uploaded < 1 {
        anyhow::ensure!(Instant::now() < deadline, "the first part did not upload");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("part uploaded");
    // Keep the writer alive (a drop would abort the upload) until killed.
    tokio::time::sleep(Duration::from_secs(600)).await;
    drop(writer);
    Ok(())
}
