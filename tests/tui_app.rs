//! The app's edges: loading the configured model with progress, and the terminal restore.

use ossterm::cli::app::{load_model, synthetic_preset};
use ossterm::config::{ModelSource, SyntheticChoice, SYNTHETIC_20B_MIN_MEMORY_BYTES};
use ossterm::engine::protocol::{ActivationFormat, KvCacheType, Settings, WeightFormat};
use ossterm::model::{LoadOptions, Model, Precision, Preset};
use std::sync::Arc;

#[test]
fn synthetic_load_reports_generation_and_conversion_and_matches_model_synthetic() {
    let settings = Settings {
        weight_format: WeightFormat::Q8,
        kv_cache: KvCacheType::F16,
        ..Settings::default()
    };
    let mut reports: Vec<(String, u64, u64)> = Vec::new();
    let loaded = load_model(
        &ModelSource::Synthetic(SyntheticChoice::Tiny),
        &settings,
        &mut |stage, done, total| reports.push((stage.to_string(), done, total)),
    )
    .unwrap();
    assert!(loaded.random_weights);
    assert!(loaded.label.contains("random weights"), "{}", loaded.label);

    let generating: Vec<&(String, u64, u64)> = reports
        .iter()
        .filter(|(stage, ..)| stage == "generating random tiny weights")
        .collect();
    assert!(generating.len() > 10, "{reports:?}");
    assert!(generating.windows(2).all(|pair| pair[0].1 <= pair[1].1));
    let (_, done, total) = generating.last().unwrap();
    assert_eq!(done, total);
    let converting: Vec<&(String, u64, u64)> = reports
        .iter()
        .filter(|(stage, ..)| stage == "converting weights to q8")
        .collect();
    // Where the kernels take tiled experts, the 4 layers' gate_up and down tensors reordered;
    // then the unembedding's q4 draft (two-stage unembedding), q, k, v and o of each layer, and
    // the unembedding.
    let tiled = if ossterm::kernels::kernels().prefers_tiled_mxfp4() {
        8
    } else {
        0
    };
    assert_eq!(
        converting.last().map(|report| (report.1, report.2)),
        Some((tiled + 18, tiled + 18))
    );

    // Same weights, same fast path as the model's own constructor.
    let options = LoadOptions {
        precision: Precision::Fast,
        weights: WeightFormat::Q8,
        kv: KvCacheType::F16,
        ..LoadOptions::default()
    };
    let reference = Arc::new(Model::synthetic(Preset::Tiny, 0, &options).unwrap());
    let loaded = Arc::new(loaded.model);
    assert_eq!(loaded.options().weights, WeightFormat::Q8);
    let prompt = [6u32, 17, 4_242, 9, 31];
    let pool = ossterm::engine::build_pool(2).unwrap();
    let mut ours = loaded.new_session_with_kv(&pool, 64, KvCacheType::F16);
    let mut theirs = reference.new_session_with_kv(&pool, 64, KvCacheType::F16);
    assert_eq!(
        ours.prefill(&prompt).unwrap(),
        theirs.prefill(&prompt).unwrap()
    );
}

#[test]
fn auto_picks_20b_only_with_the_memory_for_it_and_says_why_not() {
    let enough = Some(SYNTHETIC_20B_MIN_MEMORY_BYTES);
    assert_eq!(
        synthetic_preset(SyntheticChoice::Auto, enough),
        (Preset::Gpt20b, None)
    );
    let (preset, reason) = synthetic_preset(SyntheticChoice::Auto, Some(8 << 30));
    assert_eq!(preset, Preset::Tiny);
    let reason = reason.expect("a reason for the fallback");
    assert!(
        reason.contains("needs 16 GiB available") && reason.contains("8.0 GiB"),
        "{reason}"
    );
    assert_eq!(
        synthetic_preset(SyntheticChoice::Auto, None).0,
        Preset::Tiny
    );
    // An explicit choice is honoured whatever the memory.
    assert_eq!(
        synthetic_preset(SyntheticChoice::Tiny, enough),
        (Preset::Tiny, None)
    );
    assert_eq!(
        synthetic_preset(SyntheticChoice::Gpt20b, Some(1 << 30)),
        (Preset::Gpt20b, None)
    );
}

