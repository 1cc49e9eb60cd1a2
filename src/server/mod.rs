//! The NBD server: listeners, the accept loop, per-connection tasks and graceful shutdown.
//!
//! [`serve`] is the library entry point: give it bound listeners, the exports and a
//! shutdown future. On shutdown it stops accepting, lets every connection finish the
//! requests it has in flight, flushes every export and returns.

mod budget;
pub mod clients;
mod coalesce;
pub mod control;
mod flush_ahead;
pub mod handshake;
mod idle_spin;
mod in_flight;
pub mod pipeline;
mod probe;
mod receive;
mod splice_probe;
pub mod validate;

use std::future::Future;
use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch};
use tracing::{error, info, warn, Instrument};

use self::clients::{ClientSlot, Clients};
use crate::backend::uring::LoneThread;
use crate::backend::Backend;
use crate::log_limit::{warn_limited, FAILED_HANDSHAKES, REFUSED_CONNECTIONS, REFUSED_HANDSHAKES};
use crate::tcp::TcpSettings;

/// One exported device.
pub struct Export {
    pub name: String,
    pub description: String,
    pub backend: Arc<dyn Backend>,
    /// What its connections have served ([`crate::metrics`]).
    pub stats: crate::metrics::ExportStats,
}

impl Export {
    /// An export of `backend` under `name`, with nothing served yet.
    pub fn new(name: String, description: String, backend: Arc<dyn Backend>) -> Export {
        Export {
            name,
            description,
            backend,
            stats: Default::default(),
        }
    }

    /// The transmission flags for this export on a connection.
    pub fn transmission_flags(&self, chunked_replies: bool) -> u16 {
        self.backend
            .capabilities()
            .transmission_flags(chunked_replies)
    }
}

/// Server-wide settings.
#[derive(Clone)]
pub struct ServerConfig {
    pub exports: Vec<Arc<Export>>,
    /// A client that has not finished negotiating after this long is disconnected.
    pub handshake_timeout: Duration,
    /// Adjacent reads that arrive together are served by one backend read of up to this
    /// many bytes (0: never merge).
    pub max_merge: u32,
    /// Connections served at once, negotiating or transmitting; one more is closed as soon
    /// as it is accepted. With the shared byte budget this bounds what clients can make
    /// the server hold (see [`budget`]).
    pub max_connections: usize,
    /// Settings for accepted TCP connections whose listener did not already give them
    /// (listeners from [`crate::listen::ListenAddr::bind`] did).
    pub tcp: TcpSettings,
    /// The connections, as `netblk status` lists them ([`control`]).
    pub clients: Arc<Clients>,
}

/// The settings a plain server and a replicated node take alike from the command line
/// for their NBD clients.
#[derive(Clone, Copy, Debug)]
pub struct ClientOptions {
    /// [`ServerConfig::handshake_timeout`].
    pub handshake_timeout: Duration,
    /// [`ServerConfig::max_merge`].
    pub max_merge: u32,
    /// [`ServerConfig::max_connections`].
    pub max_connections: usize,
}

/// The default for [`ServerConfig::max_merge`] (see ARCHITECTURE.md for the measurement).
pub const DEFAULT_MAX_MERGE: u32 = 256 * 1024;

/// The default for [`ServerConfig::max_connections`]: far more than multi-connection
/// clients open (nbdcopy 4, the kernel's driver one per CPU), while what all of them can
/// make the server hold stays bounded: 1 GiB shared plus 32 MiB each, 5 GiB in all.
pub const DEFAULT_MAX_CONNECTIONS: usize = 128;
/// How long a handshake under way goes on after the server stops, refusing options with
/// `NBD_REP_ERR_SHUTDOWN`, before the connection is closed.
const HANDSHAKE_AFTER_STOP: std::time::Duration = std::time::Duration::from_secs(1);
/// ... or this long, for a client that sent no option in that time before the stop, if
/// it sends none after it either.
const HANDSHAKE_QUIET: std::time::Duration = std::time::Duration::from_millis(50);
/// The most a connection ended in its handshake waits for its option replies to leave.
const LINGER_AFTER_HANDSHAKE: std::time::Duration = std::time::Duration::from_secs(2);

