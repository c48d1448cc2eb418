//! App state and the one function that changes it: [`App::update`] takes a [`Msg`] (a key, a mouse
//! event, an engine event, the outcome of file work, a drawn frame) and returns [`Effect`]s for the
//! loop to carry out (commands for the engine, file work, clipboard text, quit). Update does no
//! input or output itself; rendering is a pure function of this state (`view`).

use crate::engine::protocol::{
    Channel, Command, Conversation, Event, RequestId, RequestKind, Role, Settings,
};
use crate::settings::change_notice;
use crate::tui::chat_file::{
    ChatFile, ChatFileExtras, ChatSnapshot, GenerateJob, STREAM_SAVE_INTERVAL,
};
use crate::tui::demo::{Action as DemoAction, Demo, View as DemoView};
use crate::tui::gauges::Gauges;
use crate::tui::input::{self, InputBox};
use crate::tui::insight::Insight;
use crate::tui::settings_panel::SettingsPanel;
use crate::tui::store::{ChatStore, SavedChat, StoreOutcome, StoreRequest};
use crate::tui::transcript::{Reply, ReplyStatus, Transcript, Turn};
use crossterm::event::{KeyCode, KeyEvent, KeyEventKind, KeyModifiers, MouseEvent, MouseEventKind};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tui_textarea::TextArea;

pub use crate::tui::chat_file::KNOWLEDGE_CUTOFF;
pub use crate::tui::gauges::{Latency, SPARKLINE_SAMPLES};

/// Lines one mouse-wheel notch scrolls.
const WHEEL_LINES: usize = 3;

/// Anything that can change the state.
#[derive(Clone, Debug)]
pub enum Msg {
    Key(KeyEvent),
    Mouse(MouseEvent),
    Paste(String),
    Engine(Event),
    /// The conversation pane's inner size for the frame about to be drawn.
    Layout {
        width: u16,
        height: u16,
    },
    /// The engine thread ended without being asked to (it panicked); the text says why.
    EngineStopped(String),
    /// A [`StoreRequest`] was carried out.
    Stored(StoreOutcome),
    /// A frame is on screen that shows keys read this long before it.
    KeysDrawn(Vec<Duration>),
    /// Something the loop could not do, for the status line.
    Notice(String),
    /// The demo's clock ([`crate::tui::demo::TICK`]); the loop sends it while a demo plays.
    Tick,
}

/// Work for the loop, outside the state.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    Engine(Command),
    /// Build the request's conversation and send it to the engine, in order with the commands
    /// around it; building it copies the whole chat, which the UI thread does not wait for.
    Generate(GenerateJob),
    /// File work; the loop answers with [`Msg::Stored`].
    Store(StoreRequest),
    /// An opened chat for the engine to resume from its KV snapshot at once (its conversation is
    /// built off the UI thread, as a request's is).
    Resume(Box<ChatSnapshot>),
    /// Put this text on the clipboard (OSC 52).
    Copy(String),
    /// Repaint every cell of the screen, not only the ones that changed. Terminals disagree with
    /// the layout about the width of some characters (combining marks of some scripts, emoji),
    /// which can leave stale cells behind; a full repaint puts the screen right.
    Redraw,
    Quit,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Focus {
    Input,
    Conversation,
    Settings,
}

/// What the engine thread is doing, as far as the UI knows.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineStatus {
    Loading {
        stage: String,
        done: u64,
        total: u64,
    },
    Ready,
    /// No checkpoint at `path`: the screen explains how to get one or run the demo.
    ModelMissing {
        path: PathBuf,
    },
    Failed(String),
}

/// A modal layer over the main screen.
#[derive(Debug)]
pub enum Overlay {
    Help,
    OpenChat {
        chats: Vec<SavedChat>,
        selected: usize,
    },
    EditSetting {
        setting: &'static crate::settings::Setting,
        editor: Box<TextArea<'static>>,
    },
}

