//! `config.toml`: the configured models and KV-cache settings. Unknown keys are rejected;
//! defaults live here; [`Config::load`] validates and names the key and the fix on error.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::kernels::attention::MAX_BLOCK_SIZE;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub models: Vec<ModelEntry>,
    #[serde(default)]
    pub kv_cache: KvCacheSettings,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    pub name: String,
    /// GGUF file or Hugging Face directory; relative paths are resolved against the config file.
    pub path: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvCacheSettings {
    pub block_size: usize,
}

impl Default for KvCacheSettings {
    fn default() -> Self {
        Self { block_size: 16 }
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let invalid = |reason: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            reason,
        };
        let mut config: Config =
            toml::from_str(&text).map_err(|e| invalid(e.message().to_string()))?;
        config.validate().map_err(invalid)?;
        let base = path.parent().unwrap_or(Path::new("."));
        for m in &mut config.models {
            if m.path.is_relative() {
                m.path = base.join(&m.path);
            }
        }
        Ok(config)
    }

    fn validate(&self) -> Result<(), String> {
        if self.models.is_empty() {
            return Err(
                "[[models]] is empty: add at least one model with a name and a path".into(),
            );
        }
        for (i, m) in self.models.iter().enumerate() {
            if m.name.is_empty() {
                return Err(format!("models[{i}].name is empty"));
            }
            if self.models[..i].iter().any(|o| o.name == m.name) {
                return Err(format!(
                    "models[{i}].name '{}' is used twice; names must be unique",
                    m.name
                ));
            }
        }
        let bs = self.kv_cache.block_size;
        if bs == 0 || bs > MAX_BLOCK_SIZE {
            return Err(format!(
                "kv_cache.block_size = {bs}: must be between 1 and {MAX_BLOCK_SIZE}"
            ));
        }
        Ok(())
    }

    pub fn model(&self, name: &str) -> Option<&ModelEntry> {
        self.models.iter().find(|m| m.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load_str(text: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, text).unwrap();
        Config::load(&path)
    }

    #[test]
    fn relative_model_paths_resolve_against_the_config_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        std::fs::write(&path, "[[models]]\nname = \"slm\"\npath = \"m/a.gguf\"\n").unwrap();
        let config = Config::load(&path).unwrap();
        assert_eq!(
            config.model("slm").unwrap().path,
            dir.path().join("m/a.gguf")
        );
        assert_eq!(config.kv_cache.block_size, 16);
    }

    #[test]
    fn unknown_keys_are_rejected_by_name() {
        let err = load_str("[[models]]\nname = \"a\"\npath = \"x\"\nquant = \"q4\"\n").unwrap_err();
        assert!(err.to_string().contains("quant"), "{err}");
    }

    #[test]
    fn duplicate_names_and_bad_block_sizes_are_rejected() {
        let err = load_str(
            "[[models]]\nname = \"a\"\npath = \"x\"\n[[models]]\nname = \"a\"\npath = \"y\"\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("used twice"), "{err}");
        let err = load_str("[[models]]\nname = \"a\"\npath = \"x\"\n[kv_cache]\nblock_size = 0\n")
            .unwrap_err();
        assert!(err.to_string().contains("kv_cache.block_size"), "{err}");
    }

    #[test]
    fn the_shipped_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.toml");
        let config = Config::load(&path).unwrap();
        assert!(config.model("slm").is_some() && config.model("llm").is_some());
    }
}
