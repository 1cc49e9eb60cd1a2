//! Metrics for monitoring: counters of the requests each export serves, and the
//! Prometheus text endpoint (`netblk serve --metrics HOST:PORT`, `GET /metrics`) that shows
//! them beside what `netblk status` says of the server or the replicated node.
//!
//! The data path counts without shared writes per request: each connection keeps its own
//! [`Tally`] and adds it to its export's [`ExportStats`] once per poll of its pipeline,
//! which handles every request a socket read brought in. Requests the backend failed are
//! counted process-wide where they are logged ([`note_io_error`]): rare, and not worth a
//! path from the backend's futures to their export.

use std::fmt::Write as _;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::control::ServerStatus;
use crate::replication::control::Status;
use crate::wire::cmd;

/// The commands counted, by their NBD command number (validation refuses any other).
const COMMANDS: [(u16, &str); 7] = [
    (cmd::READ, "read"),
    (cmd::WRITE, "write"),
    (cmd::FLUSH, "flush"),
    (cmd::TRIM, "trim"),
    (cmd::CACHE, "cache"),
    (cmd::WRITE_ZEROES, "write_zeroes"),
    (cmd::BLOCK_STATUS, "block_status"),
];
const KINDS: usize = COMMANDS.len();

fn kind_of(command: u16) -> Option<usize> {
    COMMANDS.iter().position(|&(code, _)| code == command)
}

/// What one export has served since the server started, from every connection.
#[derive(Default, Debug)]
pub struct ExportStats {
    requests: [AtomicU64; KINDS],
    refused: AtomicU64,
    read_bytes: AtomicU64,
    written_bytes: AtomicU64,
}

impl ExportStats {
    /// The counts now.
    pub fn counts(&self) -> RequestCounts {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut requests = [0u64; KINDS];
        for (count, atomic) in requests.iter_mut().zip(&self.requests) {
            *count = load(atomic);
        }
        RequestCounts {
            read: requests[0],
            write: requests[1],
            flush: requests[2],
            trim: requests[3],
            cache: requests[4],
            write_zeroes: requests[5],
            block_status: requests[6],
            refused: load(&self.refused),
            read_bytes: load(&self.read_bytes),
            written_bytes: load(&self.written_bytes),
        }
    }
}

/// An export's request counts, as `netblk status --json` and the metrics endpoint show them.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct RequestCounts {
    pub read: u64,
    pub write: u64,
    pub flush: u64,
    pub trim: u64,
    pub cache: u64,
    pub write_zeroes: u64,
    pub block_status: u64,
    /// Requests refused before they reached the backend (out of range, read-only, ...).
    pub refused: u64,
    /// Bytes the export's reads asked for, and its writes carried.
    pub read_bytes: u64,
    pub written_bytes: u64,
}

impl RequestCounts {
    fn by_command(&self) -> [(&'static str, u64); KINDS] {
        [
            ("read", self.read),
            ("write", self.write),
            ("flush", self.flush),
            ("trim", self.trim),
            ("cache", self.cache),
            ("write_zeroes", self.write_zeroes),
            ("block_status", self.block_status),
        ]
    }
}

/// One connection's counts since it last published them.
#[derive(Default, Debug)]
pub struct Tally {
    requests: [u64; KINDS],
    refused: u64,
    read_bytes: u64,
    written_bytes: u64,
    pending: bool,
}

impl Tally {
    /// A request the connection accepted: `command`, moving `length` bytes if it is a read
    /// or a write.
    #[inline]
    pub fn accepted(&mut self, command: u16, length: u64) {
        if let Some(kind) = kind_of(command) {
            self.requests[kind] += 1;
        }
        match command {
            cmd::READ => self.read_bytes += length,
            cmd::WRITE => self.written_bytes += length,
            _ => {}
        }
        self.pending = true;
    }

    /// A request refused before it reached the backend.
    pub fn refused(&mut self) {
        self.refused += 1;
        self.pending = true;
    }

