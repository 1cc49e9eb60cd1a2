//! Handshake-phase messages of fixed newstyle negotiation: the greeting, client options
//! and option replies. Pure encode and decode; the server's negotiation logic lives in
//! `server::handshake`.

use super::{
    opt, rep, IHAVEOPT, MAX_SKIPPED_OPTION_LEN, MAX_STRING_LEN, NBD_MAGIC, OPTION_REPLY_MAGIC,
};

/// Length of the server's greeting: `NBDMAGIC`, `IHAVEOPT`, 16 bits of handshake flags.
pub const GREETING_LEN: usize = 18;
/// Length of an option header: `IHAVEOPT`, option code, data length.
pub const OPTION_HEADER_LEN: usize = 16;

/// Encodes the server's greeting.
pub fn encode_greeting(handshake_flags: u16) -> [u8; GREETING_LEN] {
    let mut out = [0u8; GREETING_LEN];
    out[0..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[16..18].copy_from_slice(&handshake_flags.to_be_bytes());
    out
}

/// Why the handshake cannot go on: each of these ends the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    #[error("bad option magic {0:#018x}")]
    BadOptionMagic(u64),
    #[error("option {option} has {length} bytes of data, more than the {max} allowed")]
    OptionTooLong { option: u32, length: u32, max: u32 },
    #[error("unknown client flags {0:#010x}")]
    UnknownClientFlags(u32),
}

/// The fixed part of every client option.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub length: u32,
}

impl OptionHeader {
    /// Decodes an option header, refusing a bad magic or a length over
    /// [`MAX_SKIPPED_OPTION_LEN`] (one over [`super::MAX_OPTION_LEN`] is the server's to
    /// skip and refuse).
    pub fn decode(bytes: &[u8; OPTION_HEADER_LEN]) -> Result<OptionHeader, HandshakeError> {
        let magic = u64::from_be_bytes(bytes[0..8].try_into().expect("8 bytes"));
        if magic != IHAVEOPT {
            return Err(HandshakeError::BadOptionMagic(magic));
        }
        let option = u32::from_be_bytes(bytes[8..12].try_into().expect("4 bytes"));
        let length = u32::from_be_bytes(bytes[12..16].try_into().expect("4 bytes"));
        if length > MAX_SKIPPED_OPTION_LEN {
            return Err(HandshakeError::OptionTooLong {
                option,
                length,
                max: MAX_SKIPPED_OPTION_LEN,
            });
        }
        Ok(OptionHeader { option, length })
    }
}

/// The export name and information items of `NBD_OPT_INFO` and `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

/// The export name and queries of `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub export: String,
    pub queries: Vec<String>,
}

/// A parsed client option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientOption {
    ExportName(String),
    Abort,
    List,
    StartTls,
    Info(InfoRequest),
    Go(InfoRequest),
    StructuredReply,
    ListMetaContext(MetaContextRequest),
    SetMetaContext(MetaContextRequest),
    ExtendedHeaders,
    /// An option this server does not know; answered with `NBD_REP_ERR_UNSUP`.
    Unknown(u32),
}

/// Why an option's data is malformed; answered with `NBD_REP_ERR_INVALID` (or, for
/// `NBD_OPT_EXPORT_NAME`, which cannot carry an error, by closing the connection).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("option {option}: {reason}")]
pub struct OptionParseError {
    pub option: u32,
    pub reason: &'static str,
}

struct Reader<'a> {
    data: &'a [u8],
    option: u32,
}

impl<'a> Reader<'a> {
    fn fail(&self, reason: &'static str) -> OptionParseError {
        OptionParseError {
            option: self.option,
            reason,
        }
    }

