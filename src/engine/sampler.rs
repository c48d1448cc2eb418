//! Choosing the next token from logits: greedy, or temperature followed by top-k, top-p and min-p
//! truncation (the order Hugging Face applies them), with a seedable ChaCha generator so a run can
//! be repeated exactly.
//!
//! Nothing here sorts or collects the whole vocabulary per token: the weights are computed in a
//! vectorized pass, the draw sums them by blocks, and top-k, top-p and min-p collect only the
//! tokens above a weight floor that is lowered until it provably holds every kept token (an exact
//! prefilter, tested against [`Sampler::sample_reference`], which sorts everything).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

/// Floors (relative to the most likely token) tried in turn when collecting top-k or top-p
/// candidates; the last one takes every token, so the search always ends.
const TOP_P_FLOORS: [f32; 4] = [1e-3, 1e-6, 1e-10, 0.0];

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplerError {
    #[error("temperature must be a finite number >= 0 (0 = greedy); got {0}")]
    Temperature(f32),
    #[error("top-p must be in (0, 1]; got {0}")]
    TopP(f32),
    #[error("min-p must be in [0, 1]; got {0}")]
    MinP(f32),
    #[error("no finite logit among {count}: the forward pass produced NaN or infinity everywhere")]
    NoFiniteLogits { count: usize },
}

/// Sampling settings. The defaults (temperature 1, top-p 1, no top-k, no min-p) are what the
/// gpt-oss model card recommends: sample from the model's full distribution.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplerSettings {
    /// 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the fewest most-likely tokens whose probabilities add up to at least this.
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one.
    pub min_p: f32,
    /// Seed of the random generator; `None` draws one from the OS.
    pub seed: Option<u64>,
}

impl Default for SamplerSettings {
    fn default() -> Self {
        SamplerSettings {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
        }
    }
}

impl SamplerSettings {
    pub fn greedy() -> SamplerSettings {
        SamplerSettings {
            temperature: 0.0,
            ..SamplerSettings::default()
        }
    }

    pub fn validate(&self) -> Result<(), SamplerError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplerError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplerError::TopP(self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplerError::MinP(self.min_p));
        }
        Ok(())
    }

    fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// A token kept for sampling, with its unnormalized probability exp((logit - max) / temperature).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub id: u32,
    pub weight: f32,
}

/// Tokens per block of the canonical sum (see [`Sampler::sample`]).
const SUM_BLOCK: usize = 1024;
/// Blocks summed side by side, so the additions of one block do not wait for each other's.
const BLOCKS_IN_FLIGHT: usize = 8;

/// A sampler with its own random generator and buffers (reused: sampling allocates nothing once
/// they have grown to the vocabulary size).
#[derive(Debug)]
pub struct Sampler {
    settings: SamplerSettings,
    rng: ChaCha20Rng,
    candidates: Vec<Candidate>,
    /// The top-k candidates in token order, for top-p's total.
    by_id: Vec<Candidate>,
    /// Every token's weight, 0 for a non-finite logit.
    weights: Vec<f32>,
    /// The canonical sum's block sums.
    block_sums: Vec<f64>,
}

impl Sampler {
    pub fn new(settings: SamplerSettings) -> Result<Sampler, SamplerError> {
        settings.validate()?;
        let rng = match settings.seed {
            Some(seed) => ChaCha20Rng::seed_from_u64(seed),
            None => ChaCha20Rng::from_entropy(),
        };
        Ok(Sampler {
            settings,
            rng,
            candidates: Vec::new(),
            by_id: Vec::new(),
            weights: Vec::new(),
            block_sums: Vec::new(),
        })
    }

    pub fn settings(&self) -> &SamplerSettings {
        &self.settings
    }

