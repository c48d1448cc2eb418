//! The README's app sections stay true: every key binding, setting and config key is documented.

use ossterm::settings::SETTINGS;
use ossterm::tui::keys::KEY_BINDINGS;

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

#[test]
fn readme_lists_every_key_binding_as_the_help_overlay_does() {
    let readme = readme();
    for (keys, action) in KEY_BINDINGS {
        let row = format!("| {keys} | {action} |");
        assert!(readme.contains(&row), "README lacks the row {row}");
    }
}

/// The text of the README section that starts with `heading`, up to the next heading.
fn section(readme: &str, heading: &str) -> String {
    let start = readme
        .find(heading)
        .unwrap_or_else(|| panic!("README lacks {heading}"));
    let body = &readme[start + heading.len()..];
    body[..body.find("\n#").unwrap_or(body.len())].to_string()
}

#[test]
fn readme_lists_every_setting() {
    // Within the settings section: a label such as "activations" also heads columns elsewhere.
    let settings = section(&readme(), "### Settings");
    for setting in SETTINGS {
        let row = format!("\n| {} |", setting.label);
        assert!(settings.contains(&row), "README lacks the setting {row}");
    }
}

#[test]
fn readme_lists_every_setting_flag_and_config_key() {
    let config = section(&readme(), "### Config file and command line");
    for setting in SETTINGS {
        let key = format!("| `{}` |", setting.key);
        assert!(config.contains(&key), "README lacks the config key {key}");
        if let Some(flag) = setting.flag {
            let flag = format!("`--{flag} ");
            assert!(config.contains(&flag), "README lacks the flag {flag}");
        }
    }
}

#[test]
fn readme_lists_every_config_key_of_the_example_file() {
    let readme = readme();
    let example =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/config.example.toml"))
            .unwrap();
    let mut section = String::new();
    let mut keys = Vec::new();
    for line in example.lines() {
        let line = line.trim();
        if let Some(name) = line
            .strip_prefix('[')
            .and_then(|rest| rest.strip_suffix(']'))
        {
            section = name.to_string();
            continue;
        }
        // Keys are assigned, or shown commented out when they have no default (`# seed = 42`).
        let assignment = line.trim_start_matches("# ");
        let Some((key, _)) = assignment.split_once(" = ") else {
            continue;
        };
        if key.chars().all(|c| c.is_ascii_lowercase() || c == '_') && !section.is_empty() {
            keys.push(format!("{section}.{key}"));
        }
    }
    assert!(keys.len() >= 17, "found only {keys:?}");
    for key in keys {
        assert!(
            readme.contains(&format!("| `{key}` |")),
            "README lacks the config key {key}"
        );
    }
}
