//! Errors for users: every error names the kernel, what it is about (an operand, an
//! instruction), the rule broken, and what to change.

use std::fmt;

use crate::ir::SourceLoc;

/// A kernel rejected by the builder, the verifier or the interpreter.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelError {
    pub kernel: String,
    /// What the error is about: `operand `x``, `scratch `acc``, `grid`, `instruction mul`...
    pub subject: String,
    /// A short stable rule id, e.g. `block-tiling`, `vmem-budget`, `index-map-arity`.
    pub rule: &'static str,
    pub message: String,
    /// What to change.
    pub help: String,
    /// The user's source line, when the error is about an instruction the macro placed.
    pub loc: Option<SourceLoc>,
}

impl KernelError {
    pub fn new(kernel: &str, subject: impl Into<String>, rule: &'static str, message: impl Into<String>, help: impl Into<String>) -> Self {
        KernelError {
            kernel: kernel.to_string(),
            subject: subject.into(),
            rule,
            message: message.into(),
            help: help.into(),
            loc: None,
        }
    }

    pub fn at(mut self, loc: Option<SourceLoc>) -> Self {
        self.loc = loc;
        self
    }

    /// [`Self::at`] unless the error already has a location (an instruction's is closer).
    pub fn or_at(self, loc: &Option<SourceLoc>) -> Self {
        if self.loc.is_some() {
            self
        } else {
            self.at(loc.clone())
        }
    }
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "error[{}]: kernel `{}`, {}: {}", self.rule, self.kernel, self.subject, self.message)?;
        if let Some(loc) = &self.loc {
            write!(f, "\n  --> {loc}")?;
        }
        if !self.help.is_empty() {
            write!(f, "\n  help: {}", self.help)?;
        }
        Ok(())
    }
}

impl std::error::Error for KernelError {}

pub type Result<T, E = KernelError> = std::result::Result<T, E>;

/// A kernel that compiles but leaves performance on the table (a packed dtype in blocks
/// shorter than its native tile, an emulated matmul...): reported, never refused.
#[derive(Clone, Debug, PartialEq)]
pub struct Warning {
    pub kernel: String,
    pub subject: String,
    /// A stable rule id from [`crate::rules::RULES`] (kind `Warning`).
    pub rule: &'static str,
    pub message: String,
    /// What to change to get the performance back.
    pub help: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "warning[{}]: kernel `{}`, {}: {}", self.rule, self.kernel, self.subject, self.message)?;
        if !self.help.is_empty() {
            write!(f, "\n  help: {}", self.help)?;
        }
        Ok(())
    }
}
