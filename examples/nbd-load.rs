//! Reads against an NBD server at a fixed depth, random or sequential, from a client whose
//! cost per request does not grow with the depth nor its cost per byte with the read size
//! ([`netblk::loadgen`]); prints one JSON line.
//!
//! `cargo run --release --example nbd-load -- --address 127.0.0.1:10809 --depth 256`
//! `cargo run --release --example nbd-load -- --depth 8 --block 33554432 --sequential`

use std::time::Duration;

use clap::Parser;
use netblk::loadgen::{reads, LoadSpec};

#[derive(Parser)]
#[command(about = "Reads at a fixed depth against an NBD server (simple replies)")]
struct Args {
    /// The server's TCP address.
    #[arg(long, default_value = "127.0.0.1:10809")]
    address: String,
    /// Reads kept in flight.
    #[arg(long, default_value_t = 32)]
    depth: usize,
    /// Bytes per read.
    #[arg(long, default_value_t = 4096)]
    block: u32,
    /// Seconds counted.
    #[arg(long, default_value_t = 3.0)]
    runtime: f64,
    /// Seconds run before counting.
    #[arg(long, default_value_t = 1.0)]
    ramp: f64,
    /// Seed of the offsets.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Read the export in order instead of at random.
    #[arg(long)]
    sequential: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let spec = LoadSpec {
        depth: args.depth,
        block: args.block,
        duration: Duration::from_secs_f64(args.runtime),
        ramp: Duration::from_secs_f64(args.ramp),
        seed: args.seed,
        sequential: args.sequential,
    };
    let report = reads(&args.address, &spec)?;
    println!(
        "{}",
        serde_json::json!({
            "depth": spec.depth,
            "block": spec.block,
            "sequential": spec.sequential,
            "requests": report.requests,
            "seconds": report.seconds,
            "iops": report.iops(),
            "mean_latency_us": report.mean_latency_us,
        })
    );
    Ok(())
}
