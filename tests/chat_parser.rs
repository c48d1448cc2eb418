//! The streaming harmony parser on well-formed and malformed completions.

use ossterm::chat::tokenizer::special;
use ossterm::chat::{Channel, HarmonyParser, Malformation, ParseEvent, StopToken, Tokenizer};

/// Events with owned strings, and consecutive text deltas of one message merged.
#[derive(Debug, PartialEq)]
enum Seen {
    Start {
        role: String,
        channel: Option<Channel>,
        name: String,
        recipient: Option<String>,
    },
    Text(Option<Channel>, String),
    End(Option<Channel>, bool),
    Stop(StopToken),
    Malformed(Malformation),
}

fn tokenizer() -> &'static Tokenizer {
    Tokenizer::shared().unwrap()
}

/// Completion text with literal special-token names, tokenized the way the model would emit it.
fn ids(completion: &str) -> Vec<u32> {
    tokenizer().encode_with_special_tokens(completion).unwrap()
}

fn parse(ids: &[u32], finish: bool) -> (Vec<Seen>, usize) {
    let mut parser = HarmonyParser::after_prompt(tokenizer(), "assistant");
    let mut seen = Vec::new();
    let mut text_events = 0;
    let mut record = |event: ParseEvent<'_>| {
        let item = match event {
            ParseEvent::MessageStart {
                role,
                channel,
                channel_name,
                recipient,
            } => Seen::Start {
                role: role.into(),
                channel,
                name: channel_name.into(),
                recipient: recipient.map(Into::into),
            },
            ParseEvent::Text { channel, text } => {
                text_events += 1;
                assert!(!text.is_empty(), "empty text delta");
                if let Some(Seen::Text(last_channel, last)) = seen.last_mut() {
                    if *last_channel == channel {
                        last.push_str(text);
                        return;
                    }
                }
                Seen::Text(channel, text.into())
            }
            ParseEvent::MessageEnd { channel, complete } => Seen::End(channel, complete),
            ParseEvent::Stop(stop) => Seen::Stop(stop),
            ParseEvent::Malformed(malformation) => Seen::Malformed(malformation),
        };
        seen.push(item);
    };
    for &id in ids {
        parser.push(id, &mut record);
    }
    if finish {
        parser.finish(&mut record);
    }
    (seen, text_events)
}

fn start(channel: Channel) -> Seen {
    Seen::Start {
        role: "assistant".into(),
        channel: Some(channel),
        name: channel.as_str().into(),
        recipient: None,
    }
}

#[test]
fn analysis_then_final_streams_both_channels_without_header_tokens() {
    let completion = "<|channel|>analysis<|message|>Simple arithmetic.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>";
    let ids = ids(completion);
    assert_eq!(
        ids,
        [
            200005, 35644, 200008, 17958, 81645, 13, 200007, 200006, 173781, 200005, 17196, 200008,
            19, 200002
        ]
    );
    let (seen, text_events) = parse(&ids, false);
    assert_eq!(
        seen,
        [
            start(Channel::Analysis),
            Seen::Text(Some(Channel::Analysis), "Simple arithmetic.".into()),
            Seen::End(Some(Channel::Analysis), true),
            start(Channel::Final),
            Seen::Text(Some(Channel::Final), "4".into()),
            Seen::End(Some(Channel::Final), true),
            Seen::Stop(StopToken::Return),
        ]
    );
    assert_eq!(text_events, 4, "one delta per text token");
}

#[test]
fn final_only_with_unicode_split_across_tokens() {
    let answer = "Grüße 🙂 日本語 🦀 ꙮ";
    let answer_ids = tokenizer().encode_text(answer).unwrap();
    assert!(
        answer_ids
            .iter()
            .any(|&id| std::str::from_utf8(tokenizer().token_bytes(id).unwrap()).is_err()),
        "the answer should contain a character split across tokens"
    );
    let mut completion_ids = ids("<|channel|>final<|message|>");
    completion_ids.extend(answer_ids);
    completion_ids.push(special::RETURN);
    let (seen, _) = parse(&completion_ids, false);
    assert_eq!(
        seen,
        [
            start(Channel::Final),
            Seen::Text(Some(Channel::Final), answer.into()),
            Seen::End(Some(Channel::Final), true),
            Seen::Stop(StopToken::Return),
        ]
    );
}

#[test]
fn tool_call_reports_recipient_and_stops_on_call() {
    let completion = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}<|call|>";
    let (seen, _) = parse(&ids(completion), false);
    assert_eq!(
        seen,
        [
            Seen::Start {
                role: "assistant".into(),
                channel: Some(Channel::Commentary),
                name: "commentary".into(),
                recipient: Some("functions.get_weather".into()),
            },
            Seen::Text(Some(Channel::Commentary), "{\"city\":\"Oslo\"}".into()),
            Seen::End(Some(Channel::Commentary), true),
            Seen::Stop(StopToken::Call),
        ]
    );
}

