//! The TCP settings every netblk connection gets, client or replication peer: `TCP_NODELAY`,
//! the congestion control that sends the data, and the receive buffer.
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
//!
//! The receive buffer is set, not left to the kernel's autotuning, on the same sockets (so
//! that the window scale a connection negotiates allows it). Measured reason: with
//! autotuning, fio's 1 MiB sequential writes at iodepth 8 to the file export (8 MiB in
//! flight) met a closing window while the connection's thread copied a payload into the
//! page cache; fio's next segments then went out when netblk's window updates arrived, from
//! netblk's CPU, while fio sent others from its own, and over loopback they arrived out of
//! order: 39,131 retransmitted segments in three 5 s runs against 2,729 with a fixed 16 MiB
//! buffer (256 KiB writes 1,532 → 114), at the same rates (bench/RESULTS.md, session 27).
//! Writes of 4 MiB and more keep their retransmissions with any buffer size: those come from
//! the same two-CPU reordering without a closing window (session 28).

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::sync::OnceLock;

use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tracing::{debug, warn};

/// The algorithm sockets get unless told otherwise.
pub const DEFAULT_CONGESTION: &str = "cubic";
/// The `--tcp-congestion` value that leaves the system default alone.
pub const SYSTEM_CONGESTION: &str = "system";
/// The receive buffer asked for unless told otherwise (the kernel doubles it for its own
/// bookkeeping): room for iodepth 8 of 1 MiB writes with headroom.
pub const DEFAULT_RECEIVE_BUFFER: usize = 16 << 20;

/// Why a congestion control cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("TCP congestion control {name:?} is not available here ({why}); available: {available}")]
pub struct CongestionError {
    name: String,
    /// Quoted in the message, so not the error's source (which would print it twice).
    why: std::io::Error,
    available: String,
}

/// The settings a server gives its TCP sockets: `TCP_NODELAY` always, and a congestion
/// control. Each server (its listeners, and a replicated node's peer links) carries its own,
/// so two servers in one process can differ; [`TcpSettings::default`] is what `netblk serve`
/// uses without `--tcp-congestion`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSettings {
    /// `None` keeps the system default.
    congestion: Option<String>,
    /// Bytes asked for the receive buffer; `None` keeps the kernel's autotuning.
    receive_buffer: Option<usize>,
}

impl Default for TcpSettings {
    /// [`DEFAULT_CONGESTION`] (or the system's own when the kernel lacks it) and
    /// [`DEFAULT_RECEIVE_BUFFER`].
    fn default() -> TcpSettings {
        TcpSettings {
            congestion: default_congestion().map(str::to_string),
            receive_buffer: Some(DEFAULT_RECEIVE_BUFFER),
        }
    }
}

impl TcpSettings {
    /// The settings for `requested`: `None` for the default, [`SYSTEM_CONGESTION`] to keep
    /// the kernel's, or an algorithm's name, checked on a scratch socket so that a name the
    /// kernel lacks is refused at start-up rather than logged on every connection.
    pub fn choose(requested: Option<&str>) -> Result<TcpSettings, CongestionError> {
        Ok(match requested {
            None => TcpSettings::default(),
            Some(SYSTEM_CONGESTION) => TcpSettings {
                congestion: None,
                ..TcpSettings::default()
            },
            Some(name) => {
                check_available(name)?;
                TcpSettings {
                    congestion: Some(name.to_string()),
                    ..TcpSettings::default()
                }
            }
        })
    }

    /// These settings with a receive buffer of `bytes` (`--tcp-receive-buffer`); 0 leaves the
    /// buffer to the kernel's autotuning.
    pub fn with_receive_buffer(self, bytes: usize) -> TcpSettings {
        TcpSettings {
            receive_buffer: (bytes > 0).then_some(bytes),
            ..self
        }
    }

    /// The congestion control sockets get, `None` for the system default.
    pub fn congestion(&self) -> Option<&str> {
        self.congestion.as_deref()
    }

    /// Binds a TCP listener whose accepted connections start with these settings, so that
    /// none of them begins under another algorithm.
    pub async fn bind(&self, addr: SocketAddr) -> std::io::Result<TcpListener> {
        let listener = TcpListener::bind(addr).await?;
        self.tune_unconnected(&listener, &addr.to_string());
        Ok(listener)
    }

