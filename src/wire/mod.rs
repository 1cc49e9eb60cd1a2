//! The NBD wire format: constants, handshake messages and transmission messages,
//! encoded and decoded without any I/O so that they can be property-tested and fuzzed.
//!
//! The constants follow `doc/proto.md` of the NetworkBlockDevice/nbd repository,
//! including the extended-headers extension (64-bit request and reply headers).

pub mod handshake;
pub mod transmission;

/// `NBDMAGIC`: first eight bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle magic, sent by the server and before every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic that starts every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

/// Magic of a compact (32-bit length) request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of an extended (64-bit length) request.
pub const EXTENDED_REQUEST_MAGIC: u32 = 0x21e4_1c71;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// Magic of an extended reply chunk.
pub const EXTENDED_REPLY_MAGIC: u32 = 0x6e8a_278c;

/// Handshake flags the server sends.
pub mod handshake_flags {
    pub const FIXED_NEWSTYLE: u16 = 1 << 0;
    pub const NO_ZEROES: u16 = 1 << 1;
}

/// Client flags, the reply to the handshake flags.
pub mod client_flags {
    pub const FIXED_NEWSTYLE: u32 = 1 << 0;
    pub const NO_ZEROES: u32 = 1 << 1;
    /// Every flag this server understands.
    pub const KNOWN: u32 = FIXED_NEWSTYLE | NO_ZEROES;
}

/// Transmission flags, sent with the export size.
pub mod transmission_flags {
    pub const HAS_FLAGS: u16 = 1 << 0;
    pub const READ_ONLY: u16 = 1 << 1;
    pub const SEND_FLUSH: u16 = 1 << 2;
    pub const SEND_FUA: u16 = 1 << 3;
    pub const ROTATIONAL: u16 = 1 << 4;
    pub const SEND_TRIM: u16 = 1 << 5;
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    pub const SEND_DF: u16 = 1 << 7;
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    pub const SEND_RESIZE: u16 = 1 << 9;
    pub const SEND_CACHE: u16 = 1 << 10;
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
    pub const BLOCK_STATUS_PAYLOAD: u16 = 1 << 12;
}

/// Option codes sent by the client during option haggling.
pub mod opt {
    pub const EXPORT_NAME: u32 = 1;
    pub const ABORT: u32 = 2;
    pub const LIST: u32 = 3;
    pub const PEEK_EXPORT: u32 = 4;
    pub const STARTTLS: u32 = 5;
    pub const INFO: u32 = 6;
    pub const GO: u32 = 7;
    pub const STRUCTURED_REPLY: u32 = 8;
    pub const LIST_META_CONTEXT: u32 = 9;
    pub const SET_META_CONTEXT: u32 = 10;
    pub const EXTENDED_HEADERS: u32 = 11;
}

/// Option reply types.
pub mod rep {
    pub const ACK: u32 = 1;
    pub const SERVER: u32 = 2;
    pub const INFO: u32 = 3;
    pub const META_CONTEXT: u32 = 4;
    const ERR: u32 = 1 << 31;
    pub const ERR_UNSUP: u32 = ERR | 1;
    pub const ERR_POLICY: u32 = ERR | 2;
    pub const ERR_INVALID: u32 = ERR | 3;
    pub const ERR_PLATFORM: u32 = ERR | 4;
    pub const ERR_TLS_REQD: u32 = ERR | 5;
    pub const ERR_UNKNOWN: u32 = ERR | 6;
    pub const ERR_SHUTDOWN: u32 = ERR | 7;
    pub const ERR_BLOCK_SIZE_REQD: u32 = ERR | 8;
    pub const ERR_TOO_BIG: u32 = ERR | 9;
    pub const ERR_EXT_HEADER_REQD: u32 = ERR | 10;
}

/// Information types in `NBD_REP_INFO` replies and `NBD_OPT_INFO`/`GO` requests.
pub mod info {
    pub const EXPORT: u16 = 0;
    pub const NAME: u16 = 1;
    pub const DESCRIPTION: u16 = 2;
    pub const BLOCK_SIZE: u16 = 3;
}

/// Command types.
pub mod cmd {
    pub const READ: u16 = 0;
    pub const WRITE: u16 = 1;
    pub const DISC: u16 = 2;
    pub const FLUSH: u16 = 3;
    pub const TRIM: u16 = 4;
    pub const CACHE: u16 = 5;
    pub const WRITE_ZEROES: u16 = 6;
    pub const BLOCK_STATUS: u16 = 7;
}

/// Command flags.
pub mod cmd_flags {
    pub const FUA: u16 = 1 << 0;
    pub const NO_HOLE: u16 = 1 << 1;
    pub const DF: u16 = 1 << 2;
    pub const REQ_ONE: u16 = 1 << 3;
    pub const FAST_ZERO: u16 = 1 << 4;
    pub const PAYLOAD_LEN: u16 = 1 << 5;
}