    /// Adds what was counted since the last call to `stats`.
    #[inline]
    pub fn publish(&mut self, stats: &ExportStats) {
        if !self.pending {
            return;
        }
        let add = |atomic: &AtomicU64, n: &mut u64| {
            if *n > 0 {
                atomic.fetch_add(std::mem::take(n), Ordering::Relaxed);
            }
        };
        for (atomic, n) in stats.requests.iter().zip(self.requests.iter_mut()) {
            add(atomic, n);
        }
        add(&stats.refused, &mut self.refused);
        add(&stats.read_bytes, &mut self.read_bytes);
        add(&stats.written_bytes, &mut self.written_bytes);
        self.pending = false;
    }
}

/// Errors the backend answered requests with, on every export (each also logged, within
/// the log's limit); a large read answered in pieces counts each piece that failed.
static IO_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Counts an error the backend answered a request with.
pub fn note_io_error() {
    IO_ERRORS.fetch_add(1, Ordering::Relaxed);
}

/// Errors the backend answered requests with since the server started.
pub fn io_errors() -> u64 {
    IO_ERRORS.load(Ordering::Relaxed)
}

/// Prometheus text exposition (format 0.0.4), written family by family.
struct Exposition(String);

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        self.0.push_str(name);
        if !labels.is_empty() {
            self.0.push('{');
            for (i, (label, text)) in labels.iter().enumerate() {
                if i > 0 {
                    self.0.push(',');
                }
                let _ = write!(self.0, "{label}=\"{}\"", escape_label(text));
            }
            self.0.push('}');
        }
        let _ = writeln!(self.0, " {value}");
    }
}

/// A label value as the text format needs it: backslash, double quote and line feed escaped.
fn escape_label(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '"' => escaped.push_str("\\\""),
            '\n' => escaped.push_str("\\n"),
            c => escaped.push(c),
        }
    }
    escaped
}

fn flag(on: bool) -> u8 {
    u8::from(on)
}

/// The metrics of a plain server (`netblk serve`), from its status.
pub fn render_server(status: &ServerStatus) -> String {
    let mut out = Exposition(String::new());
    common(&mut out, status.uptime_seconds, status.clients.len());
    exports(&mut out, status);
    out.0
}

/// The metrics of a replicated node: its export's, then the replication's.
pub fn render_node(server: &ServerStatus, node: &Status) -> String {
    let mut out = Exposition(String::new());
    common(&mut out, server.uptime_seconds, server.clients.len());
    exports(&mut out, server);
    replication(&mut out, node);
    out.0
}

fn common(out: &mut Exposition, uptime_seconds: u64, clients: usize) {
    out.family(
        "netblk_uptime_seconds",
        "gauge",
        "Seconds since the server started.",
    );
    out.sample("netblk_uptime_seconds", &[], uptime_seconds);
    out.family(
        "netblk_clients",
        "gauge",
        "Client connections, negotiating ones included.",
    );
    out.sample("netblk_clients", &[], clients);
    out.family(
        "netblk_io_errors_total",
        "counter",
        "Errors the backend answered requests with, on every export.",
    );
    out.sample("netblk_io_errors_total", &[], io_errors());
}

fn exports(out: &mut Exposition, status: &ServerStatus) {
    type ExportField = fn(&crate::control::ExportStatus) -> u64;
    let per_export: [(&str, &str, &str, ExportField); 6] = [
        (
            "netblk_export_size_bytes",
            "gauge",
            "Size of the export.",
            |e| e.size,
        ),
        (
            "netblk_export_clients",
            "gauge",
            "Connections using the export.",
            |e| e.clients as u64,
        ),
        (
            "netblk_export_flush_failed",
            "gauge",
            "1 once a sync of the backing failed: every FLUSH fails until a restart.",
            |e| u64::from(e.flush_stopped.is_some()),
        ),
        (
            "netblk_export_requests_refused_total",
            "counter",
            "Requests refused before the backend (out of range, read-only export, bad flags).",
            |e| e.requests.refused,
        ),
        (
            "netblk_export_read_bytes_total",
            "counter",
            "Bytes the export's accepted reads asked for.",
            |e| e.requests.read_bytes,
        ),
        (
            "netblk_export_written_bytes_total",
            "counter",
            "Bytes the export's accepted writes carried.",
            |e| e.requests.written_bytes,
        ),
    ];
    for (name, kind, help, field) in per_export {
        out.family(name, kind, help);
        for e in &status.exports {
            out.sample(name, &[("export", e.name.as_str())], field(e));
        }
    }
    let name = "netblk_export_requests_total";
    out.family(name, "counter", "Requests the export accepted, by command.");
    for e in &status.exports {
        for (command, n) in e.requests.by_command() {
            out.sample(
                name,
                &[("export", e.name.as_str()), ("command", command)],
                n,
            );
        }
    }
}

