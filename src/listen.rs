//! Listening addresses (`HOST:PORT` or `unix:PATH`) and binding them.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

use anyhow::{bail, Context};
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
                if path.exists() {
                    if std::os::unix::net::UnixStream::connect(path).is_ok() {
                        bail!("{} is in use by another server", path.display());
                    }
                    std::fs::remove_file(path)
                        .with_context(|| format!("removing stale {}", path.display()))?;
                }
                let listener = UnixListener::bind(path)
                    .with_context(|| format!("binding unix:{}", path.display()))?;
                Ok(Listener::Unix(listener, path.clone()))
            }
        }
    }
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
}
