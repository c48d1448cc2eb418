//! Drawing: the whole screen from the app state, which it only reads.

use crate::settings::{Cost, SETTINGS};
use crate::tui::keys::KEY_BINDINGS;
use crate::tui::markdown::{terminal_safe, truncate_to_width};
use crate::tui::state::{App, EngineStatus, Focus, Overlay};
use crate::tui::transcript::{ReplyStatus, ERROR_STYLE};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Gauge, Paragraph, Sparkline, Wrap};
use ratatui::Frame;

/// Width of the gauges and settings column.
const SIDE_PANEL_WIDTH: u16 = 38;
/// Rows of the gauges box: its borders, the decode row and its two-row sparkline, and 13 gauges
/// (key→screen last).
const GAUGES_ROWS: u16 = 18;
/// Below this terminal width the side panel is hidden (the status line still says what happens).
const SIDE_PANEL_MIN_TERMINAL_WIDTH: u16 = 90;
/// The command the README gives for getting the real checkpoint.
pub const DOWNLOAD_COMMAND: &str = "huggingface-cli download openai/gpt-oss-20b --include \"config.json\" \"*.safetensors\" \"model.safetensors.index.json\" --local-dir ~/models/gpt-oss-20b";

/// Where each part of the screen goes.
struct ScreenLayout {
    title: Rect,
    conversation: Rect,
    /// The engine view (F2), beside the conversation or in its place.
    engine: Option<Rect>,
    input: Rect,
    /// `None` on a screen too narrow for the side panel.
    side: Option<Rect>,
    status: Rect,
}

fn screen_layout(area: Rect, app: &App) -> ScreenLayout {
    let [title, main_area, status] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(3),
        Constraint::Length(1),
    ])
    .areas(area);
    let show_side = area.width >= SIDE_PANEL_MIN_TERMINAL_WIDTH;
    let [left_area, side_area] = if show_side {
        Layout::horizontal([Constraint::Min(20), Constraint::Length(SIDE_PANEL_WIDTH)])
            .areas(main_area)
    } else {
        [main_area, Rect::default()]
    };
    let input_rows = (app.input.lines().len() as u16).clamp(1, 8) + 2;
    let [conversation, input] =
        Layout::vertical([Constraint::Min(3), Constraint::Length(input_rows)]).areas(left_area);
    let (conversation, engine) = if app.engine_view {
        engine_view_split(conversation, app.insight.experts)
    } else {
        (conversation, None)
    };
    ScreenLayout {
        title,
        conversation,
        engine,
        input,
        side: show_side.then_some(side_area),
        status,
    }
}

/// Narrowest conversation kept beside the engine view; a narrower screen shows the view in its
/// place.
const CONVERSATION_MIN_BESIDE_VIEW: u16 = 40;

/// Narrowest engine view placed beside the conversation: its time bars need the room even for a
/// model with few experts.
const VIEW_MIN_WIDTH: u16 = 56;

/// The conversation and engine view areas within `area`: side by side when both fit, else the
/// view alone (the conversation keeps a zero-width area and streams on underneath).
fn engine_view_split(area: Rect, experts: usize) -> (Rect, Option<Rect>) {
    let experts = if experts == 0 { 32 } else { experts };
    let wanted = crate::tui::engine_view::preferred_width(experts).max(VIEW_MIN_WIDTH);
    if area.width >= wanted + CONVERSATION_MIN_BESIDE_VIEW {
        let [conversation, view] =
            Layout::horizontal([Constraint::Min(0), Constraint::Length(wanted)]).areas(area);
        (conversation, Some(view))
    } else {
        (Rect { width: 0, ..area }, Some(area))
    }
}

