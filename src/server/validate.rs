//! Validation of each request at the protocol edge: command, flags, read-only, range and
//! size limits are checked once here and mapped to the NBD error the spec asks for, so the
//! core only ever sees well-formed commands.

use crate::wire::transmission::{RequestHeader, RequestStyle};
use crate::wire::{cmd, cmd_flags, NbdError, MAX_PAYLOAD};

/// A request that passed validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read {
        offset: u64,
        length: u32,
        df: bool,
    },
    Write {
        offset: u64,
        length: u32,
        fua: bool,
    },
    Disconnect,
    Flush,
    Trim {
        offset: u64,
        length: u64,
        fua: bool,
    },
    Cache {
        offset: u64,
        length: u64,
    },
    WriteZeroes {
        offset: u64,
        length: u64,
        no_hole: bool,
        fast: bool,
        fua: bool,
    },
    BlockStatus {
        offset: u64,
        length: u64,
        req_one: bool,
    },
}

/// What the edge needs to know about the connection and its export.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub size: u64,
    pub read_only: bool,
    pub style: RequestStyle,
    /// Structured replies or extended headers were negotiated.
    pub chunked_replies: bool,
    /// `base:allocation` was selected.
    pub base_allocation: bool,
    /// `NBD_FLAG_SEND_FAST_ZERO` was advertised: without it, the spec says a request with
    /// `NBD_CMD_FLAG_FAST_ZERO` SHOULD fail with `EINVAL` (a backend that cannot tell fast
    /// from slow zeroing would otherwise do it slowly, the one thing the flag rules out).
    pub fast_zero: bool,
}

