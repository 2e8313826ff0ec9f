//! One routed call as read: its request, count, identity, tags, route
//! and what its answer must pass; shared by the buffered path
//! ([`super::call`]) and the streamed one ([`super::stream`]).

use super::book::{CallRecord, Tag};
use super::check::Expect;
use super::route::Route;
use envelope_governor::error::GovernError;
use envelope_governor::identity::Identity;
use envelope_governor::recorder::Draft;
use envelope_governor::request_path::{Counted, Incoming};
use envelope_governor::settings::Settings;
use envelope_governor::GovernedUpstream;
use std::sync::Arc;

/// What one call is, once read.
pub(super) struct Call {
    pub(super) inc: Incoming,
    /// Its prompt counted once, by the first tier's first upstream (with
    /// its settings): a tier that counts the same way takes the count.
    /// Where that upstream could not count, the bound estimate (which
    /// routed the call) and no one who counted: each tier counts.
    pub(super) counted: Counted,
    pub(super) counted_by: Option<(Arc<GovernedUpstream>, Arc<Settings>)>,
    pub(super) who: Identity,
    pub(super) tag: Tag,
    pub(super) conversation: Option<String>,
    /// `--record`: what the call is, for its line.
    pub(super) draft: Option<Draft>,
    pub(super) route: Route,
    pub(super) expect: Expect,
    /// The whole answer is held before it goes back (so it can be checked).
    pub(super) buffered: bool,
}

impl Call {
    /// Its `--record` line's part, with `answer` (output tokens, TTFT).
    pub(super) fn rec(&self, answer: Option<(u64, Option<f64>)>) -> Option<CallRecord<'_>> {
        self.draft.as_ref().map(|draft| CallRecord {
            draft,
            answer,
            max_tokens: self.inc.parsed.max_tokens,
        })
    }
}

pub(super) fn upstream_failed(e: &GovernError) -> bool {
    matches!(
        e,
        GovernError::UpstreamUnreachable(_) | GovernError::UpstreamTimeout(_)
    )
}
