//! Light markdown for answers: headings, lists, quotes, rules, bold/italic, inline code and fenced
//! code blocks set apart; plus word wrapping of styled lines to a width.

use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use unicode_segmentation::UnicodeSegmentation;
use unicode_width::UnicodeWidthStr;

/// Style of code, inline and in blocks.
pub const CODE_STYLE: Style = Style::new().fg(Color::LightYellow);

/// Renders `text` as styled lines (not yet wrapped).
pub fn render_markdown(text: &str, base: Style) -> Vec<Line<'static>> {
    let mut lines = Vec::new();
    let mut in_code_block = false;
    for raw in text.lines() {
        let trimmed = raw.trim_start();
        if let Some(fence_info) = trimmed.strip_prefix("```") {
            if in_code_block {
                lines.push(Line::from(Span::styled(
                    "  └────",
                    CODE_STYLE.add_modifier(Modifier::DIM),
                )));
            } else {
                let label = if fence_info.trim().is_empty() {
                    "code".to_string()
                } else {
                    fence_info.trim().to_string()
                };
                lines.push(Line::from(Span::styled(
                    format!("  ┌─ {label}"),
                    CODE_STYLE.add_modifier(Modifier::DIM),
                )));
            }
            in_code_block = !in_code_block;
            continue;
        }
        if in_code_block {
            lines.push(Line::from(vec![
                Span::styled("  │ ", CODE_STYLE.add_modifier(Modifier::DIM)),
                Span::styled(raw.to_string(), CODE_STYLE),
            ]));
            continue;
        }
        lines.push(render_block_line(raw, base));
    }
    lines
}

fn render_block_line(raw: &str, base: Style) -> Line<'static> {
    let indent_width = raw.len() - raw.trim_start().len();
    let indent = " ".repeat(indent_width);
    let trimmed = raw.trim_start();

    let heading_level = trimmed
        .chars()
        .take_while(|character| *character == '#')
        .count();
    if (1..=6).contains(&heading_level) && trimmed[heading_level..].starts_with(' ') {
        let title = trimmed[heading_level..].trim();
        let style = match heading_level {
            1 => base.add_modifier(Modifier::BOLD | Modifier::UNDERLINED),
            2 => base.add_modifier(Modifier::BOLD),
            _ => base.add_modifier(Modifier::BOLD | Modifier::ITALIC),
        };
        return Line::from(render_inline(title, style));
    }
    if trimmed.len() >= 3
        && (trimmed.chars().all(|c| c == '-') || trimmed.chars().all(|c| c == '*'))
    {
        return Line::from(Span::styled(
            "─".repeat(24),
            base.add_modifier(Modifier::DIM),
        ));
    }
    for bullet in ["- ", "* ", "+ "] {
        if let Some(item) = trimmed.strip_prefix(bullet) {
            let mut spans = vec![Span::styled(format!("{indent}  • "), base)];
            spans.extend(render_inline(item, base));
            return Line::from(spans);
        }
    }
    let digits = trimmed.chars().take_while(char::is_ascii_digit).count();
    if digits > 0 && (trimmed[digits..].starts_with(". ") || trimmed[digits..].starts_with(") ")) {
        let mut spans = vec![Span::styled(
            format!("{indent}  {} ", &trimmed[..digits + 1]),
            base,
        )];
        spans.extend(render_inline(&trimmed[digits + 2..], base));
        return Line::from(spans);
    }
    if let Some(quote) = trimmed.strip_prefix('>') {
        let style = base.add_modifier(Modifier::DIM | Modifier::ITALIC);
        let mut spans = vec![Span::styled(format!("{indent}│ "), style)];
        spans.extend(render_inline(quote.trim_start(), style));
        return Line::from(spans);
    }
    let mut spans = vec![Span::styled(indent, base)];
    spans.extend(render_inline(trimmed, base));
    Line::from(spans)
}