/// A bound listening socket.
pub enum Listener {
    Tcp(TcpListener),
    /// A Unix socket and the path to remove when the server stops.
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// A printable address, with the real port when port 0 was asked for.
    pub fn describe(&self) -> String {
        match self {
            Listener::Tcp(l) => l
                .local_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|_| "tcp:?".into()),
            Listener::Unix(_, path) => format!("unix:{}", path.display()),
        }
    }
}

/// Serves `config.exports` on `listeners` until `shutdown` completes, with every
/// connection on the calling runtime.
pub async fn serve(
    listeners: Vec<Listener>,
    config: ServerConfig,
    shutdown: impl Future,
) -> anyhow::Result<()> {
    serve_on(listeners, config, shutdown, None).await
}

/// [`serve`], with connections on `threads` of their own when given (see
/// [`ConnectionThreads`]); the threads end when it returns.
pub async fn serve_on(
    listeners: Vec<Listener>,
    config: ServerConfig,
    shutdown: impl Future,
    threads: Option<ConnectionThreads>,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    // Every connection holds a clone; when all are dropped, every connection is done.
    let (alive_tx, mut alive_rx) = mpsc::channel::<()>(1);
    let config = Arc::new(config);
    let threads = threads.map(Arc::new);
    let mut accept_tasks = Vec::new();
    let mut unix_paths = Vec::new();
    for listener in listeners {
        if let Listener::Unix(_, path) = &listener {
            unix_paths.push(path.clone());
        }
        let task = tokio::spawn(accept_loop(
            listener,
            Arc::clone(&config),
            stop_rx.clone(),
            alive_tx.clone(),
            threads.clone(),
        ));
        accept_tasks.push(task);
    }
    drop(alive_tx);
    shutdown.await;
    info!("shutting down: no new connections, finishing requests in flight");
    let _ = stop_tx.send(true);
    for task in accept_tasks {
        let _ = task.await;
    }
    // Gone now, not after the connections drain (which may take a while): a server
    // started meanwhile on the same path binds a new socket there, which a late unlink
    // would take from under it.
    for path in unix_paths {
        let _ = std::fs::remove_file(path);
    }
    let _ = alive_rx.recv().await;
    let mut unflushed = Vec::new();
    for export in &config.exports {
        if let Err(e) = export.backend.final_flush().await {
            error!(export = %export.name, "final flush failed: {e}");
            unflushed.push(format!("{:?}", export.name));
        }
    }
    if let Some(threads) = threads {
        // Joining the threads blocks; every connection on them has ended.
        let _ = tokio::task::spawn_blocking(move || drop(threads)).await;
    }
    if !unflushed.is_empty() {
        // An exit status for whoever runs the server: data written since the last FLUSH
        // that succeeded may not be on the device.
        anyhow::bail!(
            "the final flush failed for export {}: data written since its last successful \
             FLUSH may not be on the device",
            unflushed.join(", ")
        );
    }
    info!("stopped");
    Ok(())
}

async fn accept_loop(
    listener: Listener,
    config: Arc<ServerConfig>,
    mut stop: watch::Receiver<bool>,
    alive: mpsc::Sender<()>,
    threads: Option<Arc<ConnectionThreads>>,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            accepted = accept(&listener, &config.tcp) => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let Some(client) = config.clients.join(peer.clone(), config.max_connections) else {
                    warn_limited!(
                        REFUSED_CONNECTIONS,
                        %peer,
                        "connection closed: {} connections are served already (--max-connections)",
                        config.max_connections
                    );
                    drop(stream);
                    continue;
                };
                let span = tracing::info_span!("conn", %peer);
                let alive = Alive {
                    _done: alive.clone(),
                    client: Some(client),
                };
                let (config, stop) = (Arc::clone(&config), stop.clone());
                match &threads {
                    Some(threads) => {
                        let task =
                            place_connection(stream, config, stop, alive, Arc::clone(threads));
                        tokio::spawn(task.instrument(span));
                    }
                    None => match stream.register() {
                        Ok(stream) => {
                            let task = serve_connection(stream, config, stop, alive);
                            tokio::spawn(task.instrument(span));
                        }
                        Err(e) => warn!("registering the connection failed: {e}"),
                    },
                }
            }
            Err(e) => {
                // Running out of descriptors should not spin the loop.
                warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// An accepted connection of either kind.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    /// The socket underneath, for a non-blocking receive that does not go through the
    /// reactor (see `pipeline`'s idle spin); `None` for in-memory streams.
    fn socket_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }

    /// Whether [`Stream::poll_splice`] can move data from a pipe into this stream.
    fn can_splice(&self) -> bool {
        false
    }

    /// Moves up to `len` bytes from the pipe `pipe` into the socket without copying them
    /// (`splice(2)`), once the socket has room; returns how many moved.
    fn poll_splice(
        &self,
        _cx: &mut Context<'_>,
        _pipe: BorrowedFd<'_>,
        _len: usize,
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Err(std::io::ErrorKind::Unsupported.into()))
    }

    /// Writes `slices` telling the socket that more data follows at once (`MSG_MORE`), so
    /// a reply header is sent in one segment with the data spliced after it; only streams
    /// that can splice are asked.
    fn poll_write_more(
        &self,
        _cx: &mut Context<'_>,
        _slices: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Err(std::io::ErrorKind::Unsupported.into()))
    }
}

