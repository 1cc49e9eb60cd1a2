//! Fuzzes the replication protocol decoder: arbitrary bytes as a stream of peer frames.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| netblk::fuzzing::peer(data));