/// The requests sent to the engine.
#[derive(Debug)]
struct Requests {
    active: Option<RequestId>,
    next_id: RequestId,
    /// What the next sent message is (an edit after Ctrl-E).
    pending_kind: RequestKind,
}

pub struct App {
    pub transcript: Transcript,
    pub input: InputBox,
    pub gauges: Gauges,
    pub chat_file: ChatFile,
    pub settings: SettingsPanel,
    pub focus: Focus,
    pub overlay: Option<Overlay>,
    pub engine: EngineStatus,
    /// Transient message for the status line (last action's result or a warning).
    pub notice: Option<String>,
    /// Routing and decode-time figures for the engine view.
    pub insight: Insight,
    /// The engine view (F2) is shown.
    pub engine_view: bool,
    /// The scripted session of `--demo`, while it plays.
    pub demo: Option<Demo>,
    requests: Requests,
    /// Effects of the message being handled, returned by [`App::update`].
    effects: Vec<Effect>,
}

impl App {
    pub fn new(settings: Settings, store: ChatStore, engine: EngineStatus) -> App {
        App {
            transcript: Transcript::default(),
            input: InputBox::default(),
            gauges: Gauges::default(),
            chat_file: ChatFile::new(store),
            settings: SettingsPanel::new(settings),
            focus: Focus::Input,
            overlay: None,
            engine,
            notice: None,
            insight: Insight::default(),
            engine_view: false,
            demo: None,
            requests: Requests {
                active: None,
                next_id: 1,
                pending_kind: RequestKind::NewTurn,
            },
            effects: Vec::new(),
        }
    }

    /// Starts the scripted demo: the engine view opens and the script plays on [`Msg::Tick`].
    pub fn start_demo(&mut self, now: Instant) {
        self.demo = Some(Demo::new(now));
        self.show_engine_view(true);
        self.notice = Some("Demo: any key stops it".to_string());
    }

    /// Whether the loop should send [`Msg::Tick`].
    pub fn wants_ticks(&self) -> bool {
        self.demo.is_some()
    }

    fn show_engine_view(&mut self, show: bool) {
        self.engine_view = show;
        if show {
            self.request_bandwidth(None);
        }
    }

    /// Asks the engine to measure the memory bandwidth unless it did for `threads` threads (any
    /// count when `None`) or a measurement is under way.
    fn request_bandwidth(&mut self, threads: Option<usize>) {
        let measured = match (self.insight.bandwidth, threads) {
            (Some((_, with)), Some(threads)) => with == threads,
            (Some(_), None) => true,
            (None, _) => false,
        };
        if !measured
            && !self.insight.bandwidth_pending
            && !self.insight.bandwidth_elsewhere
            && self.engine_ready()
        {
            self.insight.bandwidth_pending = true;
            self.effects.push(Effect::Engine(Command::MeasureBandwidth));
        }
    }

    fn on_tick(&mut self, now: Instant) {
        let Some(demo) = &mut self.demo else {
            return;
        };
        let view = DemoView {
            ready: self.engine == EngineStatus::Ready,
            generating: self.requests.active.is_some(),
            serving_weights: self.gauges.stats.as_ref().map(|stats| stats.weight_format),
            settings: &self.settings.current,
        };
        match demo.tick(view, now) {
            DemoAction::Wait => {}
            DemoAction::Say(text) => self.notice = Some(format!("{text} · any key stops the demo")),
            DemoAction::Type(text) => {
                self.focus = Focus::Input;
                self.input.paste(&text);
            }
            DemoAction::Send => self.send_input(now),
            DemoAction::Apply(next) => self.change_settings(next),
            DemoAction::NewChat => self.new_chat(),
        }
    }

    /// The request being generated, if any.
    pub fn active_request(&self) -> Option<RequestId> {
        self.requests.active
    }

    pub fn is_generating(&self) -> bool {
        self.requests.active.is_some()
    }

