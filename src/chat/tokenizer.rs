//! The o200k_harmony tokenizer of gpt-oss, through the `tiktoken-rs` crate (which embeds the
//! vocabulary, so nothing is downloaded).
//!
//! Message text is always encoded as ordinary text: a user who types `<|end|>` gets the BPE pieces
//! of those characters, never the special token. Special tokens only enter a prompt by id, from the
//! harmony renderer.

use std::collections::HashSet;
use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

/// Number of token ids of gpt-oss (`vocab_size` in its config): 0..=201087.
pub const VOCAB_SIZE: usize = 201_088;

/// First id of the special-token range (`<|startoftext|>`); every id from here up is special.
pub const FIRST_SPECIAL_ID: u32 = 199_998;

/// Harmony's special tokens, by id (spec section 4).
pub mod special {
    pub const START_OF_TEXT: u32 = 199_998;
    pub const END_OF_TEXT: u32 = 199_999;
    pub const RETURN: u32 = 200_002;
    pub const CONSTRAIN: u32 = 200_003;
    pub const CHANNEL: u32 = 200_005;
    pub const START: u32 = 200_006;
    pub const END: u32 = 200_007;
    pub const MESSAGE: u32 = 200_008;
    pub const CALL: u32 = 200_012;
}

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("token id {id} is outside the o200k_harmony vocabulary (ids 0..{VOCAB_SIZE})")]
    UnknownTokenId { id: u32 },
    #[error("o200k_harmony could not encode the text: {message}")]
    Encode { message: String },
    #[error("could not build the o200k_harmony tokenizer from the vocabulary embedded in tiktoken-rs: {message}")]
    Build { message: String },
    #[error("{text:?} is not a token id (expected comma-separated ids, e.g. 200006,1428)")]
    NotAnId { text: String },
}

/// Parses comma-separated token ids (`tokenize --decode`'s argument); spaces around ids are
/// allowed. Only the syntax is checked here: [`Tokenizer::decode`] checks the range.
pub fn parse_ids(text: &str) -> Result<Vec<u32>, TokenizerError> {
    text.split(',')
        .map(|id| {
            id.trim()
                .parse::<u32>()
                .map_err(|_| TokenizerError::NotAnId {
                    text: id.to_owned(),
                })
        })
        .collect()
}

/// o200k_harmony with a flat id -> bytes table, so decoding one token allocates nothing.
pub struct Tokenizer {
    bpe: CoreBPE,
    /// Bytes of token `id` are `token_bytes[token_offsets[id]..token_offsets[id + 1]]`.
    token_bytes: Vec<u8>,
    token_offsets: Vec<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &VOCAB_SIZE)
            .finish_non_exhaustive()
    }
}

static SHARED: OnceLock<Result<Tokenizer, String>> = OnceLock::new();

impl Tokenizer {
    /// Builds the tokenizer (about half a second: the embedded vocabulary is parsed).
    pub fn new() -> Result<Tokenizer, TokenizerError> {
        let bpe = tiktoken_rs::o200k_harmony().map_err(|error| TokenizerError::Build {
            message: error.to_string(),
        })?;
        let mut token_bytes = Vec::with_capacity(VOCAB_SIZE * 8);
        let mut token_offsets = Vec::with_capacity(VOCAB_SIZE + 1);
        token_offsets.push(0u32);
        for id in 0..VOCAB_SIZE as u32 {
            let bytes = bpe.decode_bytes(&[id]).map_err(|_| TokenizerError::Build {
                message: format!("token id {id} has no bytes in the vocabulary"),
            })?;
            token_bytes.extend_from_slice(&bytes);
            token_offsets.push(token_bytes.len() as u32);
        }
        Ok(Tokenizer {
            bpe,
            token_bytes,
            token_offsets,
        })
    }

    /// One tokenizer shared by the whole process, built on first use.
    pub fn shared() -> Result<&'static Tokenizer, TokenizerError> {
        SHARED
            .get_or_init(|| Tokenizer::new().map_err(|error| error.to_string()))
            .as_ref()
            .map_err(|message| TokenizerError::Build {
                message: message.clone(),
            })
    }

    /// Encodes text with plain BPE: special-token strings in `text` stay ordinary text.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        self.encode_text_into(text, &mut ids)?;
        Ok(ids)
    }

    /// Appends the plain-BPE ids of `text` to `ids`.
    pub fn encode_text_into(&self, text: &str, ids: &mut Vec<u32>) -> Result<(), TokenizerError> {
        // `encode` with no allowed special tokens is `encode_ordinary`, but it reports regex
        // failures (fancy-regex backtrack limits on pathological input) instead of panicking.
        let no_specials = HashSet::new();
        let (encoded, _) =
            self.bpe
                .encode(text, &no_specials)
                .map_err(|error| TokenizerError::Encode {
                    message: error.message,
                })?;
        ids.extend_from_slice(&encoded);
        Ok(())
    }

    /// Encodes text in which literal `<|...|>` strings become their special tokens (for the
    /// `tokenize --special` validation tool; never for message text).
    pub fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let specials = self.bpe.special_tokens();
        self.bpe
            .encode(text, &specials)
            .map(|(ids, _)| ids)
            .map_err(|error| TokenizerError::Encode {
                message: error.message,
            })
    }

    /// The bytes of one token; special tokens give their literal name (`<|end|>`).
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizerError> {
        let index = id as usize;
        if index >= VOCAB_SIZE {
            return Err(TokenizerError::UnknownTokenId { id });
        }
        let start = self.token_offsets[index] as usize;
        let end = self.token_offsets[index + 1] as usize;
        Ok(&self.token_bytes[start..end])
    }

    /// Token ids run from 0 to this (exclusive), special tokens included.
    pub fn vocab_size(&self) -> usize {
        VOCAB_SIZE
    }

    /// Whether `id` is one of the special tokens (`<|start|>`, `<|reserved_200013|>`, ...).
    pub fn is_special(id: u32) -> bool {
        id >= FIRST_SPECIAL_ID
    }

    /// Decodes ids to text; special tokens appear as their names, invalid UTF-8 as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let mut stream = Utf8Stream::default();
        let mut text = String::new();
        for &id in ids {
            text.push_str(stream.push(self.token_bytes(id)?));
        }
        text.push_str(stream.finish());
        Ok(text)
    }
}

