//! Matrix products as jobs on the pool: each job's weight rows are cut into tasks of a few GEMM
//! tiles, all tasks of a job set run in one parallel region (on the team when there is one), and
//! their blocks are put back in token-major order. Also the activation quantization the products
//! take and the folding of split rows.

use std::cell::RefCell;
use std::ops::Range;

use crate::kernels::{self, GemmScratch, Kernels, Mxfp4Matrix, Q8Activations};
use crate::model::convert::DenseMatrix;
use crate::model::options::Split;
use crate::model::team::{parallel_for, Team};
use crate::model::weights::{Bf16Matrix, Mxfp4Experts};

/// The weights one multiplication job reads.
#[derive(Clone, Copy)]
pub enum JobWeights<'a> {
    Dense(&'a DenseMatrix),
    Expert(Mxfp4Matrix<'a>),
    /// Exact bf16 rows (the router): f32 activations.
    Bf16(&'a Bf16Matrix),
}

impl JobWeights<'_> {
    fn rows(&self) -> usize {
        match self {
            JobWeights::Dense(m) => m.rows(),
            JobWeights::Expert(m) => m.rows(),
            JobWeights::Bf16(m) => m.rows(),
        }
    }

    fn cols(&self) -> usize {
        match self {
            JobWeights::Dense(m) => m.cols(),
            JobWeights::Expert(m) => m.cols(),
            JobWeights::Bf16(m) => m.cols(),
        }
    }
}

/// One matrix times a batch of activations, written token-major into the caller's buffer
/// ([tokens x rows] at `out_offset`).
#[derive(Clone, Copy)]
pub struct Job<'a> {
    pub weights: JobWeights<'a>,
    pub quantized: Option<&'a Q8Activations>,
    pub plain: &'a [f32],
    /// Activation rows: tokens, or tokens x quantized rows per token.
    pub tokens: usize,
    /// Consecutive activation rows summed into one output row (a token's split rows).
    pub parts: usize,
    pub out_offset: usize,
}

impl<'a> Job<'a> {
    /// A job for a dense matrix; `quantized` is used only if the matrix's format needs it,
    /// `plain` otherwise.
    pub fn dense(
        w: &'a DenseMatrix,
        quantized: &'a Q8Activations,
        plain: &'a [f32],
        tokens: usize,
        out_offset: usize,
    ) -> Self {
        Job {
            weights: JobWeights::Dense(w),
            quantized: w.needs_quantized_input().then_some(quantized),
            plain,
            tokens,
            parts: 1,
            out_offset,
        }
    }

    /// A job for one expert of an MXFP4 expert tensor on quantized rows, in the tensor's layout.
    pub fn expert(
        experts: &'a Mxfp4Experts,
        expert: usize,
        quantized: &'a Q8Activations,
        tokens: usize,
        out_offset: usize,
    ) -> Self {
        Job {
            weights: JobWeights::Expert(experts.matrix(expert)),
            quantized: Some(quantized),
            plain: &[],
            tokens,
            parts: 1,
            out_offset,
        }
    }

    /// The same job with every `parts` consecutive activation rows (a token's split rows)
    /// summed into one output row: the output is [tokens / parts x rows].
    pub fn folded(self, parts: usize) -> Self {
        debug_assert!(parts >= 1 && self.tokens.is_multiple_of(parts));
        Job { parts, ..self }
    }

    /// Output rows: one per token.
    fn out_rows(&self) -> usize {
        self.tokens / self.parts
    }

    /// A job for exact bf16 rows on f32 activations.
    pub fn bf16(w: &'a Bf16Matrix, plain: &'a [f32], tokens: usize) -> Self {
        Job {
            weights: JobWeights::Bf16(w),
            quantized: None,
            plain,
            tokens,
            parts: 1,
            out_offset: 0,
        }
    }
}

/// Multiply-accumulates below which a job set runs on the calling thread: waking the pool costs
/// more than the work (the router's 32 x 2880 for one token, say).
const INLINE_WORK: usize = 1 << 18;

#[derive(Clone, Copy, Debug)]
struct RowTask {
    job: usize,
    rows: (usize, usize),
    /// Where the task's [tokens x rows] block goes in the blocked buffer.
    block_offset: usize,
}

