//! The local control socket of a running server or replicated node (Unix, never on the
//! network): one request line per connection, one JSON [`Reply`] line back.
//! `netblk status|promote|demote|verify|outdate` are its clients. A replicated node answers
//! with its [`Status`] ([`crate::replication::control`]); a plain `netblk serve --control`
//! answers `status` with its exports and clients ([`ServerStatus`], from
//! [`crate::server::control`]).

use std::future::Future;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader as AsyncBufReader};
use tokio::net::UnixListener;
use tokio::sync::watch;

use crate::replication::control::Status;
use crate::server::clients::ClientStatus;

/// The reply to any control request.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Reply {
    pub ok: bool,
    pub message: String,
    /// A replicated node's status.
    pub status: Option<Status>,
    /// A plain server's status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<ServerStatus>,
}

/// A plain server's state as `netblk status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ServerStatus {
    pub uptime_seconds: u64,
    pub exports: Vec<ExportStatus>,
    /// Every connection, oldest first, negotiating ones included.
    pub clients: Vec<ClientStatus>,
}

/// One export of a plain server.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ExportStatus {
    pub name: String,
    /// `memory:SIZE`, or the file or block device.
    pub backing: String,
    pub size: u64,
    pub read_only: bool,
    /// `none` (O_DIRECT) or `writeback` for a file or device; `None` for memory.
    pub cache: Option<String>,
    /// Why every FLUSH fails, if a sync of the backing failed (data the kernel had
    /// accepted may be lost): until the server restarts.
    pub flush_stopped: Option<String>,
    /// Connections using this export.
    pub clients: usize,
    /// What the export has served since the server started.
    #[serde(default)]
    pub requests: crate::metrics::RequestCounts,
}

/// Binds the control socket; a stale socket file (nobody listening) is replaced, and
/// anything else at the path is refused.
pub fn bind(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    crate::listen::clear_stale_socket(path)?;
    // Owner only, whatever the umask: the socket promotes, demotes and reports (review,
    // session 66: under umask 000 any local user could demote a primary). Made so by the
    // umask at the bind itself, so that no one can connect in a moment before a chmod
    // (the process is still starting, and nothing else creates files meanwhile); the
    // chmod after it covers a file system that ignores the umask for sockets.
    let before = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let bound = UnixListener::bind(path);
    rustix::process::umask(before);
    let listener = bound?;
    if let Err(e) = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)) {
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(listener)
}

/// The most control requests served at once. One more is answered "busy" and closed at
/// once: each waits up to [`REQUEST_TIMEOUT`] for its line, and without a bound idle
/// control clients could take every file descriptor the NBD clients need (review, session
/// 66: 19,990 of them made new NBD clients hang).
const MAX_CONTROL_REQUESTS: usize = 16;

/// Serves the control socket, each request line answered by `answer`, until `stop` turns
/// true; then removes its file.
pub async fn serve<F, A>(
    listener: UnixListener,
    path: PathBuf,
    stop: watch::Receiver<bool>,
    answer: F,
) where
    F: Fn(String) -> A + Clone + Send + 'static,
    A: Future<Output = Reply> + Send,
{
    let busy = |stream: tokio::net::UnixStream| {
        let busy = Reply {
            ok: false,
            message: format!(
                "the control socket is busy ({MAX_CONTROL_REQUESTS} requests in progress); try again"
            ),
            status: None,
            server: None,
        };
        let mut text = serde_json::to_string(&busy).expect("serializable reply");
        text.push('\n');
        // Without waiting: a client that does not read its answer loses it.
        let _ = stream.try_write(text.as_bytes());
    };
    let serve_one = |stream: tokio::net::UnixStream, permit| {
        let answer = answer.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let (read, mut write) = stream.into_split();
            let Some(line) = read_request_line(read).await else {
                return;
            };
            let reply = match line {
                Ok(line) => answer(line.trim().to_string()).await,
                Err(why) => Reply {
                    ok: false,
                    message: why,
                    status: None,
                    server: None,
                },
            };
            let mut text = serde_json::to_string(&reply).expect("serializable reply");
            text.push('\n');
            // Within the request's time: a client that never reads a reply larger than
            // the socket's buffer held its place for as long as it stayed connected, and
            // sixteen of them kept the socket busy (review, session 69).
            let _ = tokio::time::timeout(REQUEST_TIMEOUT, write.write_all(text.as_bytes())).await;
        });
    };
    accept_bounded(
        &listener,
        "control socket",
        MAX_CONTROL_REQUESTS,
        stop,
        busy,
        serve_one,
    )
    .await;
    let _ = std::fs::remove_file(&path);
}

