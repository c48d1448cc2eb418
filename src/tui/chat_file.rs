//! The file the current chat is saved to, and what it holds beyond the turns.

use crate::engine::protocol::{
    Channel, ChatMessage, Conversation, GenerateRequest, ReasoningEffort, RequestId, RequestKind,
    SystemSettings,
};
use crate::tui::store::{date_utc, ChatStore};
use crate::tui::transcript::Turn;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// Harmony's default knowledge cutoff line.
pub const KNOWLEDGE_CUTOFF: &str = crate::chat::conversation::DEFAULT_KNOWLEDGE_CUTOFF;

/// How often the chat file is rewritten while a reply streams.
pub const STREAM_SAVE_INTERVAL: Duration = Duration::from_secs(2);

/// The parts of a chat file the app shows no setting for, kept so a loaded chat is written back
/// with them.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatFileExtras {
    pub knowledge_cutoff: Option<String>,
    pub system: serde_json::Map<String, serde_json::Value>,
    pub conversation: serde_json::Map<String, serde_json::Value>,
}

impl Default for ChatFileExtras {
    fn default() -> Self {
        ChatFileExtras {
            knowledge_cutoff: Some(KNOWLEDGE_CUTOFF.to_string()),
            system: serde_json::Map::new(),
            conversation: serde_json::Map::new(),
        }
    }
}

#[derive(Debug)]
pub struct ChatFile {
    pub store: ChatStore,
    /// `None` until the chat is first saved.
    pub path: Option<PathBuf>,
    /// The date in this chat's system message; fixed so the prompt prefix (and its cache) stays
    /// valid. `None` (a loaded chat without one) leaves the line out, as harmony does.
    pub date: Option<String>,
    /// What a loaded chat file holds beyond the settings the app edits (its knowledge cutoff,
    /// fields of other tools), written back unchanged.
    pub extras: ChatFileExtras,
    pub last_stream_save: Option<Instant>,
}

impl ChatFile {
    pub fn new(store: ChatStore) -> ChatFile {
        ChatFile {
            store,
            path: None,
            date: Some(date_utc(SystemTime::now())),
            extras: ChatFileExtras::default(),
            last_stream_save: None,
        }
    }

    /// A fresh chat: no file yet, today's date, harmony's defaults.
    pub fn reset(&mut self) {
        *self = ChatFile::new(self.store.clone());
    }

    /// The file to write, naming a new one the first time.
    pub fn path_for_saving(&mut self) -> PathBuf {
        self.path
            .get_or_insert_with(|| self.store.new_chat_path(SystemTime::now()))
            .clone()
    }
}

/// The chat at one moment, cheap to take (the turns are shared) and turned into the chat file's
/// conversation by whoever needs it off the UI thread: the file thread, or the thread that sends
/// requests to the engine. A chat of tens of megabytes then costs the UI a pointer per turn.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatSnapshot {
    pub turns: Vec<Arc<Turn>>,
    pub system_prompt: String,
    pub reasoning_effort: ReasoningEffort,
    pub developer_instructions: String,
    pub date: Option<String>,
    pub extras: ChatFileExtras,
}

impl ChatSnapshot {
    /// The conversation in the chat file's shape. Replies still streaming are included as far as
    /// they got, so a crash mid-reply keeps what was received.
    pub fn conversation(&self) -> Conversation {
        let mut messages = Vec::new();
        for turn in &self.turns {
            messages.push(ChatMessage::user(turn.user.clone()));
            if let Some(reply) = &turn.reply {
                if !reply.reasoning.is_empty() {
                    messages.push(ChatMessage::assistant(
                        Channel::Analysis,
                        reply.reasoning.clone(),
                    ));
                }
                if !reply.answer.is_empty() {
                    messages.push(ChatMessage::assistant(Channel::Final, reply.answer.clone()));
                }
            }
        }
        let extras = &self.extras;
        let identity = &self.system_prompt;
        Conversation {
            system: SystemSettings {
                // An empty identity leaves harmony's identity line out rather than writing it blank.
                identity: (!identity.trim().is_empty()).then(|| identity.clone()),
                reasoning: Some(self.reasoning_effort),
                date: self.date.clone(),
                knowledge_cutoff: extras.knowledge_cutoff.clone(),
                extra: extras.system.clone(),
            },
            developer: (!self.developer_instructions.trim().is_empty())
                .then(|| self.developer_instructions.clone()),
            messages,
            extra: extras.conversation.clone(),
        }
    }

    /// The conversation a request answering the last turn carries: every turn before it in full,
    /// and the last one's user message only.
    pub fn request_conversation(&self) -> Conversation {
        let mut conversation = self.conversation();
        if let Some(reply) = self.turns.last().and_then(|last| last.reply.as_ref()) {
            let reply_messages =
                usize::from(!reply.reasoning.is_empty()) + usize::from(!reply.answer.is_empty());
            conversation
                .messages
                .truncate(conversation.messages.len() - reply_messages);
        }
        conversation
    }
}

/// A generation request before its conversation is built (off the UI thread).
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateJob {
    pub id: RequestId,
    pub kind: RequestKind,
    pub chat: Box<ChatSnapshot>,
}

impl GenerateJob {
    pub fn request(&self) -> GenerateRequest {
        GenerateRequest {
            id: self.id,
            kind: self.kind,
            conversation: self.chat.request_conversation(),
        }
    }
}