/// The conversation pane's inner (width, height) on a screen of `area`: what the loop tells the
/// app before each draw ([`crate::tui::Msg::Layout`]).
pub fn conversation_viewport(area: Rect, app: &App) -> (u16, u16) {
    let layout = screen_layout(area, app);
    // Hidden behind the engine view, the conversation keeps the full width it wraps to.
    let conversation = match layout.engine {
        Some(view) if layout.conversation.width == 0 => view,
        _ => layout.conversation,
    };
    let inner = focused_block("", false).inner(conversation);
    (inner.width, inner.height)
}

/// Draws the whole screen.
pub fn draw(frame: &mut Frame, app: &App) {
    let layout = screen_layout(frame.area(), app);
    frame.render_widget(Paragraph::new(title_line(app)), layout.title);
    if layout.conversation.width > 0 {
        draw_conversation(frame, app, layout.conversation);
    }
    if let Some(view) = layout.engine {
        crate::tui::engine_view::draw(frame, &app.insight, view);
    }
    draw_input(frame, app, layout.input);
    let status_area = layout.status;
    if let Some(side_area) = layout.side {
        let [gauges_area, settings_area] =
            Layout::vertical([Constraint::Length(GAUGES_ROWS), Constraint::Min(3)])
                .areas(side_area);
        draw_gauges(frame, app, gauges_area);
        draw_settings(frame, app, settings_area);
    }
    frame.render_widget(Paragraph::new(status_line(app)), status_area);

    match &app.overlay {
        Some(Overlay::Help) => draw_help(frame, app),
        Some(Overlay::OpenChat { chats, selected }) => {
            let area = centered(frame.area(), 70, (chats.len() as u16 + 4).min(20));
            frame.render_widget(Clear, area);
            let lines: Vec<Line> = chats
                .iter()
                .enumerate()
                .map(|(index, chat)| {
                    let file = chat
                        .path
                        .file_name()
                        .map(|name| name.to_string_lossy().to_string())
                        .unwrap_or_default();
                    let text = format!("{} ({} messages, {file})", chat.title, chat.messages);
                    let text = terminal_safe(&text).into_owned();
                    let style = if index == *selected {
                        Style::new().add_modifier(Modifier::REVERSED)
                    } else {
                        Style::new()
                    };
                    Line::styled(text, style)
                })
                .collect();
            let block = Block::bordered().title(" Open a saved chat (Enter opens, Esc closes) ");
            let scroll = selected.saturating_sub(area.height.saturating_sub(3) as usize) as u16;
            frame.render_widget(Paragraph::new(lines).block(block).scroll((scroll, 0)), area);
        }
        Some(Overlay::EditSetting { setting, editor }) => {
            let area = centered(frame.area(), 70, 12);
            frame.render_widget(Clear, area);
            let mut editor = editor.as_ref().clone();
            editor.set_block(Block::bordered().title(format!(
                " {} (Enter applies, Alt-Enter new line, Esc cancels) ",
                setting.label
            )));
            frame.render_widget(&editor, area);
        }
        None => {}
    }
}

fn title_line(app: &App) -> Line<'static> {
    let mut spans = vec![Span::styled(
        " ossterm ",
        Style::new().add_modifier(Modifier::BOLD | Modifier::REVERSED),
    )];
    if let Some(info) = &app.gauges.engine_info {
        spans.push(Span::raw(format!(" {} ", terminal_safe(&info.model_label))));
        if info.random_weights {
            spans.push(Span::styled(
                " RANDOM WEIGHTS: output is noise (synthetic demo) ",
                Style::new().fg(Color::Black).bg(Color::Yellow),
            ));
        }
    }
    if let Some(path) = &app.chat_file.path {
        if let Some(name) = path.file_name() {
            spans.push(Span::styled(
                format!("  {}", terminal_safe(&name.to_string_lossy())),
                Style::new().fg(Color::DarkGray),
            ));
        }
    }
    Line::from(spans)
}

fn focused_block(title: &str, focused: bool) -> Block<'static> {
    let style = if focused {
        Style::new().fg(Color::Cyan)
    } else {
        Style::new().fg(Color::DarkGray)
    };
    Block::new()
        .borders(Borders::ALL)
        .border_style(style)
        .title(format!(" {title} "))
}

