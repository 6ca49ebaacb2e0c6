//! Reports as documents (issue 30), end to end on the real broker and S3
//! server: a typed definition with a namespace prefix, windows, count
//! rollovers and exact totals of a decimal field. Records arrive in many
//! arrays through the API, a worker is killed mid-way, and then:
//!
//! - every record is reported once (the exactness checks of every test);
//! - every report validates against the XSD its root points to, as stored
//!   beside it and as the API serves it, with a real validator (xmllint);
//! - each report's trailer total equals the exact sum of its own records'
//!   amounts, computed here in integer cents (the amounts have 16 digits
//!   before the point: a float sum would be off), and so do its header's
//!   control sum and totals, written before its first record (the header
//!   also names the report id, the window, the log times and a constant);
//! - arrays holding a record the definition refuses are answered 422
//!   naming the record, the field and the expected type, and none of their
//!   records appears anywhere;
//! - the definition indents, and every element of the document sits on a
//!   line of its own (validating all the same);
//! - a replay through another group renders the same bytes.

use std::collections::BTreeMap;
use std::num::NonZero;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use quire_tests::{ApiProcess, TestStack, unique};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(150);
const NAMESPACE: &str = "urn:quire:test:ledger";
/// Records per document before a count rollover.
const ROLLOVER: u64 = 40;

fn definition() -> Value {
    json!({
        "root": "ledger",
        "record": "entry",
        "namespace": NAMESPACE,
        "prefix": "lg",
        "fields": [
            {"name": "stream", "type": "string", "required": true},
            {"name": "seq", "type": "integer", "required": true},
            {"name": "amount", "type": "decimal", "scale": 2, "required": true},
            {"name": "at", "type": "dateTime", "required": true},
            {"name": "memo", "type": "string", "max_length": 200},
            {"name": "ok", "type": "boolean"},
            {"name": "lines", "type": "object", "repeated": true, "fields": [
                {"name": "sku", "type": "string", "pattern": "[A-Z]{3}-[0-9]{4}", "required": true},
                {"name": "qty", "type": "integer"}
            ]}
        ],
        "undeclared": "refuse",
        "totals": ["amount"],
        // Pretty printed: what people read and diff.
        "indent": 2,
        "window": {"every": "3s", "time_zone": "Europe/Paris", "grace": "1s"},
        // ISO 20022's group header: known at the end, written first.
        "header": {
            "fields": [
                {"name": "MsgId", "value": "report_id"},
                {"name": "NbOfTxs", "value": "records"},
                {"name": "CtrlSum", "value": "sum", "of": "amount"},
                {"name": "From", "value": "window_start"},
                {"name": "FirstLogTime", "value": "first_log_time"},
                {"name": "LastLogTime", "value": "last_log_time"},
                {"name": "InitgPty", "constant": INITIATING_PARTY}
            ],
            "totals": true
        }
    })
}

/// A header constant, with what XML must escape.
const INITIATING_PARTY: &str = "Quire <Test> & Co \"ledger\"";

/// The amount of record `seq`, in cents: large (16 digits before the
/// point), some negative, every scale the definition allows.
fn cents_of(seq: u64) -> i128 {
    let base = 1_234_567_890_123_456_i128 * 100 + i128::from(seq % 97) * 7;
    if seq % 5 == 3 { -base } else { base }
}

/// `cents` as the decimal text a record carries: `12.5`, `-3`, `0.07`, as
/// the scale falls.
fn decimal_text(cents: i128, seq: u64) -> String {
    let sign = if cents < 0 { "-" } else { "" };
    let (whole, fraction) = (cents.abs() / 100, cents.abs() % 100);
    match seq % 3 {
        0 if fraction == 0 => format!("{sign}{whole}"),
        1 if fraction % 10 == 0 => format!("{sign}{whole}.{}", fraction / 10),
        _ => format!("{sign}{whole}.{fraction:02}"),
    }
}

