//! Structured outputs: `response_format` `json_object` and `json_schema` (chat completions and
//! completions) and `text.format` (responses), enforced while sampling. A schema is compiled by
//! llguidance, the constrained-decoding library llama.cpp, vLLM and SGLang use, into a parser
//! that gives, before each sampled token, the set of o200k_harmony tokens that keep the output a
//! prefix of a conforming document; the other logits are set to minus infinity. Once the
//! document is whole only `<|return|>` is allowed, so the reply ends there.
//!
//! In a harmony reply the constraint holds inside the final channel's message only: reasoning and
//! tool calls stay free, as vLLM does for gpt-oss. The developer message also describes the
//! format (harmony's `# Response Formats` section), so the model knows the shape it is held to.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde::Deserialize;
use serde_json::Value;

use super::api::ApiError;
use crate::chat::tokenizer::special;
use crate::chat::{ResponseFormatSection, Tokenizer};

/// `response_format` of chat completions (and of completions, as vLLM takes it).
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormatField {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaField },
}

/// The `json_schema` object of a chat `response_format`.
#[derive(Debug, Clone, Deserialize)]
pub struct JsonSchemaField {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub description: Option<String>,
    #[serde(default)]
    pub schema: Option<Value>,
    #[serde(default)]
    pub strict: Option<bool>,
}

/// The Responses API's `text.format`: the same choices with the schema's fields inline.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TextFormatField {
    Text,
    JsonObject,
    JsonSchema(JsonSchemaField),
}

impl From<TextFormatField> for ResponseFormatField {
    fn from(format: TextFormatField) -> ResponseFormatField {
        match format {
            TextFormatField::Text => ResponseFormatField::Text,
            TextFormatField::JsonObject => ResponseFormatField::JsonObject,
            TextFormatField::JsonSchema(json_schema) => {
                ResponseFormatField::JsonSchema { json_schema }
            }
        }
    }
}

/// A checked structured-output request: what the developer message says and the compiled
/// constraint the sampler follows.
pub struct StructuredOutput {
    /// The `# Response Formats` entry (`None` for `json_object`, which has no schema to show).
    pub section: Option<ResponseFormatSection>,
    pub constraint: OutputConstraint,
}

/// The name a schema gets in the developer message when the request gives none.
const DEFAULT_FORMAT_NAME: &str = "response";

/// Checks `format` (under the request field `param`) and compiles its constraint; `Ok(None)`
/// for plain text. An unsatisfiable or (with `strict`) unsupported schema is a 400 naming the
/// field, with llguidance's reason.
pub fn structured_output(
    format: Option<ResponseFormatField>,
    param: &str,
) -> Result<Option<StructuredOutput>, ApiError> {
    let (schema, section, strict) = match format {
        None | Some(ResponseFormatField::Text) => return Ok(None),
        // JSON mode: any JSON object, as OpenAI's replies in that mode are.
        Some(ResponseFormatField::JsonObject) => {
            (serde_json::json!({"type": "object"}), None, false)
        }
        Some(ResponseFormatField::JsonSchema { json_schema }) => {
            let Some(schema) = json_schema.schema else {
                return Err(ApiError::invalid(
                    format!("`{param}` of type json_schema needs a `schema`"),
                    Some(param),
                ));
            };
            let name = json_schema
                .name
                .unwrap_or_else(|| DEFAULT_FORMAT_NAME.to_owned());
            if name.is_empty()
                || name.len() > 64
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
            {
                return Err(ApiError::invalid(
                    format!("the format's `name` {name:?} must be 1 to 64 letters, digits, underscores or dashes"),
                    Some(param),
                ));
            }
            let section = ResponseFormatSection {
                name,
                description: json_schema.description,
                schema: schema.to_string(),
            };
            (schema, Some(section), json_schema.strict.unwrap_or(false))
        }
    };
    let constraint = OutputConstraint::compile(schema, strict)
        .map_err(|reason| ApiError::invalid(format!("`{param}`: {reason}"), Some(param)))?;
    Ok(Some(StructuredOutput {
        section,
        constraint,
    }))
}

/// The token-level state of one reply's structured output.
pub struct OutputConstraint {
    /// Boxed: a matcher is over a kilobyte, and jobs move through channels.
    matcher: Box<Matcher>,
}

