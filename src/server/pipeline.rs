//! The transmission phase of one connection, driven by a single task.
//!
//! One poll loop owns the socket, the requests in flight and the reply queue:
//!
//! * **read**: pull as many bytes as the socket holds into one buffer, parse every complete
//!   request in it, validate each at the edge, and start its backend future;
//! * **complete**: poll the futures in flight (`in_flight::InFlight`, whose slots keep their
//!   boxes and wakers for the requests after); requests finish in any order. A read the
//!   backend can serve without waiting (memory, a page-cache hit:
//!   [`Backend::read_at_once`]; data already spliced into a pipe) is answered as it is
//!   parsed, with no future at all;
//! * **write**: gather every queued reply into one vectored write.
//!
//! Adjacent reads parsed in the same batch are merged into one backend read of up to
//! `max_merge` bytes (sequential 4 KiB reads become one large read), and each request is
//! answered from its slice of the result.
//!
//! Large reads with chunked replies are split into pieces that run concurrently, and each
//! piece's data leaves as its own `OFFSET_DATA` chunk as soon as it is read, so a 32 MiB
//! read starts flowing early instead of arriving as one burst. Large writes go the other
//! way: each 1 MiB piece of the payload is handed to the backend as soon as it has arrived,
//! and the reply follows the last piece. When the backend keeps whole pages it can take
//! over (memory, [`crate::backend::PageStore`]), a page-aligned payload is received from
//! the socket straight into such pages, which are handed over as they fill.
//!
//! A connection whose client keeps few requests in flight spins briefly on its socket when it
//! has nothing to do (and at iodepth 1 one that waits on a single request polls the
//! backend's completions) before its task sleeps: on a VM the wake-ups cost more than the
//! spin (`idle_spin::IdleSpin` says when it is allowed).
//!
//! Memory is bounded per connection: at most [`MAX_IN_FLIGHT`] requests, about
//! [`BYTE_BUDGET`] bytes of payloads and unsent read data, and [`MAX_QUEUED_REPLIES`]
//! unsent replies; past any of them the socket is not read until replies drain, so a
//! client that stops reading stops being served.
//!
//! When the server stops, the requests in flight are answered, requests read meanwhile
//! get `NBD_ESHUTDOWN` (`Pipeline::refuse_for_shutdown`), and once nothing is in flight
//! the connection sends what is queued and ends its stream without a reset
//! ([`close_gently`]).

use std::collections::VecDeque;
use std::future::Future;
use std::io::IoSlice;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, BytesMut};
use rustix::io::Errno;
use smallvec::{smallvec, SmallVec};
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::sync::watch;
use tracing::{debug, warn};

use super::coalesce::{Coalesce, Gathered};
use super::flush_ahead::{FlushAhead, FlushVerdict};
use super::handshake::Negotiated;
use super::idle_spin::{CountedConnection, IdleSpin, SpinOutcome, CONNECTIONS};
use super::in_flight::InFlight;
use super::splice_probe::SpliceProbe;
use super::validate::{validate, Command, Limits};
use super::Stream;
use crate::backend::splice::Spliced;
use crate::backend::{Backend, BackendError, Pieces, ReadData, WriteData, ZeroFlags};
use crate::buffer::{Buffer, MIN_POOLED};
use crate::idle::Idle;
use crate::log_limit::{warn_limited, FAILED_REQUESTS, REFUSED_REQUESTS};
use crate::wire::transmission::{ReplyEncoder, ReplyStyle, RequestHeader, RequestStyle};
use crate::wire::{cmd, NbdError, BASE_ALLOCATION_ID, MAX_PAYLOAD};

/// Requests one connection may have in flight at once.
pub const MAX_IN_FLIGHT: usize = 1024;
/// Payload and unsent read-data bytes one connection may hold before it stops reading.
pub const BYTE_BUDGET: u64 = 256 * 1024 * 1024;
/// Replies queued but unsent before the connection stops reading: a client that sends
/// without reading cannot grow the queue past this, even with replies that carry no data.
pub const MAX_QUEUED_REPLIES: usize = 16 * 1024;
/// Reads longer than this are split into concurrent pieces, each sent as it completes.
/// Small enough that a piece is still in the CPU's cache when it is sent (with
/// `WRITE_AFTER_DATA`): measured on the memory export with fio at QD8, 2 MiB pieces
/// gave 2.7–3.1 GB/s for 32 MiB reads and 4.1 GB/s for 4 MiB reads, 512 KiB pieces
/// 3.8–4.0 and 5.1–5.7; 256 KiB and 1 MiB did no better.
pub const STREAM_PIECE: u32 = 512 * 1024;
/// Writes longer than this go to the backend a piece at a time as their payload arrives,
/// and the reply follows the last piece. Measured on the memory export with fio at QD8,
/// alternating runs: 32 MiB writes 3.9–4.0 GB/s whole, 4.1–4.7 in 512 KiB pieces, 4.8 in
/// 1 MiB pieces (with 28% less server CPU per byte: the payload is copied on while still
/// in cache); 1 MiB writes lost 10–20% when split in two, so pieces are 1 MiB.
pub const WRITE_PIECE: u32 = 1024 * 1024;

/// Ranges kept of the changes whose futures may not have started
/// ([`Pipeline::changes_not_started`]) before they stand for the whole export: the deepest
/// queue the benchmarks use.
const MAX_CHANGES_NOT_STARTED: usize = 256;
/// Once the replies collected in one round carry this much read data, they are written
/// before more requests are polled: a copied read fills its buffer when first polled, so
/// polling every ready read first left megabytes to fall out of the cache before `writev`
/// copied them again (1 MiB reads at QD8 on the memory export when it still copied: 4.3
/// GB/s without the limit, 5.5–5.7 with it). Memory and cached file reads are now sent
/// without a copy; direct-I/O and small cached reads still are copied.
const WRITE_AFTER_DATA: usize = 512 * 1024;
/// The least a read takes from the byte budget until its reply is sent, whatever its
/// length: what a short reply can keep alive while it waits in the queue (a memory
/// export's whole 64 KiB page, which a later write to it copies, or a pooled buffer of at
/// least a page). Counted at their length, 16,384 unread 1-byte replies held a gigabyte of
/// page copies and were counted as 16 KiB.
const MIN_READ_CHARGE: u64 = 64 * 1024;
/// A block-status query looks at most this far (keeps the reply small and 32-bit safe).
const MAX_STATUS_SPAN: u64 = (1 << 32) - (1 << 16);
/// A block-status reply describes at most this many extents (the spec lets it cover less
/// than asked), so its size is known when the request is admitted.
const MAX_STATUS_DESCRIPTORS: usize = crate::backend::MAX_EXTENTS;
/// What a block-status request takes from the byte budget until its reply is sent: the
/// largest reply (extended descriptors are 16 bytes, plus the chunk headers). A file of
/// alternating holes answered 512 KiB to 1 MiB a reply, and uncounted replies grew one
/// connection to gigabytes.
const STATUS_REPLY_BUDGET: u64 = 64 + 16 * MAX_STATUS_DESCRIPTORS as u64;
/// How long after the stop a connection is given at most once its socket has taken no
/// reply for [`DRAIN_TIMEOUT`]: a client that frees a segment of its window per period
/// would otherwise hold the stop for ever.
const MAX_DRAIN: std::time::Duration = std::time::Duration::from_secs(300);
/// How long a stopping server waits while a client's socket takes none of the replies
/// queued for it before it looks at the socket's send queue; if that did not shrink over
/// one more such period, the connection is closed (its requests still finish). A client
/// reading slowly, or waiting for a slow backend, is not cut off.
const DRAIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a connection that sent its last reply reads on at most, dropping what comes,
/// for the client to close its side ([`close_gently`]) ...
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);
/// ... and how long it waits for a client that sends nothing.
const QUIET: std::time::Duration = std::time::Duration::from_millis(50);
/// How often a closing connection looks at its send queue while replies still wait in it.
const DRAIN_POLL: std::time::Duration = std::time::Duration::from_millis(10);
/// Free room kept in the read buffer before each socket read.
const READ_ROOM: usize = 256 * 1024;
/// Most bytes read into the read buffer at once after a request with a payload of
/// [`LARGE_PAYLOAD`] or more, so that the next such payload is read into its own buffer
/// instead of being copied there from the read buffer (which took up to a quarter of each
/// payload). Measured with fio 1 MiB sequential writes at QD8, alternating with the
/// unlimited read, three runs of 3 rounds, MB/s: memory 4,845 → 5,475, 4,027 → 4,855,
/// 3,120 → 3,877; file 4,220 → 4,990, 4,047 → 4,635, 3,991 → 3,500 (noisy VM).
const READ_AFTER_LARGE_PAYLOAD: usize = 4096;
/// Payloads from this size on limit the next socket read ([`READ_AFTER_LARGE_PAYLOAD`]).
/// Smaller ones do not: the one read that brings in several 64 KiB writes is worth more
/// than the copy it saves. At 256 KiB the copy costs more: `perf` of fio 256 KiB writes at
/// QD8 to the memory export found 40–44% of the server's samples in user-space `memmove`
/// (each payload copied from the read buffer into pages or the export), 3% with the limit
/// from 256 KiB on (the kernel's copy, now into cold pages, took most of what was saved,
/// and the socket is read 12 times a write instead of 1.3). `bench/ab.py`, session 29, four
/// runs of 4–6 rounds, server CPU µs per 256 KiB write with the limit from 1 MiB against
/// from 256 KiB: file 77.4 / 79.2 / 80.7 / 77.9 against 66.0 / 68.6 / 80.0 / 72.4, memory
/// 56.2 / 59.5 / 60.4 against 55.0 / 54.1 / 59.1, direct 75.4 / 80.0 against 70.9 / 71.4;
/// IOPS level to 16% higher (file 12,475 / 12,286 / 12,209 / 12,292 against 14,455 /
/// 14,019 / 12,146 / 12,894), within this VM's noise (the same 1 MiB writes in both
/// builds differed by 12% in one run). From 64 KiB on, 64 KiB writes fell (memory 51.7k
/// against 54.0k, file 36.2k against 37.2k; on an earlier machine 2,984 to 2,084 MB/s).
const LARGE_PAYLOAD: u32 = 256 * 1024;
/// Most slices handed to one vectored write.
const MAX_IOVECS: usize = 512;
/// Most bytes handed to one vectored write (a slice that crosses the bound still goes
/// whole). Without a bound, eight 1 MiB memory reads answered with simple replies went out
/// in one `writev` of 8 MiB, and the client copying them out of its socket took 1,487–1,860
/// replies a second with 87% of its CPU in `_copy_to_iter` (fio's structured replies,
/// streamed in [`STREAM_PIECE`]s, 3,440 and 4,228 from the same server). Measured with
/// `ab.py`, 3 rounds, the load generator's sequential reads at iodepth 8 from memory, reads
/// a second without the bound against with it: 256 KiB 7,290 (6,905–7,408) against 10,159
/// (8,493–10,418), 1 MiB 1,732 (1,663–1,744) against 2,787 (2,397–3,689), 4 MiB 565
/// against 787 (but at 1,209 µs of server CPU a read against 791). fio's reads and the
/// file export's (spliced) within noise, but for the load generator's 4 MiB file reads:
/// 1,731 (1,726–1,828) against 1,546 (1,501–1,737). 128 KiB lost fio's 4 MiB memory reads
/// 16%; 256 KiB gained less at 1 MiB.
const WRITEV_MOST: usize = 512 * 1024;
/// Slices of one vectored write kept on the stack: a header and a data piece for each of
/// 32 replies (1 KiB); more spill to the heap.
const INLINE_IOVECS: usize = 64;
/// Poll-loop rounds before yielding to other connections on this worker.
const ROUNDS_BEFORE_YIELD: usize = 64;

/// One reply message: header bytes and optional data after them, either in memory or in a
/// pipe that the socket takes it from without a copy (`spliced`). When it has been
/// written, `release` bytes go back to the connection's budget.
struct Outgoing {
    header: ReplyHeader,
    data: Option<Pieces>,
    spliced: Option<Spliced>,
    /// Data still to be read, when the socket reaches it (into `spliced` or `data`).
    later: Option<Box<LaterPiece>>,
    release: u64,
}

/// A piece of a long read of cached data, read only when the socket has taken all that
/// goes before it: spliced into a pipe if it can be, else read by copying while the
/// messages behind it wait (see `Pipeline::stream_cached_read`). Boxed, so that every
/// other message stays small; the boxes are kept for the next pieces (`LaterPieces`).
struct LaterPiece {
    offset: u64,
    length: u32,
    /// With structured replies, the piece is a chunk of its own, whose header is written
    /// once its data is ready; with a simple reply it has no header.
    chunk: Option<ReplyEncoder>,
    /// The piece's read, once started: on the heap, since it holds the backend (a piece of
    /// a large read is rare next to the data it carries).
    reading: Option<PieceRead>,
}

/// A piece's read in flight.
type PieceRead = Pin<Box<dyn Future<Output = Result<ReadData, BackendError>> + Send>>;

/// Boxes of [`LaterPiece`]s whose pieces went out, kept for the next.
///
/// Measured reason: a new box for each later piece was all that a 1 MiB read of cached
/// data still allocated (1.001 per read in `tests/allocations.rs`, session 36).
#[derive(Default)]
struct LaterPieces {
    /// At most the later pieces of a 32 MiB read and then some.
    idle: Idle<Box<LaterPiece>, 64>,
}

impl LaterPieces {
    fn boxed(&mut self, piece: LaterPiece) -> Box<LaterPiece> {
        match self.idle.take() {
            Some(mut kept) => {
                *kept = piece;
                kept
            }
            None => Box::new(piece),
        }
    }

    /// Takes `message`'s later piece, now that its data is ready, and keeps its box.
    fn done(&mut self, message: &mut Outgoing) {
        let Some(mut later) = message.later.take() else {
            return;
        };
        // The piece's read, if it had one, has completed: its future goes now.
        later.reading = None;
        self.idle.keep(later);
    }
}

impl Outgoing {
    /// A message with its data (if any) in memory.
    fn new(header: ReplyHeader, data: Option<Pieces>, release: u64) -> Outgoing {
        Outgoing {
            header,
            data,
            spliced: None,
            later: None,
            release,
        }
    }

    fn data_len(&self) -> usize {
        match (&self.data, &self.spliced, &self.later) {
            (Some(data), _, _) => data.len(),
            (None, Some(spliced), _) => spliced.len(),
            (None, None, Some(later)) => later.length as usize,
            (None, None, None) => 0,
        }
    }

    /// Whether the message's data is not in memory: it waits in a pipe or is still to be
    /// read, so a vectored write ends after the message's header.
    fn data_apart(&self) -> bool {
        self.spliced.is_some() || self.later.is_some()
    }
}

/// A reply's header bytes: inline up to the 40 bytes of an extended `OFFSET_DATA` chunk
/// header, so that the reply to a read allocates nothing for it.
type ReplyHeader = smallvec::SmallVec<[u8; 40]>;

/// What one request's future answers: one message, or several (a read merged with
/// others, or sent as several chunks), inline for the common one.
type Replies = SmallVec<[Outgoing; 1]>;

/// What a request's future ends with: its replies, or a merged read with its result,
/// which the pipeline splits into each request's reply itself (see [`PartLists`]).
enum Finished {
    Replies(Replies),
    MergedRead(MergedRead, Result<ReadData, BackendError>),
    /// A piece of a streamed read: the pipeline makes its chunks, knowing from
    /// [`StreamedReads`] whether it is the last piece.
    ReadPiece(ReadPieceDone),
    /// A flush ahead of the client's (see [`FlushAhead`]): no reply.
    FlushedAhead(Result<(), BackendError>),
}

impl From<Replies> for Finished {
    fn from(replies: Replies) -> Finished {
        Finished::Replies(replies)
    }
}

/// Lists of a merged read's parts, emptied and kept for the next merges.
///
/// Measured reason: a new list for each merged read grew by doubling as its parts came
/// (4, 8, 16, 32: four allocations for 32 reads), and a read that completed later made
/// a list of replies for its parts, all freed again. Sequential 4 KiB reads at QD32
/// allocated 0.24 (page cache) and 0.38 (`--cache=none`) times per request
/// (`tests/allocations.rs`, session 36).
#[derive(Default)]
struct PartLists {
    /// At most as many merged reads as are usually in flight at once.
    idle: Idle<Vec<ReadPart>, 8>,
}

impl PartLists {
    fn take(&mut self) -> Vec<ReadPart> {
        self.idle.take().unwrap_or_default()
    }

    fn give_back(&mut self, list: Vec<ReadPart>) {
        if list.capacity() > 0 {
            self.idle.keep(list);
        }
    }
}

/// Runs the transmission phase until the client disconnects, breaks the protocol, or the
/// server stops; every request already read is answered before it returns, unless the
/// server is stopping and the client's socket takes no reply for [`DRAIN_TIMEOUT`], or the
/// request was refused after the stop and its payload had not all come when nothing else
/// was in flight.
/// `before_linger` frees the connection's client slot once the connection is done with
/// and its socket's send queue is empty, before the rest of its linger
/// ([`close_gently`]): a new client is not refused for up to [`LINGER`] after this one
/// was ended (found by review), and a socket still delivering replies keeps its place.
pub async fn run<S: Stream>(
    mut stream: S,
    negotiated: Negotiated,
    max_merge: u32,
    mut stop: watch::Receiver<bool>,
    before_linger: impl FnOnce(),
) {
    let counted = CountedConnection::new();
    let backend = Arc::clone(&negotiated.export.backend);
    let on_device = backend.poll_completions().is_some();
    let capabilities = backend.capabilities();
    let limits = Limits {
        size: backend.size(),
        read_only: capabilities.read_only,
        fast_zero: capabilities.fast_zero_offered(),
        style: negotiated.request_style,
        chunked_replies: negotiated.reply_style != ReplyStyle::Simple,
        base_allocation: negotiated.base_allocation,
    };
    let mut pipeline = Pipeline {
        backend,
        limits,
        reply_style: negotiated.reply_style,
        inbuf: BytesMut::with_capacity(READ_ROOM),
        reading: true,
        eof: false,
        ending: String::new(),
        disconnect_received: false,
        discard_left: 0,
        refusal_after_payload: None,
        awaiting_payload: None,
        in_flight: InFlight::default(),
        changes_not_started: Vec::new(),
        outq: VecDeque::new(),
        front_written: 0,
        held: 0,
        share: Default::default(),
        stop_seen: false,
        drain: None,
        drain_queued: None,
        drain_since: None,
        max_merge,
        merging: None,
        part_lists: PartLists::default(),
        streamed_reads: StreamedReads::default(),
        later_pieces: LaterPieces::default(),
        flush_ahead: FlushAhead::new(negotiated.export.backend.flush_ahead_pays()),
        spin: IdleSpin::new(),
        coalesce: Coalesce::default(),
        splice: stream.can_splice() && negotiated.export.backend.can_splice(),
        kernel_copies: stream.socket_fd().is_some(),
        splice_probe: SpliceProbe::default(),
        on_device,
        after_large_payload: false,
        tally: Default::default(),
        export: Arc::clone(&negotiated.export),
    };
    let mut stopped = Box::pin(async move {
        let _ = stop.wait_for(|s| *s).await;
    });
    let result = std::future::poll_fn(|cx| {
        let polled = pipeline.poll(cx, Pin::new(&mut stream), stopped.as_mut());
        // Once per poll, not per request: one shared add for all a read brought in.
        pipeline.tally.publish(&pipeline.export.stats);
        polled
    })
    .await;
    // How long the end may wait for replies still in the socket's send queue: not at all
    // once the socket failed or the client stopped reading them at a stop, else up to the
    // drain's bound, counted from the stop if there was one. Other errors (a failed read
    // after its reply's header went, a send from a mapping that faulted) leave a working
    // socket whose queued replies still deserve to arrive (found by review: a done
    // write's acknowledgement was lost to the reset).
    use std::io::ErrorKind;
    let give_up_at = match (&result, pipeline.drain_since) {
        (Err(e), _)
            if matches!(
                e.kind(),
                ErrorKind::TimedOut
                    | ErrorKind::ConnectionReset
                    | ErrorKind::ConnectionAborted
                    | ErrorKind::BrokenPipe
                    | ErrorKind::NotConnected
            ) =>
        {
            tokio::time::Instant::now()
        }
        (_, Some(since)) => since + MAX_DRAIN,
        (_, None) => tokio::time::Instant::now() + MAX_DRAIN,
    };
    let disconnected = pipeline.disconnect_received;
    match result {
        Ok(()) => debug!("{}", pipeline.ending),
        Err(e) => {
            // Only memory the kernel could not read makes a send fail so: a page of a
            // mapped file (see `Backend::mapped_send_failed`).
            if e.raw_os_error() == Some(Errno::FAULT.raw_os_error()) {
                pipeline.backend.mapped_send_failed(&e);
            }
            debug!("connection ended: {e}")
        }
    }
    // Requests already submitted run to their end even though no reply can be sent: a
    // write abandoned half-way would leave its range unlocked while the disk (or a
    // replica) still applies it, and a later overlapping write could overtake it.
    while pipeline.in_flight.next().await.is_some() {}
    // What the connection held (buffers, its share of the byte budget, its count among
    // the connections) goes before the linger.
    drop(pipeline);
    drop(counted);
    if disconnected {
        // NBD_CMD_DISC: the client sends nothing more, so closing cannot bring a reset,
        // and the kernel delivers what is queued after the close.
        before_linger();
        let _ = stream.shutdown().await;
        return;
    }
    close_gently(&mut stream, give_up_at, before_linger).await;
}

