//! Fuzzes the handshake: arbitrary bytes from the client's first flags onwards.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| netblk::fuzzing::handshake(data));
