//! Saved chats: one conversation JSON file per chat in the data directory, written atomically
//! (temporary file, then rename) every time a turn is sent or completes, so a crash or a killed
//! terminal loses nothing already sent or received. The files are the chat module's conversation
//! JSON, so `ossterm run --conversation FILE` continues a chat the app saved.

use crate::chat::{Conversation, ConversationError, Role};
use crate::tui::chat_file::ChatSnapshot;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StoreError {
    #[error("cannot create chat directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write chat file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read chat file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Parse(#[from] ConversationError),
    #[error("cannot list chat directory {path}: {source}")]
    List {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One entry of the open-chat list.
#[derive(Clone, Debug, PartialEq)]
pub struct SavedChat {
    pub path: PathBuf,
    /// The first user message, shortened.
    pub title: String,
    pub modified: SystemTime,
    pub messages: usize,
}

/// File work the app's update asks the loop for; [`ChatStore::perform`] carries it out.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreRequest {
    /// Write the chat file. `manual`: the user asked (Ctrl-S), so success is reported too.
    Save {
        path: PathBuf,
        chat: Box<ChatSnapshot>,
        manual: bool,
    },
    /// List the saved chats.
    List,
    /// Read a saved chat.
    Open(PathBuf),
}

/// How a [`StoreRequest`] went, errors as the text to show.
#[derive(Clone, Debug, PartialEq)]
pub enum StoreOutcome {
    Saved {
        path: PathBuf,
        manual: bool,
        result: Result<(), String>,
    },
    /// The chats, newest first, and how many files could not be read.
    Listed(Result<(Vec<SavedChat>, usize), String>),
    Opened {
        path: PathBuf,
        result: Result<Box<Conversation>, String>,
    },
}

/// The directory of saved chats.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatStore {
    dir: PathBuf,
}

impl ChatStore {
    pub fn new(dir: PathBuf) -> ChatStore {
        ChatStore { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A fresh file name for a chat started at `now` (`chat-YYYYMMDD-HHMMSS.json`, with a suffix if
    /// that name is taken).
    pub fn new_chat_path(&self, now: SystemTime) -> PathBuf {
        let stamp = timestamp_utc(now);
        let mut path = self.dir.join(format!("chat-{stamp}.json"));
        let mut suffix = 2;
        while path.exists() {
            path = self.dir.join(format!("chat-{stamp}-{suffix}.json"));
            suffix += 1;
        }
        path
    }

    /// Writes `conversation` to `path` atomically: a reader, a crash or a power loss sees the old
    /// file or the new one, never half of one. The temporary file is flushed to disk before it
    /// replaces the old one, and the directory after, so the rename itself survives a power loss;
    /// when anything fails the temporary file is removed.
    pub fn save(&self, path: &Path, conversation: &Conversation) -> Result<(), StoreError> {
        std::fs::create_dir_all(&self.dir).map_err(|source| StoreError::CreateDir {
            path: self.dir.clone(),
            source,
        })?;
        let json = conversation.to_json() + "\n";
        let temporary = path.with_extension("json.tmp");
        let written =
            write_synced(&temporary, json.as_bytes()).map_err(|source| StoreError::Write {
                path: temporary.clone(),
                source,
            });
        let renamed = written.and_then(|()| {
            std::fs::rename(&temporary, path).map_err(|source| StoreError::Write {
                path: path.to_path_buf(),
                source,
            })
        });
        if let Err(error) = renamed {
            let _ = std::fs::remove_file(&temporary);
            return Err(error);
        }
        let directory = path.parent().unwrap_or(&self.dir);
        sync_directory(directory).map_err(|source| StoreError::Write {
            path: directory.to_path_buf(),
            source,
        })
    }

    /// Carries out `request`.
    pub fn perform(&self, request: StoreRequest) -> StoreOutcome {
        match request {
            StoreRequest::Save { path, chat, manual } => {
                let result = self
                    .save(&path, &chat.conversation())
                    .map_err(|error| error.to_string());
                StoreOutcome::Saved {
                    path,
                    manual,
                    result,
                }
            }
            StoreRequest::List => {
                StoreOutcome::Listed(self.list().map_err(|error| error.to_string()))
            }
            StoreRequest::Open(path) => {
                let result = self
                    .load(&path)
                    .map(Box::new)
                    .map_err(|error| error.to_string());
                StoreOutcome::Opened { path, result }
            }
        }
    }

    pub fn load(&self, path: &Path) -> Result<Conversation, StoreError> {
        let text = std::fs::read_to_string(path).map_err(|source| StoreError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Conversation::from_json(&text, path)?)
    }

    /// Saved chats, newest first. A missing directory is an empty list; unreadable files are skipped
    /// (they are listed in the error count the caller may show).
    pub fn list(&self) -> Result<(Vec<SavedChat>, usize), StoreError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok((Vec::new(), 0))
            }
            Err(source) => {
                return Err(StoreError::List {
                    path: self.dir.clone(),
                    source,
                })
            }
        };
        let mut chats = Vec::new();
        let mut unreadable = 0;
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().and_then(|extension| extension.to_str()) != Some("json") {
                continue;
            }
            let modified = entry
                .metadata()
                .and_then(|metadata| metadata.modified())
                .unwrap_or(UNIX_EPOCH);
            match self.load(&path) {
                Ok(conversation) => chats.push(SavedChat {
                    title: chat_title(&conversation),
                    messages: conversation.messages.len(),
                    path,
                    modified,
                }),
                Err(_) => unreadable += 1,
            }
        }
        chats.sort_by(|left, right| {
            right
                .modified
                .cmp(&left.modified)
                .then_with(|| right.path.cmp(&left.path))
        });
        Ok((chats, unreadable))
    }
}

