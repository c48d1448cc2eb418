//! Rendering conversations in OpenAI's harmony format (spec section 5), token for token as the
//! openai-harmony library does: every piece of text is BPE-encoded on its own and special tokens
//! are inserted by id.

use super::conversation::{Channel, ChatMessage, Conversation, Role, SystemSettings};
use super::tokenizer::{special, Tokenizer, TokenizerError};

/// The valid-channels line of the system message.
const VALID_CHANNELS: &str =
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.";

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenderOptions {
    /// Keep the analysis (chain of thought) of completed turns in the prompt. Off by default, as
    /// in harmony: the model was trained without earlier turns' reasoning, and keeping it costs
    /// context. On, the prompt keeps growing by appending, so the KV cache is reused whole.
    pub keep_reasoning: bool,
}

/// The system message's text (harmony's `SystemContent` without tools): sections joined by a blank
/// line.
pub fn system_text(system: &SystemSettings) -> String {
    let mut top = Vec::new();
    if let Some(identity) = &system.identity {
        top.push(identity.clone());
    }
    if let Some(cutoff) = &system.knowledge_cutoff {
        top.push(format!("Knowledge cutoff: {cutoff}"));
    }
    if let Some(date) = &system.date {
        top.push(format!("Current date: {date}"));
    }
    let mut sections = Vec::new();
    if !top.is_empty() {
        sections.push(top.join("\n"));
    }
    if let Some(reasoning) = system.reasoning {
        sections.push(format!("Reasoning: {}", reasoning.as_str()));
    }
    sections.push(VALID_CHANNELS.to_owned());
    sections.join("\n\n")
}

/// The developer message's text (harmony's `DeveloperContent` without tools).
pub fn developer_text(instructions: &str) -> String {
    format!("# Instructions\n\n{instructions}")
}

/// Which messages go into the prompt. Harmony's rule (`auto_drop_analysis`): when the last
/// assistant message is on the `final` channel, every `analysis` message before the first `final`
/// message is dropped. For a chat whose turns each end in a final answer this drops the reasoning
/// of the first turn only; later turns' reasoning stays, exactly as openai-harmony renders it.
fn kept_messages<'a>(
    messages: &'a [ChatMessage],
    options: &RenderOptions,
) -> impl Iterator<Item = &'a ChatMessage> + 'a {
    let last_assistant_is_final = messages
        .iter()
        .rev()
        .find(|message| message.role == Role::Assistant)
        .is_some_and(|message| message.channel == Some(Channel::Final));
    let drop_before = if options.keep_reasoning || !last_assistant_is_final {
        0
    } else {
        messages
            .iter()
            .position(|message| message.channel == Some(Channel::Final))
            .unwrap_or(0)
    };
    messages
        .iter()
        .enumerate()
        .filter_map(move |(index, message)| {
            let dropped = index < drop_before && message.channel == Some(Channel::Analysis);
            (!dropped).then_some(message)
        })
}

/// Appends one message: `<|start|>{role}[<|channel|>{channel}]<|message|>{content}<|end|>`.
/// A final answer that goes back into history ends in `<|end|>`, never `<|return|>`.
fn render_message_into(
    tokenizer: &Tokenizer,
    role: &str,
    channel: Option<Channel>,
    content: &str,
    ids: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    ids.push(special::START);
    tokenizer.encode_text_into(role, ids)?;
    if let Some(channel) = channel {
        ids.push(special::CHANNEL);
        tokenizer.encode_text_into(channel.as_str(), ids)?;
    }
    ids.push(special::MESSAGE);
    tokenizer.encode_text_into(content, ids)?;
    ids.push(special::END);
    Ok(())
}

/// Renders the conversation as history: system, developer (if any), then the kept messages.
pub fn render_history(
    tokenizer: &Tokenizer,
    conversation: &Conversation,
    options: &RenderOptions,
) -> Result<Vec<u32>, TokenizerError> {
    let mut ids = Vec::new();
    render_message_into(
        tokenizer,
        "system",
        None,
        &system_text(&conversation.system),
        &mut ids,
    )?;
    if let Some(instructions) = &conversation.developer {
        render_message_into(
            tokenizer,
            "developer",
            None,
            &developer_text(instructions),
            &mut ids,
        )?;
    }
    for message in kept_messages(&conversation.messages, options) {
        render_message_into(
            tokenizer,
            message.role.as_str(),
            message.channel,
            &message.content,
            &mut ids,
        )?;
    }
    Ok(ids)
}

/// The generation prompt: the history followed by `<|start|>assistant` (no channel: the model
/// chooses it).
pub fn render_for_completion(
    tokenizer: &Tokenizer,
    conversation: &Conversation,
    options: &RenderOptions,
) -> Result<Vec<u32>, TokenizerError> {
    let mut ids = render_history(tokenizer, conversation, options)?;
    ids.push(special::START);
    tokenizer.encode_text_into(Role::Assistant.as_str(), &mut ids)?;
    Ok(ids)
}
