//! The TCP settings every netblk connection gets, client or replication peer: `TCP_NODELAY`
//! and the congestion control that sends the data.
//!
//! Congestion control is chosen per socket (`TCP_CONGESTION`) because the system default may
//! be one made for long-haul paths. Measured reason: this project's VM of 2026-11-25 ran
//! `bbr` by default with the `pfifo_fast` qdisc, where TCP paces bbr's sends itself, and one
//! iperf3 stream over loopback moved 7.2 GB/s with bbr against 12.5 GB/s with `cubic`; reads
//! of 64 KiB to 1 MiB from one connection were a fifth to a half faster with cubic
//! (bench/RESULTS.md, session 17). So the default is `cubic`, the kernel's own default.
//! `--tcp-congestion system` keeps the system's choice, and any algorithm the kernel offers
//! (`net.ipv4.tcp_available_congestion_control`) may be named, such as `bbr` for a
//! replication link across a long-haul network. Write payloads are sent by the client, whose
//! own socket decides their congestion control.
//!
//! The algorithm is set where a connection is born: on the listening socket, whose accepted
//! connections inherit it, and on an outgoing socket before it connects. Measured reason: a
//! connection accepted under the system's `bbr` and switched to `cubic` afterwards keeps what
//! bbr set up at its start (by our reading of the kernel, its request for TCP's own pacing
//! timer, which then sends from whichever CPU it fires on). Over loopback its segments
//! arrived out of order, each reordering cost a spurious fast retransmit, and cubic shrank
//! its window for each: one stream of 32 MiB sends moved 2.5 GB/s with 330–590
//! retransmissions when switched after `accept`, against 6.0 GB/s with none when the listener
//! carried cubic. netblk's own reads, same A/B (session 18): 32 MiB memory 75 → 116 IOPS,
//! 4 MiB file 431 → 874, 1 MiB file 2,033 → 3,459 (the "slow mode" of spliced reads that
//! sessions 16 and 17 chased), with 0 retransmissions.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::OnceLock;

use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tracing::{debug, warn};

/// The algorithm sockets get unless told otherwise.
pub const DEFAULT_CONGESTION: &str = "cubic";
/// The `--tcp-congestion` value that leaves the system default alone.
pub const SYSTEM_CONGESTION: &str = "system";

/// The algorithm chosen for this process; `None` keeps the system default.
static CONGESTION: OnceLock<Option<String>> = OnceLock::new();

/// Why a congestion control cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("TCP congestion control {name:?} is not available here ({source}); available: {available}")]
pub struct CongestionError {
    name: String,
    source: std::io::Error,
    available: String,
}

/// Chooses the congestion control for every socket this process opens or accepts from now on,
/// after checking on a scratch socket that the kernel has it. `requested` is `None` for the
/// default ([`DEFAULT_CONGESTION`], or the system's own when the kernel lacks it) or a name,
/// [`SYSTEM_CONGESTION`] among them. The first call decides; later calls change nothing.
pub fn choose_congestion(requested: Option<&str>) -> Result<(), CongestionError> {
    let chosen = match requested {
        None => default_congestion(),
        Some(SYSTEM_CONGESTION) => None,
        Some(name) => {
            check_available(name)?;
            Some(name.to_string())
        }
    };
    let _ = CONGESTION.set(chosen);
    Ok(())
}

/// The congestion control sockets get, `None` for the system default.
pub fn chosen_congestion() -> Option<&'static str> {
    CONGESTION.get_or_init(default_congestion).as_deref()
}

/// [`DEFAULT_CONGESTION`], or the system's own (`None`) when the kernel lacks it.
fn default_congestion() -> Option<String> {
    match check_available(DEFAULT_CONGESTION) {
        Ok(()) => Some(DEFAULT_CONGESTION.to_string()),
        Err(e) => {
            debug!("keeping the system's congestion control: {e}");
            None
        }
    }
}

fn check_available(name: &str) -> Result<(), CongestionError> {
    let scratch = std::net::TcpListener::bind("127.0.0.1:0")
        .or_else(|_| std::net::TcpListener::bind("[::1]:0"));
    let result = match &scratch {
        Ok(socket) => rustix::net::sockopt::set_tcp_congestion(socket, name).map_err(Into::into),
        Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
    };
    result.map_err(|source| CongestionError {
        name: name.to_string(),
        source,
        available: std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into()),
    })
}

