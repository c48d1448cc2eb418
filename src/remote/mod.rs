//! The app on a remote engine (`--remote URL`): a backend of the engine-thread protocol that
//! asks an OpenAI-compatible chat-completions server (vLLM, SGLang, llama-server, ollama,
//! `ossterm serve`) instead of running the model. `client` speaks HTTP and SSE, `reply` reads
//! the streamed deltas into channels (ossterm's harmony parser for servers that send raw
//! harmony), `session` holds one server's conversation state for the engine and for
//! `ossterm run --remote`, and `engine` is the engine thread.

pub mod client;
pub mod engine;
pub mod reply;
pub mod session;

pub use client::{RemoteError, RemoteTarget, DEFAULT_API_KEY_ENV, DEFAULT_IDLE_TIMEOUT};
pub use engine::{spawn_remote_engine, RemoteConfig, SERVER_SETTINGS, SHOWN_AS_SERVER};
pub use session::{RemoteSession, SessionError};
