//! Every setting of the app, described once: its name, the values it takes, the config key, the
//! command-line flag, the field of the protocol's [`Settings`] it lives in, and what applying it
//! costs. The settings panel, the app's flags and the config file's keys and validation are all
//! read from [`SETTINGS`], so a new setting is one entry here (plus its field in `Settings`).

use crate::engine::protocol::{
    ActivationFormat, AttentionArithmetic, KvCacheType, ReasoningEffort, Settings, Unembedding,
    WeightFormat,
};

/// A setting's value in the shape its [`Kind`] gives it.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Count(u64),
    Real(f32),
    Choice(&'static str),
    Switch(bool),
    Text(String),
    /// A seed, or `None` for a fresh one every run.
    Seed(Option<u64>),
}

/// How the settings panel steps a whole number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    Add(u64),
    Double,
}

/// The panel's upper end for a whole number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PanelMax {
    Fixed(u64),
    /// As many as the machine runs threads at once.
    Threads,
}

/// What 0 means for a whole number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Zero {
    /// An ordinary value (or out of range if `min` is above it).
    Plain,
    /// The filter is off: the panel shows "off".
    Off,
    /// In the config file or on the command line: keep the default.
    Default,
}

/// One end of a real interval.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bound {
    Closed(f32),
    Open(f32),
}

/// The values a setting takes, how they are checked and how the panel steps them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Count {
        min: u64,
        /// `None`: no upper limit.
        max: Option<u64>,
        zero: Zero,
        step: Step,
        panel_min: u64,
        panel_max: PanelMax,
        /// Said after the range in an error, e.g. " tokens".
        note: &'static str,
    },
    Real {
        min: Bound,
        max: Bound,
        /// 0 shows as "off".
        zero_off: bool,
        step: f32,
        panel_min: f32,
        panel_max: f32,
        note: &'static str,
    },
    Choice {
        names: &'static [&'static str],
    },
    Switch,
    /// Free text, edited in an overlay.
    Text,
    Seed,
}

/// What applying a change costs, from the cheapest; the status line says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cost {
    /// Read at the next turn (sampling, budgets).
    Free,
    /// The rendered prompt changes from its first message on: the next turn re-prefills.
    PromptPrefix,
    /// A new KV cache: the next turn re-prefills.
    NewCache,
    /// Weights re-quantized in the background while the old ones keep serving.
    Requantize,
    /// The thread pool is rebuilt between turns.
    PoolRebuild,
}

/// One setting, described once.
#[derive(Debug)]
pub struct Setting {
    /// In notices and docs: "developer instructions".
    pub name: &'static str,
    /// The settings panel's row (at most 17 cells): "developer instr.".
    pub label: &'static str,
    /// Dotted key of the config file.
    pub key: &'static str,
    /// Long flag of the app, without the dashes; `None`: config file and panel only.
    pub flag: Option<&'static str>,
    pub value_name: &'static str,
    /// One line for the flag's help.
    pub help: &'static str,
    pub kind: Kind,
    pub cost: Cost,
    /// Reads the protocol field.
    pub get: fn(&Settings) -> Value,
    /// Writes the protocol field; only handed values of this setting's kind that passed
    /// [`Setting::check`].
    pub set: fn(&mut Settings, Value),
}

/// Field access for [`Setting::get`]/[`Setting::set`], from the value's variant and field path.
macro_rules! field {
    (Count, $($path:ident).+, $ty:ty) => {
        (
            |settings| Value::Count(settings.$($path).+ as u64),
            |settings, value| {
                if let Value::Count(count) = value {
                    settings.$($path).+ = <$ty>::try_from(count).unwrap_or(<$ty>::MAX);
                }
            },
        )
    };
    (Choice, $($path:ident).+, $ty:ty) => {
        (
            |settings| Value::Choice(settings.$($path).+.name()),
            |settings, value| {
                if let Some(choice) = value.choice().and_then(<$ty>::from_name) {
                    settings.$($path).+ = choice;
                }
            },
        )
    };
    // Real, Switch, Text and Seed: the value's variant holds the field's own type.
    ($variant:ident, $($path:ident).+) => {
        (
            |settings| Value::$variant(Clone::clone(&settings.$($path).+)),
            |settings, value| {
                if let Value::$variant(field) = value {
                    settings.$($path).+ = field;
                }
            },
        )
    };
}

