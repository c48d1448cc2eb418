//! Harmony rendering and tokenization against the spec's example and openai-harmony's renderings
//! (fixtures made by tools/make_harmony_fixtures.py).

use std::path::{Path, PathBuf};

use ossterm::chat::tokenizer::special;
use ossterm::chat::{
    render_for_completion, Channel, ChatMessage, Conversation, ReasoningEffort, RenderOptions,
    SystemSettings, Tokenizer,
};

/// The spec's 2-turn example (section 5), rendered by openai-harmony 0.0.8.
const SPEC_TWO_TURN_IDS: [u32; 103] = [
    200006, 17360, 200008, 3575, 553, 17554, 162016, 11, 261, 4410, 6439, 2359, 22203, 656, 7788,
    17527, 558, 87447, 100594, 25, 220, 1323, 19, 12, 3218, 198, 6576, 3521, 25, 220, 1323, 20, 12,
    3062, 12, 2922, 279, 30377, 289, 25, 4465, 279, 2, 13888, 18403, 25, 8450, 11, 49159, 11, 1721,
    13, 21030, 2804, 413, 7360, 395, 1753, 3176, 13, 200007, 200006, 77944, 200008, 2, 68406, 279,
    17045, 51088, 13, 200007, 200006, 1428, 200008, 4827, 382, 220, 17, 659, 220, 17, 30, 200007,
    200006, 173781, 200005, 17196, 200008, 19, 200007, 200006, 1428, 200008, 3436, 220, 18, 659,
    220, 18, 30, 200007, 200006, 173781,
];

fn tokenizer() -> &'static Tokenizer {
    Tokenizer::shared().expect("the embedded o200k_harmony vocabulary loads")
}

fn spec_conversation() -> Conversation {
    Conversation {
        system: SystemSettings {
            reasoning: Some(ReasoningEffort::Low),
            date: Some("2025-08-05".into()),
            ..SystemSettings::default()
        },
        developer: Some("Answer briefly.".into()),
        messages: vec![
            ChatMessage::user("What is 2 + 2?"),
            ChatMessage::assistant(Channel::Analysis, "Simple arithmetic."),
            ChatMessage::assistant(Channel::Final, "4"),
            ChatMessage::user("And 3 + 3?"),
        ],
        ..Conversation::default()
    }
}

#[test]
fn spec_two_turn_example_matches_id_for_id() {
    let ids = render_for_completion(tokenizer(), &spec_conversation(), &RenderOptions::default())
        .unwrap();
    assert_eq!(ids, SPEC_TWO_TURN_IDS);
}

#[test]
fn first_turn_prompt_is_the_prefix_of_the_second() {
    let mut first_turn = spec_conversation();
    first_turn.messages.truncate(1);
    let ids = render_for_completion(tokenizer(), &first_turn, &RenderOptions::default()).unwrap();
    assert_eq!(ids, SPEC_TWO_TURN_IDS[..85]);
}

#[test]
fn keeping_reasoning_inserts_the_analysis_message() {
    let options = RenderOptions {
        keep_reasoning: true,
    };
    let ids = render_for_completion(tokenizer(), &spec_conversation(), &options).unwrap();
    // <|start|>assistant<|channel|>analysis<|message|>Simple arithmetic.<|end|> right after the
    // first user message (which ends at id 83).
    let analysis = [
        200006, 173781, 200005, 35644, 200008, 17958, 81645, 13, 200007,
    ];
    assert_eq!(ids[..83], SPEC_TWO_TURN_IDS[..83]);
    assert_eq!(ids[83..92], analysis);
    assert_eq!(ids[92..], SPEC_TWO_TURN_IDS[83..]);
}

#[test]
fn spec_completion_decodes_and_special_strings_stay_text() {
    let tokenizer = tokenizer();
    let completion = [
        200005, 35644, 200008, 17958, 81645, 13, 200007, 200006, 173781, 200005, 17196, 200008, 19,
        200002,
    ];
    assert_eq!(
        tokenizer.decode(&completion).unwrap(),
        "<|channel|>analysis<|message|>Simple arithmetic.<|end|><|start|>assistant<|channel|>final<|message|>4<|return|>"
    );
    let typed = tokenizer.encode_text("say <|end|> now").unwrap();
    assert!(
        typed.iter().all(|&id| !Tokenizer::is_special(id)),
        "{typed:?}"
    );
    assert_eq!(tokenizer.decode(&typed).unwrap(), "say <|end|> now");
    assert_eq!(
        tokenizer.encode_with_special_tokens("<|end|>").unwrap(),
        [special::END]
    );
    assert!(tokenizer.decode(&[201_088]).is_err());
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/harmony")
}

#[test]
fn renderings_match_openai_harmony_fixtures() {
    let tokenizer = tokenizer();
    let mut checked = 0;
    for entry in std::fs::read_dir(fixture_dir()).unwrap() {
        let path = entry.unwrap().path();
        let Some(name) = path
            .file_name()
            .and_then(|name| name.to_str())
            .and_then(|name| name.strip_suffix(".conversation.json"))
        else {
            continue;
        };
        let conversation = Conversation::load(&path).unwrap();
        let expected_path = fixture_dir().join(format!("{name}.expected.json"));
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&expected_path).unwrap()).unwrap();
        for (key, keep_reasoning) in [("ids", false), ("ids_keep_reasoning", true)] {
            let want: Vec<u32> = serde_json::from_value(expected[key].clone()).unwrap();
            let got =
                render_for_completion(tokenizer, &conversation, &RenderOptions { keep_reasoning })
                    .unwrap();
            assert_eq!(
                got,
                want,
                "{name} ({key}): ossterm renders {:?}\nopenai-harmony renders {:?}",
                tokenizer.decode(&got).unwrap(),
                tokenizer.decode(&want).unwrap()
            );
        }
        checked += 1;
    }
    assert!(checked >= 10, "only {checked} harmony fixtures found");
}
