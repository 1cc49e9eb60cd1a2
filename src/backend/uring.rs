//! The io_uring engine the file backend submits its reads, writes and syncs through.
//!
//! One ring per backend, shared by every connection. Entries are submitted in batches, not
//! one by one: a connection queues what one poll round starts and enters the kernel once
//! when the round ends ([`plugged`]); an entry queued outside a round goes in at once when
//! it is alone in the ring, else a reaper task enters the kernel once for everything queued
//! after every ready task had its turn. Measured reason: entering per request kicked the
//! virtio disk once per request (15% of the server's CPU was that MMIO write) and 16
//! connections of QD1 O_DIRECT writes reached 26k/s against qemu-nbd's 76k/s, which
//! submits in batches.
//! Completions that arrive later signal an eventfd registered with the ring; a reaper task
//! on the tokio reactor drains them and hands each result to its waiter through a pooled
//! one-shot cell (`backend::answer`). (Not `IORING_REGISTER_EVENTFD_ASYNC`: it stays
//! silent for completions the kernel posts as task work in the submitting thread, such as
//! buffered writes finished by an io-wq worker, and a waiter then hangs. A unit test
//! caught it.) A page-cache ring silences the eventfd while a thread submits and collects
//! what completed inside the submission itself, so the reaper is not woken for those.
//!
//! A connection that sends one request at a time has its writes and syncs run as plain
//! system calls on its own thread instead ([`alone`]), which skips those hand-offs.
//!
//! A direct-I/O ring holds part of a burst back from a device that completes in batches,
//! so the device keeps working while the client turns the rest around (`DepthCap`). It
//! also registers the buffer pool's arena (`buffer::registered_arena`) with the kernel, and
//! reads into and writes from buffers in it as fixed buffers (`READ_FIXED`, `WRITE_FIXED`),
//! so the kernel does not pin each request's pages.
//!
//! Safety rests on ownership: every buffer and file an entry points at is moved into the
//! entry's slot before the entry is pushed, and stays there until the kernel posts its
//! completion, even if the waiting future is dropped. A semaphore keeps the number of
//! entries in flight within the completion queue, so completions are never dropped.
//!
//! Why our own small driver instead of an io_uring runtime: tokio-uring and glommio want
//! their own thread-per-core executors, while the server runs on tokio's multi-threaded
//! runtime; this module is the few hundred lines that connect the two.

#![allow(unsafe_code)]

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use io_uring::{opcode, squeue, types, IoUring};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;

use super::answer::{AnswerPool, AnswerSender};
use super::WriteData;
use crate::buffer::Buffer;

/// Submission queue entries; a full queue is submitted and reused.
const SUBMISSION_ENTRIES: u32 = 256;
/// Completion queue entries, and so the most entries in flight at once.
const COMPLETION_ENTRIES: u32 = 4096;

/// `RWF_DSYNC`: the write is durable when it completes.
pub const RWF_DSYNC: i32 = 0x2;

thread_local! {
    /// Depth of [`plugged`] calls on this thread; entries pushed while it is above zero
    /// wait in their ring for the outermost call to end.
    static PLUG_DEPTH: Cell<u32> = const { Cell::new(0) };
    /// Rings that got entries while plugged, to be submitted when the plug ends.
    static PLUGGED_RINGS: RefCell<Vec<Arc<Ring>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `work` with submissions on this thread held back; when the outermost plug ends,
/// what it queued goes to the kernel as one batch, from this thread.
///
/// The same idea as the kernel's `blk_plug`: a connection's poll loop starts every request
/// it parsed in one round inside one plug. Without it, the first entry of a burst found the
/// ring empty and went in alone at once, and the rest followed in a second
/// `io_uring_enter` from the reaper: two device kicks and two completion waves per burst.
/// Measured with fio 4 KiB O_DIRECT random writes at QD32, servers alternated, 3 s runs:
/// 41–59k IOPS without the plug, 56–65k with it; reads unchanged (56–62k against 60–66k).
///
/// The batch goes in from the plug's end, not by waking the reaper task to submit it (as
/// it did until session 21): that wake-up crossed to another worker thread and delayed
/// every batch by tens of microseconds, and sequential O_DIRECT writes at QD8 ran 15–20%
/// behind qemu-nbd, which submits from its own thread. Before the depth cap
/// (`DepthCap`), submitting from the plug's end sent random reads at QD32 into a
/// lock-step mode at 43–45k IOPS in half the runs; with the cap it no longer does. Figures
/// in ARCHITECTURE.md ("Submitting from the plug's end").
pub fn plugged<R>(work: impl FnOnce() -> R) -> R {
    struct Unplug;
    impl Drop for Unplug {
        fn drop(&mut self) {
            let depth = PLUG_DEPTH.with(|d| {
                d.set(d.get() - 1);
                d.get()
            });
            if depth == 0 {
                // One at a time, so the list keeps its room and a plug allocates nothing.
                while let Some(ring) = PLUGGED_RINGS.with(|r| r.borrow_mut().pop()) {
                    let mut state = ring.lock();
                    state.submit_and_reap();
                    ring.retry_if_refused(&state);
                }
            }
        }
    }
    PLUG_DEPTH.with(|d| d.set(d.get() + 1));
    let _unplug = Unplug;
    work()
}

thread_local! {
    /// Set inside [`alone`]: a request that finds the ring empty runs as a system call on
    /// this thread, which serves what the value says.
    static ALONE: Cell<Option<LoneThread>> = const { Cell::new(None) };
}

/// What else the thread that runs a connection's lone request serves (see [`alone`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoneThread {
    /// Other connections' tasks too: a worker of the shared runtime, or a connection
    /// thread with several connections. A call that blocks it for long holds them up.
    Shared,
    /// Only this connection: a connection thread of its own
    /// (`server::ConnectionThreads`) with no other connection on it. Nothing else waits
    /// while a call blocks it, however slow the device.
    Own,
}

/// Requests run as plain system calls by [`alone`] so far, across the process.
static INLINED: AtomicU64 = AtomicU64::new(0);

/// How many requests ran as plain system calls under [`alone`] so far.
pub fn inlined() -> u64 {
    INLINED.load(Ordering::Relaxed)
}

/// Lone system calls handed to another thread so far, across the process.
static HANDED_OFF: AtomicU64 = AtomicU64::new(0);

/// How many lone system calls were handed to another thread with `block_in_place` so far,
/// because the device had been slow (see [`Ring::run_lone`]); each allocates in tokio.
pub fn handed_off() -> u64 {
    HANDED_OFF.load(Ordering::Relaxed)
}

/// Runs `work` (which polls the one request a connection has in flight) with this thread's
/// ring writes and syncs run as plain blocking system calls on this thread whenever they
/// find the ring empty (see `Ring::run_lone` for why that may block a worker).
///
/// For a client that waits for each reply before it sends the next request (a database's
/// write and fsync at queue depth 1), a request through the ring costs hand-offs between
/// threads: the completion comes back through the submitting thread's task work, the
/// eventfd, the reaper task and the connection's waker, each a wake-up across CPUs on a
/// VM. A system call made by the connection's own thread is woken once, by the device.
/// Measured reason: ARCHITECTURE.md, "A lone write or flush as a system call".
///
/// `thread` says what else the calling thread serves. It matters only on a connection
/// thread, after a slow call: one shared with other connections sends the requests
/// through the ring again, one of its own keeps making them itself. On a worker of the
/// shared runtime, calls after a slow one go through `block_in_place` either way (see
/// `Ring::run_lone`). A connection placed on an `Own` thread while a call runs there
/// waits for that one call; the next finds the thread `Shared`.
pub fn alone<R>(thread: LoneThread, work: impl FnOnce() -> R) -> R {
    struct Reset(Option<LoneThread>);
    impl Drop for Reset {
        fn drop(&mut self) {
            ALONE.with(|a| a.set(self.0));
        }
    }
    let _reset = Reset(ALONE.with(|a| a.replace(Some(thread))));
    work()
}

/// What the kernel answered, and the buffer a read filled.
struct Completion {
    result: i32,
    buffer: Option<Buffer>,
}

/// What an entry in flight points at, kept alive until its completion.
struct Slot {
    done: AnswerSender<Completion>,
    buffer: Option<Buffer>,
    _data: Option<WriteData>,
    _file: Arc<File>,
    _permit: OwnedSemaphorePermit,
}

