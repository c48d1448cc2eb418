//! Rotary position embedding with YaRN frequencies (spec section 3).

use super::config::{ModelConfig, RopeScaling};

/// Inverse frequencies and the attention factor (YaRN "concentration") applied to cos and sin.
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub inv_freq: Vec<f32>,
    pub attention_factor: f32,
}

impl RopeTable {
    /// Computes the table as transformers' `_compute_yarn_parameters` does (same clamps, same
    /// `truncate` rule), so checkpoints with small YaRN contexts match it too.
    pub fn new(config: &ModelConfig) -> Self {
        let dim = config.head_dim as f64;
        let half = config.head_dim / 2;
        let base = config.rope_theta;
        let pos_freq = |i: usize| base.powf((2 * i) as f64 / dim);
        match &config.rope_scaling {
            RopeScaling::None => RopeTable {
                inv_freq: (0..half).map(|i| (1.0 / pos_freq(i)) as f32).collect(),
                attention_factor: 1.0,
            },
            RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate,
                attention_factor,
            } => {
                let correction_dim = |rotations: f64| {
                    dim * (original_max_position_embeddings
                        / (rotations * 2.0 * std::f64::consts::PI))
                        .ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min(dim - 1.0);
                if low == high {
                    high += 0.001;
                }
                let inv_freq = (0..half)
                    .map(|i| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolated = 1.0 / pos_freq(i);
                        let interpolated = 1.0 / (factor * pos_freq(i));
                        (interpolated * ramp + extrapolated * (1.0 - ramp)) as f32
                    })
                    .collect();
                RopeTable {
                    inv_freq,
                    attention_factor: *attention_factor as f32,
                }
            }
        }
    }

    /// cos and sin (already multiplied by the attention factor) for one position.
    pub fn cos_sin(&self, position: usize, cos: &mut [f32], sin: &mut [f32]) {
        // The references compute position x inv_freq in f32; so do we, to land on the same angles.
        let p = position as f32;
        for ((c, s), f) in cos.iter_mut().zip(sin.iter_mut()).zip(&self.inv_freq) {
            let angle = p * f;
            *c = angle.cos() * self.attention_factor;
            *s = angle.sin() * self.attention_factor;
        }
    }
}

impl RopeTable {
    /// cos and sin of positions `start..start + n`, one row of head_dim / 2 each.
    pub fn cos_sin_rows(&self, start: usize, n: usize, cos: &mut [f32], sin: &mut [f32]) {
        let half = self.inv_freq.len();
        for (i, (c, s)) in cos
            .chunks_exact_mut(half)
            .zip(sin.chunks_exact_mut(half))
            .take(n)
            .enumerate()
        {
            self.cos_sin(start + i, c, s);
        }
    }
}

/// Rotates each head of `x` (heads x head_dim, half-split pairs (i, i + d/2)).
pub fn apply_rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        let (first, second) = head.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (first[i], second[i]);
            first[i] = a * cos[i] - b * sin[i];
            second[i] = b * cos[i] + a * sin[i];
        }
    }
}

/// Rotates every head of each `width`-wide token row of `rows`, row i by the i-th rows of `cos`
/// and `sin` (head_dim / 2 each, from [`RopeTable::cos_sin_rows`]).
pub fn apply_rope_rows(rows: &mut [f32], width: usize, head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = head_dim / 2;
    for ((row, cos), sin) in rows
        .chunks_exact_mut(width)
        .zip(cos.chunks_exact(half))
        .zip(sin.chunks_exact(half))
    {
        apply_rope(row, head_dim, cos, sin);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt_oss_20b_frequencies_match_the_spec() {
        let table = RopeTable::new(&ModelConfig::gpt_oss_20b());
        let expected = [
            (0, 1.0),
            (1, 0.6890443058881633),
            (8, 0.050813274815461475),
            (9, 0.03170569618466377),
            (17, 1.2931870124506317e-4),
            (18, 3.8308812373753384e-5),
            (31, 3.0235114281192144e-7),
        ];
        for (i, value) in expected {
            let got = table.inv_freq[i] as f64;
            assert!(
                (got - value).abs() <= value * 1e-6,
                "inv_freq[{i}] = {got}, expected {value}"
            );
        }
        assert!((table.attention_factor as f64 - 1.3465735902799727).abs() < 1e-6);
    }
}