/// Structured and extended reply chunk types and flags.
pub mod reply {
    pub const FLAG_DONE: u16 = 1 << 0;
    pub const TYPE_NONE: u16 = 0;
    pub const TYPE_OFFSET_DATA: u16 = 1;
    pub const TYPE_OFFSET_HOLE: u16 = 2;
    pub const TYPE_BLOCK_STATUS: u16 = 5;
    pub const TYPE_BLOCK_STATUS_EXT: u16 = 6;
    pub const TYPE_ERROR: u16 = (1 << 15) | 1;
    pub const TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;
}

/// `base:allocation` status flags.
pub mod state {
    pub const HOLE: u32 = 1 << 0;
    pub const ZERO: u32 = 1 << 1;
}

/// The one metadata context this server offers.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// The context ID the server assigns to `base:allocation`.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// Size constraints advertised in `NBD_INFO_BLOCK_SIZE`.
pub const MIN_BLOCK_SIZE: u32 = 1;
/// Preferred block size: requests of this alignment avoid read-modify-write.
pub const PREFERRED_BLOCK_SIZE: u32 = 4096;
/// Largest READ or WRITE payload the server accepts: 32 MiB.
pub const MAX_PAYLOAD: u32 = 32 * 1024 * 1024;
/// Longest option payload read during the handshake (names are at most 4096 bytes); a
/// longer one, up to [`MAX_SKIPPED_OPTION_LEN`], is read past and answered with
/// `NBD_REP_ERR_TOO_BIG`.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;
/// Longest option payload the server reads past; a longer option ends the connection (a
/// client sending gigabytes of option data is not negotiating).
pub const MAX_SKIPPED_OPTION_LEN: u32 = 64 * 1024 * 1024;
/// Longest string the spec allows (export names, descriptions, context names).
pub const MAX_STRING_LEN: usize = 4096;

/// NBD error numbers sent in replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum NbdError {
    Perm = 1,
    Io = 5,
    NoMem = 12,
    Inval = 22,
    NoSpc = 28,
    Overflow = 75,
    NotSup = 95,
    Shutdown = 108,
}

impl NbdError {
    /// The value on the wire.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// Maps an operating-system error number onto the spec's restricted set.
    pub fn from_errno(errno: i32) -> NbdError {
        match errno {
            1 | 13 | 30 => NbdError::Perm,    // EPERM, EACCES, EROFS
            12 => NbdError::NoMem,            // ENOMEM
            22 => NbdError::Inval,            // EINVAL
            27 | 28 | 122 => NbdError::NoSpc, // EFBIG, ENOSPC, EDQUOT
            75 => NbdError::Overflow,         // EOVERFLOW
            95 => NbdError::NotSup,           // EOPNOTSUPP
            108 => NbdError::Shutdown,        // ESHUTDOWN
            _ => NbdError::Io,
        }
    }

    /// Maps an I/O error onto the spec's restricted set.
    pub fn from_io(err: &std::io::Error) -> NbdError {
        match err.raw_os_error() {
            Some(errno) => NbdError::from_errno(errno),
            None => match err.kind() {
                std::io::ErrorKind::PermissionDenied => NbdError::Perm,
                std::io::ErrorKind::InvalidInput => NbdError::Inval,
                std::io::ErrorKind::Unsupported => NbdError::NotSup,
                std::io::ErrorKind::OutOfMemory => NbdError::NoMem,
                _ => NbdError::Io,
            },
        }
    }
}

impl std::fmt::Display for NbdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            NbdError::Perm => "EPERM",
            NbdError::Io => "EIO",
            NbdError::NoMem => "ENOMEM",
            NbdError::Inval => "EINVAL",
            NbdError::NoSpc => "ENOSPC",
            NbdError::Overflow => "EOVERFLOW",
            NbdError::NotSup => "ENOTSUP",
            NbdError::Shutdown => "ESHUTDOWN",
        };
        f.write_str(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping_covers_the_spec_table() {
        assert_eq!(NbdError::from_errno(libc_like::ENOSPC), NbdError::NoSpc);
        assert_eq!(NbdError::from_errno(libc_like::EDQUOT), NbdError::NoSpc);
        assert_eq!(NbdError::from_errno(libc_like::EFBIG), NbdError::NoSpc);
        assert_eq!(NbdError::from_errno(libc_like::EROFS), NbdError::Perm);
        assert_eq!(
            NbdError::from_errno(libc_like::EOPNOTSUPP),
            NbdError::NotSup
        );
        assert_eq!(NbdError::from_errno(9999), NbdError::Io);
        assert_eq!(NbdError::Inval.code(), 22);
        assert_eq!(NbdError::Shutdown.to_string(), "ESHUTDOWN");
    }

    mod libc_like {
        pub const ENOSPC: i32 = 28;
        pub const EDQUOT: i32 = 122;
        pub const EFBIG: i32 = 27;
        pub const EROFS: i32 = 30;
        pub const EOPNOTSUPP: i32 = 95;
    }
}
