//! Fuzzes the replication protocol: arbitrary bytes as a stream of peer frames, decoded
//! and re-encoded, then handled by a secondary's frame loop (see `netblk::fuzzing::peer`).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| netblk::fuzzing::peer(data));
