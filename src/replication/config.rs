//! The resource file: one TOML file, the same on every node, that describes a replicated
//! export and the nodes that hold it.
//!
//! ```toml
//! [resource]
//! name = "r0"
//! protocol = "C"          # C (default): reply when every up-to-date replica has the write
//! peer_timeout = "3s"     # a peer silent this long is dropped (and tracked in the bitmap)
//! resync_rate = "100M"    # bytes per second of background resync
//! size = "10G"            # creates missing backing files of this size
//! # fence_peer = "CMD"      (run before writes go on without a peer; see the README)
//! # fence_timeout = "60s"   (a fence_peer run longer than this fails, and is killed)
//!
//! [[node]]
//! name = "alpha"
//! replication = "10.0.0.1:7788"
//! listen = "10.0.0.1:10809"       # or "unix:/run/netblk/r0.sock"
//! backing = "/srv/r0.img"
//! metadata = "/var/lib/netblk/r0.meta"
//! # control = "/run/netblk/r0-alpha.ctl"  (default: the metadata path + ".ctl")
//! # cache = "none"                        (O_DIRECT; default: none for block devices, writeback for files)
//!
//! [[node]]
//! name = "beta"
//! ...
//! ```

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::backend::{BackingSpec, CacheMode};
use crate::config::{backing_beside_config, beside_config, listen_beside_config, ConfigError};
use crate::listen::ListenAddr;
use crate::size::parse_size;

/// Longest resource or node name: both travel in every handshake.
pub const MAX_NAME_LEN: usize = 64;
/// A resource is replicated across at least two and at most this many nodes.
pub const MAX_NODES: usize = 3;
const DEFAULT_PEER_TIMEOUT: Duration = Duration::from_secs(3);
/// The longest `peer_timeout` or `fence_timeout`: a day. Deadlines are the timeout added
/// to now, and a value near `u64::MAX` seconds (which humantime accepts) overflowed there
/// and panicked (review, session 66).
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
const DEFAULT_FENCE_TIMEOUT: Duration = Duration::from_secs(60);
/// The shortest `fence_timeout`.
const MIN_FENCE_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_RESYNC_RATE: u64 = 100 << 20;

/// When a write is acknowledged to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Asynchronous: the local write is done and the write is queued for every peer.
    A,
    /// Memory-synchronous: the local write is done and every peer has received it.
    B,
    /// Synchronous: the local write is done and every up-to-date peer has applied it.
    C,
}