    /// Picks the next token id (an index into `logits`). NaN logits are never picked.
    ///
    /// The draw: one uniform number `u` per token; the kept tokens' weights are summed in token
    /// order by blocks of [`SUM_BLOCK`] ids (each block from its first id on, then the blocks in
    /// order), and the token picked is the first whose running sum exceeds `u` times the total.
    /// Without truncation (the model card's defaults) that runs over a dense weight array, a few
    /// vectorized passes; with top-k, top-p or min-p an exact prefilter finds the kept tokens
    /// without sorting or collecting the vocabulary, and the same sums over them alone give the
    /// same token as [`Sampler::sample_reference`], which truncates the whole vocabulary.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplerError> {
        if self.settings.is_greedy() {
            return argmax(logits).ok_or(SamplerError::NoFiniteLogits {
                count: logits.len(),
            });
        }
        self.compute_weights(logits)?;
        if self.truncates(logits.len()) {
            self.prefilter();
            let u = self.rng.gen::<f64>();
            Ok(draw_sparse(&self.candidates, u))
        } else {
            let u = self.rng.gen::<f64>();
            Ok(draw_dense(&self.weights, &mut self.block_sums, u))
        }
    }

    /// [`Sampler::sample`] the slow way, the definition the fast path is tested against: every
    /// token sorted by weight, top-k, top-p and min-p applied in turn to the whole list, and the
    /// draw over a dense array holding the kept tokens' weights. Same seed, same tokens.
    pub fn sample_reference(&mut self, logits: &[f32]) -> Result<u32, SamplerError> {
        if self.settings.is_greedy() {
            return argmax(logits).ok_or(SamplerError::NoFiniteLogits {
                count: logits.len(),
            });
        }
        self.compute_weights(logits)?;
        let settings = self.settings;
        let mut all: Vec<Candidate> = self
            .weights
            .iter()
            .enumerate()
            .filter(|(_, &w)| w > 0.0)
            .map(|(id, &weight)| Candidate {
                id: id as u32,
                weight,
            })
            .collect();
        all.sort_by(by_weight_descending);
        if settings.top_k > 0 {
            all.truncate(settings.top_k);
        }
        if settings.top_p < 1.0 {
            let mut by_id = all.clone();
            by_id.sort_by_key(|c| c.id);
            let needed = settings.top_p as f64 * canonical_total(&by_id);
            let mut cumulative = 0.0f64;
            let mut keep = all.len();
            for (index, c) in all.iter().enumerate() {
                cumulative += c.weight as f64;
                if cumulative >= needed {
                    keep = index + 1;
                    break;
                }
            }
            all.truncate(keep.max(1));
        }
        if settings.min_p > 0.0 {
            all.retain(|c| c.weight >= settings.min_p);
        }
        let mut dense = vec![0.0f32; logits.len()];
        for c in &all {
            dense[c.id as usize] = c.weight;
        }
        let u = self.rng.gen::<f64>();
        Ok(draw_dense(&dense, &mut Vec::new(), u))
    }

    /// The tokens that sampling may pick, after temperature, top-k, top-p and min-p, with their
    /// unnormalized probabilities, in token order.
    pub fn filter(&mut self, logits: &[f32]) -> Result<&[Candidate], SamplerError> {
        self.compute_weights(logits)?;
        if self.truncates(logits.len()) {
            self.prefilter();
        } else {
            self.candidates.clear();
            self.candidates.extend(
                self.weights
                    .iter()
                    .enumerate()
                    .filter(|(_, &w)| w > 0.0)
                    .map(|(id, &weight)| Candidate {
                        id: id as u32,
                        weight,
                    }),
            );
        }
        Ok(&self.candidates)
    }

    /// Whether top-k, top-p or min-p can drop a token of a vocabulary of `vocab`.
    fn truncates(&self, vocab: usize) -> bool {
        let s = &self.settings;
        (s.top_k > 0 && s.top_k < vocab) || s.top_p < 1.0 || s.min_p > 0.0
    }

    /// Every token's weight exp((logit - max) / temperature) into `self.weights`, in passes the
    /// compiler vectorizes (no branch, no call per token).
    fn compute_weights(&mut self, logits: &[f32]) -> Result<(), SamplerError> {
        let max = finite_max(logits);
        if max == f32::NEG_INFINITY {
            return Err(SamplerError::NoFiniteLogits {
                count: logits.len(),
            });
        }
        let inverse_temperature = 1.0 / self.settings.temperature;
        self.weights.resize(logits.len(), 0.0);
        for (w, &logit) in self.weights.iter_mut().zip(logits) {
            let e = exp_nonpositive((logit - max) * inverse_temperature);
            *w = if logit.is_finite() { e } else { 0.0 };
        }
        Ok(())
    }

    /// The kept tokens into `self.candidates`, in token order, from `self.weights`: exactly the
    /// tokens [`Sampler::sample_reference`] keeps. Only tokens above a weight floor are collected
    /// and sorted; the floor drops until they provably hold every kept token.
    fn prefilter(&mut self) {
        let settings = self.settings;
        let weights = &self.weights;
        let candidates = &mut self.candidates;
        let collect = |candidates: &mut Vec<Candidate>, floor: f32| {
            candidates.clear();
            candidates.extend(
                weights
                    .iter()
                    .enumerate()
                    .filter(|(_, &w)| w >= floor && w > 0.0)
                    .map(|(id, &weight)| Candidate {
                        id: id as u32,
                        weight,
                    }),
            );
        };
        if settings.top_k > 0 {
            // The k heaviest tokens all weigh at least the floor once k tokens do.
            for floor in TOP_P_FLOORS {
                collect(candidates, floor);
                if candidates.len() >= settings.top_k || floor == 0.0 {
                    break;
                }
            }
            if candidates.len() > settings.top_k {
                candidates.select_nth_unstable_by(settings.top_k - 1, by_weight_descending);
                candidates.truncate(settings.top_k);
            }
            candidates.sort_unstable_by(by_weight_descending);
            if settings.top_p < 1.0 {
                let by_id = &mut self.by_id;
                by_id.clear();
                by_id.extend_from_slice(candidates);
                by_id.sort_unstable_by_key(|c| c.id);
                let needed = settings.top_p as f64 * canonical_total(by_id);
                cut_at_mass(candidates, needed);
            }
        } else if settings.top_p < 1.0 {
            let needed = settings.top_p as f64 * dense_total(weights, &mut self.block_sums);
            // The heaviest tokens down to the floor lead the sorted vocabulary; once their
            // running sum reaches the mass needed, the cut lies among them.
            for floor in TOP_P_FLOORS {
                collect(candidates, floor);
                candidates.sort_unstable_by(by_weight_descending);
                if cut_at_mass(candidates, needed) || floor == 0.0 {
                    break;
                }
            }
        } else {
            // min-p alone: its floor is the filter.
            collect(candidates, settings.min_p);
        }
        if settings.min_p > 0.0 {
            // Every weight is relative to the most likely token (weight 1), which is always kept.
            candidates.retain(|c| c.weight >= settings.min_p);
        }
        candidates.sort_unstable_by_key(|c| c.id);
    }
}

