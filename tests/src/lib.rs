//! Shared fixtures for Tessera's cross-crate tests (see `tests/`).

pub mod broken;
pub mod oracle;