/// Builds a [`Setting`] from the field access pair of [`field!`].
macro_rules! setting {
    (
        name: $name:literal, label: $label:literal, key: $key:literal, flag: $flag:expr,
        value_name: $value_name:literal, help: $help:literal, kind: $kind:expr, cost: $cost:expr,
        field: ($($field:tt)*) $(,)?
    ) => {{
        const ACCESS: (fn(&Settings) -> Value, fn(&mut Settings, Value)) = field!($($field)*);
        Setting {
            name: $name,
            label: $label,
            key: $key,
            flag: $flag,
            value_name: $value_name,
            help: $help,
            kind: $kind,
            cost: $cost,
            get: ACCESS.0,
            set: ACCESS.1,
        }
    }};
}

/// The settings, in the panel's order. The first twelve rows keep their places: the end-to-end
/// script (tools/tmux_e2e.sh) counts Down presses to reach them.
pub static SETTINGS: &[Setting] = &[
    setting! {
        name: "threads", label: "threads", key: "engine.threads", flag: Some("threads"),
        value_name: "N", help: "Worker threads of the forward pass (0 = all cores)",
        kind: Kind::Count {
            min: 1, max: Some(1024), zero: Zero::Default, step: Step::Add(1),
            panel_min: 1, panel_max: PanelMax::Threads, note: " (0 = all cores)",
        },
        cost: Cost::PoolRebuild, field: (Count, threads, usize),
    },
    setting! {
        name: "weight format", label: "weight format", key: "engine.weight_format",
        flag: Some("weight-format"), value_name: "FORMAT",
        help: "How attention and unembedding weights are held",
        kind: Kind::Choice { names: WeightFormat::NAMES },
        cost: Cost::Requantize, field: (Choice, weight_format, WeightFormat),
    },
    setting! {
        name: "KV cache", label: "KV cache", key: "engine.kv_cache", flag: Some("kv-cache"),
        value_name: "TYPE", help: "Element type of the KV cache",
        kind: Kind::Choice { names: KvCacheType::NAMES },
        cost: Cost::NewCache, field: (Choice, kv_cache, KvCacheType),
    },
    setting! {
        name: "context limit", label: "context limit", key: "engine.context_limit",
        flag: Some("context-limit"), value_name: "TOKENS",
        help: "Most tokens of one conversation",
        kind: Kind::Count {
            min: 256, max: Some(131_072), zero: Zero::Plain, step: Step::Double,
            panel_min: 256, panel_max: PanelMax::Fixed(131_072), note: " tokens",
        },
        cost: Cost::NewCache, field: (Count, context_limit, usize),
    },
    setting! {
        name: "reasoning effort", label: "reasoning effort", key: "chat.reasoning_effort",
        flag: Some("reasoning-effort"), value_name: "EFFORT",
        help: "Reasoning effort of the system message",
        kind: Kind::Choice { names: ReasoningEffort::NAMES },
        cost: Cost::PromptPrefix, field: (Choice, reasoning_effort, ReasoningEffort),
    },
    setting! {
        name: "temperature", label: "temperature", key: "sampling.temperature",
        flag: Some("temperature"), value_name: "T", help: "Sampling temperature, 0 = greedy",
        kind: Kind::Real {
            min: Bound::Closed(0.0), max: Bound::Closed(10.0), zero_off: false, step: 0.05,
            panel_min: 0.0, panel_max: 2.0, note: " (0 = greedy)",
        },
        cost: Cost::Free, field: (Real, sampling.temperature),
    },
    setting! {
        name: "top-p", label: "top-p", key: "sampling.top_p", flag: Some("top-p"),
        value_name: "P", help: "Nucleus sampling mass",
        kind: Kind::Real {
            min: Bound::Open(0.0), max: Bound::Closed(1.0), zero_off: false, step: 0.05,
            panel_min: 0.05, panel_max: 1.0, note: "",
        },
        cost: Cost::Free, field: (Real, sampling.top_p),
    },
    setting! {
        name: "top-k", label: "top-k", key: "sampling.top_k", flag: Some("top-k"),
        value_name: "K", help: "Keep the K most likely tokens, 0 = off",
        kind: Kind::Count {
            min: 0, max: None, zero: Zero::Off, step: Step::Add(5),
            panel_min: 0, panel_max: PanelMax::Fixed(200), note: "",
        },
        cost: Cost::Free, field: (Count, sampling.top_k, usize),
    },
    setting! {
        name: "min-p", label: "min-p", key: "sampling.min_p", flag: Some("min-p"),
        value_name: "P",
        help: "Drop tokens below this fraction of the top one's probability, 0 = off",
        kind: Kind::Real {
            min: Bound::Closed(0.0), max: Bound::Open(1.0), zero_off: true, step: 0.01,
            panel_min: 0.0, panel_max: 0.5, note: "",
        },
        cost: Cost::Free, field: (Real, sampling.min_p),
    },
    setting! {
        name: "max tokens", label: "max tokens", key: "sampling.max_tokens",
        flag: Some("max-tokens"), value_name: "N",
        help: "Most tokens one reply may generate, reasoning included",
        kind: Kind::Count {
            min: 1, max: None, zero: Zero::Plain, step: Step::Double,
            panel_min: 16, panel_max: PanelMax::Fixed(131_072), note: "",
        },
        cost: Cost::Free, field: (Count, sampling.max_tokens, usize),
    },
    setting! {
        name: "seed", label: "seed", key: "sampling.seed", flag: Some("seed"), value_name: "N",
        help: "Fixed sampling seed (default: a fresh one every run)",
        kind: Kind::Seed, cost: Cost::Free, field: (Seed, sampling.seed),
    },
    setting! {
        name: "keep reasoning", label: "keep reasoning", key: "chat.keep_reasoning_in_context",
        flag: None, value_name: "BOOL",
        help: "Keep earlier turns' reasoning in the prompt",
        kind: Kind::Switch, cost: Cost::Free, field: (Switch, keep_reasoning_in_context),
    },
    setting! {
        name: "activations", label: "activations", key: "engine.activations",
        flag: Some("activations"), value_name: "FORMAT",
        help: "Int8 inputs of quantized products",
        kind: Kind::Choice { names: ActivationFormat::NAMES },
        cost: Cost::NewCache, field: (Choice, activations, ActivationFormat),
    },
    setting! {
        name: "unembedding", label: "unembedding", key: "engine.unembedding",
        flag: Some("unembedding"), value_name: "MODE",
        help: "Decoded logits: a q4 draft of every row and the 64 best again (two-stage), or every row (full)",
        kind: Kind::Choice { names: Unembedding::NAMES },
        cost: Cost::Requantize, field: (Choice, unembedding, Unembedding),
    },
    setting! {
        name: "attention", label: "attention", key: "engine.attention",
        flag: Some("attention"), value_name: "ARITHMETIC",
        help: "Attention over the f16 KV cache: auto (bf16 on the AMX matrix unit where the CPU has AMX-BF16, else bf16 dot products where the CPU has AVX-512 BF16 and issues them fast), f32 or bf16; the q8 cache takes int8 dot products on the AVX-512 path unless f32",
        kind: Kind::Choice { names: AttentionArithmetic::NAMES },
        cost: Cost::NewCache, field: (Choice, attention, AttentionArithmetic),
    },
    setting! {
        name: "system prompt", label: "system prompt", key: "chat.system_prompt", flag: None,
        value_name: "TEXT", help: "Identity line of the harmony system message",
        kind: Kind::Text, cost: Cost::PromptPrefix, field: (Text, system_prompt),
    },
    setting! {
        name: "developer instructions", label: "developer instr.",
        key: "chat.developer_instructions", flag: None, value_name: "TEXT",
        help: "Developer message instructions; empty = none",
        kind: Kind::Text, cost: Cost::PromptPrefix, field: (Text, developer_instructions),
    },
];

