//! Speaking harmony: the o200k_harmony tokenizer, rendering conversations into prompts, parsing
//! generated tokens back into channels, and the conversation file format.

pub mod conversation;
pub mod harmony;
pub mod parser;
pub mod tokenizer;

pub use conversation::{
    Channel, ChatMessage, Conversation, ConversationError, ReasoningEffort, Role, SystemSettings,
};
pub use harmony::{
    functions_section, push_assistant_start, push_call_header, push_channel_header,
    render_for_completion, render_history, render_turns, FunctionTool, RenderOptions,
    ResponseFormatSection, Turn,
};
pub use parser::{HarmonyParser, Malformation, ParseEvent, StopToken};
pub use tokenizer::{Tokenizer, TokenizerError, Utf8Stream};
