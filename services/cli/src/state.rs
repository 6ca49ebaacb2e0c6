//! How far a `quire send` got: a small JSON file rewritten after every
//! array the API accepted, read back by `--resume`.
//!
//! A rewrite must survive a crash and a power loss at any instant, leaving
//! either the previous state or the new one, whole. So the new text goes to
//! `FILE.tmp`, which is flushed to the disk (`fsync`) before it is renamed
//! over `FILE`, and the directory is flushed after the rename, so the rename
//! itself is on the disk. Without the first flush a file system may put the
//! rename on the disk before the data, and a power loss then leaves an
//! empty or partial `FILE` in place of the good old one; without the second,
//! the old `FILE` may come back. A `FILE.tmp` left by a crash is never read:
//! the next save truncates it and [`SendProgress::remove`] deletes it.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::records::Format;

/// The state file's format version; a file with another is refused.
const STATE_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendProgress {
    pub v: u32,
    pub stream: String,
    /// The input as given on the command line (`-` for stdin).
    pub file: String,
    pub format: Format,
    /// Records the API accepted, counted from the start of the file.
    pub records: u64,
    /// Offset of the first byte not yet sent (just past the last accepted record).
    pub offset: u64,
    /// The input's size when it was first sent, if it is a regular file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_size: Option<u64>,
    /// The last accepted record's id, as the API wrote it
    /// (`partition-offset-index`; `partition-offset` from APIs before batch
    /// messages). Shown to people, never parsed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_id: Option<String>,
    /// Names this send (all its runs): each array's `Idempotency-Key` is
    /// `{run_id}-{index of its first record}`, so a resumed send that sends
    /// again an array the API accepted but this file missed (a hard kill
    /// between the two) gets the first answer instead of a second copy.
    /// Empty in files of older releases (their arrays get new keys).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub run_id: String,
    /// How the input was cut into arrays; a resume cuts it the same way, so
    /// an array sent again has the same body under the same key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_request_bytes: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("reading the progress file {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    #[error("the progress file {path} is not one quire wrote: {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error(
        "the progress file {path} has version {found}, this quire reads version {STATE_VERSION}"
    )]
    Version { path: PathBuf, found: u32 },
    #[error("writing the progress file {path}: {source}")]
    Write { path: PathBuf, source: io::Error },
}

impl SendProgress {
    pub fn new(stream: &str, file: &str, format: Format, file_size: Option<u64>) -> Self {
        Self {
            v: STATE_VERSION,
            stream: stream.to_owned(),
            file: file.to_owned(),
            format,
            records: 0,
            offset: 0,
            file_size,
            last_id: None,
            run_id: uuid::Uuid::new_v4().simple().to_string(),
            array_size: None,
            max_request_bytes: None,
        }
    }

    /// The `Idempotency-Key` of the array whose first record is record
    /// `first_record` of the input (counting from 0).
    pub fn idempotency_key(&self, first_record: u64) -> String {
        format!("quire-send-{}-{first_record}", self.run_id)
    }

    /// The state file's default place: beside the input, `FILE.quire-progress`.
    /// Stdin has none (pass `--state`).
    pub fn default_path(file: &str) -> Option<PathBuf> {
        if file == "-" {
            return None;
        }
        let mut name = PathBuf::from(file).into_os_string();
        name.push(".quire-progress");
        Some(PathBuf::from(name))
    }

    /// Reads the state file; `Ok(None)` when there is none.
    pub fn load(path: &Path) -> Result<Option<Self>, StateError> {
        let text = match fs::read(path) {
            Ok(text) => text,
            Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(StateError::Read {
                    path: path.to_owned(),
                    source,
                });
            }
        };
        let progress: Self = serde_json::from_slice(&text).map_err(|source| StateError::Parse {
            path: path.to_owned(),
            source,
        })?;
        if progress.v != STATE_VERSION {
            return Err(StateError::Version {
                path: path.to_owned(),
                found: progress.v,
            });
        }
        Ok(Some(progress))
    }

    /// Writes the state file through a temporary file, flushed to the disk,
    /// and a rename (see the module's documentation), so a crash or a power
    /// loss mid-write leaves the previous state or this one, never half a
    /// file.
    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        let write_error = |source| StateError::Write {
            path: path.to_owned(),
            source,
        };
        let mut text = serde_json::to_vec_pretty(self)
            .map_err(io::Error::other)
            .map_err(write_error)?;
        text.push(b'\n');
        let temporary = temporary_path(path);
        write_durably(&temporary, &text).map_err(write_error)?;
        fs::rename(&temporary, path).map_err(write_error)?;
        sync_directory_of(path).map_err(write_error)
    }

    /// Removes the state file once everything was sent, and a temporary
    /// file a crash may have left beside it.
    pub fn remove(path: &Path) -> Result<(), StateError> {
        for file in [temporary_path(path), path.to_owned()] {
            match fs::remove_file(&file) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::NotFound => {}
                Err(source) => return Err(StateError::Write { path: file, source }),
            }
        }
        Ok(())
    }
}

/// Where a new state is written before it replaces `path`: `FILE.tmp`.
fn temporary_path(path: &Path) -> PathBuf {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    PathBuf::from(temporary)
}

/// Writes `text` to `path` (created or truncated) and flushes it to the
/// disk before returning.
fn write_durably(path: &Path, text: &[u8]) -> io::Result<()> {
    let mut file = fs::File::create(path)?;
    file.write_all(text)?;
    file.sync_all()
}

