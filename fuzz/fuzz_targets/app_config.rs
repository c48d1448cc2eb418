//! The TOML app config (`~/.config/ossterm/config.toml` or `--config FILE`), through
//! `config::parse`, the function `config::load_file` hands the file's text to.
//! Invariants: no panic, error messages render and name the file, heap under the bound.
#![no_main]

use std::path::Path;

use libfuzzer_sys::fuzz_target;
use ossterm_fuzz::LimitingAllocator;

/// Inputs are at most a few KiB of text; the TOML tree and the config stay far below this.
#[global_allocator]
static ALLOC: LimitingAllocator = LimitingAllocator::with_limit_mib(64);

fuzz_target!(|data: &[u8]| {
    // load_file reads with read_to_string: a file that is not UTF-8 never reaches the parser.
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(error) = ossterm::config::parse(text, Path::new("config.toml")) {
        let message = error.to_string();
        assert!(message.starts_with("config file config.toml"), "{message}");
    }
});