/// Inline markup: `code`, **bold**, *italic* and _italic_. Unclosed markers stay literal text.
pub fn render_inline(text: &str, base: Style) -> Vec<Span<'static>> {
    let characters: Vec<char> = text.chars().collect();
    let mut spans = Vec::new();
    let mut current = String::new();
    let mut bold = false;
    let mut italic = false;
    let style_of = |bold: bool, italic: bool| {
        let mut style = base;
        if bold {
            style = style.add_modifier(Modifier::BOLD);
        }
        if italic {
            style = style.add_modifier(Modifier::ITALIC);
        }
        style
    };
    let mut index = 0;
    while index < characters.len() {
        let character = characters[index];
        let next = characters.get(index + 1).copied();
        let previous = index.checked_sub(1).map(|at| characters[at]);
        if character == '`' {
            if let Some(length) = characters[index + 1..].iter().position(|c| *c == '`') {
                flush(&mut spans, &mut current, style_of(bold, italic));
                let code: String = characters[index + 1..index + 1 + length].iter().collect();
                spans.push(Span::styled(code, CODE_STYLE));
                index += length + 2;
                continue;
            }
        }
        if character == '*' && next == Some('*') {
            let closes = bold;
            let opens = !bold
                && characters[index + 2..]
                    .windows(2)
                    .any(|pair| pair == ['*', '*']);
            if closes || opens {
                flush(&mut spans, &mut current, style_of(bold, italic));
                bold = !bold;
                index += 2;
                continue;
            }
        }
        // A doubled marker that did not pair up as bold stays literal rather than as two italics.
        let doubled = next == Some(character) || previous == Some(character);
        if (character == '*' || character == '_') && !doubled {
            let word_inside = |c: Option<char>| c.is_some_and(|c| !c.is_whitespace());
            let boundary_before =
                previous.is_none_or(|c| c.is_whitespace() || c.is_ascii_punctuation());
            let boundary_after = next.is_none_or(|c| c.is_whitespace() || c.is_ascii_punctuation());
            let opens = !italic
                && word_inside(next)
                && (character == '*' || boundary_before)
                && characters[index + 1..].contains(&character);
            let closes = italic && word_inside(previous) && (character == '*' || boundary_after);
            if opens || closes {
                flush(&mut spans, &mut current, style_of(bold, italic));
                italic = !italic;
                index += 1;
                continue;
            }
        }
        current.push(character);
        index += 1;
    }
    flush(&mut spans, &mut current, style_of(bold, italic));
    spans
}

fn flush(spans: &mut Vec<Span<'static>>, current: &mut String, style: Style) {
    if !current.is_empty() {
        spans.push(Span::styled(std::mem::take(current), style));
    }
}

/// `text` with nothing that could move the terminal's cursor, change its state or be measured
/// differently by the terminal and by the layout: C0/C1 control characters become visible
/// stand-ins (ESC shows as ␛, CR as ␍), a tab becomes four spaces, and invisible format characters
/// (zero-width spaces and joiners, bidirectional overrides, variation selectors) are dropped.
/// Model output is untrusted: a random or confused model can emit any byte. Newlines are kept.
pub fn terminal_safe(text: &str) -> std::borrow::Cow<'_, str> {
    let needs_change = |character: char| {
        (character.is_control() && character != '\n') || is_invisible_format(character)
    };
    if !text.chars().any(needs_change) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut safe = String::with_capacity(text.len() + 8);
    for character in text.chars() {
        match character {
            '\n' => safe.push('\n'),
            '\t' => safe.push_str("    "),
            // Control Pictures: U+2400 + code for C0, U+2421 for DEL.
            '\u{0}'..='\u{1f}' => {
                safe.push(char::from_u32(0x2400 + character as u32).unwrap_or('\u{fffd}'))
            }
            '\u{7f}' => safe.push('\u{2421}'),
            _ if character.is_control() => safe.push('\u{fffd}'),
            _ if is_invisible_format(character) => {}
            _ => safe.push(character),
        }
    }
    std::borrow::Cow::Owned(safe)
}

pub(crate) fn is_invisible_format(character: char) -> bool {
    matches!(
        character,
        '\u{00ad}'
            | '\u{061c}'
            | '\u{180e}'
            | '\u{200b}'..='\u{200f}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{2064}'
            | '\u{2066}'..='\u{2069}'
            | '\u{fe00}'..='\u{fe0f}'
            | '\u{feff}'
    )
}

/// Display width of a string in terminal cells, measured as the screen buffer places it: by
/// grapheme cluster (a base character with its combining marks is one cluster), each as wide as
/// its East Asian width and emoji presentation say. Call it on [`terminal_safe`] text: that has
/// already dropped the invisible format characters (zero-width joiners, variation selectors) on
/// whose width terminals disagree.
pub fn text_width(text: &str) -> usize {
    text.graphemes(true).map(grapheme_width).sum()
}

/// Cells of one grapheme cluster. A cluster made only of zero-width characters (a combining mark
/// with nothing to combine with) is dropped by the screen buffer, so it takes no cell.
pub fn grapheme_width(grapheme: &str) -> usize {
    grapheme.width()
}

/// `text` cut to at most `width` cells, whole grapheme clusters only; a cut ends in `…`.
pub fn truncate_to_width(text: &str, width: usize) -> String {
    if text_width(text) <= width {
        return text.to_string();
    }
    let mut kept = String::new();
    let mut used = 0;
    for grapheme in text.graphemes(true) {
        let cells = grapheme_width(grapheme);
        if used + cells + 1 > width {
            break;
        }
        kept.push_str(grapheme);
        used += cells;
    }
    if width > 0 {
        kept.push('…');
    }
    kept
}

