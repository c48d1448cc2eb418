//! What the forward pass records about itself for the engine's live views: which experts the
//! router chose in every layer, and where the time of a decode step went.
//!
//! Cheap by construction: the counts array is sized once with the scratch, the router adds its
//! choices once per layer, and a decode step reads the clock only where it moves from one phase
//! to the next, on the thread that leads the pass. The session folds a pass's figures into a
//! [`SharedProfile`] that the engine drains a few times a second.

use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The parts of a decode step the time is split into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Attention projections, rotary embedding and the attention over the KV cache.
    Attention,
    /// The router and the routed experts' products.
    Experts,
    /// The final norm and the unembedding.
    Unembedding,
    /// Quantizing activations to int8 for the quantized products.
    Quantization,
    /// Embedding, norms, residual additions.
    Rest,
}

impl Phase {
    pub const ALL: [Phase; 5] = [
        Phase::Attention,
        Phase::Experts,
        Phase::Unembedding,
        Phase::Quantization,
        Phase::Rest,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Attention => "attention",
            Phase::Experts => "experts",
            Phase::Unembedding => "unembedding",
            Phase::Quantization => "quantization",
            Phase::Rest => "rest",
        }
    }
}

/// Nanoseconds per [`Phase`], indexed by the phase's position in [`Phase::ALL`].
pub type PhaseNanos = [u64; 5];

/// One pass's recording, kept in the path's scratch and written only by the leading thread.
#[derive(Debug)]
pub struct PassProfile {
    /// Whether decode steps time their phases (routing is counted either way).
    timing: bool,
    /// Whether passes of several rows per sequence (prefill) are timed too (`bench --profile`
    /// times a short prompt's prefill this way; the engine view's figures are decode steps).
    time_prefill: bool,
    /// The phase running since the instant, while a timed pass runs.
    current: Option<(Phase, Instant)>,
    /// Time per phase of the timed passes since the last fold.
    nanos: PhaseNanos,
    /// Timed passes (decode steps) since the last fold.
    steps: u64,
    /// Phase boundaries (clock reads) of those passes.
    boundaries: u64,
    /// Experts per layer.
    experts: usize,
    /// Router choices since the last fold, [layers x experts].
    routing: Vec<u32>,
    /// Tokens routed since the last fold.
    tokens: u64,
}

impl PassProfile {
    pub fn new(layers: usize, experts: usize) -> PassProfile {
        PassProfile {
            timing: true,
            time_prefill: false,
            current: None,
            nanos: [0; 5],
            steps: 0,
            boundaries: 0,
            experts,
            routing: vec![0; layers * experts],
            tokens: 0,
        }
    }

    /// Starts a pass over `rows` token rows of `steps` sequences: a decode step (one row per
    /// sequence) is timed from here, phase by phase, when timing is on.
    pub fn begin(&mut self, rows: usize, steps: usize, phase: Phase) {
        self.tokens += rows as u64;
        if self.timing && (rows == steps || self.time_prefill) {
            self.current = Some((phase, Instant::now()));
        }
    }

    /// Charges the time since the last boundary to the phase that ran and starts `phase`; returns
    /// the phase that ran, so a nested phase (quantization inside a product) can hand back.
    #[inline]
    pub fn enter(&mut self, phase: Phase) -> Phase {
        match &mut self.current {
            None => phase,
            Some((running, since)) => {
                let now = Instant::now();
                let ran = *running;
                self.nanos[ran as usize] += now.duration_since(*since).as_nanos() as u64;
                *running = phase;
                *since = now;
                self.boundaries += 1;
                ran
            }
        }
    }

    /// Ends a pass: the last phase is charged and a timed pass counts as one step.
    pub fn end(&mut self) {
        if self.current.is_some() {
            self.enter(Phase::Rest);
            self.current = None;
            self.steps += 1;
        }
    }

    /// Counts one layer's router choices: `chosen(expert)` is how many rows chose `expert`.
    #[inline]
    pub fn routed(&mut self, layer: usize, chosen: impl Fn(usize) -> usize) {
        let row = &mut self.routing[layer * self.experts..(layer + 1) * self.experts];
        for (expert, count) in row.iter_mut().enumerate() {
            *count += chosen(expert) as u32;
        }
    }

    pub fn set_timing(&mut self, on: bool) {
        self.timing = on;
    }

    pub fn set_prefill_timing(&mut self, on: bool) {
        self.time_prefill = on;
    }