/// The buffers every product needs besides its input and output, sized once per session.
pub struct Work {
    tasks: Vec<RowTask>,
    /// Kernel outputs in task blocks ([tokens x task rows] per task) before reordering.
    blocked: Vec<f32>,
    /// The f32 rows of a split quantization.
    split_staging: Vec<f32>,
    /// A few-token dense job's input cut into GEMV passes ([`GEMV_PASSES`] slots per job);
    /// each buffer grows once, to [`kernels::MAX_GEMV_TOKENS`] rows.
    pass_in: Vec<Q8Activations>,
}

impl Work {
    /// Room for job sets whose outputs total `blocked` floats and for split rows of up to
    /// `split_values` floats.
    pub fn new(blocked: usize, split_values: usize) -> Work {
        Work {
            tasks: Vec::with_capacity(1024),
            blocked: vec![0.0; blocked],
            split_staging: vec![0.0; 2 * split_values],
            pass_in: Vec::new(),
        }
    }

    /// Makes room for job sets whose outputs total `values` floats (a batch's unembedding);
    /// grows once, to the largest batch.
    pub fn reserve_blocked(&mut self, values: usize) {
        if self.blocked.len() < values {
            self.blocked.resize(values, 0.0);
        }
    }

    /// Quantizes the token rows of `x` (`cols` wide) for a quantized matrix: one int8 row per
    /// token, or for [`Split::Double`] two, the second quantizing what the first missed.
    pub fn quantize(
        &mut self,
        k: Kernels,
        x: &[f32],
        cols: usize,
        split: Split,
        out: &mut Q8Activations,
    ) {
        quantize_split(k, x, cols, split, &mut self.split_staging, true, out);
    }

    /// The blocked scratch for tasks that run whole jobs themselves ([`run_whole_job`]), each
    /// in its own range of the first `values` floats.
    pub(super) fn shared_blocked(&mut self, values: usize) -> SharedOut {
        assert!(
            values <= self.blocked.len(),
            "scratch sized for the widest job set"
        );
        SharedOut(self.blocked.as_mut_ptr())
    }

