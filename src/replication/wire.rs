//! The node-to-node replication protocol: pure encode/decode of length-prefixed frames,
//! no I/O, so it is property-tested here and fuzzed by `fuzz/fuzz_targets/peer.rs`.
//!
//! A frame is a big-endian `u32` body length, then the body: a one-byte message kind and
//! its fields (big-endian integers, strings as `u16` length + UTF-8, payloads as the rest
//! of the body). A body longer than [`MAX_FRAME_BODY`], an unknown kind, a short or
//! over-long body or a bad string is an error, never a panic.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::config::Protocol;
use super::generation::Generations;

/// First field of every [`Hello`]: "NBLKREPL".
pub const HELLO_MAGIC: u64 = 0x4e42_4c4b_5245_504c;
/// The protocol version this code speaks.
pub const PROTOCOL_VERSION: u16 = 7;
/// Largest data payload in one frame (an NBD write can be this large).
pub const MAX_DATA: usize = crate::wire::MAX_PAYLOAD as usize;
/// Largest frame body: the largest payload plus the fixed fields in front of it.
pub const MAX_FRAME_BODY: usize = MAX_DATA + 64;
/// Longest string field (names, refusal reasons).
pub const MAX_TEXT: usize = 1024;
/// Bytes of the length prefix.
pub const LENGTH_PREFIX: usize = 4;
/// Payloads from this size on are sent from their own buffer ([`Message::encode_head`])
/// instead of being copied into the frame.
pub const SEPARATE_PAYLOAD_MIN: usize = 16 << 10;
/// Most pieces one [`Message::ResyncChecksum`] compares (one bit each in
/// [`Message::ResyncNeed`]).
pub const MAX_RESYNC_PIECES: usize = 64;

/// Flags on replicated writes.
pub mod write_flags {
    /// Durable on the replica before it acknowledges.
    pub const FUA: u32 = 1 << 0;
    /// A WRITE_ZEROES that may deallocate.
    pub const MAY_TRIM: u32 = 1 << 1;
    pub const KNOWN: u32 = FUA | MAY_TRIM;
}

/// A node's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Primary,
    Secondary,
}

/// How a node's data compares to the newest data of the resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DiskState {
    /// Has every acknowledged write.
    UpToDate,
    /// Consistent but missed writes (it was not connected to the primary).
    Outdated,
    /// Partly resynced: not usable alone.
    Inconsistent,
}

/// Outcome of a resync write (or of a resync comparison the target could not make).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResyncStatus {
    /// The target's blocks now equal the source's.
    InSync,
    /// The target could not write the blocks, or the range was invalid (NBD errno).
    Failed(u32),
}

impl std::fmt::Display for ResyncStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ResyncStatus::InSync => f.write_str("in sync"),
            ResyncStatus::Failed(code) => write!(
                f,
                "failed ({})",
                crate::wire::NbdError::from_errno(*code as i32)
            ),
        }
    }
}

/// What a resync and an online verify compare instead of the data: a 128-bit hash
/// (XXH3-128).
///
/// Why not CRC32C (protocol 4): a region that differs has a 2^-32 chance of the same
/// CRC, and then it is skipped silently and the target called up to date; a full resync
/// compares 16 million regions a TiB, a 0.4% chance of a wrong region per TiB resynced.
/// At 128 bits that is nil, and XXH3 hashes faster than the disk reads.
pub type Digest = u128;

/// The [`Digest`] of `data`.
pub fn digest(data: &[u8]) -> Digest {
    xxhash_rust::xxh3::xxh3_128(data)
}

/// The [`Digest`] of each `piece`-byte part of `data` (the last part may be shorter): what
/// a resync source sends and its target compares against.
pub fn piece_checksums(data: &[u8], piece: usize) -> Vec<Digest> {
    data.chunks(piece.max(1)).map(digest).collect()
}

/// The first message each side sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub version: u16,
    pub resource: String,
    pub node: String,
    pub size: u64,
    pub generations: Generations,
    pub role: Role,
    pub disk: DiskState,
    /// The replication protocol of the sender's resource file: both ends must agree
    /// (a secondary applies writes in order only under A and B, which the primary's
    /// protocol relies on).
    pub protocol: Protocol,
    /// The sender's metadata was created with a blank backing (see
    /// `meta::Superblock::created_blank`): at the just-created generation, a node without
    /// it may hold data older than another's, and no node becomes the first primary over
    /// it without force (protocol version 7).
    pub created_blank: bool,
}

