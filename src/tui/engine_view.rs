//! The engine view (F2): what the model does inside while it runs. On top, a heat map of the
//! router's choices, layers down and experts across, fading over the last tokens, with each
//! layer's distinct experts this turn; a narrow view collapses each layer to a bar of those. Below,
//! where a decode step's time goes and the roofline bar: the decode's memory traffic against what
//! the machine can read.

use crate::tui::insight::{Insight, HEAT_TOKENS};
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph};
use ratatui::Frame;

/// Rows of the time and roofline section: a heading, six shares, the roofline bar and two lines
/// of its figures.
pub const TIME_ROWS: u16 = 10;

/// Columns of a layer's label ("L23 ") and of its distinct count (" 32/32").
const LABEL_COLUMNS: usize = 4;
const DISTINCT_COLUMNS: usize = 6;

/// Width the view asks for beside the conversation: the full map with two cells per expert of
/// `experts`, plus the border.
pub fn preferred_width(experts: usize) -> u16 {
    (LABEL_COLUMNS + 2 * experts.max(1) + DISTINCT_COLUMNS + 2) as u16
}

/// Heat glyphs from faint to hot, and their colours; an expert never chosen shows `·`.
const GLYPHS: [char; 4] = ['░', '▒', '▓', '█'];
const HEAT_COLORS: [Color; 4] = [Color::Blue, Color::Cyan, Color::Yellow, Color::Red];
const DIM: Style = Style::new().fg(Color::DarkGray);

pub fn draw(frame: &mut Frame, insight: &Insight, area: Rect) {
    let block = Block::new()
        .borders(Borders::ALL)
        .border_style(DIM)
        .title(" Engine (F2 hides) ");
    let inner = block.inner(area);
    frame.render_widget(block, area);
    if inner.width == 0 || inner.height == 0 {
        return;
    }
    let time_rows = TIME_ROWS.min(inner.height);
    let [map_area, time_area] =
        Layout::vertical([Constraint::Min(0), Constraint::Length(time_rows)]).areas(inner);
    let width = usize::from(inner.width);
    if map_area.height > 0 {
        let lines = routing_lines(insight, width, usize::from(map_area.height));
        frame.render_widget(Paragraph::new(lines), map_area);
    }
    frame.render_widget(Paragraph::new(time_lines(insight, width)), time_area);
}

/// How the map fits `width` columns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum MapMode {
    /// One glyph of `cells` columns per expert.
    Grid { cells: usize },
    /// One bar per layer: its distinct experts this turn.
    Bars,
}

fn map_mode(experts: usize, width: usize) -> MapMode {
    let frame = LABEL_COLUMNS + DISTINCT_COLUMNS;
    if width >= frame + 2 * experts {
        MapMode::Grid { cells: 2 }
    } else if width >= frame + experts {
        MapMode::Grid { cells: 1 }
    } else {
        MapMode::Bars
    }
}

/// The routing map in at most `height` lines of `width` columns. Layers share a line when there
/// are more layers than lines.
pub fn routing_lines(insight: &Insight, width: usize, height: usize) -> Vec<Line<'static>> {
    let mut lines = Vec::new();
    if height == 0 {
        return lines;
    }
    let (layers, experts) = (insight.layers, insight.experts);
    let heading = if insight.has_routing() {
        format!(
            "Routing, last ~{HEAT_TOKENS:.0} tokens: {layers} layers × {experts} experts, top-{}",
            insight.experts_per_token
        )
    } else {
        "Routing: waiting for the first tokens".to_string()
    };
    lines.push(Line::styled(
        fit(&heading, width),
        Style::new().add_modifier(Modifier::BOLD),
    ));
    if !insight.has_routing() || layers == 0 || experts == 0 {
        return lines;
    }
    let mode = map_mode(experts, width);
    let ruler = match mode {
        MapMode::Grid { cells } => {
            let mut ruler = " ".repeat(LABEL_COLUMNS);
            let mut column = 0;
            while column < experts {
                let mark = column.to_string();
                let span = 8 * cells;
                ruler.push_str(&format!("{mark:<span$}"));
                column += 8;
            }
            let map_end = LABEL_COLUMNS + experts * cells;
            let mut ruler: String = ruler.chars().take(map_end).collect();
            ruler.push_str(&format!("{:>width$}", "turn", width = DISTINCT_COLUMNS));
            ruler
        }
        MapMode::Bars => format!(
            "{:<width$}distinct experts this turn",
            "",
            width = LABEL_COLUMNS
        ),
    };
    lines.push(Line::styled(fit(&ruler, width), DIM));
    let rows = height.saturating_sub(lines.len()).max(1);
    let per_row = layers.div_ceil(rows);
    for first in (0..layers).step_by(per_row) {
        let last = (first + per_row).min(layers) - 1;
        lines.push(layer_line(insight, first..=last, mode, width));
        if lines.len() == height {
            break;
        }
    }
    lines
}