    /// The chat as it is now, for saving or for a request; shares the turns.
    pub fn snapshot(&self) -> ChatSnapshot {
        let settings = &self.settings.current;
        ChatSnapshot {
            turns: self.transcript.snapshot(),
            system_prompt: settings.system_prompt.clone(),
            reasoning_effort: settings.reasoning_effort,
            developer_instructions: settings.developer_instructions.clone(),
            date: self.chat_file.date.clone(),
            extras: self.chat_file.extras.clone(),
        }
    }

    /// The conversation in the chat file's shape (built from every turn: not for the UI thread
    /// of a long chat).
    pub fn conversation(&self) -> Conversation {
        self.snapshot().conversation()
    }

    /// The request to save the chat now, if there is anything to save (the loop's last save before
    /// it exits on a signal).
    pub fn save_request(&mut self) -> Option<StoreRequest> {
        if self.transcript.is_empty() {
            return None;
        }
        Some(StoreRequest::Save {
            path: self.chat_file.path_for_saving(),
            chat: Box::new(self.snapshot()),
            manual: false,
        })
    }

    /// Replaces the chat with a loaded conversation; its system and developer text become settings.
    fn load_conversation(&mut self, conversation: Conversation, path: PathBuf) {
        self.cancel_active();
        let mut turns: Vec<Turn> = Vec::new();
        for message in conversation.messages {
            match message.role {
                Role::User => turns.push(Turn {
                    user: message.content,
                    reply: None,
                }),
                Role::Assistant => {
                    let Some(turn) = turns.last_mut() else {
                        continue;
                    };
                    let reply = turn
                        .reply
                        .get_or_insert_with(|| Reply::finished(String::new(), String::new()));
                    match message.channel {
                        Some(Channel::Analysis) => reply.reasoning.push_str(&message.content),
                        _ => reply.answer.push_str(&message.content),
                    }
                }
            }
        }
        self.transcript.replace(turns);
        let system = conversation.system;
        let mut settings = self.settings.current.clone();
        settings.system_prompt = system.identity.unwrap_or_default();
        // A file without a reasoning line keeps the current effort (the app always writes one).
        if let Some(effort) = system.reasoning {
            settings.reasoning_effort = effort;
        }
        settings.developer_instructions = conversation.developer.unwrap_or_default();
        self.chat_file.date = system.date;
        self.chat_file.extras = ChatFileExtras {
            knowledge_cutoff: system.knowledge_cutoff,
            system: system.extra,
            conversation: conversation.extra,
        };
        self.change_settings(settings);
        self.chat_file.path = Some(path);
    }

    pub fn update(&mut self, message: Msg, now: Instant) -> Vec<Effect> {
        match message {
            Msg::Key(key) if key.kind != KeyEventKind::Release => self.on_key(key, now),
            Msg::Key(_) => {}
            Msg::Mouse(mouse) => match mouse.kind {
                MouseEventKind::ScrollUp => self.transcript.scroll_by(-(WHEEL_LINES as isize)),
                MouseEventKind::ScrollDown => self.transcript.scroll_by(WHEEL_LINES as isize),
                _ => {}
            },
            Msg::Paste(text) => match &mut self.overlay {
                Some(Overlay::EditSetting { editor, .. }) => input::paste(editor, &text),
                _ => {
                    self.focus = Focus::Input;
                    self.input.paste(&text);
                }
            },
            Msg::Engine(event) => self.on_engine_event(event, now),
            Msg::EngineStopped(reason) => self.on_engine_stopped(reason),
            Msg::Layout { width, height } => {
                self.transcript
                    .layout(usize::from(width), usize::from(height));
            }
            Msg::Stored(outcome) => self.on_stored(outcome),
            Msg::KeysDrawn(latencies) => {
                for latency in latencies {
                    self.gauges.latency.record(latency);
                }
            }
            Msg::Notice(text) => self.notice = Some(text),
            Msg::Tick => self.on_tick(now),
        }
        std::mem::take(&mut self.effects)
    }

