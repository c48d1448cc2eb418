//! The engine: sampling and the generation loop shared by `ossterm run`, and the TUI's engine
//! thread with its protocol.

pub mod generate;
pub mod protocol;
pub mod sampler;
pub mod worker;

pub use generate::{
    generate, GenerateError, GenerateEvent, GenerateLimits, GenerateResult, InferenceSession,
    StopReason,
};
pub use sampler::{Sampler, SamplerError, SamplerSettings};
