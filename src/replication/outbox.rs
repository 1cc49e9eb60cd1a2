//! The sending side of a peer connection: frames in order, written by whoever sends first.
//!
//! A sender that finds the socket idle writes its frame itself, without blocking
//! (`try_write`). Only what the socket does not take at once, and what other senders queue
//! meanwhile, is left to the connection's writer task. Measured reason: handing every frame
//! to a writer task cost a wake-up of another worker thread per frame, on both nodes (the
//! replicated write, then its ack), and on this VM a wake-up of an idle vCPU costs tens of
//! microseconds, more than the rest of the protocol's work for a 4 KiB write.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::{Buf, Bytes, BytesMut};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::Notify;

use super::wire::Message;

/// Frames queued for one peer connection.
pub struct Outbox {
    state: Mutex<OutboxState>,
    /// Wakes the writer task to send what is queued.
    writer_wanted: Notify,
}

struct OutboxState {
    /// The socket; `None` before it is attached (unit tests) and after [`Outbox::close`].
    socket: Option<Arc<OwnedWriteHalf>>,
    closed: bool,
    /// Encoded frames not yet handed to the socket, in order: `chunks`, then `tail`.
    queued: Frames,
    /// Who is writing to the socket now; everybody else only queues.
    turn: Turn,
}

/// Who is writing to the socket: at most one at a time, so frames never interleave.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Turn {
    Nobody,
    /// A sender, writing what the socket takes at once.
    Sender,
    /// The writer task, handed the turn with a wake-up.
    WriterTask,
}

impl Default for Outbox {
    fn default() -> Outbox {
        Outbox {
            state: Mutex::new(OutboxState {
                socket: None,
                closed: false,
                queued: Frames::default(),
                turn: Turn::Nobody,
            }),
            writer_wanted: Notify::new(),
        }
    }
}

impl Outbox {
    fn state(&self) -> MutexGuard<'_, OutboxState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Attaches the socket; frames queued before go out with the writer task.
    pub fn attach(&self, socket: OwnedWriteHalf) {
        let mut state = self.state();
        if state.closed {
            return;
        }
        state.socket = Some(Arc::new(socket));
        if !state.queued.is_empty() {
            state.turn = Turn::WriterTask;
            drop(state);
            self.writer_wanted.notify_one();
        }
    }

    /// Queues a frame and, if nobody is writing, writes what the socket takes at once.
    /// An error means the connection is broken.
    pub fn send(&self, message: &Message) -> io::Result<()> {
        let (socket, mut frames) = {
            let mut state = self.state();
            if state.closed {
                return Ok(());
            }
            state.queued.push(message);
            match &state.socket {
                Some(socket) if state.turn == Turn::Nobody => {
                    let socket = Arc::clone(socket);
                    state.turn = Turn::Sender;
                    (socket, std::mem::take(&mut state.queued))
                }
                // Queued behind whoever is writing (or until the socket is attached).
                _ => return Ok(()),
            }
        };
        let written = write_without_blocking(&socket, &mut frames);
        let mut state = self.state();
        if frames.is_empty() && state.queued.is_empty() {
            state.turn = Turn::Nobody;
        } else {
            // The rest goes first, then what others queued meanwhile; the writer task
            // now has the turn.
            let later = std::mem::take(&mut state.queued);
            frames.append(later);
            state.queued = frames;
            state.turn = Turn::WriterTask;
            drop(state);
            self.writer_wanted.notify_one();
        }
        written
    }

    /// The writer task's loop: sends what senders left queued, waiting for the socket to
    /// take it, until the outbox closes (even while the socket is full) or the socket
    /// fails.
    pub async fn run_writer(&self) -> io::Result<()> {
        loop {
            self.writer_wanted.notified().await;
            loop {
                let (socket, mut frames) = {
                    let mut state = self.state();
                    let Some(socket) = state.socket.clone() else {
                        return Ok(());
                    };
                    // A wake-up left over from an earlier hand-over: not this task's turn.
                    if state.turn != Turn::WriterTask {
                        break;
                    }
                    if state.queued.is_empty() {
                        state.turn = Turn::Nobody;
                        break;
                    }
                    (socket, std::mem::take(&mut state.queued))
                };
                while !frames.is_empty() {
                    // A peer that stopped reading must not hold this task (and the redial
                    // that waits for it) past a close.
                    tokio::select! {
                        ready = socket.writable() => ready?,
                        () = self.writer_wanted.notified() => {
                            if self.state().closed {
                                return Ok(());
                            }
                            continue;
                        }
                    }
                    write_without_blocking(&socket, &mut frames)?;
                }
            }
        }
    }

    /// Drops queued frames and the socket (which shuts down its sending side once the
    /// last writer lets go of it); later frames are discarded.
    pub fn close(&self) {
        let mut state = self.state();
        state.closed = true;
        state.socket = None;
        state.queued = Frames::default();
        drop(state);
        // Lets a writer task waiting for work see the close.
        self.writer_wanted.notify_one();
    }

    /// The frames queued and not yet written (for tests without a socket).
    #[cfg(test)]
    pub fn take_queued(&self) -> BytesMut {
        let mut frames = std::mem::take(&mut self.state().queued);
        let mut all = BytesMut::new();
        frames.seal();
        for chunk in frames.chunks {
            all.extend_from_slice(&chunk);
        }
        all
    }
}

/// Encoded frames in order: small frames are copied together into `tail`; a large payload
/// stays in its own buffer as a chunk of its own, so it goes to the socket without a copy.
#[derive(Default)]
struct Frames {
    chunks: VecDeque<Bytes>,
    tail: BytesMut,
}

/// The most buffers handed to one vectored write.
const MAX_IOVECS: usize = 64;