fn draw_conversation(frame: &mut Frame, app: &App, area: Rect) {
    let title = if app.transcript.following() {
        "Conversation"
    } else {
        "Conversation (scrolled: End follows)"
    };
    let block = focused_block(title, app.focus == Focus::Conversation);
    let inner = block.inner(area);
    frame.render_widget(block, area);
    if inner.height == 0 || inner.width == 0 {
        return;
    }
    if app.transcript.is_empty() && app.engine != EngineStatus::Ready {
        draw_engine_status(frame, app, inner);
        return;
    }
    let marked = app
        .transcript
        .selected()
        .filter(|_| app.focus == Focus::Conversation);
    let visible = app
        .transcript
        .visible_lines(inner.width as usize, inner.height as usize, marked);
    frame.render_widget(Paragraph::new(visible), inner);
}

fn draw_engine_status(frame: &mut Frame, app: &App, area: Rect) {
    match &app.engine {
        EngineStatus::Loading { stage, done, total } => {
            let [text_area, bar_area, _] = Layout::vertical([
                Constraint::Length(2),
                Constraint::Length(1),
                Constraint::Min(0),
            ])
            .areas(area);
            frame.render_widget(
                Paragraph::new(format!("Loading the model: {stage}")),
                text_area,
            );
            let ratio = if *total > 0 {
                (*done as f64 / *total as f64).clamp(0.0, 1.0)
            } else {
                0.0
            };
            let gauge = Gauge::default()
                .gauge_style(Style::new().fg(Color::Cyan))
                .ratio(ratio)
                .label(format!("{:.0}%", ratio * 100.0));
            frame.render_widget(gauge, bar_area);
        }
        EngineStatus::ModelMissing { path } => {
            let lines = vec![
                Line::styled(
                    format!("No model found at {}", path.display()),
                    Style::new().add_modifier(Modifier::BOLD),
                ),
                Line::raw(""),
                Line::raw("Download gpt-oss-20b (about 13 GB) as the README shows:"),
                Line::styled(
                    format!("    {DOWNLOAD_COMMAND}"),
                    Style::new().fg(Color::LightYellow),
                ),
                Line::raw(
                    "and start ossterm with --model pointing at that directory (or set model.path",
                ),
                Line::raw("in the config file)."),
                Line::raw(""),
                Line::raw("Or try the app with random weights (output is noise):"),
                Line::styled(
                    "    ossterm --synthetic tiny",
                    Style::new().fg(Color::LightYellow),
                ),
                Line::raw(""),
                Line::raw("Ctrl-Q quits."),
            ];
            frame.render_widget(Paragraph::new(lines).wrap(Wrap { trim: false }), area);
        }
        EngineStatus::Failed(message) => {
            let lines = vec![
                Line::styled(
                    "The engine could not start:",
                    ERROR_STYLE.add_modifier(Modifier::BOLD),
                ),
                Line::raw(""),
                Line::styled(terminal_safe(message).into_owned(), ERROR_STYLE),
                Line::raw(""),
                Line::raw(
                    "Check --model / model.path, or run `ossterm --synthetic tiny`. Ctrl-Q quits.",
                ),
            ];
            frame.render_widget(Paragraph::new(lines).wrap(Wrap { trim: false }), area);
        }
        EngineStatus::Ready => {}
    }
}

fn draw_input(frame: &mut Frame, app: &App, area: Rect) {
    let mut input = app.input.editor().clone();
    let title = if app.is_generating() {
        "Message (generating: Esc stops)"
    } else {
        "Message"
    };
    input.set_block(focused_block(title, app.focus == Focus::Input));
    if app.focus != Focus::Input {
        input.set_cursor_style(Style::new());
    }
    frame.render_widget(&input, area);
}