impl std::fmt::Debug for OutputConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutputConstraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl OutputConstraint {
    /// Compiles a JSON schema. Unless the request set them in the schema's `x-guidance` (an
    /// llguidance extension vLLM passes through too), the document is written without
    /// whitespace between its tokens: a model held to JSON otherwise can fill its budget with
    /// blank lines. Without `strict`, keywords llguidance does not enforce are ignored (OpenAI's
    /// best-effort mode); with it they are refused.
    pub fn compile(mut schema: Value, strict: bool) -> Result<OutputConstraint, String> {
        compact_unless_told(&mut schema, strict);
        Self::from_grammar(TopLevelGrammar::from_json_schema(schema), "the schema")
    }

    /// A grammar compiled over o200k_harmony; an error names `what` could not be enforced.
    fn from_grammar(grammar: TopLevelGrammar, what: &str) -> Result<OutputConstraint, String> {
        let parser = factory()?
            .create_parser(grammar)
            .map_err(|error| format!("{what} cannot be enforced: {}", first_line(&error)))?;
        let matcher = Box::new(Matcher::new(Ok(parser)));
        match matcher.get_error() {
            Some(error) => Err(format!("{what} cannot be enforced: {}", first_line(&error))),
            None => Ok(OutputConstraint { matcher }),
        }
    }

