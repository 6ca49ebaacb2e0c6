//! Per-record CPU time of the two hot paths, each against what it stands in
//! for, measured in the same run on the same records (no Kafka, no S3: the
//! claim is CPU):
//!
//! - the producer API's check: one clean pass (`quire_xml::is_clean_record`)
//!   against the three checks (parse into a `serde_json::Value`, look for a
//!   repeated key, `quire_xml::check_record`);
//! - the worker's rendering: `quire_xml::render_fields` straight from the
//!   text against parsing a `Value` and rendering it
//!   (`DocumentRenderer::record`), the same bytes out;
//! - the producer API's check under a typed definition (the clean pass,
//!   then a `Value` and `quire_xml::TypedCheck::check`, as
//!   `validation::check_types` does) against the same door without one:
//!   the cost a typed definition adds per record;
//! - the worker's rendering with `indent` against the same rendering
//!   without: the cost of pretty printing per record.

use std::hint::black_box;
use std::time::{Duration, Instant};

use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct RecordsArgs {
    /// Records per measured round.
    #[arg(long, default_value_t = 500_000)]
    records: usize,
    /// Rounds per shape; medians are printed.
    #[arg(long, default_value_t = 5)]
    runs: usize,
}

/// Makes the record of a sequence number.
type MakeRecord = Box<dyn Fn(usize) -> String>;

/// A record shape and the typed fields that declare all of it.
struct Shape {
    name: &'static str,
    make: MakeRecord,
    fields: &'static str,
}

const SMALL_FIELDS: &str = r#"[
    {"name": "stream", "type": "string", "required": true, "max_length": 64},
    {"name": "seq", "type": "integer", "required": true},
    {"name": "payload", "type": "string", "pattern": "x+"}]"#;

const WIDE_FIELDS: &str = r#"[
    {"name": "id", "type": "integer", "required": true},
    {"name": "amount", "type": "decimal", "scale": 2, "required": true},
    {"name": "ok", "type": "boolean"},
    {"name": "tags", "type": "string", "repeated": true},
    {"name": "field_0", "type": "string"}, {"name": "field_1", "type": "string"},
    {"name": "field_2", "type": "string"}, {"name": "field_3", "type": "string"},
    {"name": "field_4", "type": "string"}, {"name": "field_5", "type": "string"},
    {"name": "field_6", "type": "string"}, {"name": "field_7", "type": "string"},
    {"name": "field_8", "type": "string"}, {"name": "field_9", "type": "string"},
    {"name": "field_10", "type": "string"}, {"name": "field_11", "type": "string"},
    {"name": "field_12", "type": "string"}, {"name": "field_13", "type": "string"},
    {"name": "field_14", "type": "string"}, {"name": "field_15", "type": "string", "max_length": 100},
    {"name": "customer", "type": "object", "fields": [
        {"name": "name", "type": "string", "required": true},
        {"name": "city", "type": "string"}]}]"#;

/// The record shapes the pipeline benchmark sends and a wider one.
fn shapes() -> Vec<Shape> {
    vec![
        Shape {
            name: "100 B, 3 fields",
            fields: SMALL_FIELDS,
            make: Box::new(|seq| {
                format!(
                    r#"{{"stream":"bench-3","seq":{seq},"payload":"{}"}}"#,
                    "x".repeat(52)
                )
            }),
        },
        Shape {
            name: "1 KB, 20 fields, nested",
            fields: WIDE_FIELDS,
            make: Box::new(|seq| {
                let fields: Vec<String> = (0..16)
                    .map(|index| {
                        format!(
                            r#""field_{index}":"value {index} of record {seq}, with some text""#
                        )
                    })
                    .collect();
                format!(
                    r#"{{"id":{seq},"amount":12.50,"ok":true,"tags":["a","b","c"],{},"customer":{{"name":"Zoë","city":"Paris"}}}}"#,
                    fields.join(",")
                )
            }),
        },
    ]
}

/// The API's door under a typed definition: the clean pass, then the
/// record as a `Value` against its fields.
fn typed_checks(text: &str, check: &quire_xml::TypedCheck) -> bool {
    if !quire_xml::is_clean_record(text) {
        return false;
    }
    let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else {
        return false;
    };
    check.check(&value).is_ok()
}

fn full_checks(text: &str) -> bool {
    let Ok(value) = serde_json::from_str::<serde_json::Value>(text) else {
        return false;
    };
    quire_xml::first_duplicate_key(text).is_none() && quire_xml::check_record(&value).is_ok()
}

