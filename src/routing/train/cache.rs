//! Collected training data kept on disk, keyed by everything it depends on (the models, the
//! prompts and the settings), so that retraining a head or re-picking thresholds does not run
//! the models again. An entry is written whole (a temporary file renamed into place); one that
//! cannot be read is reported and collected again.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

/// The file for `key` under `dir`: the hex SHA-256 of the key's JSON.
pub fn entry_path(dir: &Path, key: &impl Serialize) -> PathBuf {
    let json = serde_json::to_vec(key).expect("a cache key serialises");
    let digest = Sha256::digest(&json);
    let name: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("{name}.bin"))
}

/// What the entry for `key` holds, or `make`'s value, then stored; and whether it was read.
pub fn cached<T, E>(
    dir: &Path,
    key: &impl Serialize,
    make: impl FnOnce() -> Result<T, E>,
) -> Result<(T, bool), E>
where
    T: Serialize + DeserializeOwned,
    E: From<std::io::Error>,
{
    let path = entry_path(dir, key);
    match std::fs::read(&path) {
        Ok(bytes) => match bincode::serde::decode_from_slice(&bytes, bincode::config::standard()) {
            Ok((value, _)) => return Ok((value, true)),
            Err(e) => tracing::warn!("{}: unreadable ({e}); collecting again", path.display()),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("{}: {e}; collecting again", path.display()),
    }
    let value = make()?;
    std::fs::create_dir_all(dir)?;
    let bytes = bincode::serde::encode_to_vec(&value, bincode::config::standard())
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    let partial = path.with_extension("partial");
    std::fs::write(&partial, bytes)?;
    std::fs::rename(&partial, &path)?;
    Ok((value, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_made_once_per_key_and_a_bad_one_is_made_again() {
        let dir = tempfile::tempdir().unwrap();
        let make = |v: Vec<f32>| move || Ok::<_, std::io::Error>(v);
        let (v, hit) = cached(dir.path(), &("a", 1), make(vec![1.0, 2.0])).unwrap();
        assert_eq!((v, hit), (vec![1.0, 2.0], false));
        // The same key reads the entry back; the closure's value is not used.
        let (v, hit) = cached(dir.path(), &("a", 1), make(vec![9.0])).unwrap();
        assert_eq!((v, hit), (vec![1.0, 2.0], true));
        // Another key is another entry.
        let (v, hit) = cached(dir.path(), &("a", 2), make(vec![3.0])).unwrap();
        assert_eq!((v, hit), (vec![3.0], false));
        // A damaged entry is collected again and replaced.
        std::fs::write(entry_path(dir.path(), &("a", 1)), [0xff, 0xff, 0xff]).unwrap();
        let (v, hit) = cached(dir.path(), &("a", 1), make(vec![4.0])).unwrap();
        assert_eq!((v, hit), (vec![4.0], false));
        let (v, hit) = cached(dir.path(), &("a", 1), make(vec![5.0])).unwrap();
        assert_eq!((v, hit), (vec![4.0], true));
    }
}
