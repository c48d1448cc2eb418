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

/// The line the system message adds under the valid channels when the developer message defines
/// function tools.
const FUNCTIONS_CHANNEL: &str =
    "Calls to these tools must go to the commentary channel: 'functions'.";

/// A function the model may call: an entry of harmony's `functions` namespace, which the
/// developer message defines in TypeScript-like types.
#[derive(Clone, Debug, PartialEq)]
pub struct FunctionTool {
    pub name: String,
    pub description: String,
    /// JSON schema of the arguments object (`None`: the function takes none).
    pub parameters: Option<serde_json::Value>,
}

/// One entry of a prompt after the system and developer messages.
#[derive(Clone, Copy, Debug)]
pub enum Turn<'a> {
    Message(&'a ChatMessage),
    /// A call the assistant made:
    /// `<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{arguments}<|call|>`.
    ToolCall {
        name: &'a str,
        arguments: &'a str,
    },
    /// A function's answer:
    /// `<|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{output}<|end|>`.
    ToolResult {
        name: &'a str,
        output: &'a str,
    },
}

/// The system message's text (harmony's `SystemContent` without tools): sections joined by a blank
/// line.
pub fn system_text(system: &SystemSettings) -> String {
    system_text_with(system, false)
}

/// [`system_text`], with the line that sends function calls to the commentary channel when the
/// prompt defines function tools.
fn system_text_with(system: &SystemSettings, function_tools: bool) -> String {
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
    if function_tools {
        sections.push(format!("{VALID_CHANNELS}\n{FUNCTIONS_CHANNEL}"));
    } else {
        sections.push(VALID_CHANNELS.to_owned());
    }
    sections.join("\n\n")
}

/// The developer message's text (harmony's `DeveloperContent` without tools).
pub fn developer_text(instructions: &str) -> String {
    format!("# Instructions\n\n{instructions}")
}

/// A structured output the developer message describes: an entry of harmony's
/// `# Response Formats` section (the OpenAI cookbook's harmony guide), named as in the API's
/// `response_format`, the schema as compact JSON.
#[derive(Clone, Debug, PartialEq)]
pub struct ResponseFormatSection {
    pub name: String,
    pub description: Option<String>,
    pub schema: String,
}

/// `# Response Formats\n\n## {name}\n\n// {description}\n{schema}` (no comment line without a
/// description).
fn response_formats_section(format: &ResponseFormatSection) -> String {
    let comment = match &format.description {
        Some(description) => format!("// {description}\n"),
        None => String::new(),
    };
    format!(
        "# Response Formats\n\n## {}\n\n{comment}{}",
        format.name, format.schema
    )
}

/// The developer message's text: the instructions (if any), the `# Tools` section (with function
/// tools), then the `# Response Formats` section (with a structured output).
fn developer_text_with(
    instructions: Option<&str>,
    tools: &[FunctionTool],
    format: Option<&ResponseFormatSection>,
) -> Option<String> {
    let mut sections = Vec::new();
    if let Some(instructions) = instructions {
        sections.push(developer_text(instructions));
    }
    if !tools.is_empty() {
        sections.push(functions_section(tools));
    }
    if let Some(format) = format {
        sections.push(response_formats_section(format));
    }
    (!sections.is_empty()).then(|| sections.join("\n\n"))
}

/// harmony's `# Tools` section for the `functions` namespace: each function's description as
/// comments above `type {name} = (_: {arguments}) => any;` (or `() => any` without arguments),
/// a blank line after each.
pub fn functions_section(tools: &[FunctionTool]) -> String {
    let mut lines = vec![
        "## functions\n".to_owned(),
        "namespace functions {\n".to_owned(),
    ];
    for tool in tools {
        for line in tool.description.lines() {
            lines.push(format!("// {line}"));
        }
        match &tool.parameters {
            Some(parameters) => lines.push(format!(
                "type {} = (_: {}) => any;\n",
                tool.name,
                schema_type(parameters, "")
            )),
            None => lines.push(format!("type {} = () => any;\n", tool.name)),
        }
    }
    lines.push("} // namespace functions".to_owned());
    format!("# Tools\n\n{}", lines.join("\n"))
}

