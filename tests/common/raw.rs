//! A raw NBD client over a TCP socket, built on the library's own codec, for tests that must
//! send what real clients refuse to send.
//!
//! It checks the framing of everything the server sends (reply magics allowed by what was
//! negotiated, chunk payload layouts, one `DONE` per reply) and panics on a violation, so a
//! test fails on a malformed reply rather than misreading it.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use netblk::wire::handshake::{ClientOption, InfoRequest, MetaContextRequest, OptionReply};
use netblk::wire::transmission::{DecodedReply, RequestHeader, RequestStyle};
use netblk::wire::{
    client_flags, cmd, cmd_flags, info, rep, reply, BASE_ALLOCATION, EXTENDED_REPLY_MAGIC,
    IHAVEOPT, NBD_MAGIC, SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC,
};

/// How long any single read waits before the test gives up on the server.
pub const READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How to negotiate (the short form of [`Setup`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Simple,
    Structured,
    Extended,
}

/// What to negotiate before `NBD_OPT_GO`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    /// Send `NBD_OPT_STRUCTURED_REPLY`.
    pub structured: bool,
    /// Send `NBD_OPT_EXTENDED_HEADERS`.
    pub extended: bool,
    /// Select `base:allocation` with `NBD_OPT_SET_META_CONTEXT` (needs one of the above).
    pub meta: bool,
    pub export: String,
}

impl Setup {
    /// The setup [`Raw::session`] uses for `mode`: `base:allocation` whenever possible.
    pub fn of(mode: Mode) -> Setup {
        Setup {
            structured: mode == Mode::Structured,
            extended: mode == Mode::Extended,
            meta: mode != Mode::Simple,
            export: String::new(),
        }
    }
}

/// How a wait for the server to close ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closed {
    /// Orderly close: read returned 0.
    Eof,
    /// The connection was reset (the server closed with unread data pending).
    Reset,
    /// Still open when the wait ended.
    Timeout,
    /// The server sent this many bytes instead of closing.
    Data(usize),
}

impl Closed {
    pub fn is_closed(self) -> bool {
        matches!(self, Closed::Eof | Closed::Reset)
    }
}

/// A connection in the handshake or transmission phase.
pub struct Raw {
    pub sock: TcpStream,
    /// Request header style, fixed by the negotiation.
    pub style: RequestStyle,
    /// Reply format, fixed by the negotiation.
    pub mode: Mode,
    /// Export size and transmission flags from the last `NBD_INFO_EXPORT`.
    pub size: u64,
    pub transmission_flags: u16,
    /// Context id the server gave `base:allocation`, if selected.
    pub context_id: Option<u32>,
    structured_acked: bool,
    extended_acked: bool,
    /// How the last read that failed ended (an end of stream is `UnexpectedEof`, a reset
    /// `ConnectionReset`).
    pub read_failed: Option<ErrorKind>,
}

/// One decoded reply.
#[derive(Debug, Default, Clone)]
pub struct Reply {
    pub cookie: u64,
    /// 0 for success, else the error of the simple reply or of the (first) error chunk.
    pub error: u32,
    /// The reply was a simple reply (not chunks).
    pub simple: bool,
    /// Read data: a simple reply's payload, or the `OFFSET_DATA`/`OFFSET_HOLE` chunks put
    /// together in offset order (they must be contiguous).
    pub data: Vec<u8>,
    /// Offset of the first data byte according to the chunks (`None` for simple replies).
    pub data_offset: Option<u64>,
    /// Chunk types in arrival order.
    pub kinds: Vec<u16>,
    /// The offset field of each chunk header (extended replies only).
    pub offsets: Vec<Option<u64>>,
    /// Raw chunk payloads in arrival order.
    pub payloads: Vec<Vec<u8>>,
    /// Message of the first error chunk.
    pub message: String,
    /// Data pieces by offset (holes as zeroes), before assembly.
    pieces: Vec<(u64, Vec<u8>)>,
}

