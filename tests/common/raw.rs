//! A raw NBD client over a TCP socket, built on the library's own codec, for tests that must
//! send what real clients refuse to send.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use netblk::wire::handshake::{ClientOption, InfoRequest, MetaContextRequest, OptionReply};
use netblk::wire::transmission::{DecodedReply, RequestHeader, RequestStyle};
use netblk::wire::{client_flags, cmd, rep, reply, BASE_ALLOCATION};

/// How to negotiate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Simple,
    Structured,
    Extended,
}

/// A connection in the handshake or transmission phase.
pub struct Raw {
    pub sock: TcpStream,
    pub style: RequestStyle,
    pub mode: Mode,
}

/// One decoded reply: the error (0 for success), data of OFFSET_DATA chunks (in offset
/// order within the request), and the raw chunk types seen.
#[derive(Debug, Default)]
pub struct Reply {
    pub cookie: u64,
    pub error: u32,
    pub data: Vec<u8>,
    pub kinds: Vec<u16>,
    pub offsets: Vec<Option<u64>>,
    pub payloads: Vec<Vec<u8>>,
}

impl Raw {
    /// Connects and reads the greeting.
    pub fn connect(addr: &str) -> Raw {
        let sock = TcpStream::connect(addr).expect("connect");
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        sock.set_nodelay(true).unwrap();
        let mut raw = Raw {
            sock,
            style: RequestStyle::Compact,
            mode: Mode::Simple,
        };
        let greeting = raw.read_n(18).expect("greeting");
        assert_eq!(&greeting[..8], b"NBDMAGIC");
        raw
    }

    /// Connects and negotiates the default export in `mode` (with `base:allocation` when the
    /// mode allows it).
    pub fn session(addr: &str, mode: Mode) -> Raw {
        Raw::session_for(addr, mode, "")
    }

    /// Like [`Raw::session`] for a named export.
    pub fn session_for(addr: &str, mode: Mode, export: &str) -> Raw {
        let mut raw = Raw::connect(addr);
        raw.send(&(client_flags::FIXED_NEWSTYLE | client_flags::NO_ZEROES).to_be_bytes());
        match mode {
            Mode::Simple => {}
            Mode::Structured => assert_eq!(
                raw.option(ClientOption::StructuredReply)[0].reply_type,
                rep::ACK
            ),
            Mode::Extended => assert_eq!(
                raw.option(ClientOption::ExtendedHeaders)[0].reply_type,
                rep::ACK
            ),
        }
        if mode != Mode::Simple {
            let meta = MetaContextRequest {
                export: export.into(),
                queries: vec![BASE_ALLOCATION.into()],
            };
            let replies = raw.option(ClientOption::SetMetaContext(meta));
            assert_eq!(replies.last().unwrap().reply_type, rep::ACK);
        }
        let replies = raw.option(ClientOption::Go(InfoRequest {
            name: export.into(),
            requests: vec![],
        }));
        assert_eq!(
            replies.last().unwrap().reply_type,
            rep::ACK,
            "GO failed: {replies:?}"
        );
        raw.mode = mode;
        raw.style = if mode == Mode::Extended {
            RequestStyle::Extended
        } else {
            RequestStyle::Compact
        };
        raw
    }

    pub fn send(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).expect("send");
    }

    /// Reads exactly `n` bytes; `None` if the server closed the connection.
    pub fn read_n(&mut self, n: usize) -> Option<Vec<u8>> {
        let mut buf = vec![0u8; n];
        self.sock.read_exact(&mut buf).ok()?;
        Some(buf)
    }

    /// Whether the server has closed the connection (waits up to the read timeout).
    pub fn is_closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        matches!(self.sock.read(&mut byte), Ok(0) | Err(_))
    }

    /// Reads one option reply.
    pub fn option_reply(&mut self) -> Option<OptionReply> {
        let head = self.read_n(20)?;
        let len = u32::from_be_bytes(head[16..20].try_into().unwrap()) as usize;
        let mut bytes = head;
        bytes.extend(self.read_n(len)?);
        Some(OptionReply::decode(&bytes).unwrap().unwrap().0)
    }

    /// Sends an option and reads every reply up to the final one.
    pub fn option(&mut self, option: ClientOption) -> Vec<OptionReply> {
        self.send(&option.encode());
        self.replies_until_final()
    }

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
        let header = RequestHeader {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        let mut bytes = header.encode(self.style);
        bytes.extend_from_slice(payload);
        self.send(&bytes);
    }

    /// Reads one whole reply. `read_len` is the length of the READ it answers, needed only
    /// to frame simple replies to reads (0 for anything else).
    pub fn reply(&mut self, read_len: usize) -> Option<Reply> {
        let mut out = Reply::default();
        loop {
            let magic = self.read_n(4)?;
            let rest = match u32::from_be_bytes(magic[..4].try_into().unwrap()) {
                0x6744_6698 => 12,
                0x668e_33ef => 16,
                0x6e8a_278c => 28,
                other => panic!("bad reply magic {other:#x}"),
            };
            let mut header = magic;
            header.extend(self.read_n(rest)?);
            match DecodedReply::decode(&header).unwrap().unwrap().0 {
                DecodedReply::Simple { error, cookie } => {
                    out.cookie = cookie;
                    out.error = error;
                    if error == 0 && read_len > 0 {
                        out.data = self.read_n(read_len)?;
                    }
                    return Some(out);
                }
                DecodedReply::Chunk {
                    flags,
                    kind,
                    cookie,
                    offset,
                    payload_len,
                } => {
                    out.cookie = cookie;
                    let payload = self.read_n(payload_len as usize)?;
                    out.kinds.push(kind);
                    out.offsets.push(offset);
                    match kind {
                        reply::TYPE_OFFSET_DATA => out.data.extend_from_slice(&payload[8..]),
                        reply::TYPE_OFFSET_HOLE => {
                            let len =
                                u32::from_be_bytes(payload[8..12].try_into().unwrap()) as usize;
                            out.data.resize(out.data.len() + len, 0);
                        }
                        k if k & 0x8000 != 0 => {
                            out.error = u32::from_be_bytes(payload[..4].try_into().unwrap())
                        }
                        _ => {}
                    }
                    out.payloads.push(payload);
                    if flags & reply::FLAG_DONE != 0 {
                        return Some(out);
                    }
                }
            }
        }
    }

    /// A READ and its reply.
    pub fn read(&mut self, cookie: u64, offset: u64, len: u32) -> Option<Reply> {
        self.request(cmd::READ, 0, cookie, offset, u64::from(len), &[]);
        self.reply(len as usize)
    }

    /// A WRITE and its reply's error.
    pub fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) -> Option<u32> {
        self.request(cmd::WRITE, 0, cookie, offset, data.len() as u64, data);
        self.reply(0).map(|r| r.error)
    }

    /// The local address of this connection, as the server logs it.
    pub fn local_addr(&self) -> String {
        self.sock.local_addr().unwrap().to_string()
    }
}