/// CPU time of this process so far (user + system), in clock ticks
/// (10 ms here): rounds are long enough (hundreds of ms) for that.
fn process_cpu() -> Duration {
    crate::pipeline::cpu_time(std::process::id()).expect("this process's CPU time")
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// CPU nanoseconds per record of `check` over `records`, one round.
fn measure(records: &[String], check: &mut dyn FnMut(&str) -> bool) -> f64 {
    let started = process_cpu();
    let wall = Instant::now();
    let mut passed = 0usize;
    for record in records {
        passed += usize::from(check(black_box(record)));
    }
    assert_eq!(passed, records.len(), "every record passes");
    let cpu = process_cpu().saturating_sub(started);
    // A round too short to register a tick falls back to wall time.
    let spent = if cpu.is_zero() { wall.elapsed() } else { cpu };
    spent.as_nanos() as f64 / records.len() as f64
}

pub fn run(args: RecordsArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.records > 0 && args.runs > 0,
        "--records and --runs must be positive"
    );
    println!(
        "records: {} records per round, {} rounds, medians of CPU ns per record",
        args.records, args.runs
    );
    println!(
        "{:<42} {:>12} {:>12} {:>8}",
        "path, shape", "baseline", "measured", "ratio"
    );
    let definition: quire_messages::Definition = serde_json::from_str("{}")?;
    let renderer = quire_xml::DocumentRenderer::new(&definition);
    let indented: quire_messages::Definition = serde_json::from_str(r#"{"indent": 2}"#)?;
    let indenting_renderer = quire_xml::DocumentRenderer::new(&indented);
    let mut last = Vec::new();
    for Shape {
        name: shape,
        make,
        fields: declared,
    } in shapes()
    {
        let records: Vec<String> = (0..args.records).map(&make).collect();
        let typed: quire_messages::Definition = serde_json::from_str(&format!(
            r#"{{"fields": {declared}, "undeclared": "refuse"}}"#
        ))?;
        typed.validate()?;
        let typed_check = quire_xml::TypedCheck::new(&typed).expect("a typed definition");
        let mut fields = Vec::new();
        let mut out = Vec::new();
        let mut tree_out = Vec::new();
        for record in records.iter().take(3) {
            anyhow::ensure!(quire_xml::is_clean_record(record), "not clean: {record}");
            fields.clear();
            anyhow::ensure!(
                quire_xml::render_fields(&mut fields, record.as_bytes()),
                "not rendered from its text: {record}"
            );
        }
        let mut tree_render = |text: &str| {
            tree_out.clear();
            let value: serde_json::Value = serde_json::from_str(text).expect("JSON");
            renderer.record(&mut tree_out, &value).is_ok()
        };
        let mut tree_rounds = Vec::new();
        let mut fast_render_rounds = Vec::new();
        let mut check_rounds = Vec::new();
        let mut clean_rounds = Vec::new();
        let mut untyped_door_rounds = Vec::new();
        let mut typed_door_rounds = Vec::new();
        let mut indented_rounds = Vec::new();
        for _ in 0..args.runs {
            check_rounds.push(measure(&records, &mut full_checks));
            clean_rounds.push(measure(&records, &mut quire_xml::is_clean_record));
            tree_rounds.push(measure(&records, &mut tree_render));
            fast_render_rounds.push(measure(&records, &mut |text: &str| {
                fields.clear();
                let rendered = quire_xml::render_fields(&mut fields, text.as_bytes());
                out.clear();
                renderer.record_of_fields(&mut out, &fields);
                rendered
            }));
            untyped_door_rounds.push(measure(&records, &mut quire_xml::is_clean_record));
            typed_door_rounds.push(measure(&records, &mut |text: &str| {
                typed_checks(text, &typed_check)
            }));
            indented_rounds.push(measure(&records, &mut |text: &str| {
                fields.clear();
                let rendered = quire_xml::render_fields(&mut fields, text.as_bytes());
                out.clear();
                indenting_renderer.record_of_fields(&mut out, &fields);
                rendered
            }));
        }
        let fast_render_baseline = fast_render_rounds.clone();
        let key = shape.split(',').next().unwrap_or(shape).replace(' ', "");
        for (path, baseline, fast) in [
            ("api check", check_rounds, clean_rounds),
            ("worker render", tree_rounds, fast_render_rounds),
            ("api typed check", untyped_door_rounds, typed_door_rounds),
            (
                "worker render indented",
                fast_render_baseline,
                indented_rounds,
            ),
        ] {
            let (baseline, fast) = (median(baseline), median(fast));
            println!(
                "{:<42} {baseline:>12.0} {fast:>12.0} {:>8.2}",
                format!("{path}, {shape}"),
                fast / baseline
            );
            let path = path.replace(' ', "_");
            last.push(format!(
                "{path}_{key}_ns_per_record={fast:.0} {path}_{key}_baseline_ns_per_record={baseline:.0} {path}_{key}_ratio={:.3}",
                fast / baseline
            ));
        }
    }
    println!("{}", last.join(" "));
    Ok(())
}
