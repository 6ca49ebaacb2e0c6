//! The seed's demo, on Kafka: enqueue three arrays (one transaction each),
//! then dequeue them in arrays of 500 until the drain loop ends.
//!
//! `deploy/local/run` runs it against the local stack.

use std::time::{Duration, Instant};

use quire_config::{LogFormat, init_telemetry};
use quire_queue::{ArrayConsumer, ConsumerOptions, OutMessage, TopicSpec, TransactionalProducer};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    init_telemetry(LogFormat::Human, "warn");
    let settings = quire_config::load(None)?.kafka;
    let topic = format!("quire.demo-{}", std::process::id());
    let spec = TopicSpec {
        name: topic.clone(),
        partitions: 3,
        replication: 1,
        config: Vec::new(),
        growable: false,
    };
    quire_queue::ensure_topics(&settings, std::slice::from_ref(&spec)).await?;

    let producer = TransactionalProducer::connect(&settings, "quire-demo").await?;
    for array in 0..3 {
        let messages: Vec<OutMessage> = (0..2_500)
            .map(|index| {
                OutMessage::new(
                    &topic,
                    Some(format!("stream-{}", index % 4).into_bytes()),
                    format!("Message number {index} of array {array}").into_bytes(),
                )
            })
            .collect();
        let started = Instant::now();
        let ids = producer.transact(messages).await?;
        println!(
            "Enqueued [{}] messages in one transaction in {:?}; first id {}, last id {}",
            ids.len(),
            started.elapsed(),
            ids[0],
            ids[ids.len() - 1]
        );
    }

    let consumer = ArrayConsumer::new(&settings, &ConsumerOptions::new("quire-demo", &topic))?;
    let summary = consumer
        .drain(500, Duration::from_secs(2), |array| {
            println!("Dequeued [{}] messages.", array.len());
        })
        .await?;
    println!(
        "No more messages to dequeue: {} messages in {} arrays, one commit each (exit: {:?}).",
        summary.messages, summary.arrays, summary.exit
    );
    drop(consumer);
    quire_queue::delete_topics(&settings, &[&topic]).await?;
    Ok(())
}
