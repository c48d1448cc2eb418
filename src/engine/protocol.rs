//! The typed messages between the UI thread and the engine thread.
//!
//! The UI never touches model internals: it sends [`Command`]s and receives [`Event`]s. Everything
//! here is plain data so that a test can drive the UI with a scripted event stream and the engine
//! with a scripted command stream.

use serde::{Deserialize, Serialize};
use std::time::Duration;

/// Identifies one generation request; events carry it so late events of a cancelled request can be
/// told apart from the current one. Ids only grow.
pub type RequestId = u64;

pub use crate::model::options::{
    ActivationFormat, AttentionArithmetic, KvFormat as KvCacheType, Unembedding, WeightFormat,
};

/// The conversation types are the chat module's own, so a request carries exactly what is
/// rendered and a saved chat is exactly the chat module's JSON file.
pub use crate::chat::{Channel, ChatMessage, Conversation, ReasoningEffort, Role, SystemSettings};

// The config file, the command line and the settings panel name efforts like the other choices.
crate::choice::impl_choice!(ReasoningEffort { Low => "low", Medium => "medium", High => "high" });

/// Sampling parameters; `top_k` 0 and `min_p` 0 switch those filters off, `seed` `None` draws one.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingSettings {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: usize,
    pub min_p: f32,
    pub max_tokens: usize,
    pub seed: Option<u64>,
}

impl SamplingSettings {
    /// The sampler's part (everything but the token budget).
    pub fn sampler(&self) -> crate::engine::SamplerSettings {
        crate::engine::SamplerSettings {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
        }
    }
}

impl Default for SamplingSettings {
    /// The model card recommends temperature 1.0 and top-p 1.0.
    fn default() -> Self {
        SamplingSettings {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            max_tokens: 4096,
            seed: None,
        }
    }
}

/// Everything the user can change while the app runs. The engine applies a change between turns.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub threads: usize,
    pub weight_format: WeightFormat,
    /// How decoded tokens' logits are computed (a q4 draft and candidates, or every row).
    #[serde(default)]
    pub unembedding: Unembedding,
    /// How the inputs of quantized products are quantized (one int8 row per token, or two).
    pub activations: ActivationFormat,
    /// The arithmetic of attention over an f16 cache (bf16 dot products or f32).
    #[serde(default)]
    pub attention: AttentionArithmetic,
    pub kv_cache: KvCacheType,
    pub context_limit: usize,
    pub sampling: SamplingSettings,
    pub reasoning_effort: ReasoningEffort,
    /// Keep earlier turns' analysis in the prompt: costs context, gains prefix-cache hits.
    pub keep_reasoning_in_context: bool,
    /// The model identity line of the harmony system message.
    pub system_prompt: String,
    /// The `# Instructions` of the developer message; empty means no developer message.
    pub developer_instructions: String,
}

/// Harmony's default identity line.
pub const DEFAULT_SYSTEM_PROMPT: &str = crate::chat::conversation::DEFAULT_IDENTITY;

impl Default for Settings {
    fn default() -> Self {
        Settings {
            threads: crate::engine::default_threads(),
            weight_format: WeightFormat::Q8,
            unembedding: Unembedding::TwoStage,
            activations: ActivationFormat::Mixed,
            attention: AttentionArithmetic::Auto,
            kv_cache: KvCacheType::F16,
            context_limit: 8192,
            sampling: SamplingSettings::default(),
            reasoning_effort: ReasoningEffort::Medium,
            keep_reasoning_in_context: false,
            system_prompt: DEFAULT_SYSTEM_PROMPT.to_string(),
            developer_instructions: String::new(),
        }
    }
}

impl Settings {
    /// Whether going from `self` to `next` changes the rendered prompt from its first message on,
    /// so the next turn has to prefill the whole conversation again.
    pub fn invalidates_prompt_prefix(&self, next: &Settings) -> bool {
        self.reasoning_effort != next.reasoning_effort
            || self.system_prompt != next.system_prompt
            || self.developer_instructions != next.developer_instructions
    }
}

/// Why a generation request exists; the engine treats all alike (prefix reuse finds the rewind
/// point), the kind only labels statistics and status text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    NewTurn,
    Regenerate,
    EditAndResend,
}