/// One message between two nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Hello(Hello),
    /// The sender will not talk to this peer, and says why before closing.
    Refuse {
        reason: String,
    },
    /// Replicated write; `seq` increases by one per write, trim or zero.
    Write {
        seq: u64,
        offset: u64,
        flags: u32,
        data: Bytes,
    },
    Trim {
        seq: u64,
        offset: u64,
        length: u64,
        flags: u32,
    },
    Zero {
        seq: u64,
        offset: u64,
        length: u64,
        flags: u32,
    },
    /// Protocol B: the write reached the replica's memory.
    Received {
        seq: u64,
    },
    /// The write was applied; `status` is 0 or an NBD errno.
    Ack {
        seq: u64,
        status: u32,
    },
    /// Every write sent before this must be durable before the matching ack.
    Barrier {
        epoch: u64,
    },
    BarrierAck {
        epoch: u64,
        status: u32,
    },
    /// Every replica acknowledged the barrier `epoch`: the writes before it are durable
    /// on every node, so a secondary may let their extents leave its activity log.
    BarrierDone {
        epoch: u64,
    },
    Ping {
        token: u64,
    },
    Pong {
        token: u64,
    },
    /// A read for a primary whose local read failed.
    ReadRequest {
        id: u64,
        offset: u64,
        length: u32,
    },
    ReadReply {
        id: u64,
        status: u32,
        data: Bytes,
    },
    /// Resync source → target: "my range `[offset, offset + length)` has these digests,
    /// one per `piece` bytes (the last part may be shorter); which of yours differ?"
    /// One message covers a run of out-of-sync regions, so a resync is not a round trip
    /// per region. Always `checksums.len() == length.div_ceil(piece)`, at most
    /// [`MAX_RESYNC_PIECES`].
    ResyncChecksum {
        id: u64,
        offset: u64,
        length: u32,
        piece: u32,
        checksums: Vec<Digest>,
    },
    /// Resync target → source: bit `i` of `need` is set when piece `i` differs (or could
    /// not be read there).
    ResyncNeed {
        id: u64,
        need: u64,
    },
    /// Resync source → target: data for pieces the target said it needs.
    ResyncData {
        id: u64,
        offset: u64,
        data: Bytes,
    },
    ResyncReply {
        id: u64,
        status: ResyncStatus,
    },
    /// Online verify: "what is the digest of this block?"
    ChecksumRequest {
        id: u64,
        offset: u64,
        length: u32,
    },
    ChecksumReply {
        id: u64,
        status: u32,
        checksum: Digest,
    },
    /// Resync target → source after the hello: this range may differ (the target's own
    /// bitmap, e.g. its logged extents after it crashed as primary), so the source
    /// resyncs the union of both bitmaps.
    OutOfSync {
        offset: u64,
        length: u64,
    },
    /// Every [`Message::OutOfSync`] has been sent.
    OutOfSyncDone,
    /// The sender's role, disk state or generations changed.
    State {
        role: Role,
        disk: DiskState,
        generations: Generations,
    },
    /// Primary → a resync target in the middle of its pass: the primary started a new data
    /// generation, and the writes that follow belong to it. The target takes the new
    /// `current` (its pass, bitmaps and disk state go on as they were), so that it never
    /// holds the new generation's data under the old name (a [`Message::State`] would
    /// mean "your pass is done").
    NewGeneration {
        generations: Generations,
    },
}

/// Why bytes from a peer are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerWireError {
    #[error("frame of {length} bytes is longer than the limit of {MAX_FRAME_BODY}")]
    FrameTooLarge { length: usize },
    #[error("empty frame")]
    EmptyFrame,
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("{kind} message ends before its {field}")]
    Truncated {
        kind: &'static str,
        field: &'static str,
    },
    #[error("{kind} message has {extra} bytes after its last field")]
    TrailingBytes { kind: &'static str, extra: usize },
    #[error("{kind} message: bad {field} value {value}")]
    BadValue {
        kind: &'static str,
        field: &'static str,
        value: u64,
    },
    #[error("{kind} message: {field} is not UTF-8 or longer than {MAX_TEXT} bytes")]
    BadText {
        kind: &'static str,
        field: &'static str,
    },
    #[error("hello has magic {0:#018x}, not a netblk replication peer")]
    BadMagic(u64),
}

mod kind {
    pub const HELLO: u8 = 1;
    pub const REFUSE: u8 = 2;
    pub const WRITE: u8 = 3;
    pub const TRIM: u8 = 4;
    pub const ZERO: u8 = 5;
    pub const RECEIVED: u8 = 6;
    pub const ACK: u8 = 7;
    pub const BARRIER: u8 = 8;
    pub const BARRIER_ACK: u8 = 9;
    pub const PING: u8 = 10;
    pub const PONG: u8 = 11;
    pub const READ_REQUEST: u8 = 12;
    pub const READ_REPLY: u8 = 13;
    pub const RESYNC_CHECKSUM: u8 = 14;
    pub const RESYNC_DATA: u8 = 15;
    pub const RESYNC_REPLY: u8 = 16;
    pub const CHECKSUM_REQUEST: u8 = 17;
    pub const CHECKSUM_REPLY: u8 = 18;
    pub const STATE: u8 = 19;
    pub const OUT_OF_SYNC: u8 = 20;
    pub const OUT_OF_SYNC_DONE: u8 = 21;
    pub const BARRIER_DONE: u8 = 22;
    pub const RESYNC_NEED: u8 = 23;
    pub const NEW_GENERATION: u8 = 24;
}

impl Role {
    fn code(self) -> u8 {
        match self {
            Role::Primary => 1,
            Role::Secondary => 2,
        }
    }
}

impl DiskState {
    fn code(self) -> u8 {
        match self {
            DiskState::UpToDate => 1,
            DiskState::Outdated => 2,
            DiskState::Inconsistent => 3,
        }
    }
}

fn protocol_code(protocol: Protocol) -> u8 {
    match protocol {
        Protocol::A => 1,
        Protocol::B => 2,
        Protocol::C => 3,
    }
}

impl ResyncStatus {
    fn code(self) -> u32 {
        match self {
            ResyncStatus::InSync => 0,
            // NBD errnos are small and positive; keep them apart from the two codes above.
            ResyncStatus::Failed(errno) => 0x100 | (errno & 0xff),
        }
    }
}

