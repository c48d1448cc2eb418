//! Choosing the next token from logits: greedy, or temperature followed by top-k, top-p and min-p
//! truncation (the order Hugging Face applies them), with a seedable ChaCha generator so a run can
//! be repeated exactly.
//!
//! Nothing here sorts the whole vocabulary per token: top-k is a linear-time selection, and top-p
//! sorts only the tokens above a probability floor that is lowered until they hold enough mass.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

/// Floors (relative to the most likely token) tried in turn when collecting top-p candidates; the
/// last one takes every token, so the search always ends.
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

/// A sampler with its own random generator and candidate buffer (reused: sampling allocates
/// nothing once the buffer has grown to the vocabulary size).
#[derive(Debug)]
pub struct Sampler {
    settings: SamplerSettings,
    rng: ChaCha20Rng,
    candidates: Vec<Candidate>,
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
        })
    }

    pub fn settings(&self) -> &SamplerSettings {
        &self.settings
    }

    /// Picks the next token id (an index into `logits`). NaN logits are never picked.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SamplerError> {
        if self.settings.is_greedy() {
            return argmax(logits).ok_or(SamplerError::NoFiniteLogits {
                count: logits.len(),
            });
        }
        self.filter(logits)?;
        let total: f64 = self.candidates.iter().map(|c| c.weight as f64).sum();
        let target = self.rng.gen::<f64>() * total;
        let mut cumulative = 0.0f64;
        for candidate in &self.candidates {
            cumulative += candidate.weight as f64;
            if cumulative > target {
                return Ok(candidate.id);
            }
        }
        // Rounding can leave `target` a hair above the last cumulative sum.
        Ok(self.candidates.last().map_or(0, |c| c.id))
    }

    /// The tokens that sampling may pick, after temperature, top-k, top-p and min-p, with their
    /// unnormalized probabilities (in no particular order unless top-k or top-p sorted them).
    pub fn filter(&mut self, logits: &[f32]) -> Result<&[Candidate], SamplerError> {
        let settings = self.settings;
        let max = logits
            .iter()
            .copied()
            .filter(|logit| logit.is_finite())
            .fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            return Err(SamplerError::NoFiniteLogits {
                count: logits.len(),
            });
        }
        let inverse_temperature = if settings.temperature > 0.0 {
            1.0 / settings.temperature
        } else {
            f32::INFINITY
        };
        let candidates = &mut self.candidates;
        candidates.clear();
        candidates.reserve(logits.len());
        for (id, &logit) in logits.iter().enumerate() {
            if logit.is_finite() {
                let weight = ((logit - max) * inverse_temperature).exp();
                if weight > 0.0 {
                    candidates.push(Candidate {
                        id: id as u32,
                        weight,
                    });
                }
            }
        }
        if settings.top_k > 0 && candidates.len() > settings.top_k {
            candidates.select_nth_unstable_by(settings.top_k - 1, by_weight_descending);
            candidates.truncate(settings.top_k);
        }
        if settings.top_p < 1.0 {
            keep_top_p(candidates, settings.top_p);
        }
        if settings.min_p > 0.0 {
            // Every weight is relative to the most likely token (weight 1), which is always kept.
            candidates.retain(|c| c.weight >= settings.min_p);
        }
        Ok(&self.candidates)
    }
}

fn by_weight_descending(a: &Candidate, b: &Candidate) -> std::cmp::Ordering {
    b.weight.total_cmp(&a.weight).then(a.id.cmp(&b.id))
}

/// Keeps the fewest most-likely candidates whose mass reaches `top_p` of the total. Only the
/// candidates above a floor are sorted; the floor drops until they carry the needed mass.
fn keep_top_p(candidates: &mut Vec<Candidate>, top_p: f32) {
    let total: f64 = candidates.iter().map(|c| c.weight as f64).sum();
    let needed = top_p as f64 * total;
    let mut head_len = 0;
    let mut head_mass = 0.0f64;
    for floor in TOP_P_FLOORS {
        // Move candidates at or above the floor to the front, after those already there. The
        // scan starts where the head ended before this floor; the head grows behind it.
        let scan_from = head_len;
        for index in scan_from..candidates.len() {
            if candidates[index].weight >= floor {
                head_mass += candidates[index].weight as f64;
                candidates.swap(head_len, index);
                head_len += 1;
            }
        }
        if head_mass >= needed || head_len == candidates.len() {
            break;
        }
    }
    candidates[..head_len].sort_unstable_by(by_weight_descending);
    let mut cumulative = 0.0f64;
    let mut keep = head_len;
    for (index, candidate) in candidates[..head_len].iter().enumerate() {
        cumulative += candidate.weight as f64;
        if cumulative >= needed {
            keep = index + 1;
            break;
        }
    }
    candidates.truncate(keep.max(1));
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