/// What the two tokio socket types offer for a write made outside tokio's own: readiness
/// and a non-blocking attempt that clears it when the socket is full.
trait RegisteredSocket: std::os::fd::AsFd {
    fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>>;
    fn try_write_io(
        &self,
        attempt: impl FnOnce() -> std::io::Result<usize>,
    ) -> std::io::Result<usize>;
}

/// Runs the non-blocking write `attempt` on `socket` once it has room, waiting for room the
/// way tokio's own writes do.
fn poll_socket_write(
    socket: &impl RegisteredSocket,
    cx: &mut Context<'_>,
    mut attempt: impl FnMut(BorrowedFd<'_>) -> rustix::io::Result<usize>,
) -> Poll<std::io::Result<usize>> {
    loop {
        std::task::ready!(socket.poll_write_ready(cx))?;
        match socket.try_write_io(|| attempt(socket.as_fd()).map_err(std::io::Error::from)) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            other => return Poll::Ready(other),
        }
    }
}

/// A socket registered with tokio: its descriptor for the idle spin, and splices into it.
macro_rules! socket_stream {
    ($socket:ty) => {
        impl RegisteredSocket for $socket {
            fn poll_write_ready(&self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                <$socket>::poll_write_ready(self, cx)
            }

            fn try_write_io(
                &self,
                attempt: impl FnOnce() -> std::io::Result<usize>,
            ) -> std::io::Result<usize> {
                self.try_io(tokio::io::Interest::WRITABLE, attempt)
            }
        }

        impl Stream for $socket {
            fn socket_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
                Some(std::os::fd::AsFd::as_fd(self))
            }

            fn can_splice(&self) -> bool {
                true
            }

            fn poll_splice(
                &self,
                cx: &mut Context<'_>,
                pipe: BorrowedFd<'_>,
                len: usize,
            ) -> Poll<std::io::Result<usize>> {
                poll_socket_write(self, cx, |socket| {
                    let flags = rustix::pipe::SpliceFlags::NONBLOCK;
                    rustix::pipe::splice(pipe, None, socket, None, len, flags)
                })
            }

            fn poll_write_more(
                &self,
                cx: &mut Context<'_>,
                slices: &[std::io::IoSlice<'_>],
            ) -> Poll<std::io::Result<usize>> {
                poll_socket_write(self, cx, |socket| {
                    let flags = rustix::net::SendFlags::MORE | rustix::net::SendFlags::NOSIGNAL;
                    let mut no_ancillary = rustix::net::SendAncillaryBuffer::default();
                    rustix::net::sendmsg(socket, slices, &mut no_ancillary, flags)
                })
            }
        }
    };
}

socket_stream!(tokio::net::TcpStream);
socket_stream!(tokio::net::UnixStream);

impl Stream for tokio::io::DuplexStream {}

impl Stream for Box<dyn Stream> {
    fn socket_fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        (**self).socket_fd()
    }

    fn can_splice(&self) -> bool {
        (**self).can_splice()
    }

    fn poll_splice(
        &self,
        cx: &mut Context<'_>,
        pipe: BorrowedFd<'_>,
        len: usize,
    ) -> Poll<std::io::Result<usize>> {
        (**self).poll_splice(cx, pipe, len)
    }

    fn poll_write_more(
        &self,
        cx: &mut Context<'_>,
        slices: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        (**self).poll_write_more(cx, slices)
    }
}

