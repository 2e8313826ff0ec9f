//! A governed request's path, one type per stage, in order. The front
//! door ([`crate::front_door`]) makes the cheap checks and identifies the
//! caller first; then:
//!
//! | stage | value | made by | file |
//! |---|---|---|---|
//! | read | [`Incoming`]: headers, parsed body, deadline, lifetime | [`read_request`] | `read.rs` |
//! | counted | [`Counted`]: prompt tokens per group, and by what | [`count`] | `count.rs` |
//! | planned | [`Planned`]: `max_tokens`, buckets, demand | [`plan_request`], a pure function | `plan.rs` |
//! | reserved | a budget [`Hold`](crate::budget::Hold) (with budgets over time) | [`reserve`] | `reserve.rs` |
//! | admitted | [`Placed`]: the permit, the hold, the plan | [`place`] (count, plan, reserve, admit) | `admit.rs` |
//! | relayed | the answer's head, then its body frame by frame | [`send`], [`stream_back_with`] | `send.rs`, `relay.rs` |
//! | or collected | the whole answer, relayed into the governor (tiers) | [`collect`] | `collect.rs` |
//! | settled | [`Settlement`]: how the answer ended and what it used | [`Held::settle`] | `settle.rs` |
//!
//! Every ending of an admitted request (a whole answer, one cut short, a
//! client gone, an upstream never reached) is one [`Settlement`], which
//! bills or refunds the budgets, gives the latency guard its sample,
//! records the tokens used and releases the permit, in that order.

mod admit;
mod app_state;
mod collect;
mod count;
mod headers;
mod plan;
mod read;
pub(crate) mod record;
mod relay;
mod reserve;
mod send;
mod settle;
pub(crate) mod timer;

pub(crate) use admit::{place, Placed, Wait};
pub use app_state::{upstream_client, AppState, ReloadHook};
pub(crate) use collect::collect;
pub(crate) use count::{count, Counted};
pub(crate) use headers::{forward_headers, named, placed_headers, Extra};
pub(crate) use plan::{plan_request, PlanInputs, Planned};
pub use read::DEADLINE_HEADER;
pub(crate) use read::{read_request, Incoming};
pub use relay::relay;
pub(crate) use relay::{stream_back_with, OnEnd, StreamEnd};
pub(crate) use reserve::reserve;
pub(crate) use send::{send, upstream_error};
pub(crate) use settle::{Ending, Held, Settlement};
