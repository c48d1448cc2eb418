//! The conversation as shown: the turns, where the view is scrolled to, which turn is selected,
//! and the turns' wrapped lines, cached per turn. Only the turns in or next to the viewport are
//! ever wrapped, so drawing and scrolling cost the same for a chat of ten messages and of ninety
//! thousand.

use crate::engine::protocol::{CacheHits, RequestId, StopReason};
use crate::tui::markdown::{render_markdown, wrap_lines};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const USER_STYLE: Style = Style::new().fg(Color::Cyan).add_modifier(Modifier::BOLD);
pub const ASSISTANT_STYLE: Style = Style::new().fg(Color::Green).add_modifier(Modifier::BOLD);
pub const REASONING_STYLE: Style = Style::new()
    .fg(Color::DarkGray)
    .add_modifier(Modifier::ITALIC);
pub const ERROR_STYLE: Style = Style::new().fg(Color::Red);

#[derive(Clone, Debug, PartialEq)]
pub enum ReplyStatus {
    Prefill {
        done: usize,
        total: usize,
        reused: usize,
    },
    Streaming,
    Done(StopReason),
    Failed(String),
}

/// One assistant reply as shown.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    pub request_id: Option<RequestId>,
    pub reasoning: String,
    pub reasoning_tokens: usize,
    pub reasoning_time: Option<Duration>,
    pub answer: String,
    pub answer_tokens: usize,
    pub status: ReplyStatus,
    /// Reasoning shown in full after the answer started (toggled per turn).
    pub expanded: bool,
    pub hits: Option<CacheHits>,
    pub(crate) started: Option<Instant>,
    pub(crate) first_reasoning_at: Option<Instant>,
}

impl Reply {
    pub(crate) fn pending(request_id: RequestId, now: Instant) -> Reply {
        Reply {
            request_id: Some(request_id),
            reasoning: String::new(),
            reasoning_tokens: 0,
            reasoning_time: None,
            answer: String::new(),
            answer_tokens: 0,
            status: ReplyStatus::Prefill {
                done: 0,
                total: 0,
                reused: 0,
            },
            expanded: false,
            hits: None,
            started: Some(now),
            first_reasoning_at: None,
        }
    }

    /// A finished reply loaded from a file.
    pub fn finished(reasoning: String, answer: String) -> Reply {
        Reply {
            request_id: None,
            reasoning_tokens: 0,
            reasoning,
            reasoning_time: None,
            answer,
            answer_tokens: 0,
            status: ReplyStatus::Done(StopReason::Finished),
            expanded: false,
            hits: None,
            started: None,
            first_reasoning_at: None,
        }
    }

    pub fn is_active(&self) -> bool {
        matches!(
            self.status,
            ReplyStatus::Prefill { .. } | ReplyStatus::Streaming
        )
    }

    /// Reasoning streams live until the answer begins; afterwards it collapses unless expanded.
    pub fn reasoning_visible(&self) -> bool {
        self.expanded || (self.is_active() && self.answer.is_empty())
    }
}

/// One exchange: what the user sent and the reply to it.
#[derive(Clone, Debug, PartialEq)]
pub struct Turn {
    pub user: String,
    pub reply: Option<Reply>,
}

/// A turn's lines wrapped to `width` cells.
#[derive(Clone, Debug)]
struct TurnLayout {
    width: usize,
    lines: Vec<Line<'static>>,
    /// Index of the "▌ Assistant" line, if the turn has a reply.
    assistant_header: Option<usize>,
}

/// The first line on screen: line `line` of turn `turn`'s wrapped lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Anchor {
    pub turn: usize,
    pub line: usize,
}

/// The turns, the scroll position and the wrapped-line cache.
#[derive(Debug)]
pub struct Transcript {
    /// Shared with snapshots ([`Transcript::snapshot`]) that are being saved or sent; a change
    /// copies only the turn it changes.
    turns: Vec<Arc<Turn>>,
    /// One entry per turn: its wrapped lines at the width they were wrapped for, or `None` after
    /// the turn changed.
    layouts: Vec<Option<TurnLayout>>,
    /// The conversation pane's inner size at the last layout message.
    width: usize,
    height: usize,
    /// `None` follows the stream (the last line at the bottom).
    scroll: Option<Anchor>,
    selected: Option<usize>,
}

impl Default for Transcript {
    fn default() -> Self {
        Transcript {
            turns: Vec::new(),
            layouts: Vec::new(),
            width: 80,
            height: 20,
            scroll: None,
            selected: None,
        }
    }
}

/// The line shown in an empty conversation.
pub const EMPTY_HINT: &str = "Type a message below and press Enter. F1 lists every key.";