async fn accept(listener: &Listener, tcp: &TcpSettings) -> std::io::Result<(Accepted, String)> {
    match listener {
        Listener::Tcp(l) => {
            let (stream, peer) = l.accept().await?;
            let peer = peer.to_string();
            tcp.tune(&stream, &peer);
            Ok((Accepted::Tcp(stream.into_std()?), peer))
        }
        Listener::Unix(l, path) => {
            let (stream, _) = l.accept().await?;
            Ok((
                Accepted::Unix(stream.into_std()?),
                format!("unix:{}", path.display()),
            ))
        }
    }
}

/// An accepted socket not yet registered with a runtime (it is registered with the one
/// that serves it).
enum Accepted {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
}

impl Accepted {
    /// The socket registered with the current runtime.
    fn register(self) -> std::io::Result<Box<dyn Stream>> {
        Ok(match self {
            Accepted::Tcp(s) => Box::new(tokio::net::TcpStream::from_std(s)?),
            Accepted::Unix(s) => Box::new(tokio::net::UnixStream::from_std(s)?),
        })
    }
}

/// Threads that each run a single-threaded tokio runtime, and the connections handed to
/// them: a connection lives on one thread, whose own `epoll` alone watches its socket.
///
/// Measured reason: on a multi-threaded runtime a worker with nothing to do waits in the
/// shared reactor, so every request that arrives while another worker serves its
/// connection wakes it on the other CPU, for nothing (the task is already running). With
/// one connection at iodepth 32 (memory export, fio 4 KiB random reads, 3 s under
/// `perf stat`), two workers made 77k context switches and 48.8k `epoll_wait` calls
/// against 38k and 4.6k for one worker, and `--threads 1` served 1.31× the IOPS at 0.74×
/// the CPU per request. With a runtime per thread, one connection gets that one-worker
/// behaviour and several connections still spread over the CPUs.
pub struct ConnectionThreads {
    runtimes: Vec<ConnectionThread>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// One thread's runtime, how many connections it serves, and how to end it.
struct ConnectionThread {
    handle: tokio::runtime::Handle,
    connections: Arc<AtomicUsize>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

/// Connection threads in this process (the idle spin counts them as workers).
pub(crate) static CONNECTION_THREADS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// On a connection thread: how many connections it serves now.
    static THREAD_CONNECTIONS: std::cell::OnceCell<Arc<AtomicUsize>> =
        const { std::cell::OnceCell::new() };
}

/// What else the calling thread serves besides the connection that runs a lone request
/// on it: nothing on a connection thread with that one connection, others' tasks on any
/// other thread (see `uring::alone`).
pub(super) fn lone_thread() -> LoneThread {
    THREAD_CONNECTIONS.with(|counter| match counter.get() {
        Some(connections) if connections.load(Ordering::Acquire) == 1 => LoneThread::Own,
        _ => LoneThread::Shared,
    })
}

impl ConnectionThreads {
    /// Starts `count` threads, each running a runtime until the value is dropped; returns
    /// once every thread runs. Called on a runtime, that runtime runs the io_uring reapers
    /// of rings first used on these threads (see `uring::set_reaper_runtime`).
    pub fn start(count: usize) -> std::io::Result<ConnectionThreads> {
        let shared = tokio::runtime::Handle::try_current().ok();
        let mut runtimes = Vec::with_capacity(count);
        let mut threads = Vec::with_capacity(count);
        let (running_tx, running_rx) = std::sync::mpsc::channel::<()>();
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
            let connections = Arc::new(AtomicUsize::new(0));
            runtimes.push(ConnectionThread {
                handle: runtime.handle().clone(),
                connections: Arc::clone(&connections),
                stop: Some(stop_tx),
            });
            let running = running_tx.clone();
            let shared = shared.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("netblk-conn-{index}"))
                    .spawn(move || {
                        crate::backend::uring::set_reaper_runtime(shared);
                        THREAD_CONNECTIONS.with(|counter| {
                            let _ = counter.set(connections);
                        });
                        let _ = running.send(());
                        runtime.block_on(async {
                            let _ = stop_rx.await;
                        });
                    })?,
            );
        }
        drop(running_tx);
        // Each thread has its name once it runs: the server is whole before it says it
        // is listening.
        for _ in 0..count {
            let _ = running_rx.recv();
        }
        CONNECTION_THREADS.fetch_add(count, Ordering::AcqRel);
        Ok(ConnectionThreads { runtimes, threads })
    }

    /// Runs the transmission phase of a negotiated connection on the thread with the
    /// fewest connections.
    fn spawn_transmission(
        &self,
        stream: Accepted,
        negotiated: handshake::Negotiated,
        config: Arc<ServerConfig>,
        stop: watch::Receiver<bool>,
        alive: Alive,
    ) {
        let thread = self
            .runtimes
            .iter()
            .min_by_key(|t| t.connections.load(Ordering::Acquire))
            .expect("at least one connection thread");
        let connections = Arc::clone(&thread.connections);
        connections.fetch_add(1, Ordering::AcqRel);
        let span = tracing::Span::current();
        thread.handle.spawn(
            async move {
                match stream.register() {
                    Ok(stream) => transmit(stream, negotiated, &config, stop, alive).await,
                    Err(e) => warn!("registering the connection failed: {e}"),
                }
                connections.fetch_sub(1, Ordering::AcqRel);
            }
            .instrument(span),
        );
    }
}

