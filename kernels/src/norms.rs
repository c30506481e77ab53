//! (being written)

use crate::LibraryKernel;

/// This module's library ops.
pub const OPS: &[LibraryKernel] = &[];
