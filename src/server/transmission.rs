//! The transmission phase of one connection, as a pipeline:
//!
//! * the **reader** pulls as many bytes as the socket holds per call, parses every complete
//!   request in its buffer, validates it at the edge and spawns it;
//! * each **request task** runs its command on the backend and queues its reply messages;
//! * the **writer** gathers every queued reply into one vectored send.
//!
//! Requests complete and reply out of order. Memory is bounded per connection: a request
//! count limit and a byte budget (payloads and read buffers) that is returned only once a
//! reply's data has been written, so a client that stops reading stops being served.

use std::io::IoSlice;
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, warn};

use super::handshake::Negotiated;
use super::validate::{validate, Command, Limits};
use super::Stream;
use crate::backend::{Backend, BackendError, ZeroFlags};
use crate::wire::transmission::{ReplyEncoder, ReplyStyle, RequestHeader, RequestStyle};
use crate::wire::{cmd, NbdError, BASE_ALLOCATION_ID, MAX_PAYLOAD};

/// Requests one connection may have in flight at once.
pub const MAX_IN_FLIGHT: usize = 1024;
/// Payload and read-buffer bytes one connection may hold at once.
pub const BYTE_BUDGET: u64 = 256 * 1024 * 1024;
/// The byte budget is counted in units of this many bytes.
const BUDGET_UNIT: u64 = 4096;
/// A block-status query looks at most this far (keeps the reply small and 32-bit safe).
const MAX_STATUS_SPAN: u64 = (1 << 32) - (1 << 16);
/// Socket read size target: room kept free in the read buffer.
const READ_CHUNK: usize = 256 * 1024;
/// Most reply messages gathered into one vectored send.
const MAX_BATCH: usize = 256;

/// One reply message for the writer: encoded header bytes and optional data sent after
/// them, plus the budget it holds until written.
struct Outgoing {
    header: Vec<u8>,
    data: Option<Bytes>,
    _budget: Option<OwnedSemaphorePermit>,
}

/// Per-connection state shared by the reader and the request tasks.
struct Connection {
    backend: Arc<dyn Backend>,
    reply_style: ReplyStyle,
    replies: mpsc::UnboundedSender<Outgoing>,
}

impl Connection {
    fn encoder(&self, cookie: u64, offset: u64) -> ReplyEncoder {
        ReplyEncoder {
            style: self.reply_style,
            cookie,
            offset,
        }
    }

    fn send(&self, header: Vec<u8>, data: Option<Bytes>, budget: Option<OwnedSemaphorePermit>) {
        // A closed writer means the client is gone; the reply has nowhere to go.
        let _ = self.replies.send(Outgoing {
            header,
            data,
            _budget: budget,
        });
    }

    fn send_ok(&self, cookie: u64, offset: u64) {
        let mut header = Vec::with_capacity(32);
        self.encoder(cookie, offset).ok(&mut header);
        self.send(header, None, None);
    }

    fn send_error(&self, cookie: u64, offset: u64, error: NbdError, message: &str) {
        let mut header = Vec::with_capacity(64);
        self.encoder(cookie, offset)
            .error(&mut header, error, message);
        self.send(header, None, None);
    }

    fn send_result(&self, cookie: u64, offset: u64, result: Result<(), BackendError>) {
        match result {
            Ok(()) => self.send_ok(cookie, offset),
            Err(e) => {
                warn!("{e}");
                self.send_error(cookie, offset, e.errno, &e.to_string());
            }
        }
    }
}

fn budget_units(bytes: u64) -> u32 {
    bytes.div_ceil(BUDGET_UNIT).max(1) as u32
}

/// Runs the transmission phase until the client disconnects, breaks the protocol, or the
/// server stops; then waits for every request in flight to reply.
pub async fn run<S: Stream>(stream: S, negotiated: Negotiated, stop: watch::Receiver<bool>) {
    let (reader, writer) = tokio::io::split(stream);
    let (tx, rx) = mpsc::unbounded_channel();
    let writer = tokio::spawn(write_loop(writer, rx));
    let backend = Arc::clone(&negotiated.export.backend);
    let limits = Limits {
        size: backend.size(),
        read_only: backend.capabilities().read_only,
        style: negotiated.request_style,
        chunked_replies: negotiated.reply_style != ReplyStyle::Simple,
        base_allocation: negotiated.base_allocation,
    };
    let conn = Arc::new(Connection {
        backend,
        reply_style: negotiated.reply_style,
        replies: tx,
    });
    let ending = read_loop(reader, &conn, limits, stop).await;
    debug!("{ending}; waiting for requests in flight");
    drop(conn);
    let _ = writer.await;
}

/// Fills `buf` with more bytes; `Ok(false)` on a clean end of stream or a stop signal.
async fn fill<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
    stop: &mut watch::Receiver<bool>,
) -> std::io::Result<bool> {
    if buf.capacity() - buf.len() < READ_CHUNK / 4 {
        buf.reserve(READ_CHUNK);
    }
    tokio::select! {
        biased;
        _ = stop.wait_for(|s| *s) => Ok(false),
        n = reader.read_buf(buf) => Ok(n? > 0),
    }
}