/// Flushes the directory holding `path` to the disk, so a rename into it is
/// there after a power loss. Directories can be opened and flushed on Unix;
/// elsewhere the rename is what the platform offers.
fn sync_directory_of(path: &Path) -> io::Result<()> {
    if cfg!(unix) {
        let directory = match path.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        fs::File::open(directory)?.sync_all()
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch_path() -> PathBuf {
        std::env::temp_dir().join(format!("quire-cli-state-{}.json", uuid::Uuid::new_v4()))
    }

    #[test]
    fn progress_round_trips_through_the_file() {
        let path = scratch_path();
        assert_eq!(SendProgress::load(&path).unwrap(), None);

        let mut progress = SendProgress::new("orders", "orders.json", Format::Array, Some(1234));
        progress.records = 1000;
        progress.offset = 567;
        progress.last_id = Some("3-999-7".to_owned());
        progress.save(&path).unwrap();
        assert_eq!(SendProgress::load(&path).unwrap(), Some(progress.clone()));

        progress.records = 2000;
        progress.save(&path).unwrap();
        assert_eq!(SendProgress::load(&path).unwrap().unwrap().records, 2000);

        SendProgress::remove(&path).unwrap();
        assert_eq!(SendProgress::load(&path).unwrap(), None);
        SendProgress::remove(&path).unwrap();
    }

    #[test]
    fn a_save_leaves_the_whole_file_and_no_temporary_one() {
        let path = scratch_path();
        let mut progress = SendProgress::new("orders", "orders.json", Format::Array, None);
        for records in [1, 20, 300, 4000] {
            progress.records = records;
            progress.last_id = Some(format!("3-{records}-0"));
            progress.save(&path).unwrap();
            let text = fs::read(&path).unwrap();
            assert!(text.ends_with(b"}\n"), "the file ends where its JSON does");
            let loaded: SendProgress = serde_json::from_slice(&text).unwrap();
            assert_eq!(loaded, progress);
            assert!(
                !temporary_path(&path).exists(),
                "the temporary file was renamed"
            );
        }
        SendProgress::remove(&path).unwrap();
    }

    #[test]
    fn a_temporary_file_left_by_a_crash_is_ignored_replaced_and_removed() {
        let path = scratch_path();
        let temporary = temporary_path(&path);
        let mut progress = SendProgress::new("orders", "orders.json", Format::Ndjson, None);
        progress.records = 10;
        progress.save(&path).unwrap();
        // A crash after the temporary file was created, before its rename:
        // half a JSON text, longer than the next one.
        fs::write(
            &temporary,
            format!("{{\"v\":1,\"stream\":\"{}", "x".repeat(4096)),
        )
        .unwrap();
        assert_eq!(
            SendProgress::load(&path).unwrap().unwrap().records,
            10,
            "the leftover is not read"
        );
        progress.records = 20;
        progress.save(&path).unwrap();
        assert_eq!(SendProgress::load(&path).unwrap(), Some(progress));
        assert!(!temporary.exists());

        fs::write(&temporary, "{").unwrap();
        SendProgress::remove(&path).unwrap();
        assert!(!path.exists());
        assert!(!temporary.exists(), "the leftover went with the state file");
    }

    #[test]
    fn the_directory_of_a_bare_file_name_is_the_current_one() {
        // `--state progress.json`: its directory is ".", flushed like any.
        sync_directory_of(Path::new("progress.json")).unwrap();
        sync_directory_of(&std::env::temp_dir().join("progress.json")).unwrap();
        assert!(sync_directory_of(Path::new("/no/such/directory/progress.json")).is_err());
    }

    #[test]
    fn a_foreign_file_or_version_is_refused() {
        let path = scratch_path();
        fs::write(&path, "not json").unwrap();
        assert!(matches!(
            SendProgress::load(&path),
            Err(StateError::Parse { .. })
        ));

        let mut progress = SendProgress::new("s", "f", Format::Ndjson, None);
        progress.v = 99;
        fs::write(&path, serde_json::to_vec(&progress).unwrap()).unwrap();
        assert!(matches!(
            SendProgress::load(&path),
            Err(StateError::Version { found: 99, .. })
        ));
        fs::remove_file(&path).unwrap();
    }

    #[test]
    fn keys_are_the_run_and_the_first_record_and_survive_the_file() {
        let path = scratch_path();
        let progress = SendProgress::new("orders", "orders.json", Format::Ndjson, None);
        assert_eq!(progress.run_id.len(), 32);
        let key = progress.idempotency_key(2000);
        assert_eq!(key, format!("quire-send-{}-2000", progress.run_id));
        assert!(key.len() <= 255 && key.bytes().all(|byte| byte.is_ascii_graphic()));
        assert_ne!(key, progress.idempotency_key(3000));
        let other_run = SendProgress::new("orders", "orders.json", Format::Ndjson, None);
        assert_ne!(key, other_run.idempotency_key(2000));

        progress.save(&path).unwrap();
        let loaded = SendProgress::load(&path).unwrap().unwrap();
        assert_eq!(loaded.idempotency_key(2000), key);
        SendProgress::remove(&path).unwrap();
    }

    #[test]
    fn files_without_a_run_id_still_load() {
        let path = scratch_path();
        fs::write(
            &path,
            r#"{"v":1,"stream":"s","file":"f","format":"ndjson","records":5,"offset":40}"#,
        )
        .unwrap();
        let loaded = SendProgress::load(&path).unwrap().unwrap();
        assert_eq!(loaded.records, 5);
        assert!(loaded.run_id.is_empty());
        fs::remove_file(&path).unwrap();
    }

    #[test]
    fn the_default_path_sits_beside_the_input() {
        assert_eq!(
            SendProgress::default_path("data/orders.ndjson"),
            Some(PathBuf::from("data/orders.ndjson.quire-progress"))
        );
        assert_eq!(SendProgress::default_path("-"), None);
    }
}