    /// Runs `jobs` in one parallel region and leaves each job's token-major output in `out` at
    /// its `out_offset`, a token's `parts` rows summed ([`fold_parts`]).
    pub fn run(&mut self, k: Kernels, team: Option<&Team>, jobs: &[Job<'_>], out: &mut [f32]) {
        let tasks = &mut self.tasks;
        tasks.clear();
        let total_rows: usize = jobs.iter().map(|j| j.weights.rows()).sum();
        let work: usize = jobs
            .iter()
            .map(|j| j.weights.rows() * j.weights.cols() * j.tokens)
            .sum();
        let inline = work < INLINE_WORK;
        let per_task = if inline {
            usize::MAX
        } else {
            task_rows(total_rows)
        };
        let mut block_offset = 0;
        for (index, job) in jobs.iter().enumerate() {
            let rows = job.weights.rows();
            let mut start = 0;
            while start < rows {
                let end = start.saturating_add(per_task).min(rows);
                tasks.push(RowTask {
                    job: index,
                    rows: (start, end),
                    block_offset,
                });
                block_offset += (end - start) * job.tokens;
                start = end;
            }
        }
        assert!(
            block_offset <= self.blocked.len(),
            "scratch sized for the widest job set"
        );
        // Largest tasks first, so a region ends on small ones. A short prompt's experts get 1 to
        // 20 tokens each and a task is a whole expert, so in job order a heavy expert claimed
        // last kept the other thread waiting (perf, 58-token prefill: the second thread idle 9%
        // of the time, the leader in a product for 43% of it). Equal tasks (a decoded token's
        // experts, the dense products) keep their order: the unstable sort's key ends in the
        // task's place. No task reads another's output, so the order changes no bits.
        if !inline {
            tasks.sort_unstable_by_key(|task| {
                let job = &jobs[task.job];
                let cost = (task.rows.1 - task.rows.0) * job.weights.cols() * job.tokens;
                (std::cmp::Reverse(cost), task.job, task.rows.0)
            });
        }
        // Cut the input of each few-token dense job into GEMV passes (see `gemv_passes`).
        let slots = jobs.len() * GEMV_PASSES;
        if self.pass_in.len() < slots {
            self.pass_in.resize_with(slots, Q8Activations::new);
        }
        for (index, job) in jobs.iter().enumerate() {
            if let (Some(passes), Some(x)) = (gemv_passes(job, k), job.quantized) {
                for pass in 0..passes {
                    let first = pass * kernels::MAX_GEMV_TOKENS;
                    let count = kernels::MAX_GEMV_TOKENS.min(job.tokens - first);
                    let rows: [usize; kernels::MAX_GEMV_TOKENS] =
                        std::array::from_fn(|i| first + i);
                    self.pass_in[index * GEMV_PASSES + pass]
                        .gather_rows(x, &rows[..count])
                        .expect("a job's token rows are its input's rows");
                }
            }
        }
        let end = jobs
            .iter()
            .map(|j| j.out_offset + j.out_rows() * j.weights.rows())
            .max()
            .unwrap_or(0);
        assert!(end <= out.len(), "output sized for every job");
        let pass_in = &self.pass_in;
        let shared = SharedOut(self.blocked.as_mut_ptr());
        let shared_out = SharedOut(out.as_mut_ptr());
        let run = |task: &RowTask| {
            let job = &jobs[task.job];
            let width = task.rows.1 - task.rows.0;
            let len = width * job.tokens;
            // SAFETY: see `SharedOut`: this task's block [block_offset, block_offset + len) is its
            // own.
            let block = unsafe { shared.slice(task.block_offset, len) };
            let passes = gemv_passes(job, k).map_or(&[][..], |passes| {
                &pass_in[task.job * GEMV_PASSES..task.job * GEMV_PASSES + passes]
            });
            run_task(k, job, task.rows.0..task.rows.1, block, passes);
            // The task puts its [tokens x task rows] block into the job's [tokens x rows]
            // output itself, a token's parts summed, while the block is in its cache: done
            // after the region by the leader alone, this kept the other threads waiting.
            let rows = job.weights.rows();
            for (t, token) in block.chunks_exact(width * job.parts).enumerate() {
                let dst = job.out_offset + t * rows + task.rows.0;
                // SAFETY: the jobs' outputs do not overlap (their callers give each its own
                // range) and within a job each task owns columns `task.rows` of every token's
                // row; `end` was checked against the buffer above.
                let out = unsafe { shared_out.slice(dst, width) };
                if job.parts == 1 {
                    out.copy_from_slice(token);
                } else {
                    fold_parts(token, job.parts, out);
                }
            }
        };
        if inline {
            tasks.iter().for_each(run);
        } else {
            parallel_for(team, tasks.len(), &|i| run(&tasks[i]));
        }
    }
}

/// `job` over all its rows on the calling thread (a task of a region that is not
/// [`Work::run`]'s): leaves its token-major output in `out`, a token's parts summed, as
/// [`Work::run`] would; `block` holds the parts' rows on the way (`job.tokens` x rows). The
/// kernel call is the one [`Work::run`] makes for a task of all the rows, so are the bits.
pub(super) fn run_whole_job(k: Kernels, job: &Job<'_>, block: &mut [f32], out: &mut [f32]) {
    let rows = job.weights.rows();
    assert_eq!(block.len(), job.tokens * rows, "a block per part row");
    assert_eq!(out.len(), job.out_rows() * rows, "an output row per token");
    assert!(gemv_passes(job, k).is_none(), "GEMV passes are Work::run's");
    if job.parts == 1 {
        run_task(k, job, 0..rows, out, &[]);
        return;
    }
    run_task(k, job, 0..rows, block, &[]);
    for (token, out) in block
        .chunks_exact(rows * job.parts)
        .zip(out.chunks_exact_mut(rows))
    {
        fold_parts(token, job.parts, out);
    }
}

thread_local! {
    /// Each thread's f32 rows of a split quantization done inside a parallel task, sized by
    /// [`prepare_split_staging`] for the most a task quantizes.
    static SPLIT_STAGING: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Sizes the calling thread's split staging for `values` input values (a task's rows x cols):
/// which thread takes which expert slot changes every step, and so does a slot's token count,
/// so a buffer grown on demand would allocate in the middle of a batched decode.
pub fn prepare_split_staging(values: usize) {
    SPLIT_STAGING.with(|staging| {
        let mut staging = staging.borrow_mut();
        if staging.len() < 2 * values {
            staging.resize(2 * values, 0.0);
        }
    });
}

/// [`Work::quantize`] for a task of a parallel region: on the calling thread, staging split
/// rows in a buffer of the thread's own. Same bits as [`Work::quantize`].
pub fn quantize_in_task(k: Kernels, x: &[f32], cols: usize, split: Split, out: &mut Q8Activations) {
    SPLIT_STAGING
        .with(|staging| quantize_split(k, x, cols, split, &mut staging.borrow_mut(), false, out));
}

/// Both quantizations' one body: `staging` takes a split's f32 rows (grown if short, which
/// [`Work`]'s, sized at the start, never is); `parallel` lets many rows go to rayon.
fn quantize_split(
    k: Kernels,
    x: &[f32],
    cols: usize,
    split: Split,
    staging: &mut Vec<f32>,
    parallel: bool,
    out: &mut Q8Activations,
) {
    let widths = "quantized inputs are a multiple of 32 wide";
    let quantize = |x: &[f32], out: &mut Q8Activations| {
        k.quantize_activation_rows_with(x, cols, split.scale_rule(), parallel, out)
            .expect(widths)
    };
    match split {
        Split::Single => quantize(x, out),
        Split::Double => {
            if staging.len() < 2 * x.len() {
                staging.resize(2 * x.len(), 0.0);
            }
            let staged = &mut staging[..2 * x.len()];
            k.split_rows(x, cols, staged).expect(widths);
            quantize(staged, out);
        }
    }
}

/// `out[k]` = the sum of `parts[p * out.len() + k]` over the first `count` parts, added to a
/// zero in part order (the order every path that sums a token's split rows keeps, so their
/// bits agree; see the unembedding's candidates).
pub(super) fn fold_parts(parts: &[f32], count: usize, out: &mut [f32]) {
    let width = out.len();
    out.fill(0.0);
    for part in parts.chunks_exact(width).take(count) {
        for (sum, &value) in out.iter_mut().zip(part) {
            *sum += value;
        }
    }
}

thread_local! {
    /// Each pool thread's GEMM tile, with the widest row it was sized for; grown on first use.
    static GEMM_SCRATCH: RefCell<(usize, GemmScratch)> = RefCell::new((0, GemmScratch::new(0)));
}

/// Sizes the calling thread's GEMM tile for rows up to `widest` wide.
pub fn prepare_gemm_scratch(widest: usize) {
    GEMM_SCRATCH.with(|scratch| {
        let mut guard = scratch.borrow_mut();
        if guard.0 < widest {
            *guard = (widest, GemmScratch::new(widest));
        }
    });
}

/// A raw pointer that may cross to pool threads; every task writes a disjoint range through it.
#[derive(Clone, Copy)]
pub struct SharedOut(pub *mut f32);
// SAFETY: the tasks of one parallel region (`Work::run`'s row tasks, attention's (KV head, token)
// tasks) cover disjoint ranges of the buffer, and the buffer outlives the region (it is borrowed
// mutably for its whole duration).
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The `len` floats at `offset`.
    ///
    /// # Safety
    /// The range is inside the buffer and no other live slice overlaps it.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, offset: usize, len: usize) -> &mut [f32] {
        // SAFETY: guaranteed by the caller, see above.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(offset), len) }
    }
}

