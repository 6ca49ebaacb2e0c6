//! Rebalances and take-over: the watermark topic's compaction bounds what a
//! new owner reads, and every place that creates the topics creates it so.
//! (The sweep after all of a read's events and the carried refused
//! transaction are unit-tested in the worker; their figures come from
//! `quire-bench rebalance` and `quire-bench takeover`.)

use quire_queue::{WATERMARK_COMPACTION, check_topics};
use quire_tests::{TestTopic, kafka_settings, unique};

fn repository_file(path: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|error| panic!("{path}: {error}"))
}

#[test]
fn the_local_stack_creates_the_watermark_topic_with_the_design_bounds() {
    let script = repository_file("deploy/local/stack");
    let line = script
        .lines()
        .find(|line| line.starts_with("WATERMARK_COMPACTION="))
        .expect("deploy/local/stack sets WATERMARK_COMPACTION");
    let expected: Vec<String> = WATERMARK_COMPACTION
        .iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect();
    assert_eq!(
        line,
        format!("WATERMARK_COMPACTION=\"{}\"", expected.join(",")),
        "the stack and quire_queue::WATERMARK_COMPACTION disagree"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watermark_topic_without_the_compaction_bounds_is_refused_at_start_up() {
    let names = quire_config::TopicNames {
        records: unique("test.bounds.records"),
        report_events: unique("test.bounds.events"),
        watermarks: unique("test.bounds.watermarks"),
        dead_letters: unique("test.bounds.dead"),
        idempotency: unique("test.bounds.idempotency"),
    };
    let specs = quire_queue::design_topics(&names, 1, quire_queue::DEFAULT_PARTITIONS);
    let mut guards = Vec::new();
    for spec in &specs {
        if spec.name == names.watermarks {
            // As releases before the bounds created it: compacted, nothing else.
            let mut legacy = spec.clone();
            legacy.config = vec![("cleanup.policy".into(), "compact".into())];
            guards.push(TestTopic::adopt(legacy).await);
        } else {
            guards.push(TestTopic::adopt(spec.clone()).await);
        }
    }
    let error = check_topics(&kafka_settings(), &specs)
        .await
        .expect_err("a watermark topic compacted without bounds");
    let message = error.to_string();
    assert!(
        message.contains(&names.watermarks) && message.contains("segment.ms"),
        "{message}"
    );

    let design = TestTopic::create_with(
        "bounds.design",
        12,
        &std::iter::once(("cleanup.policy", "compact"))
            .chain(WATERMARK_COMPACTION.iter().copied())
            .collect::<Vec<_>>(),
    )
    .await;
    let mut tightened = specs
        .iter()
        .find(|spec| spec.name == names.watermarks)
        .unwrap()
        .clone();
    tightened.name = design.name.clone();
    check_topics(&kafka_settings(), &[tightened])
        .await
        .expect("the design's own settings pass");
}