/// The setting with config key `key`.
pub fn by_key(key: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|setting| setting.key == key)
}

/// The setting with panel label `label`.
pub fn by_label(label: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|setting| setting.label == label)
}

impl Value {
    pub fn choice(&self) -> Option<&'static str> {
        match self {
            Value::Choice(name) => Some(name),
            _ => None,
        }
    }
}

/// Text the flag or key did not parse as: what was expected.
pub type ParseError = String;

impl Setting {
    /// Text settings are edited in an overlay rather than stepped.
    pub fn is_text(&self) -> bool {
        self.kind == Kind::Text
    }

    /// Parses a command-line value (the value is then [`Setting::check`]ed). `None`: keep the
    /// default (0 where [`Zero::Default`]).
    pub fn parse_text(&self, text: &str) -> Result<Option<Value>, ParseError> {
        let value = match self.kind {
            Kind::Count { .. } => Value::Count(
                text.trim()
                    .parse()
                    .map_err(|_| format!("expected a whole number, got {text:?}"))?,
            ),
            Kind::Real { .. } => {
                let real: f32 = text
                    .trim()
                    .parse()
                    .map_err(|_| format!("expected a number, got {text:?}"))?;
                Value::Real(real)
            }
            Kind::Choice { names } => Value::Choice(
                names
                    .iter()
                    .copied()
                    .find(|name| *name == text)
                    .ok_or_else(|| one_of(names, text))?,
            ),
            Kind::Switch => match text {
                "true" | "yes" | "on" => Value::Switch(true),
                "false" | "no" | "off" => Value::Switch(false),
                _ => return Err(format!("expected true or false, got {text:?}")),
            },
            Kind::Text => Value::Text(text.to_string()),
            Kind::Seed => Value::Seed(Some(
                text.trim()
                    .parse()
                    .map_err(|_| format!("expected a whole number, got {text:?}"))?,
            )),
        };
        self.normalize(value)
    }