    fn on_engine_stopped(&mut self, reason: String) {
        if let Some(id) = self.requests.active.take() {
            let message = format!("the engine stopped: {reason}");
            if let Some(reply) = self
                .transcript
                .last_mut()
                .and_then(|turn| turn.reply.as_mut())
                .filter(|reply| reply.request_id == Some(id))
            {
                reply.status = ReplyStatus::Failed(message);
            }
            self.autosave();
        }
        self.engine = EngineStatus::Failed(format!("The engine stopped: {reason}"));
        self.notice = Some(format!(
            "The engine stopped ({reason}); the chat is saved, restart ossterm"
        ));
    }

    fn on_stored(&mut self, outcome: StoreOutcome) {
        match outcome {
            StoreOutcome::Saved {
                path,
                manual: true,
                result,
            } => {
                self.notice = Some(match result {
                    Ok(()) => format!("Saved {}", path.display()),
                    Err(error) => error,
                })
            }
            StoreOutcome::Saved {
                result: Err(error), ..
            } => self.notice = Some(format!("Autosave failed: {error}")),
            StoreOutcome::Saved { .. } => {}
            StoreOutcome::Listed(Ok((chats, _))) if chats.is_empty() => {
                self.notice = Some(format!(
                    "No saved chats in {}",
                    self.chat_file.store.dir().display()
                ));
            }
            StoreOutcome::Listed(Ok((chats, unreadable))) => {
                if unreadable > 0 {
                    self.notice = Some(format!("{unreadable} unreadable chat files skipped"));
                }
                self.overlay = Some(Overlay::OpenChat { chats, selected: 0 });
            }
            StoreOutcome::Listed(Err(error)) => self.notice = Some(error),
            StoreOutcome::Opened {
                path,
                result: Ok(conversation),
            } => {
                self.load_conversation(*conversation, path.clone());
                self.notice = Some(format!("Opened {}", path.display()));
                self.effects.push(Effect::Resume(Box::new(self.snapshot())));
            }
            StoreOutcome::Opened {
                result: Err(error), ..
            } => self.notice = Some(error),
        }
    }

    fn on_key(&mut self, key: KeyEvent, now: Instant) {
        let control = key.modifiers.contains(KeyModifiers::CONTROL);
        if control && matches!(key.code, KeyCode::Char('c') | KeyCode::Char('q')) {
            self.cancel_active();
            self.effects.push(Effect::Quit);
            return;
        }
        if self.demo.take().is_some() {
            self.notice = Some("Demo stopped: the app is yours".to_string());
            return;
        }
        if self.overlay.is_some() {
            return self.on_overlay_key(key);
        }
        if key.code == KeyCode::F(2) {
            return self.show_engine_view(!self.engine_view);
        }
        let question_opens_help =
            key.code == KeyCode::Char('?') && (self.focus != Focus::Input || self.input.is_empty());
        if key.code == KeyCode::F(1) || question_opens_help {
            self.overlay = Some(Overlay::Help);
            return;
        }
        if control {
            match key.code {
                KeyCode::Char('r') => return self.regenerate(now),
                KeyCode::Char('e') => return self.edit_last_user_message(),
                KeyCode::Char('n') => return self.new_chat(),
                KeyCode::Char('s') => return self.save_now(),
                KeyCode::Char('o') => return self.effects.push(Effect::Store(StoreRequest::List)),
                KeyCode::Char('y') => return self.copy_last_answer(),
                KeyCode::Char('l') => return self.effects.push(Effect::Redraw),
                KeyCode::Char('t') => {
                    let turn = self
                        .transcript
                        .selected()
                        .or(self.transcript.len().checked_sub(1));
                    return self.toggle_reasoning(turn);
                }
                KeyCode::End => return self.transcript.follow(),
                _ => {}
            }
        }
        match key.code {
            KeyCode::Esc => {
                if self.is_generating() {
                    self.notice = Some("Stopping…".to_string());
                    return self.cancel_active();
                }
                self.focus = Focus::Input;
                return;
            }
            KeyCode::Tab => {
                self.focus = match self.focus {
                    Focus::Input => Focus::Conversation,
                    Focus::Conversation => Focus::Settings,
                    Focus::Settings => Focus::Input,
                };
                return;
            }
            KeyCode::BackTab => {
                self.focus = match self.focus {
                    Focus::Input => Focus::Settings,
                    Focus::Conversation => Focus::Input,
                    Focus::Settings => Focus::Conversation,
                };
                return;
            }
            KeyCode::PageUp => {
                return self
                    .transcript
                    .scroll_by(-(self.transcript.page() as isize))
            }
            KeyCode::PageDown => return self.transcript.scroll_by(self.transcript.page() as isize),
            _ => {}
        }
        match self.focus {
            Focus::Input => self.on_input_key(key, now),
            Focus::Conversation => self.on_conversation_key(key),
            Focus::Settings => self.on_settings_key(key),
        }
    }

