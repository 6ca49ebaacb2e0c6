//! Take-over time against watermark history: 100,000 watermark writes on
//! one partition, read to the end the way a new owner reads them
//! (read_committed, from the beginning, until the partition's end), on a
//! topic that is only compacted (the settings before issue 9: the active
//! segment rolls after 7 days, so nothing is ever cleaned in between) and on
//! a topic with the design's compaction settings once the cleaner has run.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use quire_messages::{CURRENT_VERSION, Watermark};
use quire_queue::{OutMessage, TopicSpec, TransactionalProducer};
use quire_tests::{TestTopic, kafka_settings, unique};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

#[derive(clap::Args, Clone)]
pub struct TakeoverArgs {
    /// Watermark writes on partition 0.
    #[arg(long, default_value_t = 100_000)]
    writes: usize,
    /// Streams they are spread over (the keys compaction keeps one of each).
    #[arg(long, default_value_t = 100)]
    streams: usize,
    /// How long to wait for the cleaner, in seconds.
    #[arg(long, default_value_t = 300)]
    compaction_wait_secs: u64,
}

pub async fn run(args: TakeoverArgs) -> anyhow::Result<()> {
    let settings = kafka_settings();
    let names = quire_config::TopicNames {
        records: unique("bench.takeover.records"),
        report_events: unique("bench.takeover.events"),
        watermarks: unique("bench.takeover.watermarks"),
        dead_letters: unique("bench.takeover.dead"),
        idempotency: unique("bench.takeover.idempotency"),
    };
    let design: TopicSpec = quire_queue::design_topics(&names, 1, quire_queue::DEFAULT_PARTITIONS)
        .into_iter()
        .find(|spec| spec.name == names.watermarks)
        .context("the design has a watermark topic")?;
    let design_topic = TestTopic::adopt(design).await;
    let legacy_topic = TestTopic::create_with(
        "bench.takeover.legacy",
        12,
        &[("cleanup.policy", "compact")],
    )
    .await;
    let producer = TransactionalProducer::connect(&settings, &unique("bench-takeover")).await?;
    for topic in [&legacy_topic.name, &design_topic.name] {
        write_watermarks(&producer, topic, args.writes, args.streams).await?;
    }

    let (legacy_read, legacy_seconds) = blocking_read(&legacy_topic.name).await?;
    let (fresh_read, fresh_seconds) = blocking_read(&design_topic.name).await?;
    // The cleaner compacts rolled segments once a tenth of the log is dirty
    // (log.cleaner.backoff.ms, 15 s by default, between its checks).
    let waited = Instant::now();
    let (compacted_read, compacted_seconds) = loop {
        let (read, seconds) = blocking_read(&design_topic.name).await?;
        if read < args.writes / 4 || waited.elapsed().as_secs() > args.compaction_wait_secs {
            break (read, seconds);
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    ensure!(legacy_read >= args.writes, "the legacy topic lost writes");
    println!(
        "take-over read of watermark partition 0 after {} writes over {} streams",
        args.writes, args.streams
    );
    println!("{:<46} {:>10} {:>10}", "topic", "records", "ms");
    println!(
        "{:<46} {:>10} {:>10.0}",
        "compacted only (before)",
        legacy_read,
        legacy_seconds * 1000.0
    );
    println!(
        "{:<46} {:>10} {:>10.0}",
        "design settings, before the cleaner ran",
        fresh_read,
        fresh_seconds * 1000.0
    );
    println!(
        "{:<46} {:>10} {:>10.0}",
        format!(
            "design settings, compacted ({:.0} s later)",
            waited.elapsed().as_secs_f64()
        ),
        compacted_read,
        compacted_seconds * 1000.0
    );
    println!(
        "takeover: writes={} before_ms={:.0} after_ms={:.0} ratio={:.1}",
        args.writes,
        legacy_seconds * 1000.0,
        compacted_seconds * 1000.0,
        legacy_seconds / compacted_seconds.max(1e-6)
    );
    Ok(())
}

async fn write_watermarks(
    producer: &TransactionalProducer,
    topic: &str,
    writes: usize,
    streams: usize,
) -> anyhow::Result<()> {
    let mut written = 0;
    while written < writes {
        let batch: Vec<OutMessage> = (written..(written + 5_000).min(writes))
            .map(|index| {
                let watermark = Watermark {
                    v: CURRENT_VERSION,
                    partition: 0,
                    offset: Some(index as i64),
                    definition: None,
                    window: None,
                    window_after_changes: Vec::new(),
                    // Written as before logs were named: the first log's.
                    log: None,
                    dead_letters_through: None,
                };
                OutMessage::new(
                    topic,
                    Some(format!("stream-{:04}", index % streams).into_bytes()),
                    quire_messages::encode(&watermark),
                )
                .to_partition(0)
            })
            .collect();
        written += batch.len();
        producer.transact(batch).await?;
    }
    Ok(())
}

async fn blocking_read(topic: &str) -> anyhow::Result<(usize, f64)> {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || read_to_end(&topic)).await?
}

/// Reads partition 0 from the beginning to its end, read_committed, as
/// `watermarks::load` does: the records read and the seconds it took.
fn read_to_end(topic: &str) -> anyhow::Result<(usize, f64)> {
    let settings = kafka_settings();
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &settings.bootstrap_servers)
        .set("group.id", unique("bench-takeover-reader"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("fetch.wait.max.ms", "10")
        .set("isolation.level", "read_committed")
        .create()?;
    let started = Instant::now();
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(topic, 0, Offset::Beginning)?;
    consumer.assign(&assignment)?;
    let mut read = 0;
    loop {
        ensure!(
            started.elapsed() < Duration::from_secs(120),
            "read of {topic} did not end"
        );
        match consumer.poll(Duration::from_millis(200)) {
            None => {}
            Some(Ok(_)) => read += 1,
            Some(Err(KafkaError::PartitionEOF(_))) => break,
            Some(Err(error)) => return Err(error.into()),
        }
    }
    Ok((read, started.elapsed().as_secs_f64()))
}