/// A JSON schema as the TypeScript-like type harmony writes for it (objects with their fields'
/// titles, descriptions, examples and defaults as comments, `?` on optional fields, string enums
/// as unions of literals, arrays as `T[]`, `oneOf` as `|` variants on lines of their own);
/// anything else is `any`.
fn schema_type(schema: &serde_json::Value, indent: &str) -> String {
    if let Some(variants) = schema.get("oneOf").and_then(|v| v.as_array()) {
        let mut out = String::new();
        for variant in variants {
            out.push_str(&format!("\n{indent} | "));
            out.push_str(&nullable(
                variant,
                schema_type(variant, &format!("{indent}   ")),
            ));
            let mut comments = Vec::new();
            if let Some(description) = variant.get("description").and_then(|d| d.as_str()) {
                comments.push(description.to_owned());
            }
            if let Some(default) = variant.get("default") {
                comments.push(default_comment(variant, default, true));
            }
            if !comments.is_empty() {
                out.push_str(&format!(" // {}", comments.join(" ")));
            }
        }
        return out;
    }
    if let Some(types) = schema.get("type").and_then(|t| t.as_array()) {
        let names: Vec<&str> = types
            .iter()
            .filter_map(|t| t.as_str())
            .map(|t| if t == "integer" { "number" } else { t })
            .collect();
        if !names.is_empty() {
            return names.join(" | ");
        }
    }
    match schema.get("type").and_then(|t| t.as_str()) {
        Some("object") => object_type(schema, indent),
        Some("string") => {
            let literals: Vec<String> = schema
                .get("enum")
                .and_then(|e| e.as_array())
                .map(|values| {
                    values
                        .iter()
                        .filter_map(|v| v.as_str())
                        .map(|v| format!("\"{v}\""))
                        .collect()
                })
                .unwrap_or_default();
            if literals.is_empty() {
                "string".to_owned()
            } else {
                literals.join(" | ")
            }
        }
        Some("number") | Some("integer") => "number".to_owned(),
        Some("boolean") => "boolean".to_owned(),
        Some("array") => match schema.get("items") {
            Some(items) => format!("{}[]", schema_type(items, indent)),
            None => "Array<any>".to_owned(),
        },
        _ => "any".to_owned(),
    }
}

fn object_type(schema: &serde_json::Value, indent: &str) -> String {
    let mut out = String::new();
    if let Some(description) = schema.get("description").and_then(|d| d.as_str()) {
        out.push_str(&format!("{indent}// {description}\n"));
    }
    out.push_str("{\n");
    let required: Vec<&str> = schema
        .get("required")
        .and_then(|r| r.as_array())
        .map(|names| names.iter().filter_map(|n| n.as_str()).collect())
        .unwrap_or_default();
    let properties = schema.get("properties").and_then(|p| p.as_object());
    for (key, property) in properties.into_iter().flatten() {
        let optional = if required.contains(&key.as_str()) {
            ""
        } else {
            "?"
        };
        if let Some(title) = property.get("title").and_then(|t| t.as_str()) {
            out.push_str(&format!("{indent}// {title}\n{indent}//\n"));
        }
        let description = property.get("description").and_then(|d| d.as_str());
        let variants = property.get("oneOf").and_then(|v| v.as_array());
        if variants.is_none() {
            if let Some(description) = description {
                out.push_str(&format!("{indent}// {description}\n"));
            }
        }
        if let Some(examples) = property.get("examples").and_then(|e| e.as_array()) {
            if !examples.is_empty() {
                out.push_str(&format!("{indent}// Examples:\n"));
                for example in examples.iter().filter_map(|e| e.as_str()) {
                    out.push_str(&format!("{indent}// - \"{example}\"\n"));
                }
            }
        }
        if let Some(variants) = variants {
            // The field's description above it, unless the first variant says the same.
            let first_says_it = variants
                .first()
                .and_then(|v| v.get("description"))
                .and_then(|d| d.as_str())
                .is_some_and(|d| Some(d) == description);
            let described_above = description.is_some() && !first_says_it;
            if let (Some(description), true) = (description, described_above) {
                out.push_str(&format!("{indent}// {description}\n"));
            }
            if let Some(default) = property.get("default") {
                out.push_str(&format!(
                    "{indent}// {}\n",
                    default_comment(property, default, false)
                ));
            }
            out.push_str(&format!("{indent}{key}{optional}:\n"));
            for (index, variant) in variants.iter().enumerate() {
                out.push_str(&format!("{indent} | "));
                out.push_str(&nullable(
                    variant,
                    schema_type(variant, &format!("{indent}   ")),
                ));
                let mut comments = Vec::new();
                if !(index == 0 && described_above) {
                    if let Some(own) = variant.get("description").and_then(|d| d.as_str()) {
                        if Some(own) != description {
                            comments.push(own.to_owned());
                        }
                    }
                }
                if let Some(default) = variant.get("default") {
                    comments.push(default_comment(variant, default, false));
                }
                if !comments.is_empty() {
                    out.push_str(&format!(" // {}", comments.join(" ")));
                }
                out.push('\n');
            }
            out.push_str(&format!("{indent},\n"));
            continue;
        }
        let field = nullable(property, schema_type(property, &format!("{indent}    ")));
        out.push_str(&format!("{indent}{key}{optional}: {field},"));
        if let Some(default) = property.get("default") {
            out.push_str(&format!(
                " // {}",
                default_comment(property, default, false)
            ));
        }
        out.push('\n');
    }
    out.push_str(&format!("{indent}}}"));
    out
}