    fn on_input_key(&mut self, key: KeyEvent, now: Instant) {
        let newline_modifier = key
            .modifiers
            .intersects(KeyModifiers::ALT | KeyModifiers::SHIFT);
        match key.code {
            KeyCode::Enter if newline_modifier => self.input.newline(),
            KeyCode::Enter => self.send_input(now),
            KeyCode::Up if self.input.cursor().0 == 0 && self.input.has_history() => {
                self.input.recall(true)
            }
            KeyCode::Down
                if self.input.cursor().0 + 1 >= self.input.lines().len()
                    && self.input.browsing_history() =>
            {
                self.input.recall(false)
            }
            _ => self.input.key(key),
        }
    }

    fn on_conversation_key(&mut self, key: KeyEvent) {
        let count = self.transcript.len();
        let selected = self.transcript.selected();
        match key.code {
            KeyCode::Up if count > 0 => self.transcript.select(Some(
                selected.map_or(count - 1, |index| index.saturating_sub(1)),
            )),
            KeyCode::Down if count > 0 => self.transcript.select(Some(
                selected.map_or(count - 1, |index| (index + 1).min(count - 1)),
            )),
            KeyCode::Enter | KeyCode::Char(' ') => self.toggle_reasoning(selected),
            KeyCode::Home => self.transcript.scroll_to_top(),
            KeyCode::End => self.transcript.follow(),
            _ => {}
        }
    }

    fn toggle_reasoning(&mut self, turn: Option<usize>) {
        let reply = turn
            .and_then(|index| self.transcript.turn_mut(index))
            .and_then(|turn| turn.reply.as_mut());
        match reply {
            Some(reply) if !reply.reasoning.is_empty() => reply.expanded = !reply.expanded,
            _ => self.notice = Some("No reasoning to expand in that turn".to_string()),
        }
    }

    fn on_settings_key(&mut self, key: KeyEvent) {
        let setting = self.settings.selected();
        let changes = matches!(
            key.code,
            KeyCode::Left | KeyCode::Right | KeyCode::Char('-' | '+') | KeyCode::Enter
        );
        if changes {
            if let Some(shown_as) = self.settings.fixed_value(setting) {
                self.notice = Some(format!(
                    "{} is set by the {shown_as}, not here",
                    capitalize(setting.name)
                ));
                return;
            }
        }
        match key.code {
            KeyCode::Up => self.settings.move_cursor(true),
            KeyCode::Down => self.settings.move_cursor(false),
            KeyCode::Left | KeyCode::Right | KeyCode::Char('-') | KeyCode::Char('+')
                if !setting.is_text() =>
            {
                let up = matches!(key.code, KeyCode::Right | KeyCode::Char('+'));
                let next = self.settings.stepped(up);
                self.change_settings(next);
            }
            KeyCode::Enter if setting.is_text() => {
                let text = setting.text(&self.settings.current).unwrap_or_default();
                self.overlay = Some(Overlay::EditSetting {
                    setting,
                    editor: Box::new(input::editor(&text, None)),
                });
            }
            _ => {}
        }
    }