    /// The rest of a reply that must call one of `functions` (`tool_choice: "required"`, after
    /// the prompt's `to=functions.`): a defined function's name, the header's end as the model
    /// writes it (` <|constrain|>json`, optional, then `<|message|>`), and arguments held to that
    /// function's schema (`Some`, a strict function's parameters) or any JSON object (`None`).
    pub fn required_call(functions: &[(&str, Option<Value>)]) -> Result<OutputConstraint, String> {
        use crate::chat::tokenizer::special::{CONSTRAIN, MESSAGE};
        let mut grammar = String::from("start: ");
        let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("call{i}")).collect();
        grammar.push_str(&alternatives.join(" | "));
        grammar.push('\n');
        grammar.push_str(&format!(
            "header: (\" \" <[{CONSTRAIN}]> \"json\")? <[{MESSAGE}]>\n"
        ));
        for (i, (name, schema)) in functions.iter().enumerate() {
            let (mut schema, strict) = match schema {
                Some(schema) => (schema.clone(), true),
                None => (serde_json::json!({"type": "object"}), false),
            };
            compact_unless_told(&mut schema, strict);
            // Names are checked to be letters, digits, `_` and `-`: safe inside a literal.
            grammar.push_str(&format!("call{i}: \"{name}\" header %json {schema}\n"));
        }
        Self::from_grammar(TopLevelGrammar::from_lark(grammar), "the functions")
    }

    /// Sets every logit the constraint forbids next to minus infinity. Once the document is whole
    /// the token that may follow is `end` (`<|return|>` after an answer, `<|call|>` after a
    /// call's arguments). An error (no token can continue the document, the parser failed) ends
    /// the reply.
    pub fn mask(&mut self, logits: &mut [f32], end: u32) -> Result<(), String> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|error| format!("the structured output failed: {}", first_line(&error)))?;
        if allowed.is_zero() {
            return Err("the structured output failed: no token can continue it".to_owned());
        }
        let end_logit = logits.get(end as usize).copied();
        for (words, logits) in allowed.as_slice().iter().zip(logits.chunks_mut(32)) {
            if *words == u32::MAX {
                continue;
            }
            for (bit, logit) in logits.iter_mut().enumerate() {
                if words & (1 << bit) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        if end != special::RETURN && allowed.is_allowed(special::RETURN) {
            if let (Some(logit), Some(end_logit)) = (logits.get_mut(end as usize), end_logit) {
                *logit = end_logit;
            }
            if let Some(logit) = logits.get_mut(special::RETURN as usize) {
                *logit = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past the sampled `token` (one the last mask allowed, `end` as in
    /// [`Self::mask`]).
    pub fn advance(&mut self, token: u32, end: u32) -> Result<(), String> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        let token = if token == end { special::RETURN } else { token };
        self.matcher
            .consume_token(token as TokenId)
            .map_err(|error| format!("the structured output failed: {}", first_line(&error)))
    }

    /// An independent copy in the same state (for another choice of the same request).
    pub fn fork(&self) -> OutputConstraint {
        OutputConstraint {
            matcher: Box::new(self.matcher.deep_clone()),
        }
    }

    /// Whether the document is whole (the next token may only end the reply).
    pub fn is_complete(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}

/// The schema's `x-guidance` options, unless the request set them: no whitespace between
/// tokens, and (unless `strict`) keywords llguidance does not enforce ignored.
fn compact_unless_told(schema: &mut Value, strict: bool) {
    if let Value::Object(object) = schema {
        let options = object
            .entry("x-guidance")
            .or_insert_with(|| Value::Object(Default::default()));
        if let Value::Object(options) = options {
            options
                .entry("whitespace_flexible")
                .or_insert(Value::Bool(false));
            options.entry("lenient").or_insert(Value::Bool(!strict));
        }
    }
}

/// llguidance's message without the parser state it appends on later lines (for a client, the
/// reason is the first line).
fn first_line(error: &impl std::fmt::Display) -> String {
    let text = error.to_string();
    text.lines().next().unwrap_or_default().to_owned()
}

/// o200k_harmony as llguidance reads a vocabulary: every token's bytes (special tokens marked
/// with 0xFF before their names), `<|return|>` as the end of a reply, and the tokenizer's own
/// BPE for the text a grammar forces.
struct HarmonyTokens {
    trie: TokTrie,
    tokenizer: &'static Tokenizer,
}

impl TokenizerEnv for HarmonyTokens {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(bytes).map(|text| self.tokenizer.encode_text(text)) {
            Ok(Ok(ids)) => ids,
            // Bytes that are not text (a grammar's partial characters) split greedily.
            _ => self.trie.greedy_tokenize(bytes),
        }
    }
}

/// Builds the parser factory now (on the calling thread) if no request has: the server does
/// this in the background at start, so the first structured request does not wait for it (0.8 s
/// and about 80 MB on Zen 4).
pub fn prepare() {
    let _ = factory();
}

/// The parser factory over o200k_harmony, built on first use (the vocabulary's trie and its
/// slices: a fraction of a second) and shared by every request.
fn factory() -> Result<&'static ParserFactory, String> {
    static FACTORY: OnceLock<Result<ParserFactory, String>> = OnceLock::new();
    FACTORY
        .get_or_init(|| {
            let tokenizer = Tokenizer::shared().map_err(|error| error.to_string())?;
            let words: Vec<Vec<u8>> = (0..tokenizer.vocab_size() as u32)
                .map(|id| {
                    let bytes = tokenizer.token_bytes(id).unwrap_or_default();
                    if Tokenizer::is_special(id) {
                        let mut marked = Vec::with_capacity(bytes.len() + 1);
                        marked.push(TokTrie::SPECIAL_TOKEN_MARKER);
                        marked.extend_from_slice(bytes);
                        marked
                    } else {
                        bytes.to_vec()
                    }
                })
                .collect();
            let info = TokRxInfo::new(words.len() as u32, special::RETURN);
            let env: TokEnv = Arc::new(HarmonyTokens {
                trie: TokTrie::from(&info, &words),
                tokenizer,
            });
            let mut factory = ParserFactory::new_simple(&env)
                .map_err(|error| format!("cannot build the structured-output parser: {error}"))?;
            factory.quiet();
            Ok(factory)
        })
        .as_ref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Follows the constraint with a chooser over the allowed tokens, as a sampler would.
    fn generate(
        constraint: &mut OutputConstraint,
        mut choose: impl FnMut(&[u32]) -> u32,
    ) -> Vec<u32> {
        let vocab = Tokenizer::shared().unwrap().vocab_size();
        let mut logits = vec![0.0f32; vocab];
        let mut ids = Vec::new();
        for _ in 0..200 {
            logits.fill(0.0);
            constraint.mask(&mut logits, special::RETURN).unwrap();
            let allowed: Vec<u32> = (0..vocab as u32)
                .filter(|&id| logits[id as usize].is_finite())
                .collect();
            let token = choose(&allowed);
            constraint.advance(token, special::RETURN).unwrap();
            if token == special::RETURN {
                return ids;
            }
            ids.push(token);
        }
        panic!("no end after 200 tokens: {ids:?}");
    }

    #[test]
    fn random_choices_under_a_schema_give_a_conforming_document() {
        let tokenizer = Tokenizer::shared().unwrap();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "answer": {"enum": ["yes", "no"]},
                "count": {"type": "integer", "minimum": 0, "maximum": 99},
                "flag": {"type": "boolean"}
            },
            "required": ["answer", "count", "flag"],
            "additionalProperties": false
        });
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for round in 0..8 {
            let mut constraint = OutputConstraint::compile(schema.clone(), true).unwrap();
            let ids = generate(&mut constraint, |allowed| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                allowed[(state % allowed.len() as u64) as usize]
            });
            let text = tokenizer.decode(&ids).unwrap();
            let value: Value = serde_json::from_str(&text)
                .unwrap_or_else(|error| panic!("round {round}: {text:?} is not JSON: {error}"));
            assert!(
                matches!(value["answer"].as_str(), Some("yes" | "no")),
                "{text}"
            );
            assert!(value["count"].as_u64().is_some_and(|n| n <= 99), "{text}");
            assert!(value["flag"].is_boolean(), "{text}");
            assert_eq!(value.as_object().unwrap().len(), 3, "{text}");
            assert!(!text.contains(char::is_whitespace), "compact: {text}");
        }
    }

    #[test]
    fn a_forbidden_token_is_refused_and_masked() {
        let schema = serde_json::json!({"type": "boolean"});
        let mut constraint = OutputConstraint::compile(schema, true).unwrap();
        let tokenizer = Tokenizer::shared().unwrap();
        let brace = tokenizer.encode_text("{").unwrap()[0];
        let mut logits = vec![1.0f32; tokenizer.vocab_size()];
        constraint.mask(&mut logits, special::RETURN).unwrap();
        assert_eq!(logits[brace as usize], f32::NEG_INFINITY);
        assert_eq!(logits[special::RETURN as usize], f32::NEG_INFINITY);
        let t = tokenizer.encode_text("true").unwrap();
        assert_eq!(t.len(), 1);
        assert!(logits[t[0] as usize].is_finite());
        assert!(!constraint.is_complete());
        // A call's arguments end in `<|call|>`: the whole document allows that token alone.
        let mut call =
            OutputConstraint::compile(serde_json::json!({"type": "boolean"}), true).unwrap();
        for c in [&mut constraint, &mut call] {
            c.advance(t[0], special::CALL).unwrap();
            assert!(c.is_complete());
        }
        for end in [special::RETURN, special::CALL] {
            let c = if end == special::RETURN {
                &mut constraint
            } else {
                &mut call
            };
            logits.fill(1.0);
            c.mask(&mut logits, end).unwrap();
            let allowed: Vec<usize> = (0..logits.len())
                .filter(|&i| logits[i].is_finite())
                .collect();
            assert_eq!(allowed, vec![end as usize]);
        }
        call.advance(special::CALL, special::CALL).unwrap();
        assert!(
            OutputConstraint::compile(serde_json::json!({"type": "boolean"}), true)
                .unwrap()
                .advance(brace, special::RETURN)
                .is_err()
        );
    }

    #[test]
    fn bad_formats_are_refused_by_field() {
        let parse = |value: Value| {
            let format: ResponseFormatField = serde_json::from_value(value).unwrap();
            structured_output(Some(format), "response_format").map(|o| o.is_some())
        };
        assert!(!parse(serde_json::json!({"type": "text"})).unwrap());
        assert!(parse(serde_json::json!({"type": "json_object"})).unwrap());
        let missing =
            parse(serde_json::json!({"type": "json_schema", "json_schema": {"name": "x"}}));
        assert!(missing.unwrap_err().message.contains("needs a `schema`"));
        let bad_name = parse(serde_json::json!({"type": "json_schema",
            "json_schema": {"name": "a b", "schema": {"type": "object"}}}));
        assert!(bad_name.unwrap_err().message.contains("name"));
        let impossible = parse(serde_json::json!({"type": "json_schema", "json_schema":
            {"name": "x", "strict": true, "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}));
        let error = impossible.unwrap_err();
        assert_eq!(error.param.as_deref(), Some("response_format"));
        assert!(
            error.message.contains("cannot be enforced"),
            "{}",
            error.message
        );
    }
}