impl Transcript {
    pub fn turns(&self) -> &[Arc<Turn>] {
        &self.turns
    }

    /// Every turn, shared: costs a pointer per turn however long the chat.
    pub fn snapshot(&self) -> Vec<Arc<Turn>> {
        self.turns.clone()
    }

    pub fn is_empty(&self) -> bool {
        self.turns.is_empty()
    }

    pub fn len(&self) -> usize {
        self.turns.len()
    }

    pub fn last(&self) -> Option<&Turn> {
        self.turns.last().map(|turn| turn.as_ref())
    }

    /// The last turn, for a change: its cached lines are dropped.
    pub fn last_mut(&mut self) -> Option<&mut Turn> {
        let last = self.turns.len().checked_sub(1)?;
        self.turn_mut(last)
    }

    /// Turn `index`, for a change: its cached lines are dropped.
    pub fn turn_mut(&mut self, index: usize) -> Option<&mut Turn> {
        if let Some(layout) = self.layouts.get_mut(index) {
            *layout = None;
        }
        self.turns.get_mut(index).map(Arc::make_mut)
    }

    pub fn push(&mut self, turn: Turn) {
        self.turns.push(Arc::new(turn));
        self.layouts.push(None);
    }

    pub fn pop(&mut self) -> Option<Turn> {
        self.layouts.pop();
        let turn = self.turns.pop().map(Arc::unwrap_or_clone);
        self.clamp_positions();
        turn
    }

    /// Replaces every turn; the view follows the end again.
    pub fn replace(&mut self, turns: Vec<Turn>) {
        self.layouts = vec![None; turns.len()];
        self.turns = turns.into_iter().map(Arc::new).collect();
        self.scroll = None;
        self.selected = None;
    }

    pub fn following(&self) -> bool {
        self.scroll.is_none()
    }

    pub fn follow(&mut self) {
        self.scroll = None;
    }

    pub fn scroll_to_top(&mut self) {
        self.scroll = Some(Anchor { turn: 0, line: 0 });
    }

    pub fn selected(&self) -> Option<usize> {
        self.selected
    }

    pub fn select(&mut self, turn: Option<usize>) {
        self.selected = turn.filter(|index| *index < self.turns.len());
    }

    /// Lines a page scroll moves.
    pub fn page(&self) -> usize {
        self.height.saturating_sub(2).max(1)
    }

    fn clamp_positions(&mut self) {
        if self.selected.is_some_and(|index| index >= self.turns.len()) {
            self.selected = None;
        }
        if self
            .scroll
            .is_some_and(|anchor| anchor.turn >= self.turns.len())
        {
            self.scroll = None;
        }
    }

    /// The pane's inner size for the coming draw: wraps what that draw shows (and only that) so
    /// the view finds it cached.
    pub fn layout(&mut self, width: usize, height: usize) {
        self.width = width.max(1);
        self.height = height.max(1);
        let mut remaining = self.height;
        match self.scroll {
            None => {
                for index in (0..self.turns.len()).rev() {
                    let lines = self.cached_height(index);
                    if lines >= remaining {
                        break;
                    }
                    remaining -= lines;
                }
            }
            Some(anchor) => {
                let mut skip = anchor.line;
                for index in anchor.turn..self.turns.len() {
                    let lines = self.cached_height(index).saturating_sub(skip);
                    skip = 0;
                    if lines >= remaining {
                        break;
                    }
                    remaining -= lines;
                }
            }
        }
    }

    /// Turn `index`'s line count at the current width, wrapping it if the cache lacks it.
    fn cached_height(&mut self, index: usize) -> usize {
        let width = self.width;
        let fresh = self.layouts[index]
            .as_ref()
            .is_some_and(|layout| layout.width == width);
        if !fresh {
            self.layouts[index] = Some(layout_turn(&self.turns[index], width));
        }
        self.layouts[index]
            .as_ref()
            .map_or(0, |layout| layout.lines.len())
    }

    /// Where the view starts when it follows: the last `height` lines.
    fn bottom(&mut self) -> Anchor {
        let mut remaining = self.height;
        for index in (0..self.turns.len()).rev() {
            let lines = self.cached_height(index);
            if lines >= remaining {
                return Anchor {
                    turn: index,
                    line: lines - remaining,
                };
            }
            remaining -= lines;
        }
        Anchor { turn: 0, line: 0 }
    }