    /// Converts a config file value; the error says what was expected.
    pub fn parse_toml(&self, value: &toml::Value) -> Result<Option<Value>, ParseError> {
        let got = || format!("got {value}");
        let parsed = match (self.kind, value) {
            (Kind::Count { .. }, toml::Value::Integer(count)) => Value::Count(
                u64::try_from(*count)
                    .map_err(|_| format!("expected a whole number of at least 0, {}", got()))?,
            ),
            (Kind::Count { .. }, _) => return Err(format!("expected a whole number, {}", got())),
            (Kind::Real { .. }, toml::Value::Float(real)) => Value::Real(*real as f32),
            (Kind::Real { .. }, toml::Value::Integer(count)) => Value::Real(*count as f32),
            (Kind::Real { .. }, _) => return Err(format!("expected a number, {}", got())),
            (Kind::Choice { names }, toml::Value::String(text)) => {
                return self.parse_text(text).map_err(|_| one_of(names, text))
            }
            (Kind::Choice { names }, _) => {
                return Err(format!("expected one of {}, {}", names.join(", "), got()))
            }
            (Kind::Switch, toml::Value::Boolean(on)) => Value::Switch(*on),
            (Kind::Switch, _) => return Err(format!("expected true or false, {}", got())),
            (Kind::Text, toml::Value::String(text)) => Value::Text(text.clone()),
            (Kind::Text, _) => return Err(format!("expected a string, {}", got())),
            (Kind::Seed, toml::Value::Integer(seed)) => {
                Value::Seed(Some(u64::try_from(*seed).map_err(|_| {
                    format!("expected a whole number of at least 0, {}", got())
                })?))
            }
            (Kind::Seed, _) => return Err(format!("expected a whole number, {}", got())),
        };
        self.normalize(parsed)
    }

    /// 0 of a [`Zero::Default`] count means "keep the default".
    fn normalize(&self, value: Value) -> Result<Option<Value>, ParseError> {
        match (self.kind, &value) {
            (
                Kind::Count {
                    zero: Zero::Default,
                    ..
                },
                Value::Count(0),
            ) => Ok(None),
            _ => Ok(Some(value)),
        }
    }