struct RingState {
    uring: IoUring,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
    reaper: Option<JoinHandle<()>>,
    /// Entries are queued and the reaper has been asked to submit them.
    submit_scheduled: bool,
    /// Completions handed to their waiters so far.
    handed_out: u64,
    /// Entries kept out of the kernel while it holds as many as [`DepthCap::cap`] allows;
    /// their slots are taken, so what they point at stays alive.
    held: VecDeque<squeue::Entry>,
    /// Entries ever held back (for tests and debugging).
    held_so_far: u64,
    depth: DepthCap,
    /// Completions collected by one `reap`, kept so each reap allocates nothing.
    finished: Vec<(usize, i32)>,
    /// The ring's eventfd on a page-cache ring, whose submissions silence it (see
    /// `submit_and_reap`); `None` on a direct-I/O ring, whose completions come later, from
    /// the device, so that silence would buy nothing.
    quiet_eventfd: Option<OwnedFd>,
    /// Entries other than reads were queued since the last submission (their completions
    /// mostly come later, so the submission does not silence the eventfd).
    queued_other_than_reads: bool,
    /// The kernel refused the last submission (`EAGAIN`: no memory for it), so queued
    /// entries wait in the submission queue; whoever saw it asks the reaper to try again
    /// ([`Ring::retry_if_refused`]), or a lone request would wait for ever.
    unsubmitted: bool,
    /// Submissions a test makes the kernel refuse, as if it said `EAGAIN`.
    #[cfg(test)]
    refuse_submits: usize,
    /// Entries a test makes the ring fail to queue, as if the queue were full and the
    /// kernel refused it.
    #[cfg(test)]
    refuse_pushes: usize,
}

/// Keeps a device that completes its requests in batches working on one part of a burst
/// while the client turns the other part around.
///
/// This VM's virtio disk answers everything it holds at once, after a time that grows with
/// how much it holds. A client with 32 requests in flight then sends them as one burst, the
/// disk answers the burst together, and it sits empty while the replies travel and the
/// client sends the next burst. Holding a quarter of the burst back and handing it to the
/// disk the moment the rest completes keeps the disk busy through the turnaround. Measured
/// with fio 4 KiB at QD32 (scratch build, a fixed limit, one run each): random writes
/// 40.5k IOPS without a limit, 60.0k at 20 and 60.4k at 24 entries in the kernel, 51.8k at
/// 28 (local fio 83k, qemu-nbd 44k); random reads 62.6k against 74.8k at 24. As committed,
/// against the binary before (`bench/ab.py`, 3 rounds, the disk in a slower mode): random
/// writes 19.7k → 26.7k, reads 63.0k → 71.2k; QD1, QD256, four connections, write+fsync
/// and 1 MiB rows within noise. A larger held share was measured later (RESULTS, session
/// 30, 5 rounds each): with `nbd-load` at QD32, 5/8 in the kernel read 82.5k against 74.2k
/// at 3/4, but with fio, the bench's client, reads were 66.9k against 68.0k and writes 75.3k
/// against 71.7k, within noise, so the share stays.
///
/// A device that completes requests independently (NVMe) gains nothing from this and would
/// lose queue depth, so the limit applies only while the completions handed out per reap
/// are, on average, most of what the kernel held (an exponential average over reaps that
/// found at least [`DepthCap::MIN_DEPTH`] entries in the kernel). The limit is three
/// quarters of the most entries outstanding (in the kernel or held) in the last
/// [`DepthCap::WINDOW`] submissions. Only direct-I/O rings use it: reads and writes of the
/// page cache complete as they are submitted. `NETBLK_LOG=debug` shows when it switches.
///
/// A device faster than the reaper's wake-up also hands out most of what it holds per
/// reap: a loop device on tmpfs (local fio 338k IOPS at QD32) averaged shares of 0.45–0.55
/// and was capped part of the time, at no measurable cost (4 KiB QD32 through netblk,
/// two runs each, with and without the cap: reads 111k and 90k against 95k and 102k,
/// writes 97k and 100k against 99k and 97k; the client is the limit there).
#[derive(Debug, Clone)]
struct DepthCap {
    enabled: bool,
    /// Average share of the kernel's entries that one reap hands out, in 1/1024ths.
    batch_share: u32,
    /// Most entries outstanding in the previous window and in the current one.
    peak: usize,
    window_peak: usize,
    window_submissions: u32,
    /// The average last said the device completes in batches (logged when it changes).
    batchy: bool,
    /// A limit a test fixes, in place of the one measured.
    #[cfg(test)]
    fixed: Option<usize>,
}

impl DepthCap {
    /// Reaps with fewer entries in the kernel than this say nothing about batching.
    const MIN_DEPTH: usize = 8;
    /// Submissions per window of the outstanding peak.
    const WINDOW: u32 = 1024;
    /// An average share above this (of 1024) marks a device that completes in batches.
    const BATCHY: u32 = 512;
    /// Once marked, the device stays so until the average falls below this: without the
    /// gap, this VM's disk hovered about the mark (shares of 0.49–0.52) and the cap
    /// switched on and off 100–1,000 times a second.
    const NOT_BATCHY: u32 = 256;

    fn new(enabled: bool) -> DepthCap {
        DepthCap {
            enabled,
            batch_share: 0,
            peak: 0,
            window_peak: 0,
            window_submissions: 0,
            batchy: false,
            #[cfg(test)]
            fixed: None,
        }
    }

    /// An entry was handed to the ring with `outstanding` entries in the kernel or held.
    /// (Rings that never cap keep no account: this runs for every request.)
    fn submitted(&mut self, outstanding: usize) {
        if !self.enabled {
            return;
        }
        self.window_peak = self.window_peak.max(outstanding);
        self.window_submissions += 1;
        if self.window_submissions >= Self::WINDOW {
            self.peak = self.window_peak;
            self.window_peak = 0;
            self.window_submissions = 0;
        }
    }

    /// A reap handed out `completions` while the kernel held `in_kernel` entries.
    fn reaped(&mut self, in_kernel: usize, completions: usize) {
        if !self.enabled || in_kernel < Self::MIN_DEPTH || completions == 0 {
            return;
        }
        let share = (completions.min(in_kernel) * 1024 / in_kernel) as u32;
        // Exponential average with weight 1/8 for the newest reap.
        self.batch_share = (self.batch_share * 7 + share) / 8;
        let batchy = if self.batchy {
            self.batch_share >= Self::NOT_BATCHY
        } else {
            self.batch_share > Self::BATCHY
        };
        if batchy != self.batchy {
            self.batchy = batchy;
            let share = f64::from(self.batch_share) / 1024.0;
            if batchy {
                tracing::debug!(share, "the device completes in batches: depth cap on");
            } else {
                tracing::debug!(share, "the device completes requests apart: depth cap off");
            }
        }
    }

    /// How many entries the kernel may hold now.
    fn cap(&self) -> usize {
        #[cfg(test)]
        if let Some(fixed) = self.fixed {
            return fixed;
        }
        let peak = self.peak.max(self.window_peak);
        if !self.enabled || !self.batchy || peak < Self::MIN_DEPTH {
            return usize::MAX;
        }
        peak * 3 / 4
    }
}

impl RingState {
    fn insert(&mut self, slot: Slot) -> usize {
        match self.free.pop() {
            Some(index) => {
                self.slots[index] = Some(slot);
                index
            }
            None => {
                self.slots.push(Some(slot));
                self.slots.len() - 1
            }
        }
    }

    /// Hands the queued entries to the kernel, then collects what already completed.
    fn submit_and_reap(&mut self) {
        self.submit_scheduled = false;
        let others = std::mem::take(&mut self.queued_other_than_reads);
        if self.quiet_eventfd.is_none() || others {
            self.submit();
            self.reap();
            return;
        }
        // A page-cache read mostly completes inside `io_uring_enter`, on this thread, which
        // collects it right after; its eventfd signal would only wake the reaper's thread,
        // on another CPU, to find nothing (64 KiB page-cache reads at QD8: that thread was
        // 11% of the server's samples). So the eventfd is silenced while this thread
        // submits, and what was posted meanwhile is collected once it speaks again. Not for
        // batches with writes or syncs: those run on io-wq workers and complete later, so
        // the signal below would wake the reaper for them a second time.
        self.uring.completion().disable_eventfd();
        self.submit();
        self.uring.completion().enable_eventfd();
        // The flag is cleared before the completion queue is read again.
        std::sync::atomic::fence(Ordering::SeqCst);
        self.reap();
        if let Some(eventfd) = self.quiet_eventfd.as_ref().filter(|_| self.in_kernel() > 0) {
            // The kernel reads the flag without a barrier after posting a completion, so
            // one posted on another CPU just as the flag cleared could be neither signalled
            // nor seen above: have the reaper look.
            let _ = rustix::io::write(eventfd, &1u64.to_ne_bytes());
        }
    }