fn by_weight_descending(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.weight.total_cmp(&a.weight).then(a.id.cmp(&b.id))
}

/// Keeps the fewest leading candidates (sorted by weight) whose running sum reaches `needed`;
/// returns whether it was reached (otherwise all are kept).
fn cut_at_mass(sorted: &mut Vec<Candidate>, needed: f64) -> bool {
    let mut cumulative = 0.0f64;
    for index in 0..sorted.len() {
        cumulative += sorted[index].weight as f64;
        if cumulative >= needed {
            sorted.truncate(index + 1);
            return true;
        }
    }
    false
}

/// The largest finite value, or -inf; eight running maxima so the comparisons pipeline.
fn finite_max(values: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = values.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            let v = if v.is_finite() { v } else { f32::NEG_INFINITY };
            *lane = if v > *lane { v } else { *lane };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(rest) {
        if v.is_finite() && v > max {
            max = v;
        }
    }
    max
}

/// exp(x) for x <= 0 (NaN and x below -87 give 0: such a weight is under 1e-38 of the most
/// likely token's). Cody-Waite reduction by ln 2 and a degree-6 polynomial, about 2 ulp; plain
/// multiplications and additions, so a loop over it vectorizes and gives the same bits as the
/// scalar code.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer without a rounding
    // instruction (SSE2 has none).
    const ROUND: f32 = 12_582_912.0;
    let inside = x >= -87.0;
    let x = if inside { x } else { -87.0 };
    let k = (x * LOG2E + ROUND) - ROUND;
    let r = (x - k * LN2_HI) - k * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^k with k in -126..=0: the exponent bits.
    let scale = f32::from_bits((((k as i32) + 127) as u32) << 23);
    if inside {
        p * scale
    } else {
        0.0
    }
}