impl Protocol {
    fn parse(text: &str) -> Result<Protocol, String> {
        match text {
            "A" | "a" => Ok(Protocol::A),
            "B" | "b" => Ok(Protocol::B),
            "C" | "c" => Ok(Protocol::C),
            _ => Err(format!("{text:?} is not a protocol (A, B or C)")),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResourceFile {
    resource: RawResource,
    #[serde(default, rename = "node")]
    nodes: Vec<RawNode>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResource {
    name: String,
    protocol: Option<String>,
    peer_timeout: Option<String>,
    resync_rate: Option<String>,
    size: Option<String>,
    fence_peer: Option<String>,
    fence_timeout: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNode {
    name: String,
    replication: String,
    listen: String,
    backing: String,
    metadata: String,
    control: Option<String>,
    cache: Option<String>,
}

/// One node of the resource, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    pub name: String,
    /// Where this node listens for (and its peers connect to) replication traffic.
    pub replication: SocketAddr,
    /// Where this node serves NBD clients when it is primary.
    pub listen: ListenAddr,
    pub backing: BackingSpec,
    pub metadata: PathBuf,
    /// Direct or page-cache I/O on the backing (`None`: the default for its kind).
    pub cache: Option<CacheMode>,
    /// The local Unix socket for `netblk status`, `promote`, `demote`.
    pub control: PathBuf,
}

/// A checked resource file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceConfig {
    pub name: String,
    pub protocol: Protocol,
    pub peer_timeout: Duration,
    /// Bytes per second.
    pub resync_rate: u64,
    /// Size to create missing backing files with.
    pub size: Option<u64>,
    /// A command (run by `/bin/sh -c`) that fences a peer: a primary runs it before it
    /// acknowledges a write or flush without that peer, and acknowledges nothing without
    /// the peer until it exits 0 (see `Shared::fence_missing_peers`).
    pub fence_peer: Option<String>,
    /// How long the `fence_peer` command may run before it counts as failed (and its
    /// process group is killed). A request waits this long for each peer it fences, after
    /// the loss was noticed (up to `peer_timeout`).
    pub fence_timeout: Duration,
    pub nodes: Vec<NodeConfig>,
}

/// Whether configuration text is a resource file (has a `[resource]` table) rather than a
/// plain export file. Text that is not TOML at all is not one.
pub fn is_resource_file(text: &str) -> bool {
    toml::from_str::<toml::Table>(text)
        .map(|table| table.get("resource").is_some_and(|v| v.is_table()))
        .unwrap_or(false)
}

impl ResourceConfig {
    /// Reads and checks a resource file.
    pub fn load(path: &Path) -> Result<ResourceConfig, ConfigError> {
        let text = ConfigError::read_text(path)?;
        ResourceConfig::parse(&text, &path.display().to_string())
    }

    /// Parses and checks resource-file text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<ResourceConfig, ConfigError> {
        let raw: RawResourceFile =
            toml::from_str(text).map_err(|e| ConfigError::syntax(origin, &e))?;
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            path: origin.to_string(),
            key: key.to_string(),
            message,
        };
        check_name(&raw.resource.name).map_err(|e| invalid("resource.name", e))?;
        let protocol = match &raw.resource.protocol {
            Some(text) => Protocol::parse(text).map_err(|e| invalid("resource.protocol", e))?,
            None => Protocol::C,
        };
        let peer_timeout =
            timeout_setting(raw.resource.peer_timeout.as_deref(), DEFAULT_PEER_TIMEOUT)
                .map_err(|e| invalid("resource.peer_timeout", e))?;
        let fence_timeout =
            timeout_setting(raw.resource.fence_timeout.as_deref(), DEFAULT_FENCE_TIMEOUT)
                .map_err(|e| invalid("resource.fence_timeout", e))?;
        if raw.resource.fence_timeout.is_some() && raw.resource.fence_peer.is_none() {
            return Err(invalid(
                "resource.fence_timeout",
                "set without fence_peer, so no fencing runs (set fence_peer, or leave this out)"
                    .into(),
            ));
        }
        if fence_timeout < MIN_FENCE_TIMEOUT {
            return Err(invalid(
                "resource.fence_timeout",
                format!(
                    "at least {}: a command killed sooner cannot fence anything, and every write without a peer would fail",
                    humantime::format_duration(MIN_FENCE_TIMEOUT)
                ),
            ));
        }
        let resync_rate = match &raw.resource.resync_rate {
            Some(text) => parse_size(text).map_err(|e| invalid("resource.resync_rate", e))?,
            None => DEFAULT_RESYNC_RATE,
        };
        if resync_rate == 0 {
            return Err(invalid("resource.resync_rate", "must be above zero".into()));
        }
        let size = match &raw.resource.size {
            Some(text) => Some(parse_size(text).map_err(|e| invalid("resource.size", e))?),
            None => None,
        };
        if raw
            .resource
            .fence_peer
            .as_deref()
            .is_some_and(|c| c.trim().is_empty())
        {
            return Err(invalid(
                "resource.fence_peer",
                "the command is empty (leave the key out for no fencing)".into(),
            ));
        }
        if raw.nodes.len() < 2 || raw.nodes.len() > MAX_NODES {
            return Err(invalid(
                "node",
                format!(
                    "{} [[node]] tables; a resource needs 2 to {MAX_NODES}",
                    raw.nodes.len()
                ),
            ));
        }
        let mut nodes: Vec<NodeConfig> = Vec::new();
        for (i, node) in raw.nodes.into_iter().enumerate() {
            let key = |field: &str| format!("node[{i}].{field}");
            check_name(&node.name).map_err(|e| invalid(&key("name"), e))?;
            if nodes.iter().any(|n| n.name == node.name) {
                return Err(invalid(
                    &key("name"),
                    format!("node name {:?} is used twice", node.name),
                ));
            }
            let replication: SocketAddr = node.replication.parse().map_err(|_| {
                invalid(
                    &key("replication"),
                    format!("{:?} is not IP:PORT", node.replication),
                )
            })?;
            if replication.port() == 0 {
                return Err(invalid(
                    &key("replication"),
                    "needs a fixed port: peers connect to it".into(),
                ));
            }
            if nodes.iter().any(|n| n.replication == replication) {
                return Err(invalid(
                    &key("replication"),
                    format!("{replication} is used by two nodes"),
                ));
            }
            let listen = ListenAddr::parse(&node.listen).map_err(|e| invalid(&key("listen"), e))?;
            let listen = listen_beside_config(origin, listen);
            let backing =
                BackingSpec::parse(&node.backing).map_err(|e| invalid(&key("backing"), e))?;
            let backing = backing_beside_config(origin, backing);
            if node.metadata.is_empty() {
                return Err(invalid(&key("metadata"), "the path is empty".into()));
            }
            let metadata = beside_config(origin, Path::new(&node.metadata));
            if let BackingSpec::Path(path) = &backing {
                if path == &metadata {
                    return Err(invalid(
                        &key("metadata"),
                        "must not be the backing itself".into(),
                    ));
                }
            }
            let control = match node.control {
                Some(text) if text.is_empty() => {
                    return Err(invalid(&key("control"), "the path is empty".into()))
                }
                Some(text) => beside_config(origin, Path::new(&text)),
                None => {
                    let mut path = metadata.clone().into_os_string();
                    path.push(".ctl");
                    PathBuf::from(path)
                }
            };
            // Nodes on different hosts may well name the same paths (one resource file,
            // the same layout on every host), so they are not refused here. Nodes sharing
            // one host cannot share a file either: a node refuses metadata that names
            // another node (or that a running node has locked), and a control socket that
            // another process answers on.
            let cache = node
                .cache
                .map(|text| {
                    text.parse::<CacheMode>()
                        .map_err(|e| invalid(&key("cache"), e))
                })
                .transpose()?;
            if cache.is_some() && matches!(backing, BackingSpec::Memory { .. }) {
                return Err(invalid(
                    &key("cache"),
                    "a memory backing has no cache mode (only files and block devices have one)"
                        .into(),
                ));
            }
            nodes.push(NodeConfig {
                name: node.name,
                replication,
                listen,
                backing,
                metadata,
                cache,
                control,
            });
        }
        Ok(ResourceConfig {
            name: raw.resource.name,
            protocol,
            peer_timeout,
            resync_rate,
            size,
            fence_peer: raw.resource.fence_peer,
            fence_timeout,
            nodes,
        })
    }

    /// The node called `name`, or an error that lists the nodes there are.
    pub fn node(&self, name: &str) -> Result<&NodeConfig, String> {
        self.nodes.iter().find(|n| n.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.nodes.iter().map(|n| n.name.as_str()).collect();
            format!(
                "resource {:?} has no node {name:?} (nodes: {})",
                self.name,
                known.join(", ")
            )
        })
    }