    /// Enters the kernel with what is queued.
    fn submit(&mut self) {
        loop {
            match self.enter() {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc_eintr()) => continue,
                Err(e) if e.raw_os_error() == Some(libc_ebusy()) => {
                    // Completions are waiting to be collected first.
                    self.reap();
                    continue;
                }
                Err(e) => {
                    // The entries stay queued and go with the next submission, which the
                    // reaper tries soon; their waiters still get their completions then.
                    if !self.unsubmitted {
                        tracing::warn!("io_uring submit failed: {e} (trying again)");
                    }
                    self.unsubmitted = true;
                    break;
                }
            }
        }
    }

    /// Hands the submission queue to the kernel (`io_uring_enter`), noting whether it took it.
    fn enter(&mut self) -> io::Result<usize> {
        #[cfg(test)]
        if self.refuse_submits > 0 {
            self.refuse_submits -= 1;
            self.unsubmitted = true;
            return Err(io::Error::from_raw_os_error(
                rustix::io::Errno::AGAIN.raw_os_error(),
            ));
        }
        let entered = self.uring.submit();
        if entered.is_ok() {
            self.unsubmitted = false;
        }
        entered
    }

    /// Entries the kernel holds (or will, once the queued ones are submitted).
    fn in_kernel(&self) -> usize {
        self.slots.len() - self.free.len() - self.held.len()
    }

    /// Hands every posted completion to its waiter, then lets held entries in.
    fn reap(&mut self) {
        let mut finished = std::mem::take(&mut self.finished);
        for cqe in self.uring.completion() {
            finished.push((cqe.user_data() as usize, cqe.result()));
        }
        if !finished.is_empty() {
            self.depth.reaped(self.in_kernel(), finished.len());
        }
        self.handed_out += finished.len() as u64;
        for (index, result) in finished.drain(..) {
            let Some(mut slot) = self.slots.get_mut(index).and_then(Option::take) else {
                continue;
            };
            self.free.push(index);
            let buffer = slot.buffer.take();
            // The waiter may have gone away; the slot (and what it kept alive) drops here.
            slot.done.send(Completion { result, buffer });
        }
        self.finished = finished;
        self.release_held(self.depth.cap());
    }

    /// Moves held entries into the submission queue while the kernel holds fewer than
    /// `cap`, and submits them at once: the device should not wait for the reaper's turn.
    fn release_held(&mut self, cap: usize) {
        let mut released = false;
        while self.in_kernel() < cap {
            let Some(entry) = self.held.pop_front() else {
                break;
            };
            // SAFETY: as in `Ring::push`: the entry points at memory its slot owns, and the
            // slot is only emptied in `reap` after the kernel posted its completion.
            if unsafe { self.uring.submission().push(&entry) }.is_err() {
                self.held.push_front(entry);
                break;
            }
            released = true;
        }
        if !released {
            return;
        }
        // Submitted now, or by the next `submit` if this one fails (which the reaper tries
        // soon: `unsubmitted`).
        while let Err(e) = self.enter() {
            if e.raw_os_error() != Some(libc_eintr()) {
                self.unsubmitted = true;
                break;
            }
        }
    }
}

/// An io_uring instance shared by the tasks of one runtime.
pub struct Ring {
    state: Mutex<RingState>,
    /// Where completions wait for their requests.
    answers: AnswerPool<Completion>,
    eventfd: OwnedFd,
    in_flight: Arc<Semaphore>,
    /// Wakes the reaper to submit queued entries.
    submit_wanted: Notify,
    /// Until when (nanoseconds since `born`) lone system calls go through
    /// `block_in_place` because one of them was slow; see [`Ring::run_lone`].
    hand_off_until: AtomicU64,
    born: Instant,
    /// Whether the buffer pool's arena is registered as fixed buffer 0.
    fixed_buffers: bool,
    /// Entries submitted as fixed-buffer reads or writes.
    #[cfg(test)]
    fixed_entries: AtomicU64,
    /// Requests that ask the kernel for durability: syncs, and writes with `RWF_DSYNC`
    /// (so tests can tell a backend that syncs from one that only says it did).
    #[cfg(test)]
    pub(crate) durable_requests: AtomicU64,
}

/// The registered buffer index of the pool's arena.
const ARENA_BUFFER_INDEX: u16 = 0;

/// A lone system call that takes longer than this marks the device as slow.
const SLOW_LONE_CALL: Duration = Duration::from_millis(2);
/// How long lone system calls keep handing the worker off after a slow one.
const SLOW_DEVICE_HOLD: Duration = Duration::from_secs(1);

/// One operation to submit.
enum Request {
    Read {
        offset: u64,
        buffer: Buffer,
    },
    Write {
        offset: u64,
        data: WriteData,
        flags: i32,
    },
    /// `fsync`/`fdatasync` of `[offset, offset + len]` (the kernel's `vfs_fsync_range`,
    /// whose end is inclusive); `offset` and `len` both 0 sync all of the file.
    Fsync {
        datasync: bool,
        offset: u64,
        len: u32,
    },
    /// `sync_file_range(SYNC_FILE_RANGE_WRITE)`: the range's dirty pages are queued for
    /// writing; completes without waiting for the writes.
    StartWriteback {
        offset: u64,
        len: u32,
    },
}

impl Ring {
    /// Sets up a ring. Completions are reaped by a task spawned on the runtime of the first
    /// submission, or the one its thread names with [`set_reaper_runtime`] (and again if
    /// that runtime has gone).
    pub fn new() -> io::Result<Arc<Ring>> {
        Ring::build(false)
    }

    /// A ring for direct I/O: the same, and it holds entries back from a device that
    /// completes in batches (`DepthCap`) and reads and writes the buffer pool's arena as
    /// fixed buffers (if the kernel lets it register them: an unprivileged process's
    /// locked-memory limit may be smaller than the arena).
    pub fn for_direct_io() -> io::Result<Arc<Ring>> {
        Ring::build(true)
    }

