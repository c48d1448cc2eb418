//! The engine thread and its protocol.

pub mod protocol;
pub mod worker;
