//! Conversations and their JSON file format, shared by the CLI and the TUI's saved chats:
//!
//! ```json
//! {"system": {"identity": "...", "reasoning": "low|medium|high", "date": "YYYY-MM-DD",
//!             "knowledge_cutoff": "..."},
//!  "developer": "...",
//!  "messages": [{"role": "user|assistant", "channel": "analysis|final", "content": "..."}]}
//! ```
//!
//! A missing system field takes harmony's default (identity "You are ChatGPT, ...", knowledge
//! cutoff 2024-06, reasoning medium, no current date). An explicit `null` leaves that line out,
//! as harmony does for a field set to `None`. Unknown fields are kept and written back, so the
//! TUI may store more than the renderer needs.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize};

/// Harmony's default model identity.
pub const DEFAULT_IDENTITY: &str = "You are ChatGPT, a large language model trained by OpenAI.";
/// Harmony's default knowledge cutoff.
pub const DEFAULT_KNOWLEDGE_CUTOFF: &str = "2024-06";

#[derive(Debug, thiserror::Error)]
pub enum ConversationError {
    #[error("cannot read conversation file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("conversation file {path} is not a valid conversation (expected {{\"system\": {{...}}, \"developer\": str?, \"messages\": [{{\"role\": \"user|assistant\", \"channel\": \"analysis|commentary|final\"?, \"content\": str}}]}}): {source}")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("cannot write conversation file {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// How much the model should think before answering (`Reasoning: ...` in the system message).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReasoningEffort {
    Low,
    #[default]
    Medium,
    High,
}

impl ReasoningEffort {
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }
}

impl std::str::FromStr for ReasoningEffort {
    type Err = String;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "low" => Ok(ReasoningEffort::Low),
            "medium" => Ok(ReasoningEffort::Medium),
            "high" => Ok(ReasoningEffort::High),
            other => Err(format!(
                "reasoning effort {other:?} is not one of low, medium, high"
            )),
        }
    }
}

/// Who wrote a message of the conversation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// Harmony's channels: `analysis` is the chain of thought, `final` the answer shown to the user,
/// `commentary` tool calls and preambles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Channel {
    Analysis,
    Commentary,
    Final,
}

impl Channel {
    pub fn as_str(self) -> &'static str {
        match self {
            Channel::Analysis => "analysis",
            Channel::Commentary => "commentary",
            Channel::Final => "final",
        }
    }

    pub fn from_name(name: &str) -> Option<Channel> {
        match name {
            "analysis" => Some(Channel::Analysis),
            "commentary" => Some(Channel::Commentary),
            "final" => Some(Channel::Final),
            _ => None,
        }
    }
}

/// The system message's settings. `None` means the line is left out of the system message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SystemSettings {
    #[serde(default = "default_identity", deserialize_with = "null_as_none")]
    pub identity: Option<String>,
    #[serde(default = "default_reasoning", deserialize_with = "null_as_none")]
    pub reasoning: Option<ReasoningEffort>,
    #[serde(default, deserialize_with = "null_as_none")]
    pub date: Option<String>,
    #[serde(
        default = "default_knowledge_cutoff",
        deserialize_with = "null_as_none"
    )]
    pub knowledge_cutoff: Option<String>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

fn default_identity() -> Option<String> {
    Some(DEFAULT_IDENTITY.to_owned())
}

fn default_reasoning() -> Option<ReasoningEffort> {
    Some(ReasoningEffort::default())
}

fn default_knowledge_cutoff() -> Option<String> {
    Some(DEFAULT_KNOWLEDGE_CUTOFF.to_owned())
}

/// A present field that is `null` becomes `None`; a missing one takes the field's default.
fn null_as_none<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(deserializer)
}

impl Default for SystemSettings {
    fn default() -> Self {
        SystemSettings {
            identity: default_identity(),
            reasoning: default_reasoning(),
            date: None,
            knowledge_cutoff: default_knowledge_cutoff(),
            extra: serde_json::Map::new(),
        }
    }
}

