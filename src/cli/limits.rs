//! Sizes from the command line, checked before anything is allocated: against the model's
//! context and against the memory of the machine, with errors that give the numbers.

use crate::model::Model;

use super::model_cmds::human_bytes;

/// The sum of the sizes in `parts` (flag or meaning, value), or an error naming them.
pub fn positions(parts: &[(&str, usize)]) -> anyhow::Result<usize> {
    parts
        .iter()
        .try_fold(0usize, |sum, (_, value)| sum.checked_add(*value))
        .ok_or_else(|| anyhow::anyhow!("{} add up to more than any context holds", spell(parts)))
}

/// Checks that a session of `context` positions, which `parts` add up to, fits the model's
/// context and the machine's memory.
pub fn check_context(model: &Model, context: usize, parts: &[(&str, usize)]) -> anyhow::Result<()> {
    let limit = model.config.max_position_embeddings;
    if context > limit {
        anyhow::bail!(
            "{} need {context} positions, but the model's context holds {limit}",
            spell(parts)
        );
    }
    let needed = session_bytes(model, context);
    let machine = crate::engine::worker::read_memory_usage().machine_bytes;
    if let (Some(needed), Some(machine)) = (needed, machine) {
        if needed > machine {
            anyhow::bail!(
                "{} need a KV cache of {context} positions, {} ({needed} bytes), but this machine has {} of memory",
                spell(parts),
                human_bytes(needed),
                human_bytes(machine)
            );
        }
    }
    if needed.is_none() {
        anyhow::bail!("{} need more memory than can be counted", spell(parts));
    }
    Ok(())
}

/// Bytes a session of `context` positions allocates: keys and values of every layer, and the ids.
pub fn session_bytes(model: &Model, context: usize) -> Option<u64> {
    let c = &model.config;
    let per_position = crate::model::kv::KvShape::of(c).bytes_per_position(model.kv_format)
        + std::mem::size_of::<u32>();
    (context as u64).checked_mul(per_position as u64)
}

/// "--max-tokens 5 plus the 3 prompt tokens".
fn spell(parts: &[(&str, usize)]) -> String {
    parts
        .iter()
        .map(|(what, value)| {
            if what.starts_with("--") {
                format!("{what} {value}")
            } else {
                format!("the {value} {what}")
            }
        })
        .collect::<Vec<_>>()
        .join(" plus ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_that_overflow_are_an_error_naming_the_flags() {
        let error = positions(&[("--max-tokens", usize::MAX), ("prompt tokens", 3)])
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("--max-tokens 18446744073709551615"),
            "{error}"
        );
        assert!(error.contains("the 3 prompt tokens"), "{error}");
        assert_eq!(
            positions(&[("--depth", 4), ("--prompt-tokens", 5)]).unwrap(),
            9
        );
    }
}