fn replication(out: &mut Exposition, node: &Status) {
    let me = [
        ("resource", node.resource.as_str()),
        ("node", node.node.as_str()),
    ];
    out.family(
        "netblk_replication_primary",
        "gauge",
        "1 while this node is primary.",
    );
    out.sample(
        "netblk_replication_primary",
        &me,
        flag(node.role == "primary"),
    );
    out.family(
        "netblk_replication_disk_state",
        "gauge",
        "The local disk's state: 1 for the state it is in.",
    );
    for state in ["UpToDate", "Outdated", "Inconsistent"] {
        let labels = [me[0], me[1], ("state", state)];
        out.sample(
            "netblk_replication_disk_state",
            &labels,
            flag(node.disk == state),
        );
    }
    out.family(
        "netblk_replication_out_of_sync_bytes",
        "gauge",
        "Bytes some peer misses.",
    );
    out.sample(
        "netblk_replication_out_of_sync_bytes",
        &me,
        node.out_of_sync_bytes,
    );
    for (name, help, on) in [
        (
            "netblk_replication_metadata_failed",
            "1 once a write or sync of the metadata failed: writes fail until a restart.",
            node.metadata_stopped.is_some(),
        ),
        (
            "netblk_replication_flush_failed",
            "1 once a sync of the local disk failed: every FLUSH fails until a restart.",
            node.flush_stopped.is_some(),
        ),
        (
            "netblk_replication_detached",
            "1 once the local disk was detached after an I/O error: requests go to peers.",
            node.detached.is_some(),
        ),
    ] {
        out.family(name, "gauge", help);
        out.sample(name, &me, flag(on));
    }
    type PeerField = fn(&crate::replication::control::PeerStatus) -> u64;
    let per_peer: [(&str, &str, &str, PeerField); 8] = [
        (
            "netblk_replication_peer_connected",
            "gauge",
            "1 while the link to the peer is up.",
            |p| u64::from(p.connected),
        ),
        (
            "netblk_replication_peer_replicating",
            "gauge",
            "1 while the peer takes this primary's writes.",
            |p| u64::from(p.replicating),
        ),
        (
            "netblk_replication_peer_out_of_sync_bytes",
            "gauge",
            "Bytes the peer misses.",
            |p| p.out_of_sync_bytes,
        ),
        (
            "netblk_replication_peer_resync_running",
            "gauge",
            "1 while a resync pass with the peer runs.",
            |p| u64::from(p.resyncing()),
        ),
        (
            "netblk_replication_peer_resync_done_bytes",
            "gauge",
            "Bytes the current (or last) resync pass has compared.",
            |p| p.resync_done_bytes,
        ),
        (
            "netblk_replication_peer_resync_total_bytes",
            "gauge",
            "Bytes the current (or last) resync pass has to compare.",
            |p| p.resync_total_bytes,
        ),
        (
            "netblk_replication_peer_resync_sent_bytes",
            "gauge",
            "Bytes of the current (or last) resync pass that differed and were sent.",
            |p| p.resync_sent_bytes,
        ),
        (
            "netblk_replication_peer_refused",
            "gauge",
            "1 while the last attempt to link with the peer was refused (split brain, ...).",
            |p| u64::from(p.refused.is_some()),
        ),
    ];
    for (name, kind, help, field) in per_peer {
        out.family(name, kind, help);
        for peer in &node.peers {
            let labels = [me[0], me[1], ("peer", peer.name.as_str())];
            out.sample(name, &labels, field(peer));
        }
    }
}

