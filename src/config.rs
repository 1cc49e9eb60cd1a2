//! The `--config` TOML file: several exports and listeners served by one server.
//!
//! ```toml
//! listen = ["127.0.0.1:10809", "unix:/run/netblk.sock"]
//! handshake_timeout = "10s"
//! tcp_congestion = "cubic"  # the default; "system" keeps the kernel's default
//!
//! [[export]]
//! name = "disk0"
//! backing = "/srv/disk0.img"
//! size = "10G"            # creates the file when it is missing
//! cache = "none"          # O_DIRECT; "writeback" uses the page cache
//! description = "database volume"
//!
//! [[export]]
//! name = "scratch"
//! backing = "memory:1G"
//! read_only = false
//! ```

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::backend::{BackingSpec, CacheMode};
use crate::size::parse_size;

/// The file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    listen: Vec<String>,
    handshake_timeout: Option<String>,
    tcp_congestion: Option<String>,
    #[serde(default, rename = "export")]
    exports: Vec<RawExport>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExport {
    name: String,
    backing: String,
    #[serde(default)]
    description: String,
    #[serde(default)]
    read_only: bool,
    size: Option<String>,
    cache: Option<String>,
}

/// One export, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportConfig {
    pub name: String,
    pub backing: BackingSpec,
    pub description: String,
    pub read_only: bool,
    pub size: Option<u64>,
    /// `None`: the default for the kind of backing.
    pub cache: Option<CacheMode>,
}

/// The largest export: NBD clients read the size as a signed 64-bit number (qemu showed
/// 2^64 - 1 TiB as 0 bytes, libnbd as negative).
pub const MAX_EXPORT_SIZE: u64 = i64::MAX as u64;

impl ExportConfig {
    /// What the protocol cannot carry: a name or description over 4096 bytes (the spec's
    /// limit for strings; a longer one broke `nbdinfo --list` for every export of the
    /// server) and a size past [`MAX_EXPORT_SIZE`]. Answers the field at fault and why.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let limit = crate::wire::MAX_STRING_LEN;
        if self.name.len() > limit {
            return Err(("name", format!("longer than {limit} bytes")));
        }
        if self.description.len() > limit {
            return Err(("description", format!("longer than {limit} bytes")));
        }
        let memory = match self.backing {
            BackingSpec::Memory { size } => Some(size),
            BackingSpec::Path(_) => None,
        };
        if memory.is_some() && self.cache.is_some() {
            // Accepted silently, it looked as if it did something (review, session 69).
            return Err((
                "cache",
                "a memory backing has no cache mode (only files and block devices have one)".into(),
            ));
        }
        for (field, size) in [("size", self.size), ("backing", memory)] {
            if size.is_some_and(|size| size > MAX_EXPORT_SIZE) {
                return Err((
                    field,
                    format!("a size above {MAX_EXPORT_SIZE} bytes (2^63 - 1), which clients cannot read"),
                ));
            }
        }
        Ok(())
    }
}

/// A checked configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub listen: Vec<String>,
    pub handshake_timeout: Option<Duration>,
    /// TCP congestion control for client connections (see [`crate::tcp`]); `None`: the default.
    pub tcp_congestion: Option<String>,
    pub exports: Vec<ExportConfig>,
}

/// An error in a configuration file (an export file or a replication resource file) that
/// names the file and, once it parses, the key at fault.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Syntax { path: String, message: String },
    #[error("{path}: {key}: {message}")]
    Invalid {
        path: String,
        key: String,
        message: String,
    },
}

impl ConfigError {
    /// The text of a configuration file, or the error that names it.
    pub fn read_text(path: &Path) -> Result<String, ConfigError> {
        std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })
    }

    /// A file that is not valid TOML for its kind; `origin` names it.
    pub fn syntax(origin: &str, error: &toml::de::Error) -> ConfigError {
        ConfigError::Syntax {
            path: origin.to_string(),
            message: error.to_string().trim_end().to_string(),
        }
    }
}

