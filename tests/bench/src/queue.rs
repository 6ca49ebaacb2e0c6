//! The seed's table, on Kafka: array enqueue and dequeue against one message
//! at a time, and against plain librdkafka (no transactions) as the ceiling.

use std::sync::Arc;
use std::time::{Duration, Instant};

use quire_queue::{ArrayConsumer, ConsumerOptions, OutMessage, TransactionalProducer};
use quire_tests::{TestTopic, kafka_settings, payloads, unique};
use rdkafka::ClientConfig;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

#[derive(clap::Args)]
pub struct QueueArgs {
    /// Messages per scenario.
    #[arg(long, default_value_t = 25_000)]
    messages: usize,
    /// Messages for the one-transaction-per-message scenario (slow).
    #[arg(long, default_value_t = 2_500)]
    single_transaction_messages: usize,
    /// Partitions of the benchmark topic.
    #[arg(long, default_value_t = 3)]
    partitions: i32,
    /// Approximate payload size in bytes.
    #[arg(long, default_value_t = 40)]
    payload_bytes: usize,
}

struct Row {
    name: String,
    messages: usize,
    seconds: f64,
}

impl Row {
    fn rate(&self) -> f64 {
        self.messages as f64 / self.seconds
    }
}

fn out_messages(topic: &str, count: usize, size: usize) -> Vec<OutMessage> {
    payloads(count, size)
        .into_iter()
        .enumerate()
        .map(|(index, payload)| {
            OutMessage::new(
                topic,
                Some(format!("stream-{}", index % 10).into_bytes()),
                payload,
            )
        })
        .collect()
}

pub async fn run(args: QueueArgs) -> anyhow::Result<()> {
    let settings = kafka_settings();
    let mut rows = Vec::new();
    eprintln!(
        "queue benchmark: {} messages of ~{} bytes, {} partitions",
        args.messages, args.payload_bytes, args.partitions
    );

    // Ceiling first, on a topic of its own: plain idempotent produce.
    let ceiling_topic = TestTopic::create("bench-ceiling", args.partitions).await;
    let ceiling_produce = ceiling_produce(&ceiling_topic.name, &args)?;
    rows.push(ceiling_produce);
    rows.push(ceiling_consume(&ceiling_topic.name, &args)?);

    // Enqueue (a): arrays of 2,500, one transaction each.
    let topic = TestTopic::create("bench-queue", args.partitions).await;
    let producer = TransactionalProducer::connect(&settings, &unique("bench")).await?;
    for array_size in [2_500, 250, 25_000] {
        let array_size = array_size.min(args.messages);
        let messages = out_messages(&topic.name, args.messages, args.payload_bytes);
        let started = Instant::now();
        for chunk in messages.chunks(array_size) {
            producer.transact(chunk.to_vec()).await?;
        }
        rows.push(Row {
            name: format!("enqueue (a) arrays of {array_size}, one transaction each"),
            messages: args.messages,
            seconds: started.elapsed().as_secs_f64(),
        });
    }

    // Enqueue (b): single sends, each awaited (the seed's ENQUEUE returns its
    // msgid), one commit at the end.
    rows.push(single_sends_one_commit(&topic.name, &args).await?);

    // Enqueue (c): each send its own transaction.
    let singles = out_messages(
        &topic.name,
        args.single_transaction_messages,
        args.payload_bytes,
    );
    let started = Instant::now();
    for message in singles {
        producer.transact(vec![message]).await?;
    }
    rows.push(Row {
        name: "enqueue (c) one transaction per message".into(),
        messages: args.single_transaction_messages,
        seconds: started.elapsed().as_secs_f64(),
    });

    // The dequeue scenarios read what the enqueue scenarios wrote, each with
    // a new group (a new group starts at the beginning).
    rows.push(
        dequeue(
            &topic.name,
            &args,
            "dequeue (a) arrays of 500, a sync commit each",
            500,
            Commit::PerArray,
        )
        .await?,
    );
    rows.push(
        dequeue(
            &topic.name,
            &args,
            "dequeue (b) one message at a time, one commit at the end",
            1,
            Commit::AtEnd,
        )
        .await?,
    );
    rows.push(
        dequeue(
            &topic.name,
            &args,
            "dequeue (c) one message at a time, a sync commit each",
            1,
            Commit::PerArray,
        )
        .await?,
    );

    println!(
        "{:<62} {:>9} {:>9} {:>12}",
        "scenario", "messages", "seconds", "messages/s"
    );
    for row in &rows {
        println!(
            "{:<62} {:>9} {:>9.3} {:>12.0}",
            row.name,
            row.messages,
            row.seconds,
            row.rate()
        );
    }
    let rate = |prefix: &str| {
        rows.iter()
            .find(|row| {
                row.name.starts_with(&format!("{prefix} "))
                    || row.name.starts_with(&format!("{prefix},"))
            })
            .map(Row::rate)
            .expect("scenario ran")
    };
    let ceiling = rate("ceiling produce");
    for array_size in [250, 2_500, 25_000] {
        let name = format!("enqueue (a) arrays of {}", array_size.min(args.messages));
        println!("{name} over ceiling: {:.2}", rate(&name) / ceiling);
    }
    println!(
        "queue enqueue_a_over_c={:.1} dequeue_a_over_c={:.1} enqueue_a_over_ceiling={:.2}",
        rate("enqueue (a) arrays of 2500") / rate("enqueue (c)"),
        rate("dequeue (a)") / rate("dequeue (c)"),
        rate("enqueue (a) arrays of 2500") / ceiling,
    );
    Ok(())
}

