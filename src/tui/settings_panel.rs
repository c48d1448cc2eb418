//! The settings rows: how each one is shown and changed with Left/Right.

use crate::engine::protocol::{
    ActivationFormat, KvCacheType, ReasoningEffort, Settings, WeightFormat,
};

/// One row of the settings panel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SettingField {
    Threads,
    WeightFormat,
    KvCache,
    ContextLimit,
    ReasoningEffort,
    Temperature,
    TopP,
    TopK,
    MinP,
    MaxTokens,
    Seed,
    KeepReasoning,
    Activations,
    SystemPrompt,
    DeveloperInstructions,
}

impl SettingField {
    pub const ALL: &'static [SettingField] = &[
        SettingField::Threads,
        SettingField::WeightFormat,
        SettingField::KvCache,
        SettingField::ContextLimit,
        SettingField::ReasoningEffort,
        SettingField::Temperature,
        SettingField::TopP,
        SettingField::TopK,
        SettingField::MinP,
        SettingField::MaxTokens,
        SettingField::Seed,
        SettingField::KeepReasoning,
        // Here rather than beside the weight format: rows above keep their places, which the
        // end-to-end script (tools/tmux_e2e.sh) counts Down presses to reach.
        SettingField::Activations,
        SettingField::SystemPrompt,
        SettingField::DeveloperInstructions,
    ];

    pub fn label(self) -> &'static str {
        match self {
            SettingField::Threads => "threads",
            SettingField::WeightFormat => "weight format",
            SettingField::KvCache => "KV cache",
            SettingField::ContextLimit => "context limit",
            SettingField::ReasoningEffort => "reasoning effort",
            SettingField::Temperature => "temperature",
            SettingField::TopP => "top-p",
            SettingField::TopK => "top-k",
            SettingField::MinP => "min-p",
            SettingField::MaxTokens => "max tokens",
            SettingField::Seed => "seed",
            SettingField::KeepReasoning => "keep reasoning",
            SettingField::Activations => "activations",
            SettingField::SystemPrompt => "system prompt",
            SettingField::DeveloperInstructions => "developer instr.",
        }
    }

    /// Text settings are edited in an overlay rather than stepped.
    pub fn is_text(self) -> bool {
        matches!(
            self,
            SettingField::SystemPrompt | SettingField::DeveloperInstructions
        )
    }

    pub fn value(self, settings: &Settings) -> String {
        let sampling = &settings.sampling;
        match self {
            SettingField::Threads => settings.threads.to_string(),
            SettingField::WeightFormat => settings.weight_format.to_string(),
            SettingField::KvCache => settings.kv_cache.to_string(),
            SettingField::ContextLimit => settings.context_limit.to_string(),
            SettingField::ReasoningEffort => settings.reasoning_effort.to_string(),
            SettingField::Temperature => format!("{:.2}", sampling.temperature),
            SettingField::TopP => format!("{:.2}", sampling.top_p),
            SettingField::TopK if sampling.top_k == 0 => "off".to_string(),
            SettingField::TopK => sampling.top_k.to_string(),
            SettingField::MinP if sampling.min_p == 0.0 => "off".to_string(),
            SettingField::MinP => format!("{:.2}", sampling.min_p),
            SettingField::MaxTokens => sampling.max_tokens.to_string(),
            SettingField::Seed => sampling
                .seed
                .map_or("random".to_string(), |seed| seed.to_string()),
            SettingField::KeepReasoning => if settings.keep_reasoning_in_context {
                "yes"
            } else {
                "no"
            }
            .to_string(),
            SettingField::Activations => settings.activations.to_string(),
            SettingField::SystemPrompt => one_line(&settings.system_prompt),
            SettingField::DeveloperInstructions => one_line(&settings.developer_instructions),
        }
    }

    /// The text a text setting starts its editor with.
    pub fn text(self, settings: &Settings) -> Option<&str> {
        match self {
            SettingField::SystemPrompt => Some(&settings.system_prompt),
            SettingField::DeveloperInstructions => Some(&settings.developer_instructions),
            _ => None,
        }
    }

    pub fn set_text(self, settings: &mut Settings, text: String) {
        match self {
            SettingField::SystemPrompt => settings.system_prompt = text,
            SettingField::DeveloperInstructions => settings.developer_instructions = text,
            _ => {}
        }
    }

    /// Steps the value one notch up (`direction` > 0) or down, within its valid range.
    pub fn step(self, settings: &mut Settings, direction: i32, max_threads: usize) {
        let up = direction > 0;
        let sampling = &mut settings.sampling;
        match self {
            SettingField::Threads => {
                settings.threads = step_int(settings.threads, up, 1, 1, max_threads.max(1))
            }
            SettingField::WeightFormat => {
                settings.weight_format = WeightFormat::cycle(settings.weight_format, sign(up))
            }
            SettingField::KvCache => {
                settings.kv_cache = KvCacheType::cycle(settings.kv_cache, sign(up))
            }
            SettingField::ContextLimit => {
                settings.context_limit = step_doubling(settings.context_limit, up, 256, 131_072)
            }
            SettingField::ReasoningEffort => {
                settings.reasoning_effort =
                    ReasoningEffort::cycle(settings.reasoning_effort, sign(up))
            }
            SettingField::Temperature => {
                sampling.temperature = step_float(sampling.temperature, up, 0.05, 0.0, 2.0)
            }
            SettingField::TopP => sampling.top_p = step_float(sampling.top_p, up, 0.05, 0.05, 1.0),
            SettingField::TopK => sampling.top_k = step_int(sampling.top_k, up, 5, 0, 200),
            SettingField::MinP => sampling.min_p = step_float(sampling.min_p, up, 0.01, 0.0, 0.5),
            SettingField::MaxTokens => {
                sampling.max_tokens = step_doubling(sampling.max_tokens, up, 16, 131_072)
            }
            SettingField::Seed => {
                sampling.seed = match (sampling.seed, up) {
                    (None, true) => Some(0),
                    (None, false) => None,
                    (Some(0), false) => None,
                    (Some(seed), true) => Some(seed.saturating_add(1)),
                    (Some(seed), false) => Some(seed - 1),
                }
            }
            SettingField::KeepReasoning => {
                settings.keep_reasoning_in_context = !settings.keep_reasoning_in_context
            }
            SettingField::Activations => {
                settings.activations = ActivationFormat::cycle(settings.activations, sign(up))
            }
            SettingField::SystemPrompt | SettingField::DeveloperInstructions => {}
        }
    }
}