    /// Scrolls by `lines` (negative = up). Reaching the bottom follows the stream again.
    pub fn scroll_by(&mut self, lines: isize) {
        if self.turns.is_empty() {
            return;
        }
        let bottom = self.bottom();
        let mut anchor = self.scroll.unwrap_or(bottom).min(bottom);
        if lines < 0 {
            let mut up = lines.unsigned_abs();
            while up > 0 {
                if anchor.line >= up {
                    anchor.line -= up;
                    break;
                }
                up -= anchor.line;
                if anchor.turn == 0 {
                    anchor.line = 0;
                    break;
                }
                anchor.turn -= 1;
                anchor.line = self.cached_height(anchor.turn);
            }
            // Just past a turn's last line is the next turn's first.
            if anchor.line >= self.cached_height(anchor.turn) && anchor.turn + 1 < self.turns.len()
            {
                anchor = Anchor {
                    turn: anchor.turn + 1,
                    line: 0,
                };
            }
            self.scroll = Some(anchor);
        } else {
            let mut down = lines as usize;
            while down > 0 && anchor < bottom {
                let height = self.cached_height(anchor.turn);
                let left_in_turn = height.saturating_sub(anchor.line);
                if down < left_in_turn {
                    anchor.line += down;
                    break;
                }
                down -= left_in_turn;
                anchor = Anchor {
                    turn: anchor.turn + 1,
                    line: 0,
                };
            }
            self.scroll = (anchor < bottom).then_some(anchor);
        }
    }

    /// The lines of a `width` x `height` pane, with turn `marked`'s headers highlighted. Cached
    /// lines are used where [`Transcript::layout`] left them for this width; anything else is
    /// wrapped here (the view never changes the cache).
    pub fn visible_lines(
        &self,
        width: usize,
        height: usize,
        marked: Option<usize>,
    ) -> Vec<Line<'static>> {
        let width = width.max(1);
        if self.turns.is_empty() {
            return vec![Line::styled(EMPTY_HINT, REASONING_STYLE)];
        }
        let layout_of = |index: usize| -> std::borrow::Cow<'_, TurnLayout> {
            match &self.layouts[index] {
                Some(layout) if layout.width == width => std::borrow::Cow::Borrowed(layout),
                _ => std::borrow::Cow::Owned(layout_turn(&self.turns[index], width)),
            }
        };
        let with_marker = |index: usize, layout: &TurnLayout, line: usize| {
            let mut shown = layout.lines[line].clone();
            let header = line == 0 || Some(line) == layout.assistant_header;
            if header && marked == Some(index) {
                shown = shown.patch_style(Style::new().add_modifier(Modifier::REVERSED));
            }
            shown
        };
        let mut lines = Vec::with_capacity(height);
        match self.scroll {
            None => {
                // Gathered backwards from the end, then put in order.
                let mut backwards = Vec::with_capacity(height);
                'turns: for index in (0..self.turns.len()).rev() {
                    let layout = layout_of(index);
                    for line in (0..layout.lines.len()).rev() {
                        if backwards.len() == height {
                            break 'turns;
                        }
                        backwards.push(with_marker(index, &layout, line));
                    }
                }
                backwards.reverse();
                lines = backwards;
            }
            Some(anchor) => {
                let mut skip = anchor.line;
                'forward: for index in anchor.turn..self.turns.len() {
                    let layout = layout_of(index);
                    for line in skip..layout.lines.len() {
                        if lines.len() == height {
                            break 'forward;
                        }
                        lines.push(with_marker(index, &layout, line));
                    }
                    skip = 0;
                }
            }
        }
        lines
    }
}

/// A turn's lines: the user's message, the reply, a blank line after.
fn layout_turn(turn: &Turn, width: usize) -> TurnLayout {
    let mut lines: Vec<Line<'static>> = vec![Line::styled("▌ You", USER_STYLE)];
    let user: Vec<Line<'static>> = turn
        .user
        .split('\n')
        .map(|line| Line::raw(line.to_string()))
        .collect();
    lines.extend(wrap_lines(&user, width));
    let mut assistant_header = None;
    if let Some(reply) = &turn.reply {
        lines.push(Line::raw(""));
        assistant_header = Some(lines.len());
        lines.push(Line::styled("▌ Assistant", ASSISTANT_STYLE));
        lines.extend(reply_lines(reply, width));
    }
    lines.push(Line::raw(""));
    TurnLayout {
        width,
        lines,
        assistant_header,
    }
}

