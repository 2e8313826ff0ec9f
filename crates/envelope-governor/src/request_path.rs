//! A governed request's path, one type per stage, in order. The front
//! door ([`crate::front_door`]) makes the cheap checks and identifies the
//! caller first; then, on one [`GovernedUpstream`] (whose methods are
//! these stages for both front ends):
//!
//! | stage | value | made by | file |
//! |---|---|---|---|
//! | read | [`Incoming`]: headers, parsed body, deadline, lifetime | [`read_request`] | `read.rs` |
//! | counted | [`Counted`]: prompt tokens per group, and by what | [`GovernedUpstream::count`] | `count.rs` |
//! | planned | [`Planned`]: `max_tokens`, buckets, demand | [`plan_request`], a pure function | `plan.rs` |
//! | reserved | a budget [`Hold`](crate::budget::Hold) (with budgets over time) | [`reserve`] | `reserve.rs` |
//! | admitted | [`Placed`]: the permit, the hold, the plan | [`GovernedUpstream::place`] or [`GovernedUpstream::try_place`] (plan, reserve, admit) | `admit.rs` |
//! | sent | [`Sent`]: the answer's head, the placement held | [`GovernedUpstream::send`] | `send.rs` |
//! | relayed | the body frame by frame to the client | [`Sent::stream_back`] | `relay.rs` |
//! | or collected | [`Collected`]: the whole answer, relayed into the governor (the router checks it) | [`Sent::collect`] | `collect.rs` |
//! | settled | [`Settlement`]: how the answer ended and what it used | [`Held::settle`] | `settle.rs` |
//!
//! Every ending of an admitted request (a whole answer, one cut short, a
//! client gone, an upstream never reached) is one [`Settlement`], which
//! bills or refunds the budgets, gives the latency guard its sample,
//! records the tokens used and releases the permit, in that order.

mod admit;
mod collect;
mod count;
mod governed_upstream;
pub(crate) mod headers;
mod plan;
mod read;
pub mod record;
mod relay;
mod reserve;
mod send;
mod settle;
pub(crate) mod timer;

pub use admit::Placed;
pub(crate) use admit::{place, Wait};
pub(crate) use collect::collect;
pub use collect::Collected;
pub(crate) use count::count;
pub use count::Counted;
pub use governed_upstream::{upstream_client, GovernedUpstream, ReloadHook, Sent};
pub(crate) use headers::forward_headers;
pub use headers::{named, placed_headers, Extra};
pub(crate) use plan::{plan_request, PlanInputs, Planned};
pub use read::DEADLINE_HEADER;
pub use read::{read_request, Incoming};
pub use relay::relay;
pub(crate) use relay::stream_back_with;
pub use relay::{OnEnd, StreamEnd};
pub(crate) use reserve::reserve;
pub(crate) use send::{send, upstream_error};
pub(crate) use settle::{Ending, Held, Settlement};
