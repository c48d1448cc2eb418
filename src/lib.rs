//! ossterm: gpt-oss on a CPU, in a terminal.
//!
//! The library holds everything; `main.rs` only hands the command line to [`cli`].
//! Modules follow the data flow: checkpoint files (`model`) and kernels feed the forward pass,
//! the `engine` thread drives it, `chat` speaks harmony, and `tui`/`cli` face the user.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod bench;
pub mod chat;
mod choice;
pub mod cli;
pub mod config;
pub mod engine;
pub mod fault;
pub mod kernels;
pub mod model;
pub mod remote;
pub mod server;
pub mod settings;
pub mod tui;
