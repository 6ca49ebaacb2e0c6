//! Rendering speed of records of about 100 bytes, against re-serializing the
//! same parsed records as JSON (serde_json walking the same tree into the
//! same kind of buffer), measured in the same run.
//!
//! `cargo bench -p quire-xml` prints, last:
//! `xml_render records_per_s=<n> over_json_serialize=<ratio> check_share=<fraction>`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use quire_messages::Definition;
use quire_xml::{DocumentRenderer, check_record};
use serde_json::Value;

const RECORD_COUNT: usize = 200;
const MEASURE_FOR: Duration = Duration::from_secs(1);

fn sample_records() -> Vec<Value> {
    (0..RECORD_COUNT)
        .map(|index| {
            let text = format!(
                r#"{{"id":{index},"customer":"Ada & Co {index}","price":12.50,"tags":["new","vip"],"address":{{"city":"Zürich","zip":"8000"}}}}"#
            );
            serde_json::from_str(&text).expect("sample records are JSON")
        })
        .collect()
}

/// Records per second of `pass` over all records, after a warm-up pass.
fn records_per_second(records: &[Value], mut pass: impl FnMut(&[Value], &mut Vec<u8>)) -> f64 {
    let mut buffer = Vec::with_capacity(records.len() * 256);
    pass(records, &mut buffer);
    let started = Instant::now();
    let mut passes = 0u64;
    while started.elapsed() < MEASURE_FOR {
        buffer.clear();
        pass(records, &mut buffer);
        black_box(&buffer);
        passes += 1;
    }
    (passes as f64 * records.len() as f64) / started.elapsed().as_secs_f64()
}

fn main() {
    let records = sample_records();
    let renderer = DocumentRenderer::new(&Definition::default());

    let xml_rate = records_per_second(&records, |records, out| {
        for record in records {
            let rendered = renderer.record(out, record);
            debug_assert!(rendered.is_ok());
        }
    });
    let check_rate = records_per_second(&records, |records, _| {
        for record in records {
            black_box(check_record(record).is_ok());
        }
    });
    let json_rate = records_per_second(&records, |records, out| {
        for record in records {
            let written = serde_json::to_writer(&mut *out, record);
            debug_assert!(written.is_ok());
        }
    });

    let mut sample = Vec::new();
    let rendered = renderer.record(&mut sample, &records[0]);
    debug_assert!(rendered.is_ok());
    println!(
        "one record: {}",
        String::from_utf8_lossy(&sample).trim_end()
    );
    println!(
        "xml render: {xml_rate:.0} records/s ({} bytes each)",
        sample.len()
    );
    println!("check alone: {check_rate:.0} records/s");
    println!("json serialize (baseline): {json_rate:.0} records/s");
    println!(
        "xml_render records_per_s={xml_rate:.0} over_json_serialize={:.2} check_share={:.2}",
        xml_rate / json_rate,
        xml_rate / check_rate
    );
}
