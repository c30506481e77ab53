//! Shared fixtures for Tessera's cross-crate tests (see `tests/`).

pub mod bench;
pub mod kit;
pub mod probes;
pub mod vmem;
pub mod broken;
pub mod oracle;
