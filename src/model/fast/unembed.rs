//! The two-stage unembedding of decoded tokens (see [`Unembedding::TwoStage`]): a q4 draft of every
//! row on one int8 activation row, then each token's best-scored rows again with the session's
//! `lm_head` and activation format, written over the draft's values. The candidates' logits are
//! then the bits the full product gives for them; only tokens sampling could not reach keep the
//! draft's.
//!
//! [`Unembedding::TwoStage`]: crate::model::Unembedding::TwoStage

use std::cell::RefCell;

use super::jobs::{fold_parts, Job, SharedOut};
use super::{FastPass, Scratch};
use crate::kernels::{Kernels, Q8Activations};
use crate::model::convert::{DenseMatrix, DraftUnembedding};
use crate::model::options::{Product, Split};
use crate::model::profile::Phase;
use crate::model::team::parallel_for;

/// One thread's candidate heap and the quantized input rows of the token it recomputes.
struct CandidateScratch {
    heap: Vec<(f32, u32)>,
    input: Q8Activations,
    /// The width `input` was sized for.
    input_cols: usize,
}

thread_local! {
    static CANDIDATES: RefCell<CandidateScratch> = RefCell::new(CandidateScratch {
        heap: Vec::new(),
        input: Q8Activations::new(),
        input_cols: 0,
    });
}

/// Sizes the calling thread's candidate scratch for `candidates` rows of `cols`-wide input, so a
/// pool thread does not allocate the first time it recomputes candidates.
pub fn prepare_candidate_scratch(candidates: usize, cols: usize) {
    CANDIDATES.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        if scratch.heap.capacity() < candidates {
            scratch.heap = Vec::with_capacity(candidates);
        }
        if scratch.input_cols < cols {
            scratch.input = Q8Activations::with_capacity(2, cols);
            scratch.input_cols = cols;
        }
    });
}

/// Leaves in `heap` the `k` largest of `values` (as (value, index), in no particular order).
/// Ties keep the first seen; a NaN counts as larger than everything, so it is recomputed rather
/// than hidden.
pub fn top_candidates(values: &[f32], k: usize, heap: &mut Vec<(f32, u32)>) {
    heap.clear();
    let k = k.min(values.len());
    if k == 0 {
        return;
    }
    let less = |a: f32, b: f32| a.total_cmp(&b).is_lt();
    // A min-heap on the value: its root is the bar a new value must clear.
    for (i, &v) in values[..k].iter().enumerate() {
        heap.push((v, i as u32));
        let last = heap.len() - 1;
        sift_up(heap, last, less);
    }
    for (i, &v) in values.iter().enumerate().skip(k) {
        if less(heap[0].0, v) {
            heap[0] = (v, i as u32);
            sift_down(heap, less);
        }
    }
}

fn sift_up(heap: &mut [(f32, u32)], mut at: usize, less: impl Fn(f32, f32) -> bool) {
    while at > 0 {
        let parent = (at - 1) / 2;
        if !less(heap[at].0, heap[parent].0) {
            break;
        }
        heap.swap(at, parent);
        at = parent;
    }
}

fn sift_down(heap: &mut [(f32, u32)], less: impl Fn(f32, f32) -> bool) {
    let mut at = 0;
    loop {
        let (left, right) = (2 * at + 1, 2 * at + 2);
        let mut smallest = at;
        if left < heap.len() && less(heap[left].0, heap[smallest].0) {
            smallest = left;
        }
        if right < heap.len() && less(heap[right].0, heap[smallest].0) {
            smallest = right;
        }
        if smallest == at {
            return;
        }
        heap.swap(at, smallest);
        at = smallest;
    }
}