/// Makes sure `buf` holds at least `n` bytes.
async fn fill_to<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
    n: usize,
    stop: &mut watch::Receiver<bool>,
) -> std::io::Result<bool> {
    if buf.capacity() < n {
        buf.reserve(n - buf.len());
    }
    while buf.len() < n {
        if !fill(reader, buf, stop).await? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Throws away `n` payload bytes so the stream stays in step, without buffering them.
async fn discard<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
    mut n: u64,
    stop: &mut watch::Receiver<bool>,
) -> std::io::Result<bool> {
    loop {
        let take = n.min(buf.len() as u64) as usize;
        buf.advance(take);
        n -= take as u64;
        if n == 0 {
            return Ok(true);
        }
        if !fill(reader, buf, stop).await? {
            return Ok(false);
        }
    }
}

async fn read_loop<R: AsyncRead + Unpin>(
    mut reader: R,
    conn: &Arc<Connection>,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) -> String {
    let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let budget = Arc::new(Semaphore::new((BYTE_BUDGET / BUDGET_UNIT) as usize));
    let header_len = limits.style.header_len();
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    loop {
        match fill_to(&mut reader, &mut buf, header_len, &mut stop).await {
            Ok(true) => {}
            Ok(false) => return "client closed the connection or the server is stopping".into(),
            Err(e) => return format!("read failed: {e}"),
        }
        let header = match RequestHeader::decode(&buf, limits.style) {
            Ok(Some(header)) => header,
            Ok(None) => unreachable!("fill_to guarantees a whole header"),
            Err(e) => {
                warn!("{e}: closing the connection");
                return e.to_string();
            }
        };
        buf.advance(header_len);
        if header.command == cmd::DISC {
            return "client sent NBD_CMD_DISC".into();
        }
        let verdict = validate(&header, &limits);
        let payload_len = header.payload_len(limits.style);
        let mut payload = None;
        let mut held_budget = None;
        if payload_len > 0 {
            if verdict.is_err() || payload_len > u64::from(MAX_PAYLOAD) {
                if limits.style == RequestStyle::Extended && payload_len > u64::from(u32::MAX) {
                    warn!(payload_len, "absurd payload length: closing the connection");
                    return "absurd payload length".into();
                }
                match discard(&mut reader, &mut buf, payload_len, &mut stop).await {
                    Ok(true) => {}
                    Ok(false) => return "connection ended inside a payload".into(),
                    Err(e) => return format!("read failed: {e}"),
                }
            } else {
                let Ok(permit) = Arc::clone(&budget)
                    .acquire_many_owned(budget_units(payload_len))
                    .await
                else {
                    return "budget closed".into();
                };
                match fill_to(&mut reader, &mut buf, payload_len as usize, &mut stop).await {
                    Ok(true) => {}
                    Ok(false) => return "connection ended inside a payload".into(),
                    Err(e) => return format!("read failed: {e}"),
                }
                payload = Some(buf.split_to(payload_len as usize).freeze());
                held_budget = Some(permit);
            }
        }
        let command = match verdict {
            Ok(command) => command,
            Err(error) => {
                warn!(
                    command = header.command,
                    flags = header.flags,
                    offset = header.offset,
                    length = header.length,
                    "refused request: {error}"
                );
                let message = format!("request refused: {error}");
                conn.send_error(header.cookie, header.offset, error, &message);
                continue;
            }
        };
        if let Command::Read { length, .. } = command {
            let Ok(permit) = Arc::clone(&budget)
                .acquire_many_owned(budget_units(u64::from(length)))
                .await
            else {
                return "budget closed".into();
            };
            held_budget = Some(permit);
        }
        let Ok(slot) = Arc::clone(&in_flight).acquire_owned().await else {
            return "in-flight limit closed".into();
        };
        let conn = Arc::clone(conn);
        tokio::spawn(async move {
            execute(
                &conn,
                header.cookie,
                header.offset,
                command,
                payload,
                held_budget,
            )
            .await;
            drop(slot);
        });
    }
}

async fn execute(
    conn: &Connection,
    cookie: u64,
    request_offset: u64,
    command: Command,
    payload: Option<Bytes>,
    budget: Option<OwnedSemaphorePermit>,
) {
    let backend = &conn.backend;
    match command {
        Command::Read { offset, length, df } => {
            read(conn, cookie, offset, length, df, budget).await
        }
        Command::Write {
            offset,
            length,
            fua,
        } => {
            let data = payload.unwrap_or_default();
            debug_assert_eq!(data.len(), length as usize);
            let result = if length == 0 {
                Ok(())
            } else {
                backend.write(offset, data, fua).await
            };
            drop(budget);
            conn.send_result(cookie, request_offset, result);
        }
        Command::Flush => conn.send_result(cookie, request_offset, backend.flush().await),
        Command::Trim {
            offset,
            length,
            fua,
        } => {
            let result = if length == 0 {
                Ok(())
            } else {
                backend.trim(offset, length, fua).await
            };
            conn.send_result(cookie, request_offset, result);
        }
        Command::Cache { offset, length } => {
            let result = if length == 0 {
                Ok(())
            } else {
                backend.cache(offset, length).await
            };
            conn.send_result(cookie, request_offset, result);
        }
        Command::WriteZeroes {
            offset,
            length,
            no_hole,
            fast,
            fua,
        } => {
            let flags = ZeroFlags {
                may_trim: !no_hole,
                fast,
                fua,
            };
            let result = if length == 0 {
                Ok(())
            } else {
                backend.write_zeroes(offset, length, flags).await
            };
            match result {
                Err(e) if e.errno == NbdError::NotSup => conn.send_error(
                    cookie,
                    request_offset,
                    NbdError::NotSup,
                    "zeroing would not be fast",
                ),
                other => conn.send_result(cookie, request_offset, other),
            }
        }
        Command::BlockStatus {
            offset,
            length,
            req_one,
        } => block_status(conn, cookie, offset, length, req_one).await,
        Command::Disconnect => unreachable!("the reader handles NBD_CMD_DISC"),
    }
}

async fn read(
    conn: &Connection,
    cookie: u64,
    offset: u64,
    length: u32,
    df: bool,
    budget: Option<OwnedSemaphorePermit>,
) {
    let enc = conn.encoder(cookie, offset);
    if length == 0 {
        conn.send_ok(cookie, offset);
        return;
    }
    let read = match conn.backend.read(offset, length as usize).await {
        Ok(read) => read,
        Err(e) => {
            warn!("{e}");
            conn.send_error(cookie, offset, e.errno, &e.to_string());
            return;
        }
    };
    if conn.reply_style == ReplyStyle::Simple
        || df
        || read.runs.len() <= 1 && !read.runs.first().is_some_and(|r| r.1)
    {
        let mut header = Vec::with_capacity(40);
        enc.data_header(&mut header, offset, u64::from(length), true);
        conn.send(header, Some(read.data), budget);
        return;
    }
    let mut at = 0usize;
    let last = read.runs.len() - 1;
    for (i, &(len, hole)) in read.runs.iter().enumerate() {
        let mut header = Vec::with_capacity(40);
        let chunk_offset = offset + at as u64;
        if hole {
            enc.hole(&mut header, chunk_offset, len as u32, i == last);
            conn.send(header, None, None);
        } else {
            enc.data_header(&mut header, chunk_offset, len as u64, i == last);
            conn.send(header, Some(read.data.slice(at..at + len)), None);
        }
        at += len;
    }
    // The budget covered the whole buffer; the slices above keep it alive, so release the
    // permit only after the last chunk is queued behind them.
    if let Some(budget) = budget {
        conn.send(Vec::new(), None, Some(budget));
    }
}

async fn block_status(conn: &Connection, cookie: u64, offset: u64, length: u64, req_one: bool) {
    let span = length.min(MAX_STATUS_SPAN);
    let extents = match conn.backend.extents(offset, span).await {
        Ok(extents) => extents,
        Err(e) => {
            warn!("{e}");
            conn.send_error(cookie, offset, e.errno, &e.to_string());
            return;
        }
    };
    let mut descriptors: Vec<(u64, u32)> = Vec::with_capacity(extents.len().min(1024));
    let mut covered = 0u64;
    for extent in extents {
        if covered >= span || extent.length == 0 {
            break;
        }
        let len = extent.length.min(span - covered);
        covered += len;
        descriptors.push((len, extent.status()));
        if req_one {
            break;
        }
    }
    if descriptors.is_empty() {
        descriptors.push((span, 0));
    }
    let mut header = Vec::with_capacity(40 + 16 * descriptors.len());
    conn.encoder(cookie, offset)
        .block_status(&mut header, BASE_ALLOCATION_ID, &descriptors, true);
    conn.send(header, None, None);
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
) {
    let mut batch: Vec<Outgoing> = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        if let Err(e) = write_batch(&mut writer, &batch).await {
            debug!("write failed: {e}");
            return;
        }
        batch.clear();
    }
    let _ = writer.shutdown().await;
}

async fn write_batch<W: AsyncWrite + Unpin>(
    writer: &mut W,
    batch: &[Outgoing],
) -> std::io::Result<()> {
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(batch.len() * 2);
    for message in batch {
        if !message.header.is_empty() {
            slices.push(IoSlice::new(&message.header));
        }
        if let Some(data) = &message.data {
            if !data.is_empty() {
                slices.push(IoSlice::new(data));
            }
        }
    }
    let mut remaining: &mut [IoSlice<'_>] = &mut slices;
    while !remaining.is_empty() {
        let n = writer.write_vectored(remaining).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut remaining, n);
    }
    writer.flush().await
}