/// A raw pointer to an array of buffers (one per expert slot) that may cross to pool threads;
/// each task of a region takes the buffers of its own slots.
#[derive(Clone, Copy)]
pub struct SharedSlots<T>(pub *mut T);
// SAFETY: as `SharedOut`: tasks take disjoint slots, and the array outlives the region.
unsafe impl<T: Send> Send for SharedSlots<T> {}
unsafe impl<T: Send> Sync for SharedSlots<T> {}

impl<T> SharedSlots<T> {
    /// Slot `slot`.
    ///
    /// # Safety
    /// `slot` is inside the array and no other live reference to it exists.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn get(&self, slot: usize) -> &mut T {
        // SAFETY: guaranteed by the caller, see above.
        unsafe { &mut *self.0.add(slot) }
    }
}

/// Rows per task: a multiple of the GEMM tile, about four tasks per thread for balance.
fn task_rows(total_rows: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let target = total_rows.div_ceil(threads * 4).max(1);
    target.div_ceil(kernels::GEMM_TILE_ROWS) * kernels::GEMM_TILE_ROWS
}

/// Most GEMV passes a dense job of a few tokens more than the GEMV takes is cut into.
const GEMV_PASSES: usize = 2;

/// Weight rows a GEMV pass covers before the next pass re-reads them: 64 rows of Q8 2,880 wide
/// are 190 KB, which stay in L2 (1-2 MB per core), so only the first pass reads them from memory.
const PASS_ROWS: usize = 64;