impl Frames {
    fn push(&mut self, message: &super::wire::Message) {
        if let Some(payload) = message.encode_head(&mut self.tail) {
            self.seal();
            self.chunks.push_back(payload);
        }
    }

    /// Moves the bytes gathered in `tail` to the end of `chunks`.
    fn seal(&mut self) {
        if !self.tail.is_empty() {
            self.chunks.push_back(self.tail.split().freeze());
        }
    }

    fn is_empty(&self) -> bool {
        self.chunks.is_empty() && self.tail.is_empty()
    }

    /// Appends `later` after these frames.
    fn append(&mut self, mut later: Frames) {
        self.seal();
        later.seal();
        self.chunks.extend(later.chunks);
    }

    /// Drops the first `n` bytes.
    fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if n < front.len() {
                front.advance(n);
                return;
            }
            n -= front.len();
            self.chunks.pop_front();
        }
    }
}

/// Writes as much of `frames` as the socket takes without blocking, and drops it from
/// `frames`. `WouldBlock` is not an error: the rest stays in `frames`.
fn write_without_blocking(socket: &OwnedWriteHalf, frames: &mut Frames) -> io::Result<()> {
    frames.seal();
    while !frames.chunks.is_empty() {
        let mut slices = [IoSlice::new(&[]); MAX_IOVECS];
        let mut count = 0;
        for (slice, chunk) in slices.iter_mut().zip(&frames.chunks) {
            *slice = IoSlice::new(chunk);
            count += 1;
        }
        match socket.try_write_vectored(&slices[..count]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => frames.advance(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use tokio::io::AsyncReadExt;
    use tokio::net::{TcpListener, TcpStream};

    fn write(seq: u64, len: usize) -> Message {
        Message::Write {
            seq,
            offset: seq * 4096,
            flags: 0,
            data: Bytes::from(vec![seq as u8; len]),
        }
    }

    /// Many tasks send at once through a socket whose buffers fill (the receiver starts
    /// late): every frame arrives, whole, and each task's frames in the order it sent
    /// them, whether it wrote them itself or the writer task did.
    #[test]
    fn concurrent_senders_frames_arrive_whole_and_in_order() {
        let runtime = crate::test_runtime();
        runtime.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let client = TcpStream::connect(listener.local_addr().unwrap())
                .await
                .unwrap();
            let (mut server, _) = listener.accept().await.unwrap();
            let (_read, write_half) = client.into_split();
            let outbox = Arc::new(Outbox::default());
            // Frames queued before the socket is attached go first.
            outbox.send(&write(1_000_000, 16)).unwrap();
            outbox.attach(write_half);
            let writer = tokio::spawn({
                let outbox = Arc::clone(&outbox);
                async move { outbox.run_writer().await }
            });
            const TASKS: u64 = 8;
            const EACH: u64 = 200;
            let mut senders = Vec::new();
            for task in 0..TASKS {
                let outbox = Arc::clone(&outbox);
                senders.push(tokio::spawn(async move {
                    for i in 0..EACH {
                        // Sizes from a few bytes to 64 KiB, so some writes are partial.
                        let len = ((i * 7919 + task * 104_729) % 65_536) as usize;
                        outbox.send(&write(task * EACH + i, len)).unwrap();
                        if i % 16 == 0 {
                            tokio::task::yield_now().await;
                        }
                    }
                }));
            }
            // Let the socket buffers fill before reading anything.
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            let mut received = BytesMut::new();
            let mut next = vec![0u64; TASKS as usize];
            let mut first = true;
            let mut count = 0;
            while count < TASKS * EACH {
                server.read_buf(&mut received).await.unwrap();
                while let Some(message) = Message::decode(&mut received).unwrap() {
                    let Message::Write { seq, data, .. } = message else {
                        panic!("only writes were sent");
                    };
                    if first {
                        assert_eq!(seq, 1_000_000, "the frame queued before attach");
                        first = false;
                        continue;
                    }
                    let task = seq / EACH;
                    assert_eq!(seq % EACH, next[task as usize], "task {task} out of order");
                    next[task as usize] += 1;
                    assert!(data.iter().all(|&b| b == seq as u8));
                    count += 1;
                }
            }
            for sender in senders {
                sender.await.unwrap();
            }
            outbox.close();
            writer.await.unwrap().unwrap();
            // The socket's sending side shut down: the reader sees the end.
            assert_eq!(server.read_buf(&mut received).await.unwrap(), 0);
        });
    }

    /// A peer that stops reading must not keep the writer task (and so the redial)
    /// waiting for the socket: closing the outbox ends the writer at once.
    #[test]
    fn closing_ends_a_writer_stuck_on_a_full_socket() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let client = TcpStream::connect(listener.local_addr().unwrap())
                .await
                .unwrap();
            // Accepted and never read from.
            let (_server, _) = listener.accept().await.unwrap();
            let (_read, write_half) = client.into_split();
            let outbox = Arc::new(Outbox::default());
            outbox.attach(write_half);
            let writer = tokio::spawn({
                let outbox = Arc::clone(&outbox);
                async move { outbox.run_writer().await }
            });
            // Far more than both socket buffers hold.
            for seq in 0..256 {
                outbox.send(&write(seq, 1 << 20)).unwrap();
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            assert!(!writer.is_finished(), "the writer waits for the socket");
            outbox.close();
            let ended = tokio::time::timeout(std::time::Duration::from_secs(2), writer).await;
            assert!(ended.is_ok(), "the writer ended when the outbox closed");
        });
    }

    #[test]
    fn frames_sent_after_close_are_dropped() {
        let outbox = Outbox::default();
        outbox.send(&write(1, 8)).unwrap();
        outbox.close();
        outbox.send(&write(2, 8)).unwrap();
        assert!(outbox.take_queued().is_empty());
    }
}
