//! The interactive app (`ossterm` with no command): command-line flags, terminal setup and
//! restore (also on panic), and the event loop that joins keys, engine events and redraws.

use crate::config::{self, AppConfig, ConfigOverrides, ModelSource, SyntheticChoice};
use crate::engine::protocol::{Event, KvCacheType, ReasoningEffort, WeightFormat};
use crate::engine::worker::{EngineError, EngineHandle};
use crate::tui::clipboard::osc52_sequence;
use crate::tui::store::ChatStore;
use crate::tui::view::draw;
use crate::tui::{App, Effect, EngineStatus, Msg};
use anyhow::Context;
use clap::Args;
use crossterm::event::{
    DisableBracketedPaste, DisableMouseCapture, EnableBracketedPaste, EnableMouseCapture,
    KeyboardEnhancementFlags, PopKeyboardEnhancementFlags, PushKeyboardEnhancementFlags,
};
use crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen,
};
use ratatui::backend::CrosstermBackend;
use ratatui::Terminal;
use std::io::Write;
use std::path::PathBuf;
use std::sync::mpsc::{self, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// Redraw cadence while events stream in: tokens arriving faster are batched into one frame.
const FRAME_INTERVAL: Duration = Duration::from_millis(33);

/// Flags of the interactive app; each overrides the config file's key of the same name.
#[derive(Args, Debug, Clone, Default)]
pub struct AppArgs {
    /// Config file to read instead of the one in the platform config directory.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Checkpoint directory (model.path).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Random-weight model when no checkpoint is given: auto, tiny or 20b (model.synthetic).
    #[arg(long, value_name = "PRESET", value_parser = parse_synthetic)]
    pub synthetic: Option<SyntheticChoice>,
    /// Worker threads (engine.threads).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// bf16, q8 or q4 (engine.weight_format).
    #[arg(long, value_name = "FORMAT", value_parser = parse_choice::<WeightFormat>)]
    pub weight_format: Option<WeightFormat>,
    /// f16, f32 or q8 (engine.kv_cache).
    #[arg(long, value_name = "TYPE", value_parser = parse_choice::<KvCacheType>)]
    pub kv_cache: Option<KvCacheType>,
    /// Context limit in tokens (engine.context_limit).
    #[arg(long, value_name = "TOKENS")]
    pub context_limit: Option<usize>,
    #[arg(long)]
    pub temperature: Option<f32>,
    #[arg(long)]
    pub top_p: Option<f32>,
    #[arg(long)]
    pub top_k: Option<usize>,
    #[arg(long)]
    pub min_p: Option<f32>,
    #[arg(long)]
    pub max_tokens: Option<usize>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// low, medium or high (chat.reasoning_effort).
    #[arg(long, value_name = "EFFORT", value_parser = parse_choice::<ReasoningEffort>)]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// Directory of saved chats (paths.chats_dir).
    #[arg(long, value_name = "DIR")]
    pub chats_dir: Option<PathBuf>,
}

fn parse_synthetic(text: &str) -> Result<SyntheticChoice, String> {
    SyntheticChoice::from_name(text)
        .ok_or_else(|| format!("expected auto, tiny or 20b, got {text:?}"))
}

trait NamedChoice: Sized + Copy + 'static {
    const ALL: &'static [Self];
    fn name(self) -> &'static str;
}

macro_rules! named_choice {
    ($($ty:ty),*) => {$(
        impl NamedChoice for $ty {
            const ALL: &'static [Self] = <$ty>::ALL;
            fn name(self) -> &'static str {
                <$ty>::name(self)
            }
        }
    )*};
}
named_choice!(WeightFormat, KvCacheType, ReasoningEffort);

fn parse_choice<T: NamedChoice>(text: &str) -> Result<T, String> {
    T::ALL
        .iter()
        .copied()
        .find(|value| value.name() == text)
        .ok_or_else(|| {
            let names: Vec<&str> = T::ALL.iter().map(|value| value.name()).collect();
            format!("expected one of {}, got {text:?}", names.join(", "))
        })
}

impl AppArgs {
    /// The resolved configuration: defaults < config file < these flags.
    pub fn resolve(&self) -> anyhow::Result<AppConfig> {
        let overrides = ConfigOverrides {
            model_dir: self.model.clone(),
            synthetic: self.synthetic,
            threads: self.threads,
            weight_format: self.weight_format,
            kv_cache: self.kv_cache,
            context_limit: self.context_limit,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            max_tokens: self.max_tokens,
            seed: self.seed,
            reasoning_effort: self.reasoning_effort,
            chats_dir: self.chats_dir.clone(),
        };
        Ok(config::load(self.config.as_deref(), &overrides)?)
    }
}