fn layer_line(
    insight: &Insight,
    group: std::ops::RangeInclusive<usize>,
    mode: MapMode,
    width: usize,
) -> Line<'static> {
    let experts = insight.experts;
    let label = if group.start() == group.end() {
        format!("L{}", group.start())
    } else {
        format!("L{}+", group.start())
    };
    let mut spans = vec![Span::styled(format!("{label:<LABEL_COLUMNS$}"), DIM)];
    let distinct = group
        .clone()
        .filter_map(|layer| insight.turn_distinct.get(layer).copied())
        .max()
        .unwrap_or(0);
    let distinct_text = format!("{distinct:>3}/{experts:<2}");
    match mode {
        MapMode::Grid { cells } => {
            let mut heat = vec![0.0; experts];
            for layer in group {
                for (sum, value) in heat.iter_mut().zip(insight.layer_heat(layer)) {
                    *sum += value;
                }
            }
            let hottest = heat.iter().copied().fold(0.0, f64::max);
            for value in heat {
                let (glyph, style) = heat_glyph(value, hottest);
                spans.push(Span::styled(glyph.to_string().repeat(cells), style));
            }
            spans.push(Span::raw(format!("{distinct_text:>DISTINCT_COLUMNS$}")));
        }
        MapMode::Bars => {
            let bar_cells = width
                .saturating_sub(LABEL_COLUMNS + DISTINCT_COLUMNS + 2)
                .max(1);
            let ratio = f64::from(distinct) / experts as f64;
            let filled = ((ratio * bar_cells as f64).round() as usize).min(bar_cells);
            spans.push(Span::raw("["));
            spans.push(Span::styled(
                "█".repeat(filled),
                Style::new().fg(Color::Cyan),
            ));
            spans.push(Span::styled("░".repeat(bar_cells - filled), DIM));
            spans.push(Span::raw("]"));
            spans.push(Span::raw(format!("{distinct_text:>DISTINCT_COLUMNS$}")));
        }
    }
    Line::from(spans)
}

/// The glyph of an expert chosen `value` times (decayed) in a layer whose hottest is `hottest`.
fn heat_glyph(value: f64, hottest: f64) -> (char, Style) {
    // Below a hundredth of a choice it has faded out: shown as never chosen.
    if value < 0.01 || hottest <= 0.0 {
        return ('·', DIM);
    }
    let level = (((value / hottest) * 4.0).ceil() as usize).clamp(1, 4) - 1;
    (GLYPHS[level], Style::new().fg(HEAT_COLORS[level]))
}