/// The durability the array path has, without transactions: the ceiling.
pub(crate) fn ceiling_config() -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", &kafka_settings().bootstrap_servers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "50")
        .set("batch.size", "1048576")
        .set("partitioner", "murmur2_random");
    config
}

fn ceiling_produce(topic: &str, args: &QueueArgs) -> anyhow::Result<Row> {
    let producer: FutureProducer = ceiling_config().create()?;
    let messages = out_messages(topic, args.messages, args.payload_bytes);
    let started = Instant::now();
    let mut deliveries = Vec::with_capacity(messages.len());
    for message in &messages {
        let record = FutureRecord::to(topic)
            .key(message.key.as_deref().unwrap_or_default())
            .payload(message.payload.as_slice());
        deliveries.push(producer.send_result(record).map_err(|(error, _)| error)?);
    }
    producer.flush(Duration::from_secs(60))?;
    for delivery in deliveries {
        futures::executor::block_on(delivery)?.map_err(|(error, _)| error)?;
    }
    Ok(Row {
        name: "ceiling produce (plain librdkafka, idempotent, acks=all)".into(),
        messages: args.messages,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn ceiling_consume(topic: &str, args: &QueueArgs) -> anyhow::Result<Row> {
    let (read, seconds) = crate::pipeline::ceiling_consume(
        topic,
        args.partitions,
        args.messages,
        Duration::from_secs(120),
    )?;
    Ok(Row {
        name: "ceiling consume (plain librdkafka)".into(),
        messages: read,
        seconds,
    })
}

async fn single_sends_one_commit(topic: &str, args: &QueueArgs) -> anyhow::Result<Row> {
    let mut config = ceiling_config();
    config
        .set("transactional.id", unique("bench-singles"))
        .set("linger.ms", "0");
    let producer: Arc<FutureProducer> = Arc::new(config.create()?);
    let messages = out_messages(topic, args.messages, args.payload_bytes);
    let blocking = Arc::clone(&producer);
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        blocking.init_transactions(Duration::from_secs(30))?;
        Ok(blocking.begin_transaction()?)
    })
    .await??;
    let started = Instant::now();
    for message in &messages {
        let record = FutureRecord::to(topic)
            .key(message.key.as_deref().unwrap_or_default())
            .payload(message.payload.as_slice());
        let delivery = producer.send_result(record).map_err(|(error, _)| error)?;
        delivery.await?.map_err(|(error, _)| error)?;
    }
    let blocking = Arc::clone(&producer);
    tokio::task::spawn_blocking(move || blocking.commit_transaction(Duration::from_secs(30)))
        .await??;
    Ok(Row {
        name: "enqueue (b) single sends, one commit at the end".into(),
        messages: args.messages,
        seconds: started.elapsed().as_secs_f64(),
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Commit {
    PerArray,
    AtEnd,
}

async fn dequeue(
    topic: &str,
    args: &QueueArgs,
    name: &str,
    max: usize,
    commit: Commit,
) -> anyhow::Result<Row> {
    let settings = kafka_settings();
    let consumer = ArrayConsumer::new(
        &settings,
        &ConsumerOptions::new(unique("bench-dequeue"), topic),
    )?;
    // Timing starts once the group has assigned partitions; messages read
    // while joining are not counted.
    let joined = Instant::now();
    while consumer.assignment().is_empty() {
        anyhow::ensure!(joined.elapsed() < Duration::from_secs(60), "no assignment");
        let array = consumer.next_array(1, Duration::from_millis(100)).await?;
        consumer.commit(&array).await?;
    }
    let target = args.messages;
    let started = Instant::now();
    let mut read = 0;
    let mut last = None;
    let mut offsets = std::collections::BTreeMap::new();
    while read < target {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(300),
            "{name} stalled at {read}"
        );
        let array = consumer.next_array(max, Duration::from_millis(500)).await?;
        if array.is_empty() {
            break;
        }
        read += array.len();
        if commit == Commit::PerArray {
            consumer.commit(&array).await?;
        } else {
            offsets.extend(array.next_offsets());
            last = Some(array);
        }
    }
    if let Some(array) = last {
        consumer.commit_offsets(&array, offsets).await?;
    }
    Ok(Row {
        name: name.to_owned(),
        messages: read,
        seconds: started.elapsed().as_secs_f64(),
    })
}