    /// Connects to `addr` with these settings in place before the handshake, from the
    /// address `from` when given (its port is ignored; an IPv6 scope is kept, as a
    /// link-local address needs): a replication peer checks where a connection comes from.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        from: Option<SocketAddr>,
    ) -> std::io::Result<TcpStream> {
        let socket = match addr {
            SocketAddr::V4(_) => TcpSocket::new_v4()?,
            SocketAddr::V6(_) => TcpSocket::new_v6()?,
        };
        self.tune_unconnected(&socket, &addr.to_string());
        if let Some(mut local) = from {
            local.set_port(0);
            socket.bind(local)?;
        }
        socket.connect(addr).await
    }

    /// Applies the settings to a socket that is not connected yet (a listener, whose
    /// accepted connections inherit them, or a socket about to connect): no Nagle delay for
    /// small replies, and the congestion control from the first segment on. A failure is
    /// logged, never fatal: connections still work, with the system's settings.
    fn tune_unconnected(&self, socket: impl AsFd, what: &str) {
        let fd = socket.as_fd();
        set_nodelay(fd, what);
        set_keepalive(fd, what);
        if let Some(name) = self.congestion() {
            set_congestion(fd, name, what);
        }
        if let Some(bytes) = self.receive_buffer {
            set_receive_buffer(fd, bytes, what);
        }
    }

    /// Applies the settings to a connected TCP socket: `TCP_NODELAY`, and the congestion
    /// control if it does not have it yet. Connections from [`TcpSettings::bind`] and
    /// [`TcpSettings::connect`] already have it; one that does not (a listener bound
    /// elsewhere) is switched, which works but keeps whatever state the first algorithm set
    /// up (see the module comment). A failure is logged, never fatal.
    pub fn tune(&self, socket: impl AsFd, peer: &str) {
        let fd = socket.as_fd();
        set_nodelay(fd, peer);
        set_keepalive(fd, peer);
        if let Some(name) = self.congestion() {
            let current = rustix::net::sockopt::get_tcp_congestion(fd).unwrap_or_default();
            if current != name {
                debug!("switching {peer} from {current} to {name} after the handshake");
                set_congestion(fd, name, peer);
            }
        }
    }
}

/// [`DEFAULT_CONGESTION`], or `None` (the system's own) when the kernel lacks it. Checked
/// once per process: what the kernel offers does not change while it runs.
fn default_congestion() -> Option<&'static str> {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    let available = *AVAILABLE.get_or_init(|| match check_available(DEFAULT_CONGESTION) {
        Ok(()) => true,
        Err(e) => {
            debug!("keeping the system's congestion control: {e}");
            false
        }
    });
    available.then_some(DEFAULT_CONGESTION)
}

fn check_available(name: &str) -> Result<(), CongestionError> {
    let scratch = std::net::TcpListener::bind("127.0.0.1:0")
        .or_else(|_| std::net::TcpListener::bind("[::1]:0"));
    let result = match &scratch {
        Ok(socket) => rustix::net::sockopt::set_tcp_congestion(socket, name).map_err(Into::into),
        Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
    };
    result.map_err(|why| CongestionError {
        name: name.to_string(),
        why,
        available: std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into()),
    })
}

/// Silence after which a connection's peer is probed, the time between probes, and the
/// unanswered probes after which the kernel drops it: a client whose host vanished while
/// idle is gone from `netblk status` (and gives back its descriptor) within about two
/// minutes instead of never. A live client answers probes from its kernel, idle or not.
const KEEPALIVE_IDLE: std::time::Duration = std::time::Duration::from_secs(60);
const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
const KEEPALIVE_PROBES: u32 = 6;

fn set_keepalive(fd: std::os::fd::BorrowedFd<'_>, what: &str) {
    use rustix::net::sockopt;
    let set = sockopt::set_socket_keepalive(fd, true)
        .and_then(|()| sockopt::set_tcp_keepidle(fd, KEEPALIVE_IDLE))
        .and_then(|()| sockopt::set_tcp_keepintvl(fd, KEEPALIVE_INTERVAL))
        .and_then(|()| sockopt::set_tcp_keepcnt(fd, KEEPALIVE_PROBES));
    if let Err(e) = set {
        warn!("TCP keepalive for {what}: {e}");
    }
}

