//! Transmission-phase messages: request headers (compact and extended) and replies
//! (simple, structured and extended chunks). Pure encode and decode, no I/O.
//!
//! Reply payloads (read data) are never copied by the encoders: they produce the header
//! bytes, and the caller sends the data beside them in one vectored write.

use super::{
    cmd_flags, reply, NbdError, EXTENDED_REPLY_MAGIC, EXTENDED_REQUEST_MAGIC, REQUEST_MAGIC,
    SIMPLE_REPLY_MAGIC, STRUCTURED_REPLY_MAGIC,
};

/// Length of a compact request header.
pub const COMPACT_REQUEST_LEN: usize = 28;
/// Length of an extended request header.
pub const EXTENDED_REQUEST_LEN: usize = 32;
/// Length of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Length of a structured reply chunk header.
pub const STRUCTURED_REPLY_LEN: usize = 20;
/// Length of an extended reply chunk header.
pub const EXTENDED_REPLY_LEN: usize = 32;

/// Which request header the client sends: fixed by whether extended headers were negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStyle {
    Compact,
    Extended,
}

impl RequestStyle {
    pub fn header_len(self) -> usize {
        match self {
            RequestStyle::Compact => COMPACT_REQUEST_LEN,
            RequestStyle::Extended => EXTENDED_REQUEST_LEN,
        }
    }
}

/// Which reply format the server uses: fixed by negotiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyStyle {
    Simple,
    Structured,
    Extended,
}

/// A request header as it arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    /// Effect length, or payload length for writes (and for any extended request with
    /// `NBD_CMD_FLAG_PAYLOAD_LEN`).
    pub length: u64,
}

/// A request stream that cannot be parsed: the connection must close.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("bad request magic {0:#010x}")]
    BadMagic(u32),
}

impl RequestHeader {
    /// Decodes a header from the front of `bytes`; `Ok(None)` when more bytes are needed.
    pub fn decode(
        bytes: &[u8],
        style: RequestStyle,
    ) -> Result<Option<RequestHeader>, RequestError> {
        let len = style.header_len();
        if bytes.len() < len {
            return Ok(None);
        }
        let be32 = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let be64 = |at: usize| u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let magic = be32(0);
        let expected = match style {
            RequestStyle::Compact => REQUEST_MAGIC,
            RequestStyle::Extended => EXTENDED_REQUEST_MAGIC,
        };
        if magic != expected {
            return Err(RequestError::BadMagic(magic));
        }
        let flags = u16::from_be_bytes([bytes[4], bytes[5]]);
        let command = u16::from_be_bytes([bytes[6], bytes[7]]);
        let cookie = be64(8);
        let offset = be64(16);
        let length = match style {
            RequestStyle::Compact => u64::from(be32(24)),
            RequestStyle::Extended => be64(24),
        };
        Ok(Some(RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        }))
    }

    /// Encodes the header as a client sends it. In the compact style the length must fit
    /// in 32 bits.
    pub fn encode(&self, style: RequestStyle) -> Vec<u8> {
        let mut out = Vec::with_capacity(style.header_len());
        let magic = match style {
            RequestStyle::Compact => REQUEST_MAGIC,
            RequestStyle::Extended => EXTENDED_REQUEST_MAGIC,
        };
        out.extend_from_slice(&magic.to_be_bytes());
        out.extend_from_slice(&self.flags.to_be_bytes());
        out.extend_from_slice(&self.command.to_be_bytes());
        out.extend_from_slice(&self.cookie.to_be_bytes());
        out.extend_from_slice(&self.offset.to_be_bytes());
        match style {
            RequestStyle::Compact => {
                let length = u32::try_from(self.length).expect("compact length fits in 32 bits");
                out.extend_from_slice(&length.to_be_bytes());
            }
            RequestStyle::Extended => out.extend_from_slice(&self.length.to_be_bytes()),
        }
        out
    }

    /// How many payload bytes follow this header on the wire. A WRITE always carries its
    /// payload: the extension asks extended-header clients to also set `PAYLOAD_LEN`, but
    /// qemu (10.x) does not, and qemu-nbd accepts it either way, so this server does too.
    pub fn payload_len(&self, style: RequestStyle) -> u64 {
        match style {
            _ if self.command == super::cmd::WRITE => self.length,
            RequestStyle::Compact => 0,
            RequestStyle::Extended if self.flags & cmd_flags::PAYLOAD_LEN != 0 => self.length,
            RequestStyle::Extended => 0,
        }
    }
}

/// Where encoded replies go: a `Vec`, or the small inline buffer a reply header fits in
/// (the server's read replies use one, so a reply costs no allocation).
pub trait ReplySink {
    fn put(&mut self, bytes: &[u8]);
}

