//! Shared fixtures for Tessera's cross-crate tests (see `tests/`).

pub mod agreement;
pub mod backends;
pub mod bench;
pub mod kit;
pub mod probes;
pub mod rulebook;
pub mod vmem;
pub mod broken;
pub mod conformance;
pub mod hardening;
pub mod oracle;
pub mod nonfinite;