    /// Adds this recording to `shared` and starts over (no allocation: both arrays exist).
    pub fn fold_into(&mut self, shared: &mut ProfileCounts) {
        for (total, &part) in shared.nanos.iter_mut().zip(&self.nanos) {
            *total += part;
        }
        shared.steps += self.steps;
        shared.boundaries += self.boundaries;
        shared.tokens += self.tokens;
        if shared.routing.len() == self.routing.len() {
            for (total, part) in shared.routing.iter_mut().zip(&mut self.routing) {
                *total += std::mem::take(part);
            }
        } else {
            self.routing.iter_mut().for_each(|count| *count = 0);
        }
        self.nanos = [0; 5];
        self.steps = 0;
        self.boundaries = 0;
        self.tokens = 0;
    }
}

/// Figures gathered since the engine last took them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProfileCounts {
    pub layers: usize,
    pub experts: usize,
    /// Time per phase of `steps` decode steps.
    pub nanos: PhaseNanos,
    pub steps: u64,
    /// Clock reads of those steps (each phase boundary reads the clock once).
    pub boundaries: u64,
    /// Router choices, [layers x experts], of `tokens` tokens.
    pub routing: Vec<u32>,
    pub tokens: u64,
}

impl ProfileCounts {
    pub fn new(layers: usize, experts: usize) -> ProfileCounts {
        ProfileCounts {
            layers,
            experts,
            routing: vec![0; layers * experts],
            ..ProfileCounts::default()
        }
    }

    /// Moves the figures into `into` (resized to this shape) and starts over.
    pub fn take_into(&mut self, into: &mut ProfileCounts) {
        into.layers = self.layers;
        into.experts = self.experts;
        into.nanos = std::mem::take(&mut self.nanos);
        into.steps = std::mem::take(&mut self.steps);
        into.boundaries = std::mem::take(&mut self.boundaries);
        into.tokens = std::mem::take(&mut self.tokens);
        into.routing.clear();
        into.routing.extend_from_slice(&self.routing);
        self.routing.iter_mut().for_each(|count| *count = 0);
    }
}

/// What one phase boundary of a timed pass costs, in nanoseconds: the mean over `count` of them on
/// this thread (a clock read and a few additions), for the overhead estimate of the benchmark.
pub fn boundary_cost_nanos(count: u32) -> f64 {
    let mut profile = PassProfile::new(1, 1);
    profile.begin(1, 1, Phase::Rest);
    let started = Instant::now();
    for index in 0..count {
        let phase = Phase::ALL[index as usize % Phase::ALL.len()];
        std::hint::black_box(profile.enter(phase));
    }
    let elapsed = started.elapsed();
    profile.end();
    elapsed.as_nanos() as f64 / f64::from(count.max(1))
}

/// The figures a session's passes fold into, shared with whoever reports them (the engine).
pub type SharedProfile = Arc<Mutex<ProfileCounts>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_steps_are_timed_and_prefill_is_not() {
        let mut pass = PassProfile::new(2, 4);
        pass.begin(3, 1, Phase::Rest);
        pass.enter(Phase::Attention);
        pass.end();
        pass.begin(1, 1, Phase::Rest);
        pass.enter(Phase::Attention);
        std::thread::sleep(std::time::Duration::from_millis(2));
        let outer = pass.enter(Phase::Quantization);
        assert_eq!(outer, Phase::Attention);
        pass.enter(outer);
        pass.end();
        let mut shared = ProfileCounts::new(2, 4);
        pass.fold_into(&mut shared);
        assert_eq!(shared.steps, 1);
        assert_eq!(shared.tokens, 4);
        assert!(shared.nanos[Phase::Attention as usize] >= 2_000_000);
    }

    #[test]
    fn routing_counts_fold_and_reset() {
        let mut pass = PassProfile::new(2, 4);
        pass.routed(1, |expert| expert);
        let mut shared = ProfileCounts::new(2, 4);
        pass.fold_into(&mut shared);
        pass.routed(1, |_| 1);
        pass.fold_into(&mut shared);
        assert_eq!(shared.routing, vec![0, 0, 0, 0, 1, 2, 3, 4]);
        let mut taken = ProfileCounts::default();
        shared.take_into(&mut taken);
        assert_eq!(taken.routing, vec![0, 0, 0, 0, 1, 2, 3, 4]);
        assert_eq!(shared.routing, vec![0; 8]);
    }

    #[test]
    fn timing_off_records_no_time() {
        let mut pass = PassProfile::new(1, 2);
        pass.set_timing(false);
        pass.begin(1, 1, Phase::Rest);
        pass.enter(Phase::Experts);
        pass.end();
        let mut shared = ProfileCounts::new(1, 2);
        pass.fold_into(&mut shared);
        assert_eq!((shared.steps, shared.nanos), (0, [0; 5]));
        assert_eq!(shared.tokens, 1);
    }
}