#[test]
fn a_recipient_ends_where_the_content_type_begins_even_without_a_space() {
    // harmony's docs show both `to=functions.f <|constrain|>json` and
    // `to=functions.f<|constrain|>json`; and the recipient may stand before the channel.
    for completion in [
        "<|channel|>commentary to=functions.generate_file<|constrain|>json<|message|>{}<|call|>",
        " to=functions.generate_file<|channel|>commentary json<|message|>{}<|call|>",
    ] {
        let (seen, _) = parse(&ids(completion), false);
        assert_eq!(
            seen[0],
            Seen::Start {
                role: "assistant".into(),
                channel: Some(Channel::Commentary),
                name: "commentary".into(),
                recipient: Some("functions.generate_file".into()),
            },
            "{completion}"
        );
    }
}

#[test]
fn missing_and_unknown_channels_are_reported_and_text_still_flows() {
    let (seen, _) = parse(
        &ids(
            "<|message|>no channel<|end|><|start|>assistant<|channel|>musings<|message|>hmm<|end|>",
        ),
        true,
    );
    assert_eq!(
        seen,
        [
            Seen::Malformed(Malformation::MissingChannel),
            Seen::Start {
                role: "assistant".into(),
                channel: None,
                name: "".into(),
                recipient: None
            },
            Seen::Text(None, "no channel".into()),
            Seen::End(None, true),
            Seen::Malformed(Malformation::UnknownChannel),
            Seen::Start {
                role: "assistant".into(),
                channel: None,
                name: "musings".into(),
                recipient: None
            },
            Seen::Text(None, "hmm".into()),
            Seen::End(None, true),
        ]
    );
}

#[test]
fn text_after_stop_and_between_messages_is_reported_not_emitted() {
    let (seen, _) = parse(
        &ids("<|channel|>final<|message|>ok<|end|>stray words<|start|>assistant<|channel|>final<|message|>done<|return|>more"),
        true,
    );
    let stray = ids("stray words");
    let more = ids("more");
    assert_eq!(
        seen,
        [
            start(Channel::Final),
            Seen::Text(Some(Channel::Final), "ok".into()),
            Seen::End(Some(Channel::Final), true),
            Seen::Malformed(Malformation::TextOutsideMessage { id: stray[0] }),
            start(Channel::Final),
            Seen::Text(Some(Channel::Final), "done".into()),
            Seen::End(Some(Channel::Final), true),
            Seen::Stop(StopToken::Return),
            Seen::Malformed(Malformation::TokenAfterStop { id: more[0] }),
        ]
    );
}

#[test]
fn reserved_tokens_missing_end_and_truncation_do_not_panic() {
    let mut completion = ids("<|channel|>analysis<|message|>think");
    completion.push(200_100); // a reserved token inside text
    completion.extend(ids("ing<|start|>assistant<|channel|>final<|message|>half"));
    let (seen, _) = parse(&completion, true);
    assert_eq!(
        seen,
        [
            start(Channel::Analysis),
            Seen::Text(Some(Channel::Analysis), "think".into()),
            Seen::Malformed(Malformation::UnexpectedToken { id: 200_100 }),
            Seen::Text(Some(Channel::Analysis), "ing".into()),
            Seen::Malformed(Malformation::MissingEnd),
            Seen::End(Some(Channel::Analysis), false),
            start(Channel::Final),
            Seen::Text(Some(Channel::Final), "half".into()),
            Seen::End(Some(Channel::Final), false),
        ]
    );
    // Output that ends inside a header, and a header that never ends.
    let (seen, _) = parse(&ids("<|channel|>fin"), true);
    assert_eq!(seen, [Seen::Malformed(Malformation::Truncated)]);
    let endless: Vec<u32> = std::iter::repeat_n(ids("x")[0], 100).collect();
    let (seen, _) = parse(&endless, true);
    assert_eq!(seen[0], Seen::Malformed(Malformation::HeaderTooLong));
    assert_eq!(seen[1], Seen::Malformed(Malformation::MissingChannel));
    assert!(matches!(seen.last(), Some(Seen::End(None, false))));
}

#[test]
fn end_of_text_stops_and_ids_past_the_vocabulary_are_reported() {
    let mut completion = ids("<|channel|>final<|message|>bye");
    completion.push(400_000);
    completion.push(special::END_OF_TEXT);
    let (seen, _) = parse(&completion, false);
    assert_eq!(
        seen,
        [
            start(Channel::Final),
            Seen::Text(Some(Channel::Final), "bye".into()),
            Seen::Malformed(Malformation::UnexpectedToken { id: 400_000 }),
            Seen::End(Some(Channel::Final), true),
            Seen::Stop(StopToken::EndOfText),
        ]
    );
}