/// One message of the conversation as the user sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub channel: Option<Channel>,
    pub content: String,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: Role::User,
            channel: None,
            content: content.into(),
            extra: serde_json::Map::new(),
        }
    }

    pub fn assistant(channel: Channel, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: Role::Assistant,
            channel: Some(channel),
            content: content.into(),
            extra: serde_json::Map::new(),
        }
    }
}

/// A whole chat: system settings, optional developer instructions, and the messages so far.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Conversation {
    #[serde(default)]
    pub system: SystemSettings,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub developer: Option<String>,
    #[serde(default)]
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Conversation {
    /// Parses the JSON format; `origin` names the source in error messages.
    pub fn from_json(json: &str, origin: &Path) -> Result<Conversation, ConversationError> {
        // A UTF-8 byte order mark is not JSON, but some editors start every file with one.
        let json = json.strip_prefix('\u{feff}').unwrap_or(json);
        serde_json::from_str(json).map_err(|source| ConversationError::Parse {
            path: origin.to_owned(),
            source,
        })
    }

    pub fn load(path: &Path) -> Result<Conversation, ConversationError> {
        let json = std::fs::read_to_string(path).map_err(|source| ConversationError::Read {
            path: path.to_owned(),
            source,
        })?;
        Conversation::from_json(&json, path)
    }

    pub fn to_json(&self) -> String {
        // Serializing plain strings, enums and JSON values into a String cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    pub fn save(&self, path: &Path) -> Result<(), ConversationError> {
        std::fs::write(path, self.to_json() + "\n").map_err(|source| ConversationError::Write {
            path: path.to_owned(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_fields_take_harmony_defaults_and_null_removes_them() {
        let path = Path::new("test.json");
        let conversation = Conversation::from_json(r#"{"messages": []}"#, path).unwrap();
        assert_eq!(conversation.system, SystemSettings::default());
        let conversation = Conversation::from_json(
            r#"{"system": {"identity": null, "knowledge_cutoff": null, "reasoning": "high",
                "date": "2025-01-02", "theme": "dark"}, "messages": [
                {"role": "user", "content": "hi", "sent_at": 5}]}"#,
            path,
        )
        .unwrap();
        assert_eq!(conversation.system.identity, None);
        assert_eq!(conversation.system.knowledge_cutoff, None);
        assert_eq!(conversation.system.reasoning, Some(ReasoningEffort::High));
        assert_eq!(conversation.system.date.as_deref(), Some("2025-01-02"));
        assert_eq!(conversation.system.extra["theme"], "dark");
        assert_eq!(conversation.messages[0].extra["sent_at"], 5);
        let again = Conversation::from_json(&conversation.to_json(), path).unwrap();
        assert_eq!(again, conversation);
    }

    // Found by fuzzing (fuzz targets `conversation_file`, `conversation_roundtrip`): without
    // serde_json's exact float parsing a number in an extra field came back one unit in the last
    // place off after a save and a load.
    #[test]
    fn numbers_in_extra_fields_survive_save_and_load_exactly() {
        let path = Path::new("chat.json");
        let text = r#"{"messages": [], "x": [1.8446744073702038e+25, 2.8477033034374123e-197]}"#;
        let conversation = Conversation::from_json(text, path).unwrap();
        assert_eq!(
            conversation.extra["x"][0].as_f64(),
            Some(1.8446744073702038e25)
        );
        assert_eq!(
            conversation.extra["x"][1].as_f64(),
            Some(2.8477033034374123e-197)
        );
        let again = Conversation::from_json(&conversation.to_json(), path).unwrap();
        assert_eq!(again, conversation);
    }

    #[test]
    fn bad_values_name_the_file_and_the_problem() {
        let error = Conversation::from_json(
            r#"{"system": {"reasoning": "extreme"}, "messages": []}"#,
            Path::new("chat.json"),
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("chat.json"), "{error}");
        assert!(error.contains("extreme"), "{error}");
        let error = Conversation::from_json(
            r#"{"messages": [{"role": "tool", "content": "x"}]}"#,
            Path::new("chat.json"),
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("tool"), "{error}");
    }
}