/// A bar like `[████░░░░]` of `cells` cells for `ratio`.
pub fn text_bar(ratio: f64, cells: usize) -> String {
    let filled = ((ratio.clamp(0.0, 1.0) * cells as f64).round() as usize).min(cells);
    format!("[{}{}]", "█".repeat(filled), "░".repeat(cells - filled))
}

fn gib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 30) as f64)
}

fn percent(rate: Option<f64>) -> String {
    rate.map_or("-".to_string(), |rate| format!("{:.0}%", rate * 100.0))
}

fn draw_gauges(frame: &mut Frame, app: &App, area: Rect) {
    let block = focused_block("Gauges", false);
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let [first, spark, rest] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Length(2),
        Constraint::Min(0),
    ])
    .areas(inner);
    let stats = app.gauges.stats.as_ref();
    let decode = stats.and_then(|stats| stats.decode_tokens_per_second);
    frame.render_widget(
        Paragraph::new(gauge_row(
            "decode",
            decode.map_or("-".to_string(), |rate| format!("{rate:.1} tok/s")),
        )),
        first,
    );
    let samples: Vec<u64> = app.gauges.decode_rates.iter().copied().collect();
    let visible = samples.len().saturating_sub(spark.width as usize);
    frame.render_widget(
        Sparkline::default()
            .data(&samples[visible..])
            .style(Style::new().fg(Color::Green)),
        spark,
    );

    let bar_cells = (inner.width as usize).saturating_sub(26).clamp(4, 12);
    let mut rows = Vec::new();
    let prefill = stats.and_then(|stats| stats.prefill_tokens_per_second);
    rows.push(gauge_row(
        "prefill",
        prefill.map_or("-".to_string(), |rate| format!("{rate:.1} tok/s")),
    ));
    let ttft = stats.and_then(|stats| stats.time_to_first_token);
    rows.push(gauge_row(
        "first token",
        ttft.map_or("-".to_string(), |time| {
            format!("{:.2} s", time.as_secs_f64())
        }),
    ));
    // Rows only this engine has (a remote engine's server and network) come first, so they stay
    // on a short screen.
    for (label, value) in &app.gauges.engine_rows {
        rows.push(gauge_row(label, terminal_safe(value).into_owned()));
    }
    // Rows of what the engine does not control (a server decides it) are left out.
    let shown = |key: &str| app.settings.fixed_key(key).is_none();
    let memory =
        match stats.and_then(|stats| stats.process_memory_bytes.zip(stats.machine_memory_bytes)) {
            Some((process, machine)) => format!(
                "{} {}/{} GiB",
                text_bar(process as f64 / machine.max(1) as f64, bar_cells),
                gib(process),
                gib(machine)
            ),
            None => "-".to_string(),
        };
    rows.push(gauge_row("memory", memory));
    let kv = stats.map_or("-".to_string(), |stats| {
        let ratio = stats.kv_tokens_used as f64 / stats.kv_tokens_capacity.max(1) as f64;
        format!(
            "{} {}/{}",
            text_bar(ratio, bar_cells),
            stats.kv_tokens_used,
            stats.kv_tokens_capacity
        )
    });
    if shown("engine.kv_cache") {
        rows.push(gauge_row("KV cache", kv));
        rows.push(gauge_row(
            "KV format",
            stats.map_or("-".to_string(), |stats| stats.kv_cache.to_string()),
        ));
    }
    let context = stats.map_or("-".to_string(), |stats| {
        let ratio = stats.context_used as f64 / stats.context_limit.max(1) as f64;
        format!(
            "{} {}/{}",
            text_bar(ratio, bar_cells),
            stats.context_used,
            stats.context_limit
        )
    });
    rows.push(gauge_row("context", context));
    rows.push(gauge_row(
        "cache hit",
        stats.map_or("-".to_string(), |stats| {
            // Restored snapshot rows count as reused; the value stays within the side panel.
            format!(
                "turn {} · chat {}",
                percent(stats.turn_hits.rate()),
                percent(stats.session_hits.rate()),
            )
        }),
    ));
    if shown("engine.kv_cache") {
        rows.push(gauge_row(
            "KV tiers",
            stats.map_or("-".to_string(), |stats| {
                // Sizes only: with counts the row overflowed the side panel's 24 columns and
                // the disk tier was cut off (`ossterm cache` lists the snapshots).
                let tiers = stats.kv_tiers;
                format!(
                    "RAM {}G · disk {}G",
                    gib(tiers.ram_bytes),
                    gib(tiers.disk_bytes),
                )
            }),
        ));
    }
    if shown("engine.threads") {
        rows.push(gauge_row(
            "threads",
            stats.map_or("-".to_string(), |stats| stats.threads.to_string()),
        ));
        let kernel = stats.map(|stats| stats.kernel_path.clone()).or_else(|| {
            app.gauges
                .engine_info
                .as_ref()
                .map(|info| info.kernel_path.clone())
        });
        rows.push(gauge_row(
            "kernels",
            kernel.unwrap_or_else(|| "-".to_string()),
        ));
    }
    let serving = stats.map(|stats| stats.weight_format);
    let weights = match (serving, &app.gauges.settings_progress) {
        (Some(format), Some((_, done, total))) => format!(
            "{format} → {} {}%",
            app.settings.current.weight_format,
            done * 100 / (*total).max(1)
        ),
        (Some(format), None) => format.to_string(),
        (None, _) => "-".to_string(),
    };
    if shown("engine.weight_format") {
        rows.push(gauge_row("weights", weights));
    }
    // Until the engine answers a change, the serving format lags the setting.
    let activations = match stats.map(|stats| stats.activations) {
        Some(serving) if serving != app.settings.current.activations => {
            format!("{serving} → {}", app.settings.current.activations)
        }
        Some(serving) => serving.to_string(),
        None => "-".to_string(),
    };
    if shown("engine.activations") {
        rows.push(gauge_row("activations", activations));
    }
    let latency = &app.gauges.latency;
    let ui = if latency.samples > 0 {
        format!(
            "{} ms (max {} ms)",
            latency.last.as_millis(),
            latency.max.as_millis()
        )
    } else {
        "-".to_string()
    };
    rows.push(gauge_row("key→screen", ui));
    frame.render_widget(Paragraph::new(rows), rest);
}

