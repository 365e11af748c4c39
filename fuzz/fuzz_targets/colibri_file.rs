//! Arbitrary bytes into `colibri::fuzzing::colibri_file`: any result is fine, a
//! panic, hang or oversized allocation is a finding.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = colibri::fuzzing::colibri_file(data);
});