#[test]
fn a_synthetic_120b_that_cannot_fit_is_refused_with_the_numbers() {
    use ossterm::model::memory::{MemoryNeeds, SystemMemory, WeightSource};
    use ossterm::model::{KvFormat, WeightFormat as Weights};
    assert_eq!(
        SyntheticChoice::from_name("120b"),
        Some(SyntheticChoice::Gpt120b)
    );
    assert_eq!(SyntheticChoice::Gpt120b.to_string(), "120b");
    assert_eq!(
        synthetic_preset(SyntheticChoice::Gpt120b, Some(1 << 30)),
        (Preset::Gpt120b, None)
    );
    // The 120b's random weights live in memory: against a 24 GiB machine that is a refusal
    // naming what it needs and what to do instead.
    let context = Settings::default().context_limit;
    let needs = MemoryNeeds::estimate(
        &Preset::Gpt120b.config(),
        WeightSource::Synthetic,
        Precision::Fast,
        Weights::Q8,
        KvFormat::F16,
        context,
    );
    let machine = SystemMemory {
        total: 24 << 30,
        available: 22 << 30,
    };
    let refusal = needs.check(machine).unwrap_err().to_string();
    for needed in [
        "not enough memory",
        "generated",
        "22.0 GiB of 24.0 GiB",
        "smaller synthetic preset",
    ] {
        assert!(refusal.contains(needed), "{needed:?} missing: {refusal}");
    }
    // The app refuses it the same way before generating anything, on any machine without the
    // memory for it (checked first: on one with it, this would build the 120b).
    let Some(memory) = SystemMemory::read() else {
        return;
    };
    if needs.owned + needs.kv <= memory.available {
        eprintln!("this machine could hold the synthetic 120b: the app-level refusal is not run");
        return;
    }
    let mut reports = 0;
    let Err(error) = load_model(
        &ModelSource::Synthetic(SyntheticChoice::Gpt120b),
        &Settings::default(),
        &mut |_, _, _| reports += 1,
    ) else {
        panic!("the synthetic 120b loaded on a machine without the memory for it");
    };
    let message = error.to_string();
    assert!(message.contains("not enough memory"), "{message}");
    assert_eq!(reports, 0, "weights were generated before the refusal");
}

#[test]
fn missing_checkpoint_is_an_error_naming_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-model");
    let error = load_model(
        &ModelSource::Checkpoint(missing.clone()),
        &Settings::default(),
        &mut |_, _, _| {},
    )
    .err()
    .expect("an error");
    assert!(
        error.to_string().contains(&missing.display().to_string()),
        "{error}"
    );
}

#[test]
fn the_loaded_model_uses_the_configured_activations() {
    for activations in ActivationFormat::ALL.iter().copied() {
        let settings = Settings {
            activations,
            ..Settings::default()
        };
        let loaded = load_model(
            &ModelSource::Synthetic(SyntheticChoice::Tiny),
            &settings,
            &mut |_, _, _| {},
        )
        .unwrap();
        assert_eq!(loaded.model.options().activations, activations);
    }
}

/// The app's settings from `args` (after the program name) over a config file holding `config`.
fn resolved(config: &str, args: &[&str]) -> Result<Settings, String> {
    use clap::Parser;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.toml");
    std::fs::write(&path, config).unwrap();
    let mut argv = vec!["ossterm", "--config", path.to_str().unwrap()];
    argv.extend_from_slice(args);
    let cli = ossterm::cli::Cli::try_parse_from(argv).map_err(|error| error.to_string())?;
    cli.app
        .resolve()
        .map(|config| config.settings)
        .map_err(|error| format!("{error:#}"))
}

#[test]
fn activations_flag_overrides_the_config_file_which_overrides_the_default() {
    let activations = |config: &str, args: &[&str]| resolved(config, args).unwrap().activations;
    assert_eq!(activations("", &[]), ActivationFormat::Mixed);
    let file = "[engine]\nactivations = \"q8\"\n";
    assert_eq!(activations(file, &[]), ActivationFormat::Q8);
    assert_eq!(
        activations(file, &["--activations", "q8x2"]),
        ActivationFormat::Q8x2
    );
    assert_eq!(
        activations("", &["--activations", "mixed"]),
        ActivationFormat::Mixed
    );

    let error = resolved("", &["--activations", "q4"]).unwrap_err();
    assert!(
        error.contains("q4") && error.contains("q8, mixed, q8x2"),
        "{error}"
    );
    let error = resolved("[engine]\n\nactivations = \"fp8\"\n", &[]).unwrap_err();
    assert!(
        error.contains("line 3") && error.contains("engine.activations"),
        "{error}"
    );
}

#[test]
fn every_setting_flag_reaches_its_field_and_a_bad_value_names_the_flag() {
    use ossterm::settings::{Value, SETTINGS};
    for setting in SETTINGS {
        let Some(flag) = setting.flag else {
            continue;
        };
        let mut expected = Settings::default();
        setting.step(&mut expected, true, 4);
        let text = match (setting.get)(&expected) {
            Value::Count(count) => count.to_string(),
            Value::Real(real) => real.to_string(),
            Value::Choice(name) => name.to_string(),
            Value::Switch(on) => on.to_string(),
            Value::Text(text) => text,
            Value::Seed(seed) => seed.unwrap().to_string(),
        };
        let flag = format!("--{flag}");
        let settings = resolved("", &[&flag, &text]).unwrap();
        assert_eq!((setting.get)(&settings), (setting.get)(&expected), "{flag}");
        let error = resolved("", &[&flag, "nonsense"]).unwrap_err();
        assert!(
            error.contains(&flag) && error.contains("nonsense"),
            "{error}"
        );
    }
    let error = resolved("", &["--top-p", "1.5"]).unwrap_err();
    assert!(error.contains("(0, 1]"), "{error}");
}
