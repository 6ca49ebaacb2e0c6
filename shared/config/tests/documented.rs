//! Every configuration key is documented in one place, `docs/configuration.md`,
//! with its true default and its environment variable; and that page names no
//! key the services do not know.

use std::collections::BTreeMap;

const DEFAULTS: &str = include_str!("../src/defaults.toml");
const PAGE: &str = include_str!("../../../docs/configuration.md");

/// `section.key` → the default as the page writes it.
fn defaults() -> BTreeMap<String, String> {
    let table: toml::Table = DEFAULTS.parse().expect("defaults.toml parses");
    let mut keys = BTreeMap::new();
    flatten("", &toml::Value::Table(table), &mut keys);
    keys
}

fn flatten(prefix: &str, value: &toml::Value, keys: &mut BTreeMap<String, String>) {
    match value {
        toml::Value::Table(table) if prefix == "kafka.properties" => {
            // A pass-through map: documented as one row, empty by default.
            assert!(table.is_empty(), "kafka.properties has no defaults");
            keys.insert(prefix.to_owned(), "{}".to_owned());
        }
        toml::Value::Table(table) => {
            for (name, inner) in table {
                let key = if prefix.is_empty() {
                    name.clone()
                } else {
                    format!("{prefix}.{name}")
                };
                flatten(&key, inner, keys);
            }
        }
        toml::Value::String(text) => {
            keys.insert(prefix.to_owned(), text.clone());
        }
        other => {
            keys.insert(prefix.to_owned(), other.to_string());
        }
    }
}

/// The rows of the page's "Keys" section: `| `key` | `ENV` | `default` | meaning |`.
fn documented() -> BTreeMap<String, (String, String)> {
    let keys = PAGE
        .split_once("\n## Keys\n")
        .expect("the page has a \"## Keys\" section")
        .1;
    let keys = keys.split("\n## ").next().unwrap_or(keys);
    keys.lines()
        .filter(|line| line.starts_with("| `"))
        .map(|line| {
            let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
            assert!(
                cells.len() >= 4,
                "a row needs key, variable, default, meaning: {line}"
            );
            let unquote = |cell: &str| cell.trim_matches('`').to_owned();
            (unquote(cells[0]), (unquote(cells[1]), unquote(cells[2])))
        })
        .collect()
}

fn variable(key: &str) -> String {
    let upper = key.to_uppercase().replace('.', "__");
    if key == "kafka.properties" {
        format!("QUIRE_{upper}__<PROPERTY>")
    } else {
        format!("QUIRE_{upper}")
    }
}

#[test]
fn every_key_is_documented_with_its_default_and_variable() {
    let page = documented();
    let mut problems = Vec::new();
    for (key, default) in defaults() {
        match page.get(&key) {
            None => problems.push(format!("{key} is not in docs/configuration.md")),
            Some((documented_variable, documented_default)) => {
                if *documented_variable != variable(&key) {
                    problems.push(format!(
                        "{key}: the page says {documented_variable}, the variable is {}",
                        variable(&key)
                    ));
                }
                if *documented_default != default {
                    problems.push(format!(
                        "{key}: the page says the default is {documented_default:?}, defaults.toml says {default:?}"
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_page_documents_no_unknown_key() {
    let known = defaults();
    let unknown: Vec<String> = documented()
        .into_keys()
        .filter(|key| !known.contains_key(key))
        .collect();
    assert!(unknown.is_empty(), "documented but unknown: {unknown:?}");
}