fn gauge_row(label: &str, value: String) -> Line<'static> {
    Line::from(vec![
        Span::styled(format!("{label:<12}"), Style::new().fg(Color::DarkGray)),
        Span::raw(value),
    ])
}

fn draw_settings(frame: &mut Frame, app: &App, area: Rect) {
    let focused = app.focus == Focus::Settings;
    let block = focused_block("Settings", focused);
    let inner = block.inner(area);
    frame.render_widget(block, area);
    let value_width = (inner.width as usize).saturating_sub(19);
    let mut lines: Vec<Line> = SETTINGS
        .iter()
        .enumerate()
        .map(|(index, setting)| {
            let fixed = app.settings.fixed_value(setting);
            let value = match fixed {
                Some(shown_as) => shown_as.to_string(),
                None => terminal_safe(&setting.display(&app.settings.current)).into_owned(),
            };
            let value = truncate_to_width(&value, value_width);
            let selected = focused && index == app.settings.cursor;
            let mut style = if selected {
                Style::new().add_modifier(Modifier::REVERSED)
            } else {
                Style::new()
            };
            if fixed.is_some() {
                style = style.fg(Color::DarkGray);
            }
            let cursor = if selected { "›" } else { " " };
            Line::styled(format!("{cursor}{:<17} {value}", setting.label), style)
        })
        .collect();
    if focused {
        let setting = app.settings.selected();
        let hint = if app.settings.fixed_value(setting).is_some() {
            "set by the engine"
        } else if setting.is_text() {
            "Enter edits"
        } else {
            "←/→ change"
        };
        lines.push(Line::styled(
            format!(" {hint}"),
            Style::new().fg(Color::DarkGray),
        ));
        if setting.cost == Cost::PromptPrefix && !setting.is_text() {
            lines.push(Line::styled(
                " changing it re-prefills the chat",
                Style::new().fg(Color::Yellow),
            ));
        }
    }
    // The hints follow the last setting: scroll them into view where the selected row stays
    // visible (a short panel shows the rows around the cursor instead).
    let scroll = lines
        .len()
        .saturating_sub(inner.height as usize)
        .min(app.settings.cursor) as u16;
    frame.render_widget(
        Paragraph::new(lines).scroll((if focused { scroll } else { 0 }, 0)),
        inner,
    );
}

