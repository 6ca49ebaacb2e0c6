//! Results for people (text) or scripts (`--json`, one document per line), on stdout.

use serde_json::Value;

#[derive(Debug, Clone, Copy)]
pub struct Output {
    json: bool,
}

impl Output {
    pub fn new(json: bool) -> Self {
        Self { json }
    }

    pub fn is_json(self) -> bool {
        self.json
    }

    /// Prints `document` with `--json`, the text `human` builds otherwise.
    pub fn result(self, document: &Value, human: impl FnOnce() -> String) {
        if self.json {
            println!("{document}");
        } else {
            println!("{}", human());
        }
    }
}