    /// Adopts `next` and tells the engine; warns when the change costs a full re-prefill.
    fn change_settings(&mut self, next: Settings) {
        if next == self.settings.current {
            return;
        }
        let mut notice = change_notice(&self.settings.current, &next, !self.transcript.is_empty());
        if self.is_generating() {
            notice = Some(match notice {
                Some(text) => format!("{text} (after this turn)"),
                None => "Settings apply after this turn".to_string(),
            });
        }
        if notice.is_some() {
            self.notice = notice;
        }
        self.settings.current = next;
        self.effects
            .push(Effect::Engine(Command::ApplySettings(Box::new(
                self.settings.current.clone(),
            ))));
    }

    fn on_overlay_key(&mut self, key: KeyEvent) {
        let Some(overlay) = self.overlay.take() else {
            return;
        };
        match overlay {
            // Any key closes help; F1 and ? toggle.
            Overlay::Help => {}
            Overlay::OpenChat {
                chats,
                mut selected,
            } => match key.code {
                KeyCode::Esc => {}
                KeyCode::Up => {
                    selected = selected.saturating_sub(1);
                    self.overlay = Some(Overlay::OpenChat { chats, selected });
                }
                KeyCode::Down => {
                    selected = (selected + 1).min(chats.len().saturating_sub(1));
                    self.overlay = Some(Overlay::OpenChat { chats, selected });
                }
                KeyCode::Enter => {
                    if let Some(chat) = chats.get(selected) {
                        self.effects
                            .push(Effect::Store(StoreRequest::Open(chat.path.clone())));
                    }
                }
                _ => self.overlay = Some(Overlay::OpenChat { chats, selected }),
            },
            Overlay::EditSetting {
                setting,
                mut editor,
            } => {
                let newline = key
                    .modifiers
                    .intersects(KeyModifiers::ALT | KeyModifiers::SHIFT);
                match key.code {
                    KeyCode::Esc => {}
                    KeyCode::Enter if !newline => {
                        let mut next = self.settings.current.clone();
                        let text = crate::settings::Value::Text(editor.lines().join("\n"));
                        (setting.set)(&mut next, text);
                        self.change_settings(next);
                    }
                    KeyCode::Enter => {
                        editor.insert_newline();
                        self.overlay = Some(Overlay::EditSetting { setting, editor });
                    }
                    _ => {
                        input::edit(&mut editor, key);
                        self.overlay = Some(Overlay::EditSetting { setting, editor });
                    }
                }
            }
        }
    }

    fn engine_ready(&self) -> bool {
        self.engine == EngineStatus::Ready
    }

    fn send_input(&mut self, now: Instant) {
        let text = self.input.text();
        if text.trim().is_empty() {
            return;
        }
        if self.is_generating() {
            self.notice = Some("Still generating: Esc stops it".to_string());
            return;
        }
        if !self.engine_ready() {
            self.notice = Some("The model is not ready yet".to_string());
            return;
        }
        self.input.sent(text.clone());
        self.transcript.push(Turn {
            user: text,
            reply: None,
        });
        let kind = std::mem::replace(&mut self.requests.pending_kind, RequestKind::NewTurn);
        self.start_request(kind, now);
    }

    fn start_request(&mut self, kind: RequestKind, now: Instant) {
        let id = self.requests.next_id;
        self.requests.next_id += 1;
        let chat = Box::new(self.snapshot());
        if let Some(turn) = self.transcript.last_mut() {
            turn.reply = Some(Reply::pending(id, now));
        }
        self.requests.active = Some(id);
        self.transcript.follow();
        self.transcript.select(None);
        self.notice = None;
        self.autosave();
        self.effects
            .push(Effect::Generate(GenerateJob { id, kind, chat }));
    }

    fn regenerate(&mut self, now: Instant) {
        if self.is_generating() {
            self.notice = Some("Still generating: Esc stops it first".to_string());
            return;
        }
        if !self.engine_ready() {
            self.notice = Some("The model is not ready yet".to_string());
            return;
        }
        let Some(last) = self.transcript.last_mut() else {
            self.notice = Some("Nothing to regenerate".to_string());
            return;
        };
        last.reply = None;
        self.start_request(RequestKind::Regenerate, now);
    }

