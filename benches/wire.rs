//! Micro-benchmarks of the NBD codec's hot path: parsing request headers (one, and a batch
//! as the server reads many per syscall) and encoding the replies sent per request.
//!
//! `cargo bench --bench wire` (add `-- --quick` for a short run).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use netblk::wire::transmission::{ReplyEncoder, ReplyStyle, RequestHeader, RequestStyle};
use netblk::wire::{cmd, NbdError};

fn header(cookie: u64) -> RequestHeader {
    RequestHeader {
        flags: 0,
        command: cmd::READ,
        cookie,
        offset: cookie * 4096,
        length: 4096,
    }
}

fn parsing(c: &mut Criterion) {
    let mut group = c.benchmark_group("parse");
    for style in [RequestStyle::Compact, RequestStyle::Extended] {
        let one = header(7).encode(style);
        group.throughput(Throughput::Elements(1));
        group.bench_function(format!("{style:?} header"), |b| {
            b.iter(|| RequestHeader::decode(black_box(&one), style))
        });
        let batch: Vec<u8> = (0..64).flat_map(|i| header(i).encode(style)).collect();
        let len = style.header_len();
        group.throughput(Throughput::Elements(64));
        group.bench_function(format!("{style:?} batch of 64"), |b| {
            b.iter(|| {
                let mut at = 0;
                let mut sum = 0u64;
                while let Ok(Some(h)) = RequestHeader::decode(black_box(&batch[at..]), style) {
                    sum = sum.wrapping_add(h.offset);
                    at += len;
                }
                sum
            })
        });
    }
    group.finish();
}

fn encoding(c: &mut Criterion) {
    let mut group = c.benchmark_group("encode");
    group.throughput(Throughput::Elements(1));
    for style in [
        ReplyStyle::Simple,
        ReplyStyle::Structured,
        ReplyStyle::Extended,
    ] {
        let enc = ReplyEncoder {
            style,
            cookie: 42,
            offset: 1 << 20,
        };
        let mut out = Vec::with_capacity(256);
        group.bench_function(format!("{style:?} ok"), |b| {
            b.iter(|| {
                out.clear();
                black_box(&enc).ok(&mut out);
                out.len()
            })
        });
        group.bench_function(format!("{style:?} read data header"), |b| {
            b.iter(|| {
                out.clear();
                black_box(&enc).data_header(&mut out, 1 << 20, 4096, true);
                out.len()
            })
        });
        group.bench_function(format!("{style:?} error"), |b| {
            b.iter(|| {
                out.clear();
                black_box(&enc).error(&mut out, NbdError::Inval, "request refused");
                out.len()
            })
        });
        if style != ReplyStyle::Simple {
            let extents: Vec<(u64, u32)> =
                (0..16).map(|i| (65536 * (i + 1), (i % 3) as u32)).collect();
            group.bench_function(format!("{style:?} block status, 16 extents"), |b| {
                b.iter(|| {
                    out.clear();
                    black_box(&enc).block_status(&mut out, 1, black_box(&extents), true);
                    out.len()
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, parsing, encoding);
criterion_main!(benches);