/// How many GEMV passes of at most [`kernels::MAX_GEMV_TOKENS`] tokens a dense int8 job is cut
/// into, or `None` when it takes one GEMV or the GEMM. Split activations give attention and the
/// unembedding two rows per token, so a batch of a few sequences has a few rows more than the
/// GEMV takes; the GEMM, made for many rows, ran them at a third of the GEMV's pace (a batch of
/// four: attention 62 ms a step against 23 for one sequence). The experts' MXFP4 products keep
/// their own choice (`Kernels::mxfp4_product`): their GEMV at four rows already runs at about
/// half the read bandwidth (`bench --kernels`), so a second pass would not come nearly free.
///
/// Tiled Q8 matrices take none: their kernel keeps up to 8 tokens' sums in registers per pass
/// over a tile and runs up to 16 tokens a call that way, so one call beats cut passes. Nor do
/// tiled Q4 matrices where the assembly loop runs them ([`Kernels::nibble_assembly`]).
fn gemv_passes(job: &Job<'_>, k: Kernels) -> Option<usize> {
    let int8_dense = match job.weights {
        JobWeights::Dense(DenseMatrix::Q8(m)) => !m.is_tiled(),
        JobWeights::Dense(DenseMatrix::Q4(m)) => !(m.is_tiled() && k.nibble_assembly()),
        _ => false,
    };
    let passes = job.tokens.div_ceil(kernels::MAX_GEMV_TOKENS);
    (int8_dense && (2..=GEMV_PASSES).contains(&passes)).then_some(passes)
}

/// A dense int8 job's rows `rows` over its GEMV passes `passes` (see [`gemv_passes`]): for each
/// block of [`PASS_ROWS`] weight rows, every pass in turn, so the block is read from memory once.
fn run_passes(
    k: Kernels,
    w: &DenseMatrix,
    passes: &[Q8Activations],
    rows: Range<usize>,
    out: &mut [f32],
) -> Result<(), kernels::KernelError> {
    let width = rows.len();
    let mut staged = [0.0f32; kernels::MAX_GEMV_TOKENS * PASS_ROWS];
    let mut start = rows.start;
    while start < rows.end {
        let block = start..(start + PASS_ROWS).min(rows.end);
        let (at, len) = (block.start - rows.start, block.len());
        let mut token = 0;
        for x in passes {
            let staged = &mut staged[..x.rows() * len];
            match w {
                DenseMatrix::Q8(m) => k.q8_gemv(m, x, block.clone(), staged)?,
                DenseMatrix::Q4(m) => k.q4_gemv(m, x, block.clone(), staged)?,
                DenseMatrix::Bf16(_) => unreachable!("only int8 jobs take GEMV passes"),
            }
            for (t, values) in staged.chunks_exact(len).enumerate() {
                let dst = (token + t) * width + at;
                out[dst..dst + len].copy_from_slice(values);
            }
            token += x.rows();
        }
        start = block.end;
    }
    Ok(())
}