/// Ends a connection without losing replies: sends the end of the stream after them,
/// then reads and drops what the client still sends until it closes its side, until it
/// has sent nothing for [`QUIET`], or for at most [`LINGER`].
///
/// Why: closing a socket that holds unread bytes, or receiving bytes once closed, sends a
/// reset, and the reset discards every reply still in the socket's send queue. A client
/// that is sending when it comes fails too: libnbd, which sends while earlier replies
/// arrive, fails every command in flight on a failed send, replies received or not.
/// Found by review at a stop: a client with 48 replies of 1 MiB queued that sent 4 more
/// requests got 45 of them, then ECONNRESET; libnbd saw writes the server had done and
/// acknowledged fail with ENOTCONN (RESULTS, session 64: 35 in a run before, none with
/// this; 4–57 a run when the socket closed as soon as the replies were acknowledged).
/// A client that sends nothing is not waited for beyond [`QUIET`]: an idle libnbd handle
/// or qemu does not watch its socket, and waiting for it added 2 s to every stop.
///
/// Quiet counts only once the socket's send queue is empty (every reply acknowledged by
/// the client's kernel), and a client that sent anything since the end of the stream is
/// not taken for quiet at all: it has not read up to the end yet (it would have closed),
/// and a slow reader pauses between its reads. Closing in such a pause let its
/// next request bring the reset (found by review: a libnbd client reading through a
/// 64 KiB buffer got 38 of 40 reads and saw all 8 of its done writes fail). While replies
/// wait in the send queue, the connection is cut only when the queue has not shrunk for
/// [`DRAIN_TIMEOUT`] (the stop's own rule), or at `give_up_at`; it keeps its client slot
/// meanwhile, so lingering sockets stay within `--max-connections`. Once the queue is
/// empty, `leave_list` frees the slot, and the linger lasts at most [`LINGER`] more: a
/// client that sends without reading is cut then.
pub(super) async fn close_gently<S: Stream>(
    stream: &mut S,
    give_up_at: tokio::time::Instant,
    leave_list: impl FnOnce(),
) {
    let mut leave_list = Some(leave_list);
    let _ = stream.shutdown().await;
    let mut last_shrink = tokio::time::Instant::now();
    let mut queued_before = u32::MAX;
    let mut linger_until = None;
    let mut heard = false;
    let mut dropped = vec![0u8; 64 * 1024];
    let outcome = loop {
        let queued = stream
            .socket_fd()
            .and_then(crate::tcp::send_queue_bytes)
            .unwrap_or(0);
        let now = tokio::time::Instant::now();
        if queued < queued_before {
            last_shrink = now;
        }
        queued_before = queued;
        let deadline = if queued > 0 {
            (last_shrink + DRAIN_TIMEOUT).min(give_up_at)
        } else {
            if let Some(leave) = leave_list.take() {
                leave();
            }
            *linger_until.get_or_insert(now + LINGER)
        };
        let left = deadline.saturating_duration_since(now);
        if left.is_zero() {
            break "cut";
        }
        let wait = match (queued, heard) {
            (1.., _) => DRAIN_POLL,
            (0, true) => LINGER,
            (0, false) => QUIET,
        };
        match tokio::time::timeout(left.min(wait), stream.read(&mut dropped)).await {
            // Still sending: it has not yet seen the end of the stream.
            Ok(Ok(1..)) => heard = true,
            // Closed or failed.
            Ok(Ok(0) | Err(_)) => break "closed",
            // Quiet, with nothing left to deliver.
            Err(_) if queued == 0 => break "quiet",
            // Quiet, with replies still on their way: look at the queue again.
            Err(_) => {}
        }
    };
    if let Some(leave) = leave_list.take() {
        leave();
    }
    tracing::trace!("connection's linger ended: {outcome}");
}

/// A write whose payload is still arriving, and where it is gathered (`into`). Payloads
/// over [`WRITE_PIECE`] that go into a pooled buffer are gathered a piece at a time, and
/// each full piece is written to the backend while the rest of the payload still arrives
/// (`streamed`).
struct PendingPayload {
    header: RequestHeader,
    command: Command,
    into: PayloadInto,
    /// Payload bytes before the pooled buffer, already handed to the backend as pieces.
    sent: usize,
    streamed: Option<Arc<Mutex<StreamedWrite>>>,
}

/// Where a pending write's payload is gathered.
enum PayloadInto {
    /// Split off the read buffer once it is all there (payloads under [`MIN_POOLED`]).
    ReadBuffer,
    /// Read straight from the socket into a pooled buffer, with how much of it is filled.
    Pooled(Buffer, usize),
    /// Read straight into pages the backend takes over.
    Pages(PagedPayload),
}

/// A write payload received straight into pages of the backend's [`PageStore`], one page
/// at a time, each handed over once full.
///
/// One page per socket read, not several with one `readv`: the kernel copies into cold
/// pages with the socket locked, and the client's packets wait for the lock meanwhile.
/// Measured with fio 4 MiB writes at QD8 (memory export, two runs each, IOPS at server CPU
/// µs per write): 16 pages per read 773–809 at 790, 4 pages 897–908 at 768, 2 pages
/// 947–994 at 761–774, one page 999–1,054 at 753–781; the build before (copied from a
/// pooled buffer) 962–985 at 920–939.
///
/// [`PageStore`]: crate::backend::PageStore
struct PagedPayload {
    /// Where `page` goes.
    offset: u64,
    /// The page being filled; `None` once the whole payload is in place.
    page: Option<crate::backend::page_pool::PageBuf>,
    /// Bytes of `page` received.
    filled: usize,
    /// Payload bytes after `page`.
    after: usize,
}

impl PagedPayload {
    /// The first page of a payload of `length` bytes (a multiple of the page size) for
    /// `offset`.
    fn new(store: &dyn crate::backend::PageStore, offset: u64, length: usize) -> PagedPayload {
        PagedPayload {
            offset,
            page: Some(store.spare_page()),
            filled: 0,
            after: length - store.page_size(),
        }
    }

    /// What is left to receive of the page being filled.
    fn room(&mut self) -> &mut [u8] {
        let page = self.page.as_mut().expect("a page is being filled");
        &mut page[self.filled..]
    }

    /// Copies what `bytes` has of the page being filled into it; returns how much it took.
    fn fill_from(&mut self, bytes: &[u8]) -> usize {
        let room = self.room();
        let n = room.len().min(bytes.len());
        room[..n].copy_from_slice(&bytes[..n]);
        self.filled += n;
        n
    }

    /// Hands the page over once full and takes a spare one for the rest; true once the
    /// whole payload is in place.
    fn hand_over(&mut self, store: &dyn crate::backend::PageStore) -> bool {
        let page_size = store.page_size();
        if self.filled == page_size {
            let page = self.page.take().expect("a full page is being filled");
            store.adopt_page(self.offset, page);
            self.offset += page_size as u64;
            self.filled = 0;
            if self.after > 0 {
                self.page = Some(store.spare_page());
                self.after -= page_size;
            }
        }
        self.page.is_none()
    }
}

/// One client read inside a merged backend read.
struct ReadPart {
    enc: ReplyEncoder,
    offset: u64,
    length: u32,
    df: bool,
}

/// Adjacent reads gathered while parsing one batch, to be served by one backend read.
struct MergedRead {
    offset: u64,
    length: u32,
    /// The first read, and those that follow it (in a list from [`PartLists`]).
    first: ReadPart,
    more: Vec<ReadPart>,
}

struct Pipeline {
    /// Largest merged read (0: no merging).
    max_merge: u32,
    /// Reads gathered in the current parse batch, not yet started.
    merging: Option<MergedRead>,
    part_lists: PartLists,
    streamed_reads: StreamedReads,
    later_pieces: LaterPieces,
    backend: Arc<dyn Backend>,
    limits: Limits,
    reply_style: ReplyStyle,
    inbuf: BytesMut,
    /// Still taking requests (from the socket or from what is already buffered).
    reading: bool,
    /// The client closed its side: requests already buffered are still served.
    eof: bool,
    /// Once the server is stopping: fires when the socket has taken no reply bytes for
    /// [`DRAIN_TIMEOUT`] (reset by each write that makes progress).
    drain: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The socket's send queue when the drain deadline last fired (`None`: not looked at
    /// since the last write that made progress).
    drain_queued: Option<u32>,
    /// When the server began stopping.
    drain_since: Option<tokio::time::Instant>,
    /// Why reading stopped.
    ending: String,
    /// The client sent NBD_CMD_DISC: it sends nothing more.
    disconnect_received: bool,
    /// What this connection served since it last told its export ([`crate::metrics`]).
    tally: crate::metrics::Tally,
    /// The export, whose counts the tally goes to.
    export: Arc<super::Export>,
    /// Payload bytes of a refused request still to throw away.
    discard_left: u64,
    /// The refusal of that request, sent once its payload is skipped: libnbd files a
    /// command as in flight only once it has sent the payload, and a reply to one still
    /// being sent kills its handle ("no matching cookie", found by review), with every
    /// reply behind it unread. With it, whether the request was read before the stop
    /// (then its payload holds the stop as a write's does).
    refusal_after_payload: Option<(Outgoing, bool)>,
    /// A write whose header was parsed and whose payload is still arriving.
    awaiting_payload: Option<PendingPayload>,
    in_flight: InFlight<Finished>,
    /// The ranges (start, end) of writes, TRIMs and zeroings pushed to `in_flight` whose
    /// futures may not have been polled yet: they reach the export at their first poll,
    /// after the parse. A write that would land as it is parsed (inline, or received into
    /// the export's pages) over one of them waits its turn as a future instead, so that
    /// overlapping changes on one connection land in the order they came. Emptied once
    /// every future has been polled; past [`MAX_CHANGES_NOT_STARTED`] entries it stands
    /// for the whole export until then. This holds only while every change's future calls
    /// the backend before it first waits (the backend then lands or registers the change:
    /// memory, `backend::change_order`).
    changes_not_started: Vec<(u64, u64)>,
    outq: VecDeque<Outgoing>,
    /// Bytes of the front message already written.
    front_written: usize,
    /// Budget bytes held by admitted requests and unsent replies.
    held: u64,
    /// This connection's part of the server-wide budget (see [`super::budget`]).
    share: super::budget::BudgetShare,
    stop_seen: bool,
    /// Busy-polls the socket for a moment before sleeping (see [`IdleSpin`]).
    spin: IdleSpin,
    /// Naps before reading while that lets requests gather (see `super::coalesce`).
    coalesce: Coalesce,
    /// The socket takes read data straight from a pipe, and the backend can put read data
    /// into one ([`Backend::read_to_pipe`]). Cleared if the socket refuses a splice.
    splice: bool,
    /// The stream is a kernel socket, whose `writev` the kernel copies from our memory:
    /// cached reads of a page or more that are not spliced are copied into it from the
    /// backend's mapping of its file ([`Backend::read_mapped`]). Never a stream that reads
    /// the bytes in user space, where a page that cannot be read back would be a `SIGBUS`
    /// instead of that one `writev`'s `EFAULT`.
    kernel_copies: bool,
    /// Whether this client takes spliced or copied large reads faster (see
    /// `super::splice_probe`).
    splice_probe: SpliceProbe,
    /// The backend is a device whose completions can be polled (`poll_completions`), not
    /// a layer such as replication over one.
    on_device: bool,
    /// The last request parsed carried a payload of [`LARGE_PAYLOAD`] bytes or more.
    after_large_payload: bool,
    /// Syncs a lone write as soon as it is answered when the client follows each write
    /// with a FLUSH.
    flush_ahead: FlushAhead,
}

impl Pipeline {
    fn encoder(&self, cookie: u64, offset: u64) -> ReplyEncoder {
        ReplyEncoder {
            style: self.reply_style,
            cookie,
            offset,
        }
    }

    fn stop_reading(&mut self, why: impl Into<String>) {
        if self.reading {
            self.reading = false;
            self.ending = why.into();
        }
    }

    /// Every request read so far is answered and its reply written, and the connection
    /// is between requests (no payload half read) and not stopping.
    fn all_answered(&self) -> bool {
        self.reading
            && !self.stop_seen
            && !self.eof
            && self.in_flight.is_empty()
            && self.outq.is_empty()
            && self.discard_left == 0
            && self.awaiting_payload.is_none()
    }

    fn can_admit(&mut self) -> bool {
        self.in_flight.len() < MAX_IN_FLIGHT
            && self.held < BYTE_BUDGET
            && self.outq.len() < MAX_QUEUED_REPLIES
            && self.share.may_admit(self.held)
    }

    fn queue_error(&mut self, header: &RequestHeader, error: NbdError) {
        self.tally.refused();
        warn_limited!(
            REFUSED_REQUESTS,
            command = header.command,
            flags = header.flags,
            offset = header.offset,
            length = header.length,
            "refused request: {error}"
        );
        self.queue_error_reply(header, error, &format!("request refused: {error}"));
    }

    /// Queues an error reply to `header`, or holds it until the request's payload is
    /// skipped ([`Pipeline::skip_payload`] comes first).
    fn queue_error_reply(&mut self, header: &RequestHeader, error: NbdError, message: &str) {
        let mut bytes = ReplyHeader::new();
        self.encoder(header.cookie, header.offset)
            .error(&mut bytes, error, message);
        let reply = Outgoing::new(bytes, None, 0);
        if self.discard_left > 0 {
            self.refusal_after_payload = Some((reply, !self.stop_seen));
        } else {
            self.outq.push_back(reply);
        }
    }

    /// Skips the `payload_len` bytes of a refused request's payload as they come; `Err`
    /// for one too long to skip (an extended header's length beyond 4 GiB).
    fn skip_payload(&mut self, payload_len: u64) -> Result<(), String> {
        if self.limits.style == RequestStyle::Extended && payload_len > u64::from(u32::MAX) {
            warn!(payload_len, "absurd payload length: closing the connection");
            return Err("absurd payload length".into());
        }
        self.discard_left = payload_len;
        Ok(())
    }

    /// Answers a request read after the server began stopping with `NBD_ESHUTDOWN`, and
    /// skips its payload; `Err` for a payload too long to skip.
    ///
    /// The spec: a stopping server SHOULD answer the requests in flight before it
    /// disconnects, and the error for requests received meanwhile SHOULD be
    /// `NBD_ESHUTDOWN`, on which the client MUST disconnect. So the connection reads on
    /// while requests are in flight and refuses what it reads; once none is, it stops
    /// reading (in `poll`), sends what is queued and closes ([`close_gently`]). Before,
    /// the requests read after the stop got no reply at all.
    fn refuse_for_shutdown(&mut self, header: &RequestHeader) -> Result<(), String> {
        self.skip_payload(header.payload_len(self.limits.style))?;
        debug!(
            command = header.command,
            offset = header.offset,
            length = header.length,
            "refused request: the server is stopping"
        );
        self.tally.refused();
        self.queue_error_reply(header, NbdError::Shutdown, "the server is stopping");
        Ok(())
    }

    /// Parses and admits every complete request in the buffer that the limits allow.
    /// `Err` means the stream cannot be parsed any further.
    fn parse(&mut self) -> Result<(), String> {
        let parsed = self.parse_batch();
        self.start_merged_read();
        parsed
    }

    /// Starts the reads gathered for merging, as one backend read. A backend that reads at
    /// once ([`Backend::read_at_once`]) is answered here: the replies are queued without a
    /// future. A boxed future, a task in `in_flight` and a boxed backend future per read
    /// were 6% of the server's CPU per 4 KiB memory read at iodepth 32 (3.36 against
    /// 3.17 µs, three runs each), and for page-cache hits of a file export 7% (4.02
    /// against 3.72 µs, with spliced reads queued at once as well).
    fn start_merged_read(&mut self) {
        let Some(merged) = self.merging.take() else {
            return;
        };
        if let Some(mapped) = self.read_mapped(merged.offset, merged.length) {
            self.merged_replies(merged, Ok(mapped));
            return;
        }
        if let Some(result) = self
            .backend
            .read_at_once(merged.offset, merged.length as usize)
        {
            self.merged_replies(merged, result);
            return;
        }
        let backend = Arc::clone(&self.backend);
        self.in_flight.push(async move {
            let result = backend
                .read_declined(merged.offset, merged.length as usize)
                .await;
            Finished::MergedRead(merged, result)
        });
    }

    /// Queues the replies to a merged read's requests, and keeps its list of parts. A
    /// merged read that failed is read again request by request, so that each request gets
    /// its own answer: a bad sector fails the reads of it, not its neighbours merged with
    /// them.
    fn merged_replies(&mut self, merged: MergedRead, result: Result<ReadData, BackendError>) {
        if result.is_err() && !merged.more.is_empty() {
            self.read_parts_alone(merged);
            return;
        }
        let parts = merged_replies(merged, result, &mut self.outq);
        self.part_lists.give_back(parts);
    }

    /// Starts a backend read for each request of `merged`, each answered on its own.
    fn read_parts_alone(&mut self, merged: MergedRead) {
        let MergedRead {
            first, mut more, ..
        } = merged;
        for part in std::iter::once(first).chain(more.drain(..)) {
            let alone = MergedRead {
                offset: part.offset,
                length: part.length,
                first: part,
                more: self.part_lists.take(),
            };
            let backend = Arc::clone(&self.backend);
            self.in_flight.push(async move {
                let result = backend.read(alone.offset, alone.length as usize).await;
                Finished::MergedRead(alone, result)
            });
        }
        self.part_lists.give_back(more);
    }

    fn parse_batch(&mut self) -> Result<(), String> {
        loop {
            if self.discard_left > 0 {
                let n = self.discard_left.min(self.inbuf.len() as u64);
                self.inbuf.advance(n as usize);
                self.discard_left -= n;
                if self.discard_left > 0 {
                    return Ok(());
                }
                if let Some((refusal, _)) = self.refusal_after_payload.take() {
                    self.outq.push_back(refusal);
                }
            }
            if let Some(mut pending) = self.awaiting_payload.take() {
                let need = pending.header.length as usize;
                let payload = match std::mem::replace(&mut pending.into, PayloadInto::ReadBuffer) {
                    PayloadInto::Pages(mut paged) => {
                        let taken = paged.fill_from(&self.inbuf);
                        self.inbuf.advance(taken);
                        let store = self
                            .backend
                            .page_store()
                            .expect("paged payloads need a store");
                        if !paged.hand_over(store) {
                            // More of the payload may wait in the read buffer than the page
                            // being filled took.
                            let more_buffered = !self.inbuf.is_empty();
                            pending.into = PayloadInto::Pages(paged);
                            self.awaiting_payload = Some(pending);
                            if more_buffered {
                                continue;
                            }
                            return Ok(());
                        }
                        let enc = self.encoder(pending.header.cookie, pending.header.offset);
                        let release = pending.header.length;
                        self.outq.push_back(status_message(enc, Ok(()), release));
                        continue;
                    }
                    PayloadInto::Pooled(mut buffer, mut filled) => {
                        let want = buffer.len();
                        let n = (want - filled).min(self.inbuf.len());
                        buffer.as_mut()[filled..filled + n].copy_from_slice(&self.inbuf[..n]);
                        self.inbuf.advance(n);
                        filled += n;
                        if filled < want {
                            pending.into = PayloadInto::Pooled(buffer, filled);
                            self.awaiting_payload = Some(pending);
                            return Ok(());
                        }
                        if pending.streamed.is_some() {
                            // A full piece of a streamed write goes to the backend now.
                            self.start_write_piece(&pending, buffer.share().into());
                            pending.sent += want;
                            if pending.sent < need {
                                let next = (need - pending.sent).min(WRITE_PIECE as usize);
                                pending.into = PayloadInto::Pooled(Buffer::take(next), 0);
                                self.awaiting_payload = Some(pending);
                            }
                            continue;
                        }
                        buffer.share().into()
                    }
                    PayloadInto::ReadBuffer if self.inbuf.len() < need => {
                        self.inbuf.reserve(need - self.inbuf.len());
                        self.awaiting_payload = Some(pending);
                        return Ok(());
                    }
                    PayloadInto::ReadBuffer => self.inbuf.split_to(need).freeze().into(),
                };
                self.admit(pending.header, pending.command, Some(payload));
                continue;
            }
            let header_len = self.limits.style.header_len();
            // After the stop every request is refused, which takes no budget: what the
            // read buffer holds is answered (up to the reply queue's bound).
            let room = if self.stop_seen {
                self.outq.len() < MAX_QUEUED_REPLIES
            } else {
                self.can_admit()
            };
            if !self.reading || !room || self.inbuf.len() < header_len {
                return Ok(());
            }
            let header = match RequestHeader::decode(&self.inbuf, self.limits.style) {
                Ok(Some(header)) => header,
                Ok(None) => return Ok(()),
                Err(e) => {
                    warn!("{e}: closing the connection");
                    return Err(e.to_string());
                }
            };
            self.inbuf.advance(header_len);
            self.spin.request();
            let moves_data = matches!(header.command, cmd::READ | cmd::WRITE);
            self.coalesce
                .request(if moves_data { header.length } else { 0 });
            self.after_large_payload =
                header.payload_len(self.limits.style) >= u64::from(LARGE_PAYLOAD);
            if header.command == cmd::DISC {
                self.disconnect_received = true;
                self.stop_reading("client sent NBD_CMD_DISC");
                return Ok(());
            }
            if self.stop_seen {
                self.refuse_for_shutdown(&header)?;
                continue;
            }
            let verdict = validate(&header, &self.limits);
            if let Ok(command) = &verdict {
                self.flush_ahead.request(command);
                self.tally.accepted(header.command, header.length);
            }
            let payload_len = header.payload_len(self.limits.style);
            if payload_len > 0 {
                match verdict {
                    Ok(command) if payload_len <= u64::from(MAX_PAYLOAD) => {
                        self.held += payload_len;
                        if self.write_inline(&header, &command) {
                            continue;
                        }
                        if let Some(paged) = self.paged_payload(&command) {
                            self.awaiting_payload = Some(PendingPayload {
                                header,
                                command,
                                into: PayloadInto::Pages(paged),
                                sent: 0,
                                streamed: None,
                            });
                            continue;
                        }
                        // Every byte of a pooled buffer is overwritten by the payload
                        // before it is used.
                        let len = payload_len as usize;
                        let streamed = (len > WRITE_PIECE as usize).then(|| {
                            Arc::new(Mutex::new(StreamedWrite {
                                left: payload_len.div_ceil(u64::from(WRITE_PIECE)) as u32,
                                error: None,
                            }))
                        });
                        let first = if streamed.is_some() {
                            WRITE_PIECE as usize
                        } else {
                            len
                        };
                        let into = if len >= MIN_POOLED || self.backend.wants_pooled_payloads() {
                            PayloadInto::Pooled(Buffer::take(first), 0)
                        } else {
                            PayloadInto::ReadBuffer
                        };
                        self.awaiting_payload = Some(PendingPayload {
                            header,
                            command,
                            into,
                            sent: 0,
                            streamed,
                        });
                    }
                    other => {
                        self.skip_payload(payload_len)?;
                        self.queue_error(&header, other.err().unwrap_or(NbdError::Inval));
                    }
                }
                continue;
            }
            match verdict {
                Ok(command) => self.admit(header, command, None),
                Err(error) => self.queue_error(&header, error),
            }
        }
    }