/// A listener [`accept_bounded`] takes connections from.
pub(crate) trait Accept {
    type Stream: Send + 'static;
    fn accept_one(&self) -> impl Future<Output = std::io::Result<Self::Stream>> + Send + '_;
}

impl Accept for UnixListener {
    type Stream = tokio::net::UnixStream;
    async fn accept_one(&self) -> std::io::Result<tokio::net::UnixStream> {
        self.accept().await.map(|(stream, _)| stream)
    }
}

impl Accept for tokio::net::TcpListener {
    type Stream = tokio::net::TcpStream;
    async fn accept_one(&self) -> std::io::Result<tokio::net::TcpStream> {
        self.accept().await.map(|(stream, _)| stream)
    }
}

/// Accepts connections on `listener` (the control socket, the metrics endpoint) until
/// `stop` turns true, at most `most` of them served at once: each goes to `serve` with
/// the permit that holds its place, and one more to `busy`. A failed accept (out of
/// descriptors, most likely) is retried after 50 ms: at once, it would spin.
pub(crate) async fn accept_bounded<L: Accept>(
    listener: &L,
    what: &str,
    most: usize,
    mut stop: watch::Receiver<bool>,
    mut busy: impl FnMut(L::Stream),
    mut serve: impl FnMut(L::Stream, tokio::sync::OwnedSemaphorePermit),
) {
    let in_progress = Arc::new(tokio::sync::Semaphore::new(most));
    loop {
        let accepted = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            accepted = listener.accept_one() => accepted,
        };
        let stream = match accepted {
            Ok(stream) => stream,
            Err(e) => {
                tracing::debug!("{what} accept: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        match Arc::clone(&in_progress).try_acquire_owned() {
            Ok(permit) => serve(stream, permit),
            Err(_) => busy(stream),
        }
    }
}

/// The longest request line the control socket reads; requests are a few words.
const MAX_REQUEST_LINE: u64 = 4096;
/// How long a control client may take to send its request line.
const REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// One request line, read within [`REQUEST_TIMEOUT`] and [`MAX_REQUEST_LINE`] bytes:
/// `None` when the client sent nothing usable in time (the connection is just closed),
/// `Some(Err)` for a line too long or not UTF-8 (answered with the reason).
async fn read_request_line(
    read: tokio::net::unix::OwnedReadHalf,
) -> Option<Result<String, String>> {
    let mut reader = AsyncBufReader::new(read.take(MAX_REQUEST_LINE + 1));
    let mut line = Vec::new();
    match tokio::time::timeout(REQUEST_TIMEOUT, reader.read_until(b'\n', &mut line)).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) | Err(_) => return None,
    }
    if line.len() as u64 > MAX_REQUEST_LINE {
        return Some(Err(format!("request longer than {MAX_REQUEST_LINE} bytes")));
    }
    Some(String::from_utf8(line).map_err(|_| "request is not UTF-8".to_string()))
}

/// Errors of the control client. The cause is the error's source, not part of its text:
/// `netblk` prints the chain, and a message that also quoted it printed the OS error twice.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("{path} is not a control socket")]
    NotASocket { path: String },
    #[error("cannot reach the server at {path} (is it running?)")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("control socket {path}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("control socket {path}: bad reply")]
    BadReply {
        path: String,
        source: serde_json::Error,
    },
}