    /// Every node except `name`.
    pub fn peers_of<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a NodeConfig> + 'a {
        self.nodes.iter().filter(move |n| n.name != name)
    }
}

/// A timeout from the resource file (`"3s"`, `"500ms"`), or `default` where it is left out:
/// above zero and at most [`MAX_TIMEOUT`], since deadlines are computed by adding it.
fn timeout_setting(text: Option<&str>, default: Duration) -> Result<Duration, String> {
    let Some(text) = text else {
        return Ok(default);
    };
    let timeout = humantime::parse_duration(text).map_err(|e| format!("{text:?}: {e}"))?;
    if timeout.is_zero() || timeout > MAX_TIMEOUT {
        return Err(format!(
            "must be above zero and at most {}",
            humantime::format_duration(MAX_TIMEOUT)
        ));
    }
    Ok(timeout)
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("the name is empty".into());
    }
    if name.len() > MAX_NAME_LEN {
        return Err(format!("longer than {MAX_NAME_LEN} bytes"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(format!(
            "{name:?}: only letters, digits, '-', '_' and '.' are allowed"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_examples_in_the_repository_parse() {
        for (text, nodes) in [
            (include_str!("../../examples/two-nodes.toml"), 2),
            (include_str!("../../examples/three-nodes.toml"), 3),
        ] {
            let config = ResourceConfig::parse(text, "example").unwrap();
            assert_eq!(config.nodes.len(), nodes);
        }
    }

    use super::*;

    const TWO_NODES: &str = r#"
        [resource]
        name = "r0"
        peer_timeout = "2s"
        resync_rate = "10M"
        size = "1G"

        [[node]]
        name = "alpha"
        replication = "127.0.0.1:7001"
        listen = "127.0.0.1:10809"
        backing = "/tmp/a.img"
        metadata = "/tmp/a.meta"

        [[node]]
        name = "beta"
        replication = "127.0.0.1:7002"
        listen = "unix:/tmp/b.sock"
        backing = "memory:1G"
        metadata = "/tmp/b.meta"
        control = "/tmp/b.control"
    "#;

    #[test]
    fn a_two_node_resource_parses_with_defaults() {
        let config = ResourceConfig::parse(TWO_NODES, "r0.toml").unwrap();
        assert_eq!(config.name, "r0");
        assert_eq!(config.protocol, Protocol::C);
        assert_eq!(config.peer_timeout, Duration::from_secs(2));
        assert_eq!(config.resync_rate, 10 << 20);
        assert_eq!(config.size, Some(1 << 30));
        let alpha = config.node("alpha").unwrap();
        assert_eq!(alpha.replication, "127.0.0.1:7001".parse().unwrap());
        assert_eq!(alpha.control, PathBuf::from("/tmp/a.meta.ctl"));
        let beta = config.node("beta").unwrap();
        assert_eq!(beta.listen, ListenAddr::Unix("/tmp/b.sock".into()));
        assert_eq!(beta.control, PathBuf::from("/tmp/b.control"));
        let peers: Vec<&str> = config.peers_of("alpha").map(|n| n.name.as_str()).collect();
        assert_eq!(peers, ["beta"]);
        let missing = config.node("gamma").unwrap_err();
        assert!(missing.contains("alpha, beta"), "{missing}");
        assert_eq!(config.fence_peer, None, "no fencing unless asked");
    }

    #[test]
    fn a_fence_peer_command_is_kept_and_an_empty_one_refused() {
        let with =
            |line: &str| TWO_NODES.replace("size = \"1G\"", &format!("size = \"1G\"\n{line}"));
        let config = ResourceConfig::parse(
            &with("fence_peer = \"/usr/local/sbin/fence %p\""),
            "r0.toml",
        )
        .unwrap();
        assert_eq!(
            config.fence_peer.as_deref(),
            Some("/usr/local/sbin/fence %p")
        );
        let e = ResourceConfig::parse(&with("fence_peer = \"  \""), "r0.toml").unwrap_err();
        assert!(e.to_string().contains("resource.fence_peer"), "{e}");
    }

    #[test]
    fn the_fence_timeout_is_a_minute_unless_set_and_must_be_a_sane_duration() {
        let with =
            |line: &str| TWO_NODES.replace("size = \"1G\"", &format!("size = \"1G\"\n{line}"));
        let config = ResourceConfig::parse(&with(""), "r0.toml").unwrap();
        assert_eq!(config.fence_timeout, Duration::from_secs(60));
        let fenced = |line: &str| with(&format!("fence_peer = \"true\"\n{line}"));
        let config = ResourceConfig::parse(&fenced("fence_timeout = \"15s\""), "r0.toml").unwrap();
        assert_eq!(config.fence_timeout, Duration::from_secs(15));
        let alone = ResourceConfig::parse(&with("fence_timeout = \"15s\""), "r0.toml").unwrap_err();
        assert!(alone.to_string().contains("without fence_peer"), "{alone}");
        for bad in ["0s", "999ms", "soon", "500000000000years"] {
            let e =
                ResourceConfig::parse(&fenced(&format!("fence_timeout = \"{bad}\"")), "r0.toml")
                    .unwrap_err();
            assert!(
                e.to_string().contains("resource.fence_timeout"),
                "{bad}: {e}"
            );
        }
    }

    /// The README's example, as an operator copies it: one file for hosts whose paths
    /// are laid out alike (until session 69 it was refused, "used by two nodes").
    #[test]
    fn the_readmes_resource_file_is_accepted() {
        let readme = include_str!("../../README.md");
        let section = &readme[readme.find("## Replication").unwrap()..];
        let start = section.find("```toml\n").unwrap() + "```toml\n".len();
        let text = &section[start..start + section[start..].find("```").unwrap()];
        let config = ResourceConfig::parse(text, "r0.toml").unwrap();
        assert_eq!(config.nodes.len(), 2);
        assert_eq!(config.nodes[0].metadata, config.nodes[1].metadata);
    }

    /// Relative paths are taken from the resource file's directory, whatever the working
    /// directory of `serve` or `status`.
    #[test]
    fn relative_paths_are_taken_from_the_files_directory() {
        let text = TWO_NODES
            .replace("/tmp/a.img", "data/r0.img")
            .replace("/tmp/a.meta", "a.meta")
            .replace("unix:/tmp/b.sock", "unix:b.sock");
        let config = ResourceConfig::parse(&text, "/etc/netblk/r0.toml").unwrap();
        let alpha = &config.nodes[0];
        assert_eq!(alpha.metadata, Path::new("/etc/netblk/a.meta"));
        assert_eq!(alpha.control, Path::new("/etc/netblk/a.meta.ctl"));
        assert_eq!(
            alpha.backing,
            BackingSpec::Path("/etc/netblk/data/r0.img".into())
        );
        assert_eq!(
            config.nodes[1].listen,
            ListenAddr::Unix("/etc/netblk/b.sock".into())
        );
        // A file in the working directory keeps them relative to it, as given.
        let config = ResourceConfig::parse(&text, "r0.toml").unwrap();
        assert_eq!(config.nodes[0].metadata, Path::new("a.meta"));
    }

    #[test]
    fn resource_files_are_told_from_export_files() {
        assert!(is_resource_file(TWO_NODES));
        assert!(!is_resource_file(
            "[[export]]\nname = \"a\"\nbacking = \"memory:1M\"\n"
        ));
        assert!(!is_resource_file("resource = 1\n"));
        assert!(!is_resource_file("not toml ["));
    }

    fn error_of(edit: impl Fn(&str) -> String) -> String {
        ResourceConfig::parse(&edit(TWO_NODES), "r0.toml")
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn errors_name_the_key_and_why() {
        let cases: [(&str, &str, &str); 12] = [
            ("name = \"r0\"", "name = \"\"", "resource.name"),
            ("name = \"r0\"", "name = \"r 0\"", "resource.name"),
            (
                "peer_timeout = \"2s\"",
                "peer_timeout = \"soon\"",
                "resource.peer_timeout",
            ),
            (
                "peer_timeout = \"2s\"",
                "peer_timeout = \"0s\"",
                "resource.peer_timeout",
            ),
            (
                "peer_timeout = \"2s\"",
                "peer_timeout = \"500000000000years\"",
                "resource.peer_timeout",
            ),
            (
                "resync_rate = \"10M\"",
                "resync_rate = \"fast\"",
                "resource.resync_rate",
            ),
            (
                "size = \"1G\"",
                "size = \"1G\"\nprotocol = \"D\"",
                "resource.protocol",
            ),
            ("name = \"beta\"", "name = \"alpha\"", "node[1].name"),
            (
                "replication = \"127.0.0.1:7002\"",
                "replication = \"127.0.0.1:7001\"",
                "node[1].replication",
            ),
            (
                "replication = \"127.0.0.1:7002\"",
                "replication = \"somewhere\"",
                "node[1].replication",
            ),
            (
                "listen = \"unix:/tmp/b.sock\"",
                "listen = \"nowhere\"",
                "node[1].listen",
            ),
            (
                "backing = \"memory:1G\"",
                "backing = \"memory:0\"",
                "node[1].backing",
            ),
        ];
        for (from, to, key) in cases {
            let e = error_of(|text| text.replacen(from, to, 1));
            assert!(e.contains(key), "{to}: {e}");
        }
        let e = error_of(|text| {
            text.replace(
                "backing = \"memory:1G\"",
                "backing = \"memory:1G\"\ncache = \"none\"",
            )
        });
        assert!(e.contains("node[1].cache") && e.contains("memory"), "{e}");
        let e = error_of(|text| text.replace("size = \"1G\"", "colour = \"red\""));
        assert!(e.contains("colour"), "{e}");
        let e = error_of(|text| {
            text.split("[[node]]")
                .take(2)
                .collect::<Vec<_>>()
                .join("[[node]]")
        });
        assert!(e.contains("node") && e.contains("2 to 3"), "{e}");
        let e = error_of(|text| text.replace("metadata = \"/tmp/a.meta\"", ""));
        assert!(e.contains("metadata"), "{e}");
    }
}