    fn edit_last_user_message(&mut self) {
        self.cancel_active();
        let Some(last) = self.transcript.pop() else {
            self.notice = Some("No message to edit".to_string());
            return;
        };
        self.input.set_text(&last.user);
        self.focus = Focus::Input;
        self.requests.pending_kind = RequestKind::EditAndResend;
        self.notice = Some("Editing the last message: Enter resends it".to_string());
        self.autosave();
    }

    fn new_chat(&mut self) {
        self.cancel_active();
        self.autosave();
        self.transcript.replace(Vec::new());
        self.chat_file.reset();
        self.requests.pending_kind = RequestKind::NewTurn;
        self.notice = Some("New chat".to_string());
    }

    fn copy_last_answer(&mut self) {
        let answer = self
            .transcript
            .turns()
            .iter()
            .rev()
            .filter_map(|turn| turn.reply.as_ref())
            .find(|reply| !reply.answer.is_empty());
        match answer {
            Some(reply) => {
                let text = reply.answer.clone();
                self.notice = Some(format!(
                    "Copied the last answer ({} characters)",
                    text.chars().count()
                ));
                self.effects.push(Effect::Copy(text));
            }
            None => self.notice = Some("No answer to copy yet".to_string()),
        }
    }

    /// Cancels the running request, if any; the reply keeps what it received.
    fn cancel_active(&mut self) {
        if let Some(id) = self.requests.active {
            self.effects.push(Effect::Engine(Command::Cancel(id)));
        }
    }

    /// Ctrl-S: writes the chat file now; the outcome says where.
    fn save_now(&mut self) {
        match self.save_request() {
            Some(StoreRequest::Save { path, chat, .. }) => {
                self.effects.push(Effect::Store(StoreRequest::Save {
                    path,
                    chat,
                    manual: true,
                }))
            }
            _ => self.notice = Some("Nothing to save yet".to_string()),
        }
    }

    fn autosave(&mut self) {
        // The demo's scripted chats are not the user's: they stay out of the chats directory.
        if self.demo.is_some() {
            return;
        }
        if let Some(request) = self.save_request() {
            self.effects.push(Effect::Store(request));
        }
    }

    fn active_reply(&mut self, id: RequestId) -> Option<&mut Reply> {
        if self.requests.active != Some(id) {
            return None;
        }
        self.transcript
            .last_mut()?
            .reply
            .as_mut()
            .filter(|reply| reply.request_id == Some(id))
    }