impl Drop for ConnectionThreads {
    fn drop(&mut self) {
        for runtime in &mut self.runtimes {
            if let Some(stop) = runtime.stop.take() {
                let _ = stop.send(());
            }
        }
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        CONNECTION_THREADS.fetch_sub(self.runtimes.len(), Ordering::AcqRel);
    }
}

/// Negotiates and then serves one connection; `alive` is dropped when it ends. (For a
/// caller with a stream of its own: it is not listed in [`ServerConfig::clients`], as the
/// connections a server accepts are.)
pub async fn handle_connection<S: Stream>(
    stream: S,
    config: Arc<ServerConfig>,
    stop: watch::Receiver<bool>,
    alive: mpsc::Sender<()>,
) {
    let alive = Alive {
        _done: alive,
        client: None,
    };
    serve_connection(stream, config, stop, alive).await;
}

/// What a connection holds while it lives: the server's shutdown waits until every one is
/// dropped, and its client slot lists it for `netblk status`.
struct Alive {
    _done: mpsc::Sender<()>,
    client: Option<ClientSlot>,
}

impl Alive {
    /// What takes the connection off the list of clients (freeing its slot) when called,
    /// while the server's shutdown still waits for `self`: for the end of a connection,
    /// before its socket lingers.
    fn leave_list(&mut self) -> impl FnOnce() + Send {
        let slot = self.client.take();
        move || drop(slot)
    }

    /// Records the export the handshake chose.
    fn transmitting(&self, export: &str) {
        if let Some(client) = &self.client {
            client.transmitting(export);
        }
    }
}

/// [`handle_connection`].
async fn serve_connection<S: Stream>(
    mut stream: S,
    config: Arc<ServerConfig>,
    mut stop: watch::Receiver<bool>,
    alive: Alive,
) {
    let Some(negotiated) = negotiate(&mut stream, &config, &mut stop).await else {
        return;
    };
    alive.transmitting(&negotiated.export.name);
    transmit(stream, negotiated, &config, stop, alive).await;
}

/// The transmission phase of a negotiated connection; `alive` lists it until its replies
/// have left ([`Alive::leave_list`]) and holds the server's shutdown until it ends.
async fn transmit<S: Stream>(
    stream: S,
    negotiated: handshake::Negotiated,
    config: &ServerConfig,
    stop: watch::Receiver<bool>,
    mut alive: Alive,
) {
    let leave_list = alive.leave_list();
    pipeline::run(stream, negotiated, config.max_merge, stop, leave_list).await;
    drop(alive);
}

/// A socket that can leave its runtime for another one.
trait Unregister: Stream + Sized {
    fn unregister(self) -> std::io::Result<Accepted>;
}

impl Unregister for tokio::net::TcpStream {
    fn unregister(self) -> std::io::Result<Accepted> {
        Ok(Accepted::Tcp(self.into_std()?))
    }
}

