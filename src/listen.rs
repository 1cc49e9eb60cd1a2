//! Listening addresses (`HOST:PORT` or `unix:PATH`) and binding them.

use std::net::{SocketAddr, ToSocketAddrs};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

use anyhow::Context;
use tokio::net::UnixListener;

use crate::server::Listener;
use crate::tcp::TcpSettings;

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl ListenAddr {
    /// Parses `HOST:PORT` (IPv4, `[IPv6]` or a resolvable name) or `unix:PATH`.
    pub fn parse(text: &str) -> Result<ListenAddr, String> {
        if let Some(path) = text.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path, as in unix:/run/netblk.sock".into());
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return Ok(ListenAddr::Tcp(addr));
        }
        let mut addrs = text
            .to_socket_addrs()
            .map_err(|e| format!("{text:?} is neither HOST:PORT nor unix:PATH ({e})"))?;
        addrs
            .next()
            .map(ListenAddr::Tcp)
            .ok_or_else(|| format!("{text:?} resolves to no address"))
    }

    /// Binds the address, a TCP one with `tcp`'s settings. A stale Unix socket file (nobody listening) is replaced.
    pub async fn bind(&self, tcp: &TcpSettings) -> anyhow::Result<Listener> {
        match self {
            ListenAddr::Tcp(addr) => {
                let listener = tcp
                    .bind(*addr)
                    .await
                    .with_context(|| format!("binding {addr}"))?;
                Ok(Listener::Tcp(listener))
            }
            ListenAddr::Unix(path) => {
                clear_stale_socket(path)?;
                let listener = UnixListener::bind(path)
                    .with_context(|| format!("binding unix:{}", path.display()))?;
                Ok(Listener::Unix(listener, path.clone()))
            }
        }
    }
}

/// Makes room to bind a Unix socket at `path`: a stale socket file (nobody listening)
/// is removed. Anything else there stays and is an error: a live socket, or a file that
/// is not a socket at all (a typo must not unlink a disk image).
pub fn clear_stale_socket(path: &Path) -> std::io::Result<()> {
    let Ok(found) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !found.file_type().is_socket() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!(
                "{} exists and is not a socket; refusing to replace it",
                path.display()
            ),
        ));
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!("{} is in use by another server", path.display()),
        ));
    }
    std::fs::remove_file(path).map_err(|e| {
        std::io::Error::new(e.kind(), format!("removing stale {}: {e}", path.display()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse() {
        assert_eq!(
            ListenAddr::parse("127.0.0.1:10809").unwrap(),
            ListenAddr::Tcp("127.0.0.1:10809".parse().unwrap())
        );
        assert_eq!(
            ListenAddr::parse("[::1]:0").unwrap(),
            ListenAddr::Tcp("[::1]:0".parse().unwrap())
        );
        assert_eq!(
            ListenAddr::parse("unix:/tmp/s").unwrap(),
            ListenAddr::Unix("/tmp/s".into())
        );
        assert!(ListenAddr::parse("unix:").is_err());
        assert!(ListenAddr::parse("nowhere").is_err());
    }

    #[test]
    fn only_a_stale_socket_is_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("disk.img");
        std::fs::write(&image, b"data").unwrap();
        let e = clear_stale_socket(&image).unwrap_err();
        assert!(e.to_string().contains("is not a socket"), "{e}");
        assert_eq!(std::fs::read(&image).unwrap(), b"data");

        let live = dir.path().join("live");
        let listening = std::os::unix::net::UnixListener::bind(&live).unwrap();
        let e = clear_stale_socket(&live).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        drop(listening);
        // The listener is gone but its file stays: stale, so it is removed.
        clear_stale_socket(&live).unwrap();
        assert!(!live.exists());
        clear_stale_socket(&dir.path().join("missing")).unwrap();
    }
}