impl FastPass<'_> {
    /// The logits of the `rows` final-normed rows in `s.normed` into `s.logits` ([rows x vocab]).
    pub(super) fn two_stage_unembedding(
        &self,
        draft: &DraftUnembedding,
        rows: usize,
        s: &mut Scratch,
    ) {
        let h = self.config.hidden_size;
        let vocab = self.config.vocab_size;
        let lm_head = &self.fast.lm_head;
        let x = &s.normed[..rows * h];
        let outer = s.profile.enter(Phase::Quantization);
        // The draft only ranks rows and stands in for tokens sampling cannot reach: one int8 row.
        s.work
            .quantize(self.kernels, x, h, Split::Single, &mut s.draft_in);
        let split = self.activations.split(Product::Dense);
        if lm_head.needs_quantized_input() {
            s.work.quantize(self.kernels, x, h, split, &mut s.normed_q);
        }
        s.profile.enter(outer);
        let job = Job::dense(&draft.matrix, &s.draft_in, x, rows, 0);
        s.work.reserve_blocked(rows * vocab);
        if s.logits.len() < rows * vocab {
            s.logits.resize(rows * vocab, 0.0);
        }
        let out = &mut s.logits[..rows * vocab];
        s.work.run(self.kernels, self.team, &[job], out);

        let per_token = split.rows_per_token();
        let (kernels, candidates) = (self.kernels, draft.candidates);
        let (normed_q, logits) = (&s.normed_q, SharedOut(s.logits.as_mut_ptr()));
        let recompute = |row: usize| {
            // SAFETY: each task writes the logits of its own row only, and `s.logits` outlives
            // the region.
            let logits = unsafe { logits.slice(row * vocab, vocab) };
            let x = &x[row * h..(row + 1) * h];
            CANDIDATES.with(|scratch| {
                let scratch = &mut *scratch.borrow_mut();
                top_candidates(logits, candidates, &mut scratch.heap);
                if lm_head.needs_quantized_input() {
                    let rows: [usize; 2] = [per_token * row, per_token * row + 1];
                    scratch
                        .input
                        .gather_rows(normed_q, &rows[..per_token])
                        .expect("a token's rows are the quantized input's rows");
                }
                for &(_, token) in scratch.heap.iter() {
                    let token = token as usize;
                    logits[token] = session_logit(kernels, lm_head, &scratch.input, x, token);
                }
            });
        };
        if rows == 1 {
            recompute(0);
        } else {
            parallel_for(self.team, rows, &recompute);
        }
    }
}

/// Row `token` of `lm_head` times one token's input (`quantized`: its int8 rows, `plain`: its
/// f32 values), in the session's format and summed as the full product and its fold sum them.
fn session_logit(
    k: Kernels,
    lm_head: &DenseMatrix,
    quantized: &Q8Activations,
    plain: &[f32],
    token: usize,
) -> f32 {
    let mut parts = [0.0f32; 2];
    let rows = token..token + 1;
    let (result, count) = match lm_head {
        DenseMatrix::Q8(m) => {
            let count = quantized.rows();
            (k.q8_gemv(m, quantized, rows, &mut parts[..count]), count)
        }
        DenseMatrix::Q4(m) => {
            let count = quantized.rows();
            (k.q4_gemv(m, quantized, rows, &mut parts[..count]), count)
        }
        DenseMatrix::Bf16(m) => (
            k.bf16_gemm(m.values(), m.cols(), plain, rows, &mut parts[..1]),
            1,
        ),
    };
    // Shapes are fixed by the model config and checked at load; a mismatch is a bug, not input.
    if let Err(err) = result {
        panic!("kernel shape mismatch: {err}");
    }
    // Summed as `Work::run` sums a token's parts, so a candidate gets the full product's bits.
    let mut sum = 0.0;
    fold_parts(&parts[..count], count, std::slice::from_mut(&mut sum));
    sum
}

#[cfg(test)]
mod tests {
    use super::top_candidates;

    #[test]
    fn top_candidates_are_the_largest_values_with_their_indices() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let values: Vec<f32> = (0..10_000)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        let mut heap = Vec::new();
        for k in [1, 7, 64, 10_000, 20_000] {
            top_candidates(&values, k, &mut heap);
            let mut got: Vec<u32> = heap.iter().map(|&(_, i)| i).collect();
            got.sort_unstable();
            let mut order: Vec<u32> = (0..values.len() as u32).collect();
            order.sort_by(|&a, &b| values[b as usize].total_cmp(&values[a as usize]));
            let mut want = order[..k.min(values.len())].to_vec();
            want.sort_unstable();
            assert_eq!(got, want, "k = {k}");
            assert!(heap.iter().all(|&(v, i)| v == values[i as usize]));
        }
        top_candidates(&values, 0, &mut heap);
        assert!(heap.is_empty());
        top_candidates(&[], 5, &mut heap);
        assert!(heap.is_empty());
    }

    #[test]
    fn a_nan_logit_is_always_a_candidate() {
        let mut values = vec![1.0f32; 100];
        values[37] = f32::NAN;
        values[80] = 2.0;
        let mut heap = Vec::new();
        top_candidates(&values, 2, &mut heap);
        let mut got: Vec<u32> = heap.iter().map(|&(_, i)| i).collect();
        got.sort_unstable();
        assert_eq!(got, vec![37, 80]);
    }
}