/// Where a decode step's time goes, and the roofline, in [`TIME_ROWS`] lines of `width` columns.
pub fn time_lines(insight: &Insight, width: usize) -> Vec<Line<'static>> {
    let mut lines = Vec::new();
    let heading = match insight.decode_rate {
        Some(rate) if rate > 0.0 => format!(
            "Decode step: {:.1} ms/token, {rate:.1} tok/s",
            1000.0 / rate
        ),
        _ => "Decode step: waiting for decoded tokens".to_string(),
    };
    lines.push(Line::styled(
        fit(&heading, width),
        Style::new().add_modifier(Modifier::BOLD),
    ));
    const NAME_COLUMNS: usize = 13;
    let bar_cells = width.saturating_sub(NAME_COLUMNS + 7).max(1);
    let names = [
        "attention",
        "experts",
        "unembedding",
        "quantization",
        "rest",
        "outside",
    ];
    for (index, name) in names.iter().enumerate() {
        let share = insight.shares.map(|shares| shares[index].1);
        let label = if *name == "outside" {
            "sample+parse"
        } else {
            name
        };
        let mut spans = vec![Span::styled(format!("{label:<NAME_COLUMNS$}"), DIM)];
        match share {
            Some(share) => {
                let filled =
                    ((share.clamp(0.0, 1.0) * bar_cells as f64).round() as usize).min(bar_cells);
                spans.push(Span::styled(
                    "█".repeat(filled),
                    Style::new().fg(Color::Green),
                ));
                spans.push(Span::styled("░".repeat(bar_cells - filled), DIM));
                spans.push(Span::raw(format!(" {:>4.0}%", share * 100.0)));
            }
            None => spans.push(Span::styled("-", DIM)),
        }
        lines.push(Line::from(spans));
    }
    let roofline = insight.roofline();
    let mut spans = vec![Span::styled(format!("{:<NAME_COLUMNS$}", "roofline"), DIM)];
    let bar = width.saturating_sub(NAME_COLUMNS + 2).max(1);
    let filled = roofline.map_or(0, |ratio| {
        ((ratio.clamp(0.0, 1.0) * bar as f64).round() as usize).min(bar)
    });
    let color = match roofline {
        Some(ratio) if ratio >= 0.75 => Color::Green,
        Some(ratio) if ratio >= 0.4 => Color::Yellow,
        _ => Color::Red,
    };
    spans.push(Span::raw("["));
    spans.push(Span::styled("█".repeat(filled), Style::new().fg(color)));
    spans.push(Span::styled("░".repeat(bar - filled), DIM));
    spans.push(Span::raw("]"));
    lines.push(Line::from(spans));
    let (first, second) = match (
        roofline,
        insight.bandwidth,
        insight.effective_bandwidth_gbps(),
    ) {
        (Some(ratio), Some((machine, threads)), Some(used)) => (
            format!(
                "decode at {:.0}% of memory bandwidth ({threads} threads)",
                ratio * 100.0
            ),
            format!(
                "{:.2} GB/token × {:.1} tok/s = {used:.1} of {machine:.1} GB/s",
                insight.bytes_per_token.unwrap_or(0) as f64 / 1e9,
                insight.decode_rate.unwrap_or(0.0),
            ),
        ),
        (_, None, _) if insight.bandwidth_elsewhere => (
            "no roofline: the weights are read on the server".to_string(),
            String::new(),
        ),
        (_, None, _) if insight.bandwidth_pending => (
            "measuring the machine's memory bandwidth…".to_string(),
            String::new(),
        ),
        (_, None, _) => (
            "memory bandwidth not measured yet".to_string(),
            String::new(),
        ),
        (_, Some((machine, threads)), _) => (
            "waiting for decoded tokens".to_string(),
            format!("the machine reads {machine:.1} GB/s ({threads} threads)"),
        ),
    };
    lines.push(Line::styled(
        fit(&first, width),
        Style::new().add_modifier(Modifier::BOLD),
    ));
    lines.push(Line::styled(fit(&second, width), DIM));
    lines
}

/// `text` cut to `width` columns (an ellipsis marks the cut).
fn fit(text: &str, width: usize) -> String {
    crate::tui::markdown::truncate_to_width(text, width)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_modes_by_width() {
        assert_eq!(map_mode(32, 80), MapMode::Grid { cells: 2 });
        assert_eq!(map_mode(32, 50), MapMode::Grid { cells: 1 });
        assert_eq!(map_mode(32, 30), MapMode::Bars);
    }

    #[test]
    fn glyphs_scale_with_the_hottest() {
        assert_eq!(heat_glyph(0.0, 5.0).0, '·');
        assert_eq!(heat_glyph(5.0, 5.0).0, '█');
        assert_eq!(heat_glyph(1.0, 5.0).0, '░');
        assert_eq!(heat_glyph(2.4, 5.0).0, '▒');
    }
}