/// Generate the next assistant reply to `conversation`, whose last message is the user's.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    pub id: RequestId,
    pub kind: RequestKind,
    pub conversation: Conversation,
}

/// UI -> engine.
#[derive(Clone, Debug, PartialEq)]
pub enum Command {
    /// Boxed: a conversation is large beside the other commands.
    Generate(Box<GenerateRequest>),
    /// Stop request `id` (and anything older). The handle also raises the shared cancel mark so a
    /// running turn sees it within one token or one prefill chunk.
    Cancel(RequestId),
    ApplySettings(Box<Settings>),
    /// Measure the machine's memory read bandwidth (between turns), answered with
    /// [`Event::Bandwidth`]: the ceiling the decode's roofline bar compares with.
    MeasureBandwidth,
    /// A saved chat was opened: restore the longest KV snapshot of this conversation now (a
    /// notice says what was resumed), so its next turn prefills only the new message.
    Resume(Box<Conversation>),
    Shutdown,
}

/// Why a turn ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model ended its reply (`<|return|>` or `<|call|>`).
    Finished,
    MaxTokens,
    ContextFull,
    Cancelled,
}

impl From<crate::engine::StopReason> for StopReason {
    fn from(reason: crate::engine::StopReason) -> StopReason {
        use crate::engine::StopReason as Loop;
        match reason {
            Loop::Return | Loop::ToolCall | Loop::EndOfText => StopReason::Finished,
            Loop::MaxTokens => StopReason::MaxTokens,
            Loop::ContextFull => StopReason::ContextFull,
            Loop::Cancelled => StopReason::Cancelled,
        }
    }
}

impl StopReason {
    pub fn describe(self) -> &'static str {
        match self {
            StopReason::Finished => "finished",
            StopReason::MaxTokens => "stopped at max tokens",
            StopReason::ContextFull => "context full",
            StopReason::Cancelled => "stopped",
        }
    }
}

/// Tokens taken from the KV cache versus tokens in the prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheHits {
    pub reused: u64,
    pub prompt: u64,
}

impl CacheHits {
    /// Reused / prompt tokens, or `None` before any prompt.
    pub fn rate(self) -> Option<f64> {
        (self.prompt > 0).then(|| self.reused as f64 / self.prompt as f64)
    }

    pub fn add(&mut self, other: CacheHits) {
        self.reused += other.reused;
        self.prompt += other.prompt;
    }
}

/// A snapshot of the engine's numbers, sent a few times a second while it works and after each turn.
#[derive(Clone, Debug, PartialEq)]
pub struct StatsSample {
    pub decode_tokens_per_second: Option<f64>,
    pub prefill_tokens_per_second: Option<f64>,
    pub time_to_first_token: Option<Duration>,
    pub process_memory_bytes: Option<u64>,
    pub machine_memory_bytes: Option<u64>,
    pub kv_tokens_used: usize,
    pub kv_tokens_capacity: usize,
    /// The element type the current KV cache holds.
    pub kv_cache: KvCacheType,
    /// Tokens of the current conversation (prompt plus reply so far).
    pub context_used: usize,
    pub context_limit: usize,
    pub turn_hits: CacheHits,
    pub session_hits: CacheHits,
    pub threads: usize,
    pub kernel_path: String,
    pub weight_format: WeightFormat,
    /// How the serving model computes decoded tokens' logits.
    pub unembedding: Unembedding,
    /// The activation format the serving session computes with.
    pub activations: ActivationFormat,
    /// Use of the KV snapshot tiers (RAM and disk) and turns resumed from them.
    pub kv_tiers: crate::engine::kv_tiers::TierUsage,
}

pub use crate::model::profile::{Phase, PhaseNanos};

/// What the forward passes did since the previous sample: which experts the router chose in each
/// layer, and where the time of the decode steps went. Sent with the stats while the engine works.
#[derive(Clone, Debug, PartialEq)]
pub struct ProfileSample {
    pub layers: usize,
    pub experts: usize,
    /// Experts each token is routed to (top-k).
    pub experts_per_token: usize,
    /// Router choices since the previous sample, [layers x experts], row-major.
    pub routing: Vec<u32>,
    /// Tokens (prompt and reply) behind `routing`.
    pub routed_tokens: u64,
    /// Distinct experts each layer has chosen so far this turn.
    pub turn_distinct: Vec<u16>,
    /// Decode steps timed since the previous sample.
    pub decode_steps: u64,
    /// Time per phase of those steps inside the forward pass, in [`Phase::ALL`] order.
    pub phase_nanos: PhaseNanos,
    /// Tokens decoded since the previous sample, as the engine saw them go by, and the wall time
    /// they took, sampling and parsing included.
    pub wall_steps: u64,
    pub decode_wall: Duration,
    /// Bytes one decoded token reads from memory at the current context (weights, routed experts,
    /// visible KV cache), when the model can tell.
    pub bytes_per_token: Option<u64>,
}

