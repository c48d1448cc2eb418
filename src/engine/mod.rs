//! The engine: sampling, the generation loop shared by `ossterm run` and the TUI's engine thread.