/// Bytes in a TCP socket's send queue: written by the server and not yet acknowledged
/// by the peer, which shrinks as a client that filled its receive window reads. `None`
/// if the kernel does not say (not a TCP socket).
#[allow(unsafe_code)]
pub fn send_queue_bytes(fd: std::os::fd::BorrowedFd<'_>) -> Option<u32> {
    use std::os::fd::AsRawFd;
    let mut queued: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ on a socket) writes one `c_int` through the pointer,
    // which points at `queued`, alive for the call; the descriptor is borrowed, so open.
    // Exercised by `send_queue_bytes_shrinks_as_the_peer_reads`.
    let result = unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCOUTQ, &mut queued) };
    (result == 0).then(|| u32::try_from(queued).ok()).flatten()
}

fn set_nodelay(fd: std::os::fd::BorrowedFd<'_>, what: &str) {
    if let Err(e) = rustix::net::sockopt::set_tcp_nodelay(fd, true) {
        warn!("TCP_NODELAY for {what}: {e}");
    }
}

/// Asks for a receive buffer of `bytes`: past `net.core.rmem_max` when the process may
/// (`SO_RCVBUFFORCE`, with `CAP_NET_ADMIN`), else up to it (`SO_RCVBUF`).
fn set_receive_buffer(fd: std::os::fd::BorrowedFd<'_>, bytes: usize, what: &str) {
    use rustix::net::sockopt;
    let set = sockopt::set_socket_recv_buffer_size_force(fd, bytes)
        .or_else(|_| sockopt::set_socket_recv_buffer_size(fd, bytes));
    match set {
        Ok(()) => debug!(
            "{what}: receive buffer {} bytes",
            sockopt::get_socket_recv_buffer_size(fd).unwrap_or(0)
        ),
        Err(e) => warn!("{what}: could not size the receive buffer: {e}"),
    }
}

fn set_congestion(fd: std::os::fd::BorrowedFd<'_>, name: &str, what: &str) {
    if let Err(e) = rustix::net::sockopt::set_tcp_congestion(fd, name) {
        warn!("TCP congestion control {name} for {what}: {e}");
    }
}

/// What tests of this crate read back from sockets.
#[cfg(test)]
pub(crate) mod test_support {
    use std::os::fd::AsFd;

    /// The congestion control a socket has.
    pub(crate) fn algorithm(socket: impl AsFd) -> String {
        rustix::net::sockopt::get_tcp_congestion(socket).unwrap()
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

    use super::test_support::algorithm;

    #[test]
    fn send_queue_bytes_shrinks_as_the_peer_reads() {
        use std::io::{Read, Write};
        use std::os::fd::AsFd;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut sender = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut receiver, _) = listener.accept().unwrap();
        // Small buffers, so the peer's window fills and the rest stays queued here.
        rustix::net::sockopt::set_socket_recv_buffer_size(&receiver, 64 << 10).unwrap();
        rustix::net::sockopt::set_socket_send_buffer_size(&sender, 256 << 10).unwrap();
        sender.set_nodelay(true).unwrap();
        assert_eq!(send_queue_bytes(sender.as_fd()), Some(0));
        sender.set_nonblocking(true).unwrap();
        let chunk = vec![7u8; 1 << 16];
        while sender.write(&chunk).is_ok() {}
        std::thread::sleep(std::time::Duration::from_millis(50));
        let full = send_queue_bytes(sender.as_fd()).unwrap();
        assert!(full > 0);
        // Everything that arrived so far: the window opens and queued bytes go out.
        receiver.set_nonblocking(true).unwrap();
        let mut drained = vec![0u8; 1 << 20];
        for _ in 0..20 {
            while receiver.read(&mut drained).is_ok_and(|n| n > 0) {}
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        let later = send_queue_bytes(sender.as_fd()).unwrap();
        assert!(later < full, "{later} not below {full}");
        // Not a socket: no figure.
        let file = tempfile::tempfile().unwrap();
        assert_eq!(send_queue_bytes(file.as_fd()), None);
    }

    #[test]
    fn tune_sets_nodelay_and_the_chosen_algorithm() {
        let (_client, server) = connected_pair();
        let settings = TcpSettings::choose(Some("reno")).unwrap();
        settings.tune(&server, "test");
        assert!(rustix::net::sockopt::get_tcp_nodelay(&server).unwrap());
        assert_eq!(algorithm(&server), "reno");
    }

    #[tokio::test]
    async fn connections_start_with_the_chosen_algorithm_on_both_ends() {
        // Inherited from the listener and set before connecting, not switched afterwards: a
        // switch after the handshake would keep the first algorithm's pacing.
        let settings = TcpSettings::default();
        assert_eq!(settings.congestion(), Some(DEFAULT_CONGESTION));
        let listener = settings.bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) = tokio::join!(settings.connect(addr, None), listener.accept());
        let (client, (server, _)) = (client.unwrap(), accepted.unwrap());
        for socket in [client.as_fd(), server.as_fd()] {
            assert!(rustix::net::sockopt::get_tcp_nodelay(socket).unwrap());
            assert_eq!(algorithm(socket), DEFAULT_CONGESTION);
            // Inherited from the listener too: a vanished idle peer is dropped.
            assert!(rustix::net::sockopt::get_socket_keepalive(socket).unwrap());
            assert_eq!(
                rustix::net::sockopt::get_tcp_keepidle(socket).unwrap(),
                KEEPALIVE_IDLE
            );
        }
    }