impl Unregister for tokio::net::UnixStream {
    fn unregister(self) -> std::io::Result<Accepted> {
        Ok(Accepted::Unix(self.into_std()?))
    }
}

/// Negotiates on this runtime, then serves the connection on a connection thread, or
/// here when its export completes through a ring (see [`ConnectionThreads`]).
async fn place_connection(
    stream: Accepted,
    config: Arc<ServerConfig>,
    stop: watch::Receiver<bool>,
    alive: Alive,
    threads: Arc<ConnectionThreads>,
) {
    let registered = match stream {
        Accepted::Tcp(s) => tokio::net::TcpStream::from_std(s).map(|s| {
            Box::pin(place_registered(s, config, stop, alive, threads))
                as Pin<Box<dyn Future<Output = ()> + Send>>
        }),
        Accepted::Unix(s) => tokio::net::UnixStream::from_std(s).map(|s| {
            Box::pin(place_registered(s, config, stop, alive, threads))
                as Pin<Box<dyn Future<Output = ()> + Send>>
        }),
    };
    match registered {
        Ok(task) => task.await,
        Err(e) => warn!("registering the connection failed: {e}"),
    }
}

/// [`place_connection`] for a socket registered with this runtime.
async fn place_registered<S: Unregister>(
    mut stream: S,
    config: Arc<ServerConfig>,
    mut stop: watch::Receiver<bool>,
    alive: Alive,
    threads: Arc<ConnectionThreads>,
) {
    let Some(negotiated) = negotiate(&mut stream, &config, &mut stop).await else {
        return;
    };
    alive.transmitting(&negotiated.export.name);
    if negotiated.export.backend.completes_through_ring() {
        transmit(stream, negotiated, &config, stop, alive).await;
        return;
    }
    match stream.unregister() {
        Ok(stream) => threads.spawn_transmission(stream, negotiated, config, stop, alive),
        Err(e) => warn!("moving the connection to its thread failed: {e}"),
    }
}