/// `type | null` for a schema marked `nullable` (unless the type already names null).
fn nullable(schema: &serde_json::Value, type_text: String) -> String {
    let marked = schema.get("nullable").and_then(|n| n.as_bool()) == Some(true);
    if marked && !type_text.contains("null") {
        format!("{type_text} | null")
    } else {
        type_text
    }
}

/// `default: "text"`, or the bare value for an enum's string (as harmony writes
/// `// default: celsius`) and for non-strings. `always_quote_enums` is harmony's rule for
/// top-level `oneOf` variants, which quote only non-enum strings too but write other values as
/// JSON.
fn default_comment(
    schema: &serde_json::Value,
    default: &serde_json::Value,
    always_quote_enums: bool,
) -> String {
    let is_enum = schema
        .get("enum")
        .and_then(|e| e.as_array())
        .is_some_and(|values| !values.is_empty());
    match default.as_str() {
        Some(text) if !is_enum => format!("default: \"{text}\""),
        Some(_) if always_quote_enums => format!("default: {default}"),
        Some(text) => format!("default: {text}"),
        None => format!("default: {default}"),
    }
}

/// Which turns go into the prompt. Harmony's rule (`auto_drop_analysis`): when the last
/// assistant message is on the `final` channel, every `analysis` message before the first `final`
/// message is dropped. For a chat whose turns each end in a final answer this drops the reasoning
/// of the first turn only; later turns' reasoning stays, exactly as openai-harmony renders it.
/// A tool call is an assistant message on the commentary channel: while one is the last, the
/// reasoning that led to it stays.
fn kept_turns<'a>(
    turns: &'a [Turn<'a>],
    options: &RenderOptions,
) -> impl Iterator<Item = &'a Turn<'a>> + 'a {
    let last_assistant_is_final = turns
        .iter()
        .rev()
        .find_map(|turn| match turn {
            Turn::Message(message) if message.role == Role::Assistant => Some(message.channel),
            Turn::ToolCall { .. } => Some(Some(Channel::Commentary)),
            _ => None,
        })
        .is_some_and(|channel| channel == Some(Channel::Final));
    let is_final =
        |turn: &Turn<'_>| matches!(turn, Turn::Message(m) if m.channel == Some(Channel::Final));
    let drop_before = if options.keep_reasoning || !last_assistant_is_final {
        0
    } else {
        turns.iter().position(is_final).unwrap_or(0)
    };
    turns.iter().enumerate().filter_map(move |(index, turn)| {
        let analysis = matches!(turn, Turn::Message(m) if m.channel == Some(Channel::Analysis));
        (!(index < drop_before && analysis)).then_some(turn)
    })
}

/// Appends one message: `<|start|>{author}[<|channel|>{channel}]<|message|>{content}<|end|>`.
/// A final answer that goes back into history ends in `<|end|>`, never `<|return|>`.
fn render_message_into(
    tokenizer: &Tokenizer,
    author: &str,
    channel: Option<Channel>,
    content: &str,
    ids: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    ids.push(special::START);
    tokenizer.encode_text_into(author, ids)?;
    if let Some(channel) = channel {
        ids.push(special::CHANNEL);
        tokenizer.encode_text_into(channel.as_str(), ids)?;
    }
    ids.push(special::MESSAGE);
    tokenizer.encode_text_into(content, ids)?;
    ids.push(special::END);
    Ok(())
}