/// Record `seq` of `stream`, as the exact JSON text sent: hostile strings
/// (markup, quotes, `]]>`, non-ASCII) in `memo`, nested repeated lines.
fn record_text(stream: &str, seq: u64) -> String {
    let memo = format!("entry {seq} <&> \"quoted\" 'single' ]]> Zoë ✓");
    let record = format!(
        r#"{{"stream":{},"seq":{seq},"amount":{},"at":"2026-12-06T10:{:02}:{:02}.125+01:00","memo":{},"ok":{},"lines":[{{"sku":"ABC-{:04}","qty":{}}},{{"sku":"XYZ-0001"}}]}}"#,
        serde_json::to_string(stream).unwrap(),
        decimal_text(cents_of(seq), seq),
        seq / 60 % 60,
        seq % 60,
        serde_json::to_string(&memo).unwrap(),
        seq.is_multiple_of(2),
        seq % 10_000,
        seq % 7,
    );
    assert!(
        serde_json::from_str::<Value>(&record).is_ok(),
        "the test's own record is JSON: {record}"
    );
    record
}

fn array_of(texts: &[String]) -> String {
    format!("[{}]", texts.join(","))
}

/// Sends arrays of 7 records every 150 ms for `period`.
async fn send_for(api: &ApiProcess, stream: &str, sent: &mut Vec<u64>, period: Duration) {
    let until = Instant::now() + period;
    while Instant::now() < until {
        let next = sent.len() as u64;
        let texts: Vec<String> = (next..next + 7)
            .map(|seq| record_text(stream, seq))
            .collect();
        let (status, body) = api.send_body(stream, array_of(&texts)).await;
        assert_eq!(status, 200, "a good array is accepted: {body}");
        sent.extend(next..next + 7);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
}

/// Bad records, each at place 2 of an otherwise good array (numbered from
/// `REFUSED_SEQ`, never sent in a good array): the field the refusal must
/// name and the code.
const REFUSED_SEQ: u64 = 1_000_000;

fn refused_cases(stream: &str) -> Vec<(String, &'static str, &'static str)> {
    let good = |seq: u64| record_text(stream, seq);
    let with = |seq: u64, field: &str, value: &str| {
        let mut record: serde_json::Map<String, Value> = serde_json::from_str(&good(seq)).unwrap();
        let raw: Value = serde_json::from_str(value).unwrap();
        record.insert(field.to_owned(), raw);
        serde_json::to_string(&record).unwrap()
    };
    vec![
        // Three digits after the point: scale 2.
        (
            with(REFUSED_SEQ, "amount", "12.345"),
            "amount",
            "wrong_type",
        ),
        // Past the 18 digits a typed number may hold.
        (
            with(REFUSED_SEQ + 1, "amount", "1234567890123456789012.5"),
            "amount",
            "wrong_type",
        ),
        // A string where a decimal belongs.
        (
            with(REFUSED_SEQ + 2, "amount", r#""12.50""#),
            "amount",
            "wrong_type",
        ),
        // A dateTime without its offset.
        (
            with(REFUSED_SEQ + 3, "at", r#""2026-12-06T10:00:00""#),
            "at",
            "wrong_type",
        ),
        // A sku off its pattern, inside a repeated object.
        (
            with(REFUSED_SEQ + 4, "lines", r#"[{"sku":"abc-1"}]"#),
            "lines[0].sku",
            "wrong_type",
        ),
        // A field the definition does not declare, with undeclared: refuse.
        (
            with(REFUSED_SEQ + 5, "colour", r#""red""#),
            "colour",
            "wrong_type",
        ),
        // Deep nesting where an object is declared one level deep.
        (
            with(
                REFUSED_SEQ + 6,
                "lines",
                r#"[{"sku":"ABC-0001","qty":{"a":{"b":{"c":1}}}}]"#,
            ),
            "lines[0].qty",
            "wrong_type",
        ),
        // A control character: refused by the XML check, as ever.
        (
            with(REFUSED_SEQ + 7, "memo", r#""bell \u0007""#),
            "memo",
            "forbidden_character",
        ),
    ]
}

/// Every refused array answers 422 naming record 2, the field and (for a
/// type) what the definition expects.
async fn send_refused(api: &ApiProcess, stream: &str) {
    for (bad, field, code) in refused_cases(stream) {
        let texts = vec![
            record_text(stream, REFUSED_SEQ + 100),
            record_text(stream, REFUSED_SEQ + 101),
            bad.clone(),
            record_text(stream, REFUSED_SEQ + 102),
        ];
        let (status, body) = api.send_body(stream, array_of(&texts)).await;
        assert_eq!(status, 422, "{bad}: {body}");
        let error = &body["error"];
        assert_eq!(error["code"], code, "{bad}: {body}");
        assert_eq!(error["index"], 2, "{bad}: {body}");
        assert_eq!(error["path"], field, "{bad}: {body}");
        if code == "wrong_type" {
            let expected = error["expected"].as_str().unwrap_or_default();
            assert!(!expected.is_empty(), "{bad}: the expected type: {body}");
            assert!(
                error["message"]
                    .as_str()
                    .is_some_and(|message| message.contains(field) && message.contains(expected)),
                "{bad}: the message names the field and the type: {body}"
            );
        }
    }
}

fn xmllint() -> PathBuf {
    let path = std::env::var("QUIRE_TEST_XMLLINT").unwrap_or_else(|_| "xmllint".to_owned());
    let found = Command::new(&path).arg("--version").output();
    assert!(
        found.is_ok_and(|output| output.status.success()),
        "xmllint is needed (Debian's libxml2-utils, which `deploy/local/stack up` installs; \
         `eval \"$(deploy/local/stack env)\"` exports QUIRE_TEST_XMLLINT)"
    );
    PathBuf::from(path)
}

/// xmllint's verdict on `document` against `schema`.
fn validate(schema: &[u8], document: &[u8], name: &str) -> Result<(), String> {
    let directory = std::env::temp_dir().join(unique("quire-documents"));
    std::fs::create_dir_all(&directory).unwrap();
    let schema_path = directory.join("schema.xsd");
    let document_path = directory.join(format!("{}.xml", name.replace(['/', '~'], "_")));
    std::fs::write(&schema_path, schema).unwrap();
    std::fs::write(&document_path, document).unwrap();
    let output = Command::new(xmllint())
        .arg("--noout")
        .arg("--nonet")
        .arg("--schema")
        .arg(&schema_path)
        .arg(&document_path)
        .output()
        .expect("xmllint runs");
    std::fs::remove_dir_all(&directory).unwrap();
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).into_owned())
    }
}

/// `text` (a decimal with at most 2 digits after the point) in cents.
fn cents_in(text: &str) -> i128 {
    let (negative, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, fraction) = digits.split_once('.').unwrap_or((digits, ""));
    assert!(
        fraction.len() <= 2,
        "{text}: at most 2 digits after the point"
    );
    let cents =
        whole.parse::<i128>().unwrap() * 100 + format!("{fraction:0<2}").parse::<i128>().unwrap();
    if negative { -cents } else { cents }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_reports_validate_against_their_schema_and_total_their_records_exactly() {
    let stack = TestStack::create("documents").await;
    let api = stack.start_api().await;
    let stream = unique("ledger");
    api.put_definition(&stream, definition()).await;
    let rollover = |settings: &mut quire_config::Settings| {
        settings.worker.rollover_records = NonZero::new(ROLLOVER).unwrap();
    };

    let mut sent = Vec::new();
    let mut worker = stack.worker("w1").with(rollover).spawn();
    send_for(&api, &stream, &mut sent, Duration::from_millis(3_000)).await;
    send_refused(&api, &stream).await;
    api.cut(&stream).await;
    send_for(&api, &stream, &mut sent, Duration::from_millis(2_000)).await;
    // Killed with documents open; records keep coming.
    worker.kill();
    send_for(&api, &stream, &mut sent, Duration::from_millis(1_500)).await;
    let _successor = stack.worker("w1").with(rollover).spawn();
    send_for(&api, &stream, &mut sent, Duration::from_millis(2_500)).await;

    let sent_by_stream = BTreeMap::from([(stream.clone(), sent.clone())]);
    let observed = stack
        .wait_for("every record in a report", LONG, |observed| {
            observed.sequence_numbers(&stream).len() >= sent.len()
        })
        .await;
    // Exactly once, and no record of a refused array anywhere.
    observed.assert_exactly_once(&sent_by_stream);
    assert!(
        observed.dead_letters.is_empty(),
        "every accepted record renders: {:?}",
        observed.dead_letters
    );

    let mut schemas: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut windows = std::collections::BTreeSet::new();
    let mut rolled_over = 0;
    for (id, report) in &observed.reports {
        // The event carries the S3 checksum its manifest has.
        let event = observed
            .events
            .iter()
            .find(|event| event["report_id"].as_str() == Some(id.as_str()))
            .unwrap_or_else(|| panic!("{id}: an event"));
        assert_eq!(event["checksum"]["algorithm"], "CRC32C", "{event}");
        assert_eq!(event["checksum"], report.manifest["checksum"], "{id}");
        // Its object is tagged with what selects it, before its event.
        let key = report.manifest["key"].as_str().unwrap();
        let tagging = stack
            .bucket
            .client
            .get_object_tagging()
            .bucket(&stack.bucket.name)
            .key(key)
            .send()
            .await
            .expect("GetObjectTagging");
        let tags: BTreeMap<&str, &str> = tagging
            .tag_set()
            .iter()
            .map(|tag| (tag.key(), tag.value()))
            .collect();
        let text_of = |field: &str| match &report.manifest[field] {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        };
        assert_eq!(
            tags,
            BTreeMap::from([
                ("quire-stream", stream.as_str()),
                ("quire-report-id", id.replace('~', "/").as_str()),
                ("quire-partition", text_of("partition").as_str()),
                ("quire-records", text_of("records").as_str()),
                ("quire-first-offset", text_of("first_offset").as_str()),
                ("quire-last-offset", text_of("last_offset").as_str()),
                ("quire-window-start", text_of("window_start").as_str()),
            ]),
            "{id}"
        );
        let text = std::str::from_utf8(&report.document).unwrap();
        let document = roxmltree::Document::parse(text).expect("well-formed");
        let root = document.root_element();
        assert_eq!(
            (root.tag_name().namespace(), root.tag_name().name()),
            (Some(NAMESPACE), "ledger"),
            "{id}"
        );
        assert!(
            text.starts_with("<?xml") && text.contains("<lg:ledger "),
            "{id}: {text}"
        );
        // Indented: the header's and the records' children one level in,
        // each on a line of its own.
        assert!(
            text.contains("\n  <lg:header>\n    <MsgId>")
                && text.contains("\n  <lg:summary ")
                && text.ends_with("\n  </lg:summary>\n</lg:ledger>\n"),
            "{id}: {text}"
        );
        // The root points to its schema: `namespace key`.
        let location = root
            .attribute((quire_xml::XML_SCHEMA_INSTANCE_NAMESPACE, "schemaLocation"))
            .unwrap_or_else(|| panic!("{id}: no xsi:schemaLocation"));
        let (namespace, key) = location.split_once(' ').expect("namespace and key");
        assert_eq!(namespace, NAMESPACE);
        let prefix = format!("schemas/{stream}/");
        let file = key
            .strip_prefix(&prefix)
            .unwrap_or_else(|| panic!("{id}: {key} is not under {prefix}"));
        if !schemas.contains_key(file) {
            let stored = stack
                .bucket
                .read(key)
                .await
                .expect("the schema beside the reports");
            let (status, served) = api
                .get_bytes(&format!("/v1/streams/{stream}/schemas/{file}"))
                .await;
            assert_eq!(status, 200, "the API serves the schema");
            assert_eq!(served, stored, "the API serves the stored bytes");
            schemas.insert(file.to_owned(), stored);
        }
        validate(&schemas[file], &report.document, id)
            .unwrap_or_else(|complaint| panic!("{id} does not validate: {complaint}\n{text}"));

        // The header comes first, before every record, and holds what
        // only the document's end knows.
        let header = root
            .children()
            .find(|node| node.is_element())
            .expect("a first element");
        assert_eq!(
            (header.tag_name().namespace(), header.tag_name().name()),
            (Some(NAMESPACE), "header"),
            "{id}: the header first"
        );
        let child = |name: &str| {
            header
                .children()
                .find(|node| node.is_element() && node.tag_name().name() == name)
                .and_then(|node| node.text().map(str::to_owned))
        };
        assert_eq!(child("MsgId").as_deref(), Some(id.as_str()), "{id}");
        assert_eq!(
            child("From").as_deref(),
            report.manifest["window_start"].as_str(),
            "{id}"
        );
        assert_eq!(child("InitgPty").as_deref(), Some(INITIATING_PARTY), "{id}");
        let header_total = header
            .children()
            .find(|node| node.is_element() && node.tag_name().name() == "total")
            .unwrap_or_else(|| panic!("{id}: no total in the header"));

        // The trailer's total is the exact sum of the report's amounts.
        let summary = root
            .children()
            .rfind(|node| node.is_element())
            .expect("a summary");
        assert_eq!(summary.tag_name().name(), "summary");
        let total = summary
            .children()
            .find(|node| node.is_element() && node.tag_name().name() == "total")
            .unwrap_or_else(|| panic!("{id}: no total in {text}"));
        let seqs: Vec<u64> = report
            .records()
            .iter()
            .map(|record| record["seq"].parse().unwrap())
            .collect();
        assert_eq!(total.attribute("field"), Some("amount"));
        assert_eq!(
            child("NbOfTxs"),
            Some(seqs.len().to_string()),
            "{id}: the header's count"
        );
        for attribute in ["field", "count", "sum", "min", "max"] {
            assert_eq!(
                header_total.attribute(attribute),
                total.attribute(attribute),
                "{id}: the header's {attribute} is the trailer's"
            );
        }
        assert_eq!(
            child("CtrlSum").as_deref(),
            total.attribute("sum"),
            "{id}: the control sum is the trailer's"
        );
        let (first, last) = (child("FirstLogTime"), child("LastLogTime"));
        assert_eq!(
            (first.is_some(), last.is_some()),
            (!seqs.is_empty(), !seqs.is_empty()),
            "{id}: log times exactly when there are records"
        );
        if let (Some(first), Some(last)) = (&first, &last) {
            assert!(
                first <= last && first.ends_with('Z'),
                "{id}: {first} .. {last}"
            );
        }
        assert_eq!(
            total.attribute("count"),
            Some(seqs.len().to_string().as_str()),
            "{id}"
        );
        if seqs.is_empty() {
            assert_eq!(total.attribute("sum"), Some("0"), "{id}: an empty window");
            continue;
        }
        let expected: i128 = seqs.iter().map(|&seq| cents_of(seq)).sum();
        let written = total.attribute("sum").expect("a sum");
        assert_eq!(cents_in(written), expected, "{id}: sum {written}");
        let control_sum = child("CtrlSum").expect("a control sum");
        assert_eq!(
            cents_in(&control_sum),
            expected,
            "{id}: header sum {control_sum}"
        );
        let min = seqs.iter().map(|&seq| cents_of(seq)).min().unwrap();
        let max = seqs.iter().map(|&seq| cents_of(seq)).max().unwrap();
        assert_eq!(cents_in(total.attribute("min").unwrap()), min, "{id}: min");
        assert_eq!(cents_in(total.attribute("max").unwrap()), max, "{id}: max");
        // A hostile string comes back as it went in.
        assert!(
            text.contains("\n  <lg:entry>\n    <stream>"),
            "{id}: {text}"
        );
        let record = &report.records()[0];
        assert!(
            record["memo"].contains("<&> \"quoted\" 'single' ]]> Zoë ✓"),
            "{id}"
        );
        // A rollover ends a document at the first batch message that
        // brings it to the count: 7 records travel in one message.
        if report.manifest["trigger"] == "records" {
            assert!(
                seqs.len() as u64 >= ROLLOVER,
                "{id}: {} records",
                seqs.len()
            );
            rolled_over += 1;
        }
        windows.insert(report.manifest["window_start"].as_str().unwrap().to_owned());
    }
    assert_eq!(schemas.len(), 1, "one definition, one schema");
    assert!(
        rolled_over > 0,
        "some documents ended by the count rollover"
    );
    assert!(
        windows.len() >= 3,
        "reports of several windows: {windows:?}"
    );

    // A replay through another group renders the same bytes, totals and all.
    stack
        .assert_replay_renders_with("documents", 12, &observed.reports, LONG, rollover)
        .await;
}