    /// Starts writing one full piece of a streamed write; the piece that completes last
    /// sends the reply.
    fn start_write_piece(&mut self, pending: &PendingPayload, data: WriteData) {
        let (Command::Write { offset, fua, .. }, Some(shared)) =
            (pending.command, &pending.streamed)
        else {
            unreachable!("only streamed writes come in pieces")
        };
        let backend = Arc::clone(&self.backend);
        let enc = self.encoder(pending.header.cookie, pending.header.offset);
        let shared = Arc::clone(shared);
        let at = offset + pending.sent as u64;
        let release = pending.header.length;
        self.change_not_started(at, data.len() as u64);
        self.in_flight.push(async move {
            let result = backend.write(at, data, fua).await;
            Finished::from(write_piece_done(enc, result, release, &shared))
        });
    }

    /// A read too long for one pipe, when all of it is in the page cache
    /// ([`Backend::all_cached`]): its first piece is spliced now and goes out behind its
    /// header, and each of the others is spliced only when the socket has taken everything
    /// before it ([`LaterPiece`]), so the read holds one pipe at a time however long it is.
    /// With structured replies each piece is a chunk, and a final chunk follows them. Returns
    /// false, with nothing queued, when the read is to be read whole or in pieces through
    /// the backend instead.
    ///
    /// A simple reply cannot be cut into chunks, and its error must come before its data:
    /// the cache check is what lets the header go out first. Should a later piece fail to
    /// read after all (its pages evicted meanwhile, then a device error), the connection
    /// is closed, as the reply has already said there was no error (for structured replies
    /// too: their final chunk is queued with the pieces). The pieces are of equal length,
    /// whole pages but the last, and at most [`STREAM_PIECE`]: a short last piece would be
    /// below what a backend splices.
    ///
    /// Measured reason: ARCHITECTURE.md, "Cached file reads leave without a copy".
    fn stream_cached_read(&mut self, enc: ReplyEncoder, offset: u64, length: u32) -> bool {
        if !self.splicing() || !self.backend.all_cached(offset, u64::from(length)) {
            return false;
        }
        let chunked = self.reply_style != ReplyStyle::Simple;
        let pieces = length.div_ceil(STREAM_PIECE);
        let piece = length.div_ceil(pieces).next_multiple_of(4096);
        let Some(first) = self.read_to_pipe(offset, piece) else {
            return false;
        };
        // A simple reply's header carries no length; a chunk's is the piece's.
        let first = spliced_reply(enc, offset, first, !chunked, u64::from(piece));
        self.outq.push_back(first);
        let mut start = piece;
        while start < length {
            let len = (length - start).min(piece);
            self.outq.push_back(Outgoing {
                header: ReplyHeader::new(),
                data: None,
                spliced: None,
                later: Some(self.later_pieces.boxed(LaterPiece {
                    offset: offset + u64::from(start),
                    length: len,
                    chunk: chunked.then_some(enc),
                    reading: None,
                })),
                release: u64::from(len),
            });
            start += piece;
        }
        if chunked {
            self.outq.push_back(read_done_message(enc));
        }
        true
    }

    /// The data of a read put into a pipe for the socket to take without a copy, when the
    /// socket and the backend can do that now (page-cache data; see `backend::splice`).
    fn read_to_pipe(&self, offset: u64, length: u32) -> Option<Spliced> {
        if !self.splicing() {
            return None;
        }
        self.backend.read_to_pipe(offset, length as usize)
    }

    /// A cached read (a page or more) as part of the backend's mapping of its file, for the socket's
    /// `writev` to copy straight from the page cache (one copy instead of two: the page
    /// cache into a buffer, the buffer into the socket), when the socket is one the kernel
    /// copies into and the whole range is cached. Measured reason: ARCHITECTURE.md, "Cached
    /// file reads copied once, from a mapping".
    fn read_mapped(&self, offset: u64, length: u32) -> Option<ReadData> {
        if !self.kernel_copies {
            return None;
        }
        self.backend.read_mapped(offset, length as usize)
    }

    /// Whether cached reads are spliced now: the socket takes splices, and this client
    /// has not been measured to take copies faster.
    fn splicing(&self) -> bool {
        self.splice && self.splice_probe.splicing()
    }

    /// Serves a write whose payload is already whole in the read buffer at once, when the
    /// backend can write without waiting on a device ([`Backend::write_inline`]): the
    /// payload is copied from the read buffer straight into place and the reply queued.
    /// Returns false, with nothing consumed, when the write must go the usual way.
    ///
    /// Measured reason: a 64 KiB memory write was copied three times (socket → read
    /// buffer → pooled buffer → page), and user-space `memmove` was 43.9% of the server's
    /// samples (fio, QD8); nbdkit copies twice. Inline, against the build before
    /// (`bench/ab.py`, 3 rounds, IOPS at server CPU µs per write): 64 KiB memory 62.2k at
    /// 15.6 against 50.9k at 17.9 (nbdkit 59.0k; a 5-round rerun: 48.6k at 16.8 against
    /// 44.5k at 18.5, both with slow rounds that the client's bbr causes); 256 KiB memory
    /// 14.3k at 59.0 against 13.1k at 65.8 (nbdkit 13.0k); 4 KiB random writes at QD32,
    /// memory 3.80 against 3.96 µs and page cache 4.30 against 4.68. FUA writes, direct I/O
    /// and writes a replica must also take still go through [`Backend::write`].
    fn write_inline(&mut self, header: &RequestHeader, command: &Command) -> bool {
        let &Command::Write {
            offset,
            length,
            fua,
        } = command
        else {
            return false;
        };
        let len = length as usize;
        if length == 0 || len > WRITE_PIECE as usize || self.inbuf.len() < len {
            return false;
        }
        if self.over_a_change_not_started(offset, u64::from(length)) {
            return false;
        }
        let Some(result) = self.backend.write_inline(offset, &self.inbuf[..len], fua) else {
            return false;
        };
        self.inbuf.advance(len);
        let enc = self.encoder(header.cookie, header.offset);
        self.outq
            .push_back(status_message(enc, result, u64::from(length)));
        true
    }

    /// A write whose payload is to be received straight into the backend's pages: one of
    /// [`MIN_POOLED`] bytes or more, page-aligned at both ends, to a backend with a
    /// [`PageStore`](crate::backend::PageStore). Its first page is taken now.
    fn paged_payload(&mut self, command: &Command) -> Option<PagedPayload> {
        let &Command::Write { offset, length, .. } = command else {
            return None;
        };
        // The store is taken again at the end: its borrow of the backend cannot live
        // across the `&mut self` check below.
        let page_size = self.backend.page_store()?.page_size();
        let aligned = offset % page_size as u64 == 0 && length as usize % page_size == 0;
        if !aligned || (length as usize) < MIN_POOLED {
            return None;
        }
        // Its pages are handed over as they fill, during the parse.
        if self.over_a_change_not_started(offset, u64::from(length)) {
            return None;
        }
        let store = self.backend.page_store()?;
        Some(PagedPayload::new(store, offset, length as usize))
    }

    /// Whether `[offset, offset + length)` overlaps a change pushed to `in_flight` that
    /// may not have started yet ([`Pipeline::changes_not_started`]).
    fn over_a_change_not_started(&mut self, offset: u64, length: u64) -> bool {
        if self.changes_not_started.is_empty() {
            return false;
        }
        if !self.in_flight.any_unpolled() {
            self.changes_not_started.clear();
            return false;
        }
        let end = offset.saturating_add(length);
        self.changes_not_started
            .iter()
            .any(|&(start, stop)| start < end && offset < stop)
    }

    /// Notes a change about to be pushed to `in_flight` ([`Pipeline::changes_not_started`]).
    /// A list grown long (futures left unpolled at the end of every round, as when each
    /// round stops at [`WRITE_AFTER_DATA`] of read data) becomes one range over the whole
    /// export, so that it stays short and no write lands at parse time until it is emptied.
    fn change_not_started(&mut self, offset: u64, length: u64) {
        const WHOLE_EXPORT: (u64, u64) = (0, u64::MAX);
        if length == 0 || self.changes_not_started.first() == Some(&WHOLE_EXPORT) {
            return;
        }
        if self.changes_not_started.len() >= MAX_CHANGES_NOT_STARTED {
            self.changes_not_started.clear();
            self.changes_not_started.push(WHOLE_EXPORT);
            return;
        }
        self.changes_not_started
            .push((offset, offset.saturating_add(length)));
    }

    /// Starts a validated request. A write's payload budget was taken when its header was
    /// parsed; a read's is taken here.
    fn admit(&mut self, header: RequestHeader, command: Command, payload: Option<WriteData>) {
        match command {
            Command::Write { offset, length, .. } => {
                self.change_not_started(offset, u64::from(length));
            }
            Command::Trim { offset, length, .. } | Command::WriteZeroes { offset, length, .. } => {
                self.change_not_started(offset, length);
            }
            _ => {}
        }
        let backend = Arc::clone(&self.backend);
        let cookie = header.cookie;
        let offset = header.offset;
        let enc = self.encoder(cookie, offset);
        match command {
            Command::Read { offset, length, df } => {
                self.held += read_charge(length);
                if self.splice {
                    self.splice_probe.read(length, std::time::Instant::now);
                }
                let pieces =
                    if self.reply_style != ReplyStyle::Simple && !df && length > STREAM_PIECE {
                        length.div_ceil(STREAM_PIECE)
                    } else {
                        1
                    };
                if length == 0 {
                    // Nothing to read: answered as parsed, with a read's reply.
                    self.outq.push_back(read_done_message(enc));
                    return;
                }
                if !df && length > STREAM_PIECE && self.stream_cached_read(enc, offset, length) {
                    return;
                }
                if pieces == 1 {
                    if let Some(spliced) = self.read_to_pipe(offset, length) {
                        // In the pipe already: the reply is ready as it is parsed.
                        let reply = spliced_reply(enc, offset, spliced, true, read_charge(length));
                        self.outq.push_back(reply);
                        return;
                    }
                    let part = ReadPart {
                        enc,
                        offset,
                        length,
                        df,
                    };
                    if let Some(merged) = &mut self.merging {
                        let adjacent = merged.offset + u64::from(merged.length) == offset;
                        if adjacent && merged.length.saturating_add(length) <= self.max_merge {
                            merged.length += length;
                            merged.more.push(part);
                            return;
                        }
                    }
                    self.start_merged_read();
                    self.merging = Some(MergedRead {
                        offset,
                        length,
                        first: part,
                        more: self.part_lists.take(),
                    });
                    return;
                }
                let stream = self.streamed_reads.start(pieces);
                for piece in 0..pieces {
                    let start = u64::from(piece) * u64::from(STREAM_PIECE);
                    let len = (u64::from(length) - start).min(u64::from(STREAM_PIECE)) as u32;
                    let backend = Arc::clone(&backend);
                    let spliced = self.read_to_pipe(offset + start, len);
                    let mapped = match spliced {
                        Some(_) => None,
                        None => self.read_mapped(offset + start, len),
                    };
                    self.in_flight.push(async move {
                        let data = match (spliced, mapped) {
                            (Some(spliced), _) => Ok(PieceData::Spliced(spliced)),
                            (None, Some(mapped)) => Ok(PieceData::Read(mapped)),
                            (None, None) => backend
                                .read(offset + start, len as usize)
                                .await
                                .map(PieceData::Read),
                        };
                        Finished::ReadPiece(ReadPieceDone {
                            stream,
                            enc,
                            offset: offset + start,
                            length: len,
                            data,
                        })
                    });
                }
            }
            Command::Write {
                offset,
                length,
                fua,
            } => {
                let data = payload.unwrap_or_default();
                let release = data.len() as u64;
                self.in_flight.push(async move {
                    let result = if length == 0 {
                        Ok(())
                    } else {
                        backend.write(offset, data, fua).await
                    };
                    Finished::from(status_reply(enc, result, release))
                });
            }
            Command::Flush => {
                match self.flush_ahead.flush(enc) {
                    FlushVerdict::Flush => {}
                    FlushVerdict::Fail(failed) => {
                        self.outq.push_back(status_message(enc, Err(failed), 0));
                        return;
                    }
                    FlushVerdict::Wait => return,
                }
                self.in_flight.push(flush(backend, FlushFor::Client(enc)));
            }
            Command::Trim {
                offset,
                length,
                fua,
            } => self.in_flight.push(async move {
                let result = if length == 0 {
                    Ok(())
                } else {
                    backend.trim(offset, length, fua).await
                };
                Finished::from(status_reply(enc, result, 0))
            }),
            Command::Cache { offset, length } => self.in_flight.push(async move {
                let result = if length == 0 {
                    Ok(())
                } else {
                    backend.cache(offset, length).await
                };
                Finished::from(status_reply(enc, result, 0))
            }),
            Command::WriteZeroes {
                offset,
                length,
                no_hole,
                fast,
                fua,
            } => self.in_flight.push(async move {
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
                Finished::from(status_reply(enc, result, 0))
            }),
            Command::BlockStatus {
                offset,
                length,
                req_one,
            } => {
                self.held += STATUS_REPLY_BUDGET;
                self.in_flight.push(async move {
                    Finished::from(block_status(&*backend, enc, offset, length, req_one).await)
                })
            }
            Command::Disconnect => unreachable!("the parser handles NBD_CMD_DISC"),
        }
    }

