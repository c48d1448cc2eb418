//! Structured conversations built with `arbitrary` (any text in every field, any mix of roles and
//! channels, extra fields of any JSON type): saving then loading gives the same conversation, and
//! rendering its history then parsing it with the streaming parser gives its messages back.
#![no_main]

use std::path::Path;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use ossterm::chat::{Channel, ChatMessage, Conversation, ReasoningEffort, Role, SystemSettings};
use ossterm_fuzz::{check_harmony_round_trip, tokenizer, LimitingAllocator};
use serde_json::{Map, Value};

/// The tokenizer's tables plus a few copies of an input of at most 64 KiB.
#[global_allocator]
static ALLOC: LimitingAllocator = LimitingAllocator::with_limit_mib(256);

#[derive(Arbitrary, Debug)]
struct FuzzConversation {
    identity: Option<String>,
    reasoning: Option<FuzzEffort>,
    date: Option<String>,
    knowledge_cutoff: Option<String>,
    system_extra: Vec<(String, FuzzValue)>,
    developer: Option<String>,
    messages: Vec<FuzzMessage>,
    extra: Vec<(String, FuzzValue)>,
}

#[derive(Arbitrary, Debug)]
struct FuzzMessage {
    assistant: bool,
    channel: Option<FuzzChannel>,
    content: String,
    extra: Vec<(String, FuzzValue)>,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum FuzzEffort {
    Low,
    Medium,
    High,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum FuzzChannel {
    Analysis,
    Commentary,
    Final,
}

#[derive(Arbitrary, Debug)]
enum FuzzLeaf {
    Null,
    Bool(bool),
    Int(i64),
    Unsigned(u64),
    Float(f64),
    Text(String),
}

/// Extra fields the TUI may store: leaves, or one level of list or object.
#[derive(Arbitrary, Debug)]
enum FuzzValue {
    Leaf(FuzzLeaf),
    List(Vec<FuzzLeaf>),
    Object(Vec<(String, FuzzLeaf)>),
}

impl FuzzLeaf {
    fn to_json(&self) -> Value {
        match self {
            FuzzLeaf::Null => Value::Null,
            FuzzLeaf::Bool(b) => Value::Bool(*b),
            FuzzLeaf::Int(i) => Value::from(*i),
            FuzzLeaf::Unsigned(u) => Value::from(*u),
            // JSON has no NaN or infinity: serde_json makes them null, which is what a reload sees.
            FuzzLeaf::Float(f) => {
                serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number)
            }
            FuzzLeaf::Text(text) => Value::String(text.clone()),
        }
    }
}

impl FuzzValue {
    fn to_json(&self) -> Value {
        match self {
            FuzzValue::Leaf(leaf) => leaf.to_json(),
            FuzzValue::List(items) => Value::Array(items.iter().map(FuzzLeaf::to_json).collect()),
            FuzzValue::Object(fields) => Value::Object(
                fields
                    .iter()
                    .map(|(key, leaf)| (key.clone(), leaf.to_json()))
                    .collect(),
            ),
        }
    }
}

/// Extra fields under names the format does not use itself (a loaded file never has others: the
/// known names are taken by the fields).
fn extras(fields: &[(String, FuzzValue)], reserved: &[&str]) -> Map<String, Value> {
    fields
        .iter()
        .filter(|(key, _)| !reserved.contains(&key.as_str()))
        .map(|(key, value)| (key.clone(), value.to_json()))
        .collect()
}

impl FuzzConversation {
    fn build(&self) -> Conversation {
        Conversation {
            system: SystemSettings {
                identity: self.identity.clone(),
                reasoning: self.reasoning.map(|effort| match effort {
                    FuzzEffort::Low => ReasoningEffort::Low,
                    FuzzEffort::Medium => ReasoningEffort::Medium,
                    FuzzEffort::High => ReasoningEffort::High,
                }),
                date: self.date.clone(),
                knowledge_cutoff: self.knowledge_cutoff.clone(),
                extra: extras(
                    &self.system_extra,
                    &["identity", "reasoning", "date", "knowledge_cutoff"],
                ),
            },
            developer: self.developer.clone(),
            messages: self
                .messages
                .iter()
                .map(|message| ChatMessage {
                    role: if message.assistant {
                        Role::Assistant
                    } else {
                        Role::User
                    },
                    channel: message.channel.map(|channel| match channel {
                        FuzzChannel::Analysis => Channel::Analysis,
                        FuzzChannel::Commentary => Channel::Commentary,
                        FuzzChannel::Final => Channel::Final,
                    }),
                    content: message.content.clone(),
                    extra: extras(&message.extra, &["role", "channel", "content"]),
                })
                .collect(),
            extra: extras(&self.extra, &["system", "developer", "messages"]),
        }
    }
}

// The tokenizer is built before fuzzing starts: its half second (more on a busy machine) must
// not count against the first input's timeout.
fuzz_target!(init: { tokenizer(); }, |input: FuzzConversation| {
    let conversation = input.build();
    let path = Path::new("chat.json");
    let saved = conversation.to_json();
    let reloaded = Conversation::from_json(&saved, path)
        .unwrap_or_else(|error| panic!("a saved conversation does not load: {error}\n{saved}"));
    assert_eq!(
        reloaded, conversation,
        "save then load changed the conversation"
    );
    check_harmony_round_trip(&conversation);
});