    #[tokio::test]
    async fn two_servers_in_one_process_keep_their_own_algorithms() {
        // The choice belongs to each server's settings, not to the process: a second server
        // (or a library user's) neither inherits nor overrides the first one's.
        let reno = TcpSettings::choose(Some("reno")).unwrap();
        let cubic = TcpSettings::choose(Some("cubic")).unwrap();
        for (settings, name) in [(&reno, "reno"), (&cubic, "cubic"), (&reno, "reno")] {
            let listener = settings.bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (client, accepted) = tokio::join!(settings.connect(addr, None), listener.accept());
            assert_eq!(algorithm(&listener), name);
            assert_eq!(algorithm(client.unwrap()), name);
            assert_eq!(algorithm(accepted.unwrap().0), name);
        }
    }

    #[tokio::test]
    async fn accepted_and_outgoing_connections_get_the_receive_buffer_asked_for() {
        // Granted past net.core.rmem_max with CAP_NET_ADMIN, else up to it; the kernel
        // reports twice what it was asked for.
        let rmem_max: usize = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .map_or(0, |text| text.trim().parse().unwrap_or(0));
        let asked = 8 << 20;
        for (settings, sized) in [
            (TcpSettings::default().with_receive_buffer(asked), true),
            (TcpSettings::default().with_receive_buffer(0), false),
        ] {
            let listener = settings.bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
            let addr = listener.local_addr().unwrap();
            let (client, accepted) = tokio::join!(settings.connect(addr, None), listener.accept());
            let (client, (server, _)) = (client.unwrap(), accepted.unwrap());
            for socket in [client.as_fd(), server.as_fd()] {
                let got = rustix::net::sockopt::get_socket_recv_buffer_size(socket).unwrap();
                if sized {
                    assert!(got >= asked.min(rmem_max), "{got} bytes for {asked} asked");
                } else {
                    assert!(got < asked, "autotuning starts small, not at {got} bytes");
                }
            }
        }
        assert_eq!(
            TcpSettings::default().receive_buffer,
            Some(DEFAULT_RECEIVE_BUFFER)
        );
    }

    #[test]
    fn system_keeps_the_kernel_default() {
        let settings = TcpSettings::choose(Some(SYSTEM_CONGESTION)).unwrap();
        assert_eq!(settings.congestion(), None);
        let (_client, server) = connected_pair();
        let before = algorithm(&server);
        settings.tune(&server, "test");
        assert_eq!(algorithm(&server), before);
        assert!(rustix::net::sockopt::get_tcp_nodelay(&server).unwrap());
    }

    #[test]
    fn an_unknown_algorithm_is_refused_with_the_available_ones() {
        let e = TcpSettings::choose(Some("no-such-algorithm")).unwrap_err();
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