    fn take(&mut self, n: usize, reason: &'static str) -> Result<&'a [u8], OptionParseError> {
        if self.data.len() < n {
            return Err(self.fail(reason));
        }
        let (head, tail) = self.data.split_at(n);
        self.data = tail;
        Ok(head)
    }

    fn u16(&mut self) -> Result<u16, OptionParseError> {
        let b = self.take(2, "truncated 16-bit field")?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, OptionParseError> {
        let b = self.take(4, "truncated 32-bit field")?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn string(&mut self, len: usize) -> Result<String, OptionParseError> {
        if len > MAX_STRING_LEN {
            return Err(self.fail("string longer than 4096 bytes"));
        }
        let bytes = self.take(len, "string runs past the option data")?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.fail("string is not valid UTF-8"))
    }

    fn finish(&self) -> Result<(), OptionParseError> {
        if self.data.is_empty() {
            Ok(())
        } else {
            Err(self.fail("trailing bytes after the option data"))
        }
    }
}

impl ClientOption {
    /// Parses the data of option `option`.
    pub fn parse(option: u32, data: &[u8]) -> Result<ClientOption, OptionParseError> {
        let mut r = Reader { data, option };
        let no_data = |r: &Reader| {
            if r.data.is_empty() {
                Ok(())
            } else {
                Err(r.fail("this option takes no data"))
            }
        };
        match option {
            opt::EXPORT_NAME => Ok(ClientOption::ExportName(r.string(data.len())?)),
            // The spec asks the server to ignore any data sent with ABORT.
            opt::ABORT => Ok(ClientOption::Abort),
            opt::LIST => no_data(&r).map(|_| ClientOption::List),
            opt::STARTTLS => no_data(&r).map(|_| ClientOption::StartTls),
            opt::STRUCTURED_REPLY => no_data(&r).map(|_| ClientOption::StructuredReply),
            opt::EXTENDED_HEADERS => no_data(&r).map(|_| ClientOption::ExtendedHeaders),
            opt::INFO | opt::GO => {
                let name_len = r.u32()? as usize;
                let name = r.string(name_len)?;
                let count = r.u16()? as usize;
                let mut requests = Vec::with_capacity(count.min(r.data.len() / 2));
                for _ in 0..count {
                    requests.push(r.u16()?);
                }
                r.finish()?;
                let request = InfoRequest { name, requests };
                Ok(if option == opt::INFO {
                    ClientOption::Info(request)
                } else {
                    ClientOption::Go(request)
                })
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                let name_len = r.u32()? as usize;
                let export = r.string(name_len)?;
                let count = r.u32()? as usize;
                let mut queries = Vec::with_capacity(count.min(r.data.len() / 4));
                for _ in 0..count {
                    let len = r.u32()? as usize;
                    queries.push(r.string(len)?);
                }
                r.finish()?;
                let request = MetaContextRequest { export, queries };
                Ok(if option == opt::LIST_META_CONTEXT {
                    ClientOption::ListMetaContext(request)
                } else {
                    ClientOption::SetMetaContext(request)
                })
            }
            other => Ok(ClientOption::Unknown(other)),
        }
    }

    /// The option code.
    pub fn code(&self) -> u32 {
        match self {
            ClientOption::ExportName(_) => opt::EXPORT_NAME,
            ClientOption::Abort => opt::ABORT,
            ClientOption::List => opt::LIST,
            ClientOption::StartTls => opt::STARTTLS,
            ClientOption::Info(_) => opt::INFO,
            ClientOption::Go(_) => opt::GO,
            ClientOption::StructuredReply => opt::STRUCTURED_REPLY,
            ClientOption::ListMetaContext(_) => opt::LIST_META_CONTEXT,
            ClientOption::SetMetaContext(_) => opt::SET_META_CONTEXT,
            ClientOption::ExtendedHeaders => opt::EXTENDED_HEADERS,
            ClientOption::Unknown(code) => *code,
        }
    }

    /// Encodes the option with its header, as a client sends it.
    pub fn encode(&self) -> Vec<u8> {
        let mut data = Vec::new();
        match self {
            ClientOption::ExportName(name) => data.extend_from_slice(name.as_bytes()),
            ClientOption::Info(req) | ClientOption::Go(req) => {
                data.extend_from_slice(&(req.name.len() as u32).to_be_bytes());
                data.extend_from_slice(req.name.as_bytes());
                data.extend_from_slice(&(req.requests.len() as u16).to_be_bytes());
                for item in &req.requests {
                    data.extend_from_slice(&item.to_be_bytes());
                }
            }
            ClientOption::ListMetaContext(req) | ClientOption::SetMetaContext(req) => {
                data.extend_from_slice(&(req.export.len() as u32).to_be_bytes());
                data.extend_from_slice(req.export.as_bytes());
                data.extend_from_slice(&(req.queries.len() as u32).to_be_bytes());
                for query in &req.queries {
                    data.extend_from_slice(&(query.len() as u32).to_be_bytes());
                    data.extend_from_slice(query.as_bytes());
                }
            }
            _ => {}
        }
        let mut out = Vec::with_capacity(OPTION_HEADER_LEN + data.len());
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&self.code().to_be_bytes());
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(&data);
        out
    }
}

/// One reply to a client option.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub reply_type: u32,
    pub data: Vec<u8>,
}