impl ProfileSample {
    /// Tokens per second of the decode steps of this sample.
    pub fn decode_rate(&self) -> Option<f64> {
        let seconds = self.decode_wall.as_secs_f64();
        (self.wall_steps > 0 && seconds > 0.0).then(|| self.wall_steps as f64 / seconds)
    }

    /// The memory traffic of those steps: bytes per token x tokens per second, in GB/s.
    pub fn effective_bandwidth_gbps(&self) -> Option<f64> {
        Some(self.bytes_per_token? as f64 * self.decode_rate()? / 1e9)
    }

    /// Each phase's share of the decode wall time, plus the time outside the forward pass
    /// (sampling, parsing, events) last; `None` before a decode step was timed.
    pub fn shares(&self) -> Option<[(&'static str, f64); 6]> {
        if self.decode_steps == 0 {
            return None;
        }
        // Per step: the pass's phases are timed over its steps, the wall over the tokens the
        // engine saw, which a sample boundary can split differently.
        let steps = self.decode_steps as f64;
        let inside = self.phase_nanos.iter().sum::<u64>() as f64 / steps;
        let wall = match self.wall_steps {
            0 => inside,
            tokens => (self.decode_wall.as_nanos() as f64 / tokens as f64).max(inside),
        };
        if wall <= 0.0 {
            return None;
        }
        let mut shares = [("outside", (wall - inside) / wall); 6];
        for (slot, phase) in shares.iter_mut().zip(Phase::ALL) {
            *slot = (
                phase.name(),
                self.phase_nanos[phase as usize] as f64 / steps / wall,
            );
        }
        Some(shares)
    }
}

/// What the engine runs, sent once the model is ready.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineInfo {
    /// e.g. "gpt-oss-20b (/models/gpt-oss-20b)" or "synthetic tiny".
    pub model_label: String,
    /// Synthetic checkpoints have random weights: their output is noise, and the UI says so.
    pub random_weights: bool,
    pub kernel_path: String,
    pub settings: Settings,
}

/// Engine -> UI.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    LoadProgress {
        stage: String,
        done: u64,
        total: u64,
    },
    Ready(EngineInfo),
    PrefillProgress {
        id: RequestId,
        done: usize,
        total: usize,
        reused: usize,
    },
    Token {
        id: RequestId,
        channel: Channel,
        text: String,
    },
    Stats(StatsSample),
    /// Routing and decode phase times since the previous sample (the engine view).
    Profile(Box<ProfileSample>),
    /// The machine's memory read bandwidth with the serving thread count, in GB/s; 0 from an
    /// engine whose weights are read elsewhere (a remote server).
    Bandwidth {
        gigabytes_per_second: f64,
        threads: usize,
    },
    /// Gauge rows only this engine has, as (label, value), replacing the ones sent before: a
    /// remote engine's server, network and server time.
    EngineGauges(Vec<(String, String)>),
    /// Settings, by config key, that this engine does not control (a remote server decides
    /// them): the settings panel shows `shown_as` for them and does not change them.
    SettingsFixed {
        keys: Vec<String>,
        shown_as: String,
    },
    TurnDone {
        id: RequestId,
        reason: StopReason,
        hits: CacheHits,
        generated_tokens: usize,
    },
    /// Background work for a settings change (re-quantization), `done` of `total` units.
    SettingsProgress {
        what: String,
        done: u64,
        total: u64,
    },
    SettingsApplied(Box<Settings>),
    /// A one-line message for the status line: a prefix resumed from a KV snapshot ("resumed
    /// 4,096 tokens from disk in 0.3 s"), a snapshot file skipped.
    Notice(String),
    Error {
        id: Option<RequestId>,
        message: String,
    },
}