impl Message {
    /// A short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Hello(_) => "hello",
            Message::Refuse { .. } => "refuse",
            Message::Write { .. } => "write",
            Message::Trim { .. } => "trim",
            Message::Zero { .. } => "zero",
            Message::Received { .. } => "received",
            Message::Ack { .. } => "ack",
            Message::Barrier { .. } => "barrier",
            Message::BarrierAck { .. } => "barrier-ack",
            Message::BarrierDone { .. } => "barrier-done",
            Message::Ping { .. } => "ping",
            Message::Pong { .. } => "pong",
            Message::ReadRequest { .. } => "read-request",
            Message::ReadReply { .. } => "read-reply",
            Message::ResyncChecksum { .. } => "resync-checksum",
            Message::ResyncNeed { .. } => "resync-need",
            Message::ResyncData { .. } => "resync-data",
            Message::ResyncReply { .. } => "resync-reply",
            Message::ChecksumRequest { .. } => "checksum-request",
            Message::ChecksumReply { .. } => "checksum-reply",
            Message::OutOfSync { .. } => "out-of-sync",
            Message::OutOfSyncDone => "out-of-sync-done",
            Message::State { .. } => "state",
            Message::NewGeneration { .. } => "new-generation",
        }
    }

    /// Appends the framed message to `out`.
    pub fn encode(&self, out: &mut BytesMut) {
        if let Some(payload) = self.encode_head(out) {
            out.extend_from_slice(&payload);
        }
    }

    /// Appends the framed message to `out`, except for a large payload (a write's or a
    /// read's data), which it returns to be sent after what it appended, as is: the frame
    /// is then `out`'s new bytes followed by the payload, with no copy of the payload.
    pub fn encode_head(&self, out: &mut BytesMut) -> Option<Bytes> {
        let payload = match self {
            Message::Write { data, .. }
            | Message::ReadReply { data, .. }
            | Message::ResyncData { data, .. }
                if data.len() >= SEPARATE_PAYLOAD_MIN =>
            {
                Some(data.clone())
            }
            _ => None,
        };
        let start = out.len();
        out.put_u32(0);
        match self {
            Message::Hello(hello) => {
                out.put_u8(kind::HELLO);
                out.put_u64(HELLO_MAGIC);
                out.put_u16(hello.version);
                put_text(out, &hello.resource);
                put_text(out, &hello.node);
                out.put_u64(hello.size);
                put_generations(out, &hello.generations);
                out.put_u8(hello.role.code());
                out.put_u8(hello.disk.code());
                out.put_u8(protocol_code(hello.protocol));
                out.put_u8(u8::from(hello.created_blank));
            }
            Message::Refuse { reason } => {
                out.put_u8(kind::REFUSE);
                put_text(out, reason);
            }
            Message::Write {
                seq,
                offset,
                flags,
                data,
            } => {
                out.put_u8(kind::WRITE);
                out.put_u64(*seq);
                out.put_u64(*offset);
                out.put_u32(*flags);
                if payload.is_none() {
                    out.put_slice(data);
                }
            }
            Message::Trim {
                seq,
                offset,
                length,
                flags,
            } => {
                out.put_u8(kind::TRIM);
                out.put_u64(*seq);
                out.put_u64(*offset);
                out.put_u64(*length);
                out.put_u32(*flags);
            }
            Message::Zero {
                seq,
                offset,
                length,
                flags,
            } => {
                out.put_u8(kind::ZERO);
                out.put_u64(*seq);
                out.put_u64(*offset);
                out.put_u64(*length);
                out.put_u32(*flags);
            }
            Message::Received { seq } => {
                out.put_u8(kind::RECEIVED);
                out.put_u64(*seq);
            }
            Message::Ack { seq, status } => {
                out.put_u8(kind::ACK);
                out.put_u64(*seq);
                out.put_u32(*status);
            }
            Message::Barrier { epoch } => {
                out.put_u8(kind::BARRIER);
                out.put_u64(*epoch);
            }
            Message::BarrierAck { epoch, status } => {
                out.put_u8(kind::BARRIER_ACK);
                out.put_u64(*epoch);
                out.put_u32(*status);
            }
            Message::BarrierDone { epoch } => {
                out.put_u8(kind::BARRIER_DONE);
                out.put_u64(*epoch);
            }
            Message::Ping { token } => {
                out.put_u8(kind::PING);
                out.put_u64(*token);
            }
            Message::Pong { token } => {
                out.put_u8(kind::PONG);
                out.put_u64(*token);
            }
            Message::ReadRequest { id, offset, length } => {
                out.put_u8(kind::READ_REQUEST);
                out.put_u64(*id);
                out.put_u64(*offset);
                out.put_u32(*length);
            }
            Message::ReadReply { id, status, data } => {
                out.put_u8(kind::READ_REPLY);
                out.put_u64(*id);
                out.put_u32(*status);
                if payload.is_none() {
                    out.put_slice(data);
                }
            }
            Message::ResyncChecksum {
                id,
                offset,
                length,
                piece,
                checksums,
            } => {
                out.put_u8(kind::RESYNC_CHECKSUM);
                out.put_u64(*id);
                out.put_u64(*offset);
                out.put_u32(*length);
                out.put_u32(*piece);
                for checksum in checksums {
                    out.put_u128(*checksum);
                }
            }
            Message::ResyncNeed { id, need } => {
                out.put_u8(kind::RESYNC_NEED);
                out.put_u64(*id);
                out.put_u64(*need);
            }
            Message::ResyncData { id, offset, data } => {
                out.put_u8(kind::RESYNC_DATA);
                out.put_u64(*id);
                out.put_u64(*offset);
                if payload.is_none() {
                    out.put_slice(data);
                }
            }
            Message::ResyncReply { id, status } => {
                out.put_u8(kind::RESYNC_REPLY);
                out.put_u64(*id);
                out.put_u32(status.code());
            }
            Message::ChecksumRequest { id, offset, length } => {
                out.put_u8(kind::CHECKSUM_REQUEST);
                out.put_u64(*id);
                out.put_u64(*offset);
                out.put_u32(*length);
            }
            Message::ChecksumReply {
                id,
                status,
                checksum,
            } => {
                out.put_u8(kind::CHECKSUM_REPLY);
                out.put_u64(*id);
                out.put_u32(*status);
                out.put_u128(*checksum);
            }
            Message::OutOfSync { offset, length } => {
                out.put_u8(kind::OUT_OF_SYNC);
                out.put_u64(*offset);
                out.put_u64(*length);
            }
            Message::OutOfSyncDone => out.put_u8(kind::OUT_OF_SYNC_DONE),
            Message::State {
                role,
                disk,
                generations,
            } => {
                out.put_u8(kind::STATE);
                out.put_u8(role.code());
                out.put_u8(disk.code());
                put_generations(out, generations);
            }
            Message::NewGeneration { generations } => {
                out.put_u8(kind::NEW_GENERATION);
                put_generations(out, generations);
            }
        }
        let body = out.len() - start - LENGTH_PREFIX + payload.as_ref().map_or(0, Bytes::len);
        let prefix = u32::try_from(body).expect("encoders are called with bounded payloads");
        out[start..start + LENGTH_PREFIX].copy_from_slice(&prefix.to_be_bytes());
        payload
    }

    /// Takes one complete frame off the front of `buf`: `Ok(None)` while more bytes are
    /// needed. Payloads share `buf`'s memory (no copy).
    pub fn decode(buf: &mut BytesMut) -> Result<Option<Message>, PeerWireError> {
        if buf.len() < LENGTH_PREFIX {
            return Ok(None);
        }
        let length = u32::from_be_bytes(buf[..LENGTH_PREFIX].try_into().expect("4 bytes")) as usize;
        if length > MAX_FRAME_BODY {
            return Err(PeerWireError::FrameTooLarge { length });
        }
        if buf.len() < LENGTH_PREFIX + length {
            buf.reserve(LENGTH_PREFIX + length - buf.len());
            return Ok(None);
        }
        buf.advance(LENGTH_PREFIX);
        let body = buf.split_to(length).freeze();
        Message::decode_body(body).map(Some)
    }

    /// Decodes one frame body (without its length prefix).
    pub fn decode_body(mut body: Bytes) -> Result<Message, PeerWireError> {
        if body.is_empty() {
            return Err(PeerWireError::EmptyFrame);
        }
        let code = body.get_u8();
        let mut r = Fields {
            body,
            kind: "unknown",
        };
        let message = match code {
            kind::HELLO => {
                r.kind = "hello";
                let magic = r.u64("magic")?;
                if magic != HELLO_MAGIC {
                    return Err(PeerWireError::BadMagic(magic));
                }
                Message::Hello(Hello {
                    version: r.u16("version")?,
                    resource: r.text("resource")?,
                    node: r.text("node")?,
                    size: r.u64("size")?,
                    generations: r.generations()?,
                    role: r.role()?,
                    disk: r.disk()?,
                    protocol: r.protocol()?,
                    created_blank: r.flag("created blank")?,
                })
            }
            kind::REFUSE => {
                r.kind = "refuse";
                Message::Refuse {
                    reason: r.text("reason")?,
                }
            }
            kind::WRITE => {
                r.kind = "write";
                Message::Write {
                    seq: r.u64("seq")?,
                    offset: r.u64("offset")?,
                    flags: r.flags()?,
                    data: r.rest(),
                }
            }
            kind::TRIM | kind::ZERO => {
                r.kind = if code == kind::TRIM { "trim" } else { "zero" };
                let (seq, offset, length, flags) = (
                    r.u64("seq")?,
                    r.u64("offset")?,
                    r.u64("length")?,
                    r.flags()?,
                );
                if code == kind::TRIM {
                    Message::Trim {
                        seq,
                        offset,
                        length,
                        flags,
                    }
                } else {
                    Message::Zero {
                        seq,
                        offset,
                        length,
                        flags,
                    }
                }
            }
            kind::RECEIVED => {
                r.kind = "received";
                Message::Received { seq: r.u64("seq")? }
            }
            kind::ACK => {
                r.kind = "ack";
                Message::Ack {
                    seq: r.u64("seq")?,
                    status: r.u32("status")?,
                }
            }
            kind::BARRIER => {
                r.kind = "barrier";
                Message::Barrier {
                    epoch: r.u64("epoch")?,
                }
            }
            kind::BARRIER_ACK => {
                r.kind = "barrier-ack";
                Message::BarrierAck {
                    epoch: r.u64("epoch")?,
                    status: r.u32("status")?,
                }
            }
            kind::BARRIER_DONE => {
                r.kind = "barrier-done";
                Message::BarrierDone {
                    epoch: r.u64("epoch")?,
                }
            }
            kind::PING => {
                r.kind = "ping";
                Message::Ping {
                    token: r.u64("token")?,
                }
            }
            kind::PONG => {
                r.kind = "pong";
                Message::Pong {
                    token: r.u64("token")?,
                }
            }
            kind::READ_REQUEST => {
                r.kind = "read-request";
                Message::ReadRequest {
                    id: r.u64("id")?,
                    offset: r.u64("offset")?,
                    length: r.length()?,
                }
            }
            kind::READ_REPLY => {
                r.kind = "read-reply";
                Message::ReadReply {
                    id: r.u64("id")?,
                    status: r.u32("status")?,
                    data: r.rest(),
                }
            }
            kind::RESYNC_CHECKSUM => {
                r.kind = "resync-checksum";
                let id = r.u64("id")?;
                let offset = r.u64("offset")?;
                let length = r.length()?;
                let piece = r.u32("piece")?;
                if piece == 0 {
                    return Err(r.bad("piece", 0));
                }
                let count = length.div_ceil(piece) as usize;
                if count == 0 || count > MAX_RESYNC_PIECES {
                    return Err(r.bad("length", u64::from(length)));
                }
                let checksums = (0..count)
                    .map(|_| r.u128("checksum"))
                    .collect::<Result<_, _>>()?;
                Message::ResyncChecksum {
                    id,
                    offset,
                    length,
                    piece,
                    checksums,
                }
            }
            kind::RESYNC_NEED => {
                r.kind = "resync-need";
                Message::ResyncNeed {
                    id: r.u64("id")?,
                    need: r.u64("need")?,
                }
            }
            kind::RESYNC_DATA => {
                r.kind = "resync-data";
                Message::ResyncData {
                    id: r.u64("id")?,
                    offset: r.u64("offset")?,
                    data: r.rest(),
                }
            }
            kind::RESYNC_REPLY => {
                r.kind = "resync-reply";
                let id = r.u64("id")?;
                let code = r.u32("status")?;
                let status = match code {
                    0 => ResyncStatus::InSync,
                    0x100..=0x1ff => ResyncStatus::Failed(code & 0xff),
                    _ => return Err(r.bad("status", u64::from(code))),
                };
                Message::ResyncReply { id, status }
            }
            kind::CHECKSUM_REQUEST => {
                r.kind = "checksum-request";
                Message::ChecksumRequest {
                    id: r.u64("id")?,
                    offset: r.u64("offset")?,
                    length: r.length()?,
                }
            }
            kind::CHECKSUM_REPLY => {
                r.kind = "checksum-reply";
                Message::ChecksumReply {
                    id: r.u64("id")?,
                    status: r.u32("status")?,
                    checksum: r.u128("checksum")?,
                }
            }
            kind::OUT_OF_SYNC => {
                r.kind = "out-of-sync";
                Message::OutOfSync {
                    offset: r.u64("offset")?,
                    length: r.u64("length")?,
                }
            }
            kind::OUT_OF_SYNC_DONE => {
                r.kind = "out-of-sync-done";
                Message::OutOfSyncDone
            }
            kind::STATE => {
                r.kind = "state";
                Message::State {
                    role: r.role()?,
                    disk: r.disk()?,
                    generations: r.generations()?,
                }
            }
            kind::NEW_GENERATION => {
                r.kind = "new-generation";
                Message::NewGeneration {
                    generations: r.generations()?,
                }
            }
            other => return Err(PeerWireError::UnknownKind(other)),
        };
        if !r.body.is_empty() {
            return Err(PeerWireError::TrailingBytes {
                kind: r.kind,
                extra: r.body.len(),
            });
        }
        Ok(message)
    }
}