impl OptionReply {
    pub fn ack(option: u32) -> OptionReply {
        OptionReply {
            option,
            reply_type: rep::ACK,
            data: Vec::new(),
        }
    }

    /// An error reply with a message for a human, cut to the spec's longest string at a
    /// character's boundary (it must stay UTF-8).
    pub fn error(option: u32, reply_type: u32, message: &str) -> OptionReply {
        let mut end = message.len().min(MAX_STRING_LEN);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        let data = message.as_bytes()[..end].to_vec();
        OptionReply {
            option,
            reply_type,
            data,
        }
    }

    /// `NBD_REP_SERVER`: an export name and, if not empty, its description.
    pub fn server(option: u32, name: &str, description: &str) -> OptionReply {
        let mut data = Vec::with_capacity(4 + name.len() + description.len());
        data.extend_from_slice(&(name.len() as u32).to_be_bytes());
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(description.as_bytes());
        OptionReply {
            option,
            reply_type: rep::SERVER,
            data,
        }
    }

    /// `NBD_REP_INFO` with `NBD_INFO_EXPORT`.
    pub fn info_export(option: u32, size: u64, flags: u16) -> OptionReply {
        let mut data = Vec::with_capacity(12);
        data.extend_from_slice(&super::info::EXPORT.to_be_bytes());
        data.extend_from_slice(&size.to_be_bytes());
        data.extend_from_slice(&flags.to_be_bytes());
        OptionReply {
            option,
            reply_type: rep::INFO,
            data,
        }
    }

    /// `NBD_REP_INFO` with a string item (`NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION`).
    pub fn info_string(option: u32, item: u16, text: &str) -> OptionReply {
        let mut data = Vec::with_capacity(2 + text.len());
        data.extend_from_slice(&item.to_be_bytes());
        data.extend_from_slice(text.as_bytes());
        OptionReply {
            option,
            reply_type: rep::INFO,
            data,
        }
    }

    /// `NBD_REP_INFO` with `NBD_INFO_BLOCK_SIZE`.
    pub fn info_block_size(option: u32, minimum: u32, preferred: u32, maximum: u32) -> OptionReply {
        let mut data = Vec::with_capacity(14);
        data.extend_from_slice(&super::info::BLOCK_SIZE.to_be_bytes());
        data.extend_from_slice(&minimum.to_be_bytes());
        data.extend_from_slice(&preferred.to_be_bytes());
        data.extend_from_slice(&maximum.to_be_bytes());
        OptionReply {
            option,
            reply_type: rep::INFO,
            data,
        }
    }

