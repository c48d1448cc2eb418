//! The engine: sampling, the generation loop (shared by the TUI's engine thread, `ossterm run` and
//! the benchmark), and the engine thread with its protocol.

pub mod generate;
pub mod kv_tiers;
pub mod protocol;
pub mod sampler;
pub mod worker;

pub use generate::{
    check_logits, common_prefix_len, generate, resume_from_tiers, rewind_for_prompt, GenerateError,
    GenerateEvent, GenerateLimits, GenerateResult, InferenceSession, ReplyParser, Resumed,
    StopReason, TokenSampler,
};
pub use sampler::{Sampler, SamplerError, SamplerSettings};

/// The thread pool the forward pass computes on, as the app, every command and the benchmark
/// build it: `threads` named workers. A session holds it and runs its forward calls there.
pub fn build_pool(
    threads: usize,
) -> Result<std::sync::Arc<rayon::ThreadPool>, rayon::ThreadPoolBuildError> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|index| format!("ossterm-compute-{index}"))
        .build()
        .map(std::sync::Arc::new)
}

/// Default worker threads: one per physical core. Hyperthread siblings share a core's load units
/// and cache, so they add little to bandwidth-bound decode and contend in compute-bound prefill.
pub fn default_threads() -> usize {
    num_cpus::get_physical().max(1)
}
