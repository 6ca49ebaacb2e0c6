//! A document's totals: per declared numeric field named in the
//! definition's `totals`, the count of values, their exact sum (decimal
//! arithmetic, no rounding, of any size) and the smallest and largest
//! value as sent.
//!
//! Records are staged as they render and counted when they are appended,
//! so a record rendered and then discarded (it did not fit, its message
//! went to a dead letter) leaves the totals as they were.

use std::str::FromStr;

use bigdecimal::BigDecimal;
use quire_messages::Definition;
use serde_json::Value;

use crate::FieldTotal;

/// The running totals of one document.
#[derive(Debug, Clone)]
pub struct Totals {
    fields: Vec<Running>,
    /// Values of records rendered and not yet appended: (field, text).
    staged: Vec<(usize, String)>,
}

#[derive(Debug, Clone)]
struct Running {
    field: String,
    count: u64,
    sum: BigDecimal,
    /// The extremes as sent, with their values.
    min: Option<(BigDecimal, String)>,
    max: Option<(BigDecimal, String)>,
}

impl Totals {
    /// `None` for a definition that asks for no totals.
    pub fn new(definition: &Definition) -> Option<Self> {
        (!definition.totals.is_empty()).then(|| Totals {
            fields: definition
                .totals
                .iter()
                .map(|field| Running {
                    field: field.clone(),
                    count: 0,
                    sum: BigDecimal::from(0),
                    min: None,
                    max: None,
                })
                .collect(),
            staged: Vec::new(),
        })
    }

    /// Stages a rendered record's values (numbers only: the typed check
    /// has refused anything else).
    pub fn stage(&mut self, record: &Value) {
        for (index, running) in self.fields.iter().enumerate() {
            if let Some(Value::Number(number)) = record.get(&running.field) {
                self.staged.push((index, number.as_str().to_owned()));
            }
        }
    }

    /// Counts what is staged: its records were appended.
    pub fn commit(&mut self) {
        for (index, text) in self.staged.drain(..) {
            // A JSON number's text always parses; one that would not is
            // left out rather than stop the document.
            let Ok(value) = BigDecimal::from_str(&text) else {
                continue;
            };
            let running = &mut self.fields[index];
            running.count += 1;
            running.sum += &value;
            if running.min.as_ref().is_none_or(|(min, _)| value < *min) {
                running.min = Some((value.clone(), text.clone()));
            }
            if running.max.as_ref().is_none_or(|(max, _)| value > *max) {
                running.max = Some((value, text));
            }
        }
    }

    /// Forgets what is staged.
    pub fn discard(&mut self) {
        self.staged.clear();
    }

    /// The totals so far, in the definition's order.
    pub fn totals(&self) -> Vec<FieldTotal> {
        self.fields
            .iter()
            .map(|running| FieldTotal {
                field: running.field.clone(),
                count: running.count,
                sum: running.sum.to_plain_string(),
                min: running.min.as_ref().map(|(_, text)| text.clone()),
                max: running.max.as_ref().map(|(_, text)| text.clone()),
            })
            .collect()
    }

    /// Memory the totals hold: what a document's header totals cost.
    pub fn held_bytes(&self) -> usize {
        let running: usize = self
            .fields
            .iter()
            .map(|running| {
                std::mem::size_of::<Running>()
                    + running.field.len()
                    + running.sum.digits() as usize / 2
                    + running.min.as_ref().map_or(0, |(_, text)| 2 * text.len())
                    + running.max.as_ref().map_or(0, |(_, text)| 2 * text.len())
            })
            .sum();
        running
            + self
                .staged
                .iter()
                .map(|(_, text)| text.len() + 32)
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn totals_of(records: &[&str]) -> FieldTotal {
        let definition = Definition {
            fields: serde_json::from_str(r#"[{"name": "amount", "type": "decimal"}]"#).unwrap(),
            totals: vec!["amount".into()],
            ..Definition::default()
        };
        let mut totals = Totals::new(&definition).unwrap();
        for record in records {
            totals.stage(&serde_json::from_str(record).unwrap());
            totals.commit();
        }
        totals.totals().remove(0)
    }

    #[test]
    fn sums_are_exact_whatever_the_size_and_extremes_keep_their_digits() {
        let total = totals_of(&[
            r#"{"amount": 0.1}"#,
            r#"{"amount": 0.2}"#,
            r#"{"amount": 123456789012345678901234567890.10}"#,
            r#"{"amount": -5}"#,
            r#"{"note": "no amount"}"#,
            r#"{"amount": null}"#,
        ]);
        assert_eq!(total.count, 4);
        assert_eq!(total.sum, "123456789012345678901234567885.40");
        assert_eq!(total.min.as_deref(), Some("-5"));
        assert_eq!(
            total.max.as_deref(),
            Some("123456789012345678901234567890.10")
        );
        let empty = totals_of(&[]);
        assert_eq!((empty.count, empty.sum.as_str(), empty.min), (0, "0", None));
    }

    #[test]
    fn a_discarded_record_is_not_counted() {
        let definition = Definition {
            fields: serde_json::from_str(r#"[{"name": "n", "type": "integer"}]"#).unwrap(),
            totals: vec!["n".into()],
            ..Definition::default()
        };
        let mut totals = Totals::new(&definition).unwrap();
        totals.stage(&serde_json::from_str(r#"{"n": 7}"#).unwrap());
        totals.discard();
        totals.stage(&serde_json::from_str(r#"{"n": 2}"#).unwrap());
        totals.commit();
        let total = totals.totals().remove(0);
        assert_eq!((total.count, total.sum.as_str()), (1, "2"));
    }
}