/// Sends one request to a control socket and returns its reply.
pub fn request(path: &Path, request: &str) -> Result<Reply, ControlError> {
    let shown = path.display().to_string();
    let mut stream = std::os::unix::net::UnixStream::connect(path).map_err(|source| {
        use std::os::unix::fs::FileTypeExt;
        match std::fs::metadata(path) {
            Ok(found) if !found.file_type().is_socket() => ControlError::NotASocket {
                path: shown.clone(),
            },
            _ => ControlError::Connect {
                path: shown.clone(),
                source,
            },
        }
    })?;
    let io = |source| ControlError::Io {
        path: shown.clone(),
        source,
    };
    // A server that answers at once without reading (busy, or a request too long) may
    // have closed before the request was all written: its answer still waits to be read
    // (the write's EPIPE was shown instead of "busy"; review, session 69).
    let written = stream.write_all(format!("{request}\n").as_bytes());
    let mut line = String::new();
    let read = BufReader::new(stream).read_line(&mut line);
    if let Ok(reply) = serde_json::from_str(&line) {
        return Ok(reply);
    }
    written.map_err(io)?;
    read.map_err(io)?;
    serde_json::from_str(&line).map_err(|source| ControlError::BadReply {
        path: shown.clone(),
        source,
    })
}

/// A human-readable rendering of a plain server's status.
pub fn render_server(status: &ServerStatus) -> String {
    let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    let mut text = format!(
        "server up {} s: {}, {}\n",
        status.uptime_seconds,
        plural(status.exports.len(), "export"),
        plural(status.clients.len(), "client")
    );
    for export in &status.exports {
        let cache = export
            .cache
            .as_ref()
            .map_or(String::new(), |c| format!(", cache {c}"));
        text.push_str(&format!(
            "  export {:?} ({}{cache}): {} bytes, {}, {}\n",
            export.name,
            export.backing,
            export.size,
            if export.read_only {
                "read-only"
            } else {
                "read-write"
            },
            plural(export.clients, "client")
        ));
        if let Some(why) = &export.flush_stopped {
            text.push_str(&format!(
                "    flushes fail: a sync of the backing failed ({why})\n"
            ));
        }
        let r = &export.requests;
        text.push_str(&format!(
            "    served: {} reads ({} bytes), {} writes ({} bytes), {} flushes, {} trims, {} zeroings, {} other, {} refused\n",
            r.read,
            r.read_bytes,
            r.write,
            r.written_bytes,
            r.flush,
            r.trim,
            r.write_zeroes,
            r.cache + r.block_status,
            r.refused
        ));
    }
    for client in &status.clients {
        let on = client
            .export
            .as_ref()
            .map_or("negotiating".to_string(), |e| format!("export {e:?}"));
        text.push_str(&format!(
            "  client {}: {on}, connected {} s\n",
            client.peer, client.connected_seconds
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Serves `listener` with replies that echo each request line; stopped by the sender.
    fn serve_echo(
        listener: UnixListener,
        path: &Path,
    ) -> (watch::Sender<bool>, tokio::task::JoinHandle<()>) {
        let (stop, stop_rx) = watch::channel(false);
        let served = tokio::spawn(serve(
            listener,
            path.to_path_buf(),
            stop_rx,
            |line| async move {
                Reply {
                    ok: true,
                    message: line,
                    status: None,
                    server: None,
                }
            },
        ));
        (stop, served)
    }

    #[tokio::test]
    async fn an_overlong_request_is_refused_without_reading_it_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctl");
        let listener = bind(&path).unwrap();
        let (stop, served) = serve_echo(listener, &path);
        let asking = path.clone();
        let replies = tokio::task::spawn_blocking(move || {
            let normal = request(&asking, "status").unwrap();
            // 64 MiB and no newline: the server stops after 4 KiB and says why.
            let mut stream = std::os::unix::net::UnixStream::connect(&asking).unwrap();
            let chunk = vec![b'x'; 1 << 20];
            for _ in 0..64 {
                if stream.write_all(&chunk).is_err() {
                    break; // the server answered and closed
                }
            }
            let mut reply = String::new();
            let _ = BufReader::new(stream).read_line(&mut reply);
            (normal, reply)
        })
        .await
        .unwrap();
        assert!(replies.0.ok && replies.0.message == "status");
        let refused: Reply = serde_json::from_str(&replies.1).unwrap();
        assert!(!refused.ok);
        assert!(refused.message.contains("longer than 4096"), "{refused:?}");
        stop.send(true).unwrap();
        served.await.unwrap();
        assert!(!path.exists());
    }

    /// The socket is the owner's only, and a 17th client while 16 sit idle is told the
    /// socket is busy at once instead of being held (review, session 66: idle control
    /// clients took every descriptor).
    #[tokio::test]
    async fn the_control_socket_is_private_and_bounded() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ctl");
        let listener = bind(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "control socket mode {mode:o}");
        let (stop, served) = serve_echo(listener, &path);
        let asking = path.clone();
        let (busy, after) = tokio::task::spawn_blocking(move || {
            let idle: Vec<_> = (0..MAX_CONTROL_REQUESTS)
                .map(|_| std::os::unix::net::UnixStream::connect(&asking).unwrap())
                .collect();
            // Let the server take them all in before the next one comes.
            std::thread::sleep(std::time::Duration::from_millis(200));
            let started = std::time::Instant::now();
            let busy = request(&asking, "status").unwrap();
            assert!(started.elapsed() < std::time::Duration::from_secs(2));
            // A request the server closes on before it is all written is still told
            // "busy", not the write's EPIPE (review, session 69).
            let long = request(&asking, &"status ".repeat(1 << 18)).unwrap();
            assert!(!long.ok && long.message.contains("busy"), "{long:?}");
            drop(idle);
            std::thread::sleep(std::time::Duration::from_millis(200));
            (busy, request(&asking, "status").unwrap())
        })
        .await
        .unwrap();
        assert!(!busy.ok && busy.message.contains("busy"), "{busy:?}");
        assert!(after.ok && after.message == "status", "{after:?}");
        stop.send(true).unwrap();
        served.await.unwrap();
    }

    #[test]
    fn a_server_status_renders_its_exports_clients_and_failed_flushes() {
        let status = ServerStatus {
            uptime_seconds: 12,
            exports: vec![
                ExportStatus {
                    name: String::new(),
                    backing: "memory:16777216".into(),
                    size: 16 << 20,
                    read_only: false,
                    cache: None,
                    flush_stopped: None,
                    clients: 1,
                    requests: crate::metrics::RequestCounts {
                        read: 3,
                        read_bytes: 12288,
                        write: 1,
                        written_bytes: 4096,
                        flush: 1,
                        block_status: 2,
                        refused: 1,
                        ..Default::default()
                    },
                },
                ExportStatus {
                    name: "disk0".into(),
                    backing: "/dev/loop0".into(),
                    size: 1 << 30,
                    read_only: true,
                    cache: Some("none".into()),
                    flush_stopped: Some("Input/output error (os error 5)".into()),
                    clients: 0,
                    requests: Default::default(),
                },
            ],
            clients: vec![
                ClientStatus {
                    peer: "127.0.0.1:40000".into(),
                    export: Some(String::new()),
                    connected_seconds: 10,
                },
                ClientStatus {
                    peer: "unix:/run/netblk.sock".into(),
                    export: None,
                    connected_seconds: 0,
                },
            ],
        };
        assert_eq!(
            render_server(&status),
            "server up 12 s: 2 exports, 2 clients\n\
             \x20 export \"\" (memory:16777216): 16777216 bytes, read-write, 1 client\n\
             \x20   served: 3 reads (12288 bytes), 1 writes (4096 bytes), 1 flushes, 0 trims, 0 zeroings, 2 other, 1 refused\n\
             \x20 export \"disk0\" (/dev/loop0, cache none): 1073741824 bytes, read-only, 0 clients\n\
             \x20   flushes fail: a sync of the backing failed (Input/output error (os error 5))\n\
             \x20   served: 0 reads (0 bytes), 0 writes (0 bytes), 0 flushes, 0 trims, 0 zeroings, 0 other, 0 refused\n\
             \x20 client 127.0.0.1:40000: export \"\", connected 10 s\n\
             \x20 client unix:/run/netblk.sock: negotiating, connected 0 s\n"
        );
        // A reply without the field (a replicated node's, or an older server's) still reads.
        let reply: Reply =
            serde_json::from_str(r#"{"ok":true,"message":"","status":null}"#).unwrap();
        assert_eq!(reply.server, None);
    }
}