fn reply_lines(reply: &Reply, width: usize) -> Vec<Line<'static>> {
    let mut lines = Vec::new();
    if let ReplyStatus::Prefill {
        done,
        total,
        reused,
    } = reply.status
    {
        let text = if total == 0 {
            "Reading the prompt…".to_string()
        } else if done == total {
            // Tokens are coming but none is text yet (a message header, or a random model that
            // never writes one).
            "Generating…".to_string()
        } else {
            format!("Reading the prompt… {done}/{total} tokens ({reused} reused from the cache)")
        };
        lines.push(Line::styled(text, REASONING_STYLE));
    }
    if !reply.reasoning.is_empty() {
        let tokens = reply.reasoning_tokens;
        let streaming_reasoning = reply.is_active() && reply.answer.is_empty();
        let header = if streaming_reasoning {
            format!("Thinking… ({tokens} tokens)")
        } else {
            let seconds = reply.reasoning_time.map_or(String::new(), |time| {
                format!(", {:.1} s", time.as_secs_f64())
            });
            let count = if tokens > 0 {
                format!("{tokens} tokens")
            } else {
                format!("{} characters", reply.reasoning.chars().count())
            };
            let arrow = if reply.expanded { "▾" } else { "▸" };
            format!("{arrow} Thought ({count}{seconds})")
        };
        lines.push(Line::styled(
            header,
            REASONING_STYLE.remove_modifier(Modifier::ITALIC),
        ));
        if reply.reasoning_visible() {
            let reasoning: Vec<Line<'static>> = reply
                .reasoning
                .split('\n')
                .map(|line| Line::styled(format!("  {line}"), REASONING_STYLE))
                .collect();
            lines.extend(wrap_lines(&reasoning, width));
        }
    }
    if !reply.answer.is_empty() {
        lines.extend(wrap_lines(
            &render_markdown(&reply.answer, Style::new()),
            width,
        ));
    }
    match &reply.status {
        ReplyStatus::Done(StopReason::Finished)
        | ReplyStatus::Prefill { .. }
        | ReplyStatus::Streaming => {}
        ReplyStatus::Done(reason) => lines.push(Line::styled(
            format!("[{}]", reason.describe()),
            Style::new().fg(Color::Yellow),
        )),
        ReplyStatus::Failed(message) => lines.extend(wrap_lines(
            &[Line::styled(format!("[error: {message}]"), ERROR_STYLE)],
            width,
        )),
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tui::markdown::line_text;

    fn transcript(turns: usize) -> Transcript {
        let mut transcript = Transcript::default();
        for index in 0..turns {
            transcript.push(Turn {
                user: format!("question {index}"),
                reply: Some(Reply::finished(String::new(), format!("answer {index}"))),
            });
        }
        transcript
    }

    fn texts(lines: &[Line]) -> Vec<String> {
        lines.iter().map(line_text).collect()
    }

    /// Every line of every turn, wrapped without the cache: what a full layout would show.
    fn all_lines(transcript: &Transcript, width: usize) -> Vec<String> {
        transcript
            .turns
            .iter()
            .flat_map(|turn| texts(&layout_turn(turn, width).lines))
            .collect()
    }

    #[test]
    fn scrolling_walks_the_same_lines_as_a_full_layout() {
        let mut transcript = transcript(30);
        transcript.layout(40, 7);
        let all = all_lines(&transcript, 40);
        let bottom = texts(&transcript.visible_lines(40, 7, None));
        assert_eq!(bottom, all[all.len() - 7..]);
        for step in 1..=all.len() {
            transcript.scroll_by(-1);
            let top = all.len().saturating_sub(7 + step);
            assert_eq!(
                texts(&transcript.visible_lines(40, 7, None)),
                all[top..top + 7],
                "after {step} lines up"
            );
        }
        transcript.scroll_by(5);
        assert_eq!(texts(&transcript.visible_lines(40, 7, None)), all[5..12]);
        transcript.scroll_by(all.len() as isize);
        assert!(transcript.following());
    }

    #[test]
    fn the_cache_follows_width_and_changes() {
        let mut transcript = transcript(3);
        transcript.layout(40, 50);
        transcript.last_mut().unwrap().user = "changed".to_string();
        transcript.layout(30, 50);
        assert_eq!(
            texts(&transcript.visible_lines(30, 50, None)),
            all_lines(&transcript, 30)
        );
        assert!(transcript
            .layouts
            .iter()
            .all(|layout| layout.as_ref().is_some_and(|layout| layout.width == 30)));
    }

    #[test]
    fn only_the_visible_turns_are_wrapped() {
        let mut transcript = transcript(10_000);
        transcript.layout(60, 10);
        let wrapped = transcript.layouts.iter().filter(|layout| layout.is_some());
        assert!(wrapped.count() <= 3);
        transcript.scroll_to_top();
        transcript.layout(60, 10);
        let wrapped = transcript.layouts.iter().filter(|layout| layout.is_some());
        assert!(wrapped.count() <= 6);
    }
}