/// The engine status to start with: a checkpoint directory that does not exist is explained on
/// screen (download command, demo) instead of failing with an error dump.
pub fn initial_engine_status(config: &AppConfig) -> EngineStatus {
    match &config.model {
        ModelSource::Checkpoint(dir) if !dir.join("config.json").is_file() => {
            EngineStatus::ModelMissing { path: dir.clone() }
        }
        _ => EngineStatus::Loading {
            stage: "starting".to_string(),
            done: 0,
            total: 1,
        },
    }
}

/// Puts the terminal back: raw mode off, main screen, mouse and paste reporting off.
fn restore_terminal() {
    let mut stdout = std::io::stdout();
    let _ = crossterm::execute!(
        stdout,
        PopKeyboardEnhancementFlags,
        DisableBracketedPaste,
        DisableMouseCapture,
        LeaveAlternateScreen,
        crossterm::cursor::Show
    );
    let _ = disable_raw_mode();
}

/// Restores the terminal when dropped, so every exit path (error, `?`, panic unwinding) leaves
/// the user's shell usable.
struct TerminalGuard;

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore_terminal();
    }
}

fn setup_terminal() -> anyhow::Result<(Terminal<CrosstermBackend<std::io::Stdout>>, TerminalGuard)>
{
    // The hook runs before unwinding prints anything, so the panic message lands on the normal
    // screen in cooked mode rather than being lost in the alternate screen.
    let previous_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        restore_terminal();
        previous_hook(info);
    }));
    enable_raw_mode().context("cannot switch the terminal to raw mode")?;
    let guard = TerminalGuard;
    let mut stdout = std::io::stdout();
    crossterm::execute!(
        stdout,
        EnterAlternateScreen,
        EnableMouseCapture,
        EnableBracketedPaste
    )
    .context("cannot set up the terminal")?;
    // Lets terminals that support it report Shift-Enter apart from Enter.
    if crossterm::terminal::supports_keyboard_enhancement().unwrap_or(false) {
        let _ = crossterm::execute!(
            stdout,
            PushKeyboardEnhancementFlags(KeyboardEnhancementFlags::DISAMBIGUATE_ESCAPE_CODES)
        );
    }
    let terminal = Terminal::new(CrosstermBackend::new(std::io::stdout()))
        .context("cannot start the terminal UI")?;
    Ok((terminal, guard))
}

/// What the loop receives: terminal input and engine events on one channel.
enum Input {
    Terminal(crossterm::event::Event, Instant),
    Engine(Event),
}

/// Runs the app until the user quits. `start_engine` starts the engine thread sending its events
/// to the given sender (the caller chooses the model and chat pieces, see `EngineHandle::spawn`).
pub fn run_app(
    config: AppConfig,
    start_engine: impl FnOnce(&AppConfig, Sender<Event>) -> Result<EngineHandle, EngineError>,
) -> anyhow::Result<()> {
    let chats_dir = config
        .chats_dir
        .clone()
        .or_else(config::default_chats_dir)
        .context("no platform data directory for saved chats; set paths.chats_dir")?;
    let status = initial_engine_status(&config);
    let mut app = App::new(
        config.settings.clone(),
        ChatStore::new(chats_dir),
        status.clone(),
    );

    let (input_sender, inputs) = mpsc::channel();
    let (event_sender, engine_events) = mpsc::channel();
    let engine = match status {
        EngineStatus::ModelMissing { .. } => None,
        _ => Some(start_engine(&config, event_sender)?),
    };
    let forward = input_sender.clone();
    std::thread::Builder::new()
        .name("ossterm-engine-events".to_string())
        .spawn(move || {
            for event in engine_events {
                if forward.send(Input::Engine(event)).is_err() {
                    return;
                }
            }
        })?;
    std::thread::Builder::new()
        .name("ossterm-terminal-input".to_string())
        .spawn(move || {
            while let Ok(event) = crossterm::event::read() {
                if input_sender
                    .send(Input::Terminal(event, Instant::now()))
                    .is_err()
                {
                    return;
                }
            }
        })?;

    let (mut terminal, _guard) = setup_terminal()?;
    let result = event_loop(&mut terminal, &mut app, &inputs, engine.as_ref());
    if let Some(engine) = engine {
        engine.shutdown();
    }
    result
}

