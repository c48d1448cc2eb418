//! Output of the commands. `println!` panics when standard output is a closed pipe or a full
//! disk; the commands write through [`Out`] instead, whose every write returns an error, and
//! [`exit_code`] turns that error into the conventional ending.

use std::fmt;
use std::io::{StdoutLock, Write};
use std::process::ExitCode;

/// Exit status of a command whose reader went away (`ossterm render ... | head -1`): what the
/// shell reports for coreutils killed by SIGPIPE (128 + 13), printed without a message.
pub const BROKEN_PIPE_STATUS: u8 = 141;

/// A write to standard output failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot write to standard output: {0}")]
pub struct OutputError(std::io::Error);

impl OutputError {
    pub fn io(&self) -> &std::io::Error {
        &self.0
    }
}

/// Locked standard output whose writes return [`OutputError`]; `write!`/`writeln!` work on it.
pub struct Out {
    lock: StdoutLock<'static>,
}

pub fn stdout() -> Out {
    Out {
        lock: std::io::stdout().lock(),
    }
}

impl Out {
    pub fn write_fmt(&mut self, args: fmt::Arguments<'_>) -> Result<(), OutputError> {
        self.lock.write_fmt(args).map_err(OutputError)
    }

    pub fn write_all(&mut self, bytes: &[u8]) -> Result<(), OutputError> {
        self.lock.write_all(bytes).map_err(OutputError)
    }

    /// Pushes out what is buffered. Call it before returning success: a write error found only
    /// when the process exits is lost.
    pub fn flush(&mut self) -> Result<(), OutputError> {
        self.lock.flush().map_err(OutputError)
    }
}

/// Writes a line to standard error, ignoring failure (`eprintln!` panics on it). Progress and
/// notes are not the command's result, and there is nowhere left to report their loss.
pub fn note_args(args: fmt::Arguments<'_>) {
    let mut stderr = std::io::stderr().lock();
    let _ = stderr.write_fmt(args);
    let _ = stderr.write_all(b"\n");
}

/// `eprintln!` that never panics.
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::cli::output::note_args(format_args!($($arg)*))
    };
}
pub(crate) use note;

/// Whether `error` comes from writing to a reader that went away.
pub fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        let io = cause
            .downcast_ref::<OutputError>()
            .map(OutputError::io)
            .or_else(|| cause.downcast_ref::<std::io::Error>());
        io.is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// The error and its causes on one line, each cause once: many errors already quote their
/// cause in their own message, and `{:#}` would repeat it.
pub fn describe(error: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in error.chain() {
        let part = cause.to_string();
        if part.is_empty() || text.contains(&part) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&part);
    }
    text
}

/// How a command's result ends the process: 0; [`BROKEN_PIPE_STATUS`] quietly when the reader
/// of standard output went away; otherwise the message on standard error and 1.
pub fn exit_code(result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if is_broken_pipe(&error) => ExitCode::from(BROKEN_PIPE_STATUS),
        Err(error) => {
            note!("error: {}", describe(&error));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_quoted_by_its_error_is_printed_once() {
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "file not found");
        #[derive(Debug, thiserror::Error)]
        #[error("cannot read config.json: {source}")]
        struct Quoting {
            source: std::io::Error,
        }
        let error = anyhow::Error::new(Quoting { source: io }).context("cannot load the model");
        assert_eq!(
            describe(&error),
            "cannot load the model: cannot read config.json: file not found"
        );
    }

    #[test]
    fn a_broken_pipe_is_recognised_under_context() {
        let pipe = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        let error = anyhow::Error::new(OutputError(pipe)).context("writing ids");
        assert!(is_broken_pipe(&error));
        let full = std::io::Error::from(std::io::ErrorKind::StorageFull);
        assert!(!is_broken_pipe(&anyhow::Error::new(OutputError(full))));
    }
}