/// Binds a TCP listener whose accepted connections start with netblk's settings
/// (`TCP_NODELAY` and the chosen congestion control), so that none of them begins under
/// another algorithm.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let listener = TcpListener::bind(addr).await?;
    tune_unconnected(&listener, &addr.to_string());
    Ok(listener)
}

/// Connects to `addr` with netblk's settings in place before the handshake.
pub async fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4()?,
        SocketAddr::V6(_) => TcpSocket::new_v6()?,
    };
    tune_unconnected(&socket, &addr.to_string());
    socket.connect(addr).await
}

/// Applies netblk's settings to a socket that is not connected yet (a listener, whose accepted
/// connections inherit them, or a socket about to connect): no Nagle delay for small replies,
/// and the chosen congestion control from the first segment on. A failure is logged, never
/// fatal: connections still work, with the system's settings.
fn tune_unconnected(socket: impl AsFd, what: &str) {
    let fd = socket.as_fd();
    set_nodelay(fd, what);
    if let Some(name) = chosen_congestion() {
        set_congestion(fd, name, what);
    }
}

/// Applies netblk's settings to a connected TCP socket: `TCP_NODELAY`, and the chosen
/// congestion control if it does not have it yet. Connections from [`bind`] and [`connect`]
/// already have it; one that does not (a listener bound elsewhere) is switched, which works
/// but keeps whatever state the first algorithm set up (see the module comment). A failure is
/// logged, never fatal.
pub fn tune(socket: impl AsFd, peer: &str) {
    let fd = socket.as_fd();
    set_nodelay(fd, peer);
    if let Some(name) = chosen_congestion() {
        let current = rustix::net::sockopt::get_tcp_congestion(fd).unwrap_or_default();
        if current != name {
            debug!("switching {peer} from {current} to {name} after the handshake");
            set_congestion(fd, name, peer);
        }
    }
}

fn set_nodelay(fd: std::os::fd::BorrowedFd<'_>, what: &str) {
    if let Err(e) = rustix::net::sockopt::set_tcp_nodelay(fd, true) {
        warn!("TCP_NODELAY for {what}: {e}");
    }
}

fn set_congestion(fd: std::os::fd::BorrowedFd<'_>, name: &str, what: &str) {
    if let Err(e) = rustix::net::sockopt::set_tcp_congestion(fd, name) {
        warn!("TCP congestion control {name} for {what}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connected_pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    #[test]
    fn tune_sets_nodelay_and_the_chosen_algorithm() {
        let (_client, server) = connected_pair();
        tune(&server, "test");
        assert!(rustix::net::sockopt::get_tcp_nodelay(&server).unwrap());
        let got = rustix::net::sockopt::get_tcp_congestion(&server).unwrap();
        match chosen_congestion() {
            Some(name) => assert_eq!(got, name),
            None => assert!(!got.is_empty()),
        }
    }

    #[tokio::test]
    async fn connections_start_with_the_chosen_algorithm_on_both_ends() {
        // Inherited from the listener and set before connecting, not switched afterwards: a
        // switch after the handshake would keep the first algorithm's pacing.
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(connect(addr), listener.accept());
        let (client, (server, _)) = (client.unwrap(), accepted.unwrap());
        for socket in [client.as_fd(), server.as_fd()] {
            assert!(rustix::net::sockopt::get_tcp_nodelay(socket).unwrap());
            let got = rustix::net::sockopt::get_tcp_congestion(socket).unwrap();
            match chosen_congestion() {
                Some(name) => assert_eq!(got, name),
                None => assert!(!got.is_empty()),
            }
        }
    }

    #[test]
    fn an_unknown_algorithm_is_refused_with_the_available_ones() {
        let e = check_available("no-such-algorithm").unwrap_err();
        let text = e.to_string();
        assert!(text.contains("no-such-algorithm"), "{text}");
        assert!(text.contains("available:"), "{text}");
    }

    #[test]
    fn the_default_is_available_on_linux() {
        // cubic is built into every Debian kernel; if this fails, the default silently
        // becomes the system's and the measured reason above no longer applies.
        check_available(DEFAULT_CONGESTION).unwrap();
    }
}