fn run_task(
    k: Kernels,
    job: &Job<'_>,
    rows: Range<usize>,
    out: &mut [f32],
    passes: &[Q8Activations],
) {
    // A token and its split remainder (decode), or the few tokens an expert gets in a batched
    // step or a short prefill, stream the weights once through the GEMV; more go to the GEMM.
    // For the nibble formats, the experts' MXFP4 and dense Q4, the kernels decide
    // (`Kernels::mxfp4_product`, `Kernels::q4_product`), so the choice is made in one place.
    let few = job.tokens <= kernels::MAX_GEMV_TOKENS;
    let result = match (job.weights, job.quantized) {
        (JobWeights::Dense(m), Some(_)) if !passes.is_empty() => {
            run_passes(k, m, passes, rows, out)
        }
        (JobWeights::Bf16(m), _) => k.bf16_gemm(m.values(), m.cols(), job.plain, rows, out),
        (JobWeights::Dense(DenseMatrix::Bf16(m)), _) => {
            k.bf16_gemm(m.values(), m.cols(), job.plain, rows, out)
        }
        (JobWeights::Dense(DenseMatrix::Q8(m)), Some(x)) if few => k.q8_gemv(m, x, rows, out),
        (weights, Some(x)) => GEMM_SCRATCH.with(|scratch| {
            let mut guard = scratch.borrow_mut();
            if guard.0 < x.cols() {
                *guard = (x.cols(), GemmScratch::new(x.cols()));
            }
            let scratch = &mut guard.1;
            match weights {
                JobWeights::Dense(DenseMatrix::Q8(m)) => k.q8_gemm(m, x, rows, out, scratch),
                JobWeights::Dense(DenseMatrix::Q4(m)) => k.q4_product(m, x, rows, out, scratch),
                JobWeights::Expert(m) => k.mxfp4_product(&m, x, rows, out, scratch),
                _ => unreachable!("bf16 weights take the plain path above"),
            }
        }),
        (_, None) => unreachable!("quantized weights are always given quantized activations"),
    };
    // Shapes are fixed by the model config and checked at load; a mismatch is a bug, not input.
    if let Err(err) = result {
        panic!("kernel shape mismatch: {err}");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use half::f16;

    use super::*;
    use crate::kernels::{KernelPath, Q8Matrix};
    use crate::model::team::with_team;

    fn random(state: &mut u64) -> f32 {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        (*state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }

    fn matrix(rows: usize, cols: usize, state: &mut u64) -> DenseMatrix {
        let quants: Vec<i8> = (0..rows * cols)
            .map(|_| (random(state) * 254.0) as i8)
            .collect();
        let scales = (0..rows * cols / 32)
            .map(|_| f16::from_f32(0.01 + random(state).abs() * 0.02))
            .collect();
        let m = Q8Matrix::from_parts(rows, cols, &quants, scales).expect("shape");
        DenseMatrix::Q8(Arc::new(m))
    }

    /// Folding a token's split rows inside the region's tasks gives the bits of running the
    /// parts unfolded and summing them from zero in part order, for jobs side by side, inline
    /// and on a team of two, with more tasks than threads.
    #[test]
    fn folded_jobs_match_unfolded_parts_summed_in_order() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let cols = 256;
        let (a, b) = (matrix(96, cols, &mut state), matrix(160, cols, &mut state));
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .expect("pool");
        for path in [KernelPath::Scalar, crate::kernels::best_supported_path()] {
            let k = Kernels::new(path).expect("supported");
            for (tokens, parts) in [(1, 2), (3, 2), (5, 1), (40, 2)] {
                let x: Vec<f32> = (0..tokens * parts * cols)
                    .map(|_| random(&mut state) * 4.0)
                    .collect();
                let mut q = Q8Activations::new();
                k.quantize_activation_rows(&x, cols, &mut q).expect("rows");
                let rows = tokens * parts;
                let unfolded_jobs = [
                    Job::dense(&a, &q, &x, rows, 0),
                    Job::dense(&b, &q, &x, rows, rows * 96),
                ];
                let mut work = Work::new(rows * 256, rows * cols);
                let mut unfolded = vec![f32::NAN; rows * 256];
                pool.install(|| work.run(k, None, &unfolded_jobs, &mut unfolded));
                let mut want = vec![0.0f32; tokens * 256];
                for (job, (offset, width)) in [(0, 96), (rows * 96, 160)].into_iter().enumerate() {
                    let out_at = [0, tokens * 96][job];
                    for t in 0..tokens {
                        for c in 0..width {
                            let mut sum = 0.0f32;
                            for p in 0..parts {
                                sum += unfolded[offset + (t * parts + p) * width + c];
                            }
                            want[out_at + t * width + c] = sum;
                        }
                    }
                }
                let folded_jobs = [
                    Job::dense(&a, &q, &x, rows, 0).folded(parts),
                    Job::dense(&b, &q, &x, rows, tokens * 96).folded(parts),
                ];
                let mut alone = vec![f32::NAN; tokens * 256];
                pool.install(|| work.run(k, None, &folded_jobs, &mut alone));
                let mut teamed = vec![f32::NAN; tokens * 256];
                with_team(&pool, |team| {
                    assert!(team.is_some());
                    work.run(k, team, &folded_jobs, &mut teamed)
                });
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&alone), bits(&want), "{path:?} {tokens} x {parts}");
                assert_eq!(
                    bits(&teamed),
                    bits(&want),
                    "{path:?} {tokens} x {parts}, team"
                );
            }
        }
    }
}