/// Appends one turn. Tool calls and results take openai-harmony's rendering of the messages vLLM
/// makes of them (recipient in the header before the channel, content type `json`); the parser
/// takes that form and the one the model writes alike.
fn render_turn_into(
    tokenizer: &Tokenizer,
    turn: &Turn<'_>,
    ids: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    match *turn {
        Turn::Message(message) => render_message_into(
            tokenizer,
            message.role.as_str(),
            message.channel,
            &message.content,
            ids,
        ),
        Turn::ToolCall { name, arguments } => {
            ids.push(special::START);
            tokenizer.encode_text_into(Role::Assistant.as_str(), ids)?;
            tokenizer.encode_text_into(&format!(" to=functions.{name}"), ids)?;
            ids.push(special::CHANNEL);
            tokenizer.encode_text_into(Channel::Commentary.as_str(), ids)?;
            tokenizer.encode_text_into(" json", ids)?;
            ids.push(special::MESSAGE);
            tokenizer.encode_text_into(arguments, ids)?;
            ids.push(special::CALL);
            Ok(())
        }
        Turn::ToolResult { name, output } => {
            ids.push(special::START);
            tokenizer.encode_text_into(&format!("functions.{name}"), ids)?;
            tokenizer.encode_text_into(" to=assistant", ids)?;
            ids.push(special::CHANNEL);
            tokenizer.encode_text_into(Channel::Commentary.as_str(), ids)?;
            ids.push(special::MESSAGE);
            tokenizer.encode_text_into(output, ids)?;
            ids.push(special::END);
            Ok(())
        }
    }
}

/// Renders the conversation as history: system, developer (if any), then the kept messages.
pub fn render_history(
    tokenizer: &Tokenizer,
    conversation: &Conversation,
    options: &RenderOptions,
) -> Result<Vec<u32>, TokenizerError> {
    let turns: Vec<Turn<'_>> = conversation.messages.iter().map(Turn::Message).collect();
    render_turns(
        tokenizer,
        &conversation.system,
        conversation.developer.as_deref(),
        &[],
        None,
        &turns,
        options,
    )
}

/// Renders a prompt's history: the system message, the developer message (its instructions, the
/// function tools and the response format, if any), then the kept turns.
pub fn render_turns(
    tokenizer: &Tokenizer,
    system: &SystemSettings,
    instructions: Option<&str>,
    tools: &[FunctionTool],
    format: Option<&ResponseFormatSection>,
    turns: &[Turn<'_>],
    options: &RenderOptions,
) -> Result<Vec<u32>, TokenizerError> {
    let mut ids = Vec::new();
    render_message_into(
        tokenizer,
        "system",
        None,
        &system_text_with(system, !tools.is_empty()),
        &mut ids,
    )?;
    if let Some(developer) = developer_text_with(instructions, tools, format) {
        render_message_into(tokenizer, "developer", None, &developer, &mut ids)?;
    }
    for turn in kept_turns(turns, options) {
        render_turn_into(tokenizer, turn, &mut ids)?;
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
    push_assistant_start(tokenizer, &mut ids)?;
    Ok(ids)
}

/// Appends, after the generation prompt, the header of a call the model is to write, as the model
/// writes one: for `Some(name)` `<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>`
/// (the model writes only the arguments); for `None` up to `to=functions.` (the model names the
/// function).
pub fn push_call_header(
    tokenizer: &Tokenizer,
    function: Option<&str>,
    ids: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    ids.push(special::CHANNEL);
    tokenizer.encode_text_into(Channel::Commentary.as_str(), ids)?;
    let Some(name) = function else {
        return tokenizer.encode_text_into(" to=functions.", ids);
    };
    tokenizer.encode_text_into(&format!(" to=functions.{name}"), ids)?;
    tokenizer.encode_text_into(" ", ids)?;
    ids.push(special::CONSTRAIN);
    tokenizer.encode_text_into("json", ids)?;
    ids.push(special::MESSAGE);
    Ok(())
}

/// Appends, after the generation prompt, the header of a message on `channel` as the model
/// writes one (`<|channel|>final<|message|>`): what a prefilled answer continues.
pub fn push_channel_header(
    tokenizer: &Tokenizer,
    channel: Channel,
    ids: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    ids.push(special::CHANNEL);
    tokenizer.encode_text_into(channel.as_str(), ids)?;
    ids.push(special::MESSAGE);
    Ok(())
}

/// Appends `<|start|>assistant`, the generation prompt's last tokens.
pub fn push_assistant_start(
    tokenizer: &Tokenizer,
    ids: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    ids.push(special::START);
    tokenizer.encode_text_into(Role::Assistant.as_str(), ids)
}