fn event_loop(
    terminal: &mut Terminal<CrosstermBackend<std::io::Stdout>>,
    app: &mut App,
    inputs: &mpsc::Receiver<Input>,
    engine: Option<&EngineHandle>,
) -> anyhow::Result<()> {
    let mut dirty = true;
    let mut last_draw = Instant::now() - FRAME_INTERVAL;
    // Keys read since the last frame, timed until that frame is on screen.
    let mut pending_keys: Vec<Instant> = Vec::new();
    loop {
        if dirty && (last_draw.elapsed() >= FRAME_INTERVAL || !pending_keys.is_empty()) {
            let size = terminal.size()?;
            app.update(
                Msg::Resize {
                    conversation_height: size.height.saturating_sub(6),
                },
                Instant::now(),
            );
            terminal.draw(|frame| draw(frame, app))?;
            let drawn = Instant::now();
            for read_at in pending_keys.drain(..) {
                let latency = drawn.saturating_duration_since(read_at);
                app.latency.last = latency;
                app.latency.max = app.latency.max.max(latency);
                app.latency.samples += 1;
            }
            last_draw = drawn;
            dirty = false;
        }
        let wait = if dirty {
            FRAME_INTERVAL.saturating_sub(last_draw.elapsed())
        } else {
            Duration::from_secs(1)
        };
        let first = match inputs.recv_timeout(wait) {
            Ok(input) => input,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return Ok(()),
        };
        // Drain everything already queued so a burst of tokens costs one frame.
        for input in std::iter::once(first).chain(inputs.try_iter()) {
            let now = Instant::now();
            let message = match input {
                Input::Engine(event) => Msg::Engine(event),
                Input::Terminal(event, read_at) => match event {
                    crossterm::event::Event::Key(key) => {
                        pending_keys.push(read_at);
                        Msg::Key(key)
                    }
                    crossterm::event::Event::Mouse(mouse) => Msg::Mouse(mouse),
                    crossterm::event::Event::Paste(text) => Msg::Paste(text),
                    crossterm::event::Event::Resize(..) => {
                        dirty = true;
                        continue;
                    }
                    _ => continue,
                },
            };
            dirty = true;
            for effect in app.update(message, now) {
                match effect {
                    Effect::Engine(command) => {
                        if let Some(engine) = engine {
                            if let Err(error) = engine.send(command) {
                                app.notice = Some(error.to_string());
                            }
                        }
                    }
                    Effect::Copy(text) => {
                        let mut stdout = std::io::stdout();
                        stdout.write_all(osc52_sequence(&text).as_bytes())?;
                        stdout.flush()?;
                    }
                    Effect::Quit => return Ok(()),
                }
            }
        }
    }
}

/// `ossterm` with no command: resolve the configuration and run the app over the real model.
pub fn run(args: AppArgs) -> anyhow::Result<()> {
    let config = args.resolve()?;
    run_app(config, |config, events| {
        Ok(start_model_engine(config, events))
    })
}

/// Starts the engine thread over the configured checkpoint or synthetic model, the harmony codec
/// and the sampler; loading happens on that thread while the UI shows progress.
pub fn start_model_engine(config: &AppConfig, events: Sender<Event>) -> EngineHandle {
    use crate::engine::worker::{EngineParts, EngineSampler, HarmonyCodec};
    use crate::model::{LoadOptions, Model, Preset};
    let source = config.model.clone();
    EngineHandle::spawn(
        config.settings.clone(),
        events,
        move |settings, progress| {
            let options = LoadOptions {
                precision: crate::model::Precision::Fast,
                weights: settings.weight_format,
                kv: settings.kv_cache,
                ..LoadOptions::default()
            };
            let (model, model_label, random_weights) = match source {
                ModelSource::Checkpoint(dir) => {
                    progress("reading the checkpoint", 0, 1);
                    let model = Model::load(&dir, &options)
                        .map_err(|error| EngineError::Model(Box::new(error)))?;
                    progress("reading the checkpoint", 1, 1);
                    (model, format!("gpt-oss ({})", dir.display()), false)
                }
                ModelSource::Synthetic(choice) => {
                    let machine = crate::engine::worker::machine_memory_bytes();
                    let preset = match choice.resolve(machine) {
                        SyntheticChoice::Gpt20b => Preset::Gpt20b,
                        SyntheticChoice::Tiny | SyntheticChoice::Auto => Preset::Tiny,
                    };
                    progress(
                        &format!("generating random {} weights", preset.name()),
                        0,
                        1,
                    );
                    let model = Model::synthetic(preset, 0, &options)
                        .map_err(|error| EngineError::Model(Box::new(error)))?;
                    progress(
                        &format!("generating random {} weights", preset.name()),
                        1,
                        1,
                    );
                    let label = model.source.clone();
                    (model, label, true)
                }
            };
            progress("loading the tokenizer", 0, 1);
            let codec = HarmonyCodec::new()?;
            let sampler = EngineSampler::new(&settings.sampling)?;
            Ok(EngineParts {
                model: std::sync::Arc::new(model),
                codec,
                sampler,
                model_label,
                random_weights,
            })
        },
    )
}