    fn build(direct: bool) -> io::Result<Arc<Ring>> {
        let uring = IoUring::builder()
            .setup_cqsize(COMPLETION_ENTRIES)
            .build(SUBMISSION_ENTRIES)?;
        if !uring.params().is_feature_nodrop() {
            return Err(io::Error::other(
                "this kernel's io_uring may drop completions",
            ));
        }
        let eventfd = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )?;
        uring.submitter().register_eventfd(eventfd.as_raw_fd())?;
        let fixed_buffers = direct && {
            let arena = crate::buffer::registered_arena();
            let region = libc::iovec {
                iov_base: arena.start as *mut libc::c_void,
                iov_len: arena.len,
            };
            // SAFETY: the arena is never freed (the buffer pool leaks it on purpose), so the
            // memory stays valid for as long as the ring keeps it registered. The kernel
            // touches it only for an entry that names the arena's index, and an entry does
            // so only for a buffer it owns in its slot until its completion, as for every
            // other entry's buffer (see the module's safety note).
            match unsafe { uring.submitter().register_buffers(&[region]) } {
                Ok(()) => true,
                Err(e) => {
                    tracing::info!(
                        "direct I/O without fixed buffers: registering {} MiB failed: {e} \
                         (the locked-memory limit, RLIMIT_MEMLOCK, may be too small)",
                        arena.len >> 20
                    );
                    false
                }
            }
        };
        Ok(Arc::new(Ring {
            state: Mutex::new(RingState {
                uring,
                slots: Vec::new(),
                free: Vec::new(),
                reaper: None,
                submit_scheduled: false,
                handed_out: 0,
                held: VecDeque::new(),
                held_so_far: 0,
                depth: DepthCap::new(direct),
                finished: Vec::new(),
                quiet_eventfd: if direct {
                    None
                } else {
                    Some(eventfd.try_clone()?)
                },
                queued_other_than_reads: false,
                unsubmitted: false,
                #[cfg(test)]
                refuse_submits: 0,
                #[cfg(test)]
                refuse_pushes: 0,
            }),
            answers: AnswerPool::default(),
            submit_wanted: Notify::new(),
            hand_off_until: AtomicU64::new(0),
            born: Instant::now(),
            fixed_buffers,
            #[cfg(test)]
            fixed_entries: AtomicU64::new(0),
            #[cfg(test)]
            durable_requests: AtomicU64::new(0),
            eventfd,
            in_flight: Arc::new(Semaphore::new(COMPLETION_ENTRIES as usize)),
        }))
    }

    /// Reads into `buffer` (all of it) at `offset`; returns the bytes read and the buffer
    /// (an empty one after an error that kept the read from the kernel).
    pub async fn read(
        self: &Arc<Self>,
        file: &Arc<File>,
        offset: u64,
        buffer: Buffer,
    ) -> (io::Result<usize>, Buffer) {
        let (result, buffer) = self.submit(file, Request::Read { offset, buffer }).await;
        match buffer {
            Some(buffer) => (result, buffer),
            // The entry never reached the kernel (or the ring went away) and its buffer
            // went with its slot: the error stands, with an empty buffer in its place.
            None => (
                result.and(Err(io::Error::other("the read was not submitted"))),
                Buffer::take(0),
            ),
        }
    }

    /// Writes `data` at `offset` with `RWF_*` flags; returns the bytes written.
    pub async fn write(
        self: &Arc<Self>,
        file: &Arc<File>,
        offset: u64,
        data: impl Into<WriteData>,
        flags: i32,
    ) -> io::Result<usize> {
        #[cfg(test)]
        if flags & RWF_DSYNC != 0 {
            self.durable_requests.fetch_add(1, Ordering::Relaxed);
        }
        self.submit(
            file,
            Request::Write {
                offset,
                data: data.into(),
                flags,
            },
        )
        .await
        .0
    }

    /// fsync, or fdatasync with `datasync`.
    pub async fn fsync(self: &Arc<Self>, file: &Arc<File>, datasync: bool) -> io::Result<()> {
        self.sync_range(file, datasync, 0, 0).await
    }

    /// fdatasync of `[offset, offset + len)` only, as a write with `RWF_DSYNC` syncs its
    /// own range (the same `vfs_fsync_range`, which also reports a failed writeback of the
    /// file's other pages). Always through the ring: no system call syncs a range. A
    /// length of 0 (a zero-length FUA write) syncs the one byte at `offset`.
    pub async fn fdatasync_range(
        self: &Arc<Self>,
        file: &Arc<File>,
        offset: u64,
        len: u32,
    ) -> io::Result<()> {
        self.sync_range(file, true, offset, len).await
    }

    /// A sync entry ([`Request::Fsync`]), counted among the durable requests.
    async fn sync_range(
        self: &Arc<Self>,
        file: &Arc<File>,
        datasync: bool,
        offset: u64,
        len: u32,
    ) -> io::Result<()> {
        #[cfg(test)]
        self.durable_requests.fetch_add(1, Ordering::Relaxed);
        let request = Request::Fsync {
            datasync,
            offset,
            len,
        };
        self.submit(file, request).await.0.map(|_| ())
    }

    /// Starts writeback of the dirty pages in `[offset, offset + len)` (`len` 0: to the end
    /// of the file) without waiting for it to finish.
    pub async fn start_writeback(
        self: &Arc<Self>,
        file: &Arc<File>,
        offset: u64,
        len: u32,
    ) -> io::Result<()> {
        self.submit(file, Request::StartWriteback { offset, len })
            .await
            .0
            .map(|_| ())
    }

    async fn submit(
        self: &Arc<Self>,
        file: &Arc<File>,
        request: Request,
    ) -> (io::Result<usize>, Option<Buffer>) {
        let request = match self.try_inline(file, request) {
            Ok(done) => return done,
            Err(request) => request,
        };
        let permit = match Arc::clone(&self.in_flight).acquire_owned().await {
            Ok(permit) => permit,
            Err(_) => {
                return (
                    Err(not_submitted(io::Error::other("the ring is closed"))),
                    None,
                )
            }
        };
        let (done, answer) = self.answers.channel();
        let fd = types::Fd(file.as_raw_fd());
        let is_read = matches!(request, Request::Read { .. });
        let (entry, buffer, data) = match request {
            Request::Read { offset, mut buffer } => {
                let target = buffer.as_mut();
                let fixed = self.is_fixed_buffer(target);
                let (start, len) = (target.as_mut_ptr(), target.len() as u32);
                let entry = if fixed {
                    opcode::ReadFixed::new(fd, start, len, ARENA_BUFFER_INDEX)
                        .offset(offset)
                        .build()
                } else {
                    opcode::Read::new(fd, start, len).offset(offset).build()
                };
                (entry, Some(buffer), None)
            }
            Request::Write {
                offset,
                data,
                flags,
            } => {
                let (start, len) = (data.as_ptr(), data.len() as u32);
                let entry = if self.is_fixed_buffer(&data) {
                    opcode::WriteFixed::new(fd, start, len, ARENA_BUFFER_INDEX)
                        .offset(offset)
                        .rw_flags(flags)
                        .build()
                } else {
                    opcode::Write::new(fd, start, len)
                        .offset(offset)
                        .rw_flags(flags)
                        .build()
                };
                (entry, None, Some(data))
            }
            Request::Fsync {
                datasync,
                offset,
                len,
            } => {
                let flags = if datasync {
                    types::FsyncFlags::DATASYNC
                } else {
                    types::FsyncFlags::empty()
                };
                let entry = opcode::Fsync::new(fd)
                    .flags(flags)
                    .offset(offset)
                    .len(len)
                    .build();
                (entry, None, None)
            }
            Request::StartWriteback { offset, len } => {
                const SYNC_FILE_RANGE_WRITE: u32 = 2;
                let entry = opcode::SyncFileRange::new(fd, len)
                    .offset(offset)
                    .flags(SYNC_FILE_RANGE_WRITE)
                    .build();
                (entry, None, None)
            }
        };
        let slot = Slot {
            done,
            buffer,
            _data: data,
            _file: Arc::clone(file),
            _permit: permit,
        };
        if let Err(e) = self.push(slot, entry, is_read) {
            return (Err(not_submitted(e)), None);
        }
        match answer.await {
            Ok(Completion { result, buffer }) if result < 0 => {
                (Err(io::Error::from_raw_os_error(-result)), buffer)
            }
            Ok(Completion { result, buffer }) => (Ok(result as usize), buffer),
            Err(_) => (Err(io::Error::other("the ring went away")), None),
        }
    }

    /// Whether an entry for `bytes` goes as a fixed-buffer read or write: the ring has the
    /// arena registered and the bytes lie in it (a pooled buffer, or a large payload the
    /// pipeline gathered into one and passed on as `Bytes`).
    fn is_fixed_buffer(&self, bytes: &[u8]) -> bool {
        let fixed = self.fixed_buffers && crate::buffer::in_arena(bytes.as_ptr(), bytes.len());
        #[cfg(test)]
        if fixed {
            self.fixed_entries.fetch_add(1, Ordering::Relaxed);
        }
        fixed
    }

    /// Runs `request` as a plain system call on this thread ([`Ring::run_lone`]) when the
    /// caller runs inside [`alone`] and nothing else is in the ring; gives the request back
    /// otherwise.
    fn try_inline(
        &self,
        file: &Arc<File>,
        request: Request,
    ) -> Result<(io::Result<usize>, Option<Buffer>), Request> {
        let Some(thread) = ALONE.with(Cell::get) else {
            return Err(request);
        };
        // Reads stay in the ring: a connection that polls the ring for a lone read's
        // completion (the pipeline's spin) answers sooner than one woken from `pread`.
        if matches!(
            request,
            Request::Read { .. } | Request::StartWriteback { .. }
        ) {
            return Err(request);
        }
        // On a worker of a multi-threaded runtime, or on a connection thread
        // (`server::ConnectionThreads`), whose other connections, if it has any, wait
        // meanwhile; the pipeline runs requests alone only with few connections. A slow
        // device's calls are handed over with `block_in_place`, which needs a
        // multi-threaded runtime. On a connection thread they go through the ring when
        // the thread has other connections, and stay on it when it has none: there the
        // ring's hand-offs (io-wq, the eventfd, the reaper on another thread, the
        // connection's waker) would only slow the one client that waits (page-cache write
        // + FLUSH at QD1 on this VM's disk, whose syncs often take over 2 ms: 1,681
        // against 1,248 pairs a second, bench/RESULTS.md, session 50).
        let Some(multi_threaded) = on_multi_threaded_runtime() else {
            return Err(request);
        };
        if !multi_threaded && thread == LoneThread::Shared && self.hands_off_at(Instant::now()) {
            return Err(request);
        }
        {
            let state = self.lock();
            if state.slots.len() != state.free.len() || state.submit_scheduled {
                return Err(request);
            }
        }
        let file = file.as_fd();
        let done = match request {
            Request::Write {
                offset,
                data,
                flags,
            } => self.run_lone(|| {
                let flags = rustix::io::ReadWriteFlags::from_bits_retain(flags as u32);
                let written = retry_interrupted(|| {
                    rustix::io::pwritev2(file, &[io::IoSlice::new(&data)], offset, flags)
                });
                (written, None)
            }),
            Request::Fsync {
                datasync,
                offset: 0,
                len: 0,
            } => self.run_lone(|| {
                let synced = retry_interrupted(|| {
                    if datasync {
                        rustix::fs::fdatasync(file)
                    } else {
                        rustix::fs::fsync(file)
                    }
                });
                (synced.map(|()| 0), None)
            }),
            other => return Err(other),
        };
        INLINED.fetch_add(1, Ordering::Relaxed);
        Ok(done)
    }

    /// Runs one lone system call on this worker thread.
    ///
    /// Normally straight on the worker: a connection in [`alone`] has one request in flight
    /// and the pipeline only calls it with at most half the workers busy with connections,
    /// so tasks queued on this worker are stolen by idle ones meanwhile. Handing the worker
    /// over with `block_in_place` instead costs two cross-thread wake-ups per request
    /// (the worker's run queue moves to a pool thread, and the connection's next wake-up
    /// goes there; measured in ARCHITECTURE.md, "A lone write or flush as a system call").
    /// When a call takes longer than [`SLOW_LONE_CALL`], the device is slow enough for
    /// blocking a worker to matter, so for [`SLOW_DEVICE_HOLD`] after it calls hand the
    /// worker over.
    fn run_lone<R>(&self, call: impl FnOnce() -> R) -> R {
        let started = Instant::now();
        if on_multi_threaded_runtime() == Some(true) && self.hands_off_at(started) {
            HANDED_OFF.fetch_add(1, Ordering::Relaxed);
            return tokio::task::block_in_place(call);
        }
        let result = call();
        let finished = Instant::now();
        if finished.duration_since(started) > SLOW_LONE_CALL {
            let until = (finished + SLOW_DEVICE_HOLD).duration_since(self.born);
            self.hand_off_until
                .store(until.as_nanos() as u64, Ordering::Relaxed);
        }
        result
    }

    /// Whether lone system calls hand the worker over at `at` (within a second of a slow one).
    fn hands_off_at(&self, at: Instant) -> bool {
        let since_born = at.duration_since(self.born).as_nanos() as u64;
        since_born < self.hand_off_until.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    fn hands_off(&self) -> bool {
        self.hands_off_at(Instant::now())
    }

    /// Hands out the completions already posted, without entering the kernel or waiting;
    /// returns how many completions were handed out so far (by this call, the reaper or a
    /// submitter).
    pub fn reap_posted(&self) -> u64 {
        let mut state = self.lock();
        if !state.uring.completion().is_empty() {
            state.reap();
        }
        state.handed_out
    }

    /// Completions handed out so far, without reaping any.
    #[cfg(test)]
    pub(crate) fn handed_out(&self) -> u64 {
        self.lock().handed_out
    }

    /// Makes the next `entries` fail to queue, as if the kernel refused a full queue.
    #[cfg(test)]
    pub(crate) fn refuse_next_pushes(&self, entries: usize) {
        self.lock().refuse_pushes = entries;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RingState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(self: &Arc<Self>, slot: Slot, entry: squeue::Entry, is_read: bool) -> io::Result<()> {
        let mut state = self.lock();
        #[cfg(test)]
        if state.refuse_pushes > 0 {
            state.refuse_pushes -= 1;
            return Err(io::Error::from_raw_os_error(
                rustix::io::Errno::AGAIN.raw_os_error(),
            ));
        }
        state.queued_other_than_reads |= !is_read;
        self.ensure_reaper(&mut state)?;
        let index = state.insert(slot);
        let entry = entry.user_data(index as u64);
        let outstanding = state.slots.len() - state.free.len();
        state.depth.submitted(outstanding);
        if state.in_kernel() > state.depth.cap() {
            // Let in by `reap` as the kernel's entries complete.
            state.held.push_back(entry);
            state.held_so_far += 1;
            return Ok(());
        }
        loop {
            // SAFETY: the entry points at memory owned by slot `index` (a pooled buffer,
            // shared or not, or a `Bytes`: heap storage that does not move when the slot
            // moves) and at a file the slot holds open. The slot is only emptied in `reap`,
            // after the kernel posted this entry's completion, so everything stays valid
            // while the kernel may touch it. `in_flight` permits keep entries within the
            // completion queue.
            let pushed = unsafe { state.uring.submission().push(&entry) };
            if pushed.is_ok() {
                break;
            }
            // The submission queue is full: hand it to the kernel and try again.
            if let Err(e) = state.uring.submit() {
                state.slots[index] = None;
                state.free.push(index);
                return Err(e);
            }
        }
        if state.submit_scheduled {
            // The reaper or a plug on some thread submits it with the entries before it.
            return Ok(());
        }
        state.submit_scheduled = true;
        // Inside a plug, the entry waits for the plug's end and goes with its batch.
        if PLUG_DEPTH.with(Cell::get) > 0 {
            drop(state);
            PLUGGED_RINGS.with(|r| r.borrow_mut().push(Arc::clone(self)));
            return Ok(());
        }
        self.submit_now_or_later(&mut state);
        Ok(())
    }

    /// Hands the queued entries (`submit_scheduled` is set) of a push outside any plug to the
    /// kernel now when they are all that is in flight and just one; otherwise asks the
    /// reaper to. (A plug's batch goes in from the plug's end: [`plugged`].)
    ///
    /// An entry alone in the ring goes in at once: nothing else is in flight to batch
    /// with, and handing it to the reaper would cost a wake-up of another worker thread
    /// (tens of µs on this VM) before the device even sees it. Otherwise entering the
    /// kernel is left to the reaper task, which runs after every task that is ready now:
    /// requests from many connections then go in with one `io_uring_enter`, and the block
    /// layer kicks the device once for all of them.
    fn submit_now_or_later(&self, state: &mut RingState) {
        if state.slots.len() - state.free.len() == 1 {
            state.submit_and_reap();
            self.retry_if_refused(state);
        } else {
            self.submit_wanted.notify_one();
        }
    }

    /// Asks the reaper to submit again when the kernel refused the last submission.
    fn retry_if_refused(&self, state: &RingState) {
        if state.unsubmitted {
            self.submit_wanted.notify_one();
        }
    }

    /// Starts the reaper unless one is already running: on the runtime named by
    /// [`set_reaper_runtime`], else on the current one.
    fn ensure_reaper(self: &Arc<Self>, state: &mut RingState) -> io::Result<()> {
        if state
            .reaper
            .as_ref()
            .is_some_and(|task| !task.is_finished())
        {
            return Ok(());
        }
        let named = REAPER_RUNTIME.with(|named| named.borrow().clone());
        let handle = match named {
            Some(handle) => handle,
            None => tokio::runtime::Handle::try_current()
                .map_err(|_| io::Error::other("io_uring submissions need a tokio runtime"))?,
        };
        let eventfd = self.eventfd.try_clone()?;
        // The eventfd is watched by the reaper's runtime: registered with the caller's
        // instead (a connection thread's), its completions were noticed only when that
        // thread next waited for events, however long its connection kept it busy.
        let _reaper_runtime = handle.enter();
        // SAFETY: the `AsyncFd` owns this duplicate descriptor (an `OwnedFd`), so it stays
        // open and names the same eventfd until the `AsyncFd` is dropped.
        let eventfd = unsafe { AsyncFd::register_with_interest(eventfd, Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        let ring = Arc::downgrade(self);
        state.reaper = Some(handle.spawn(reap_forever(ring, eventfd)));
        Ok(())
    }
}

thread_local! {
    /// Where rings first used on this thread start their reapers, when set (see
    /// [`set_reaper_runtime`]).
    static REAPER_RUNTIME: RefCell<Option<tokio::runtime::Handle>> = const { RefCell::new(None) };
}

/// A request that never reached the kernel: the ring was closing, or its entry could not
/// be queued (no reaper, a submission the kernel refused while the queue was full). The
/// file was not touched, so a sync that fails this way says nothing about the data
/// written before it ([`reached_the_kernel`]).
#[derive(Debug)]
struct NotSubmitted(io::Error);

impl std::fmt::Display for NotSubmitted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (not submitted)", self.0)
    }
}

impl std::error::Error for NotSubmitted {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

fn not_submitted(e: io::Error) -> io::Error {
    io::Error::new(e.kind(), NotSubmitted(e))
}

/// Whether the request that failed with `error` reached the kernel, which then failed it;
/// `false` for one the ring never handed over ([`NotSubmitted`]).
pub fn reached_the_kernel(error: &io::Error) -> bool {
    !error
        .get_ref()
        .is_some_and(|inner| inner.is::<NotSubmitted>())
}

/// Names the runtime that rings first used on this thread start their reapers on (`None`:
/// the thread's own runtime). A server whose connections each run on a thread of their own
/// (`server::ConnectionThreads`) names its shared runtime on each of those threads, so that
/// completions are handed out by a task that no busy connection holds up, whichever thread
/// submitted them.
///
/// Per thread, not per process: a process-wide setting (until session 36) reached every
/// server in the process and every test beside them.
pub fn set_reaper_runtime(handle: Option<tokio::runtime::Handle>) {
    REAPER_RUNTIME.with(|named| *named.borrow_mut() = handle);
}

/// Whether the caller runs on a multi-threaded tokio runtime (`block_in_place` works
/// there); `None` outside any runtime.
fn on_multi_threaded_runtime() -> Option<bool> {
    let handle = tokio::runtime::Handle::try_current().ok()?;
    Some(handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// Runs a system call again while a signal interrupts it.
fn retry_interrupted<T>(mut call: impl FnMut() -> rustix::io::Result<T>) -> io::Result<T> {
    loop {
        match call() {
            Err(rustix::io::Errno::INTR) => continue,
            result => return result.map_err(io::Error::from),
        }
    }
}

fn libc_eintr() -> i32 {
    rustix::io::Errno::INTR.raw_os_error()
}

fn libc_ebusy() -> i32 {
    rustix::io::Errno::BUSY.raw_os_error()
}

/// Submits queued entries when asked, and hands out completions when the eventfd says
/// there are some, until the ring is dropped.
async fn reap_forever(ring: Weak<Ring>, eventfd: AsyncFd<OwnedFd>) {
    loop {
        let Some(strong) = ring.upgrade() else { return };
        tokio::select! {
            ready = eventfd.readable() => {
                let Ok(mut ready) = ready else { return };
                // One read takes the whole count and resets it (not a semaphore eventfd).
                let mut counter = [0u8; 8];
                let _ = rustix::io::read(eventfd.get_ref(), &mut counter);
                ready.clear_ready();
                let mut state = strong.lock();
                state.reap();
                strong.retry_if_refused(&state);
            }
            _ = strong.submit_wanted.notified() => {
                drop(strong);
                // Let every task that is ready now queue its entries first.
                tokio::task::yield_now().await;
                let Some(strong) = ring.upgrade() else { return };
                let mut state = strong.lock();
                state.submit_and_reap();
                if state.unsubmitted {
                    drop(state);
                    // Refused again: a moment for the kernel to find memory. A thread
                    // sleep, not a timer: the reaper's runtime may have none, and this
                    // is the rarest of paths.
                    std::thread::sleep(Duration::from_millis(1));
                    strong.submit_wanted.notify_one();
                }
            }
        }
    }
}

impl Drop for RingState {
    fn drop(&mut self) {
        if let Some(reaper) = self.reaper.take() {
            reaper.abort();
        }
        // Entries still in flight point at buffers in `slots`: wait for the kernel to
        // finish with them before the slots (and their memory) are freed. Held entries go
        // in too, so that every slot ends with a completion.
        self.release_held(usize::MAX);
        while self.slots.iter().any(Option::is_some) {
            match self.uring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc_eintr()) => continue,
                Err(e) if e.raw_os_error() == Some(libc_ebusy()) => {}
                Err(e) => {
                    // The kernel may still write into what the slots hold: better to
                    // leak it than to free it under the device.
                    tracing::warn!(
                        "io_uring: waiting for the entries in flight failed ({e}): their buffers are leaked"
                    );
                    std::mem::forget(std::mem::take(&mut self.slots));
                    break;
                }
            }
            self.reap();
        }
    }
}

/// Where tests make files to open with `O_DIRECT`: /var/tmp, which is on a disk where
/// /tmp may be tmpfs (no `O_DIRECT`), or the temporary directory when there is no /var/tmp.
#[cfg(test)]
pub(crate) fn scratch_dir_for_direct_io() -> std::path::PathBuf {
    let var_tmp = std::path::Path::new("/var/tmp");
    if var_tmp.is_dir() {
        var_tmp.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

/// A scratch file of `len` bytes that start with `contents`, synced to the disk, opened for
/// reading and writing with `O_DIRECT` where the file system has it (not tmpfs): on
/// /var/tmp when there is one. Direct reads of it complete from the device, later than
/// they are submitted.
#[cfg(test)]
pub(crate) fn direct_scratch_file(
    contents: &[u8],
    len: u64,
) -> (tempfile::NamedTempFile, Arc<File>) {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt;
    let mut tmp = tempfile::NamedTempFile::new_in(scratch_dir_for_direct_io()).unwrap();
    tmp.write_all(contents).unwrap();
    tmp.as_file().set_len(len).unwrap();
    tmp.as_file().sync_all().unwrap();
    let open = |flags| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(flags)
            .open(tmp.path())
    };
    let file = Arc::new(open(libc::O_DIRECT).or_else(|_| open(0)).unwrap());
    (tmp, file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use std::future::Future as _;
    use std::io::Write as _;

    /// An empty temporary file, opened for reading and writing.
    fn scratch_file() -> (tempfile::NamedTempFile, Arc<File>) {
        let tmp = tempfile::NamedTempFile::new().unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(tmp.path())
            .unwrap();
        (tmp, Arc::new(file))
    }

    /// A one-thread runtime: its reaper task runs only when the test's task yields.
    fn current_thread() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn writes_reads_and_syncs_go_through_the_ring() {
        let (mut tmp, file) = scratch_file();
        tmp.write_all(&vec![0u8; 1 << 20]).unwrap();
        let ring = Ring::new().unwrap();
        crate::test_runtime().block_on(async {
            let n = ring
                .write(&file, 4096, Bytes::from(vec![7u8; 8192]), RWF_DSYNC)
                .await
                .unwrap();
            assert_eq!(n, 8192);
            ring.fsync(&file, true).await.unwrap();
            let (n, buffer) = ring.read(&file, 0, Buffer::take(16384)).await;
            assert_eq!(n.unwrap(), 16384);
            assert!(buffer.as_ref()[..4096].iter().all(|&b| b == 0));
            assert!(buffer.as_ref()[4096..12288].iter().all(|&b| b == 7));
            // Reading at the end of the file comes back short, not as an error.
            let (n, _) = ring.read(&file, (1 << 20) - 100, Buffer::take(4096)).await;
            assert_eq!(n.unwrap(), 100);
        });
    }

    #[test]
    fn a_submission_the_kernel_refuses_is_tried_again() {
        let (mut tmp, file) = scratch_file();
        tmp.write_all(&vec![5u8; 1 << 20]).unwrap();
        let ring = Ring::new().unwrap();
        crate::test_runtime().block_on(async {
            // Three refusals (as `EAGAIN`): the entries wait in the queue until the reaper
            // gets them in.
            ring.lock().refuse_submits = 3;
            let read = ring.read(&file, 4096, Buffer::take(4096));
            let (n, buffer) = tokio::time::timeout(Duration::from_secs(5), read)
                .await
                .expect("the read is submitted again and completes");
            assert_eq!(n.unwrap(), 4096);
            assert!(buffer.as_ref().iter().all(|&b| b == 5));
            assert_eq!(ring.lock().refuse_submits, 0);
            assert!(!ring.lock().unsubmitted);
        });
    }

    #[test]
    fn a_read_the_ring_cannot_take_fails_without_a_panic() {
        let (mut tmp, file) = scratch_file();
        tmp.write_all(&vec![0u8; 1 << 20]).unwrap();
        let ring = Ring::new().unwrap();
        crate::test_runtime().block_on(async {
            ring.in_flight.close();
            let (n, buffer) = ring.read(&file, 0, Buffer::take(4096)).await;
            assert!(n.is_err());
            assert!(buffer.is_empty());
        });
    }

    /// Polls its future inside [`alone`] on a thread that serves what the second field
    /// says, as the pipeline polls a lone request.
    struct Alone<F>(std::pin::Pin<Box<F>>, LoneThread);

    impl<F: std::future::Future> std::future::Future for Alone<F> {
        type Output = F::Output;
        fn poll(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<F::Output> {
            alone(self.1, || self.0.as_mut().poll(cx))
        }
    }

    #[test]
    fn alone_writes_and_syncs_run_as_system_calls_and_reads_stay_in_the_ring() {
        use std::os::unix::fs::FileExt;
        let (mut tmp, file) = scratch_file();
        tmp.write_all(&vec![0u8; 1 << 20]).unwrap();
        let ring = Ring::new().unwrap();
        let runtime = crate::test_runtime();
        let (task_ring, task_file) = (Arc::clone(&ring), Arc::clone(&file));
        // On a worker of the multi-threaded runtime, where `block_in_place` may run.
        runtime
            .block_on(runtime.spawn(async move {
                let (ring, file) = (task_ring, task_file);
                let inlined_before = inlined();
                let n = Alone(
                    Box::pin(ring.write(&file, 8192, Bytes::from(vec![5u8; 4096]), RWF_DSYNC)),
                    LoneThread::Shared,
                )
                .await
                .unwrap();
                assert_eq!(n, 4096);
                Alone(Box::pin(ring.fsync(&file, true)), LoneThread::Shared)
                    .await
                    .unwrap();
                assert!(inlined() >= inlined_before + 2);
                assert_eq!(ring.reap_posted(), 0, "nothing went through the ring");
                let read = ring.read(&file, 8192, Buffer::take(4096));
                let (n, buffer) = Alone(Box::pin(read), LoneThread::Shared).await;
                assert_eq!(n.unwrap(), 4096);
                assert!(buffer.as_ref().iter().all(|&b| b == 5));
                assert_eq!(ring.reap_posted(), 1, "the read went through the ring");
                // Outside `alone`, writes and syncs go through the ring as before.
                ring.write(&file, 0, Bytes::from(vec![6u8; 4096]), 0)
                    .await
                    .unwrap();
                ring.fsync(&file, true).await.unwrap();
                assert_eq!(ring.reap_posted(), 3);
            }))
            .unwrap();
        let mut back = vec![0u8; 12288];
        file.read_exact_at(&mut back, 0).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 6));
        assert!(back[4096..8192].iter().all(|&b| b == 0));
        assert!(back[8192..].iter().all(|&b| b == 5));
        // On a one-thread runtime (a connection thread) a lone call runs on the thread
        // as well ...
        let ring = Ring::new().unwrap();
        let inlined_before = inlined();
        current_thread().block_on(async {
            Alone(Box::pin(ring.fsync(&file, true)), LoneThread::Shared)
                .await
                .unwrap();
        });
        assert_eq!(ring.reap_posted(), 0, "nothing went through the ring");
        assert!(inlined() > inlined_before);
        // ... until the device is slow: a slow call cannot be handed over there (no
        // `block_in_place`), so on a thread with other connections the next ones go
        // through the ring instead ...
        current_thread().block_on(async {
            ring.run_lone(|| std::thread::sleep(SLOW_LONE_CALL * 2));
            assert!(ring.hands_off());
            Alone(Box::pin(ring.fsync(&file, true)), LoneThread::Shared)
                .await
                .unwrap();
        });
        assert_eq!(ring.reap_posted(), 1, "the sync went through the ring");
        // ... while a thread that serves only this connection keeps making them itself.
        let inlined_before = inlined();
        current_thread().block_on(async {
            ring.run_lone(|| std::thread::sleep(SLOW_LONE_CALL * 2));
            assert!(ring.hands_off());
            Alone(Box::pin(ring.fsync(&file, true)), LoneThread::Own)
                .await
                .unwrap();
            let write = ring.write(&file, 0, Bytes::from(vec![8u8; 4096]), 0);
            let n = Alone(Box::pin(write), LoneThread::Own).await.unwrap();
            assert_eq!(n, 4096);
        });
        assert_eq!(ring.reap_posted(), 1, "neither went through the ring");
        assert!(inlined() >= inlined_before + 2);
        file.read_exact_at(&mut back[..4096], 0).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 8), "the write landed");
    }

    #[test]
    fn a_slow_lone_call_makes_the_next_ones_hand_the_worker_over() {
        let ring = Ring::new().unwrap();
        let task_ring = Arc::clone(&ring);
        let runtime = crate::test_runtime();
        runtime
            .block_on(runtime.spawn(async move {
                let ring = task_ring;
                assert_eq!(ring.run_lone(|| 7), 7);
                assert!(!ring.hands_off(), "a quick call blocks the worker directly");
                ring.run_lone(|| std::thread::sleep(SLOW_LONE_CALL * 2));
                assert!(ring.hands_off(), "a slow call marks the device as slow");
                // Now through `block_in_place`, which only works on a worker of a
                // multi-threaded runtime: a panic here would mean it was not used.
                let worker = std::thread::current().id();
                let ran_on = ring.run_lone(|| std::thread::current().id());
                assert_eq!(ran_on, worker, "block_in_place runs the call where it is");
                assert!(ring.hands_off());
            }))
            .unwrap();
        // On a current-thread runtime `block_in_place` would panic: a marked ring runs
        // the call where it is there (`try_inline` keeps such calls in the ring).
        let thread = std::thread::current().id();
        let ran_on =
            current_thread().block_on(async { ring.run_lone(|| std::thread::current().id()) });
        assert_eq!(ran_on, thread);
    }

    /// Writes blocks 0..count at once, block i filled with `i % 251`, each from its own task.
    async fn write_blocks_at_once(ring: &Arc<Ring>, file: &Arc<File>, count: u64) {
        let writes = (0..count).map(|i| {
            let ring = Arc::clone(ring);
            let file = Arc::clone(file);
            tokio::spawn(async move {
                let data = Bytes::from(vec![(i % 251) as u8; 4096]);
                ring.write(&file, i * 4096, data, 0).await.unwrap()
            })
        });
        for write in writes.collect::<Vec<_>>() {
            assert_eq!(write.await.unwrap(), 4096);
        }
    }

    /// Reads the blocks back and checks what [`write_blocks_at_once`] wrote there.
    async fn check_blocks(ring: &Arc<Ring>, file: &Arc<File>, blocks: &[u64]) {
        for &i in blocks {
            let (n, buffer) = ring.read(file, i * 4096, Buffer::take(4096)).await;
            assert_eq!(n.unwrap(), 4096);
            assert!(buffer.as_ref().iter().all(|&b| b == (i % 251) as u8));
        }
    }

    #[test]
    fn many_requests_in_flight_complete_and_a_dropped_waiter_loses_nothing() {
        let (_tmp, file) = scratch_file();
        let ring = Ring::new().unwrap();
        crate::test_runtime().block_on(async {
            write_blocks_at_once(&ring, &file, 2000).await;
            // A read whose waiter is dropped at once: its buffer stays with the ring
            // until the kernel is done, and later requests still complete.
            let abandoned = ring.read(&file, 0, Buffer::take(1 << 20));
            drop(abandoned);
            let mut started = Box::pin(ring.read(&file, 0, Buffer::take(1 << 20)));
            let polled_once =
                tokio::time::timeout(std::time::Duration::ZERO, started.as_mut()).await;
            drop(polled_once);
            drop(started);
            check_blocks(&ring, &file, &[0, 999, 1999]).await;
        });
    }

    #[test]
    fn the_depth_cap_holds_back_only_from_a_device_that_completes_in_batches() {
        let mut cap = DepthCap::new(true);
        for _ in 0..32 {
            cap.submitted(32);
        }
        assert_eq!(cap.cap(), usize::MAX, "no reaps seen yet");
        // A device that hands out everything it holds at each reap: a quarter held back.
        for _ in 0..16 {
            cap.reaped(32, 32);
        }
        assert_eq!(cap.cap(), 24);
        // Reaps that hand out 40% (under the mark, over the lower one) keep it capped:
        // a device about the mark does not switch the cap at every reap.
        for _ in 0..64 {
            cap.reaped(32, 13);
        }
        assert_eq!(cap.cap(), 24, "stays capped between the two marks");
        // One that trickles (a few of 32 per reap) is left its full depth.
        for _ in 0..32 {
            cap.reaped(32, 3);
        }
        assert_eq!(cap.cap(), usize::MAX);
        // Shallow reaps say nothing either way, and a page-cache ring never caps.
        let mut shallow = DepthCap::new(true);
        for _ in 0..64 {
            shallow.submitted(4);
            shallow.reaped(4, 4);
        }
        assert_eq!(shallow.cap(), usize::MAX);
        let mut cached = DepthCap::new(false);
        for _ in 0..64 {
            cached.submitted(32);
            cached.reaped(32, 32);
        }
        assert_eq!(cached.cap(), usize::MAX);
    }

    #[test]
    fn a_direct_ring_reads_and_writes_arena_buffers_as_fixed_buffers() {
        // O_DIRECT, so the kernel really maps the registered pages for the device; fixed
        // buffers serve buffered files as well.
        let (_tmp, file) = direct_scratch_file(&[], 1 << 20);
        let ring = Ring::for_direct_io().unwrap();
        assert!(
            ring.fixed_buffers,
            "registering the arena failed (run as root, or raise RLIMIT_MEMLOCK)"
        );
        crate::test_runtime().block_on(async {
            let mut data = crate::buffer::arena_buffer(8192);
            for (i, b) in data.as_mut().iter_mut().enumerate() {
                *b = (i % 253) as u8;
            }
            // As the pipeline passes a large payload it gathered into a pooled buffer.
            let data = data.share();
            let written = ring.write(&file, 4096, data.clone(), 0).await.unwrap();
            assert_eq!(written, 8192);
            let mut second = crate::buffer::arena_buffer(4096);
            second.as_mut().copy_from_slice(&data[..4096]);
            // A pooled buffer shared without `Bytes`, as aligned copies are.
            assert_eq!(
                ring.write(&file, 4096, second.share(), 0).await.unwrap(),
                4096
            );
            // Bytes outside the arena beside it take the plain path (aligned for O_DIRECT).
            let outside = vec![9u8; 8192];
            let start = outside.as_ptr().align_offset(4096);
            let plain = Bytes::from(outside).slice(start..start + 4096);
            assert_eq!(ring.write(&file, 12288, plain, 0).await.unwrap(), 4096);
            let (n, back) = ring
                .read(&file, 4096, crate::buffer::arena_buffer(12288))
                .await;
            assert_eq!(n.unwrap(), 12288);
            assert!(back.as_ref()[..8192]
                .iter()
                .enumerate()
                .all(|(i, &b)| b == (i % 253) as u8));
            assert!(back.as_ref()[8192..].iter().all(|&b| b == 9));
        });
        assert_eq!(ring.fixed_entries.load(Ordering::Relaxed), 3);
        // A page-cache ring registers nothing.
        assert!(!Ring::new().unwrap().fixed_buffers);
    }

    /// A direct-I/O ring that behaves as if its device completes in batches.
    fn batchy_ring() -> Arc<Ring> {
        let ring = Ring::for_direct_io().unwrap();
        let mut state = ring.lock();
        state.depth.batch_share = 1024;
        state.depth.batchy = true;
        drop(state);
        ring
    }

    #[test]
    fn entries_held_back_by_the_depth_cap_all_complete_in_place() {
        let (_tmp, file) = scratch_file();
        let ring = batchy_ring();
        crate::test_runtime().block_on(async {
            write_blocks_at_once(&ring, &file, 512).await;
            check_blocks(&ring, &file, &[0, 255, 511]).await;
        });
        let state = ring.lock();
        assert!(state.held_so_far > 0, "the cap held nothing back");
        assert!(state.held.is_empty());
    }

    #[test]
    fn a_ring_dropped_with_entries_held_back_waits_for_them_all() {
        // The entries' waiters are gone and the reaper never ran: dropping the ring must
        // still let every held entry into the kernel and collect it, not wait forever.
        let (_tmp, file) = scratch_file();
        let ring = Ring::for_direct_io().unwrap();
        // At most 4 entries in the kernel, whatever the device does. With the measured
        // cap, the submission at the plug's end could find the kernel's entries already
        // complete and let every held one in before the drop: writes to the page cache
        // often finish that fast. The earlier version of this test retried up to 20
        // times; run 300 times beside two busy threads, 5 runs needed a second try and
        // one found nothing held in any of its 20.
        ring.lock().depth.fixed = Some(4);
        let rt = current_thread();
        rt.block_on(async {
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            // Inside a plug nothing reaches the kernel, so the entries pile up past the
            // cap; its end lets in 4, and completions let in no more than they free.
            let started = plugged(|| {
                (0..64u64)
                    .map(|i| {
                        let data = Bytes::from(vec![7u8; 4096]);
                        let mut write = Box::pin(ring.write(&file, i * 4096, data, 0));
                        assert!(write.as_mut().poll(&mut cx).is_pending());
                        write
                    })
                    .collect::<Vec<_>>()
            });
            assert!(
                ring.lock().held.len() >= 56,
                "the plug's end let in too many"
            );
            drop(started);
        });
        drop(ring);
        drop(rt);
        // Every held entry reached the kernel before the drop returned.
        let mut written = vec![0u8; 64 * 4096];
        std::os::unix::fs::FileExt::read_exact_at(&*file, &mut written, 0).unwrap();
        assert!(written.iter().all(|&b| b == 7));
    }

    #[test]
    fn entries_queued_inside_a_plug_reach_the_kernel_together_after_it_ends() {
        let (_tmp, file) = scratch_file();
        let ring = Ring::new().unwrap();
        // One thread: the reaper cannot run before this task yields.
        let runtime = current_thread();
        runtime.block_on(async {
            let mut writes: Vec<_> = (0..3u8)
                .map(|i| {
                    let data = Bytes::from(vec![i + 1; 4096]);
                    Box::pin(ring.write(&file, u64::from(i) * 4096, data, 0))
                })
                .collect();
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            plugged(|| {
                // A nested plug does not end the outer one.
                plugged(|| {
                    for write in &mut writes {
                        assert!(write.as_mut().poll(&mut cx).is_pending());
                    }
                });
                assert_eq!(
                    ring.lock().uring.submission().len(),
                    3,
                    "held back while plugged, even the first entry"
                );
            });
            // The reaper cannot have run (one thread, no yield): the plug's end itself
            // handed the three to the kernel, in one call.
            assert_eq!(
                ring.lock().uring.submission().len(),
                0,
                "a batch goes to the kernel whole when its plug ends"
            );
            for write in writes {
                assert_eq!(write.await.unwrap(), 4096);
            }
            // A lone entry, with nothing else in flight, goes in as soon as its plug ends.
            let mut lone = Box::pin(ring.read(&file, 4096, Buffer::take(4096)));
            plugged(|| assert!(lone.as_mut().poll(&mut cx).is_pending()));
            assert_eq!(ring.lock().uring.submission().len(), 0);
            let (n, buffer) = lone.await;
            assert_eq!(n.unwrap(), 4096);
            assert!(buffer.as_ref().iter().all(|&b| b == 2));
            for i in 0..3u8 {
                let (n, buffer) = ring
                    .read(&file, u64::from(i) * 4096, Buffer::take(4096))
                    .await;
                assert_eq!(n.unwrap(), 4096);
                assert!(buffer.as_ref().iter().all(|&b| b == i + 1));
            }
        });
    }

    /// Takes the eventfd's count; `None` when nothing signalled it since the last take.
    fn eventfd_signals(ring: &Ring) -> Option<u64> {
        let mut count = [0u8; 8];
        rustix::io::read(&ring.eventfd, &mut count)
            .ok()
            .map(|_| u64::from_ne_bytes(count))
    }

    #[test]
    fn a_page_cache_ring_wakes_its_reaper_only_for_what_its_submitter_could_not_collect() {
        // On a disk, where pages can be dropped from the cache (/tmp may be tmpfs).
        let mut tmp = tempfile::NamedTempFile::new_in(scratch_dir_for_direct_io()).unwrap();
        let file = Arc::new(tmp.reopen().unwrap());
        tmp.write_all(&vec![5u8; 1 << 20]).unwrap();
        let ring = Ring::new().unwrap();
        // One thread, not driven while the futures below are polled: the reaper cannot run
        // and take the eventfd's count first.
        let runtime = current_thread();
        let _entered = runtime.enter();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut collected_by_submitter = 0;
        for round in 0..20u64 {
            let _ = eventfd_signals(&ring);
            let mut read = Box::pin(ring.read(&file, round * 4096, Buffer::take(65536)));
            plugged(|| assert!(read.as_mut().poll(&mut cx).is_pending()));
            if let std::task::Poll::Ready((n, buffer)) = read.as_mut().poll(&mut cx) {
                assert_eq!(n.unwrap(), 65536);
                assert!(buffer.as_ref().iter().all(|&b| b == 5));
                collected_by_submitter += 1;
                assert_eq!(
                    eventfd_signals(&ring),
                    None,
                    "a read its submitter collected woke the reaper"
                );
            } else {
                runtime.block_on(read).0.unwrap();
            }
        }
        assert!(
            collected_by_submitter > 0,
            "no cached read completed inside its submission"
        );
        // A read that is still in flight after its submission must have signalled the
        // eventfd, or its waiter could hang. A read from an empty pipe always is: it
        // completes only once something is written.
        let (pipe_out, pipe_in) = rustix::pipe::pipe().unwrap();
        let pipe_out = Arc::new(File::from(pipe_out));
        let _ = eventfd_signals(&ring);
        let mut read = Box::pin(ring.read(&pipe_out, 0, Buffer::take(4096)));
        plugged(|| assert!(read.as_mut().poll(&mut cx).is_pending()));
        assert!(
            ring.lock().in_kernel() > 0,
            "a read from an empty pipe completed"
        );
        let count = eventfd_signals(&ring);
        assert!(
            count.is_some(),
            "a read left in flight with the reaper asleep"
        );
        // Put the count back for the reaper, which may have nothing else to wake it.
        rustix::io::write(&ring.eventfd, &count.unwrap().to_ne_bytes()).unwrap();
        rustix::io::write(&pipe_in, &[7u8; 4096]).unwrap();
        let (n, buffer) = runtime.block_on(read);
        assert_eq!(n.unwrap(), 4096);
        assert!(buffer.as_ref().iter().all(|&b| b == 7));
        // So may a read of pages not in the cache, when the disk is slower than the
        // submission (a fast device or the kernel's own read path may finish it inside).
        tmp.as_file().sync_all().unwrap();
        for round in 0..20u64 {
            rustix::fs::fadvise(file.as_ref(), 0, 0, rustix::fs::Advice::DontNeed).unwrap();
            let _ = eventfd_signals(&ring);
            let mut read = Box::pin(ring.read(&file, round * 4096, Buffer::take(65536)));
            plugged(|| assert!(read.as_mut().poll(&mut cx).is_pending()));
            if ring.lock().in_kernel() > 0 {
                let count = eventfd_signals(&ring);
                assert!(
                    count.is_some(),
                    "a read left in flight with the reaper asleep"
                );
                rustix::io::write(&ring.eventfd, &count.unwrap().to_ne_bytes()).unwrap();
            }
            let (n, buffer) = runtime.block_on(read);
            assert_eq!(n.unwrap(), 65536);
            assert!(buffer.as_ref().iter().all(|&b| b == 5));
        }
        // An fsync, which runs on an io-wq worker, does not silence the eventfd: its
        // completion signals it.
        let _ = eventfd_signals(&ring);
        let mut sync = Box::pin(ring.fsync(&file, true));
        plugged(|| {
            let _ = sync.as_mut().poll(&mut cx);
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let count = loop {
            if let Some(count) = eventfd_signals(&ring) {
                break count;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "an fsync's completion did not signal the eventfd"
            );
            std::hint::spin_loop();
        };
        rustix::io::write(&ring.eventfd, &count.to_ne_bytes()).unwrap();
        runtime.block_on(sync).unwrap();
    }

    #[test]
    fn a_ring_outlives_the_runtime_that_first_used_it() {
        let (_tmp, file) = scratch_file();
        let ring = Ring::new().unwrap();
        for round in 0..3u8 {
            let runtime = current_thread();
            runtime.block_on(async {
                let data = Bytes::from(vec![round; 4096]);
                ring.write(&file, 0, data, 0).await.unwrap();
                let (n, buffer) = ring.read(&file, 0, Buffer::take(4096)).await;
                assert_eq!(n.unwrap(), 4096);
                assert!(buffer.as_ref().iter().all(|&b| b == round));
            });
        }
    }

    #[test]
    fn a_poll_hands_out_what_the_kernel_posted_without_the_reaper() {
        let (_tmp, file) = scratch_file();
        let ring = Ring::new().unwrap();
        // A current-thread runtime that is never driven: its reaper task cannot run.
        let runtime = current_thread();
        let _entered = runtime.enter();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut caught_pending = 0;
        for _ in 0..20 {
            // An fsync runs on an io-wq worker, so it is usually still in flight when
            // the first poll returns.
            let mut sync = Box::pin(ring.fsync(&file, true));
            let before = ring.reap_posted();
            if sync.as_mut().poll(&mut cx).is_ready() {
                assert!(ring.reap_posted() > before);
                continue;
            }
            caught_pending += 1;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while ring.reap_posted() == before {
                assert!(
                    std::time::Instant::now() < deadline,
                    "no completion handed out"
                );
                std::hint::spin_loop();
            }
            match sync.as_mut().poll(&mut cx) {
                std::task::Poll::Ready(result) => result.unwrap(),
                std::task::Poll::Pending => panic!("handed out, yet the waiter has nothing"),
            }
        }
        assert!(caught_pending > 0, "every fsync completed inline");
    }
}
