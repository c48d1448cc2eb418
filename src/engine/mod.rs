//! The engine: sampling, the generation loop (shared by the TUI's engine thread, `ossterm run` and
//! the benchmark), and the engine thread with its protocol.

pub mod generate;
pub mod protocol;
pub mod sampler;
pub mod worker;

pub use generate::{
    check_logits, common_prefix_len, generate, rewind_for_prompt, GenerateError, GenerateEvent,
    GenerateLimits, GenerateResult, InferenceSession, ReplyParser, StopReason, TokenSampler,
};
pub use sampler::{Sampler, SamplerError, SamplerSettings};

/// Runs `work` on a thread of the global rayon pool and returns its result.
///
/// The forward pass opens a few parallel regions per layer. Opened from a thread outside the pool,
/// each region is injected through rayon's global queue (which allocates a block every few dozen
/// jobs) and the caller sleeps until a worker picks it up; opened from a pool thread, the caller
/// works on the region itself and the other workers steal from its local queue. Generation loops
/// therefore run in here.
pub fn on_pool<T: Send>(work: impl FnOnce() -> T + Send) -> T {
    let mut result = None;
    rayon::scope(|_| result = Some(work()));
    result.expect("rayon::scope runs its closure before returning")
}

/// Default worker threads: one per physical core. Hyperthread siblings share a core's load units
/// and cache, so they add little to bandwidth-bound decode and contend in compute-bound prefill.
pub fn default_threads() -> usize {
    num_cpus::get_physical().max(1)
}