    fn on_engine_event(&mut self, event: Event, now: Instant) {
        match event {
            Event::LoadProgress { stage, done, total } => {
                self.engine = EngineStatus::Loading { stage, done, total }
            }
            Event::Ready(info) => {
                self.engine = EngineStatus::Ready;
                // Show what really runs: the model may not offer the configured formats.
                let current = &mut self.settings.current;
                current.weight_format = info.settings.weight_format;
                current.unembedding = info.settings.unembedding;
                current.activations = info.settings.activations;
                current.attention = info.settings.attention;
                current.kv_cache = info.settings.kv_cache;
                self.settings.engine = Some(info.settings.clone());
                self.gauges.engine_info = Some(info);
            }
            Event::PrefillProgress {
                id,
                done,
                total,
                reused,
            } => {
                if let Some(reply) = self.active_reply(id) {
                    reply.status = ReplyStatus::Prefill {
                        done,
                        total,
                        reused,
                    };
                }
            }
            Event::Token { id, channel, text } => {
                let Some(reply) = self.active_reply(id) else {
                    return;
                };
                reply.status = ReplyStatus::Streaming;
                match channel {
                    Channel::Analysis => {
                        reply.first_reasoning_at.get_or_insert(now);
                        reply.reasoning.push_str(&text);
                        reply.reasoning_tokens += 1;
                    }
                    Channel::Final | Channel::Commentary => {
                        if reply.answer.is_empty() {
                            if let Some(start) = reply.first_reasoning_at {
                                reply.reasoning_time = Some(now.saturating_duration_since(start));
                            }
                        }
                        reply.answer.push_str(&text);
                        reply.answer_tokens += 1;
                    }
                }
                let due = self
                    .chat_file
                    .last_stream_save
                    .is_none_or(|at| now.saturating_duration_since(at) >= STREAM_SAVE_INTERVAL);
                if due {
                    self.chat_file.last_stream_save = Some(now);
                    self.autosave();
                }
            }
            Event::Stats(sample) => {
                if self.is_generating() {
                    if let Some(rate) = sample.decode_tokens_per_second {
                        self.gauges.push_decode_rate(rate);
                    }
                }
                if self.engine_view {
                    self.request_bandwidth(Some(sample.threads));
                }
                self.gauges.stats = Some(sample);
            }
            Event::Profile(sample) => self.insight.record(&sample),
            Event::Bandwidth {
                gigabytes_per_second,
                threads,
            } => {
                self.insight.bandwidth_pending = false;
                self.insight.bandwidth_elsewhere = gigabytes_per_second <= 0.0;
                self.insight.bandwidth =
                    (gigabytes_per_second > 0.0).then_some((gigabytes_per_second, threads));
            }
            Event::EngineGauges(rows) => self.gauges.engine_rows = rows,
            Event::SettingsFixed { keys, shown_as } => self.settings.fix(keys, shown_as),
            Event::TurnDone {
                id,
                reason,
                hits,
                generated_tokens,
            } => {
                let was_active = self.requests.active == Some(id);
                if let Some(reply) = self.active_reply(id) {
                    if reply.reasoning_time.is_none() {
                        if let Some(start) = reply.first_reasoning_at {
                            reply.reasoning_time = Some(now.saturating_duration_since(start));
                        }
                    }
                    reply.status = ReplyStatus::Done(reason);
                    reply.hits = Some(hits);
                    let took = reply
                        .started
                        .map(|start| now.saturating_duration_since(start));
                    let rate = hits.rate().map_or(String::new(), |rate| {
                        format!(", prefix cache {:.0}%", rate * 100.0)
                    });
                    self.notice = Some(format!(
                        "{}: {generated_tokens} tokens in {:.1} s{rate}",
                        capitalize(reason.describe()),
                        took.unwrap_or_default().as_secs_f64()
                    ));
                    self.autosave();
                }
                if was_active {
                    self.requests.active = None;
                    // A streamed reply is the text most likely to have confused the terminal.
                    self.effects.push(Effect::Redraw);
                }
            }
            Event::SettingsProgress { what, done, total } => {
                self.gauges.settings_progress = Some((what, done, total))
            }
            Event::SettingsApplied(applied) => {
                let serving = self.settings.engine.as_ref();
                if serving.is_some_and(|serving| {
                    serving.threads != applied.threads
                        || serving.weight_format != applied.weight_format
                        || serving.unembedding != applied.unembedding
                }) {
                    self.insight.reset_timing();
                }
                let current = &self.settings.current;
                if (applied.weight_format, applied.unembedding)
                    == (current.weight_format, current.unembedding)
                {
                    self.gauges.settings_progress = None;
                }
                self.settings.engine = Some(*applied);
            }
            Event::Notice(message) => self.notice = Some(message),
            Event::Error {
                id: Some(id),
                message,
            } => {
                if let Some(reply) = self.active_reply(id) {
                    reply.status = ReplyStatus::Failed(message.clone());
                    self.autosave();
                }
                if self.requests.active == Some(id) {
                    self.requests.active = None;
                }
                self.notice = Some(format!("Error: {message}"));
            }
            Event::Error { id: None, message } => {
                if matches!(self.engine, EngineStatus::Loading { .. }) {
                    self.engine = EngineStatus::Failed(message);
                } else {
                    self.gauges.settings_progress = None;
                    self.notice = Some(format!("Error: {message}"));
                }
            }
        }
    }
}

fn capitalize(text: &str) -> String {
    let mut characters = text.chars();
    match characters.next() {
        Some(first) => first.to_uppercase().chain(characters).collect(),
        None => String::new(),
    }
}