/// What is happening now, for the status line.
pub fn status_text(app: &App) -> String {
    if let Some(reply) = app
        .transcript
        .last()
        .and_then(|turn| turn.reply.as_ref())
        .filter(|reply| reply.is_active())
    {
        return match reply.status {
            ReplyStatus::Prefill { done, total, .. } if total > 0 && done == total => {
                "Generating… · Esc stops".to_string()
            }
            ReplyStatus::Prefill { done, total, .. } if total > 0 => {
                format!("Reading the prompt {done}/{total} · Esc stops")
            }
            ReplyStatus::Prefill { .. } => "Sending… · Esc stops".to_string(),
            _ if reply.answer.is_empty() => {
                format!("Thinking… {} tokens · Esc stops", reply.reasoning_tokens)
            }
            _ => {
                let rate = app
                    .gauges
                    .stats
                    .as_ref()
                    .and_then(|stats| stats.decode_tokens_per_second);
                let rate = rate.map_or(String::new(), |rate| format!(" · {rate:.1} tok/s"));
                format!(
                    "Answering… {} tokens{rate} · Esc stops",
                    reply.answer_tokens
                )
            }
        };
    }
    if let Some(notice) = &app.notice {
        return notice.clone();
    }
    if let Some((what, done, total)) = &app.gauges.settings_progress {
        return format!("{what}: {}%", done * 100 / (*total).max(1));
    }
    match &app.engine {
        EngineStatus::Loading { stage, done, total } => {
            format!("Loading: {stage} {}%", done * 100 / (*total).max(1))
        }
        EngineStatus::ModelMissing { .. } => "No model: see the instructions above".to_string(),
        EngineStatus::Failed(_) => "The engine failed to start".to_string(),
        EngineStatus::Ready => "Ready".to_string(),
    }
}

fn status_line(app: &App) -> Line<'static> {
    Line::from(vec![
        Span::styled(
            format!(" {} ", terminal_safe(&status_text(app))),
            Style::new().add_modifier(Modifier::BOLD),
        ),
        Span::styled(" F1 help · Ctrl-Q quit", Style::new().fg(Color::DarkGray)),
    ])
}

fn draw_help(frame: &mut Frame, app: &App) {
    let height = (KEY_BINDINGS.len() as u16 + 5).min(frame.area().height);
    let area = centered(frame.area(), 78, height);
    frame.render_widget(Clear, area);
    let mut lines: Vec<Line> = KEY_BINDINGS
        .iter()
        .map(|(keys, action)| {
            Line::from(vec![
                Span::styled(format!(" {keys:<28}"), Style::new().fg(Color::Cyan)),
                Span::raw(*action),
            ])
        })
        .collect();
    lines.push(Line::raw(""));
    let location = app.chat_file.store.dir().display();
    lines.push(Line::styled(
        format!(" Chats are saved in {location}"),
        Style::new().fg(Color::DarkGray),
    ));
    frame.render_widget(
        Paragraph::new(lines).block(Block::bordered().title(" Keys (any key closes) ")),
        area,
    );
}

fn centered(area: Rect, width: u16, height: u16) -> Rect {
    let width = width.min(area.width);
    let height = height.min(area.height);
    Rect {
        x: area.x + (area.width - width) / 2,
        y: area.y + (area.height - height) / 2,
        width,
        height,
    }
}
