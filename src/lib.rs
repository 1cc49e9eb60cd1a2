//! netblk: a network block device in user space that speaks the standard NBD protocol,
//! so the Linux kernel driver, qemu, libnbd's tools and fio use it unchanged.
//!
//! # Layout
//! - [`wire`]: the NBD wire format (handshake, requests, replies), pure encode/decode.
//! - [`server`]: listeners, option haggling ([`server::handshake`]), edge validation
//!   ([`server::validate`]) and the per-connection pipeline ([`server::pipeline`]);
//!   [`server::serve`] is the entry point.
//! - [`backend`]: the [`backend::Backend`] trait every export goes through, with the
//!   sparse [`backend::memory`] (its pages from the huge-page pool, [`backend::page_pool`])
//!   and the [`backend::file`] (file or block device) engines, the io_uring driver
//!   ([`backend::uring`]) and zero-copy page-cache reads ([`backend::splice`]).
//! - [`control`]: the local control socket that `netblk status` and the other commands
//!   talk to, for a plain server and for a replicated node.
//! - [`config`]: the TOML file for several exports; [`listen`]: listen addresses;
//!   [`tcp`]: the socket settings every TCP connection gets.
//! - [`replication`]: replication of an export across nodes (a backend layer), its
//!   resource file, peer protocol and crash-safe metadata.
//! - [`buffer`]: the pool of large I/O buffers (no allocation per request on the hot path).
//! - [`log_limit`]: the rate limit on warnings that every failed request would log.
//! - [`metrics`]: what each export served, and the Prometheus endpoint (`--metrics`).
//! - [`size`]: `512K`/`1G`-style sizes; [`fuzzing`]: entry points for the fuzz targets;
//!   [`loadgen`]: a client for the benchmark whose cost per request does not grow with depth.
//!
//! The `netblk` binary (`src/main.rs`) is only the command line around [`server::serve`].

// `unsafe` is allowed in six places only: `backend::uring`, where the kernel borrows
// buffers; `backend::splice`, for the one system call (`cachestat`) with no safe binding;
// `backend::page_pool`, which maps memory for huge pages and hands out slices of it;
// `backend::mapping`, which maps a cached file for reads; `server::receive`, which reads
// from a socket into a buffer's spare room without a copy; and `tcp::send_queue_bytes`,
// the one ioctl (TIOCOUTQ) with no safe binding.
#![deny(unsafe_code)]

pub mod backend;
pub mod buffer;
pub mod config;
pub mod control;
pub mod fuzzing;
pub mod idle;
pub mod listen;
pub mod loadgen;
pub mod log_limit;
pub mod metrics;
pub mod replication;
pub mod server;
pub mod size;
pub mod tcp;
pub mod wire;

/// A runtime for unit tests: two worker threads, as the machines here have two cores, with
/// the I/O and time drivers, so that tasks meet each other across threads as in the server.
#[cfg(test)]
pub(crate) fn test_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a test runtime")
}
