//! Fuzzes the transmission phase: a valid negotiation, then arbitrary request bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| netblk::fuzzing::requests(data));