fn put_text(out: &mut BytesMut, text: &str) {
    let bytes = &text.as_bytes()[..text.len().min(MAX_TEXT)];
    // Cut on a character boundary so the receiver always gets valid UTF-8.
    let mut end = bytes.len();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    out.put_u16(end as u16);
    out.put_slice(&bytes[..end]);
}

fn put_generations(out: &mut BytesMut, generations: &Generations) {
    out.put_u64(generations.current);
    out.put_u64(generations.bitmap);
    out.put_u64(generations.history[0]);
    out.put_u64(generations.history[1]);
}

/// A cursor over a frame body that names the field it could not read.
struct Fields {
    body: Bytes,
    kind: &'static str,
}

impl Fields {
    fn need(&self, n: usize, field: &'static str) -> Result<(), PeerWireError> {
        if self.body.len() < n {
            return Err(PeerWireError::Truncated {
                kind: self.kind,
                field,
            });
        }
        Ok(())
    }

    fn bad(&self, field: &'static str, value: u64) -> PeerWireError {
        PeerWireError::BadValue {
            kind: self.kind,
            field,
            value,
        }
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, PeerWireError> {
        self.need(1, field)?;
        Ok(self.body.get_u8())
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, PeerWireError> {
        self.need(2, field)?;
        Ok(self.body.get_u16())
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, PeerWireError> {
        self.need(4, field)?;
        Ok(self.body.get_u32())
    }

    fn u64(&mut self, field: &'static str) -> Result<u64, PeerWireError> {
        self.need(8, field)?;
        Ok(self.body.get_u64())
    }

    fn u128(&mut self, field: &'static str) -> Result<u128, PeerWireError> {
        self.need(16, field)?;
        Ok(self.body.get_u128())
    }

    fn flags(&mut self) -> Result<u32, PeerWireError> {
        let flags = self.u32("flags")?;
        if flags & !write_flags::KNOWN != 0 {
            return Err(self.bad("flags", u64::from(flags)));
        }
        Ok(flags)
    }

    fn length(&mut self) -> Result<u32, PeerWireError> {
        let length = self.u32("length")?;
        if length as usize > MAX_DATA {
            return Err(self.bad("length", u64::from(length)));
        }
        Ok(length)
    }

    fn text(&mut self, field: &'static str) -> Result<String, PeerWireError> {
        let len = usize::from(self.u16(field)?);
        if len > MAX_TEXT {
            return Err(PeerWireError::BadText {
                kind: self.kind,
                field,
            });
        }
        self.need(len, field)?;
        let bytes = self.body.split_to(len);
        String::from_utf8(bytes.to_vec()).map_err(|_| PeerWireError::BadText {
            kind: self.kind,
            field,
        })
    }

    fn generations(&mut self) -> Result<Generations, PeerWireError> {
        Ok(Generations {
            current: self.u64("current generation")?,
            bitmap: self.u64("bitmap generation")?,
            history: [
                self.u64("history generation")?,
                self.u64("history generation")?,
            ],
        })
    }

    fn role(&mut self) -> Result<Role, PeerWireError> {
        match self.u8("role")? {
            1 => Ok(Role::Primary),
            2 => Ok(Role::Secondary),
            other => Err(self.bad("role", u64::from(other))),
        }
    }

    fn disk(&mut self) -> Result<DiskState, PeerWireError> {
        match self.u8("disk state")? {
            1 => Ok(DiskState::UpToDate),
            2 => Ok(DiskState::Outdated),
            3 => Ok(DiskState::Inconsistent),
            other => Err(self.bad("disk state", u64::from(other))),
        }
    }

    fn flag(&mut self, field: &'static str) -> Result<bool, PeerWireError> {
        match self.u8(field)? {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(self.bad(field, u64::from(other))),
        }
    }

    fn protocol(&mut self) -> Result<Protocol, PeerWireError> {
        match self.u8("protocol")? {
            1 => Ok(Protocol::A),
            2 => Ok(Protocol::B),
            3 => Ok(Protocol::C),
            other => Err(self.bad("protocol", u64::from(other))),
        }
    }

    fn rest(&mut self) -> Bytes {
        std::mem::take(&mut self.body)
    }
}

/// Example messages of every kind, for tests and the fuzz seed corpus.
pub fn example_messages() -> Vec<Message> {
    let generations = Generations {
        current: 0x8000_0000_0000_1235,
        bitmap: 0x8000_0000_0000_0021,
        history: [7, 0],
    };
    vec![
        Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            resource: "r0".into(),
            node: "alpha".into(),
            size: 1 << 30,
            generations,
            role: Role::Primary,
            disk: DiskState::UpToDate,
            protocol: Protocol::C,
            created_blank: false,
        }),
        Message::Refuse {
            reason: "resource r1 is not r0".into(),
        },
        Message::Write {
            seq: 1,
            offset: 4096,
            flags: write_flags::FUA,
            data: Bytes::from_static(&[0xa5; 512]),
        },
        Message::Trim {
            seq: 2,
            offset: 0,
            length: 1 << 20,
            flags: 0,
        },
        Message::Zero {
            seq: 3,
            offset: 8192,
            length: 8192,
            flags: write_flags::MAY_TRIM,
        },
        Message::Received { seq: 3 },
        Message::Ack { seq: 1, status: 0 },
        Message::Barrier { epoch: 9 },
        Message::BarrierAck {
            epoch: 9,
            status: 5,
        },
        Message::BarrierDone { epoch: 9 },
        Message::Ping { token: 77 },
        Message::Pong { token: 77 },
        Message::ReadRequest {
            id: 5,
            offset: 65536,
            length: 4096,
        },
        Message::ReadReply {
            id: 5,
            status: 0,
            data: Bytes::from_static(b"healed"),
        },
        Message::ResyncChecksum {
            id: 6,
            offset: 0,
            length: 3 * 65536 - 512,
            piece: 65536,
            checksums: vec![0xdead_beef, 7, 0],
        },
        Message::ResyncNeed { id: 6, need: 0b101 },
        Message::ResyncData {
            id: 6,
            offset: 0,
            data: Bytes::from_static(&[1; 64]),
        },
        Message::ResyncReply {
            id: 6,
            status: ResyncStatus::Failed(5),
        },
        Message::ChecksumRequest {
            id: 8,
            offset: 0,
            length: 65536,
        },
        Message::ChecksumReply {
            id: 8,
            status: 0,
            checksum: 42,
        },
        Message::OutOfSync {
            offset: 4 << 20,
            length: 8 << 20,
        },
        Message::OutOfSyncDone,
        Message::State {
            role: Role::Secondary,
            disk: DiskState::Inconsistent,
            generations,
        },
        Message::NewGeneration { generations },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn encoded(message: &Message) -> BytesMut {
        let mut out = BytesMut::new();
        message.encode(&mut out);
        out
    }

    #[test]
    fn every_example_round_trips() {
        for message in example_messages() {
            let mut buf = encoded(&message);
            assert_eq!(Message::decode(&mut buf).unwrap(), Some(message.clone()));
            assert!(buf.is_empty(), "{} left bytes behind", message.name());
        }
    }

    #[test]
    fn partial_frames_wait_for_more_bytes() {
        let full = encoded(&example_messages()[0]);
        for cut in 0..full.len() {
            let mut buf = BytesMut::from(&full[..cut]);
            assert_eq!(Message::decode(&mut buf).unwrap(), None, "cut at {cut}");
            assert_eq!(
                buf.len(),
                cut,
                "nothing is consumed before a frame is whole"
            );
        }
    }

    #[test]
    fn malformed_frames_are_clean_errors() {
        let frame = |body: &[u8]| {
            let mut buf = BytesMut::new();
            buf.put_u32(body.len() as u32);
            buf.put_slice(body);
            Message::decode(&mut buf)
        };
        assert_eq!(frame(&[]), Err(PeerWireError::EmptyFrame));
        assert_eq!(frame(&[200]), Err(PeerWireError::UnknownKind(200)));
        assert!(matches!(
            frame(&[kind::ACK, 0, 0]),
            Err(PeerWireError::Truncated { field: "seq", .. })
        ));
        assert!(matches!(
            frame(&[kind::PING, 0, 0, 0, 0, 0, 0, 0, 1, 9]),
            Err(PeerWireError::TrailingBytes { extra: 1, .. })
        ));
        let mut hello = vec![kind::HELLO];
        hello.extend_from_slice(&1u64.to_be_bytes());
        assert_eq!(frame(&hello), Err(PeerWireError::BadMagic(1)));
        let mut bad_flags = vec![kind::TRIM];
        bad_flags.extend_from_slice(&[0; 24]);
        bad_flags.extend_from_slice(&0x80u32.to_be_bytes());
        assert!(matches!(
            frame(&bad_flags),
            Err(PeerWireError::BadValue { field: "flags", .. })
        ));
        let mut refuse = vec![kind::REFUSE, 0, 2, 0xff, 0xfe];
        assert!(matches!(frame(&refuse), Err(PeerWireError::BadText { .. })));
        refuse[2] = 9;
        assert!(matches!(
            frame(&refuse),
            Err(PeerWireError::Truncated { .. })
        ));
        // A resync comparison: piece 0, too many pieces, or fewer checksums than pieces.
        let resync = |length: u32, piece: u32, checksums: usize| {
            let mut body = vec![kind::RESYNC_CHECKSUM];
            body.extend_from_slice(&[0; 16]);
            body.extend_from_slice(&length.to_be_bytes());
            body.extend_from_slice(&piece.to_be_bytes());
            body.extend(std::iter::repeat_n(7u8, 16 * checksums));
            frame(&body)
        };
        assert!(resync(4096, 4096, 1).is_ok());
        assert!(matches!(
            resync(4096, 0, 1),
            Err(PeerWireError::BadValue { field: "piece", .. })
        ));
        assert!(matches!(
            resync(65 * 512, 512, 65),
            Err(PeerWireError::BadValue {
                field: "length",
                ..
            })
        ));
        assert!(matches!(
            resync(3 * 512, 512, 2),
            Err(PeerWireError::Truncated {
                field: "checksum",
                ..
            })
        ));
        assert!(matches!(
            resync(512, 512, 2),
            Err(PeerWireError::TrailingBytes { extra: 16, .. })
        ));
        let mut huge = BytesMut::new();
        huge.put_u32(u32::MAX);
        assert!(matches!(
            Message::decode(&mut huge),
            Err(PeerWireError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn long_text_is_cut_on_a_character_boundary() {
        let reason = "é".repeat(MAX_TEXT);
        let mut buf = encoded(&Message::Refuse { reason });
        match Message::decode(&mut buf).unwrap() {
            Some(Message::Refuse { reason }) => {
                assert!(reason.len() <= MAX_TEXT && reason.chars().all(|c| c == 'é'));
            }
            other => panic!("{other:?}"),
        }
    }

    fn generations() -> impl Strategy<Value = Generations> {
        (any::<u64>(), any::<u64>(), any::<[u64; 2]>()).prop_map(|(current, bitmap, history)| {
            Generations {
                current,
                bitmap,
                history,
            }
        })
    }

    fn role() -> impl Strategy<Value = Role> {
        prop_oneof![Just(Role::Primary), Just(Role::Secondary)]
    }

    fn disk() -> impl Strategy<Value = DiskState> {
        prop_oneof![
            Just(DiskState::UpToDate),
            Just(DiskState::Outdated),
            Just(DiskState::Inconsistent)
        ]
    }

    fn data() -> impl Strategy<Value = Bytes> {
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(Bytes::from)
    }

    fn text() -> impl Strategy<Value = String> {
        "[a-z0-9.é_-]{0,40}"
    }

    fn flags() -> impl Strategy<Value = u32> {
        0..=write_flags::KNOWN
    }

    fn message() -> impl Strategy<Value = Message> {
        let length = 0..=MAX_DATA as u32;
        prop_oneof![
            (
                any::<u16>(),
                text(),
                text(),
                any::<u64>(),
                generations(),
                role(),
                disk(),
                prop_oneof![Just(Protocol::A), Just(Protocol::B), Just(Protocol::C)],
                any::<bool>()
            )
                .prop_map(
                    |(
                        version,
                        resource,
                        node,
                        size,
                        generations,
                        role,
                        disk,
                        protocol,
                        created_blank,
                    )| {
                        Message::Hello(Hello {
                            version,
                            resource,
                            node,
                            size,
                            generations,
                            role,
                            disk,
                            protocol,
                            created_blank,
                        })
                    }
                ),
            text().prop_map(|reason| Message::Refuse { reason }),
            (any::<u64>(), any::<u64>(), flags(), data()).prop_map(|(seq, offset, flags, data)| {
                Message::Write {
                    seq,
                    offset,
                    flags,
                    data,
                }
            }),
            (any::<u64>(), any::<u64>(), any::<u64>(), flags()).prop_map(
                |(seq, offset, length, flags)| Message::Trim {
                    seq,
                    offset,
                    length,
                    flags
                }
            ),
            (any::<u64>(), any::<u64>(), any::<u64>(), flags()).prop_map(
                |(seq, offset, length, flags)| Message::Zero {
                    seq,
                    offset,
                    length,
                    flags
                }
            ),
            any::<u64>().prop_map(|seq| Message::Received { seq }),
            (any::<u64>(), any::<u32>()).prop_map(|(seq, status)| Message::Ack { seq, status }),
            any::<u64>().prop_map(|epoch| Message::Barrier { epoch }),
            (any::<u64>(), any::<u32>())
                .prop_map(|(epoch, status)| Message::BarrierAck { epoch, status }),
            any::<u64>().prop_map(|epoch| Message::BarrierDone { epoch }),
            any::<u64>().prop_map(|token| Message::Ping { token }),
            any::<u64>().prop_map(|token| Message::Pong { token }),
            (any::<u64>(), any::<u64>(), length.clone())
                .prop_map(|(id, offset, length)| Message::ReadRequest { id, offset, length }),
            (any::<u64>(), any::<u32>(), data())
                .prop_map(|(id, status, data)| Message::ReadReply { id, status, data }),
            (
                any::<u64>(),
                any::<u64>(),
                1u32..=(MAX_DATA / MAX_RESYNC_PIECES) as u32,
                proptest::collection::vec(any::<u128>(), 1..=MAX_RESYNC_PIECES),
                any::<u32>()
            )
                .prop_map(|(id, offset, piece, checksums, short)| {
                    // The last piece holds 1..=piece bytes.
                    let length = (checksums.len() as u32 - 1) * piece + 1 + short % piece;
                    Message::ResyncChecksum {
                        id,
                        offset,
                        length,
                        piece,
                        checksums,
                    }
                }),
            (any::<u64>(), any::<u64>()).prop_map(|(id, need)| Message::ResyncNeed { id, need }),
            (any::<u64>(), any::<u64>(), data())
                .prop_map(|(id, offset, data)| Message::ResyncData { id, offset, data }),
            (
                any::<u64>(),
                prop_oneof![
                    Just(ResyncStatus::InSync),
                    (0u32..256).prop_map(ResyncStatus::Failed)
                ]
            )
                .prop_map(|(id, status)| Message::ResyncReply { id, status }),
            (any::<u64>(), any::<u64>(), length)
                .prop_map(|(id, offset, length)| Message::ChecksumRequest { id, offset, length }),
            (any::<u64>(), any::<u32>(), any::<u128>()).prop_map(|(id, status, checksum)| {
                Message::ChecksumReply {
                    id,
                    status,
                    checksum,
                }
            }),
            (any::<u64>(), any::<u64>())
                .prop_map(|(offset, length)| Message::OutOfSync { offset, length }),
            Just(Message::OutOfSyncDone),
            (role(), disk(), generations()).prop_map(|(role, disk, generations)| {
                Message::State {
                    role,
                    disk,
                    generations,
                }
            }),
            generations().prop_map(|generations| Message::NewGeneration { generations }),
        ]
    }

    proptest! {
        #[test]
        fn messages_round_trip_back_to_back(messages in proptest::collection::vec(message(), 1..8)) {
            let mut buf = BytesMut::new();
            for message in &messages {
                message.encode(&mut buf);
            }
            for message in &messages {
                prop_assert_eq!(Message::decode(&mut buf).unwrap(), Some(message.clone()));
            }
            prop_assert!(buf.is_empty());
        }

        #[test]
        fn a_head_and_its_separate_payload_are_the_whole_frame(
            len in 0usize..40_000, kind in 0u8..3, seq in any::<u64>()
        ) {
            let data = Bytes::from((0..len).map(|i| i as u8).collect::<Vec<_>>());
            let message = match kind {
                0 => Message::Write { seq, offset: seq / 2, flags: 1, data },
                1 => Message::ReadReply { id: seq, status: 0, data },
                _ => Message::ResyncData { id: seq, offset: seq / 3, data },
            };
            let mut head = BytesMut::new();
            let payload = message.encode_head(&mut head);
            prop_assert_eq!(payload.is_some(), len >= SEPARATE_PAYLOAD_MIN);
            if let Some(payload) = payload {
                head.extend_from_slice(&payload);
            }
            prop_assert_eq!(&head, &encoded(&message));
            prop_assert_eq!(Message::decode(&mut head).unwrap(), Some(message));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut buf = BytesMut::from(&bytes[..]);
            while let Ok(Some(_)) = Message::decode(&mut buf) {}
        }

        #[test]
        fn a_changed_kind_byte_is_an_error_or_another_valid_message(
            message in message(), kind in any::<u8>()
        ) {
            let mut buf = encoded(&message);
            buf[LENGTH_PREFIX] = kind;
            if let Ok(Some(other)) = Message::decode(&mut buf) {
                // Re-encoding what was decoded gives the same bytes back.
                let mut again = BytesMut::new();
                other.encode(&mut again);
                let mut original = encoded(&message);
                original[LENGTH_PREFIX] = kind;
                prop_assert_eq!(again, original);
            }
        }
    }
}
