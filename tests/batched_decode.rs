//! Batched forward passes (several sequences as the rows of one pass, as `ossterm serve` decodes)
//! against each sequence computed alone: identical greedy ids on the exact path, logits within the
//! fast path's cross-path tolerance, and a copied prefix equal to a computed one.

use std::path::Path;
use std::sync::Arc;

use ossterm::model::{
    ForwardError, KvFormat, LoadOptions, Model, Precision, SequenceStep, Session,
};

fn pool() -> Arc<rayon::ThreadPool> {
    ossterm::engine::build_pool(2).expect("a pool of two threads")
}

fn load(fixture: &str, precision: Precision) -> Arc<Model> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(fixture);
    let opts = LoadOptions {
        precision,
        ..LoadOptions::default()
    };
    Arc::new(Model::load(&dir, &opts).expect("fixture loads"))
}

/// Three prompts of different lengths over the vocabulary of the tiny fixtures.
fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    prompts_of(vocab, &[5, 11, 17])
}

/// Prompts of the given lengths, each different.
fn prompts_of(vocab: usize, lengths: &[usize]) -> Vec<Vec<u32>> {
    lengths
        .iter()
        .enumerate()
        .map(|(p, &len)| {
            (0..len)
                .map(|i| ((i * 7919 + p * 104_729 + 13) % vocab) as u32)
                .collect()
        })
        .collect()
}

fn argmax(values: &[f32]) -> u32 {
    ossterm::engine::sampler::argmax(values).expect("finite logits")
}

/// Each prompt alone: the logits after the prompt and after each of `forced` (or, without
/// `forced`, greedy) tokens; returns (tokens fed, logits per step).
fn alone(
    session: &mut Session,
    prompt: &[u32],
    forced: Option<&[u32]>,
    steps: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    session.truncate(0);
    let mut logits = vec![session.prefill(prompt).unwrap().to_vec()];
    let mut fed = Vec::new();
    for step in 0..steps {
        let token = match forced {
            Some(tokens) => tokens[step],
            None => argmax(logits.last().unwrap()),
        };
        fed.push(token);
        logits.push(session.decode(token).unwrap().to_vec());
    }
    (fed, logits)
}

/// All prompts in one session: the first two prefilled together in one pass, the third joining
/// while the others decode (its prompt rows in the same pass as their decode rows), then every
/// sequence decoding one token per pass.
fn batched(
    session: &mut Session,
    prompts: &[Vec<u32>],
    forced: Option<&[Vec<u32>]>,
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>) {
    let mut sequences: Vec<_> = prompts.iter().map(|_| session.new_sequence(64)).collect();
    let mut logits: Vec<Vec<Vec<f32>>> = vec![Vec::new(); prompts.len()];
    let mut fed: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut next: Vec<Option<u32>> = vec![None; prompts.len()];
    let mut joined = vec![false; prompts.len()];
    let mut pass = 0;
    while fed.iter().any(|f| f.len() < steps) {
        let mut rows: Vec<(usize, Vec<u32>)> = Vec::new();
        for (s, prompt) in prompts.iter().enumerate() {
            if !joined[s] {
                // The last prompt joins in the second pass.
                if s + 1 < prompts.len() || pass == 1 {
                    rows.push((s, prompt.clone()));
                    joined[s] = true;
                }
            } else if fed[s].len() < steps {
                let token = match forced {
                    Some(tokens) => tokens[s][fed[s].len()],
                    None => next[s].unwrap(),
                };
                fed[s].push(token);
                rows.push((s, vec![token]));
            }
        }
        let mut steps_in_pass: Vec<SequenceStep<'_>> = Vec::new();
        let mut order = Vec::new();
        for (s, sequence) in sequences.iter_mut().enumerate() {
            if let Some((_, tokens)) = rows.iter().find(|(r, _)| *r == s) {
                order.push(s);
                steps_in_pass.push(SequenceStep { sequence, tokens });
            }
        }
        session.forward_batch(&mut steps_in_pass).unwrap();
        for (row, &s) in order.iter().enumerate() {
            let row_logits = session.batch_logits(row).to_vec();
            next[s] = Some(argmax(&row_logits));
            logits[s].push(row_logits);
        }
        pass += 1;
    }
    (fed, logits)
}

#[test]
fn batched_greedy_decode_equals_each_sequence_alone_on_the_exact_path() {
    for fixture in ["tiny_gqa8", "tiny_single"] {
        let model = load(fixture, Precision::Exact);
        let prompts = prompts(model.config.vocab_size);
        let mut session = model.new_session(&pool(), 64);
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|prompt| alone(&mut session, prompt, None, 12).0)
            .collect();
        let (got, _) = batched(&mut session, &prompts, None, 12);
        assert_eq!(
            got, want,
            "{fixture}: batched greedy ids differ from each sequence alone"
        );
    }
}