    /// `NBD_REP_META_CONTEXT`.
    pub fn meta_context(option: u32, id: u32, name: &str) -> OptionReply {
        let mut data = Vec::with_capacity(4 + name.len());
        data.extend_from_slice(&id.to_be_bytes());
        data.extend_from_slice(name.as_bytes());
        OptionReply {
            option,
            reply_type: rep::META_CONTEXT,
            data,
        }
    }

    /// Whether this reply ends the answer to its option.
    pub fn is_final(&self) -> bool {
        self.reply_type == rep::ACK || self.reply_type & (1 << 31) != 0
    }

    /// Appends the encoded reply to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&self.option.to_be_bytes());
        out.extend_from_slice(&self.reply_type.to_be_bytes());
        out.extend_from_slice(&(self.data.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.data);
    }

    /// Decodes one reply from the front of `bytes`, as a client would: `Ok(None)` when more
    /// bytes are needed, otherwise the reply and how many bytes it took.
    pub fn decode(bytes: &[u8]) -> Result<Option<(OptionReply, usize)>, &'static str> {
        if bytes.len() < 20 {
            return Ok(None);
        }
        let magic = u64::from_be_bytes(bytes[0..8].try_into().expect("8 bytes"));
        if magic != OPTION_REPLY_MAGIC {
            return Err("bad option reply magic");
        }
        let option = u32::from_be_bytes(bytes[8..12].try_into().expect("4 bytes"));
        let reply_type = u32::from_be_bytes(bytes[12..16].try_into().expect("4 bytes"));
        let len = u32::from_be_bytes(bytes[16..20].try_into().expect("4 bytes")) as usize;
        if bytes.len() < 20 + len {
            return Ok(None);
        }
        let data = bytes[20..20 + len].to_vec();
        Ok(Some((
            OptionReply {
                option,
                reply_type,
                data,
            },
            20 + len,
        )))
    }
}