/// Checks one request; on failure returns the error to send (the connection goes on).
pub fn validate(h: &RequestHeader, limits: &Limits) -> Result<Command, NbdError> {
    use cmd_flags::*;
    let extended = limits.style == RequestStyle::Extended;
    let allowed = match h.command {
        cmd::READ if limits.chunked_replies => FUA | DF,
        cmd::READ => FUA,
        cmd::WRITE if extended => FUA | PAYLOAD_LEN,
        cmd::WRITE | cmd::DISC | cmd::FLUSH | cmd::TRIM | cmd::CACHE => FUA,
        cmd::WRITE_ZEROES => FUA | NO_HOLE | FAST_ZERO,
        cmd::BLOCK_STATUS => FUA | REQ_ONE,
        _ => return Err(NbdError::Inval),
    };
    if h.flags & !allowed != 0 {
        return Err(NbdError::Inval);
    }
    if h.flags & FAST_ZERO != 0 && !limits.fast_zero {
        return Err(NbdError::Inval);
    }
    let writes = matches!(h.command, cmd::WRITE | cmd::TRIM | cmd::WRITE_ZEROES);
    if writes && limits.read_only {
        return Err(NbdError::Perm);
    }
    let in_range = h
        .offset
        .checked_add(h.length)
        .is_some_and(|end| end <= limits.size);
    if matches!(h.command, cmd::READ | cmd::WRITE) && h.length > u64::from(MAX_PAYLOAD) {
        // A read with chunked replies is not bound by the maximum payload in the spec, which
        // lets a server refuse it up front with EOVERFLOW: the hint to retry smaller (not
        // for a read past the end, which smaller would not mend).
        return Err(
            if h.command == cmd::READ && limits.chunked_replies && in_range {
                NbdError::Overflow
            } else {
                NbdError::Inval
            },
        );
    }
    if !in_range && !matches!(h.command, cmd::DISC | cmd::FLUSH) {
        return Err(if matches!(h.command, cmd::WRITE | cmd::WRITE_ZEROES) {
            NbdError::NoSpc
        } else {
            NbdError::Inval
        });
    }
    let fua = h.flags & FUA != 0;
    let (offset, length) = (h.offset, h.length);
    Ok(match h.command {
        cmd::READ => Command::Read {
            offset,
            length: length as u32,
            df: h.flags & DF != 0,
        },
        cmd::WRITE => Command::Write {
            offset,
            length: length as u32,
            fua,
        },
        cmd::DISC => Command::Disconnect,
        cmd::FLUSH if offset != 0 || length != 0 => return Err(NbdError::Inval),
        cmd::FLUSH => Command::Flush,
        cmd::TRIM => Command::Trim {
            offset,
            length,
            fua,
        },
        cmd::CACHE => Command::Cache { offset, length },
        cmd::WRITE_ZEROES => Command::WriteZeroes {
            offset,
            length,
            no_hole: h.flags & NO_HOLE != 0,
            fast: h.flags & FAST_ZERO != 0,
            fua,
        },
        cmd::BLOCK_STATUS if !limits.base_allocation || !limits.chunked_replies => {
            return Err(NbdError::Inval)
        }
        cmd::BLOCK_STATUS if length == 0 => return Err(NbdError::Inval),
        cmd::BLOCK_STATUS => Command::BlockStatus {
            offset,
            length,
            req_one: h.flags & REQ_ONE != 0,
        },
        _ => return Err(NbdError::Inval),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        size: 1 << 20,
        read_only: false,
        style: RequestStyle::Compact,
        chunked_replies: true,
        base_allocation: true,
        fast_zero: true,
    };

    fn req(command: u16, flags: u16, offset: u64, length: u64) -> RequestHeader {
        RequestHeader {
            flags,
            command,
            cookie: 1,
            offset,
            length,
        }
    }

    #[test]
    fn good_requests_pass() {
        assert_eq!(
            validate(&req(cmd::READ, cmd_flags::DF, 0, 4096), &LIMITS),
            Ok(Command::Read {
                offset: 0,
                length: 4096,
                df: true
            })
        );
        assert_eq!(
            validate(&req(cmd::FLUSH, 0, 0, 0), &LIMITS),
            Ok(Command::Flush)
        );
        assert_eq!(
            validate(
                &req(
                    cmd::WRITE_ZEROES,
                    cmd_flags::NO_HOLE | cmd_flags::FAST_ZERO,
                    0,
                    1 << 20
                ),
                &LIMITS
            ),
            Ok(Command::WriteZeroes {
                offset: 0,
                length: 1 << 20,
                no_hole: true,
                fast: true,
                fua: false
            })
        );
    }

    #[test]
    fn past_the_end_is_einval_for_reads_and_enospc_for_writes() {
        assert_eq!(
            validate(&req(cmd::READ, 0, (1 << 20) - 1, 2), &LIMITS),
            Err(NbdError::Inval)
        );
        assert_eq!(
            validate(&req(cmd::TRIM, 0, 1 << 20, 1), &LIMITS),
            Err(NbdError::Inval)
        );
        assert_eq!(
            validate(&req(cmd::WRITE, 0, 1 << 20, 1), &LIMITS),
            Err(NbdError::NoSpc)
        );
        assert_eq!(
            validate(&req(cmd::WRITE_ZEROES, 0, 1 << 19, 1 << 20), &LIMITS),
            Err(NbdError::NoSpc)
        );
        assert_eq!(
            validate(&req(cmd::READ, 0, u64::MAX, 2), &LIMITS),
            Err(NbdError::Inval)
        );
    }

    #[test]
    fn unknown_commands_and_flags_are_einval() {
        assert_eq!(validate(&req(42, 0, 0, 0), &LIMITS), Err(NbdError::Inval));
        assert_eq!(
            validate(&req(cmd::READ, 1 << 9, 0, 1), &LIMITS),
            Err(NbdError::Inval)
        );
        assert_eq!(
            validate(&req(cmd::WRITE, cmd_flags::NO_HOLE, 0, 1), &LIMITS),
            Err(NbdError::Inval)
        );
        let simple = Limits {
            chunked_replies: false,
            ..LIMITS
        };
        assert_eq!(
            validate(&req(cmd::READ, cmd_flags::DF, 0, 1), &simple),
            Err(NbdError::Inval)
        );
        assert_eq!(
            validate(&req(cmd::BLOCK_STATUS, 0, 0, 1), &simple),
            Err(NbdError::Inval)
        );
        assert_eq!(
            validate(&req(cmd::FLUSH, 0, 1, 0), &LIMITS),
            Err(NbdError::Inval)
        );
    }

    #[test]
    fn oversized_payloads_are_einval_and_chunked_reads_eoverflow() {
        let big = u64::from(MAX_PAYLOAD) + 1;
        let chunked = Limits {
            size: 1 << 40,
            ..LIMITS
        };
        let limits = Limits {
            chunked_replies: false,
            ..chunked
        };
        assert_eq!(
            validate(&req(cmd::READ, 0, 0, big), &limits),
            Err(NbdError::Inval)
        );
        assert_eq!(
            validate(&req(cmd::READ, 0, 0, big), &chunked),
            Err(NbdError::Overflow)
        );
        // Past the end as well: EINVAL, as any read past the end.
        assert_eq!(
            validate(&req(cmd::READ, 0, (1 << 40) - 4096, big), &chunked),
            Err(NbdError::Inval)
        );
        assert_eq!(
            validate(&req(cmd::WRITE, 0, 0, big), &chunked),
            Err(NbdError::Inval)
        );
        assert_eq!(
            validate(&req(cmd::WRITE, 0, 0, big), &limits),
            Err(NbdError::Inval)
        );
        // Effect lengths beyond the payload limit are fine.
        assert!(validate(&req(cmd::TRIM, 0, 0, big), &limits).is_ok());
    }

    #[test]
    fn read_only_exports_refuse_writes_with_eperm() {
        let ro = Limits {
            read_only: true,
            ..LIMITS
        };
        assert_eq!(
            validate(&req(cmd::WRITE, 0, 0, 1), &ro),
            Err(NbdError::Perm)
        );
        assert_eq!(validate(&req(cmd::TRIM, 0, 0, 1), &ro), Err(NbdError::Perm));
        assert_eq!(
            validate(&req(cmd::WRITE_ZEROES, 0, 0, 1), &ro),
            Err(NbdError::Perm)
        );
        assert!(validate(&req(cmd::READ, 0, 0, 1), &ro).is_ok());
    }

    #[test]
    fn fast_zero_is_refused_where_it_was_not_advertised() {
        let slow = Limits {
            fast_zero: false,
            ..LIMITS
        };
        let fast_zero = req(cmd::WRITE_ZEROES, cmd_flags::FAST_ZERO, 0, 4096);
        assert!(validate(&fast_zero, &LIMITS).is_ok());
        assert_eq!(validate(&fast_zero, &slow), Err(NbdError::Inval));
        assert!(validate(&req(cmd::WRITE_ZEROES, 0, 0, 4096), &slow).is_ok());
    }

    #[test]
    fn the_payload_flag_is_for_extended_writes_only() {
        let ext = Limits {
            style: RequestStyle::Extended,
            ..LIMITS
        };
        assert!(validate(&req(cmd::WRITE, 0, 0, 1), &ext).is_ok());
        assert!(validate(&req(cmd::WRITE, cmd_flags::PAYLOAD_LEN, 0, 1), &ext).is_ok());
        assert_eq!(
            validate(&req(cmd::WRITE, cmd_flags::PAYLOAD_LEN, 0, 1), &LIMITS),
            Err(NbdError::Inval)
        );
        assert_eq!(
            validate(&req(cmd::TRIM, cmd_flags::PAYLOAD_LEN, 0, 1), &ext),
            Err(NbdError::Inval)
        );
    }
}
