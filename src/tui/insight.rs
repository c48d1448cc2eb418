//! What the engine view shows, built from the engine's [`ProfileSample`]s: a decaying heat map of
//! the router's choices (layers x experts), the distinct experts of the turn per layer, where a
//! decode step's time goes, and the decode's memory traffic against the machine's bandwidth.

use crate::engine::protocol::ProfileSample;

/// Tokens over which a router choice fades to 1/e of its weight: the map shows roughly the last
/// this many tokens, so a new prompt's routing takes over within a few seconds of decoding.
pub const HEAT_TOKENS: f64 = 128.0;

/// Weight of the newest sample in the smoothed time shares and rates: steadies the bars without
/// hiding a change of threads or weight format for more than a second or two.
const SMOOTHING: f64 = 0.35;

/// Names and shares of a decode step's time (see [`ProfileSample::shares`]).
pub type Shares = [(&'static str, f64); 6];

#[derive(Debug, Default, Clone)]
pub struct Insight {
    pub layers: usize,
    pub experts: usize,
    pub experts_per_token: usize,
    /// Decayed router choices, [layers x experts].
    heat: Vec<f64>,
    /// Tokens the map has seen, all turns.
    pub tokens_seen: u64,
    /// Distinct experts each layer chose this turn.
    pub turn_distinct: Vec<u16>,
    /// Smoothed shares of a decode step's time.
    pub shares: Option<Shares>,
    /// Smoothed decode rate of the timed steps (tokens/s).
    pub decode_rate: Option<f64>,
    pub bytes_per_token: Option<u64>,
    /// The machine's read bandwidth (GB/s) and the thread count it was measured with.
    pub bandwidth: Option<(f64, usize)>,
    /// A measurement was asked for and not answered yet.
    pub bandwidth_pending: bool,
    /// The engine reads its weights on another machine: no bandwidth to compare with.
    pub bandwidth_elsewhere: bool,
}

fn smooth(previous: Option<f64>, next: f64) -> f64 {
    previous.map_or(next, |previous| previous + SMOOTHING * (next - previous))
}

impl Insight {
    pub fn record(&mut self, sample: &ProfileSample) {
        let cells = sample.layers * sample.experts;
        if sample.routing.len() != cells {
            return;
        }
        if self.layers != sample.layers || self.experts != sample.experts {
            self.layers = sample.layers;
            self.experts = sample.experts;
            self.heat = vec![0.0; cells];
        }
        self.experts_per_token = sample.experts_per_token;
        let fade = (-(sample.routed_tokens as f64) / HEAT_TOKENS).exp();
        for (heat, &chosen) in self.heat.iter_mut().zip(&sample.routing) {
            *heat = *heat * fade + f64::from(chosen);
        }
        self.tokens_seen += sample.routed_tokens;
        if sample.turn_distinct.len() == sample.layers {
            self.turn_distinct.clone_from(&sample.turn_distinct);
        }
        if let Some(next) = sample.shares() {
            self.shares = Some(match self.shares {
                Some(mut shares) => {
                    for ((_, share), (_, new)) in shares.iter_mut().zip(next) {
                        *share = smooth(Some(*share), new);
                    }
                    shares
                }
                None => next,
            });
        }
        if let Some(rate) = sample.decode_rate() {
            self.decode_rate = Some(smooth(self.decode_rate, rate));
        }
        if sample.bytes_per_token.is_some() {
            self.bytes_per_token = sample.bytes_per_token;
        }
    }

    /// A new thread count or weight format makes the old rate and shares another setup's.
    pub fn reset_timing(&mut self) {
        self.shares = None;
        self.decode_rate = None;
    }

    /// Decayed choices of `layer`, one per expert.
    pub fn layer_heat(&self, layer: usize) -> &[f64] {
        self.heat
            .get(layer * self.experts..(layer + 1) * self.experts)
            .unwrap_or(&[])
    }

    pub fn has_routing(&self) -> bool {
        self.tokens_seen > 0
    }

    /// Bytes per token x tokens per second, in GB/s.
    pub fn effective_bandwidth_gbps(&self) -> Option<f64> {
        Some(self.bytes_per_token? as f64 * self.decode_rate? / 1e9)
    }

    /// The decode's memory traffic as a share of the machine's bandwidth.
    pub fn roofline(&self) -> Option<f64> {
        let (machine, _) = self.bandwidth?;
        (machine > 0.0).then(|| self.effective_bandwidth_gbps().map(|used| used / machine))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn sample(routing: Vec<u32>, tokens: u64) -> ProfileSample {
        ProfileSample {
            layers: 2,
            experts: 2,
            experts_per_token: 1,
            routing,
            routed_tokens: tokens,
            turn_distinct: vec![1, 2],
            decode_steps: 4,
            phase_nanos: [400, 300, 100, 100, 100],
            wall_steps: 4,
            decode_wall: Duration::from_nanos(4400),
            bytes_per_token: Some(1_000_000_000),
        }
    }

    #[test]
    fn heat_fades_with_tokens() {
        let mut insight = Insight::default();
        insight.record(&sample(vec![4, 0, 2, 2], 4));
        assert_eq!(insight.layer_heat(0), &[4.0, 0.0]);
        insight.record(&sample(vec![0, 0, 0, 0], HEAT_TOKENS as u64));
        let faded = insight.layer_heat(0)[0];
        assert!((faded - 4.0 / std::f64::consts::E).abs() < 1e-9, "{faded}");
        assert_eq!(insight.turn_distinct, vec![1, 2]);
    }

    #[test]
    fn shares_rate_and_roofline() {
        let mut insight = Insight::default();
        insight.record(&sample(vec![1, 0, 0, 1], 1));
        let shares = insight.shares.expect("timed steps give shares");
        assert_eq!(shares[0].0, "attention");
        assert!((shares[0].1 - 100.0 / 1100.0).abs() < 1e-9);
        assert!(
            (shares[5].1 - 850.0 / 1100.0).abs() < 1e-9,
            "outside the pass"
        );
        let rate = insight.decode_rate.unwrap();
        assert!((rate - 4.0 / 4.4e-6).abs() < 1.0);
        assert_eq!(insight.roofline(), None, "no bandwidth measured yet");
        insight.bandwidth = Some((2.0 * rate, 2));
        assert!((insight.roofline().unwrap() - 0.5).abs() < 1e-9);
    }
}
