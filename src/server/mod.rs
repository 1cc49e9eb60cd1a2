//! The NBD server: listeners, the accept loop, per-connection tasks and graceful shutdown.
//!
//! [`serve`] is the library entry point: give it bound listeners, the exports and a
//! shutdown future. On shutdown it stops accepting, lets every connection finish the
//! requests it has in flight, flushes every export and returns.

mod coalesce;
pub mod handshake;
pub mod pipeline;
pub mod validate;

use std::future::Future;
use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn, Instrument};

use crate::backend::Backend;

/// One exported device.
pub struct Export {
    pub name: String,
    pub description: String,
    pub backend: Arc<dyn Backend>,
}

impl Export {
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
}

/// The default for [`ServerConfig::max_merge`] (see ARCHITECTURE.md for the measurement).
pub const DEFAULT_MAX_MERGE: u32 = 256 * 1024;

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

/// Serves `config.exports` on `listeners` until `shutdown` completes.
pub async fn serve(
    listeners: Vec<Listener>,
    config: ServerConfig,
    shutdown: impl Future,
) -> anyhow::Result<()> {
    let (stop_tx, stop_rx) = watch::channel(false);
    // Every connection holds a clone; when all are dropped, every connection is done.
    let (alive_tx, mut alive_rx) = mpsc::channel::<()>(1);
    let config = Arc::new(config);
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
    let _ = alive_rx.recv().await;
    for export in &config.exports {
        if let Err(e) = export.backend.flush().await {
            warn!(export = %export.name, "final flush failed: {e}");
        }
    }
    for path in unix_paths {
        let _ = std::fs::remove_file(path);
    }
    info!("stopped");
    Ok(())
}

async fn accept_loop(
    listener: Listener,
    config: Arc<ServerConfig>,
    mut stop: watch::Receiver<bool>,
    alive: mpsc::Sender<()>,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            accepted = accept(&listener) => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let span = tracing::info_span!("conn", %peer);
                let task =
                    handle_connection(stream, Arc::clone(&config), stop.clone(), alive.clone());
                tokio::spawn(task.instrument(span));
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
}

/// A socket registered with tokio: its descriptor for the idle spin, and splices into it.
macro_rules! socket_stream {
    ($socket:ty) => {
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
                // Wait for room the way tokio's own writes do.
                loop {
                    match self.poll_write_ready(cx) {
                        Poll::Ready(Ok(())) => {}
                        Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                        Poll::Pending => return Poll::Pending,
                    }
                    let moved = self.try_io(tokio::io::Interest::WRITABLE, || {
                        rustix::pipe::splice(
                            pipe,
                            None,
                            self,
                            None,
                            len,
                            rustix::pipe::SpliceFlags::NONBLOCK,
                        )
                        .map_err(std::io::Error::from)
                    });
                    match moved {
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                        other => return Poll::Ready(other),
                    }
                }
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
}

async fn accept(listener: &Listener) -> std::io::Result<(Box<dyn Stream>, String)> {
    match listener {
        Listener::Tcp(l) => {
            let (stream, peer) = l.accept().await?;
            stream.set_nodelay(true)?;
            Ok((Box::new(stream), peer.to_string()))
        }
        Listener::Unix(l, path) => {
            let (stream, _) = l.accept().await?;
            Ok((Box::new(stream), format!("unix:{}", path.display())))
        }
    }
}

/// Negotiates and then serves one connection.
pub async fn handle_connection<S: Stream>(
    mut stream: S,
    config: Arc<ServerConfig>,
    mut stop: watch::Receiver<bool>,
    alive: mpsc::Sender<()>,
) {
    let handshake = tokio::time::timeout(
        config.handshake_timeout,
        handshake::negotiate(&mut stream, &config.exports),
    );
    let negotiated = tokio::select! {
        _ = stop.wait_for(|s| *s) => {
            tracing::debug!("server stopping during the handshake: closing");
            return;
        }
        result = handshake => result,
    };
    let negotiated = match negotiated {
        Err(_) => {
            warn!(
                "handshake not finished within {:?}: closing",
                config.handshake_timeout
            );
            return;
        }
        Ok(Err(end)) if end.is_violation() => {
            warn!("closing during handshake: {end}");
            return;
        }
        Ok(Err(end)) => {
            tracing::debug!("{end}");
            return;
        }
        Ok(Ok(negotiated)) => negotiated,
    };
    info!(export = %negotiated.export.name, reply = ?negotiated.reply_style, "transmission");
    pipeline::run(stream, negotiated, config.max_merge, stop).await;
    drop(alive);
}
