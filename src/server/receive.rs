//! Receiving request bytes from a client's socket straight into the read buffer's spare
//! room, without the reactor: the coalescer's gather and the idle spin both read this way.

use std::os::fd::BorrowedFd;

use bytes::BytesMut;
use rustix::io::Errno;
use rustix::net::RecvFlags;

/// Bytes one receive takes at most, in the coalescer's gather and in the idle spin: a
/// bound on how far the read buffer grows ahead of the requests parsed from it.
pub(super) const RECEIVE_MOST: usize = 64 * 1024;

/// What one receive without blocking found.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Received {
    /// This many bytes were appended to the read buffer.
    Bytes(usize),
    /// Nothing was waiting (or a signal interrupted the call).
    Nothing,
    /// The client closed its side.
    Closed,
}

/// Appends at most `most` bytes of what waits on `fd` to `inbuf`, without blocking.
///
/// The bytes go straight into `inbuf`'s spare room: through a scratch buffer they were
/// copied once more, and a large write's payload received here is copied again into the
/// export after that. `perf` of fio 64 KiB sequential writes at iodepth 8 to the memory
/// export: 4% of the server's samples were that extra `memmove`.
#[allow(unsafe_code)]
pub(super) fn receive_into_spare_room(
    fd: BorrowedFd<'_>,
    inbuf: &mut BytesMut,
    most: usize,
) -> std::io::Result<Received> {
    inbuf.reserve(most);
    let room = &mut inbuf.spare_capacity_mut()[..most];
    match rustix::net::recv_uninit(fd, room, RecvFlags::DONTWAIT) {
        Ok(([], _)) => Ok(Received::Closed),
        Ok((received, _)) => {
            let n = received.len();
            // SAFETY: `recv_uninit` initialized the first `n` bytes of the spare room,
            // which starts at the buffer's length, and `n` is at most the room's size,
            // which `reserve` made available.
            unsafe { inbuf.set_len(inbuf.len() + n) };
            Ok(Received::Bytes(n))
        }
        Err(Errno::AGAIN) | Err(Errno::INTR) => Ok(Received::Nothing),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    #[test]
    fn receives_behind_what_is_buffered_at_most_the_bound() {
        let (server, mut client) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut inbuf = BytesMut::new();
        inbuf.extend_from_slice(b"kept");
        let payload: Vec<u8> = (0..10_000).map(|i| (i % 251) as u8).collect();
        client.write_all(&payload).unwrap();
        let first = receive_into_spare_room(server.as_fd(), &mut inbuf, 4096).unwrap();
        assert_eq!(first, Received::Bytes(4096));
        let rest = receive_into_spare_room(server.as_fd(), &mut inbuf, 64 * 1024).unwrap();
        assert_eq!(rest, Received::Bytes(10_000 - 4096));
        assert_eq!(&inbuf[..4], b"kept", "bytes already buffered stay in front");
        assert_eq!(&inbuf[4..], &payload[..], "received in order, intact");
    }

    #[test]
    fn tells_nothing_waiting_from_a_closed_client() {
        let (server, client) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut inbuf = BytesMut::new();
        let nothing = receive_into_spare_room(server.as_fd(), &mut inbuf, 4096).unwrap();
        assert_eq!(nothing, Received::Nothing);
        drop(client);
        let closed = receive_into_spare_room(server.as_fd(), &mut inbuf, 4096).unwrap();
        assert_eq!(closed, Received::Closed);
        assert!(inbuf.is_empty());
    }

    #[test]
    fn a_failed_receive_is_an_error() {
        let not_a_socket = std::fs::File::open("/dev/null").unwrap();
        let mut inbuf = BytesMut::new();
        assert!(receive_into_spare_room(not_a_socket.as_fd(), &mut inbuf, 4096).is_err());
        assert!(inbuf.is_empty());
    }
}
