//! A KV snapshot: the state of a session after a token sequence (its ids, every layer's keys and
//! values of those positions, the logits of the last one), restorable into any session of the same
//! model, path and formats. Restoring copies rows: the restored session continues exactly as the
//! one that computed them, bit for bit. A snapshot may leave out the rows of the sliding-window
//! layers that no restore it allows will read ([`RowSpan`]).

use super::kv::{KvShape, RowSpan, Tensors};
use super::options::KvFormat;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    #[error("the snapshot was computed by other weights or settings (fingerprint {found:016x}, this session {expected:016x})")]
    Fingerprint { expected: u64, found: u64 },
    #[error("the snapshot holds a {found} KV cache, this session a {expected} one")]
    Format { expected: KvFormat, found: KvFormat },
    #[error("the snapshot's KV shape {found:?} is not this model's {expected:?}")]
    Shape { expected: KvShape, found: KvShape },
    #[error("cannot restore {len} of the snapshot's {tokens} tokens into a context of {limit}")]
    Length {
        len: usize,
        tokens: usize,
        limit: usize,
    },
    #[error("token id {token} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { token: u32, vocab: usize },
    #[error("the snapshot holds {found} logits, the vocabulary has {expected} tokens")]
    Logits { expected: usize, found: usize },
    #[error("the snapshot's tensors do not hold {tokens} positions of its shape")]
    Tensors { tokens: usize },
    #[error("the snapshot keeps the sliding-window rows for restores of {min} tokens or more, not {len}")]
    Window { len: usize, min: usize },
    #[error("the snapshot's sliding-window layers (window {found}) are not this model's (window {expected})")]
    Layers { expected: usize, found: usize },
    #[error("nothing to snapshot: the session holds no tokens")]
    Empty,
}

/// The KV state of a token sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct KvSnapshot {
    /// Identifies the weights, path and activation format that computed the rows
    /// ([`super::Session::kv_fingerprint`]).
    pub fingerprint: u64,
    pub shape: KvShape,
    /// The positions the tensors hold per layer.
    pub rows: RowSpan,
    pub tokens: Vec<u32>,
    /// Logits after the last token.
    pub logits: Vec<f32>,
    /// Each tensor holds `tokens.len()` positions per head.
    pub tensors: Tensors,
}

impl KvSnapshot {
    /// Builds a snapshot from its parts, checking that the tensors hold the rows `rows` says.
    pub fn new(
        fingerprint: u64,
        shape: KvShape,
        rows: RowSpan,
        tokens: Vec<u32>,
        logits: Vec<f32>,
        tensors: Tensors,
    ) -> Result<KvSnapshot, SnapshotError> {
        let snapshot = KvSnapshot {
            fingerprint,
            shape,
            rows,
            tokens,
            logits,
            tensors,
        };
        let expected = Tensors::byte_len(snapshot.format(), shape, &snapshot.rows, snapshot.len());
        let positions: Vec<usize> = snapshot.rows.tensor_positions(snapshot.len()).collect();
        if snapshot.rows.sliding.len() != shape.layers
            || snapshot.rows.sliding_from > snapshot.len()
            || snapshot.tensor_bytes() != expected
            || snapshot.tensors.positions_each(shape) != positions
        {
            return Err(SnapshotError::Tensors {
                tokens: snapshot.len(),
            });
        }
        Ok(snapshot)
    }

    pub fn format(&self) -> KvFormat {
        self.tensors.format()
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Bytes of the keys and values (scales included).
    pub fn tensor_bytes(&self) -> usize {
        self.tensors.total_bytes()
    }

    /// The shortest prefix this snapshot can be restored to.
    pub fn min_restore(&self) -> usize {
        self.rows.min_restore()
    }

    /// Memory the snapshot holds (tensors, logits and ids).
    pub fn memory_bytes(&self) -> usize {
        self.tensor_bytes() + 4 * self.logits.len() + 4 * self.tokens.len()
    }
}
