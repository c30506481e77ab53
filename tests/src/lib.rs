//! Shared fixtures for Tessera's cross-crate tests (see `tests/`).

pub mod bench;
pub mod broken;
pub mod conformance;
pub mod hardening;
pub mod oracle;