impl Reply {
    fn finish(&mut self) {
        if self.pieces.is_empty() {
            return;
        }
        self.pieces.sort_by_key(|p| p.0);
        let start = self.pieces[0].0;
        let mut at = start;
        for (offset, bytes) in std::mem::take(&mut self.pieces) {
            assert_eq!(
                offset, at,
                "content chunks of cookie {:#x} are not contiguous",
                self.cookie
            );
            at += bytes.len() as u64;
            self.data.extend_from_slice(&bytes);
        }
        self.data_offset = Some(start);
    }
}

/// One message from the server in transmission: a whole simple reply or one chunk.
struct Message {
    cookie: u64,
    done: bool,
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes(b[..2].try_into().unwrap())
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().unwrap())
}

impl Raw {
    /// Wraps a connected socket as is (nothing read or sent yet).
    pub fn from_socket(sock: TcpStream) -> Raw {
        sock.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
        sock.set_write_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        sock.set_nodelay(true).unwrap();
        Raw {
            sock,
            style: RequestStyle::Compact,
            mode: Mode::Simple,
            size: 0,
            transmission_flags: 0,
            context_id: None,
            structured_acked: false,
            extended_acked: false,
            read_failed: None,
        }
    }

    /// Connects and reads the 18-byte greeting.
    pub fn connect(addr: &str) -> Raw {
        let mut raw = Raw::from_socket(TcpStream::connect(addr).expect("connect"));
        let greeting = raw.read_n(18).expect("greeting");
        assert_eq!(be64(&greeting[..8]), NBD_MAGIC, "NBDMAGIC");
        assert_eq!(be64(&greeting[8..16]), IHAVEOPT, "IHAVEOPT");
        raw
    }

    /// Connects, reads the greeting and sends the usual client flags.
    pub fn hello(addr: &str) -> Raw {
        let mut raw = Raw::connect(addr);
        raw.send(&(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES).to_be_bytes());
        raw
    }

    /// Connects and negotiates the default export in `mode` (with `base:allocation` when the
    /// mode allows it).
    pub fn session(addr: &str, mode: Mode) -> Raw {
        Raw::negotiate(addr, &Setup::of(mode))
    }

    /// Like [`Raw::session`] for a named export.
    pub fn session_for(addr: &str, mode: Mode, export: &str) -> Raw {
        Raw::negotiate(
            addr,
            &Setup {
                export: export.into(),
                ..Setup::of(mode)
            },
        )
    }

    /// Connects and negotiates as `setup` says, ending with a successful `NBD_OPT_GO`.
    pub fn negotiate(addr: &str, setup: &Setup) -> Raw {
        let mut raw = Raw::hello(addr);
        if setup.structured {
            let replies = raw.option(ClientOption::StructuredReply);
            assert_eq!(replies[0].reply_type, rep::ACK, "{replies:?}");
        }
        if setup.extended {
            let replies = raw.option(ClientOption::ExtendedHeaders);
            assert_eq!(replies[0].reply_type, rep::ACK, "{replies:?}");
        }
        if setup.meta {
            let replies = raw.set_meta_context(&setup.export, &[BASE_ALLOCATION]);
            assert_eq!(replies.last().unwrap().reply_type, rep::ACK, "{replies:?}");
            assert!(raw.context_id.is_some(), "base:allocation was not selected");
        }
        let replies = raw.go(&setup.export);
        assert_eq!(
            replies.last().unwrap().reply_type,
            rep::ACK,
            "GO failed: {replies:?}"
        );
        raw
    }

    /// Sends `NBD_OPT_SET_META_CONTEXT` and records the id given to `base:allocation`.
    pub fn set_meta_context(&mut self, export: &str, queries: &[&str]) -> Vec<OptionReply> {
        let meta = MetaContextRequest {
            export: export.into(),
            queries: queries.iter().map(|q| q.to_string()).collect(),
        };
        let replies = self.option(ClientOption::SetMetaContext(meta));
        self.context_id = None;
        for r in &replies {
            if r.reply_type == rep::META_CONTEXT && &r.data[4..] == BASE_ALLOCATION.as_bytes() {
                self.context_id = Some(be32(&r.data));
            }
        }
        replies
    }