fn sign(up: bool) -> isize {
    if up {
        1
    } else {
        -1
    }
}

fn step_int(value: usize, up: bool, step: usize, min: usize, max: usize) -> usize {
    if up {
        value.saturating_add(step).min(max)
    } else {
        value.saturating_sub(step).max(min)
    }
}

fn step_doubling(value: usize, up: bool, min: usize, max: usize) -> usize {
    if up {
        value.saturating_mul(2).min(max)
    } else {
        (value / 2).max(min)
    }
}

/// Steps a float and rounds to the step's grid so repeated steps never drift (0.1 + 0.05 ...).
fn step_float(value: f32, up: bool, step: f32, min: f32, max: f32) -> f32 {
    let next = if up { value + step } else { value - step };
    ((next / step).round() * step).clamp(min, max)
}

fn one_line(text: &str) -> String {
    if text.trim().is_empty() {
        return "(none)".to_string();
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_stay_in_range() {
        let mut settings = Settings::default();
        settings.sampling.top_p = 1.0;
        SettingField::TopP.step(&mut settings, 1, 2);
        assert_eq!(settings.sampling.top_p, 1.0);
        SettingField::TopP.step(&mut settings, -1, 2);
        assert!((settings.sampling.top_p - 0.95).abs() < 1e-6);
        settings.threads = 2;
        SettingField::Threads.step(&mut settings, 1, 2);
        assert_eq!(settings.threads, 2);
        SettingField::Threads.step(&mut settings, -1, 2);
        SettingField::Threads.step(&mut settings, -1, 2);
        assert_eq!(settings.threads, 1);
        SettingField::Seed.step(&mut settings, 1, 2);
        assert_eq!(settings.sampling.seed, Some(0));
        SettingField::Seed.step(&mut settings, -1, 2);
        assert_eq!(settings.sampling.seed, None);
        assert_eq!(SettingField::TopK.value(&settings), "off");
    }

    #[test]
    fn activations_cycle_through_every_format_both_ways() {
        let mut settings = Settings::default();
        assert_eq!(SettingField::Activations.value(&settings), "mixed");
        let mut seen = Vec::new();
        for _ in 0..ActivationFormat::ALL.len() {
            SettingField::Activations.step(&mut settings, 1, 2);
            seen.push(SettingField::Activations.value(&settings));
        }
        assert_eq!(seen, ["q8x2", "q8", "mixed"]);
        SettingField::Activations.step(&mut settings, -1, 2);
        assert_eq!(settings.activations, ActivationFormat::Q8);
    }
}
