//! Placeholder: the reference interpreter is being written.