impl Config {
    /// Reads and checks a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = ConfigError::read_text(path)?;
        Config::parse(&text, &path.display().to_string())
    }

    /// Parses and checks configuration text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::syntax(origin, &e))?;
        let invalid = |key: String, message: String| ConfigError::Invalid {
            path: origin.to_string(),
            key,
            message,
        };
        let handshake_timeout = match raw.handshake_timeout {
            Some(text) => Some(humantime::parse_duration(&text).map_err(|e| {
                invalid(
                    "handshake_timeout".into(),
                    format!("{text:?}: {e} (example: \"10s\")"),
                )
            })?),
            None => None,
        };
        if raw.exports.is_empty() {
            return Err(invalid(
                "export".into(),
                "at least one [[export]] table is needed".into(),
            ));
        }
        let mut exports: Vec<ExportConfig> = Vec::new();
        for (i, export) in raw.exports.into_iter().enumerate() {
            let key = |field: &str| format!("export[{i}].{field}");
            if exports.iter().any(|e| e.name == export.name) {
                return Err(invalid(
                    key("name"),
                    format!("export name {:?} is used twice", export.name),
                ));
            }
            let backing =
                BackingSpec::parse(&export.backing).map_err(|e| invalid(key("backing"), e))?;
            let backing = backing_beside_config(origin, backing);
            let size = match export.size {
                Some(text) => Some(parse_size(&text).map_err(|e| invalid(key("size"), e))?),
                None => None,
            };
            let cache = export
                .cache
                .map(|text| {
                    text.parse::<CacheMode>()
                        .map_err(|e| invalid(key("cache"), e))
                })
                .transpose()?;
            let checked = ExportConfig {
                name: export.name,
                backing,
                description: export.description,
                read_only: export.read_only,
                size,
                cache,
            };
            checked
                .check()
                .map_err(|(field, why)| invalid(key(field), why))?;
            // Two exports of one file would be two caches of it (one O_DIRECT, one the page
            // cache, say) that do not see each other's writes.
            if let BackingSpec::Path(path) = &checked.backing {
                let same = |other: &ExportConfig| match &other.backing {
                    BackingSpec::Path(seen) => same_file(seen, path),
                    BackingSpec::Memory { .. } => false,
                };
                if let Some(first) = exports.iter().position(same) {
                    return Err(invalid(
                        key("backing"),
                        format!("{} is export[{first}]'s backing too", path.display()),
                    ));
                }
            }
            exports.push(checked);
        }
        let mut listens = Vec::new();
        for (i, listen) in raw.listen.iter().enumerate() {
            let parsed = crate::listen::ListenAddr::parse(listen)
                .map_err(|e| invalid(format!("listen[{i}]"), e))?;
            listens.push(match listen_beside_config(origin, parsed) {
                crate::listen::ListenAddr::Unix(path) => format!("unix:{}", path.display()),
                crate::listen::ListenAddr::Tcp(_) => listen.clone(),
            });
        }
        Ok(Config {
            listen: listens,
            handshake_timeout,
            tcp_congestion: raw.tcp_congestion,
            exports,
        })
    }
}

/// Where a path written in the configuration file `origin` points: a relative path is
/// taken from the file's own directory, so `serve` and `status` started from anywhere find
/// the same files (resolved against the working directory, a node started in its
/// config's directory and `netblk status` run elsewhere disagreed on its control socket).
/// `origin` without a directory (a file in the working directory, or text given in a
/// test) leaves the path as it is.
pub fn beside_config(origin: &str, path: &Path) -> std::path::PathBuf {
    match Path::new(origin).parent() {
        Some(dir) if path.is_relative() && !dir.as_os_str().is_empty() => dir.join(path),
        _ => path.to_path_buf(),
    }
}

/// A backing spec with its path taken from the config file's directory ([`beside_config`]).
pub fn backing_beside_config(origin: &str, spec: BackingSpec) -> BackingSpec {
    match spec {
        BackingSpec::Path(path) => BackingSpec::Path(beside_config(origin, &path)),
        memory => memory,
    }
}

/// A listen address with a Unix socket path taken from the config file's directory.
pub fn listen_beside_config(
    origin: &str,
    listen: crate::listen::ListenAddr,
) -> crate::listen::ListenAddr {
    match listen {
        crate::listen::ListenAddr::Unix(path) => {
            crate::listen::ListenAddr::Unix(beside_config(origin, &path))
        }
        tcp => tcp,
    }
}

/// Whether two paths name one file: the same device and inode when both exist, else the
/// same name in the same (resolved) directory, as for a file `--size` will create.
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => resolved(a) == resolved(b),
    }
}