    /// Writes queued replies until the socket is full or the queue is empty: headers and
    /// in-memory data gathered into vectored writes, data held in a pipe spliced into the
    /// socket after its header.
    fn poll_write<S: Stream + ?Sized>(
        &mut self,
        cx: &mut Context<'_>,
        mut stream: Pin<&mut S>,
    ) -> Poll<std::io::Result<bool>> {
        let mut wrote = false;
        while let Some(front) = self.outq.front_mut() {
            if front.later.is_some() && self.front_written >= front.header.len() {
                // `self.splicing()`, field by field: `front` borrows `self.outq`.
                let splice = self.splice && self.splice_probe.splicing();
                let (backend, kernel_copies) = (&self.backend, self.kernel_copies);
                let boxes = &mut self.later_pieces;
                match poll_later_piece(backend, splice, kernel_copies, front, boxes, cx) {
                    Poll::Ready(Ok(())) => continue,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending if wrote => return Poll::Ready(Ok(true)),
                    Poll::Pending => return Poll::Pending,
                }
            }
            if front.spliced.is_some() && self.front_written >= front.header.len() {
                let Some(spliced) = front.spliced.as_mut() else {
                    unreachable!("checked above")
                };
                let n = match stream.poll_splice(cx, spliced.fd(), spliced.left()) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                    }
                    Poll::Ready(Ok(n)) => n,
                    Poll::Ready(Err(e))
                        if spliced.left() == spliced.len()
                            && e.raw_os_error().is_some_and(splice_unsupported) =>
                    {
                        // This socket cannot take a splice after all: copy this reply's
                        // data out of the pipe, and copy every later read.
                        debug!("splice into the socket failed ({e}): copying replies instead");
                        self.splice = false;
                        let spliced = front.spliced.take().expect("checked above");
                        front.data = Some(spliced.drain()?.into());
                        continue;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending if wrote => return Poll::Ready(Ok(true)),
                    Poll::Pending => return Poll::Pending,
                };
                spliced.consumed(n);
                self.consume(n);
                wrote = true;
                continue;
            }
            // Kept on the stack for the common batch (17 replies a `writev` at 4 KiB QD32,
            // session 30), so a write allocates nothing.
            let mut slices: SmallVec<[IoSlice<'_>; INLINE_IOVECS]> = SmallVec::new();
            let mut skip = self.front_written;
            // Whether the batch ends with the header of a message whose data waits in a pipe.
            let mut splice_follows = false;
            // Headers and data pieces in order, as many as one `writev` takes (up to
            // `MAX_IOVECS` slices and `WRITEV_MOST` bytes); a message whose data waits in a
            // pipe ends the batch after its header.
            let mut gathered_bytes = 0;
            'gather: for message in &self.outq {
                let pieces = if message.data_apart() {
                    None
                } else {
                    message.data.as_ref().map(Pieces::slices)
                };
                for part in std::iter::once(&message.header[..]).chain(pieces.into_iter().flatten())
                {
                    if skip >= part.len() {
                        skip -= part.len();
                        continue;
                    }
                    slices.push(IoSlice::new(&part[skip..]));
                    gathered_bytes += part.len() - skip;
                    skip = 0;
                    if slices.len() == MAX_IOVECS || gathered_bytes >= WRITEV_MOST {
                        break 'gather;
                    }
                }
                if message.data_apart() {
                    splice_follows = true;
                    break;
                }
            }
            if slices.is_empty() {
                // Only empty messages are queued: retire them.
                drop(slices);
                self.consume(0);
                continue;
            }
            // The spliced data follows the header at once: `MSG_MORE` keeps the header
            // out of a segment of its own (with TCP_NODELAY every write is pushed).
            let written = if splice_follows {
                stream.poll_write_more(cx, &slices)
            } else {
                stream.as_mut().poll_write_vectored(cx, &slices)
            };
            let n = match written {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()))
                }
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending if wrote => return Poll::Ready(Ok(true)),
                Poll::Pending => return Poll::Pending,
            };
            drop(slices);
            self.consume(n);
            wrote = true;
        }
        match stream.poll_flush(cx) {
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            _ => Poll::Ready(Ok(wrote)),
        }
    }

    /// Retires `n` written bytes from the front of the queue.
    fn consume(&mut self, mut n: usize) {
        if let Some(drain) = self.drain.as_mut().filter(|_| n > 0) {
            // Progress puts the drain's deadline off, but never past MAX_DRAIN from the
            // stop, where it fires and cuts the connection whatever the client reads
            // (found by review: a client taking 64 KiB every 0.25 s held a stop 510 s).
            let mut next = tokio::time::Instant::now() + DRAIN_TIMEOUT;
            if let Some(since) = self.drain_since {
                next = next.min(since + MAX_DRAIN);
            }
            drain.as_mut().reset(next);
            self.drain_queued = None;
        }
        while let Some(front) = self.outq.front() {
            let len = front.header.len() + front.data_len();
            let left = len - self.front_written;
            if n < left {
                self.front_written += n;
                return;
            }
            n -= left;
            self.front_written = 0;
            let done = self.outq.pop_front().expect("front exists");
            self.held = self.held.saturating_sub(done.release);
            self.share.release(self.held);
        }
    }

    /// Parses and starts what the read buffer holds, then collects the replies of the
    /// requests that finished, up to [`WRITE_AFTER_DATA`] of read data; says whether any
    /// did.
    fn start_and_complete(&mut self, cx: &mut Context<'_>) -> bool {
        if self.reading {
            if let Err(fatal) = self.parse() {
                self.stop_reading(fatal);
            }
            // After the client's end of stream, what is buffered is still served; once
            // parsing stops for want of bytes rather than of room, nothing more will come.
            // A payload cut off by the end never completes, whatever room there is: with
            // the shared budget spent by others and nothing in flight here, waiting for
            // room would wait for ever (found by review: the connection stayed, with its
            // client slot, after the client had gone).
            let payload_cut_off = self.awaiting_payload.is_some() || self.discard_left > 0;
            if self.eof && self.reading && (payload_cut_off || self.can_admit()) {
                let why = if payload_cut_off {
                    "connection ended inside a payload"
                } else {
                    "client closed the connection"
                };
                self.stop_reading(why);
            }
        }
        let mut completed = false;
        let mut collected = 0usize;
        // A connection in the pattern of one request at a time (see `IdleSpin`) has its
        // request run by this thread, without the ring's hand-offs (`uring::alone`); only
        // for a backend that is a device itself: a replicated write must not wait for its
        // local half before its remote half is sent. A client that follows each write with
        // a FLUSH is in that pattern too, though its FLUSH, now answered at once, may come
        // before the connection idles (see `FlushAhead`).
        let connections = CONNECTIONS.load(Ordering::Relaxed);
        let alone = self.on_device
            && self.in_flight.len() == 1
            && (self.spin.one_at_a_time(connections)
                || (self.flush_ahead.in_pattern() && self.spin.few_connections(connections)));
        // What else this thread serves, asked once for the whole loop.
        let lone_thread = alone.then(super::lone_thread);
        while collected < WRITE_AFTER_DATA {
            let polled = match lone_thread {
                Some(thread) => {
                    crate::backend::uring::alone(thread, || self.in_flight.poll_next(cx))
                }
                None => self.in_flight.poll_next(cx),
            };
            let Poll::Ready(Some(finished)) = polled else {
                break;
            };
            match finished {
                Finished::Replies(replies) => {
                    collected += replies
                        .iter()
                        .map(|r| r.data.as_ref().map_or(0, Pieces::len))
                        .sum::<usize>();
                    self.outq.extend(replies);
                }
                Finished::MergedRead(merged, result) => {
                    collected += merged.length as usize;
                    self.merged_replies(merged, result);
                }
                Finished::ReadPiece(piece) => {
                    collected += piece.length as usize;
                    read_piece_replies(piece, &mut self.streamed_reads, &mut self.outq);
                }
                Finished::FlushedAhead(result) => {
                    // The write before it and the client's FLUSH after it are busy
                    // periods of their own (one request each), as they were before.
                    self.spin.busy_period_ended();
                    let (backend, outq, in_flight) =
                        (&self.backend, &mut self.outq, &mut self.in_flight);
                    self.flush_ahead
                        .finished(result, |enc, failed| match failed {
                            Some(failed) => outq.push_back(status_message(enc, Err(failed), 0)),
                            None => {
                                in_flight.push(flush(Arc::clone(backend), FlushFor::Client(enc)))
                            }
                        });
                }
            }
            completed = true;
        }
        if !self.in_flight.any_unpolled() {
            self.changes_not_started.clear();
        }
        completed
    }

    fn poll<S: Stream, F: Future<Output = ()>>(
        &mut self,
        cx: &mut Context<'_>,
        mut stream: Pin<&mut S>,
        mut stopped: Pin<&mut F>,
    ) -> Poll<std::io::Result<()>> {
        if let Some(drain) = self.drain.as_mut() {
            if drain.as_mut().poll(cx).is_ready() {
                // No write made progress for a whole period. The client may still be
                // reading: over TCP a write succeeds again only once a third of the send
                // buffer is free, which a slow reader takes longer than that to free. The
                // socket's send queue says: it shrank since the last look (or this is the
                // first look), or nothing is queued (the backend is what is slow): another
                // period. Only a queue that stayed put cuts the connection.
                let queued = stream.socket_fd().and_then(crate::tcp::send_queue_bytes);
                let client_reading = match (queued, self.drain_queued) {
                    (Some(0), _) | (Some(_), None) => true,
                    (Some(now), Some(before)) => now < before,
                    (None, _) => false,
                };
                // However slowly a client reads, the stop ends: a client taking one segment
                // per period would otherwise hold it for ever.
                let too_long = self
                    .drain_since
                    .is_some_and(|since| since.elapsed() >= MAX_DRAIN);
                let client_reading = client_reading && !too_long;
                if !self.outq.is_empty() && !client_reading {
                    let why = "the client stopped reading its replies while the server was \
                               stopping: closing the connection"
                        .to_string();
                    warn!("{why}");
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        why,
                    )));
                }
                self.drain_queued = queued;
                drain
                    .as_mut()
                    .reset(tokio::time::Instant::now() + DRAIN_TIMEOUT);
                let _ = drain.as_mut().poll(cx);
            }
        }
        for _ in 0..ROUNDS_BEFORE_YIELD {
            let mut progressed = false;
            if !self.stop_seen && stopped.as_mut().poll(cx).is_ready() {
                // Requests read from now on are refused with ESHUTDOWN, until those in
                // flight are answered (see `refuse_for_shutdown`).
                self.stop_seen = true;
                let mut drain = Box::pin(tokio::time::sleep(DRAIN_TIMEOUT));
                let _ = drain.as_mut().poll(cx);
                self.drain = Some(drain);
                self.drain_since = Some(tokio::time::Instant::now());
            }
            let wants_bytes =
                self.discard_left > 0 || self.awaiting_payload.is_some() || self.can_admit();
            if self.reading && !self.eof && wants_bytes {
                if self.inbuf.capacity() - self.inbuf.len() < READ_ROOM / 4 {
                    self.inbuf.reserve(READ_ROOM);
                }
                let polled = match &mut self.awaiting_payload {
                    // A payload received into the backend's pages, with nothing of it left
                    // in the read buffer: read it straight into them.
                    Some(PendingPayload {
                        into: PayloadInto::Pages(paged),
                        ..
                    }) if self.inbuf.is_empty() => {
                        poll_read_into(stream.as_mut(), cx, paged.room()).map_ok(|n| {
                            paged.filled += n;
                            n
                        })
                    }
                    // A large payload, with nothing of it left in the read buffer: read it
                    // straight into its own buffer.
                    Some(PendingPayload {
                        into: PayloadInto::Pooled(buffer, filled),
                        ..
                    }) if self.inbuf.is_empty() => {
                        let need = buffer.len();
                        poll_read_into(stream.as_mut(), cx, &mut buffer.as_mut()[*filled..need])
                            .map_ok(|n| {
                                *filled += n;
                                n
                            })
                    }
                    // After a large write, read only a little: the next request is likely
                    // another large write, whose payload then goes straight into its own
                    // buffer (above) instead of being copied there from this one.
                    _ if self.after_large_payload => tokio_util::io::poll_read_buf(
                        stream.as_mut(),
                        cx,
                        &mut (&mut self.inbuf).limit(READ_AFTER_LARGE_PAYLOAD),
                    ),
                    _ => tokio_util::io::poll_read_buf(stream.as_mut(), cx, &mut self.inbuf),
                };
                match polled {
                    Poll::Ready(Ok(0)) => {
                        self.eof = true;
                        progressed = true;
                    }
                    Poll::Ready(Ok(_)) => {
                        self.spin.got_bytes();
                        progressed = true;
                    }
                    Poll::Ready(Err(e)) => self.stop_reading(format!("read failed: {e}")),
                    Poll::Pending => {}
                }
            }
            // Starting the parsed requests and polling those in flight runs plugged: the
            // io_uring entries they queue reach the kernel together when this step ends,
            // from this thread, before the replies are written (see `uring::plugged`).
            progressed |= crate::backend::uring::plugged(|| self.start_and_complete(cx));
            if !self.outq.is_empty() {
                match self.poll_write(cx, stream.as_mut()) {
                    Poll::Ready(Ok(wrote)) => {
                        progressed |= wrote;
                        let all_answered = wrote && self.all_answered();
                        if all_answered && self.flush_ahead.start_if_due(self.inbuf.is_empty()) {
                            // The write's reply is out: sync it while the client takes
                            // the reply and sends its FLUSH.
                            self.in_flight
                                .push(flush(Arc::clone(&self.backend), FlushFor::Ahead));
                        } else if all_answered {
                            let gather = self.coalesce.replied(CONNECTIONS.load(Ordering::Relaxed));
                            if let Some(fd) = stream.socket_fd().filter(|_| gather) {
                                match self.coalesce.gather(fd, &mut self.inbuf) {
                                    Gathered::Nothing => {}
                                    Gathered::Bytes => self.spin.got_bytes(),
                                    Gathered::Closed => self.eof = true,
                                    Gathered::Failed(e) => {
                                        self.stop_reading(format!("read failed: {e}"))
                                    }
                                }
                            }
                        }
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {}
                }
            }
            // A stopping server reads on only while requests are in flight (see
            // `refuse_for_shutdown`). A request read before the stop whose payload is
            // still arriving (a write, or one refused whose refusal waits for it) counts
            // as in flight for at most DRAIN_TIMEOUT after the stop (the drain timer wakes
            // the task then), so a slow sender cannot hold the stop. The payload of a
            // request refused after the stop is not waited for: its refusal is dropped,
            // and the client sees the request fail with the connection's end.
            if self.stop_seen && self.reading && self.in_flight.is_empty() {
                let payload_due = self.awaiting_payload.is_some()
                    || matches!(self.refusal_after_payload, Some((_, true)));
                let waited = self
                    .drain_since
                    .map_or(true, |since| since.elapsed() >= DRAIN_TIMEOUT);
                if !payload_due || waited {
                    self.stop_reading("the server is stopping");
                }
            }
            if !self.reading && self.in_flight.is_empty() && self.outq.is_empty() {
                return Poll::Ready(Ok(()));
            }
            if !progressed {
                let idle = self.reading
                    && !self.eof
                    && self.in_flight.is_empty()
                    && self.outq.is_empty()
                    && self.discard_left == 0
                    && self.awaiting_payload.is_none();
                let connections = CONNECTIONS.load(Ordering::Relaxed);
                if !idle {
                    let waiting_on_one = self.reading
                        && self.outq.is_empty()
                        && self.in_flight.len() == 1
                        && self.discard_left == 0
                        && self.awaiting_payload.is_none();
                    if waiting_on_one && self.spin.wait_for_backend(&*self.backend, connections) {
                        continue;
                    }
                    return Poll::Pending;
                }
                match self
                    .spin
                    .wait(stream.socket_fd(), &mut self.inbuf, connections)
                {
                    SpinOutcome::Bytes => continue,
                    SpinOutcome::Closed => {
                        self.eof = true;
                        continue;
                    }
                    SpinOutcome::Failed(e) => {
                        self.stop_reading(format!("read failed: {e}"));
                        continue;
                    }
                    SpinOutcome::Sleep => return Poll::Pending,
                }
            }
        }
        // Busy connection: let the others on this worker run, then come back.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// Reads from `stream` straight into `room` (not through the read buffer); returns how
/// many bytes came, 0 at the end of the stream.
fn poll_read_into<S: Stream + ?Sized>(
    stream: Pin<&mut S>,
    cx: &mut Context<'_>,
    room: &mut [u8],
) -> Poll<std::io::Result<usize>> {
    let mut window = ReadBuf::new(room);
    std::task::ready!(stream.poll_read(cx, &mut window))?;
    Poll::Ready(Ok(window.filled().len()))
}

/// Whose flush a backend flush is.
enum FlushFor {
    /// The client's FLUSH, answered with the flush's result.
    Client(ReplyEncoder),
    /// A flush ahead of the client's (see [`FlushAhead`]): no reply.
    Ahead,
}

/// `backend` flushed, for `whom`. One function for every place that starts a flush (the
/// client's FLUSH as parsed or after a flush ahead it waited for, and the flush ahead
/// itself), so that their futures share a type and reuse each other's slot boxes.
async fn flush(backend: Arc<dyn Backend>, whom: FlushFor) -> Finished {
    let result = backend.flush().await;
    match whom {
        FlushFor::Client(enc) => Finished::from(status_reply(enc, result, 0)),
        FlushFor::Ahead => Finished::FlushedAhead(result),
    }
}

/// [`status_message`] as the replies of a request future.
fn status_reply(enc: ReplyEncoder, result: Result<(), BackendError>, release: u64) -> Replies {
    smallvec![status_message(enc, result, release)]
}

/// The one message that answers a request without data: success or its error.
fn status_message(enc: ReplyEncoder, result: Result<(), BackendError>, release: u64) -> Outgoing {
    let mut header = ReplyHeader::new();
    match result {
        Ok(()) => enc.ok(&mut header),
        Err(e) if e.refused_fast_zero => {
            enc.error(&mut header, e.errno, "zeroing would not be fast")
        }
        Err(e) => return error_message(enc, &e, release),
    }
    Outgoing::new(header, None, release)
}

/// The message that ends a successful read after its data chunks (or one of no bytes).
fn read_done_message(enc: ReplyEncoder) -> Outgoing {
    let mut header = ReplyHeader::new();
    enc.read_done(&mut header);
    Outgoing::new(header, None, 0)
}

/// The message that reports a backend error, logged.
fn error_message(enc: ReplyEncoder, e: &BackendError, release: u64) -> Outgoing {
    crate::metrics::note_io_error();
    warn_limited!(FAILED_REQUESTS, "{e}");
    let mut header = ReplyHeader::new();
    enc.error(&mut header, e.errno, &e.to_string());
    Outgoing::new(header, None, release)
}

fn error_reply(enc: ReplyEncoder, e: &BackendError, release: u64) -> Replies {
    smallvec![error_message(enc, e, release)]
}

/// Content chunks for data read at `offset`; the last is marked done when `done`.
fn content_chunks(
    enc: ReplyEncoder,
    offset: u64,
    read: ReadData,
    done: bool,
    release: u64,
    out: &mut impl Extend<Outgoing>,
) {
    if read.runs.len() <= 1 && !read.runs.first().is_some_and(|r| r.1) {
        let mut header = ReplyHeader::new();
        enc.data_header(&mut header, offset, read.data.len() as u64, done);
        out.extend(Some(Outgoing::new(header, Some(read.data), release)));
        return;
    }
    let mut at = 0usize;
    let last = read.runs.len() - 1;
    for (i, &(len, hole)) in read.runs.iter().enumerate() {
        let mut header = ReplyHeader::new();
        let chunk_offset = offset + at as u64;
        // Messages leave in order, so the last one returns the whole buffer's budget.
        let release = if i == last { release } else { 0 };
        if hole {
            enc.hole(&mut header, chunk_offset, len as u32, done && i == last);
            out.extend(Some(Outgoing::new(header, None, release)));
        } else {
            enc.data_header(&mut header, chunk_offset, len as u64, done && i == last);
            out.extend(Some(Outgoing::new(
                header,
                Some(read.data.slice(at, len)),
                release,
            )));
        }
        at += len;
    }
}

/// What a read of `length` bytes takes from the byte budget until its reply is sent (a
/// streamed read, longer than [`MIN_READ_CHARGE`], its length: its pieces give it back).
fn read_charge(length: u32) -> u64 {
    match length {
        0 => 0,
        length => u64::from(length).max(MIN_READ_CHARGE),
    }
}

/// The reply to a read of `length` bytes at `offset`, from what the backend returned,
/// added to `out`.
fn read_reply(
    enc: ReplyEncoder,
    offset: u64,
    length: u32,
    df: bool,
    read: Result<ReadData, &BackendError>,
    out: &mut impl Extend<Outgoing>,
) {
    let release = read_charge(length);
    let read = match read {
        Ok(read) => read,
        Err(e) => return out.extend(error_reply(enc, e, release)),
    };
    if enc.style == ReplyStyle::Simple || df {
        let mut header = ReplyHeader::new();
        enc.data_header(&mut header, offset, u64::from(length), true);
        out.extend(Some(Outgoing::new(header, Some(read.data), release)));
    } else {
        content_chunks(enc, offset, read, true, release, out);
    }
}

/// The replies to the reads merged into one backend read, from what that read returned,
/// added to `out`.
fn merged_replies(
    merged: MergedRead,
    result: Result<ReadData, BackendError>,
    out: &mut impl Extend<Outgoing>,
) -> Vec<ReadPart> {
    let MergedRead {
        offset: merged_offset,
        first,
        mut more,
        ..
    } = merged;
    if more.is_empty() {
        // The whole read is this one request's: its data as it came.
        let (enc, offset, length, df) = (first.enc, first.offset, first.length, first.df);
        match result {
            Ok(read) => read_reply(enc, offset, length, df, Ok(read), out),
            Err(e) => read_reply(enc, offset, length, df, Err(&e), out),
        }
        return more;
    }
    for part in std::iter::once(first).chain(more.drain(..)) {
        let start = (part.offset - merged_offset) as usize;
        let slice = result
            .as_ref()
            .map(|read| read.slice(start, part.length as usize));
        read_reply(part.enc, part.offset, part.length, part.df, slice, out);
    }
    more
}

/// Streamed reads in flight, each in a slot the pipeline reuses: how many of its pieces
/// are not done yet, and the first error. The piece that finishes last ends the reply.
///
/// Measured reason: the pieces shared this state through an `Arc<Mutex<_>>`, one
/// allocation per read over [`STREAM_PIECE`] (1 MiB reads under `--cache=none` allocated
/// exactly that once, `tests/allocations.rs`, session 36); a piece's future now ends with
/// its data, and the pipeline, which alone handles completions, keeps the count.
#[derive(Default)]
struct StreamedReads {
    slots: Vec<StreamedRead>,
    free: Vec<usize>,
}

#[derive(Default)]
struct StreamedRead {
    left: u32,
    error: Option<(NbdError, String)>,
}

impl StreamedReads {
    /// A slot for a read of `pieces` pieces.
    fn start(&mut self, pieces: u32) -> usize {
        let slot = self.free.pop().unwrap_or_else(|| {
            self.slots.push(StreamedRead::default());
            self.slots.len() - 1
        });
        self.slots[slot] = StreamedRead {
            left: pieces,
            error: None,
        };
        slot
    }

    /// Counts a finished piece of the read in `slot`, failed with `error`; returns whether
    /// it was the last, and the first error of any piece once the last is done (the slot
    /// is free again then).
    fn piece_done(
        &mut self,
        slot: usize,
        error: Option<&BackendError>,
    ) -> (bool, Option<(NbdError, String)>) {
        let read = &mut self.slots[slot];
        read.left -= 1;
        if let Some(e) = error {
            read.error.get_or_insert_with(|| (e.errno, e.to_string()));
        }
        if read.left > 0 {
            return (false, None);
        }
        self.free.push(slot);
        (true, read.error.take())
    }
}

/// What the pieces of one streamed write share: how many are not done yet, and the first
/// error.
struct StreamedWrite {
    left: u32,
    error: Option<BackendError>,
}

/// Records a finished piece of a streamed write; the last one to finish makes the reply,
/// which carries the first error any piece had.
fn write_piece_done(
    enc: ReplyEncoder,
    result: Result<(), BackendError>,
    release: u64,
    shared: &Mutex<StreamedWrite>,
) -> Replies {
    let mut state = shared.lock().unwrap_or_else(|e| e.into_inner());
    state.left -= 1;
    if let Err(e) = result {
        state.error.get_or_insert(e);
    }
    if state.left > 0 {
        return Replies::new();
    }
    status_reply(enc, state.error.take().map_or(Ok(()), Err), release)
}

/// Where a finished piece of a streamed read has its data.
enum PieceData {
    Read(ReadData),
    Spliced(Spliced),
}

/// A finished piece of the streamed read in slot `stream` of [`StreamedReads`].
struct ReadPieceDone {
    stream: usize,
    enc: ReplyEncoder,
    offset: u64,
    length: u32,
    data: Result<PieceData, BackendError>,
}

/// The chunks of a finished piece of a streamed read: its data chunk, and the final chunk
/// if it is the last piece to finish.
fn read_piece_replies(
    piece: ReadPieceDone,
    streams: &mut StreamedReads,
    out: &mut impl Extend<Outgoing>,
) {
    let ReadPieceDone {
        stream,
        enc,
        offset,
        length,
        data,
    } = piece;
    if let Err(e) = &data {
        crate::metrics::note_io_error();
        warn_limited!(FAILED_REQUESTS, "{e}");
    }
    let (last, error) = streams.piece_done(stream, data.as_ref().err());
    // The piece that finishes last ends the reply: its data chunk carries the done flag
    // when no piece failed, so a piece's replies fit in `Replies` without a list (one
    // allocation per piece before, session 35); else a final error chunk follows.
    let done_with_data = last && error.is_none();
    match data {
        Ok(PieceData::Read(read)) => {
            content_chunks(enc, offset, read, done_with_data, u64::from(length), out)
        }
        Ok(PieceData::Spliced(spliced)) => out.extend(std::iter::once(spliced_reply(
            enc,
            offset,
            spliced,
            done_with_data,
            u64::from(length),
        ))),
        Err(_) => out.extend(std::iter::once(Outgoing::new(
            ReplyHeader::new(),
            None,
            u64::from(length),
        ))),
    }
    if let Some((errno, message)) = error {
        let mut header = ReplyHeader::new();
        enc.error(&mut header, errno, &message);
        out.extend(std::iter::once(Outgoing::new(header, None, 0)));
    }
}

/// Makes a [`LaterPiece`] at the front of the queue ready to send: spliced into a pipe
/// when it can be, else read by copying (`Pending` until that read completes). A failed
/// read becomes an error chunk for its range when the reply is chunked (the reply's final
/// chunk is queued behind it); with a simple reply it is an error for the connection, as
/// the reply's header, saying there was none, is out.
fn poll_later_piece(
    backend: &Arc<dyn Backend>,
    splice: bool,
    kernel_copies: bool,
    message: &mut Outgoing,
    boxes: &mut LaterPieces,
    cx: &mut Context<'_>,
) -> Poll<std::io::Result<()>> {
    let later = message.later.as_mut().expect("called for a later piece");
    // A chunk's header, once its data is ready (nothing of this message has gone yet).
    let chunk_header = |later: &LaterPiece, header: &mut ReplyHeader| {
        if let Some(enc) = later.chunk {
            enc.data_header(header, later.offset, u64::from(later.length), false);
        }
    };
    if later.reading.is_none() {
        if let Some(spliced) = splice
            .then(|| backend.read_to_pipe(later.offset, later.length as usize))
            .flatten()
        {
            chunk_header(later, &mut message.header);
            message.spliced = Some(spliced);
            boxes.done(message);
            return Poll::Ready(Ok(()));
        }
        // Not spliced (no pipe free, or the client takes copies faster): a cached piece is
        // copied into the socket from the mapping, once, rather than read into a buffer.
        if let Some(mapped) = kernel_copies
            .then(|| backend.read_mapped(later.offset, later.length as usize))
            .flatten()
        {
            chunk_header(later, &mut message.header);
            message.data = Some(mapped.data);
            boxes.done(message);
            return Poll::Ready(Ok(()));
        }
        let backend = Arc::clone(backend);
        let (offset, length) = (later.offset, later.length as usize);
        later.reading = Some(Box::pin(async move { backend.read(offset, length).await }));
    }
    let reading = later.reading.as_mut().expect("started above");
    match reading.as_mut().poll(cx) {
        Poll::Pending => Poll::Pending,
        Poll::Ready(Ok(read)) => {
            chunk_header(later, &mut message.header);
            message.data = Some(read.data);
            boxes.done(message);
            Poll::Ready(Ok(()))
        }
        Poll::Ready(Err(e)) if later.chunk.is_some() => {
            crate::metrics::note_io_error();
            warn_limited!(FAILED_REQUESTS, "{e}");
            let enc = later.chunk.expect("matched above");
            enc.error_at(&mut message.header, e.errno, &e.to_string(), later.offset);
            boxes.done(message);
            Poll::Ready(Ok(()))
        }
        Poll::Ready(Err(e)) => {
            warn!("{e}: after the reply's header was sent; closing the connection");
            Poll::Ready(Err(std::io::Error::other(format!(
                "a read failed after its reply's header was sent: {e}"
            ))))
        }
    }
}

/// A data reply (or chunk, marked final when `done`) whose data waits in a pipe.
fn spliced_reply(
    enc: ReplyEncoder,
    offset: u64,
    spliced: Spliced,
    done: bool,
    release: u64,
) -> Outgoing {
    let mut header = ReplyHeader::new();
    enc.data_header(&mut header, offset, spliced.len() as u64, done);
    Outgoing {
        header,
        data: None,
        spliced: Some(spliced),
        later: None,
        release,
    }
}

/// Errors of a splice into a socket that mean it cannot take one at all, as opposed to a
/// connection that failed.
fn splice_unsupported(errno: i32) -> bool {
    [Errno::INVAL, Errno::NOSYS, Errno::OPNOTSUPP]
        .iter()
        .any(|e| e.raw_os_error() == errno)
}

async fn block_status(
    backend: &dyn Backend,
    enc: ReplyEncoder,
    offset: u64,
    length: u64,
    req_one: bool,
) -> Replies {
    let span = length.min(MAX_STATUS_SPAN);
    let extents = match backend.extents(offset, span).await {
        Ok(extents) => extents,
        Err(e) => return error_reply(enc, &e, STATUS_REPLY_BUDGET),
    };
    let mut descriptors: Vec<(u64, u32)> = Vec::with_capacity(extents.len().min(1024));
    let mut covered = 0u64;
    for extent in extents {
        if covered >= span || extent.length == 0 || descriptors.len() == MAX_STATUS_DESCRIPTORS {
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
    let mut header = ReplyHeader::with_capacity(40 + 16 * descriptors.len());
    enc.block_status(&mut header, BASE_ALLOCATION_ID, &descriptors, true);
    debug_assert!(header.len() as u64 <= STATUS_REPLY_BUDGET);
    smallvec![Outgoing::new(header, None, STATUS_REPLY_BUDGET)]
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    use std::collections::HashMap;

    use super::*;
    use crate::backend::backend_future;
    use crate::backend::memory::{MemoryBackend, PAGE_SIZE};
    use crate::server::{handle_connection, Export, ServerConfig};
    use crate::wire::handshake::{ClientOption, InfoRequest, OptionReply};
    use crate::wire::transmission::DecodedReply;
    use crate::wire::{client_flags, reply};

    /// A compact request header, as a client encodes it.
    fn request(command: u16, flags: u16, cookie: u64, offset: u64, length: u64) -> Vec<u8> {
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        header.encode(RequestStyle::Compact)
    }

    /// Negotiates structured replies on a fresh 64 MiB memory export.
    async fn connect() -> DuplexStream {
        connect_to(Arc::new(MemoryBackend::new(64 << 20, false))).await
    }

    /// An export (memory unless said otherwise) that counts the reads, spliced reads,
    /// writes and inline writes it is asked for, and fails a write that starts at
    /// `fail_write_at` and a read that starts at `fail_read_at`. Reads at once
    /// ([`Backend::read_at_once`]) are passed on only when `at_once` is set, and counted
    /// among the reads. With `trim_unsupported`, a TRIM fails as a file system without hole
    /// punching fails it (EOPNOTSUPP). After `splices_allowed` spliced reads, no more are
    /// (as when the pages were evicted or the pipes ran out).
    struct CountingReads<B = MemoryBackend> {
        inner: B,
        at_once: bool,
        reads: std::sync::atomic::AtomicUsize,
        /// Of `reads`, those asked for with `read_declined`.
        declined: std::sync::atomic::AtomicUsize,
        spliced: std::sync::atomic::AtomicUsize,
        writes: std::sync::atomic::AtomicUsize,
        /// Of `writes`, those whose payload came in a pooled buffer.
        pooled_writes: std::sync::atomic::AtomicUsize,
        flushes: std::sync::atomic::AtomicUsize,
        /// The flush (counting from 1) that fails.
        fail_flush: Option<usize>,
        /// Flushes wait until this is notified.
        hold_flushes: Option<tokio::sync::Notify>,
        inline_writes: std::sync::atomic::AtomicUsize,
        fail_write_at: Option<u64>,
        fail_read_at: Option<u64>,
        trim_unsupported: bool,
        splices_allowed: usize,
        /// Reads served from the backend's mapping; asked of the backend only when
        /// `map_reads` (the other tests count every large read as copied or spliced).
        mapped: std::sync::atomic::AtomicUsize,
        map_reads: bool,
    }

    impl CountingReads {
        fn new(fail_write_at: Option<u64>) -> CountingReads {
            CountingReads::over(MemoryBackend::new(64 << 20, false), fail_write_at)
        }
    }

    impl<B> CountingReads<B> {
        fn over(inner: B, fail_write_at: Option<u64>) -> CountingReads<B> {
            CountingReads {
                inner,
                at_once: false,
                reads: Default::default(),
                declined: Default::default(),
                spliced: Default::default(),
                writes: Default::default(),
                pooled_writes: Default::default(),
                flushes: Default::default(),
                fail_flush: None,
                hold_flushes: None,
                inline_writes: Default::default(),
                fail_write_at,
                fail_read_at: None,
                trim_unsupported: false,
                splices_allowed: usize::MAX,
                mapped: Default::default(),
                map_reads: false,
            }
        }

        /// The error a write of `length` bytes at `offset` fails with, if it is the one
        /// told to fail.
        fn injected_failure(&self, offset: u64, length: usize) -> Option<BackendError> {
            (self.fail_write_at == Some(offset))
                .then(|| BackendError::plain("write", offset, length as u64, NbdError::Io))
        }
    }

    impl<B: Backend> Backend for CountingReads<B> {
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn capabilities(&self) -> crate::backend::Capabilities {
            self.inner.capabilities()
        }
        fn read(&self, offset: u64, length: usize) -> crate::backend::BackendFuture<'_, ReadData> {
            self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if self.fail_read_at == Some(offset) {
                let error = BackendError::plain("read", offset, length as u64, NbdError::Io);
                return backend_future(std::future::ready(Err(error)));
            }
            self.inner.read(offset, length)
        }
        fn read_declined(
            &self,
            offset: u64,
            length: usize,
        ) -> crate::backend::BackendFuture<'_, ReadData> {
            self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.declined
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if self.fail_read_at == Some(offset) {
                let error = BackendError::plain("read", offset, length as u64, NbdError::Io);
                return backend_future(std::future::ready(Err(error)));
            }
            self.inner.read_declined(offset, length)
        }
        fn read_at_once(
            &self,
            offset: u64,
            length: usize,
        ) -> Option<Result<ReadData, BackendError>> {
            let read = self
                .inner
                .read_at_once(offset, length)
                .filter(|_| self.at_once)?;
            self.reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Some(read)
        }
        fn read_to_pipe(&self, offset: u64, length: usize) -> Option<Spliced> {
            let count = &self.spliced;
            if count.load(std::sync::atomic::Ordering::SeqCst) >= self.splices_allowed {
                return None;
            }
            let spliced = self.inner.read_to_pipe(offset, length)?;
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Some(spliced)
        }
        fn read_mapped(&self, offset: u64, length: usize) -> Option<ReadData> {
            if !self.map_reads {
                return None;
            }
            let mapped = self.inner.read_mapped(offset, length)?;
            self.mapped
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Some(mapped)
        }
        fn can_splice(&self) -> bool {
            self.inner.can_splice()
        }
        fn all_cached(&self, offset: u64, length: u64) -> bool {
            self.inner.all_cached(offset, length)
        }
        fn wants_pooled_payloads(&self) -> bool {
            self.inner.wants_pooled_payloads()
        }
        fn write(
            &self,
            offset: u64,
            data: WriteData,
            fua: bool,
        ) -> crate::backend::BackendFuture<'_, ()> {
            self.writes
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if matches!(data, WriteData::Pooled(_)) {
                self.pooled_writes
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            if let Some(failure) = self.injected_failure(offset, data.len()) {
                return backend_future(std::future::ready(Err(failure)));
            }
            self.inner.write(offset, data, fua)
        }
        fn write_inline(
            &self,
            offset: u64,
            data: &[u8],
            fua: bool,
        ) -> Option<Result<(), BackendError>> {
            let result = match self.injected_failure(offset, data.len()) {
                Some(failure) => Some(Err(failure)),
                None => self.inner.write_inline(offset, data, fua),
            };
            if result.is_some() {
                self.inline_writes
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            result
        }
        fn flush(&self) -> crate::backend::BackendFuture<'_, ()> {
            let number = self
                .flushes
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                + 1;
            if self.fail_flush == Some(number) {
                let error = BackendError::plain("flush", 0, 0, NbdError::Io);
                return backend_future(std::future::ready(Err(error)));
            }
            if let Some(hold) = &self.hold_flushes {
                return backend_future(async move {
                    hold.notified().await;
                    self.inner.flush().await
                });
            }
            self.inner.flush()
        }
        fn flush_ahead_pays(&self) -> bool {
            self.inner.flush_ahead_pays()
        }
        fn trim(
            &self,
            offset: u64,
            length: u64,
            fua: bool,
        ) -> crate::backend::BackendFuture<'_, ()> {
            if self.trim_unsupported {
                let unsupported = std::io::Error::from_raw_os_error(95); // EOPNOTSUPP
                let error = BackendError::io("trim", offset, length, unsupported);
                return backend_future(std::future::ready(Err(error)));
            }
            self.inner.trim(offset, length, fua)
        }
        fn write_zeroes(
            &self,
            offset: u64,
            length: u64,
            flags: ZeroFlags,
        ) -> crate::backend::BackendFuture<'_, ()> {
            self.inner.write_zeroes(offset, length, flags)
        }
        fn cache(&self, offset: u64, length: u64) -> crate::backend::BackendFuture<'_, ()> {
            self.inner.cache(offset, length)
        }
        fn extents(
            &self,
            offset: u64,
            length: u64,
        ) -> crate::backend::BackendFuture<'_, Vec<crate::backend::Extent>> {
            self.inner.extents(offset, length)
        }
    }

    /// A disk of alternating 4 KiB data and holes: as many extents as a query can hold.
    struct Fragmented {
        inner: MemoryBackend,
    }

    impl Backend for Fragmented {
        crate::backend::pass_to_inner!(
            size,
            capabilities,
            read,
            write,
            flush,
            trim,
            write_zeroes,
            cache
        );
        fn extents(
            &self,
            _offset: u64,
            length: u64,
        ) -> crate::backend::BackendFuture<'_, Vec<crate::backend::Extent>> {
            let extents = (0..length / 4096)
                .map(|i| crate::backend::Extent {
                    length: 4096,
                    hole: i % 2 == 1,
                    zero: i % 2 == 1,
                })
                .collect();
            backend_future(std::future::ready(Ok(extents)))
        }
    }

    #[tokio::test]
    async fn a_block_status_reply_is_capped_and_charged_to_the_byte_budget() {
        let backend = Fragmented {
            inner: MemoryBackend::new(1 << 30, false),
        };
        for style in [ReplyStyle::Structured, ReplyStyle::Extended] {
            let enc = ReplyEncoder {
                style,
                cookie: 1,
                offset: 0,
            };
            let replies = block_status(&backend, enc, 0, 1 << 30, false).await;
            let [reply] = &replies[..] else {
                panic!("one reply chunk")
            };
            // Charged at admission and given back when sent: the largest reply.
            assert_eq!(reply.release, STATUS_REPLY_BUDGET);
            assert!(reply.header.len() as u64 <= STATUS_REPLY_BUDGET);
            let (decoded, _) = DecodedReply::decode(&reply.header).unwrap().unwrap();
            let DecodedReply::Chunk { payload_len, .. } = decoded else {
                panic!("a chunk")
            };
            let per_descriptor = if style == ReplyStyle::Extended { 16 } else { 8 };
            let header = if style == ReplyStyle::Extended { 8 } else { 4 };
            // 262,144 extents asked about; the reply stops at the cap.
            assert_eq!(
                payload_len,
                header + per_descriptor * MAX_STATUS_DESCRIPTORS as u64
            );
        }
    }

    #[tokio::test]
    async fn adjacent_reads_sent_together_are_served_by_one_backend_read() {
        // Through futures, and answered as parsed (a memory export reads at once).
        for at_once in [false, true] {
            adjacent_reads_merge(at_once).await;
        }
    }

    async fn adjacent_reads_merge(at_once: bool) {
        let mut backend = CountingReads::new(None);
        backend.at_once = at_once;
        let backend = Arc::new(backend);
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        // 64 KiB of pattern, then a 64 KiB hole (a page never written).
        let pattern: Vec<u8> = (0..65536).map(|i| (i * 13 % 251) as u8).collect();
        client
            .write_all(&request(cmd::WRITE, 0, 1, 0, 65536))
            .await
            .unwrap();
        client.write_all(&pattern).await.unwrap();
        read_chunk(&mut client).await;
        let before = backend.reads.load(std::sync::atomic::Ordering::SeqCst);
        // 32 adjacent 4 KiB reads across the data and the hole, in one send.
        let batch: Vec<u8> = (0..32u64)
            .flat_map(|i| request(cmd::READ, 0, 100 + i, i * 4096, 4096))
            .collect();
        client.write_all(&batch).await.unwrap();
        let mut seen = std::collections::HashSet::new();
        while seen.len() < 32 {
            let (flags, kind, cookie, payload) = read_chunk(&mut client).await;
            let i = cookie - 100;
            let at = u64::from_be_bytes(payload[..8].try_into().unwrap());
            assert_eq!(at, i * 4096, "each reply is for its own request");
            match kind {
                reply::TYPE_OFFSET_DATA => {
                    assert!(i < 16, "data where the hole is");
                    let at = at as usize;
                    assert_eq!(&payload[8..], &pattern[at..at + 4096]);
                }
                reply::TYPE_OFFSET_HOLE => {
                    assert!(i >= 16, "a hole where the data is");
                    assert_eq!(u32::from_be_bytes(payload[8..12].try_into().unwrap()), 4096);
                }
                other => panic!("unexpected chunk type {other}"),
            }
            assert!(flags & reply::FLAG_DONE != 0);
            assert!(seen.insert(cookie), "two replies for {cookie}");
        }
        let reads = backend.reads.load(std::sync::atomic::Ordering::SeqCst) - before;
        assert!(
            reads < 32,
            "32 adjacent reads took {reads} backend reads: nothing merged (at once: {at_once})"
        );
        // A read the backend declined to do at once is asked for as declined, so that a
        // file export does not try its page cache a second time.
        let declined = backend.declined.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(declined, if at_once { 0 } else { reads });
    }

    /// A merged read that fails is read again request by request: only the request the
    /// failure is in fails (a bad sector must not fail its merged neighbours), and the next
    /// merge is served.
    #[tokio::test]
    async fn a_failed_merged_read_fails_only_the_request_that_fails_alone() {
        // Completed later (not at once), so the merged read comes back through its future
        // and its list of parts is kept for the next merge. Reads at 0 fail: the merged
        // read, then the first request's own.
        let mut backend = CountingReads::new(None);
        backend.fail_read_at = Some(0);
        let backend = Arc::new(backend);
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        for (first_cookie, start) in [(100u64, 0u64), (200, 1 << 20)] {
            let batch: Vec<u8> = (0..8u64)
                .flat_map(|i| request(cmd::READ, 0, first_cookie + i, start + i * 4096, 4096))
                .collect();
            let before = backend.reads.load(std::sync::atomic::Ordering::SeqCst);
            client.write_all(&batch).await.unwrap();
            let mut seen = std::collections::HashSet::new();
            while seen.len() < 8 {
                let (flags, kind, cookie, _) = read_chunk(&mut client).await;
                assert!((first_cookie..first_cookie + 8).contains(&cookie));
                let want = if cookie == 100 {
                    reply::TYPE_ERROR
                } else {
                    reply::TYPE_OFFSET_HOLE
                };
                assert_eq!(kind, want, "the reply to {cookie}");
                assert!(flags & reply::FLAG_DONE != 0);
                assert!(seen.insert(cookie), "two replies for {cookie}");
            }
            let reads = backend.reads.load(std::sync::atomic::Ordering::SeqCst) - before;
            if start == 0 {
                assert!(
                    reads > 8,
                    "the failed merge was not read again request by request"
                );
            } else {
                assert!(reads < 8, "8 adjacent reads took {reads} backend reads");
            }
        }
    }

    /// Sends one write of `data` at 4096 and returns its reply's chunk type, after checking
    /// that exactly one reply came for it.
    async fn write_and_answer(client: &mut DuplexStream, data: &[u8]) -> u16 {
        client
            .write_all(&request(cmd::WRITE, 0, 7, 4096, data.len() as u64))
            .await
            .unwrap();
        client.write_all(data).await.unwrap();
        let (flags, kind, cookie, _) = read_chunk(client).await;
        assert_eq!(cookie, 7);
        assert!(flags & reply::FLAG_DONE != 0, "one reply, the final one");
        // The connection goes on, and nothing else was queued for the write.
        client
            .write_all(&request(cmd::FLUSH, 0, 8, 0, 0))
            .await
            .unwrap();
        let (_, _, cookie, _) = read_chunk(client).await;
        assert_eq!(cookie, 8, "a second reply for the write");
        kind
    }

    /// With structured replies, a write's, a flush's and a trim's success each leave as a
    /// 16-byte simple reply, while a READ, even of no bytes, gets a chunk.
    #[tokio::test]
    async fn successes_without_data_are_simple_replies_and_reads_are_chunks() {
        let mut client = connect().await;
        let mut batch = request(cmd::WRITE, 0, 1, 0, 512);
        batch.extend([7u8; 512]);
        batch.extend(request(cmd::FLUSH, 0, 2, 0, 0));
        batch.extend(request(cmd::TRIM, 0, 3, 0, 512));
        batch.extend(request(cmd::READ, 0, 4, 0, 0));
        client.write_all(&batch).await.unwrap();
        // Replies may come in any order; every header starts with 16 bytes.
        let mut simple = Vec::new();
        let mut chunks = Vec::new();
        for _ in 0..4 {
            match read_reply_header(&mut client).await {
                DecodedReply::Simple { error, cookie } => simple.push((cookie, error)),
                chunk => chunks.push(chunk),
            }
        }
        simple.sort_unstable();
        assert_eq!(simple, [(1, 0), (2, 0), (3, 0)]);
        let done_read = DecodedReply::Chunk {
            flags: reply::FLAG_DONE,
            kind: reply::TYPE_NONE,
            cookie: 4,
            offset: None,
            payload_len: 0,
        };
        assert_eq!(chunks, [done_read], "a READ's reply must be a chunk");
    }

    #[tokio::test]
    async fn a_large_write_goes_to_the_backend_in_pieces_and_is_answered_once() {
        let backend = Arc::new(CountingReads::new(None));
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        let len = 3 * WRITE_PIECE as usize + 12345;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
        let kind = write_and_answer(&mut client, &data).await;
        assert_eq!(kind, reply::TYPE_NONE);
        assert_eq!(
            backend.writes.load(std::sync::atomic::Ordering::SeqCst),
            4,
            "three full pieces and the rest"
        );
        let stored = backend.inner.read(4096, len).await.unwrap();
        assert!(stored.bytes()[..] == data[..], "the pieces landed in place");
    }

    /// A direct-I/O export wants every payload in a pooled buffer: short writes sent
    /// together, aligned or not, each reach it in one (gathered from the read buffer as
    /// they arrive, not shared out of it), are answered, and land.
    #[tokio::test]
    async fn short_payloads_to_a_direct_export_arrive_in_pooled_buffers() {
        let (tmp, backend) = counted_direct_export(None);
        assert!(backend.wants_pooled_payloads());
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        // 16 block-aligned 4 KiB writes, then one of 100 bytes inside a block (read,
        // modified and written back), in one send.
        let mut batch = Vec::new();
        let mut expected = vec![0u8; 1 << 20];
        for i in 0..17u64 {
            let (offset, len) = if i < 16 {
                (i * 8192, 4096)
            } else {
                (200_000, 100)
            };
            let data: Vec<u8> = (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect();
            batch.extend(request(cmd::WRITE, 0, 100 + i, offset, len as u64));
            batch.extend(&data);
            expected[offset as usize..offset as usize + len].copy_from_slice(&data);
        }
        client.write_all(&batch).await.unwrap();
        let mut answered = std::collections::HashSet::new();
        while answered.len() < 17 {
            let (flags, kind, cookie, _) = read_chunk(&mut client).await;
            assert_eq!(kind, reply::TYPE_NONE, "write {cookie} failed");
            assert!(flags & reply::FLAG_DONE != 0);
            assert!(answered.insert(cookie), "write {cookie} answered twice");
        }
        let writes = backend.writes.load(std::sync::atomic::Ordering::SeqCst);
        let pooled = backend
            .pooled_writes
            .load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            (writes, pooled),
            (17, 17),
            "every payload in a pooled buffer"
        );
        assert!(
            std::fs::read(tmp.path()).unwrap() == expected,
            "the writes landed"
        );
    }

    /// A file export of `contents`, `cache` as `--cache` gives it, with its reads, writes
    /// and flushes counted and its flush number `fail_flush` failing; the file (where
    /// `O_DIRECT` works) comes back with it.
    fn counted_export(
        contents: &[u8],
        cache: Option<crate::backend::CacheMode>,
        fail_flush: Option<usize>,
    ) -> (
        tempfile::NamedTempFile,
        Arc<CountingReads<crate::backend::file::FileBackend>>,
    ) {
        use std::io::Write as _;
        let mut tmp =
            tempfile::NamedTempFile::new_in(crate::backend::uring::scratch_dir_for_direct_io())
                .unwrap();
        tmp.write_all(contents).unwrap();
        let file = crate::backend::file::FileBackend::open(tmp.path(), None, false, cache).unwrap();
        let mut backend = CountingReads::over(file, None);
        backend.fail_flush = fail_flush;
        (tmp, Arc::new(backend))
    }

    /// A `--cache=none` export of 1 MiB of zeroes, counted, whose flush number
    /// `fail_flush` fails.
    fn counted_direct_export(
        fail_flush: Option<usize>,
    ) -> (
        tempfile::NamedTempFile,
        Arc<CountingReads<crate::backend::file::FileBackend>>,
    ) {
        counted_export(
            &vec![0u8; 1 << 20],
            Some(crate::backend::CacheMode::None),
            fail_flush,
        )
    }

    /// Sends `pairs` writes, each followed by a FLUSH once its reply came, as a database
    /// commits; returns the FLUSH replies (0 or the error).
    async fn write_flush_pairs(client: &mut DuplexStream, pairs: u64) -> Vec<u32> {
        let mut flushed = Vec::new();
        for i in 0..pairs {
            let data = vec![i as u8 + 1; 4096];
            client
                .write_all(&request(cmd::WRITE, 0, 2 * i, i * 4096, 4096))
                .await
                .unwrap();
            client.write_all(&data).await.unwrap();
            let (_, kind, cookie, _) = read_chunk(client).await;
            assert_eq!((kind, cookie), (reply::TYPE_NONE, 2 * i), "write {i}");
            client
                .write_all(&request(cmd::FLUSH, 0, 2 * i + 1, 0, 0))
                .await
                .unwrap();
            let (_, kind, cookie, payload) = read_chunk(client).await;
            assert_eq!(cookie, 2 * i + 1);
            flushed.push(match kind {
                reply::TYPE_NONE => 0,
                reply::TYPE_ERROR => u32::from_be_bytes(payload[..4].try_into().unwrap()),
                other => panic!("unexpected chunk type {other}"),
            });
        }
        flushed
    }

    /// A client that follows each write with a FLUSH has, once the pattern is clear (8
    /// pairs), each write flushed ahead of its FLUSH, which is still answered after a
    /// flush of its own (a no-op when the flush ahead covered everything).
    #[tokio::test]
    async fn writes_each_followed_by_a_flush_are_flushed_ahead() {
        let (_tmp, backend) = counted_direct_export(None);
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        assert_eq!(write_flush_pairs(&mut client, 20).await, [0; 20]);
        let flushes = backend.flushes.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            flushes,
            20 + 12,
            "the FLUSHes, and the 9th to 20th writes ahead"
        );
        let stored = backend.inner.read(0, 20 * 4096).await.unwrap();
        for i in 0..20 {
            assert!(stored.bytes()[i * 4096..(i + 1) * 4096]
                .iter()
                .all(|&b| b == i as u8 + 1));
        }
        // Writes not followed by FLUSHes are not flushed.
        let batch: Vec<u8> = (0..4u64)
            .flat_map(|i| {
                let mut r = request(cmd::WRITE, 0, 100 + i, i * 4096, 4096);
                r.extend(vec![7u8; 4096]);
                r
            })
            .collect();
        client.write_all(&batch).await.unwrap();
        for _ in 0..4 {
            assert_eq!(read_chunk(&mut client).await.1, reply::TYPE_NONE);
        }
        let after = backend.flushes.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(after, 32, "a flush without a FLUSH to follow");
    }

    /// A flush ahead that fails fails the client's FLUSH after it, though a sync then
    /// would succeed (the failed one may have consumed the file's error), and only that
    /// FLUSH.
    #[tokio::test]
    async fn a_failed_flush_ahead_fails_the_flush_it_was_ahead_of() {
        // Flushes 1 to 8 are the client's, 9 and 10 the 9th write's ahead and its FLUSH's,
        // and 11 the 10th write's ahead.
        let (_tmp, backend) = counted_direct_export(Some(11));
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        let flushed = write_flush_pairs(&mut client, 12).await;
        let eio = NbdError::Io as u32;
        assert_eq!(flushed, [0, 0, 0, 0, 0, 0, 0, 0, 0, eio, 0, 0]);
    }

    /// Writes whose payloads arrive whole are copied from the read buffer straight into
    /// the backend (no buffer of their own, no backend future), each is answered once
    /// with its own status, and the data lands; a failing one fails alone.
    #[tokio::test]
    async fn writes_that_arrive_whole_are_written_inline_and_answered_each() {
        let backend = Arc::new(CountingReads::new(Some(3 << 16)));
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        let mut burst = Vec::new();
        let mut expected = Vec::new();
        for i in 0..6u64 {
            let len = if i % 2 == 0 { 65536 } else { 4096 };
            let data: Vec<u8> = (0..len).map(|j| (j as u64 * 13 + i) as u8).collect();
            burst.extend(request(cmd::WRITE, 0, 100 + i, i << 16, len as u64));
            burst.extend(&data);
            if i != 3 {
                expected.push((i << 16, data));
            }
        }
        client.write_all(&burst).await.unwrap();
        let mut answered = std::collections::HashMap::new();
        for _ in 0..6 {
            let (flags, kind, cookie, _) = read_chunk(&mut client).await;
            assert!(flags & reply::FLAG_DONE != 0);
            assert!(
                answered.insert(cookie, kind).is_none(),
                "one reply per write"
            );
        }
        for i in 0..6u64 {
            let want = if i == 3 {
                reply::TYPE_ERROR
            } else {
                reply::TYPE_NONE
            };
            assert_eq!(answered[&(100 + i)], want, "write {i}");
        }
        assert_eq!(
            backend
                .inline_writes
                .load(std::sync::atomic::Ordering::SeqCst),
            6
        );
        assert_eq!(backend.writes.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_landed(&backend, expected).await;
    }

    /// A write that would land as it is parsed (inline, or received into the export's
    /// pages) over a change read before it on the same connection, whose future has not
    /// started yet, waits for it: overlapping changes land in the order they came. A
    /// write over nothing waiting still goes inline.
    #[tokio::test]
    async fn a_write_parsed_over_a_change_not_yet_started_lands_after_it() {
        let backend = Arc::new(CountingReads::new(None));
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        let mut burst = Vec::new();
        // A TRIM, then a small write over it, which would go inline.
        burst.extend(request(cmd::WRITE, 0, 1, 0, 4096));
        burst.extend(vec![1u8; 4096]);
        burst.extend(request(cmd::TRIM, 0, 2, 0, 4096));
        burst.extend(request(cmd::WRITE, 0, 3, 0, 512));
        burst.extend(vec![2u8; 512]);
        // Over nothing waiting: inline, as before.
        burst.extend(request(cmd::WRITE, 0, 4, 8 << 20, 4096));
        burst.extend(vec![4u8; 4096]);
        client.write_all(&burst).await.unwrap();
        for _ in 0..4 {
            let (_, kind, cookie, _) = read_chunk(&mut client).await;
            assert_eq!(kind, reply::TYPE_NONE, "request {cookie}");
        }
        let mut first = vec![2u8; 512];
        first.resize(4096, 0);
        assert_landed(&backend, vec![(0, first), (8 << 20, vec![4u8; 4096])]).await;
        assert!(
            backend
                .inline_writes
                .load(std::sync::atomic::Ordering::SeqCst)
                >= 2
        );

        // A write whose payload came in two reads starts as a future; a small write over
        // it, parsed right after, waits for it.
        let data: Vec<u8> = (0..20_000).map(|j| (j % 251) as u8).collect();
        let mut head = request(cmd::WRITE, 0, 10, 16 << 20, data.len() as u64);
        head.extend(&data[..5_000]);
        client.write_all(&head).await.unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let mut rest = data[5_000..].to_vec();
        rest.extend(request(cmd::WRITE, 0, 11, (16 << 20) + 100, 512));
        rest.extend(vec![9u8; 512]);
        client.write_all(&rest).await.unwrap();
        for _ in 0..2 {
            let (_, kind, cookie, _) = read_chunk(&mut client).await;
            assert_eq!(kind, reply::TYPE_NONE, "request {cookie}");
        }
        let mut want = data.clone();
        want[100..612].fill(9);
        assert_landed(&backend, vec![(16 << 20, want)]).await;

        // A page-aligned write received into the export's pages, over a TRIM before it.
        let memory = Arc::new(MemoryBackend::new(64 << 20, false));
        let mut client = connect_to(Arc::clone(&memory) as Arc<dyn Backend>).await;
        let big = 2 * MIN_POOLED;
        let mut burst = request(cmd::TRIM, 0, 20, 1 << 20, big as u64);
        burst.extend(request(cmd::WRITE, 0, 21, 1 << 20, big as u64));
        burst.extend(vec![3u8; big]);
        client.write_all(&burst).await.unwrap();
        for _ in 0..2 {
            let (_, kind, cookie, _) = read_chunk(&mut client).await;
            assert_eq!(kind, reply::TYPE_NONE, "request {cookie}");
        }
        let stored = memory.read(1 << 20, big).await.unwrap();
        assert!(
            stored.bytes().iter().all(|&b| b == 3),
            "the TRIM landed after the paged write over it"
        );
    }

    /// Past [`MAX_CHANGES_NOT_STARTED`] changes not yet started, the list stands for the
    /// whole export: a write over none of them then goes as a future too, and lands.
    #[tokio::test]
    async fn many_changes_not_yet_started_hold_back_every_write_parsed_after_them() {
        let backend = Arc::new(CountingReads::new(None));
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        let trims = MAX_CHANGES_NOT_STARTED as u64 + 10;
        let mut burst = Vec::new();
        for i in 0..trims {
            burst.extend(request(cmd::TRIM, 0, i, i * 8192, 4096));
        }
        burst.extend(request(cmd::WRITE, 0, trims, 32 << 20, 4096));
        burst.extend(vec![5u8; 4096]);
        client.write_all(&burst).await.unwrap();
        for _ in 0..=trims {
            let (_, kind, cookie, _) = read_chunk(&mut client).await;
            assert_eq!(kind, reply::TYPE_NONE, "request {cookie}");
        }
        assert_landed(&backend, vec![(32 << 20, vec![5u8; 4096])]).await;
        let ordering = std::sync::atomic::Ordering::SeqCst;
        assert_eq!(backend.inline_writes.load(ordering), 0);
        assert_eq!(backend.writes.load(ordering), 1);
    }

    /// Writes whose header arrives with only part of the payload, the rest a little later,
    /// land whole and leave the connection in step, whichever way the payload is gathered:
    /// in the read buffer (small), in a pooled buffer (large), in the export's pages
    /// (large and page-aligned) or in pieces (over a megabyte), with the part that came
    /// first larger or smaller than what remains.
    #[tokio::test]
    async fn writes_whose_payload_arrives_in_two_parts_land_whole() {
        let backend = Arc::new(CountingReads::new(None));
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        let cases: [(u64, usize, usize); 6] = [
            (512, 20_000, 5_000),
            (512 + (2 << 20), MIN_POOLED + 100, 40 * 1024),
            (4 << 20, 4 * MIN_POOLED, 40 * 1024),
            (8 << 20, 4 * MIN_POOLED, 3 * MIN_POOLED),
            (512 + (12 << 20), WRITE_PIECE as usize + 4097, 100 * 1024),
            (16 << 20, 2 * WRITE_PIECE as usize, WRITE_PIECE as usize + 1),
        ];
        let patience = std::time::Duration::from_secs(10);
        let mut expected = Vec::new();
        for (i, &(offset, len, first)) in cases.iter().enumerate() {
            let cookie = 40 + i as u64;
            let data: Vec<u8> = (0..len).map(|j| ((j * 11 + i * 3) % 241) as u8).collect();
            let mut head = request(cmd::WRITE, 0, cookie, offset, len as u64);
            head.extend(&data[..first]);
            client.write_all(&head).await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            client.write_all(&data[first..]).await.unwrap();
            let (flags, kind, got, _) = tokio::time::timeout(patience, read_chunk(&mut client))
                .await
                .unwrap_or_else(|_| panic!("no reply to the write of {len} bytes"));
            assert_eq!((got, kind), (cookie, reply::TYPE_NONE), "{len} bytes");
            assert!(flags & reply::FLAG_DONE != 0);
            // In step: the next request is parsed as one, and reads back the write's end.
            let tail = 4096.min(len);
            let at = offset + (len - tail) as u64;
            client
                .write_all(&request(cmd::READ, 0, cookie + 100, at, tail as u64))
                .await
                .unwrap();
            let (_, kind, got, payload) = tokio::time::timeout(patience, read_chunk(&mut client))
                .await
                .unwrap_or_else(|_| panic!("no reply to the read after {len} bytes"));
            assert_eq!((got, kind), (cookie + 100, reply::TYPE_OFFSET_DATA));
            assert!(
                payload[8..] == data[len - tail..],
                "{len} bytes: wrong tail"
            );
            expected.push((offset, data));
        }
        assert_landed(&backend, expected).await;
    }

    /// Serves `backend` over a real socket pair (not an in-memory pipe, so socket reads end
    /// where the kernel's buffers do) and negotiates structured replies.
    async fn over_a_socket(backend: &Arc<CountingReads>) -> tokio::net::UnixStream {
        let (client, server) = tokio::net::UnixStream::pair().unwrap();
        serve_and_negotiate(Arc::clone(backend) as Arc<dyn Backend>, client, server).await
    }

    /// Asserts that each `(offset, data)` write is what the backend now holds there.
    async fn assert_landed(backend: &CountingReads, expected: Vec<(u64, Vec<u8>)>) {
        for (offset, data) in expected {
            let stored = backend.inner.read(offset, data.len()).await.unwrap();
            assert!(
                stored.bytes()[..] == data[..],
                "write at {offset} landed wrong"
            );
        }
    }

    /// Large writes with nothing between them, over a real socket: whether a payload is
    /// read straight into its own buffer or copied from the read buffer depends on where
    /// each socket read ends, and every byte still lands where its write said, a small write
    /// among them included, and a read after them returns what was written.
    #[tokio::test]
    async fn large_writes_sent_back_to_back_with_nothing_between_land_whole() {
        let backend = Arc::new(CountingReads::new(None));
        let client = over_a_socket(&backend).await;
        let sizes = [
            MIN_POOLED,
            4 * MIN_POOLED,
            MIN_POOLED + 1,
            LARGE_PAYLOAD as usize + 17,
            3,
            2 * MIN_POOLED,
        ];
        let mut stream = Vec::new();
        let mut expected = Vec::new();
        let mut at = 0u64;
        for (i, &len) in sizes.iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|j| ((i * 13 + j * 5) % 253) as u8).collect();
            stream.extend(request(cmd::WRITE, 0, i as u64, at, len as u64));
            stream.extend(&data);
            expected.push((at, data));
            at += len as u64;
        }
        let first = expected[0].1.clone();
        stream.extend(request(cmd::READ, 0, 99, 0, first.len() as u64));
        let (mut rx, mut tx) = client.into_split();
        let sender = tokio::spawn(async move { tx.write_all(&stream).await.unwrap() });
        let mut answered = 0;
        let mut read_back = Vec::new();
        while answered < sizes.len() + 1 {
            let (flags, kind, cookie, payload) = read_chunk(&mut rx).await;
            assert!(kind != reply::TYPE_ERROR, "cookie {cookie} failed");
            if cookie == 99 && kind == reply::TYPE_OFFSET_DATA {
                read_back.extend_from_slice(&payload[8..]);
            }
            if flags & reply::FLAG_DONE != 0 {
                answered += 1;
            }
        }
        sender.await.unwrap();
        assert!(
            read_back == first,
            "the read after the writes returned other data"
        );
        assert_landed(&backend, expected).await;
    }

    /// Large writes sent back to back, with small requests among them, all land in place:
    /// after each large payload the socket is read a little at a time, so the next header
    /// and the first bytes of its payload arrive in the read buffer and the rest straight
    /// in the payload's own buffer.
    #[tokio::test]
    async fn large_writes_sent_back_to_back_land_whole_with_small_requests_between() {
        let backend = Arc::new(CountingReads::new(None));
        let client = over_a_socket(&backend).await;
        let sizes = [
            LARGE_PAYLOAD as usize,
            LARGE_PAYLOAD as usize + 17,
            3,
            2 * LARGE_PAYLOAD as usize + 4095,
            MIN_POOLED,
            LARGE_PAYLOAD as usize - 1,
        ];
        let mut stream = Vec::new();
        let mut expected = Vec::new();
        let mut at = 0u64;
        for (i, &len) in sizes.iter().enumerate() {
            let data: Vec<u8> = (0..len).map(|j| ((i * 31 + j * 7) % 251) as u8).collect();
            stream.extend(request(cmd::WRITE, 0, i as u64, at, len as u64));
            stream.extend(&data);
            // A flush after each write: a small request between the large ones.
            stream.extend(request(cmd::FLUSH, 0, 100 + i as u64, 0, 0));
            expected.push((at, data));
            at += len as u64 + 512;
        }
        let (mut rx, mut tx) = client.into_split();
        let sender = tokio::spawn(async move { tx.write_all(&stream).await.unwrap() });
        let mut answered = 0;
        while answered < 2 * sizes.len() {
            let (flags, kind, cookie, _) = read_chunk(&mut rx).await;
            assert_eq!(kind, reply::TYPE_NONE, "cookie {cookie} failed");
            assert!(flags & reply::FLAG_DONE != 0);
            answered += 1;
        }
        sender.await.unwrap();
        assert_landed(&backend, expected).await;
    }

    /// Page-aligned writes to a memory export, sent back to back with small requests and
    /// unaligned writes between them, are received straight into pages the backend takes
    /// over, and every byte lands in place, twice over (the second round reuses the pages
    /// the first replaced); a read after them sees what was written.
    #[tokio::test]
    async fn aligned_writes_received_into_the_backends_pages_land_whole() {
        let memory = Arc::new(MemoryBackend::new(64 << 20, false));
        let page = PAGE_SIZE as usize;
        let (client, server) = tokio::net::UnixStream::pair().unwrap();
        let client =
            serve_and_negotiate(Arc::clone(&memory) as Arc<dyn Backend>, client, server).await;
        let (mut rx, mut tx) = client.into_split();
        // (offset, length), none overlapping: aligned writes of one page up to 32 MiB, an
        // unaligned one and a small one.
        let writes = [
            (0, page),
            (4 * page, 4 * page),
            (16 * page, 3 * WRITE_PIECE as usize + page),
            (100 * page + 512, 2 * page),
            (200 * page, 3),
            (256 * page, MAX_PAYLOAD as usize),
        ];
        let mut expected = vec![0u8; 64 << 20];
        let check = 40 * page;
        for round in 0..2 {
            let mut stream = Vec::new();
            for (i, &(offset, len)) in writes.iter().enumerate() {
                let data: Vec<u8> = (0..len)
                    .map(|j| ((round * 7 + i * 29 + j * 3) % 241) as u8)
                    .collect();
                stream.extend(request(cmd::WRITE, 0, i as u64, offset as u64, len as u64));
                stream.extend(&data);
                stream.extend(request(cmd::FLUSH, 0, 100 + i as u64, 0, 0));
                expected[offset..offset + len].copy_from_slice(&data);
            }
            stream.extend(request(cmd::READ, 0, 99, 0, check as u64));
            tx.write_all(&stream).await.unwrap();
            let mut answered = 0;
            // Holes (pages never written) come as OFFSET_HOLE chunks and stay zero here.
            let mut read_back = vec![0u8; check];
            while answered < 2 * writes.len() + 1 {
                let (flags, kind, cookie, payload) = read_chunk(&mut rx).await;
                assert!(kind != reply::TYPE_ERROR, "cookie {cookie} failed");
                if cookie == 99 && kind == reply::TYPE_OFFSET_DATA {
                    let at = u64::from_be_bytes(payload[..8].try_into().unwrap()) as usize;
                    read_back[at..at + payload.len() - 8].copy_from_slice(&payload[8..]);
                }
                if flags & reply::FLAG_DONE != 0 {
                    answered += 1;
                }
            }
            assert!(
                read_back == expected[..check],
                "round {round}: the read differs"
            );
            let stored = memory.read(0, 64 << 20).await.unwrap().bytes();
            assert!(
                stored[..] == expected[..],
                "round {round}: a write landed wrong"
            );
        }
        // The 3 MiB and 32 MiB writes cannot be taken from the read buffer whole: at least
        // their pages were handed over, in both rounds.
        let at_least = 2 * (3 * WRITE_PIECE as usize + page + MAX_PAYLOAD as usize) / page;
        assert!(
            memory.pages_adopted() >= at_least as u64,
            "{} pages handed over",
            memory.pages_adopted()
        );
    }

    /// The error and message of the structured error chunk that answers `cookie`.
    async fn read_error_chunk(client: &mut DuplexStream, cookie: u64) -> (u32, String) {
        let (flags, kind, answered, payload) = read_chunk(client).await;
        assert_eq!((kind, answered), (reply::TYPE_ERROR, cookie));
        assert_ne!(flags & reply::FLAG_DONE, 0);
        let error = u32::from_be_bytes(payload[..4].try_into().unwrap());
        let message_len = u16::from_be_bytes(payload[4..6].try_into().unwrap()) as usize;
        let message = String::from_utf8(payload[6..6 + message_len].to_vec()).unwrap();
        (error, message)
    }

    #[tokio::test]
    async fn only_a_refused_fast_zero_is_answered_as_zeroing_that_would_not_be_fast() {
        let mut backend = CountingReads::new(None);
        backend.trim_unsupported = true;
        let mut client = connect_to(Arc::new(backend)).await;
        let not_supported = NbdError::NotSup as u32;

        // The memory export cannot zero fast without dropping pages, which NO_HOLE forbids.
        let flags = crate::wire::cmd_flags::FAST_ZERO | crate::wire::cmd_flags::NO_HOLE;
        let zero = request(cmd::WRITE_ZEROES, flags, 1, 0, 4096);
        client.write_all(&zero).await.unwrap();
        let (error, message) = read_error_chunk(&mut client, 1).await;
        assert_eq!(
            (error, message.as_str()),
            (not_supported, "zeroing would not be fast")
        );

        // The same error code from the operating system is a failure, and says what failed.
        let trim = request(cmd::TRIM, 0, 2, 8192, 4096);
        client.write_all(&trim).await.unwrap();
        let (error, message) = read_error_chunk(&mut client, 2).await;
        assert_eq!(error, not_supported);
        assert!(
            message.starts_with("trim of 4096 bytes at offset 8192 failed"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn a_piece_of_a_large_write_that_fails_fails_the_write_once() {
        let second_piece = 4096 + u64::from(WRITE_PIECE);
        let backend = Arc::new(CountingReads::new(Some(second_piece)));
        let mut client = connect_to(Arc::clone(&backend) as Arc<dyn Backend>).await;
        let data = vec![9u8; 2 * WRITE_PIECE as usize + 4096];
        let kind = write_and_answer(&mut client, &data).await;
        assert_eq!(kind, reply::TYPE_ERROR);
        assert_eq!(backend.writes.load(std::sync::atomic::Ordering::SeqCst), 3);
    }

    /// Negotiates structured replies on `backend`.
    async fn connect_to(backend: Arc<dyn Backend>) -> DuplexStream {
        let (client, server) = tokio::io::duplex(1 << 20);
        serve_and_negotiate(backend, client, server).await
    }

    /// Serves `backend` on `server` and negotiates structured replies from `client`.
    async fn serve_and_negotiate<C, S>(backend: Arc<dyn Backend>, client: C, server: S) -> C
    where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        S: Stream,
    {
        serve_and_negotiate_as(backend, client, server, true).await
    }

    /// [`serve_and_negotiate`], with structured replies or without (simple replies).
    async fn serve_and_negotiate_as<C, S>(
        backend: Arc<dyn Backend>,
        client: C,
        server: S,
        structured: bool,
    ) -> C
    where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        S: Stream,
    {
        let (stop_tx, stop_rx) = watch::channel(false);
        let (client, served) = serve_stoppable(backend, client, server, structured, stop_rx).await;
        tokio::spawn(async move {
            let _keep = stop_tx;
            let _ = served.await;
        });
        client
    }

    /// [`serve_and_negotiate_as`], the server stopping when `stop` turns true; also
    /// answers the connection's task.
    async fn serve_stoppable<C, S>(
        backend: Arc<dyn Backend>,
        mut client: C,
        server: S,
        structured: bool,
        stop_rx: watch::Receiver<bool>,
    ) -> (C, tokio::task::JoinHandle<()>)
    where
        C: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
        S: Stream,
    {
        let export = Arc::new(Export::new(String::new(), String::new(), backend));
        let config = Arc::new(ServerConfig {
            exports: vec![export],
            handshake_timeout: Duration::from_secs(5),
            max_merge: crate::server::DEFAULT_MAX_MERGE,
            max_connections: crate::server::DEFAULT_MAX_CONNECTIONS,
            tcp: crate::tcp::TcpSettings::default(),
            clients: Default::default(),
        });
        let (alive_tx, _alive_rx) = tokio::sync::mpsc::channel(1);
        let served = tokio::spawn(handle_connection(server, config, stop_rx, alive_tx));
        let mut greeting = [0u8; 18];
        client.read_exact(&mut greeting).await.unwrap();
        let mut hello = (client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES)
            .to_be_bytes()
            .to_vec();
        if structured {
            hello.extend(ClientOption::StructuredReply.encode());
        }
        hello.extend(
            ClientOption::Go(InfoRequest {
                name: String::new(),
                requests: vec![],
            })
            .encode(),
        );
        client.write_all(&hello).await.unwrap();
        let mut acks = 0;
        let mut buf = Vec::new();
        while acks < 1 + usize::from(structured) {
            let mut chunk = [0u8; 512];
            let n = client.read(&mut chunk).await.unwrap();
            buf.extend_from_slice(&chunk[..n]);
            while let Some((reply, used)) = OptionReply::decode(&buf).unwrap() {
                buf.drain(..used);
                if reply.reply_type == crate::wire::rep::ACK {
                    acks += 1;
                }
            }
        }
        (client, served)
    }

    /// Reads the next reply chunk: its flags, type, cookie and payload. The success of a
    /// command without data comes as a simple reply (see `ReplyEncoder::ok`), which this
    /// reads as the `NONE` chunk it stands for.
    async fn read_chunk(client: &mut (impl AsyncReadExt + Unpin)) -> (u16, u16, u64, Vec<u8>) {
        match read_reply_header(client).await {
            DecodedReply::Simple { error, cookie } => {
                assert_eq!(error, 0, "only successes come as simple replies");
                (reply::FLAG_DONE, reply::TYPE_NONE, cookie, Vec::new())
            }
            DecodedReply::Chunk {
                flags,
                kind,
                cookie,
                payload_len,
                ..
            } => {
                let payload = read_exactly(client, payload_len as usize).await;
                (flags, kind, cookie, payload)
            }
        }
    }

    /// Reads the next reply's header on a connection with structured replies: 16 bytes,
    /// and 4 more unless they are a whole simple reply.
    async fn read_reply_header(client: &mut (impl AsyncReadExt + Unpin)) -> DecodedReply {
        let mut header = read_exactly(client, 16).await;
        if let Some((simple @ DecodedReply::Simple { .. }, 16)) =
            DecodedReply::decode(&header).unwrap()
        {
            return simple;
        }
        header.extend(read_exactly(client, 4).await);
        DecodedReply::decode(&header).unwrap().unwrap().0
    }

    async fn read_exactly(client: &mut (impl AsyncReadExt + Unpin), n: usize) -> Vec<u8> {
        let mut data = vec![0u8; n];
        client.read_exact(&mut data).await.unwrap();
        data
    }

    #[tokio::test]
    async fn a_large_read_streams_as_several_chunks_that_cover_it_exactly() {
        let mut client = connect().await;
        let len = 3 * STREAM_PIECE as usize + 12345;
        let pattern: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let write = request(cmd::WRITE, 0, 1, 4096, len as u64);
        client.write_all(&write).await.unwrap();
        client.write_all(&pattern).await.unwrap();
        let (_, kind, cookie, _) = read_chunk(&mut client).await;
        assert_eq!((kind, cookie), (reply::TYPE_NONE, 1));

        let read = request(cmd::READ, 0, 2, 4096, len as u64);
        client.write_all(&read).await.unwrap();
        let mut assembled = vec![0u8; len];
        let mut covered = 0;
        let mut chunks = 0;
        loop {
            let (flags, kind, cookie, payload) = read_chunk(&mut client).await;
            assert_eq!(cookie, 2);
            match kind {
                reply::TYPE_OFFSET_DATA => {
                    let at = u64::from_be_bytes(payload[..8].try_into().unwrap()) as usize - 4096;
                    assembled[at..at + payload.len() - 8].copy_from_slice(&payload[8..]);
                    covered += payload.len() - 8;
                    chunks += 1;
                }
                reply::TYPE_NONE => {}
                other => panic!("unexpected chunk type {other}"),
            }
            if flags & reply::FLAG_DONE != 0 {
                break;
            }
        }
        assert_eq!(chunks, 4, "the read left as one chunk per piece");
        assert_eq!(covered, len);
        assert_eq!(assembled, pattern);
    }

    /// A streamed read whose second piece fails: the other pieces' data arrives, then one
    /// error chunk, which alone carries the done flag, and the connection serves on.
    #[tokio::test]
    async fn a_large_read_with_a_failed_piece_ends_with_one_error_chunk() {
        let mut backend = CountingReads::new(None);
        backend.fail_read_at = Some(4096 + u64::from(STREAM_PIECE));
        let mut client = connect_to(Arc::new(backend)).await;
        let len = 3 * u64::from(STREAM_PIECE) + 12345;
        client
            .write_all(&request(cmd::READ, 0, 7, 4096, len))
            .await
            .unwrap();
        let (mut data, mut errors) = (0, 0);
        loop {
            let (flags, kind, cookie, payload) = read_chunk(&mut client).await;
            assert_eq!(cookie, 7);
            let done = flags & reply::FLAG_DONE != 0;
            match kind {
                reply::TYPE_OFFSET_DATA => {
                    assert!(!done, "a data chunk ended a read that failed");
                    data += payload.len() - 8;
                }
                // Nothing was written: the data reads as holes.
                reply::TYPE_OFFSET_HOLE => {
                    assert!(!done, "a hole chunk ended a read that failed");
                    data += u32::from_be_bytes(payload[8..12].try_into().unwrap()) as usize;
                }
                reply::TYPE_ERROR => errors += 1,
                other => panic!("unexpected chunk type {other}"),
            }
            if done {
                break;
            }
        }
        assert_eq!(errors, 1);
        assert_eq!(data as u64, len - u64::from(STREAM_PIECE));
        // The connection still answers.
        client
            .write_all(&request(cmd::READ, 0, 8, 0, 4096))
            .await
            .unwrap();
        let (flags, kind, cookie, _) = read_chunk(&mut client).await;
        assert_eq!((kind, cookie), (reply::TYPE_OFFSET_HOLE, 8));
        assert_ne!(flags & reply::FLAG_DONE, 0);
    }

    /// A file export of `len` bytes of pattern `i * step % modulo` (in the page cache, as
    /// just written), with its reads counted; the file and the pattern come back with it.
    fn counted_file_export(
        len: usize,
        step: usize,
        modulo: usize,
    ) -> (
        tempfile::NamedTempFile,
        Vec<u8>,
        Arc<CountingReads<crate::backend::file::FileBackend>>,
    ) {
        let pattern: Vec<u8> = (0..len).map(|i| (i * step % modulo) as u8).collect();
        let (tmp, backend) = counted_export(&pattern, None, None);
        (tmp, pattern, backend)
    }

    /// [`counted_file_export`] that hands out large cached reads from its mapping when
    /// asked, and splices at most `splices_allowed` reads or pieces.
    fn mapping_file_export(
        len: usize,
        step: usize,
        modulo: usize,
        splices_allowed: usize,
    ) -> (
        tempfile::NamedTempFile,
        Vec<u8>,
        Arc<CountingReads<crate::backend::file::FileBackend>>,
    ) {
        let (tmp, pattern, backend) = counted_file_export(len, step, modulo);
        let mut backend = Arc::into_inner(backend).unwrap();
        backend.splices_allowed = splices_allowed;
        backend.map_reads = true;
        (tmp, pattern, Arc::new(backend))
    }

    /// Reads of an 8 MiB export, (cookie, offset, length), for the tests of cached reads:
    /// whole reads, one longer than three stream pieces, one of 64 KiB, a small one and one
    /// that ends at the end of the export.
    const MIXED_READS: [(u64, u64, u64); 5] = [
        (1, 0, 200_000),
        (2, 300_001, 3 * STREAM_PIECE as u64 + 4097),
        (3, 5 << 20, 65536),
        (4, 7 << 20, 4096),
        (5, (8 << 20) - 131_072, 131_072),
    ];

    /// Sends every read of `reads` (cookie, offset, length) before reading any reply,
    /// then reads the structured replies and checks that each read got all its bytes, equal
    /// to `pattern`'s.
    async fn send_reads_and_check_structured_replies(
        client: &mut (impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin),
        reads: &[(u64, u64, u64)],
        pattern: &[u8],
    ) {
        for &(cookie, offset, length) in reads {
            client
                .write_all(&request(cmd::READ, 0, cookie, offset, length))
                .await
                .unwrap();
        }
        let mut assembled: HashMap<u64, (Vec<u8>, usize)> = reads
            .iter()
            .map(|&(c, _, l)| (c, (vec![0u8; l as usize], 0)))
            .collect();
        let mut finished = 0;
        while finished < reads.len() {
            let (flags, kind, cookie, payload) = read_chunk(client).await;
            let &(_, offset, _) = reads.iter().find(|r| r.0 == cookie).unwrap();
            if kind == reply::TYPE_OFFSET_DATA {
                let at = u64::from_be_bytes(payload[..8].try_into().unwrap()) - offset;
                let (buf, covered) = assembled.get_mut(&cookie).unwrap();
                buf[at as usize..at as usize + payload.len() - 8].copy_from_slice(&payload[8..]);
                *covered += payload.len() - 8;
            } else {
                assert_eq!(kind, reply::TYPE_NONE, "cookie {cookie}");
            }
            if flags & reply::FLAG_DONE != 0 {
                finished += 1;
            }
        }
        for &(cookie, offset, length) in reads {
            let (buf, covered) = &assembled[&cookie];
            assert_eq!(*covered as u64, length, "cookie {cookie}");
            assert!(
                buf[..] == pattern[offset as usize..(offset + length) as usize],
                "cookie {cookie}: wrong bytes"
            );
        }
    }

    /// Reads of cached file data over a real socket leave through a pipe: a whole read, a
    /// streamed one, several in flight at once, and a simple reply; every byte matches,
    /// and small reads are still copied.
    #[tokio::test]
    async fn cached_file_reads_are_spliced_into_the_socket_byte_for_byte() {
        let (tmp, pattern, backend) = counted_file_export(8 << 20, 13, 251);
        let (client, server) = tokio::net::UnixStream::pair().unwrap();
        let mut client = serve_and_negotiate(backend.clone(), client, server).await;
        send_reads_and_check_structured_replies(&mut client, &MIXED_READS, &pattern).await;
        let spliced = backend.spliced.load(std::sync::atomic::Ordering::SeqCst);
        if crate::backend::splice::splice_cached(
            &std::fs::File::open(tmp.path()).unwrap(),
            0,
            65536,
        )
        .is_some()
        {
            // 1 + 4 pieces of equal length + 1 + 1: the 4 KiB read is too small to be
            // worth a pipe, and is copied.
            assert_eq!(spliced, 7, "reads that went through a pipe");
            assert_eq!(backend.reads.load(std::sync::atomic::Ordering::SeqCst), 1);
        }
    }

    /// Large cached reads that are not spliced (here: no pipe is ever free, as when the
    /// client was measured to take copies faster) are copied into the socket from the
    /// file's mapping: whole reads and the whole pieces of a streamed one, down to a page,
    /// several in flight; every byte matches.
    #[tokio::test]
    async fn cached_file_reads_that_are_not_spliced_leave_from_the_mapping_byte_for_byte() {
        let (tmp, pattern, backend) = mapping_file_export(8 << 20, 13, 251, 0);
        let (client, server) = tokio::net::UnixStream::pair().unwrap();
        let mut client = serve_and_negotiate(backend.clone(), client, server).await;
        send_reads_and_check_structured_replies(&mut client, &MIXED_READS, &pattern).await;
        assert_eq!(backend.spliced.load(std::sync::atomic::Ordering::SeqCst), 0);
        let file = std::fs::File::open(tmp.path()).unwrap();
        if crate::backend::splice::cached(&file, 0, 8 << 20) == Some(true) {
            // 1 + 4 + 1 + 1 + 1 mapped: the second read's short last piece (4,097 bytes)
            // and the 4 KiB read too, as they are a page or more.
            assert_eq!(backend.mapped.load(std::sync::atomic::Ordering::SeqCst), 8);
            assert_eq!(backend.reads.load(std::sync::atomic::Ordering::SeqCst), 0);
        }
    }

    /// A stream that is not a kernel socket never gets mapped bytes, even when no read is
    /// spliced: only a kernel socket's `writev` turns a page that cannot be read back into
    /// an error for that one call. The reads are copied, byte for byte.
    #[tokio::test]
    async fn a_stream_that_is_not_a_kernel_socket_never_gets_mapped_reads() {
        let (_tmp, pattern, backend) = mapping_file_export(8 << 20, 13, 251, 0);
        let (client, server) = tokio::io::duplex(1 << 20);
        let mut client = serve_and_negotiate(backend.clone(), client, server).await;
        send_reads_and_check_structured_replies(&mut client, &MIXED_READS, &pattern).await;
        assert_eq!(backend.mapped.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(backend.spliced.load(std::sync::atomic::Ordering::SeqCst), 0);
    }

    /// With simple replies, a cached read too long for one pipe leaves through several,
    /// each spliced as the socket reaches it, however long the read; replies of several
    /// reads in flight stay whole and in step, and every byte matches.
    #[tokio::test]
    async fn long_simple_reply_reads_are_spliced_a_piece_at_a_time_byte_for_byte() {
        let (tmp, pattern, backend) = counted_file_export(16 << 20, 11, 241);
        let (client, server) = tokio::net::UnixStream::pair().unwrap();
        let mut client = serve_and_negotiate_as(backend.clone(), client, server, false).await;
        let piece = u64::from(STREAM_PIECE);
        // (cookie, offset, length): three pieces, 4 MiB, 8 MiB and a byte (17 pieces), and
        // one pipe's worth; all sent before any reply is read.
        let reads = [
            (1u64, 4097u64, 2 * piece + 12_345),
            (2, 1 << 20, 4 << 20),
            (3, 6 << 20, (8 << 20) + 1),
            (4, 15 << 20, piece),
        ];
        for &(cookie, offset, length) in &reads {
            client
                .write_all(&request(cmd::READ, 0, cookie, offset, length))
                .await
                .unwrap();
        }
        for _ in 0..reads.len() {
            let (cookie, data) = read_simple_reply(&mut client, &reads).await;
            let &(_, offset, length) = reads.iter().find(|r| r.0 == cookie).unwrap();
            assert!(
                data.unwrap()[..] == pattern[offset as usize..(offset + length) as usize],
                "cookie {cookie}: wrong bytes"
            );
        }
        let probe = std::fs::File::open(tmp.path()).unwrap();
        if crate::backend::splice::splice_cached(&probe, 0, 65536).is_some() {
            let spliced = backend.spliced.load(std::sync::atomic::Ordering::SeqCst);
            // The first read's pieces are of equal length: a 12,345-byte last piece would
            // be too short to splice, and would be copied.
            assert_eq!(spliced, 3 + 8 + 17 + 1, "pieces that went through a pipe");
            assert_eq!(backend.reads.load(std::sync::atomic::Ordering::SeqCst), 0);
        }
    }

    /// With structured replies, a later piece of a streamed cached read whose read fails
    /// (no pipe and no mapping for it, and the device fails) becomes an `ERROR_OFFSET`
    /// chunk for its range: the read fails with EIO, its other chunks cover the rest, and
    /// the connection goes on. (It was closed, with every other reply in flight.)
    #[tokio::test]
    async fn a_later_piece_that_fails_is_an_error_chunk_and_the_connection_goes_on() {
        let (_tmp, pattern, backend) = counted_file_export(16 << 20, 11, 241);
        let mut backend = Arc::into_inner(backend).unwrap();
        let piece = u64::from(STREAM_PIECE);
        // Three equal pieces; the first is spliced, the rest are read (no pipe, no map).
        let (offset, length) = (1 << 20, 3 * piece);
        backend.splices_allowed = 1;
        backend.fail_read_at = Some(offset + piece);
        let backend = Arc::new(backend);
        let (client, server) = tokio::net::UnixStream::pair().unwrap();
        let mut client = serve_and_negotiate(backend.clone(), client, server).await;
        client
            .write_all(&request(cmd::READ, 0, 7, offset, length))
            .await
            .unwrap();
        let (mut covered, mut errors) = (0u64, Vec::new());
        loop {
            let (flags, kind, cookie, payload) = read_chunk(&mut client).await;
            assert_eq!(cookie, 7);
            match kind {
                reply::TYPE_OFFSET_DATA => {
                    let at = u64::from_be_bytes(payload[..8].try_into().unwrap());
                    let data = &payload[8..];
                    assert!(data == &pattern[at as usize..at as usize + data.len()]);
                    covered += data.len() as u64;
                }
                reply::TYPE_ERROR | reply::TYPE_ERROR_OFFSET => {
                    errors.push((kind, u32::from_be_bytes(payload[..4].try_into().unwrap())))
                }
                _ => assert_eq!(kind, reply::TYPE_NONE),
            }
            if flags & reply::FLAG_DONE != 0 {
                break;
            }
        }
        assert_eq!(errors.len(), 1, "one error chunk: {errors:?}");
        assert_eq!(errors[0].1, NbdError::Io.code(), "{errors:?}");
        if backend.spliced.load(std::sync::atomic::Ordering::SeqCst) == 1 {
            // Streamed: the failed piece's range alone is missing.
            assert_eq!(errors[0].0, reply::TYPE_ERROR_OFFSET);
            assert_eq!(covered, length - piece);
        }
        // The connection goes on.
        send_reads_and_check_structured_replies(&mut client, &[(8, 0, 65536)], &pattern).await;
    }

    /// With simple replies, the later pieces of a long cached read that cannot get a pipe
    /// (here: only one splice is allowed, the first piece's) are copied into the socket
    /// from the file's mapping, each as the socket reaches it, not read into a buffer.
    #[tokio::test]
    async fn later_pieces_that_get_no_pipe_leave_from_the_mapping_byte_for_byte() {
        let (tmp, pattern, backend) = mapping_file_export(16 << 20, 11, 241, 1);
        let (client, server) = tokio::net::UnixStream::pair().unwrap();
        let mut client = serve_and_negotiate_as(backend.clone(), client, server, false).await;
        // Three pieces of 356,352 bytes but the last (348,217).
        let reads = [(1u64, 4097u64, 2 * u64::from(STREAM_PIECE) + 12_345)];
        let (cookie, offset, length) = reads[0];
        client
            .write_all(&request(cmd::READ, 0, cookie, offset, length))
            .await
            .unwrap();
        let (_, data) = read_simple_reply(&mut client, &reads).await;
        assert!(data.unwrap()[..] == pattern[offset as usize..(offset + length) as usize]);
        let file = std::fs::File::open(tmp.path()).unwrap();
        if crate::backend::splice::splice_cached(&file, 0, 65536).is_some()
            && crate::backend::splice::cached(&file, 0, 16 << 20) == Some(true)
        {
            let count =
                |c: &std::sync::atomic::AtomicUsize| c.load(std::sync::atomic::Ordering::SeqCst);
            let counts = (
                count(&backend.spliced),
                count(&backend.mapped),
                count(&backend.reads),
            );
            assert_eq!(counts, (1, 2, 0), "pieces spliced, mapped and read");
        }
    }

    /// A server-side stream that remembers the most bytes it was handed in one write.
    struct LargestWrite {
        inner: DuplexStream,
        largest: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl tokio::io::AsyncRead for LargestWrite {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut tokio::io::ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
        }
    }

    impl tokio::io::AsyncWrite for LargestWrite {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            self.poll_write_vectored(cx, &[IoSlice::new(buf)])
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            slices: &[IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            let this = self.get_mut();
            let handed = slices.iter().map(|slice| slice.len()).sum();
            this.largest
                .fetch_max(handed, std::sync::atomic::Ordering::SeqCst);
            Pin::new(&mut this.inner).poll_write_vectored(cx, slices)
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_flush(cx)
        }

        fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
        }
    }

    impl Stream for LargestWrite {}

    /// Eight 1 MiB simple-reply reads sent together are answered byte for byte, in writes
    /// of about [`WRITEV_MOST`] bytes at most (the bound, plus the one slice that crosses
    /// it: a page of the memory export at most).
    #[tokio::test]
    async fn reads_answered_together_leave_in_writes_of_bounded_size() {
        let len = 1usize << 20;
        let backend = Arc::new(MemoryBackend::new(8 << 20, false));
        let pattern: Vec<u8> = (0..8 * len).map(|i| (i * 13 % 251) as u8).collect();
        backend
            .write_inline(0, &pattern, false)
            .expect("memory writes inline")
            .unwrap();
        let (client, server) = tokio::io::duplex(1 << 20);
        let largest = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let server = LargestWrite {
            inner: server,
            largest: Arc::clone(&largest),
        };
        let mut client = serve_and_negotiate_as(backend, client, server, false).await;
        for cookie in 0..8u64 {
            let read = request(cmd::READ, 0, cookie, cookie * len as u64, len as u64);
            client.write_all(&read).await.unwrap();
        }
        for _ in 0..8 {
            let header = read_exactly(&mut client, 16).await;
            let Some((DecodedReply::Simple { error: 0, cookie }, 16)) =
                DecodedReply::decode(&header).unwrap()
            else {
                panic!("not a successful simple reply: {header:?}");
            };
            let data = read_exactly(&mut client, len).await;
            let start = cookie as usize * len;
            assert!(data[..] == pattern[start..start + len], "cookie {cookie}");
        }
        let largest = largest.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            largest <= WRITEV_MOST + PAGE_SIZE as usize,
            "{largest} bytes in one write"
        );
        assert!(
            largest >= WRITEV_MOST,
            "{largest}: the bound should have been reached"
        );
    }

    /// One simple reply from the client's side: its cookie, and its data (`length` of the
    /// read with that cookie in `reads`), or `None` when the connection ends before all of
    /// it came. Panics on an error reply.
    async fn read_simple_reply(
        client: &mut tokio::net::UnixStream,
        reads: &[(u64, u64, u64)],
    ) -> (u64, Option<Vec<u8>>) {
        let header = read_exactly(client, 16).await;
        let Some((DecodedReply::Simple { error, cookie }, 16)) =
            DecodedReply::decode(&header).unwrap()
        else {
            panic!("not a simple reply: {header:?}");
        };
        assert_eq!(error, 0, "cookie {cookie}");
        let length = reads.iter().find(|r| r.0 == cookie).unwrap().2 as usize;
        let mut data = vec![0u8; length];
        let mut filled = 0;
        while filled < length {
            match client.read(&mut data[filled..]).await.unwrap() {
                0 => return (cookie, None),
                n => filled += n,
            }
        }
        (cookie, Some(data))
    }

    /// A piece of a long cached read that can no longer be spliced when the socket reaches
    /// it (evicted, or no pipe free) is read by copying, in its place, in both reply
    /// styles; with a simple reply, one whose read then fails closes the connection, since
    /// the reply's header already said there was no error, and the client sees the reply
    /// cut short. (With structured replies it is an error chunk: the test above.)
    #[tokio::test]
    async fn pieces_of_a_long_cached_read_that_cannot_be_spliced_are_copied_or_end_the_connection()
    {
        let piece = u64::from(STREAM_PIECE);
        let length = 4 * piece;
        for (structured, fail) in [(false, false), (false, true), (true, false)] {
            let (tmp, pattern, backend) = counted_file_export(4 << 20, 7, 251);
            let probe = std::fs::File::open(tmp.path()).unwrap();
            if crate::backend::splice::splice_cached(&probe, 0, 65536).is_none() {
                return; // nothing is spliced on this kernel: the path cannot be taken
            }
            let mut backend = Arc::into_inner(backend).unwrap();
            backend.splices_allowed = 2;
            backend.fail_read_at = fail.then_some(3 * piece);
            let backend = Arc::new(backend);
            let (client, server) = tokio::net::UnixStream::pair().unwrap();
            let mut client =
                serve_and_negotiate_as(backend.clone(), client, server, structured).await;
            client
                .write_all(&request(cmd::READ, 0, 1, 0, length))
                .await
                .unwrap();
            let case = format!("structured {structured}, failing {fail}");
            if fail {
                let mut all = Vec::new();
                client.read_to_end(&mut all).await.unwrap();
                assert!(
                    (all.len() as u64) < length,
                    "{case}: the reply must be cut short"
                );
            } else if structured {
                let mut data = vec![0u8; length as usize];
                let mut covered = 0;
                loop {
                    let (flags, kind, cookie, payload) = read_chunk(&mut client).await;
                    assert_eq!(cookie, 1);
                    if kind == reply::TYPE_OFFSET_DATA {
                        let at = u64::from_be_bytes(payload[..8].try_into().unwrap()) as usize;
                        data[at..at + payload.len() - 8].copy_from_slice(&payload[8..]);
                        covered += payload.len() - 8;
                    } else {
                        assert_eq!(kind, reply::TYPE_NONE, "{case}");
                    }
                    if flags & reply::FLAG_DONE != 0 {
                        break;
                    }
                }
                assert_eq!(covered as u64, length, "{case}");
                assert!(
                    data[..] == pattern[..length as usize],
                    "{case}: wrong bytes"
                );
            } else {
                let (_, data) = read_simple_reply(&mut client, &[(1, 0, length)]).await;
                assert!(data.unwrap()[..] == pattern[..length as usize], "{case}");
            }
            assert_eq!(
                backend.spliced.load(std::sync::atomic::Ordering::SeqCst),
                2,
                "{case}"
            );
            if !fail {
                assert_eq!(
                    backend.reads.load(std::sync::atomic::Ordering::SeqCst),
                    2,
                    "{case}"
                );
            }
        }
    }

    /// A spliced read over TCP with TCP_NODELAY, one at a time: its header goes out with
    /// `MSG_MORE` so that it shares a segment with the data, and that must never leave the
    /// header waiting for a TCP timer (the cork timer is 200 ms, a delayed ACK 40 ms).
    /// 50 lone 64 KiB reads must answer well within either, and all bytes match.
    #[tokio::test]
    async fn lone_spliced_reads_over_tcp_never_wait_on_a_tcp_timer() {
        let len = 4 << 20;
        let (tmp, pattern, backend) = counted_file_export(len, 7, 253);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        client.set_nodelay(true).unwrap();
        let (server, _) = listener.accept().await.unwrap();
        server.set_nodelay(true).unwrap();
        let mut client = serve_and_negotiate(backend.clone(), client, server).await;
        let mut times = Vec::new();
        for i in 0..50u64 {
            let offset = (i * 65536 + i * 4096) % (len as u64 - 65536);
            let started = Instant::now();
            client
                .write_all(&request(cmd::READ, 0, i, offset, 65536))
                .await
                .unwrap();
            let (flags, kind, cookie, payload) = read_chunk(&mut client).await;
            times.push(started.elapsed());
            assert_eq!((cookie, kind), (i, reply::TYPE_OFFSET_DATA));
            assert_ne!(flags & reply::FLAG_DONE, 0, "one chunk");
            assert_eq!(u64::from_be_bytes(payload[..8].try_into().unwrap()), offset);
            assert!(payload[8..] == pattern[offset as usize..offset as usize + 65536]);
        }
        // A reply that waits on a timer waits every time: the median shows it, and a
        // moment's scheduling noise on a busy machine does not.
        times.sort();
        let median = times[times.len() / 2];
        assert!(
            median < Duration::from_millis(20),
            "lone 64 KiB reads took {median:?} (median): replies waited on a TCP timer"
        );
        let probe = std::fs::File::open(tmp.path()).unwrap();
        if crate::backend::splice::splice_cached(&probe, 0, 65536).is_some() {
            let spliced = backend.spliced.load(std::sync::atomic::Ordering::SeqCst);
            assert_eq!(spliced, 50, "every read went through a pipe");
        }
    }

    #[tokio::test]
    async fn a_df_read_is_one_chunk() {
        let mut client = connect().await;
        let len = 3 * STREAM_PIECE as u64;
        let read = request(cmd::READ, crate::wire::cmd_flags::DF, 3, 0, len);
        client.write_all(&read).await.unwrap();
        let header = read_exactly(&mut client, 20).await;
        let (reply, _) = DecodedReply::decode(&header).unwrap().unwrap();
        assert_eq!(
            reply,
            DecodedReply::Chunk {
                flags: reply::FLAG_DONE,
                kind: reply::TYPE_OFFSET_DATA,
                cookie: 3,
                offset: None,
                payload_len: len + 8
            }
        );
    }

    #[tokio::test]
    async fn a_client_that_never_reads_replies_stops_being_read() {
        let mut client = connect().await;
        // Zero-length reads carry no data, so only the reply-queue cap can stop them.
        let flush = request(cmd::READ, 0, 9, 0, 0);
        let one = flush;
        let burst: Vec<u8> = one.iter().copied().cycle().take(one.len() * 4096).collect();
        let mut sent = 0usize;
        let accepted = tokio::time::timeout(Duration::from_secs(2), async {
            loop {
                client.write_all(&burst).await.unwrap();
                sent += 4096;
            }
        })
        .await;
        assert!(accepted.is_err(), "the server kept reading forever");
        // The pipe holds 1 MiB each way; the server must have stopped well before
        // queueing replies without limit.
        assert!(sent < 300_000, "{sent} requests were read");
    }

    /// A connection with four 1 MiB reads whose replies its 64 KiB pipe cannot take, and
    /// the server then told to stop: the client, and the connection's task.
    async fn stopping_with_replies_queued() -> (DuplexStream, tokio::task::JoinHandle<()>) {
        let (client, server) = tokio::io::duplex(1 << 16);
        let (stop_tx, stop_rx) = watch::channel(false);
        let backend = Arc::new(MemoryBackend::new(64 << 20, false));
        // Simple replies: the holes of the fresh export go out as data, not as hole chunks.
        let (mut client, served) = serve_stoppable(backend, client, server, false, stop_rx).await;
        for cookie in 0..4 {
            client
                .write_all(&request(cmd::READ, 0, cookie, 0, 1 << 20))
                .await
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!served.is_finished(), "the connection waits for its client");
        stop_tx.send(true).unwrap();
        // The stop was sent: dropping its sender now changes nothing.
        (client, served)
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_does_not_read_is_cut_off_some_time_after_the_stop() {
        let (client, served) = stopping_with_replies_queued().await;
        let stopped_at = tokio::time::Instant::now();
        tokio::time::timeout(DRAIN_TIMEOUT * 2, served)
            .await
            .expect("the connection ends without its client reading")
            .unwrap();
        assert!(
            stopped_at.elapsed() >= DRAIN_TIMEOUT,
            "{:?}",
            stopped_at.elapsed()
        );
        drop(client);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_reading_slowly_after_the_stop_gets_every_reply() {
        let (mut client, served) = stopping_with_replies_queued().await;
        // 64 KiB a second: the 4 MiB of replies take over a minute, far past the deadline,
        // but the socket keeps taking bytes.
        let mut received = 0;
        let mut chunk = vec![0u8; 64 << 10];
        loop {
            match client.read(&mut chunk).await.unwrap() {
                0 => break,
                n => received += n,
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        assert_eq!(received, 4 * (16 + (1 << 20)), "every reply, whole");
        served.await.unwrap();
    }

    /// The error and cookie of the next simple reply (no data follows an error).
    async fn simple_reply_error(client: &mut (impl AsyncReadExt + Unpin)) -> (u32, u64) {
        let header = read_exactly(client, 16).await;
        let Some((DecodedReply::Simple { error, cookie }, 16)) =
            DecodedReply::decode(&header).unwrap()
        else {
            panic!("not a simple reply: {header:?}");
        };
        (error, cookie)
    }

    const ESHUTDOWN: u32 = NbdError::Shutdown as u32;

    /// Everything the server still sends until its end of the stream.
    async fn rest_of_stream(client: &mut (impl AsyncReadExt + Unpin)) -> Vec<u8> {
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        rest
    }

    #[tokio::test]
    async fn requests_read_after_the_stop_are_refused_with_eshutdown() {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (stop_tx, stop_rx) = watch::channel(false);
        let backend = Arc::new(MemoryBackend::new(64 << 20, false));
        let (mut client, served) =
            serve_stoppable(backend.clone(), client, server, false, stop_rx).await;
        // A read, a write with its payload and a flush, sent as the stop comes: the
        // connection reads them (its test runtime runs it only once this task waits).
        let mut batch = request(cmd::READ, 0, 1, 0, 4096);
        batch.extend(request(cmd::WRITE, 0, 2, 8192, 4096));
        batch.extend(vec![0x5a; 4096]);
        batch.extend(request(cmd::FLUSH, 0, 3, 0, 0));
        stop_tx.send(true).unwrap();
        client.write_all(&batch).await.unwrap();
        for cookie in 1..=3 {
            assert_eq!(simple_reply_error(&mut client).await, (ESHUTDOWN, cookie));
        }
        let rest = rest_of_stream(&mut client).await;
        assert!(
            rest.is_empty(),
            "nothing after the refusals: {} bytes",
            rest.len()
        );
        served.await.unwrap();
        let data = backend.read(8192, 4096).await.unwrap().bytes();
        assert!(
            data.iter().all(|&b| b == 0),
            "the refused write was not done"
        );
    }

    /// A connection (simple replies) whose FLUSH (cookie 1) is held in the backend, and
    /// the server then told to stop: the client, the connection's task, and the backend,
    /// whose `hold_flushes` lets the FLUSH go.
    async fn stopping_with_a_flush_held() -> (
        DuplexStream,
        tokio::task::JoinHandle<()>,
        Arc<CountingReads>,
    ) {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (stop_tx, stop_rx) = watch::channel(false);
        let backend = Arc::new(CountingReads {
            hold_flushes: Some(tokio::sync::Notify::new()),
            ..CountingReads::new(None)
        });
        let (mut client, served) =
            serve_stoppable(backend.clone(), client, server, false, stop_rx).await;
        client
            .write_all(&request(cmd::FLUSH, 0, 1, 0, 0))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop_tx.send(true).unwrap();
        (client, served, backend)
    }

    #[tokio::test]
    async fn a_stopping_server_answers_what_is_in_flight_and_refuses_what_comes_meanwhile() {
        let (mut client, served, backend) = stopping_with_a_flush_held().await;
        // While the FLUSH is in flight, the connection still reads, and refuses.
        client
            .write_all(&request(cmd::READ, 0, 2, 0, 4096))
            .await
            .unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), simple_reply_error(&mut client))
            .await
            .expect("a request read after the stop is answered");
        assert_eq!(answer, (ESHUTDOWN, 2));
        // A write's refusal waits for its payload: libnbd would take a reply to a command
        // whose payload it is still sending for a server bug, and drop the connection.
        client
            .write_all(&request(cmd::WRITE, 0, 3, 0, 4096))
            .await
            .unwrap();
        client.write_all(&[1u8; 4000]).await.unwrap();
        let early = tokio::time::timeout(Duration::from_millis(100), client.read_u8()).await;
        assert!(early.is_err(), "no reply before the payload is all sent");
        client.write_all(&[1u8; 96]).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), simple_reply_error(&mut client))
            .await
            .expect("the write is refused once its payload came");
        assert_eq!(answer, (ESHUTDOWN, 3));
        assert!(
            !served.is_finished(),
            "the FLUSH in flight holds the connection"
        );
        backend.hold_flushes.as_ref().unwrap().notify_one();
        assert_eq!(
            simple_reply_error(&mut client).await,
            (0, 1),
            "the FLUSH is answered"
        );
        let rest = rest_of_stream(&mut client).await;
        assert!(rest.is_empty());
        served.await.unwrap();
    }

    /// A refused write whose payload stops coming does not hold the stop once nothing
    /// else is in flight: the connection ends without waiting for the drain timer.
    #[tokio::test]
    async fn a_refused_write_whose_payload_stalls_does_not_hold_the_stop() {
        let (mut client, served, backend) = stopping_with_a_flush_held().await;
        let mut stalled = request(cmd::WRITE, 0, 2, 0, 1 << 20);
        stalled.extend(vec![2u8; 1000]);
        client.write_all(&stalled).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        backend.hold_flushes.as_ref().unwrap().notify_one();
        assert_eq!(simple_reply_error(&mut client).await, (0, 1));
        tokio::time::timeout(DRAIN_TIMEOUT / 2, served)
            .await
            .expect("the connection ends without the rest of the payload")
            .unwrap();
        let rest = rest_of_stream(&mut client).await;
        assert!(
            rest.is_empty(),
            "the refusal of the unfinished write is dropped"
        );
    }

    /// A write refused before the stop (here: past the end of the export) whose payload
    /// is still arriving at the stop is answered once the payload came, as a valid one
    /// would be (found by review: its refusal was dropped with the connection).
    #[tokio::test]
    async fn a_request_refused_before_the_stop_is_answered_after_its_payload() {
        let (client, server) = tokio::io::duplex(1 << 20);
        let (stop_tx, stop_rx) = watch::channel(false);
        let backend = Arc::new(MemoryBackend::new(1 << 20, false));
        let (mut client, served) = serve_stoppable(backend, client, server, false, stop_rx).await;
        client
            .write_all(&request(cmd::WRITE, 0, 7, 2 << 20, 65536))
            .await
            .unwrap();
        client.write_all(&[3u8; 30000]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop_tx.send(true).unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.write_all(&[3u8; 65536 - 30000]).await.unwrap();
        let (error, cookie) =
            tokio::time::timeout(Duration::from_secs(10), simple_reply_error(&mut client))
                .await
                .expect("the refusal comes once the payload did");
        assert_eq!(cookie, 7);
        assert_ne!(error, 0);
        assert_ne!(error, ESHUTDOWN, "refused for itself, before the stop");
        let rest = rest_of_stream(&mut client).await;
        assert!(rest.is_empty());
        served.await.unwrap();
    }

    /// Short reads whose replies the client does not take each hold the budget as a page:
    /// the connection stops reading after [`BYTE_BUDGET`] / [`MIN_READ_CHARGE`] of them, not
    /// after the reply queue's 16,384 (each reply can keep a 64 KiB page alive).
    #[tokio::test]
    async fn short_reads_left_unread_take_a_page_each_from_the_budget() {
        let backend = Arc::new(CountingReads::new(None));
        let (client, server) = tokio::io::duplex(4096);
        let client = serve_and_negotiate(backend.clone(), client, server).await;
        let (_rx, mut tx) = tokio::io::split(client);
        let count = 6000u64;
        let batch: Vec<u8> = (0..count)
            .flat_map(|i| request(cmd::READ, 0, i, i * 8192, 1))
            .collect();
        let writer = tokio::spawn(async move {
            let _ = tx.write_all(&batch).await;
            tx
        });
        let most = (BYTE_BUDGET / MIN_READ_CHARGE) as usize + 1;
        let reads = || backend.reads.load(std::sync::atomic::Ordering::SeqCst);
        let deadline = Instant::now() + Duration::from_secs(5);
        while reads() < most && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        // Plus those whose replies the 4 KiB pipe took (a reply is 32 bytes here).
        let admitted = reads();
        assert!(
            (most..most + 4096 / 32 + 2).contains(&admitted),
            "{admitted} reads admitted before the connection stopped reading, not about {most}"
        );
        writer.abort();
    }

    #[tokio::test]
    async fn requests_buffered_when_the_client_closes_its_side_are_still_answered() {
        let mut client = connect().await;
        // More zero-length reads than the reply queue admits at once, then end of stream.
        let count = MAX_QUEUED_REPLIES + 5000;
        let mut burst = Vec::with_capacity(count * 28);
        for cookie in 0..count as u64 {
            burst.extend(request(cmd::READ, 0, cookie, 0, 0));
        }
        let (mut rx, mut tx) = tokio::io::split(client);
        let writer = tokio::spawn(async move {
            tx.write_all(&burst).await.unwrap();
            tx.shutdown().await.unwrap();
            tx
        });
        let mut replies = Vec::new();
        rx.read_to_end(&mut replies).await.unwrap();
        assert_eq!(
            replies.len(),
            count * 20,
            "every request got its reply before the server closed"
        );
        client = rx.unsplit(writer.await.unwrap());
        drop(client);
    }
}
