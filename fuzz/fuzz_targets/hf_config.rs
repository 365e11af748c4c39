//! Arbitrary bytes into `colibri::fuzzing::hf_config`: any result is fine, a
//! panic, hang or oversized allocation is a finding.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = colibri::fuzzing::hf_config(data);
});