/// `path` with its directory resolved (symlinks, `.`, `..`), for a file that may not exist.
fn resolved(path: &std::path::Path) -> std::path::PathBuf {
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => std::path::Path::new("."),
    };
    match (directory.canonicalize(), path.file_name()) {
        (Ok(directory), Some(name)) => directory.join(name),
        _ => path.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_file_cannot_back_two_exports() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("disk.img");
        std::fs::write(&file, [0u8; 4096]).unwrap();
        let link = dir.path().join("link.img");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let text = format!(
            "[[export]]\nname = \"a\"\nbacking = \"{}\"\n\
             [[export]]\nname = \"b\"\nbacking = \"{}\"\ncache = \"none\"\n",
            file.display(),
            link.display()
        );
        let e = Config::parse(&text, "test").unwrap_err().to_string();
        assert!(
            e.contains("export[1].backing") && e.contains("export[0]'s backing too"),
            "{e}"
        );
        // A file neither has created yet, named two ways.
        let fresh = dir.path().join("fresh.img");
        let again = dir.path().join(".").join("fresh.img");
        let text = format!(
            "[[export]]\nname = \"a\"\nbacking = \"{}\"\nsize = \"1M\"\n\
             [[export]]\nname = \"b\"\nbacking = \"{}\"\nsize = \"1M\"\n",
            fresh.display(),
            again.display()
        );
        let e = Config::parse(&text, "test").unwrap_err().to_string();
        assert!(e.contains("export[0]'s backing too"), "{e}");
    }

    #[test]
    fn a_full_config_parses() {
        let config = Config::parse(
            r#"
            listen = ["127.0.0.1:0", "unix:/tmp/x.sock"]
            handshake_timeout = "3s"
            tcp_congestion = "reno"
            [[export]]
            name = "a"
            backing = "memory:1M"
            [[export]]
            name = "b"
            backing = "/tmp/b.img"
            size = "2G"
            read_only = true
            description = "bee"
            "#,
            "test.toml",
        )
        .unwrap();
        assert_eq!(config.listen.len(), 2);
        assert_eq!(config.handshake_timeout, Some(Duration::from_secs(3)));
        assert_eq!(config.tcp_congestion.as_deref(), Some("reno"));
        assert_eq!(
            config.exports[0].backing,
            BackingSpec::Memory { size: 1 << 20 }
        );
        assert_eq!(config.exports[1].size, Some(2 << 30));
        assert!(config.exports[1].read_only);
    }

    fn error_of(text: &str) -> String {
        Config::parse(text, "t.toml").unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_key_and_why() {
        let e = error_of("[[export]]\nname = \"a\"\nbacking = \"memory:1M\"\ncache = \"none\"\n");
        assert!(e.contains("export[0].cache"), "{e}");
        let e = error_of("[[export]]\nname = \"a\"\nbacking = \"memory:1M\"\ncolour = 1\n");
        assert!(e.contains("colour"), "{e}");
        let e = error_of("[[export]]\nname = \"a\"\nbacking = \"memory:lots\"\n");
        assert!(
            e.contains("export[0].backing") && e.contains("not a size"),
            "{e}"
        );
        let e = error_of("[[export]]\nname = \"a\"\nbacking = \"/x\"\nsize = \"1Q\"\n");
        assert!(e.contains("export[0].size"), "{e}");
        let e = error_of("[[export]]\nname = \"a\"\nbacking = \"/x\"\ncache = \"off\"\n");
        assert!(
            e.contains("export[0].cache") && e.contains("writeback"),
            "{e}"
        );
        let e = error_of("[[export]]\nname = \"a\"\nbacking = \"memory:1M\"\n[[export]]\nname = \"a\"\nbacking = \"memory:1M\"\n");
        assert!(e.contains("export[1].name") && e.contains("twice"), "{e}");
        let e =
            error_of("listen = [\"nowhere\"]\n[[export]]\nname = \"a\"\nbacking = \"memory:1M\"\n");
        assert!(e.contains("listen[0]"), "{e}");
        let e = error_of(
            "handshake_timeout = \"soon\"\n[[export]]\nname = \"a\"\nbacking = \"memory:1M\"\n",
        );
        assert!(e.contains("handshake_timeout"), "{e}");
        let e = error_of("listen = []\n");
        assert!(e.contains("export"), "{e}");
        let e = error_of("[[export]]\nname = 5\nbacking = \"memory:1M\"\n");
        assert!(e.contains("name"), "{e}");
    }
}