/// The reply to `NBD_OPT_EXPORT_NAME`: size, transmission flags and, unless the client
/// negotiated `NO_ZEROES`, 124 bytes of zeroes.
pub fn encode_export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + 124);
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        out.resize(out.len() + 124, 0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn name() -> impl Strategy<Value = String> {
        proptest::string::string_regex("[a-zA-Z0-9:/_é-]{0,40}").expect("valid regex")
    }

    fn client_option() -> impl Strategy<Value = ClientOption> {
        let info = || {
            (name(), proptest::collection::vec(any::<u16>(), 0..8))
                .prop_map(|(name, requests)| InfoRequest { name, requests })
        };
        let meta = || {
            (name(), proptest::collection::vec(name(), 0..5))
                .prop_map(|(export, queries)| MetaContextRequest { export, queries })
        };
        prop_oneof![
            name().prop_map(ClientOption::ExportName),
            Just(ClientOption::Abort),
            Just(ClientOption::List),
            Just(ClientOption::StartTls),
            info().prop_map(ClientOption::Info),
            info().prop_map(ClientOption::Go),
            Just(ClientOption::StructuredReply),
            meta().prop_map(ClientOption::ListMetaContext),
            meta().prop_map(ClientOption::SetMetaContext),
            Just(ClientOption::ExtendedHeaders),
            (12u32..).prop_map(ClientOption::Unknown),
        ]
    }

    proptest! {
        #[test]
        fn every_option_round_trips(option in client_option()) {
            let bytes = option.encode();
            let header = OptionHeader::decode(bytes[..16].try_into().unwrap()).unwrap();
            prop_assert_eq!(header.length as usize, bytes.len() - 16);
            let parsed = ClientOption::parse(header.option, &bytes[16..]).unwrap();
            prop_assert_eq!(parsed, option);
        }

        #[test]
        fn every_reply_round_trips(option in any::<u32>(), reply_type in any::<u32>(),
                                   data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let reply = OptionReply { option, reply_type, data };
            let mut bytes = Vec::new();
            reply.encode_into(&mut bytes);
            let (decoded, used) = OptionReply::decode(&bytes).unwrap().unwrap();
            prop_assert_eq!(used, bytes.len());
            prop_assert_eq!(decoded, reply);
        }

        #[test]
        fn parsing_arbitrary_data_never_panics(option in 0u32..16,
                                               data in proptest::collection::vec(any::<u8>(), 0..128)) {
            let _ = ClientOption::parse(option, &data);
        }
    }

    #[test]
    fn greeting_has_both_magics_and_flags() {
        let g = encode_greeting(3);
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..18], &[0, 3]);
    }

    #[test]
    fn bad_magic_is_refused() {
        let mut bytes = ClientOption::List.encode();
        bytes[0] ^= 0xff;
        let err = OptionHeader::decode(bytes[..16].try_into().unwrap()).unwrap_err();
        assert!(matches!(err, HandshakeError::BadOptionMagic(_)));
    }

    #[test]
    fn oversized_option_is_refused() {
        let mut bytes = ClientOption::List.encode();
        bytes[12..16].copy_from_slice(&(MAX_SKIPPED_OPTION_LEN + 1).to_be_bytes());
        let err = OptionHeader::decode(bytes[..16].try_into().unwrap()).unwrap_err();
        assert!(matches!(err, HandshakeError::OptionTooLong { .. }));
        // Longer than the server reads, but not past what it skips: for the server.
        bytes[12..16].copy_from_slice(&MAX_SKIPPED_OPTION_LEN.to_be_bytes());
        assert!(OptionHeader::decode(bytes[..16].try_into().unwrap()).is_ok());
    }

    #[test]
    fn error_messages_are_cut_at_a_character_boundary() {
        let name = "é".repeat(2048); // 4096 bytes, a legal export name
        let reply = OptionReply::error(1, rep::ERR_UNKNOWN, &format!("no export named {name:?}"));
        assert!(reply.data.len() <= MAX_STRING_LEN);
        assert!(std::str::from_utf8(&reply.data).is_ok());
        assert_eq!(
            OptionReply::error(1, rep::ERR_UNKNOWN, "short").data,
            b"short"
        );
    }

    #[test]
    fn malformed_options_map_to_their_errors() {
        // LIST with data.
        assert_eq!(
            ClientOption::parse(opt::LIST, b"x").unwrap_err().reason,
            "this option takes no data"
        );
        // GO whose name length runs past the data.
        let err = ClientOption::parse(opt::GO, &[0, 0, 0, 9, b'a']).unwrap_err();
        assert_eq!(err.reason, "string runs past the option data");
        // GO with a truncated information count.
        let err = ClientOption::parse(opt::GO, &[0, 0, 0, 0, 0]).unwrap_err();
        assert_eq!(err.reason, "truncated 16-bit field");
        // GO with trailing bytes.
        let err = ClientOption::parse(opt::GO, &[0, 0, 0, 0, 0, 0, 9]).unwrap_err();
        assert_eq!(err.reason, "trailing bytes after the option data");
        // A name that is not UTF-8.
        let err = ClientOption::parse(opt::EXPORT_NAME, &[0xff, 0xfe]).unwrap_err();
        assert_eq!(err.reason, "string is not valid UTF-8");
        // A meta-context query count larger than the data.
        let err =
            ClientOption::parse(opt::SET_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 5]).unwrap_err();
        assert_eq!(err.reason, "truncated 32-bit field");
        // ABORT ignores data, unknown options are reported as such.
        assert_eq!(
            ClientOption::parse(opt::ABORT, b"junk").unwrap(),
            ClientOption::Abort
        );
        assert_eq!(
            ClientOption::parse(99, b"junk").unwrap(),
            ClientOption::Unknown(99)
        );
    }

    #[test]
    fn export_name_reply_honours_no_zeroes() {
        assert_eq!(encode_export_name_reply(1, 1, true).len(), 10);
        assert_eq!(encode_export_name_reply(1, 1, false).len(), 134);
    }
}
