//! Decoding a token allocates nothing: a counting global allocator watches the forward pass (fast
//! and exact), the sampler, the whole generation loop, and the first decode on a freshly built pool.
//!
//! One test function in its own binary, so no other test allocates while it counts.

use std::sync::Arc;

use ossterm::chat::{HarmonyParser, Tokenizer};
use ossterm::engine::{build_pool, generate, GenerateLimits, Sampler, SamplerSettings};
use ossterm::model::{LoadOptions, Model, Precision, Preset, Sequence, SequenceStep, Session};
use rayon::ThreadPool;

mod counting_alloc;
use counting_alloc::allocations;

fn model(precision: Precision) -> Arc<Model> {
    let opts = LoadOptions {
        precision,
        ..LoadOptions::default()
    };
    Arc::new(Model::synthetic(Preset::Tiny, 3, &opts).expect("tiny model"))
}

/// Allocations made while decoding `steps` tokens after a warm-up.
fn decode_allocations(model: &Arc<Model>, pool: &Arc<ThreadPool>, steps: usize) -> usize {
    let mut session = model.new_session(pool, 256);
    let mut sampler = Sampler::new(SamplerSettings {
        seed: Some(1),
        ..SamplerSettings::default()
    })
    .unwrap();
    let mut next = sampler
        .sample(session.prefill(&[200006, 17360, 200008]).unwrap())
        .unwrap();
    // Warm-up: the pool's threads and their per-thread scratch come to life on first use.
    for _ in 0..4 {
        next = sampler.sample(session.decode(next).unwrap()).unwrap();
    }
    let before = allocations();
    for _ in 0..steps {
        next = sampler.sample(session.decode(next).unwrap()).unwrap();
    }
    allocations() - before
}

/// Allocations of a whole generation of `max_tokens` tokens (prefill included).
fn generation_allocations(model: &Arc<Model>, pool: &Arc<ThreadPool>, max_tokens: usize) -> usize {
    let tokenizer = Tokenizer::shared().unwrap();
    let prompt = tokenizer
        .encode_with_special_tokens("<|start|>user<|message|>hi<|end|><|start|>assistant")
        .unwrap();
    let mut session = model.new_session(pool, 512);
    let mut sampler = Sampler::new(SamplerSettings {
        seed: Some(2),
        ..SamplerSettings::default()
    })
    .unwrap();
    let before = allocations();
    let result = generate(
        &mut session,
        &mut HarmonyParser::after_prompt(tokenizer, "assistant"),
        &prompt,
        &mut sampler,
        GenerateLimits {
            max_tokens: Some(max_tokens),
        },
        || false,
        |_| {},
    )
    .unwrap();
    let used = allocations() - before;
    assert_eq!(
        result.generated_tokens, max_tokens,
        "{:?}",
        result.stop_reason
    );
    used
}

#[test]
fn decoding_a_token_allocates_nothing() {
    // Loops run on the session's pool, as the app's, every command's and the benchmark's do.
    let pool = build_pool(2).unwrap();
    for precision in [Precision::Fast, Precision::Exact] {
        let model = model(precision);
        assert_eq!(
            pool.install(|| decode_allocations(&model, &pool, 64)),
            0,
            "{precision:?} decode allocated"
        );
        // The generation loop: longer runs allocate no more than shorter ones.
        pool.install(|| generation_allocations(&model, &pool, 8));
        let short = pool.install(|| generation_allocations(&model, &pool, 8));
        let long = pool.install(|| generation_allocations(&model, &pool, 72));
        assert_eq!(
            long,
            short,
            "{precision:?}: 32 more tokens cost {} more allocations",
            long - short
        );
    }
    first_decode_on_a_new_pool_allocates_nothing();
    batched_decode_allocates_nothing(&pool);
}

/// A server's decode step (`Session::forward_batch` over four sequences, each one token: eight
/// split rows, which the dense products run as two GEMV passes, and attention as one region for
/// all sequences) allocates nothing once warm.
fn batched_decode_allocates_nothing(pool: &Arc<ThreadPool>) {
    let model = model(Precision::Fast);
    let mut session = model.new_session(pool, 64);
    let mut sequences: Vec<Sequence> = (0..4).map(|_| session.new_sequence(64)).collect();
    let mut next = [200006u32, 17360, 200008, 17360];
    let step = |session: &mut Session, sequences: &mut [Sequence], next: &mut [u32; 4]| {
        let [a, b, c, d] = sequences else {
            unreachable!("four sequences")
        };
        let tokens = *next;
        let mut row = 0;
        // An array, not a Vec: the step itself is what is counted.
        let mut steps = [a, b, c, d].map(|sequence| {
            row += 1;
            SequenceStep {
                sequence,
                tokens: &tokens[row - 1..row],
            }
        });
        session.forward_batch(&mut steps).unwrap();
        for (row, token) in next.iter_mut().enumerate() {
            *token = ossterm::engine::sampler::argmax(session.batch_logits(row)).unwrap();
        }
    };
    let used = pool.install(|| {
        for _ in 0..4 {
            step(&mut session, &mut sequences, &mut next);
        }
        let before = allocations();
        for _ in 0..32 {
            step(&mut session, &mut sequences, &mut next);
        }
        allocations() - before
    });
    assert_eq!(used, 0, "batched decode steps allocated");
}

/// The app builds a new pool when the thread count changes and moves its session there, which
/// readies the new pool's threads: their very first decode then allocates nothing either.
fn first_decode_on_a_new_pool_allocates_nothing() {
    let model = model(Precision::Fast);
    // Kept alive through the count: a dropped pool's threads wind down in the background.
    let first_pool = build_pool(1).unwrap();
    let mut session = model.new_session(&first_pool, 256);
    let mut next =
        ossterm::engine::sampler::argmax(session.prefill(&[200006, 17360, 200008]).unwrap())
            .unwrap();
    let pool = build_pool(2).unwrap();
    session.set_pool(Arc::clone(&pool));
    let used = pool.install(|| {
        let before = allocations();
        for _ in 0..4 {
            next = ossterm::engine::sampler::argmax(session.decode(next).unwrap()).unwrap();
        }
        allocations() - before
    });
    assert_eq!(used, 0, "the first decode steps on a new pool allocated");
}