    /// Whether `value` is in range; the error says what was expected.
    pub fn check(&self, value: &Value) -> Result<(), ParseError> {
        match (self.kind, value) {
            (
                Kind::Count {
                    min,
                    max,
                    zero,
                    note,
                    ..
                },
                Value::Count(count),
            ) => {
                let zero_allowed = *count == 0 && zero == Zero::Off;
                let in_range = *count >= min && max.is_none_or(|max| *count <= max);
                if zero_allowed || in_range {
                    return Ok(());
                }
                Err(match max {
                    Some(max) => format!("expected {min}..={max}{note}, got {count}"),
                    None => format!("expected at least {min}{note}, got {count}"),
                })
            }
            (Kind::Real { min, max, note, .. }, Value::Real(real)) => {
                let above = match min {
                    Bound::Closed(min) => *real >= min,
                    Bound::Open(min) => *real > min,
                };
                let below = match max {
                    Bound::Closed(max) => *real <= max,
                    Bound::Open(max) => *real < max,
                };
                if real.is_finite() && above && below {
                    return Ok(());
                }
                let (open, low) = match min {
                    Bound::Closed(low) => ('[', low),
                    Bound::Open(low) => ('(', low),
                };
                let (close, high) = match max {
                    Bound::Closed(high) => (']', high),
                    Bound::Open(high) => (')', high),
                };
                Err(format!(
                    "expected a value in {open}{low}, {high}{close}{note}, got {real}"
                ))
            }
            (Kind::Choice { names }, Value::Choice(name)) if names.contains(name) => Ok(()),
            (Kind::Choice { names }, Value::Choice(name)) => Err(one_of(names, name)),
            (Kind::Switch, Value::Switch(_))
            | (Kind::Text, Value::Text(_))
            | (Kind::Seed, Value::Seed(_)) => Ok(()),
            (_, other) => Err(format!("a value of another kind: {other:?}")),
        }
    }

    /// Checks `value` and writes it into `settings`.
    pub fn apply(&self, settings: &mut Settings, value: Value) -> Result<(), ParseError> {
        self.check(&value)?;
        (self.set)(settings, value);
        Ok(())
    }

    /// The value as the panel shows it.
    pub fn display(&self, settings: &Settings) -> String {
        match ((self.get)(settings), self.kind) {
            (
                Value::Count(0),
                Kind::Count {
                    zero: Zero::Off, ..
                },
            ) => "off".to_string(),
            (Value::Count(count), _) => count.to_string(),
            (Value::Real(0.0), Kind::Real { zero_off: true, .. }) => "off".to_string(),
            (Value::Real(real), _) => format!("{real:.2}"),
            (Value::Choice(name), _) => name.to_string(),
            (Value::Switch(on), _) => if on { "yes" } else { "no" }.to_string(),
            (Value::Text(text), _) => one_line(&text),
            (Value::Seed(seed), _) => seed.map_or("random".to_string(), |seed| seed.to_string()),
        }
    }

    /// The text a text setting's editor starts with.
    pub fn text(&self, settings: &Settings) -> Option<String> {
        match (self.get)(settings) {
            Value::Text(text) => Some(text),
            _ => None,
        }
    }

    /// Steps the value one notch up (`up`) or down within the panel's range; `max_threads` bounds
    /// [`PanelMax::Threads`].
    pub fn step(&self, settings: &mut Settings, up: bool, max_threads: usize) {
        let next = match ((self.get)(settings), self.kind) {
            (
                Value::Count(count),
                Kind::Count {
                    step,
                    panel_min,
                    panel_max,
                    ..
                },
            ) => {
                let max = match panel_max {
                    PanelMax::Fixed(max) => max,
                    PanelMax::Threads => max_threads.max(1) as u64,
                };
                Value::Count(match (step, up) {
                    (Step::Add(step), true) => count.saturating_add(step).min(max),
                    (Step::Add(step), false) => count.saturating_sub(step).max(panel_min),
                    (Step::Double, true) => count.saturating_mul(2).min(max),
                    (Step::Double, false) => (count / 2).max(panel_min),
                })
            }
            (
                Value::Real(real),
                Kind::Real {
                    step,
                    panel_min,
                    panel_max,
                    ..
                },
            ) => {
                // Rounded to the step's grid so repeated steps never drift (0.1 + 0.05 ...).
                let next = if up { real + step } else { real - step };
                Value::Real(((next / step).round() * step).clamp(panel_min, panel_max))
            }
            (Value::Choice(name), Kind::Choice { names }) => {
                let index = names.iter().position(|known| *known == name).unwrap_or(0);
                let count = names.len() as isize;
                let next = (index as isize + if up { 1 } else { -1 }).rem_euclid(count);
                Value::Choice(names[next as usize])
            }
            (Value::Switch(on), _) => Value::Switch(!on),
            (Value::Seed(seed), _) => Value::Seed(match (seed, up) {
                (None, true) => Some(0),
                (None, false) | (Some(0), false) => None,
                (Some(seed), true) => Some(seed.saturating_add(1)),
                (Some(seed), false) => Some(seed - 1),
            }),
            (Value::Text(_), _) => return,
            (value, _) => value,
        };
        (self.set)(settings, next);
    }