/// The longest request head the endpoint reads.
const MAX_HEAD: usize = 8192;
/// How long a metrics client may take to send its request head, and to take its answer:
/// one that never reads an answer larger than its socket's buffer would otherwise hold a
/// place for as long as it stays connected.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);
/// Metrics requests served at once; one more is closed at once (as the control socket's).
const MAX_REQUESTS: usize = 16;
/// The most headers a request may carry.
const MAX_HEADERS: usize = 64;

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Asked {
    /// `GET /metrics` (or `HEAD`): the metrics; `head_only` for `HEAD`.
    Metrics { head_only: bool },
    /// A complete head, answered with this status line and reason.
    Refused(u16, &'static str),
    /// Not a complete head yet.
    Incomplete,
}

/// Parses a request head (HTTP/1.x) from `bytes`: what it asks for.
pub fn parse_request(bytes: &[u8]) -> Asked {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(bytes) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Asked::Incomplete,
        Err(httparse::Error::TooManyHeaders) => {
            return Asked::Refused(431, "Request Header Fields Too Large")
        }
        Err(_) => return Asked::Refused(400, "Bad Request"),
    }
    let head_only = match request.method {
        Some("GET") => false,
        Some("HEAD") => true,
        _ => return Asked::Refused(405, "Method Not Allowed"),
    };
    let path = request.path.unwrap_or("");
    let path = path.split_once('?').map_or(path, |(path, _)| path);
    if path == "/metrics" || path == "/" {
        Asked::Metrics { head_only }
    } else {
        Asked::Refused(404, "Not Found")
    }
}

/// Serves `GET /metrics` on `listener`, each answered with what `render` gives then,
/// until `stop` turns true.
pub async fn serve<F, R>(listener: TcpListener, stop: watch::Receiver<bool>, render: F)
where
    F: Fn() -> R + Clone + Send + 'static,
    R: Future<Output = String> + Send,
{
    let serve_one = |stream, permit| {
        let render = render.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let _ = answer(stream, render).await;
        });
    };
    // One more request than the bound is closed at once.
    crate::control::accept_bounded(
        &listener,
        "metrics endpoint",
        MAX_REQUESTS,
        stop,
        drop,
        serve_one,
    )
    .await;
}

/// Reads one request head from `stream` and answers it; the connection then closes.
async fn answer<F, R>(mut stream: tokio::net::TcpStream, render: F) -> std::io::Result<()>
where
    F: Fn() -> R,
    R: Future<Output = String>,
{
    let mut head = Vec::with_capacity(1024);
    let asked = tokio::time::timeout(HEAD_TIMEOUT, async {
        let mut chunk = [0u8; 1024];
        loop {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(None);
            }
            head.extend_from_slice(&chunk[..n]);
            match parse_request(&head) {
                Asked::Incomplete if head.len() < MAX_HEAD => continue,
                Asked::Incomplete => {
                    return Ok(Some(Asked::Refused(431, "Request Header Fields Too Large")))
                }
                asked => return Ok(Some(asked)),
            }
        }
    })
    .await;
    let asked = match asked {
        Ok(Ok(Some(asked))) => asked,
        Ok(Ok(None)) | Err(_) => return Ok(()),
        Ok(Err(e)) => return Err(e),
    };
    let (status, reason, body, head_only) = match asked {
        Asked::Metrics { head_only } => (200, "OK", render().await, head_only),
        Asked::Refused(status, reason) => (status, reason, format!("{reason}\n"), false),
        Asked::Incomplete => unreachable!("answered only once complete"),
    };
    // The exposition format's type only on the metrics themselves; 405 names the methods.
    let (content_type, allow) = match status {
        200 => ("text/plain; version=0.0.4; charset=utf-8", ""),
        405 => ("text/plain; charset=utf-8", "Allow: GET, HEAD\r\n"),
        _ => ("text/plain; charset=utf-8", ""),
    };
    let mut reply = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n{allow}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    if !head_only {
        reply.push_str(&body);
    }
    match tokio::time::timeout(HEAD_TIMEOUT, async {
        stream.write_all(reply.as_bytes()).await?;
        stream.shutdown().await
    })
    .await
    {
        Ok(done) => done,
        Err(_) => Err(std::io::ErrorKind::TimedOut.into()),
    }
}

