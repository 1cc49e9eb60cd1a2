//! Fuzzes the metrics endpoint's request parser: arbitrary bytes as an HTTP request head.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| netblk::fuzzing::metrics_request(data));