    /// What the user should know about this setting having changed to its value in `next`.
    fn change_notice(&self, next: &Settings) -> Option<String> {
        let value = self.display(next);
        let name = capitalize(self.name);
        match self.cost {
            Cost::Free => None,
            Cost::PromptPrefix if self.is_text() => Some(format!("The {} changed", self.name)),
            Cost::PromptPrefix => Some(format!("{name} {value} changes the system message")),
            Cost::NewCache => Some(format!("{name} {value} needs a new cache")),
            Cost::Requantize => Some(format!(
                "{name} {value}: the weights are rebuilt in the background; the old weights keep \
                 serving"
            )),
            Cost::PoolRebuild => Some(format!(
                "{name} {value}: the thread pool is rebuilt between turns"
            )),
        }
    }
}

/// What the user should know about going from `previous` to `next`: the costliest consequence
/// for the conversation first (a whole-conversation re-prefill, then a background
/// re-quantization, then a pool rebuild).
pub fn change_notice(previous: &Settings, next: &Settings, has_turns: bool) -> Option<String> {
    const REPREFILL: &str = "the next turn re-prefills the whole conversation";
    let rank = |cost: Cost| match cost {
        Cost::PromptPrefix => 0,
        Cost::NewCache => 1,
        Cost::Requantize => 2,
        Cost::PoolRebuild => 3,
        Cost::Free => 4,
    };
    let changed = SETTINGS
        .iter()
        .filter(|setting| setting.cost != Cost::Free)
        .filter(|setting| (setting.get)(previous) != (setting.get)(next))
        .min_by_key(|setting| rank(setting.cost))?;
    let notice = changed.change_notice(next)?;
    let reprefills = matches!(changed.cost, Cost::PromptPrefix | Cost::NewCache);
    Some(if reprefills && has_turns {
        format!("{notice}: {REPREFILL}")
    } else {
        notice
    })
}

fn one_of(names: &[&str], text: &str) -> String {
    format!("expected one of {}, got {text:?}", names.join(", "))
}

