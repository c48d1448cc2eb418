//! The engine: sampling and the generation loop shared by `ossterm run` and the TUI's engine
//! thread.

pub mod generate;
pub mod sampler;

pub use generate::{
    generate, GenerateError, GenerateEvent, GenerateLimits, GenerateResult, InferenceSession,
    StopReason,
};
pub use sampler::{Sampler, SamplerError, SamplerSettings};