/// The handshake, with the server's timeout; `None` when it ended without transmission
/// (what happened is logged).
async fn negotiate<S: Stream>(
    stream: &mut S,
    config: &ServerConfig,
    stop: &mut watch::Receiver<bool>,
) -> Option<handshake::Negotiated> {
    let stopping = stop.clone();
    // When the client's last option came.
    let last_option = Arc::new(std::sync::Mutex::new(None::<tokio::time::Instant>));
    let option_seen = Arc::clone(&last_option);
    let negotiated = {
        let handshake = tokio::time::timeout(
            config.handshake_timeout,
            handshake::negotiate(&mut *stream, &config.exports, move || {
                *option_seen.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some(tokio::time::Instant::now());
                let stopped = *stopping.borrow();
                stopped
            }),
        );
        tokio::pin!(handshake);
        tokio::select! {
            () = async { drop(stop.wait_for(|s| *s).await) } => {
                // The handshake goes on for a client that is haggling, refusing every
                // further option with NBD_REP_ERR_SHUTDOWN, so it learns why the connection
                // ends: for HANDSHAKE_AFTER_STOP, if it sent an option within that time
                // before the stop or sends one within HANDSHAKE_QUIET after it. A client
                // that sends nothing costs the stop HANDSHAKE_QUIET (found by review: a
                // fixed second here made every silent client cost the stop 1 s; then a
                // 50 ms gap between options cut clients that were haggling). One that
                // agreed on an export just before (its GO was being answered) starts
                // transmission, which refuses what it reads.
                let stopped_at = tokio::time::Instant::now();
                let give_up = stopped_at + HANDSHAKE_AFTER_STOP;
                let last = || *last_option.lock().unwrap_or_else(|e| e.into_inner());
                let mut haggling = last()
                    .is_some_and(|at| stopped_at.duration_since(at) < HANDSHAKE_AFTER_STOP);
                loop {
                    let left = give_up.saturating_duration_since(tokio::time::Instant::now());
                    let window = if haggling { left } else { left.min(HANDSHAKE_QUIET) };
                    match tokio::time::timeout(window, &mut handshake).await {
                        Ok(Ok(Ok(negotiated))) => break Some(Ok(Ok(negotiated))),
                        Ok(_) => break None,
                        Err(_) => {
                            let sent_since = last().is_some_and(|at| at >= stopped_at);
                            if haggling || !sent_since || left.is_zero() {
                                break None;
                            }
                            haggling = true;
                        }
                    }
                }
            }
            result = &mut handshake => Some(result),
        }
    };
    let Some(negotiated) = negotiated else {
        tracing::debug!("server stopping during the handshake: closing");
        let give_up_at = tokio::time::Instant::now() + LINGER_AFTER_HANDSHAKE;
        pipeline::close_gently(stream, give_up_at, || {}).await;
        return None;
    };
    match negotiated {
        Err(_) => {
            warn_limited!(
                FAILED_HANDSHAKES,
                "handshake not finished within {:?}: closing",
                config.handshake_timeout
            );
            None
        }
        Ok(Err(end @ handshake::NegotiationEnd::Io(_))) => {
            warn_limited!(FAILED_HANDSHAKES, "closing during handshake: {end}");
            None
        }
        Ok(Err(end)) if end.is_violation() => {
            warn_limited!(REFUSED_HANDSHAKES, "closing during handshake: {end}");
            None
        }
        Ok(Err(end)) => {
            tracing::debug!("{end}");
            None
        }
        Ok(Ok(negotiated)) => {
            info!(export = %negotiated.export.name, reply = ?negotiated.reply_style, "transmission");
            Some(negotiated)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::uring::{direct_scratch_file, plugged, Ring};
    use crate::buffer::Buffer;
    use std::time::{Duration, Instant};

    #[test]
    fn rings_used_on_connection_threads_reap_on_the_runtime_that_started_them() {
        // Data on the device, read with O_DIRECT: the reads complete later, from the
        // device, not while they are submitted.
        let (_tmp, file) = direct_scratch_file(&[5u8; 8 * 4096], 8 * 4096);
        let shared = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let threads = shared
            .block_on(async { ConnectionThreads::start(1) })
            .unwrap();
        let ring = Ring::for_direct_io().unwrap();
        let (handed_out_tx, handed_out_rx) = std::sync::mpsc::channel();
        let on_thread = Arc::clone(&ring);
        threads.runtimes[0].handle.spawn(async move {
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            let mut reads: Vec<_> = plugged(|| {
                (0..8u64)
                    .map(|i| {
                        let mut read =
                            Box::pin(on_thread.read(&file, i * 4096, Buffer::take(4096)));
                        assert!(read.as_mut().poll(&mut cx).is_pending());
                        read
                    })
                    .collect()
            });
            // This thread's runtime is held up from here on (as a busy connection holds
            // it): only a reaper on the shared runtime hands the completions out.
            let deadline = Instant::now() + Duration::from_secs(10);
            while on_thread.handed_out() < 8 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            let _ = handed_out_tx.send(on_thread.handed_out());
            for read in &mut reads {
                let std::task::Poll::Ready((result, buffer)) = read.as_mut().poll(&mut cx) else {
                    panic!("a handed-out read is still pending");
                };
                assert_eq!(result.unwrap(), 4096);
                assert!(buffer.as_ref().iter().all(|&b| b == 5));
            }
        });
        assert_eq!(handed_out_rx.recv().unwrap(), 8);
        drop(threads);
        drop(ring);
    }

    #[test]
    fn a_connection_thread_is_its_connections_own_only_while_it_has_one() {
        let threads = ConnectionThreads::start(1).unwrap();
        let thread = &threads.runtimes[0];
        let on_thread = |thread: &ConnectionThread| {
            let (tx, rx) = std::sync::mpsc::channel();
            thread.handle.spawn(async move {
                let _ = tx.send(lone_thread());
            });
            rx.recv().unwrap()
        };
        assert_eq!(on_thread(thread), LoneThread::Shared, "no connection yet");
        thread.connections.fetch_add(1, Ordering::AcqRel);
        assert_eq!(on_thread(thread), LoneThread::Own);
        thread.connections.fetch_add(1, Ordering::AcqRel);
        assert_eq!(on_thread(thread), LoneThread::Shared, "a second connection");
        thread.connections.fetch_sub(1, Ordering::AcqRel);
        assert_eq!(on_thread(thread), LoneThread::Own);
        assert_eq!(lone_thread(), LoneThread::Shared, "any other thread");
    }
}