/// Writes `bytes` to a new file at `path` and flushes it to the disk.
fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::File::create(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

/// Flushes a directory's entries (a rename in it) to the disk. Windows cannot open a directory
/// as a file; there the rename is as durable as the file system makes it.
fn sync_directory(directory: &Path) -> std::io::Result<()> {
    if cfg!(unix) {
        std::fs::File::open(directory)?.sync_all()
    } else {
        Ok(())
    }
}

/// The first user message on one line, at most 60 characters.
pub fn chat_title(conversation: &Conversation) -> String {
    let first = conversation
        .messages
        .iter()
        .find(|message| message.role == Role::User);
    let text = first.map_or("(empty chat)", |message| message.content.as_str());
    let one_line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.chars().count() > 60 {
        format!("{}…", one_line.chars().take(59).collect::<String>())
    } else {
        one_line
    }
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (H. Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn seconds_since_epoch(time: SystemTime) -> i64 {
    match time.duration_since(UNIX_EPOCH) {
        Ok(elapsed) => elapsed.as_secs() as i64,
        Err(before) => -(before.duration().as_secs() as i64),
    }
}

/// `YYYY-MM-DD` (UTC), the harmony system message's date format.
pub fn date_utc(time: SystemTime) -> String {
    let (year, month, day) = civil_from_days(seconds_since_epoch(time).div_euclid(86_400));
    format!("{year:04}-{month:02}-{day:02}")
}

/// `YYYYMMDD-HHMMSS` (UTC), for file names.
pub fn timestamp_utc(time: SystemTime) -> String {
    let seconds = seconds_since_epoch(time);
    let (year, month, day) = civil_from_days(seconds.div_euclid(86_400));
    let of_day = seconds.rem_euclid(86_400);
    format!(
        "{year:04}{month:02}{day:02}-{:02}{:02}{:02}",
        of_day / 3600,
        of_day / 60 % 60,
        of_day % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates_match_known_days() {
        assert_eq!(date_utc(UNIX_EPOCH), "1970-01-01");
        // 2025-08-05 00:00:00 UTC = 1754352000
        assert_eq!(
            date_utc(UNIX_EPOCH + Duration::from_secs(1_754_352_000)),
            "2025-08-05"
        );
        assert_eq!(
            timestamp_utc(UNIX_EPOCH + Duration::from_secs(951_782_400 + 3723)),
            "20000229-010203"
        );
    }
}