/// Turns a stream of token bytes into text without ever splitting a UTF-8 character across two
/// updates: an incomplete character waits for the next token's bytes.
#[derive(Debug)]
pub struct Utf8Stream {
    pending: Vec<u8>,
    text: String,
}

/// The longest o200k token is 128 bytes; with up to 3 bytes of a held-back character that bounds
/// `pending`, and U+FFFD (3 bytes) for every byte bounds `text`. Sized once, never regrown.
const STREAM_PENDING: usize = 256;
const STREAM_TEXT: usize = 3 * STREAM_PENDING;

impl Default for Utf8Stream {
    fn default() -> Self {
        Utf8Stream {
            pending: Vec::with_capacity(STREAM_PENDING),
            text: String::with_capacity(STREAM_TEXT),
        }
    }
}

impl Utf8Stream {
    /// Adds bytes and returns the complete characters now available (possibly empty). Byte
    /// sequences that can never become valid UTF-8 come out as U+FFFD at once.
    pub fn push(&mut self, bytes: &[u8]) -> &str {
        self.pending.extend_from_slice(bytes);
        self.text.clear();
        let mut consumed = 0;
        loop {
            match std::str::from_utf8(&self.pending[consumed..]) {
                Ok(valid) => {
                    self.text.push_str(valid);
                    consumed = self.pending.len();
                    break;
                }
                Err(error) => {
                    let valid_end = consumed + error.valid_up_to();
                    if let Ok(valid) = std::str::from_utf8(&self.pending[consumed..valid_end]) {
                        self.text.push_str(valid);
                    }
                    match error.error_len() {
                        Some(invalid_len) => {
                            self.text.push(char::REPLACEMENT_CHARACTER);
                            consumed = valid_end + invalid_len;
                        }
                        None => {
                            // An incomplete character at the end: keep it for the next push.
                            consumed = valid_end;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        &self.text
    }

    /// Ends the stream: an incomplete trailing character becomes U+FFFD.
    pub fn finish(&mut self) -> &str {
        self.text.clear();
        if !self.pending.is_empty() {
            self.text.push(char::REPLACEMENT_CHARACTER);
            self.pending.clear();
        }
        &self.text
    }

    /// Forgets any pending bytes (a new message starts).
    pub fn reset(&mut self) {
        self.pending.clear();
        self.text.clear();
    }

    /// Whether bytes of an incomplete character are waiting.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_lists_parse_with_spaces_and_name_what_is_not_an_id() {
        assert_eq!(
            parse_ids(" 200006, 1428 ,0").unwrap(),
            vec![200006, 1428, 0]
        );
        for bad in ["", "1,,2", "1;2", "-1", "4294967296"] {
            let error = parse_ids(bad).unwrap_err().to_string();
            assert!(error.contains("is not a token id"), "{bad:?}: {error}");
        }
        assert!(parse_ids("7,x y")
            .unwrap_err()
            .to_string()
            .contains("\"x y\""));
    }

    #[test]
    fn utf8_stream_holds_split_characters_back() {
        let mut stream = Utf8Stream::default();
        let snowman = "☃".as_bytes();
        assert_eq!(stream.push(&snowman[..1]), "");
        assert_eq!(stream.push(&snowman[1..2]), "");
        assert_eq!(stream.push(&[snowman[2], b'a']), "☃a");
        assert_eq!(stream.finish(), "");
    }

    #[test]
    fn utf8_stream_replaces_invalid_bytes_and_flushes_tail() {
        let mut stream = Utf8Stream::default();
        assert_eq!(stream.push(&[b'x', 0xFF, b'y']), "x\u{FFFD}y");
        assert_eq!(stream.push(&[0xE2, 0x98]), "");
        assert!(stream.has_pending());
        assert_eq!(stream.finish(), "\u{FFFD}");
        assert!(!stream.has_pending());
    }
}
