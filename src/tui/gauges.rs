//! What the gauges panel shows: what the engine runs, its latest numbers, the decode-rate
//! history, a running weight conversion and the UI's own key-to-screen latency.

use crate::engine::protocol::{EngineInfo, StatsSample};
use std::collections::VecDeque;
use std::time::Duration;

/// Decode-rate samples kept for the sparkline.
pub const SPARKLINE_SAMPLES: usize = 120;

/// Key-to-screen latency, measured by the loop (time from reading a key to finishing the draw).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Latency {
    pub last: Duration,
    pub max: Duration,
    pub samples: u64,
}

impl Latency {
    pub fn record(&mut self, latency: Duration) {
        self.last = latency;
        self.max = self.max.max(latency);
        self.samples += 1;
    }
}

/// A background settings change in progress: (what, done, total).
pub type SettingsProgress = (String, u64, u64);

#[derive(Debug, Default)]
pub struct Gauges {
    pub engine_info: Option<EngineInfo>,
    pub stats: Option<StatsSample>,
    /// Decode rates (tenths of tokens per second), oldest first.
    pub decode_rates: VecDeque<u64>,
    pub settings_progress: Option<SettingsProgress>,
    pub latency: Latency,
    /// Rows only this engine reports (a remote engine's server and network figures).
    pub engine_rows: Vec<(String, String)>,
}

impl Gauges {
    pub fn push_decode_rate(&mut self, tokens_per_second: f64) {
        if self.decode_rates.len() == SPARKLINE_SAMPLES {
            self.decode_rates.pop_front();
        }
        self.decode_rates
            .push_back((tokens_per_second * 10.0).round() as u64);
    }
}