/// Binds the metrics endpoint at `addr` (`HOST:PORT`).
pub async fn bind(addr: &str) -> anyhow::Result<TcpListener> {
    use anyhow::Context;
    // A name resolves as --listen's does (`localhost:9810` was refused).
    let parsed: Vec<SocketAddr> = tokio::net::lookup_host(addr)
        .await
        .with_context(|| format!("--metrics {addr}: expected HOST:PORT, e.g. 127.0.0.1:9810"))?
        .collect();
    TcpListener::bind(parsed.as_slice())
        .await
        .with_context(|| format!("binding the metrics endpoint {addr}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::ExportStatus;

    #[test]
    fn a_tally_reaches_its_export_once_per_publish() {
        let stats = ExportStats::default();
        let mut tally = Tally::default();
        tally.accepted(cmd::READ, 4096);
        tally.accepted(cmd::READ, 512);
        tally.accepted(cmd::WRITE, 65536);
        tally.accepted(cmd::FLUSH, 0);
        tally.refused();
        tally.publish(&stats);
        tally.publish(&stats);
        let counts = stats.counts();
        assert_eq!(
            counts,
            RequestCounts {
                read: 2,
                write: 1,
                flush: 1,
                refused: 1,
                read_bytes: 4608,
                written_bytes: 65536,
                ..RequestCounts::default()
            }
        );
        tally.accepted(cmd::TRIM, 1 << 20);
        tally.publish(&stats);
        assert_eq!(stats.counts().trim, 1);
        assert_eq!(stats.counts().read_bytes, 4608, "a trim moves no data");
    }

    #[test]
    fn request_heads_are_parsed_and_refused_plainly() {
        let metrics = Asked::Metrics { head_only: false };
        assert_eq!(
            parse_request(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"),
            metrics
        );
        assert_eq!(parse_request(b"GET /metrics?x=1 HTTP/1.0\r\n\r\n"), metrics);
        assert_eq!(parse_request(b"GET / HTTP/1.1\r\n\r\n"), metrics);
        assert_eq!(
            parse_request(b"HEAD /metrics HTTP/1.1\r\n\r\n"),
            Asked::Metrics { head_only: true }
        );
        assert_eq!(
            parse_request(b"GET /metrics HTTP/1.1\r\n"),
            Asked::Incomplete
        );
        assert_eq!(
            parse_request(b"GET /other HTTP/1.1\r\n\r\n"),
            Asked::Refused(404, "Not Found")
        );
        assert_eq!(
            parse_request(b"POST /metrics HTTP/1.1\r\n\r\n"),
            Asked::Refused(405, "Method Not Allowed")
        );
        assert_eq!(
            parse_request(b"\x00\x01garbage\r\n\r\n"),
            Asked::Refused(400, "Bad Request")
        );
        let many = format!(
            "GET / HTTP/1.1\r\n{}\r\n",
            "a: b\r\n".repeat(MAX_HEADERS + 1)
        );
        assert_eq!(
            parse_request(many.as_bytes()),
            Asked::Refused(431, "Request Header Fields Too Large")
        );
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn a_server_renders_one_sample_per_export_and_command() {
        let stats = ExportStats::default();
        let mut tally = Tally::default();
        tally.accepted(cmd::WRITE, 4096);
        tally.publish(&stats);
        let status = ServerStatus {
            uptime_seconds: 7,
            exports: vec![ExportStatus {
                name: "disk \"0\"".into(),
                backing: "memory:1M".into(),
                size: 1 << 20,
                read_only: false,
                cache: None,
                flush_stopped: Some("EIO".into()),
                clients: 0,
                requests: stats.counts(),
            }],
            clients: Vec::new(),
        };
        let text = render_server(&status);
        assert!(text.contains("netblk_uptime_seconds 7\n"), "{text}");
        assert!(text.contains(
            "netblk_export_requests_total{export=\"disk \\\"0\\\"\",command=\"write\"} 1\n"
        ));
        assert!(
            text.contains("netblk_export_written_bytes_total{export=\"disk \\\"0\\\"\"} 4096\n")
        );
        assert!(text.contains("netblk_export_flush_failed{export=\"disk \\\"0\\\"\"} 1\n"));
        // Every sample belongs to a family declared before it.
        let mut declared = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                declared.insert(rest.split(' ').next().unwrap().to_string());
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap();
                assert!(declared.contains(name), "{name} undeclared");
            }
        }
    }
}