impl ReplySink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

impl<const N: usize> ReplySink for smallvec::SmallVec<[u8; N]> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

fn chunk_header(
    out: &mut impl ReplySink,
    style: ReplyStyle,
    flags: u16,
    kind: u16,
    cookie: u64,
    offset: u64,
    len: u64,
) {
    match style {
        ReplyStyle::Simple => {
            unreachable!("chunks are only sent when structured replies were negotiated")
        }
        ReplyStyle::Structured => {
            out.put(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
            out.put(&flags.to_be_bytes());
            out.put(&kind.to_be_bytes());
            out.put(&cookie.to_be_bytes());
            let len = u32::try_from(len).expect("structured chunk payload fits in 32 bits");
            out.put(&len.to_be_bytes());
        }
        ReplyStyle::Extended => {
            out.put(&EXTENDED_REPLY_MAGIC.to_be_bytes());
            out.put(&flags.to_be_bytes());
            out.put(&kind.to_be_bytes());
            out.put(&cookie.to_be_bytes());
            out.put(&offset.to_be_bytes());
            out.put(&len.to_be_bytes());
        }
    }
}

fn simple_header(out: &mut impl ReplySink, error: u32, cookie: u64) {
    out.put(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.put(&error.to_be_bytes());
    out.put(&cookie.to_be_bytes());
}

/// Encodes the replies the server sends. `offset` is always the request's offset (the
/// extended reply header echoes it).
#[derive(Debug, Clone, Copy)]
pub struct ReplyEncoder {
    pub style: ReplyStyle,
    pub cookie: u64,
    pub offset: u64,
}

impl ReplyEncoder {
    /// The success of a command other than `READ` and `BLOCK_STATUS` (which carry data):
    /// a simple reply unless extended headers were negotiated. The spec lets a server with
    /// structured replies answer these either way, and the simple reply is cheaper for the
    /// client: libnbd reads its 16 bytes in one `recv`, and a 20-byte `NONE` chunk in two.
    pub fn ok(&self, out: &mut impl ReplySink) {
        match self.style {
            ReplyStyle::Simple | ReplyStyle::Structured => simple_header(out, 0, self.cookie),
            // Extended headers allow no simple reply: the chunk that ends a read.
            ReplyStyle::Extended => self.read_done(out),
        }
    }

    /// The end of a successful read whose data went in earlier chunks (or of one with no
    /// data): a `NONE` chunk marked done. A read's reply must be structured when structured
    /// replies were negotiated, so only a simple-reply connection gets a simple reply.
    pub fn read_done(&self, out: &mut impl ReplySink) {
        match self.style {
            ReplyStyle::Simple => simple_header(out, 0, self.cookie),
            style => chunk_header(
                out,
                style,
                reply::FLAG_DONE,
                reply::TYPE_NONE,
                self.cookie,
                self.offset,
                0,
            ),
        }
    }

    /// A failure: a simple reply with the error, or an `ERROR` chunk marked done.
    pub fn error(&self, out: &mut impl ReplySink, error: NbdError, message: &str) {
        match self.style {
            ReplyStyle::Simple => simple_header(out, error.code(), self.cookie),
            _ => self.error_chunk(
                out,
                reply::FLAG_DONE,
                reply::TYPE_ERROR,
                error,
                message,
                &[],
            ),
        }
    }

    /// An error chunk of `kind` with `flags`: the error, the message (cut to the longest
    /// string the spec allows) and `then` (an `ERROR_OFFSET`'s offset).
    fn error_chunk(
        &self,
        out: &mut impl ReplySink,
        flags: u16,
        kind: u16,
        error: NbdError,
        message: &str,
        then: &[u8],
    ) {
        let message = &message.as_bytes()[..message.len().min(super::MAX_STRING_LEN)];
        let len = 6 + message.len() as u64 + then.len() as u64;
        chunk_header(out, self.style, flags, kind, self.cookie, self.offset, len);
        out.put(&error.code().to_be_bytes());
        out.put(&(message.len() as u16).to_be_bytes());
        out.put(message);
        out.put(then);
    }

    /// A read's failure at `error_offset`, in a reply that goes on: an `ERROR_OFFSET`
    /// chunk, not marked done (a final chunk follows). Chunked replies only.
    pub fn error_at(
        &self,
        out: &mut impl ReplySink,
        error: NbdError,
        message: &str,
        error_offset: u64,
    ) {
        debug_assert!(
            self.style != ReplyStyle::Simple,
            "a simple reply has no chunks"
        );
        let then = error_offset.to_be_bytes();
        self.error_chunk(out, 0, reply::TYPE_ERROR_OFFSET, error, message, &then);
    }

    /// The header in front of read data. For simple replies this is the whole reply header
    /// and `data_len` bytes follow; for chunks it is an `OFFSET_DATA` header and its 8-byte
    /// offset, and `data_len` bytes of data follow.
    pub fn data_header(
        &self,
        out: &mut impl ReplySink,
        data_offset: u64,
        data_len: u64,
        done: bool,
    ) {
        match self.style {
            ReplyStyle::Simple => simple_header(out, 0, self.cookie),
            style => {
                let flags = if done { reply::FLAG_DONE } else { 0 };
                chunk_header(
                    out,
                    style,
                    flags,
                    reply::TYPE_OFFSET_DATA,
                    self.cookie,
                    self.offset,
                    8 + data_len,
                );
                out.put(&data_offset.to_be_bytes());
            }
        }
    }

    /// An `OFFSET_HOLE` chunk: `len` bytes at `hole_offset` read as zeroes.
    pub fn hole(&self, out: &mut impl ReplySink, hole_offset: u64, len: u32, done: bool) {
        let flags = if done { reply::FLAG_DONE } else { 0 };
        chunk_header(
            out,
            self.style,
            flags,
            reply::TYPE_OFFSET_HOLE,
            self.cookie,
            self.offset,
            12,
        );
        out.put(&hole_offset.to_be_bytes());
        out.put(&len.to_be_bytes());
    }

    /// A block-status chunk for one context: `BLOCK_STATUS` (32-bit) with structured
    /// replies, `BLOCK_STATUS_EXT` (64-bit) with extended headers.
    pub fn block_status(
        &self,
        out: &mut impl ReplySink,
        context_id: u32,
        extents: &[(u64, u32)],
        done: bool,
    ) {
        let flags = if done { reply::FLAG_DONE } else { 0 };
        match self.style {
            ReplyStyle::Simple => unreachable!("block status needs structured replies"),
            ReplyStyle::Structured => {
                let len = 4 + 8 * extents.len() as u64;
                chunk_header(
                    out,
                    self.style,
                    flags,
                    reply::TYPE_BLOCK_STATUS,
                    self.cookie,
                    self.offset,
                    len,
                );
                out.put(&context_id.to_be_bytes());
                for &(length, status) in extents {
                    let length = u32::try_from(length).expect("caller caps extents at 32 bits");
                    out.put(&length.to_be_bytes());
                    out.put(&status.to_be_bytes());
                }
            }
            ReplyStyle::Extended => {
                let len = 8 + 16 * extents.len() as u64;
                chunk_header(
                    out,
                    self.style,
                    flags,
                    reply::TYPE_BLOCK_STATUS_EXT,
                    self.cookie,
                    self.offset,
                    len,
                );
                out.put(&context_id.to_be_bytes());
                out.put(&(extents.len() as u32).to_be_bytes());
                for &(length, status) in extents {
                    out.put(&length.to_be_bytes());
                    out.put(&u64::from(status).to_be_bytes());
                }
            }
        }
    }
}

/// A reply header as a client decodes it (used by tests and by the fuzz harness).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodedReply {
    Simple {
        error: u32,
        cookie: u64,
    },
    Chunk {
        flags: u16,
        kind: u16,
        cookie: u64,
        offset: Option<u64>,
        payload_len: u64,
    },
}

impl DecodedReply {
    /// Decodes a reply header from the front of `bytes`: `Ok(None)` when more bytes are
    /// needed, else the header and its length. Simple-reply payloads are not framed, so
    /// the caller skips read data itself.
    pub fn decode(bytes: &[u8]) -> Result<Option<(DecodedReply, usize)>, &'static str> {
        if bytes.len() < 4 {
            return Ok(None);
        }
        let be16 = |at: usize| u16::from_be_bytes([bytes[at], bytes[at + 1]]);
        let be32 = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        let be64 = |at: usize| u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        match be32(0) {
            SIMPLE_REPLY_MAGIC if bytes.len() >= SIMPLE_REPLY_LEN => Ok(Some((
                DecodedReply::Simple {
                    error: be32(4),
                    cookie: be64(8),
                },
                SIMPLE_REPLY_LEN,
            ))),
            STRUCTURED_REPLY_MAGIC if bytes.len() >= STRUCTURED_REPLY_LEN => Ok(Some((
                DecodedReply::Chunk {
                    flags: be16(4),
                    kind: be16(6),
                    cookie: be64(8),
                    offset: None,
                    payload_len: u64::from(be32(16)),
                },
                STRUCTURED_REPLY_LEN,
            ))),
            EXTENDED_REPLY_MAGIC if bytes.len() >= EXTENDED_REPLY_LEN => Ok(Some((
                DecodedReply::Chunk {
                    flags: be16(4),
                    kind: be16(6),
                    cookie: be64(8),
                    offset: Some(be64(16)),
                    payload_len: be64(24),
                },
                EXTENDED_REPLY_LEN,
            ))),
            SIMPLE_REPLY_MAGIC | STRUCTURED_REPLY_MAGIC | EXTENDED_REPLY_MAGIC => Ok(None),
            _ => Err("bad reply magic"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::cmd;
    use proptest::prelude::*;

    fn style() -> impl Strategy<Value = RequestStyle> {
        prop_oneof![Just(RequestStyle::Compact), Just(RequestStyle::Extended)]
    }

    proptest! {
        #[test]
        fn every_request_round_trips(style in style(), flags in any::<u16>(), command in any::<u16>(),
                                     cookie in any::<u64>(), offset in any::<u64>(), length in any::<u32>(),
                                     high in any::<u32>()) {
            let length = match style {
                RequestStyle::Compact => u64::from(length),
                RequestStyle::Extended => (u64::from(high) << 32) | u64::from(length),
            };
            let header = RequestHeader { flags, command, cookie, offset, length };
            let bytes = header.encode(style);
            prop_assert_eq!(bytes.len(), style.header_len());
            prop_assert_eq!(RequestHeader::decode(&bytes, style).unwrap(), Some(header));
            // Any prefix is "need more", never an error.
            prop_assert_eq!(RequestHeader::decode(&bytes[..bytes.len() - 1], style).unwrap(), None);
        }

        #[test]
        fn wrong_magic_is_an_error(style in style(), magic in any::<u32>(), rest in proptest::collection::vec(any::<u8>(), 28)) {
            prop_assume!(magic != REQUEST_MAGIC && magic != EXTENDED_REQUEST_MAGIC);
            let mut bytes = magic.to_be_bytes().to_vec();
            bytes.extend_from_slice(&rest);
            prop_assert_eq!(RequestHeader::decode(&bytes, style), Err(RequestError::BadMagic(magic)));
        }

        #[test]
        fn data_chunks_round_trip(cookie in any::<u64>(), offset in any::<u64>(), data_offset in any::<u64>(),
                                  len in 0u64..(1 << 25), done in any::<bool>(), extended in any::<bool>()) {
            let style = if extended { ReplyStyle::Extended } else { ReplyStyle::Structured };
            let enc = ReplyEncoder { style, cookie, offset };
            let mut out = Vec::new();
            enc.data_header(&mut out, data_offset, len, done);
            // The server's inline header buffer gets the same bytes, and they fit inline.
            let mut inline = smallvec::SmallVec::<[u8; 40]>::new();
            enc.data_header(&mut inline, data_offset, len, done);
            prop_assert_eq!(&inline[..], &out[..]);
            prop_assert!(!inline.spilled());
            let (decoded, used) = DecodedReply::decode(&out).unwrap().unwrap();
            prop_assert_eq!(used + 8, out.len());
            prop_assert_eq!(decoded, DecodedReply::Chunk {
                flags: if done { reply::FLAG_DONE } else { 0 },
                kind: reply::TYPE_OFFSET_DATA,
                cookie,
                offset: extended.then_some(offset),
                payload_len: len + 8,
            });
            prop_assert_eq!(&out[used..], &data_offset.to_be_bytes()[..]);
        }

        #[test]
        fn errors_round_trip(cookie in any::<u64>(), message in "[a-z ]{0,50}", style_index in 0usize..3) {
            let style = [ReplyStyle::Simple, ReplyStyle::Structured, ReplyStyle::Extended][style_index];
            let enc = ReplyEncoder { style, cookie, offset: 7 };
            let mut out = Vec::new();
            enc.error(&mut out, NbdError::NoSpc, &message);
            let mut inline = smallvec::SmallVec::<[u8; 40]>::new();
            enc.error(&mut inline, NbdError::NoSpc, &message);
            prop_assert_eq!(&inline[..], &out[..], "a long message spills, whole");
            let (decoded, used) = DecodedReply::decode(&out).unwrap().unwrap();
            match decoded {
                DecodedReply::Simple { error, cookie: c } => {
                    prop_assert_eq!(error, 28);
                    prop_assert_eq!(c, cookie);
                    prop_assert_eq!(used, out.len());
                }
                DecodedReply::Chunk { flags, kind, cookie: c, payload_len, .. } => {
                    prop_assert_eq!(flags, reply::FLAG_DONE);
                    prop_assert_eq!(kind, reply::TYPE_ERROR);
                    prop_assert_eq!(c, cookie);
                    prop_assert_eq!(payload_len as usize, out.len() - used);
                    prop_assert_eq!(&out[used..used + 4], &28u32.to_be_bytes()[..]);
                    let mlen = u16::from_be_bytes([out[used + 4], out[used + 5]]) as usize;
                    prop_assert_eq!(&out[used + 6..used + 6 + mlen], message.as_bytes());
                }
            }
        }

        #[test]
        fn block_status_lengths_match(extents in proptest::collection::vec((1u64..u32::MAX as u64, 0u32..4), 1..20),
                                      extended in any::<bool>()) {
            let style = if extended { ReplyStyle::Extended } else { ReplyStyle::Structured };
            let enc = ReplyEncoder { style, cookie: 1, offset: 0 };
            let mut out = Vec::new();
            enc.block_status(&mut out, 1, &extents, true);
            let (decoded, used) = DecodedReply::decode(&out).unwrap().unwrap();
            let DecodedReply::Chunk { kind, payload_len, .. } = decoded else { panic!("chunk expected") };
            prop_assert_eq!(payload_len as usize, out.len() - used);
            if extended {
                prop_assert_eq!(kind, reply::TYPE_BLOCK_STATUS_EXT);
                prop_assert_eq!(payload_len, 8 + 16 * extents.len() as u64);
            } else {
                prop_assert_eq!(kind, reply::TYPE_BLOCK_STATUS);
                prop_assert_eq!(payload_len, 4 + 8 * extents.len() as u64);
            }
        }

        #[test]
        fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = DecodedReply::decode(&bytes);
            let _ = RequestHeader::decode(&bytes, RequestStyle::Compact);
            let _ = RequestHeader::decode(&bytes, RequestStyle::Extended);
        }
    }

    #[test]
    fn payload_length_depends_on_style_and_flag() {
        let write = RequestHeader {
            flags: 0,
            command: cmd::WRITE,
            cookie: 0,
            offset: 0,
            length: 512,
        };
        assert_eq!(write.payload_len(RequestStyle::Compact), 512);
        assert_eq!(write.payload_len(RequestStyle::Extended), 512);
        let ext_write = RequestHeader {
            flags: cmd_flags::PAYLOAD_LEN,
            ..write
        };
        assert_eq!(ext_write.payload_len(RequestStyle::Extended), 512);
        let trim = RequestHeader {
            command: cmd::TRIM,
            ..write
        };
        assert_eq!(trim.payload_len(RequestStyle::Compact), 0);
    }

    /// A success without data is a 16-byte simple reply unless extended headers forbid
    /// simple replies; the end of a read is a `NONE` chunk unless no chunks were negotiated.
    #[test]
    fn ok_is_simple_where_allowed_and_read_done_is_a_chunk() {
        let chunk = |style| DecodedReply::Chunk {
            flags: reply::FLAG_DONE,
            kind: reply::TYPE_NONE,
            cookie: 9,
            offset: (style == ReplyStyle::Extended).then_some(5),
            payload_len: 0,
        };
        let simple = DecodedReply::Simple {
            error: 0,
            cookie: 9,
        };
        for (style, ok, read_done) in [
            (ReplyStyle::Simple, simple.clone(), simple.clone()),
            (
                ReplyStyle::Structured,
                simple.clone(),
                chunk(ReplyStyle::Structured),
            ),
            (
                ReplyStyle::Extended,
                chunk(ReplyStyle::Extended),
                chunk(ReplyStyle::Extended),
            ),
        ] {
            let enc = ReplyEncoder {
                style,
                cookie: 9,
                offset: 5,
            };
            for (encode, expected) in [
                (ReplyEncoder::ok as fn(&ReplyEncoder, &mut Vec<u8>), ok),
                (ReplyEncoder::read_done, read_done),
            ] {
                let mut out = Vec::new();
                encode(&enc, &mut out);
                let (decoded, used) = DecodedReply::decode(&out).unwrap().unwrap();
                assert_eq!((decoded, used), (expected, out.len()), "{style:?}");
            }
        }
    }

    #[test]
    fn hole_chunk_is_twelve_bytes_of_payload() {
        let mut out = Vec::new();
        ReplyEncoder {
            style: ReplyStyle::Structured,
            cookie: 1,
            offset: 0,
        }
        .hole(&mut out, 4096, 8192, true);
        assert_eq!(out.len(), STRUCTURED_REPLY_LEN + 12);
    }
}