    /// Sends `NBD_OPT_GO` for `export` (asking for the block size) and reads every reply.
    /// On `ACK`, the connection is in transmission with the style negotiated so far.
    pub fn go(&mut self, export: &str) -> Vec<OptionReply> {
        let replies = self.option(ClientOption::Go(InfoRequest {
            name: export.into(),
            requests: vec![info::BLOCK_SIZE],
        }));
        for r in &replies {
            if r.reply_type == rep::INFO && be16(&r.data) == info::EXPORT {
                assert_eq!(r.data.len(), 12, "NBD_INFO_EXPORT is 12 bytes");
                self.size = be64(&r.data[2..]);
                self.transmission_flags = be16(&r.data[10..]);
            }
        }
        if replies.last().is_some_and(|r| r.reply_type == rep::ACK) {
            self.style = if self.extended_acked {
                RequestStyle::Extended
            } else {
                RequestStyle::Compact
            };
            self.mode = if self.extended_acked {
                Mode::Extended
            } else if self.structured_acked {
                Mode::Structured
            } else {
                Mode::Simple
            };
        }
        replies
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).expect("send");
    }

    /// Sends, reporting failure (the server may already have dropped the connection).
    pub fn try_send(&mut self, bytes: &[u8]) -> bool {
        self.sock.write_all(bytes).is_ok()
    }

    /// Sends an option with arbitrary data (which need not match the option).
    pub fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut bytes = IHAVEOPT.to_be_bytes().to_vec();
        bytes.extend(option.to_be_bytes());
        bytes.extend((data.len() as u32).to_be_bytes());
        bytes.extend_from_slice(data);
        self.send(&bytes);
    }

    /// Reads exactly `n` bytes; `None` if the server closed the connection (or it timed out).
    pub fn read_n(&mut self, n: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; n];
        if let Err(e) = self.sock.read_exact(&mut buf) {
            self.read_failed = Some(e.kind());
            return None;
        }
        Some(buf)
    }

    /// Waits up to `within` for the server to close, without sending anything.
    pub fn wait_closed(&mut self, within: Duration) -> Closed {
        self.sock
            .set_read_timeout(Some(within.max(Duration::from_millis(1))))
            .unwrap();
        let mut buf = [0u8; 4096];
        let result = self.sock.read(&mut buf);
        self.sock.set_read_timeout(Some(READ_TIMEOUT)).unwrap();
        match result {
            Ok(0) => Closed::Eof,
            Ok(n) => Closed::Data(n),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Closed::Timeout
            }
            Err(_) => Closed::Reset,
        }
    }

    /// Whether the server closed the connection (EOF or reset) within [`READ_TIMEOUT`]. A
    /// read that times out, or data, is "not closed".
    pub fn is_closed(&mut self) -> bool {
        self.wait_closed(READ_TIMEOUT).is_closed()
    }

    /// Half-closes the sending side, then reads and drops everything until the server
    /// closes. Returns whether it closed before `deadline` and how many bytes came.
    pub fn finish_and_drain(&mut self, within: Duration) -> (bool, usize) {
        let _ = self.sock.shutdown(Shutdown::Write);
        let deadline = Instant::now() + within;
        let mut total = 0;
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return (false, total);
            }
            self.sock.set_read_timeout(Some(left)).unwrap();
            match self.sock.read(&mut buf) {
                Ok(0) => return (true, total),
                Ok(n) => total += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return (false, total)
                }
                Err(_) => return (true, total),
            }
        }
    }

    /// Reads one option reply.
    pub fn option_reply(&mut self) -> Option<OptionReply> {
        let head = self.read_n(20)?;
        let len = be32(&head[16..]) as usize;
        let mut bytes = head;
        bytes.extend(self.read_n(len)?);
        Some(
            OptionReply::decode(&bytes)
                .expect("a well-formed option reply")
                .expect("complete")
                .0,
        )
    }

    /// Sends an option and reads every reply up to the final one.
    pub fn option(&mut self, option: ClientOption) -> Vec<OptionReply> {
        let code = option.code();
        self.send(&option.encode());
        let replies = self.replies_until_final();
        for r in &replies {
            assert_eq!(r.option, code, "option reply names option {code}: {r:?}");
        }
        if replies.last().is_some_and(|r| r.reply_type == rep::ACK) {
            match code {
                netblk::wire::opt::STRUCTURED_REPLY => self.structured_acked = true,
                netblk::wire::opt::EXTENDED_HEADERS => self.extended_acked = true,
                _ => {}
            }
        }
        replies
    }

    /// Reads option replies up to the final one (`ACK` or an error).
    pub fn replies_until_final(&mut self) -> Vec<OptionReply> {
        let mut replies = Vec::new();
        loop {
            let reply = self.option_reply().expect("option reply");
            let last = reply.is_final();
            replies.push(reply);
            if last {
                return replies;
            }
        }
    }

    /// Encodes a request header in this connection's style, followed by `payload`.
    pub fn encode_request(
        &self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) -> Vec<u8> {
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        let mut bytes = header.encode(self.style);
        bytes.extend_from_slice(payload);
        bytes
    }

    /// Sends a request header (and payload, if any).
    pub fn request(
        &mut self,
        command: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u64,
        payload: &[u8],
    ) {
        let bytes = self.encode_request(command, flags, cookie, offset, length, payload);
        self.send(&bytes);
    }

    /// Reads one message (a whole simple reply, or one chunk) into `replies`. `read_len`
    /// gives the READ length of a cookie, needed to frame simple replies (0 for non-reads).
    fn message(
        &mut self,
        read_len: &dyn Fn(u64) -> usize,
        replies: &mut HashMap<u64, Reply>,
    ) -> Option<Message> {
        let magic = self.read_n(4)?;
        let rest = match be32(&magic) {
            SIMPLE_REPLY_MAGIC => {
                assert_ne!(
                    self.mode,
                    Mode::Extended,
                    "simple reply with extended headers"
                );
                12
            }
            STRUCTURED_REPLY_MAGIC => {
                assert_eq!(self.mode, Mode::Structured, "unexpected structured chunk");
                16
            }
            EXTENDED_REPLY_MAGIC => {
                assert_eq!(self.mode, Mode::Extended, "unexpected extended chunk");
                28
            }
            other => panic!("bad reply magic {other:#x}"),
        };
        let mut header = magic;
        header.extend(self.read_n(rest)?);
        let (decoded, used) = DecodedReply::decode(&header)
            .expect("reply header")
            .expect("complete");
        assert_eq!(used, header.len());
        match decoded {
            DecodedReply::Simple { error, cookie } => {
                let out = replies.entry(cookie).or_default();
                assert!(
                    out.kinds.is_empty() && !out.simple,
                    "simple reply for cookie {cookie:#x} after other replies"
                );
                let len = read_len(cookie);
                assert!(
                    self.mode == Mode::Simple || len == 0,
                    "simple reply to a READ of {len} bytes after structured replies"
                );
                out.cookie = cookie;
                out.simple = true;
                out.error = error;
                if error == 0 && len > 0 {
                    out.data = self.read_n(len)?;
                }
                Some(Message { cookie, done: true })
            }
            DecodedReply::Chunk {
                flags,
                kind,
                cookie,
                offset,
                payload_len,
            } => {
                assert!(
                    payload_len < 64 << 20,
                    "chunk payload of {payload_len} bytes"
                );
                let payload = self.read_n(payload_len as usize)?;
                let out = replies.entry(cookie).or_default();
                assert!(!out.simple, "chunk after a simple reply for {cookie:#x}");
                out.cookie = cookie;
                out.kinds.push(kind);
                out.offsets.push(offset);
                match kind {
                    reply::TYPE_NONE => {
                        assert_eq!(payload_len, 0, "NONE chunk with a payload");
                        assert!(flags & reply::FLAG_DONE != 0, "NONE chunk without DONE");
                    }
                    reply::TYPE_OFFSET_DATA => {
                        assert!(payload.len() > 8, "OFFSET_DATA of {} bytes", payload.len());
                        out.pieces.push((be64(&payload), payload[8..].to_vec()));
                    }
                    reply::TYPE_OFFSET_HOLE => {
                        assert_eq!(payload.len(), 12, "OFFSET_HOLE is 12 bytes");
                        let len = be32(&payload[8..]) as usize;
                        assert!(len > 0, "empty hole");
                        out.pieces.push((be64(&payload), vec![0; len]));
                    }
                    reply::TYPE_BLOCK_STATUS | reply::TYPE_BLOCK_STATUS_EXT => {}
                    k if k & 0x8000 != 0 => {
                        let min = if k == reply::TYPE_ERROR_OFFSET { 14 } else { 6 };
                        assert!(
                            payload.len() >= min,
                            "error chunk of {} bytes",
                            payload.len()
                        );
                        let error = be32(&payload);
                        assert_ne!(error, 0, "error chunk with error 0");
                        let msg_len = be16(&payload[4..]) as usize;
                        assert!(
                            msg_len <= payload.len() - min,
                            "error message runs past the chunk"
                        );
                        if out.error == 0 {
                            out.error = error;
                            out.message =
                                String::from_utf8_lossy(&payload[6..6 + msg_len]).into_owned();
                        }
                    }
                    other => panic!("unknown chunk type {other}"),
                }
                out.payloads.push(payload);
                Some(Message {
                    cookie,
                    done: flags & reply::FLAG_DONE != 0,
                })
            }
        }
    }

    /// Reads one whole reply. `read_len` is the length of the READ it answers, needed only
    /// to frame simple replies to reads (0 for anything else). Every message until the
    /// reply is done must carry the same cookie.
    pub fn reply(&mut self, read_len: usize) -> Option<Reply> {
        let mut replies = HashMap::new();
        let mut first = None;
        loop {
            let message = self.message(&|_| read_len, &mut replies)?;
            let cookie = *first.get_or_insert(message.cookie);
            assert_eq!(
                message.cookie, cookie,
                "chunks of another reply arrived before this one was done"
            );
            if message.done {
                let mut reply = replies.remove(&cookie).expect("reply");
                reply.finish();
                return Some(reply);
            }
        }
    }

    /// Reads `count` whole replies whose messages may interleave, keyed by cookie; each
    /// cookie must be answered exactly once. `read_len` frames simple replies to reads.
    pub fn replies(
        &mut self,
        count: usize,
        read_len: impl Fn(u64) -> usize,
    ) -> Option<HashMap<u64, Reply>> {
        let mut pending = HashMap::new();
        let mut done: HashMap<u64, Reply> = HashMap::new();
        while done.len() < count {
            let message = self.message(&read_len, &mut pending)?;
            assert!(
                !done.contains_key(&message.cookie),
                "a second reply for cookie {:#x}",
                message.cookie
            );
            if message.done {
                let mut reply = pending.remove(&message.cookie).expect("reply");
                reply.finish();
                done.insert(message.cookie, reply);
            }
        }
        assert!(pending.is_empty(), "unfinished replies: {pending:?}");
        Some(done)
    }

    /// A READ and its reply.
    pub fn read(&mut self, cookie: u64, offset: u64, len: u32) -> Option<Reply> {
        self.request(cmd::READ, 0, cookie, offset, u64::from(len), &[]);
        self.reply(len as usize)
    }

    /// A WRITE (with `NBD_CMD_FLAG_PAYLOAD_LEN` under extended headers, as the extension
    /// asks) and its reply's error.
    pub fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) -> Option<u32> {
        let flags = match self.style {
            RequestStyle::Extended => cmd_flags::PAYLOAD_LEN,
            RequestStyle::Compact => 0,
        };
        self.request(cmd::WRITE, flags, cookie, offset, data.len() as u64, data);
        self.reply(0).map(|r| {
            assert_eq!(r.cookie, cookie, "reply to the write");
            r.error
        })
    }

    /// The local address of this connection, as the server logs it.
    pub fn local_addr(&self) -> String {
        self.sock.local_addr().unwrap().to_string()
    }
}
