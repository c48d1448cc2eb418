//! `ollama:NAME:TAG` model names, resolved through ollama's local store to the GGUF blob it pulled.
//!
//! ollama keeps `manifests/registry.ollama.ai/library/NAME/TAG` (an OCI-style JSON manifest) and
//! content-addressed `blobs/sha256-HEX` under `$OLLAMA_MODELS`, or `~/.ollama/models` by default.
//! The model weights are the layer whose media type is `application/vnd.ollama.image.model`.

use std::path::{Path, PathBuf};

use super::ModelError;

/// The prefix that marks an ollama model name where a path is expected.
pub const PREFIX: &str = "ollama:";
const MODEL_MEDIA_TYPE: &str = "application/vnd.ollama.image.model";
const REGISTRY: &str = "registry.ollama.ai";

/// `ollama:NAME[:TAG]` -> (NAME, TAG), or `None` for anything else. NAME may carry a namespace
/// (`user/model`); names without one live in `library`, as in ollama.
pub fn parse(spec: &str) -> Option<(&str, &str)> {
    let rest = spec.strip_prefix(PREFIX)?;
    Some(match rest.rsplit_once(':') {
        Some((name, tag)) => (name, tag),
        None => (rest, "latest"),
    })
}

/// ollama's model directory: `$OLLAMA_MODELS`, else `~/.ollama/models`.
pub fn models_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("OLLAMA_MODELS").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(dir));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".ollama").join("models"))
}

/// The GGUF blob behind `ollama:NAME:TAG` in the store at `models`.
pub fn resolve(spec: &str, models: &Path) -> Result<PathBuf, ModelError> {
    let err = |message: String| ModelError::Ollama {
        name: spec.to_owned(),
        message,
    };
    let (name, tag) = parse(spec).ok_or_else(|| err("expected ollama:NAME:TAG".into()))?;
    let plain = |s: &str| !s.is_empty() && !s.contains(['\\', ':']) && s != "." && s != "..";
    let parts: Vec<&str> = name.split('/').collect();
    if !plain(tag) || parts.len() > 2 || !parts.iter().all(|p| plain(p)) {
        return Err(err(format!(
            "\"{name}\" / \"{tag}\" is not a model name and tag (ollama:NAME:TAG, e.g. ollama:gpt-oss:20b)"
        )));
    }
    let (namespace, model) = match parts.as_slice() {
        [namespace, model] => (*namespace, *model),
        _ => ("library", name),
    };
    let manifests = models.join("manifests").join(REGISTRY);
    let manifest = manifests.join(namespace).join(model).join(tag);
    if !manifest.is_file() {
        let found = installed(&manifests);
        return Err(err(format!(
            "no manifest {} ({}); {}",
            manifest.display(),
            if models.is_dir() {
                "pull it with: ollama pull NAME:TAG"
            } else {
                "no ollama store there: set OLLAMA_MODELS to the directory `ollama serve` uses"
            },
            if found.is_empty() {
                "no models found in the store".to_owned()
            } else {
                format!("models found: {}", found.join(", "))
            }
        )));
    }
    let text = std::fs::read_to_string(&manifest).map_err(|source| ModelError::Io {
        path: manifest.clone(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        err(format!(
            "{} is not a JSON manifest: {e}",
            manifest.display()
        ))
    })?;
    let layers = json
        .get("layers")
        .and_then(|l| l.as_array())
        .ok_or_else(|| err(format!("{} has no \"layers\" list", manifest.display())))?;
    let layer = layers
        .iter()
        .find(|l| l.get("mediaType").and_then(|m| m.as_str()) == Some(MODEL_MEDIA_TYPE))
        .ok_or_else(|| {
            err(format!(
                "{} has no layer of media type {MODEL_MEDIA_TYPE}",
                manifest.display()
            ))
        })?;
    let digest = layer
        .get("digest")
        .and_then(|d| d.as_str())
        .ok_or_else(|| {
            err(format!(
                "the model layer of {} has no digest",
                manifest.display()
            ))
        })?;
    let hex = digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| err(format!("digest {digest:?} is not sha256:<64 hex digits>")))?;
    let blob = models.join("blobs").join(format!("sha256-{hex}"));
    if !blob.is_file() {
        return Err(err(format!(
            "the manifest names blob {}, which is missing (an interrupted pull? run ollama pull again)",
            blob.display()
        )));
    }
    Ok(blob)
}

/// `NAME:TAG` of every manifest in the store, sorted (`library/` left out, as ollama lists them).
fn installed(manifests: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(namespaces) = std::fs::read_dir(manifests) else {
        return found;
    };
    for namespace in namespaces.flatten() {
        let ns = namespace.file_name().to_string_lossy().into_owned();
        let Ok(models) = std::fs::read_dir(namespace.path()) else {
            continue;
        };
        for model in models.flatten() {
            let m = model.file_name().to_string_lossy().into_owned();
            let Ok(tags) = std::fs::read_dir(model.path()) else {
                continue;
            };
            for tag in tags.flatten().filter(|t| t.path().is_file()) {
                let t = tag.file_name().to_string_lossy().into_owned();
                found.push(if ns == "library" {
                    format!("{m}:{t}")
                } else {
                    format!("{ns}/{m}:{t}")
                });
            }
        }
    }
    found.sort();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_tags_parse() {
        assert_eq!(parse("ollama:gpt-oss:20b"), Some(("gpt-oss", "20b")));
        assert_eq!(parse("ollama:gpt-oss"), Some(("gpt-oss", "latest")));
        assert_eq!(
            parse("ollama:me/gpt-oss:120b"),
            Some(("me/gpt-oss", "120b"))
        );
        assert_eq!(parse("/models/gpt-oss"), None);
    }
}