#[test]
fn batched_logits_match_each_sequence_alone_on_the_fast_path() {
    // small_wide's head_dim 64 takes int8 attention over the q8 cache on the AVX-512 path.
    for (fixture, kv) in [
        ("tiny_gqa8", KvFormat::F16),
        ("small_wide", KvFormat::F16),
        ("small_wide", KvFormat::Q8),
    ] {
        let model = load(fixture, Precision::Fast);
        let prompts = prompts(model.config.vocab_size);
        let mut session = model.new_session_with_kv(&pool(), 64, kv);
        let mut want_tokens = Vec::new();
        let mut want_logits = Vec::new();
        for prompt in &prompts {
            let (tokens, logits) = alone(&mut session, prompt, None, 10);
            want_tokens.push(tokens);
            want_logits.push(logits);
        }
        let (_, got_logits) = batched(&mut session, &prompts, Some(&want_tokens), 10);
        let mut worst = 0.0f32;
        for (want, got) in want_logits.iter().zip(&got_logits) {
            assert_eq!(want.len(), got.len());
            for (w, g) in want.iter().zip(got) {
                let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let error = w
                    .iter()
                    .zip(g)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                worst = worst.max(error / scale);
            }
        }
        // The fast path's cross-path tolerance (tests/fast_path.rs bounds the 90th percentile of
        // fast against exact at 6%); batching changes only which kernel (GEMV or GEMM) sums the
        // same int8 products.
        assert!(
            worst < 0.06,
            "{fixture} ({kv}): batched logits differ by {worst} of the largest logit"
        );
    }
}

/// A server's batch of many sequences (more rows than the old team limit of 7): decode steps of
/// ten rows run on the decode team and still give each sequence's greedy ids alone, exactly.
#[test]
fn ten_sequences_decoded_together_equal_each_alone() {
    for precision in [Precision::Exact, Precision::Fast] {
        let model = load("tiny_gqa8", precision);
        let prompts = prompts_of(model.config.vocab_size, &[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
        let mut session = model.new_session(&pool(), 64);
        let mut want_tokens = Vec::new();
        let mut want_logits = Vec::new();
        for prompt in &prompts {
            let (tokens, logits) = alone(&mut session, prompt, None, 6);
            want_tokens.push(tokens);
            want_logits.push(logits);
        }
        match precision {
            Precision::Exact => {
                let (got, _) = batched(&mut session, &prompts, None, 6);
                assert_eq!(got, want_tokens, "batched greedy ids differ");
            }
            Precision::Fast => {
                let (_, got) = batched(&mut session, &prompts, Some(&want_tokens), 6);
                for (want, got) in want_logits.iter().zip(&got) {
                    for (w, g) in want.iter().zip(got) {
                        let scale = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                        let error = w
                            .iter()
                            .zip(g)
                            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                        assert!(error / scale < 0.06, "batched logits differ by {error}");
                    }
                }
            }
        }
    }
}

#[test]
fn a_copied_prefix_continues_like_a_computed_one() {
    let model = load("tiny_gqa8", Precision::Exact);
    let prompt = &prompts(model.config.vocab_size)[2];
    let mut session = model.new_session(&pool(), 64);
    let (_, want) = alone(&mut session, prompt, None, 0);
    let mut source = session.new_sequence(64);
    let mut target = session.new_sequence(64);
    let mut steps = [SequenceStep {
        sequence: &mut source,
        tokens: &prompt[..10],
    }];
    session.forward_batch(&mut steps).unwrap();
    assert_eq!(target.copy_prefix_from(&source, 10), 10);
    assert_eq!(target.tokens(), &prompt[..10]);
    let mut steps = [SequenceStep {
        sequence: &mut target,
        tokens: &prompt[10..],
    }];
    session.forward_batch(&mut steps).unwrap();
    assert_eq!(session.batch_logits(0), &want[0][..]);
}

#[test]
fn a_batch_that_does_not_fit_is_refused_before_computing() {
    let model = load("tiny_gqa8", Precision::Exact);
    let mut session = model.new_session(&pool(), 8);
    let mut small = session.new_sequence(4);
    let mut other = session.new_sequence(4);
    let tokens = [1u32, 2, 3, 4, 5];
    let mut steps = [
        SequenceStep {
            sequence: &mut other,
            tokens: &tokens[..2],
        },
        SequenceStep {
            sequence: &mut small,
            tokens: &tokens,
        },
    ];
    assert_eq!(
        session.forward_batch(&mut steps),
        Err(ForwardError::ContextFull {
            limit: 4,
            needed: 5
        })
    );
    assert!(other.is_empty(), "nothing was computed for the first step");
    let chunk = session.chunk_len();
    let long: Vec<u32> = (0..chunk as u32 + 1).map(|i| i % 50).collect();
    let mut big = session.new_sequence(chunk + 8);
    let mut steps = [SequenceStep {
        sequence: &mut big,
        tokens: &long,
    }];
    assert!(matches!(
        session.forward_batch(&mut steps),
        Err(ForwardError::BatchTooLarge { .. })
    ));
    assert_eq!(session.forward_batch(&mut []), Err(ForwardError::Empty));
}