fn one_line(text: &str) -> String {
    if text.trim().is_empty() {
        return "(none)".to_string();
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn capitalize(text: &str) -> String {
    let mut characters = text.chars();
    match characters.next() {
        Some(first) => first.to_uppercase().chain(characters).collect(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting(label: &str) -> &'static Setting {
        by_label(label).unwrap()
    }

    #[test]
    fn every_entry_is_consistent() {
        let defaults = Settings::default();
        for entry in SETTINGS {
            assert!(entry.label.chars().count() <= 17, "{}", entry.label);
            assert!(entry.key.contains('.'), "{}", entry.key);
            // The default passes its own check, and writing what was read changes nothing.
            entry.check(&(entry.get)(&defaults)).unwrap();
            let mut copy = defaults.clone();
            (entry.set)(&mut copy, (entry.get)(&defaults));
            assert_eq!(copy, defaults, "{}", entry.key);
        }
        let mut keys: Vec<_> = SETTINGS.iter().map(|entry| entry.key).collect();
        keys.sort_unstable();
        keys.dedup();
        assert_eq!(keys.len(), SETTINGS.len());
    }

    #[test]
    fn every_setting_reaches_its_own_field_and_only_that() {
        let defaults = Settings::default();
        for entry in SETTINGS {
            let mut changed = defaults.clone();
            entry.step(&mut changed, true, 64);
            if (entry.get)(&changed) == (entry.get)(&defaults) {
                entry.step(&mut changed, false, 64);
            }
            if entry.is_text() {
                (entry.set)(&mut changed, Value::Text("other".to_string()));
            }
            assert_ne!(changed, defaults, "{} changes nothing", entry.key);
            for other in SETTINGS.iter().filter(|other| other.key != entry.key) {
                assert_eq!(
                    (other.get)(&changed),
                    (other.get)(&defaults),
                    "{} changed {}",
                    entry.key,
                    other.key
                );
            }
        }
    }

    #[test]
    fn steps_stay_in_range() {
        let mut settings = Settings::default();
        settings.sampling.top_p = 1.0;
        setting("top-p").step(&mut settings, true, 2);
        assert_eq!(settings.sampling.top_p, 1.0);
        setting("top-p").step(&mut settings, false, 2);
        assert!((settings.sampling.top_p - 0.95).abs() < 1e-6);
        settings.threads = 2;
        setting("threads").step(&mut settings, true, 2);
        assert_eq!(settings.threads, 2);
        setting("threads").step(&mut settings, false, 2);
        setting("threads").step(&mut settings, false, 2);
        assert_eq!(settings.threads, 1);
        setting("seed").step(&mut settings, true, 2);
        assert_eq!(settings.sampling.seed, Some(0));
        setting("seed").step(&mut settings, false, 2);
        assert_eq!(settings.sampling.seed, None);
        assert_eq!(setting("top-k").display(&settings), "off");
        assert_eq!(setting("min-p").display(&settings), "off");
        assert_eq!(setting("keep reasoning").display(&settings), "no");
    }

    #[test]
    fn activations_cycle_through_every_format_both_ways() {
        let mut settings = Settings::default();
        let activations = setting("activations");
        assert_eq!(activations.display(&settings), "mixed");
        let mut seen = Vec::new();
        for _ in 0..ActivationFormat::ALL.len() {
            activations.step(&mut settings, true, 2);
            seen.push(activations.display(&settings));
        }
        assert_eq!(seen, ["q8x2", "q8", "mixed"]);
        activations.step(&mut settings, false, 2);
        assert_eq!(settings.activations, ActivationFormat::Q8);
    }

    #[test]
    fn checks_name_what_was_expected() {
        let top_p = setting("top-p");
        assert_eq!(
            top_p.check(&Value::Real(1.5)).unwrap_err(),
            "expected a value in (0, 1], got 1.5"
        );
        assert_eq!(
            setting("threads").check(&Value::Count(5000)).unwrap_err(),
            "expected 1..=1024 (0 = all cores), got 5000"
        );
        assert_eq!(setting("threads").parse_text("0").unwrap(), None);
        assert!(setting("top-k").check(&Value::Count(0)).is_ok());
        assert!(setting("max tokens").check(&Value::Count(0)).is_err());
        let error = setting("activations").parse_text("q4").unwrap_err();
        assert!(
            error.contains("q8, mixed, q8x2") && error.contains("q4"),
            "{error}"
        );
    }

    #[test]
    fn notices_put_the_re_prefill_first() {
        let previous = Settings::default();
        let mut next = previous.clone();
        next.threads = previous.threads + 1;
        next.reasoning_effort = ReasoningEffort::High;
        assert_eq!(
            change_notice(&previous, &next, true).unwrap(),
            "Reasoning effort high changes the system message: the next turn re-prefills the \
             whole conversation"
        );
        next.reasoning_effort = previous.reasoning_effort;
        assert_eq!(
            change_notice(&previous, &next, true).unwrap(),
            format!(
                "Threads {}: the thread pool is rebuilt between turns",
                next.threads
            )
        );
        let mut next = previous.clone();
        next.developer_instructions = "be brief".to_string();
        assert_eq!(
            change_notice(&previous, &next, false).unwrap(),
            "The developer instructions changed"
        );
        let mut next = previous.clone();
        next.sampling.temperature = 0.5;
        assert_eq!(change_notice(&previous, &next, true), None);
    }
}