/// Wraps styled lines to `width` cells, breaking at spaces where it can and inside words where a
/// word is longer than a line. Styles are kept; an empty line stays one empty line.
pub fn wrap_lines(lines: &[Line<'static>], width: usize) -> Vec<Line<'static>> {
    let width = width.max(1);
    let mut wrapped = Vec::new();
    for line in lines {
        wrap_line(line, width, &mut wrapped);
    }
    wrapped
}

fn wrap_line(line: &Line<'static>, width: usize, output: &mut Vec<Line<'static>>) {
    // Split into words (a run of non-spaces with its trailing spaces), each a list of styled pieces.
    let mut words: Vec<Vec<(Style, String)>> = Vec::new();
    let mut word: Vec<(Style, String)> = Vec::new();
    let mut in_spaces = false;
    for span in &line.spans {
        let style = line.style.patch(span.style);
        for grapheme in terminal_safe(&span.content).graphemes(true) {
            let is_space = grapheme == " ";
            if !is_space && in_spaces {
                words.push(std::mem::take(&mut word));
                in_spaces = false;
            }
            in_spaces |= is_space;
            match word.last_mut() {
                Some((last_style, text)) if *last_style == style => text.push_str(grapheme),
                _ => word.push((style, grapheme.to_string())),
            }
        }
    }
    if !word.is_empty() {
        words.push(word);
    }

    let mut current: Vec<Span<'static>> = Vec::new();
    let mut used = 0;
    for word in words {
        let word_width: usize = word.iter().map(|(_, text)| text_width(text)).sum();
        let trimmed_width: usize = word_width - trailing_spaces(&word);
        if used > 0 && used + trimmed_width > width {
            output.push(Line::from(std::mem::take(&mut current)));
            used = 0;
        }
        for (style, text) in word {
            // By cluster, so a line never breaks between a character and its combining marks.
            for grapheme in text.graphemes(true) {
                let cell = grapheme_width(grapheme);
                if used + cell > width {
                    if grapheme == " " {
                        continue;
                    }
                    output.push(Line::from(std::mem::take(&mut current)));
                    used = 0;
                }
                push_grapheme(&mut current, style, grapheme);
                used += cell;
            }
        }
    }
    output.push(Line::from(current));
}

fn trailing_spaces(word: &[(Style, String)]) -> usize {
    word.last()
        .map_or(0, |(_, text)| text.len() - text.trim_end_matches(' ').len())
}

fn push_grapheme(spans: &mut Vec<Span<'static>>, style: Style, grapheme: &str) {
    match spans.last_mut() {
        Some(span) if span.style == style => span.content.to_mut().push_str(grapheme),
        _ => spans.push(Span::styled(grapheme.to_string(), style)),
    }
}

/// The plain text of a line (for tests and copy).
pub fn line_text(line: &Line<'_>) -> String {
    line.spans
        .iter()
        .map(|span| span.content.as_ref())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(lines: &[Line<'_>]) -> Vec<String> {
        lines.iter().map(line_text).collect()
    }

    #[test]
    fn headings_lists_and_code_blocks() {
        let lines = render_markdown(
            "# Title\n- one\n2. two\n```rust\nlet x = 1;\n```\nplain",
            Style::default(),
        );
        assert_eq!(
            texts(&lines),
            vec![
                "Title",
                "  • one",
                "  2. two",
                "  ┌─ rust",
                "  │ let x = 1;",
                "  └────",
                "plain"
            ]
        );
        assert!(lines[0].spans[0]
            .style
            .add_modifier
            .contains(Modifier::BOLD));
        assert_eq!(lines[4].spans[1].style, CODE_STYLE);
    }

    #[test]
    fn inline_bold_italic_code() {
        let spans = render_inline("a **b** *c* `d` snake_case_name", Style::default());
        let by_text = |needle: &str| {
            spans
                .iter()
                .find(|span| span.content == needle)
                .map(|span| span.style)
        };
        assert!(by_text("b").unwrap().add_modifier.contains(Modifier::BOLD));
        assert!(by_text("c")
            .unwrap()
            .add_modifier
            .contains(Modifier::ITALIC));
        assert_eq!(by_text("d").unwrap(), CODE_STYLE);
        let all: String = spans.iter().map(|span| span.content.as_ref()).collect();
        assert!(all.ends_with("snake_case_name"), "{all}");
    }

    #[test]
    fn unclosed_markers_stay_literal() {
        let spans = render_inline("2 * 3 = 6 and **open", Style::default());
        let all: String = spans.iter().map(|span| span.content.as_ref()).collect();
        assert_eq!(all, "2 * 3 = 6 and **open");
    }

    #[test]
    fn wrap_breaks_at_spaces_and_long_words() {
        let lines = wrap_lines(&[Line::from("hello world abcdefghij")], 8);
        assert_eq!(texts(&lines), vec!["hello ", "world ", "abcdefgh", "ij"]);
        let empty = wrap_lines(&[Line::from("")], 8);
        assert_eq!(empty.len(), 1);
    }
}