/// The sum of `weights` in the canonical order: each block of [`SUM_BLOCK`] from its first
/// element, then the blocks in order; leaves the block sums in `block_sums`.
fn dense_total(weights: &[f32], block_sums: &mut Vec<f64>) -> f64 {
    let blocks = weights.len().div_ceil(SUM_BLOCK);
    block_sums.clear();
    block_sums.resize(blocks, 0.0);
    // BLOCKS_IN_FLIGHT blocks side by side: each accumulator still adds its own block's values
    // one after another, so the sums are exactly the sequential ones.
    let full = weights.len() / SUM_BLOCK;
    let mut first = 0;
    while first + BLOCKS_IN_FLIGHT <= full {
        let mut acc = [0.0f64; BLOCKS_IN_FLIGHT];
        let blocks: [&[f32]; BLOCKS_IN_FLIGHT] =
            std::array::from_fn(|b| &weights[(first + b) * SUM_BLOCK..][..SUM_BLOCK]);
        for i in 0..SUM_BLOCK {
            for (a, block) in acc.iter_mut().zip(&blocks) {
                *a += block[i] as f64;
            }
        }
        block_sums[first..first + BLOCKS_IN_FLIGHT].copy_from_slice(&acc);
        first += BLOCKS_IN_FLIGHT;
    }
    for (b, sum) in block_sums.iter_mut().enumerate().skip(first) {
        let end = ((b + 1) * SUM_BLOCK).min(weights.len());
        *sum = weights[b * SUM_BLOCK..end]
            .iter()
            .fold(0.0f64, |acc, &w| acc + w as f64);
    }
    block_sums.iter().fold(0.0f64, |acc, &s| acc + s)
}

/// The canonical sum of candidates in token order: the same value as [`dense_total`] of a dense
/// array holding their weights and zeros elsewhere (adding zero changes no sum).
fn canonical_total(by_id: &[Candidate]) -> f64 {
    let mut total = 0.0f64;
    let mut index = 0;
    while index < by_id.len() {
        let block = by_id[index].id as usize / SUM_BLOCK;
        let mut sum = 0.0f64;
        while index < by_id.len() && by_id[index].id as usize / SUM_BLOCK == block {
            sum += by_id[index].weight as f64;
            index += 1;
        }
        total += sum;
    }
    total
}

/// The token of a dense weight array for the uniform number `u` (see [`Sampler::sample`]).
fn draw_dense(weights: &[f32], block_sums: &mut Vec<f64>, u: f64) -> u32 {
    let target = u * dense_total(weights, block_sums);
    let mut before = 0.0f64;
    for (b, &sum) in block_sums.iter().enumerate() {
        if before + sum > target {
            let start = b * SUM_BLOCK;
            let end = (start + SUM_BLOCK).min(weights.len());
            let mut inside = 0.0f64;
            for (i, &w) in weights[start..end].iter().enumerate() {
                inside += w as f64;
                if before + inside > target {
                    return (start + i) as u32;
                }
            }
        }
        before += sum;
    }
    // Rounding can leave the target a hair above the last sum: the last token with weight.
    weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32
}

/// [`draw_dense`] over the candidates alone (in token order): the same token.
fn draw_sparse(by_id: &[Candidate], u: f64) -> u32 {
    let target = u * canonical_total(by_id);
    let mut before = 0.0f64;
    let mut index = 0;
    while index < by_id.len() {
        let block = by_id[index].id as usize / SUM_BLOCK;
        let end = by_id[index..]
            .iter()
            .position(|c| c.id as usize / SUM_BLOCK != block)
            .map_or(by_id.len(), |n| index + n);
        let sum = by_id[index..end]
            .iter()
            .fold(0.0f64, |acc, c| acc + c.weight as f64);
        if before + sum > target {
            let mut inside = 0.0f64;
            for c in &by_id[index..end] {
                inside += c.weight as f64;
                if before + inside > target {
                    return c.id;
                }
            }
        }
        before += sum;
        index = end;
    }
    by_id.last().map_or(0, |c| c.id)
}

/// Index of the largest finite value (the first one on ties).
pub fn argmax(values: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (index, &value) in values.iter().enumerate() {
        if value.is_finite() && best.is_none_or(|(_, top)| value > top) {
            best = Some((index, value));
        }
    }
    best.map(|(index, _)| index as u32)
}
