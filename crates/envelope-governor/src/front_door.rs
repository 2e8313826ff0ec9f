//! The one way into the governed endpoints, for both front ends (one
//! upstream, or the model tiers' router): the cheap refusals first (nothing is read or counted
//! for a request that would be refused anyway), then who the caller is,
//! then the mode's own path ([`FrontDoor::serve`]); every refusal goes
//! through [`crate::refusal::refuse`], and every answer, refused or not,
//! names the tenant and class it was charged to.

use crate::error::GovernError;
use crate::identity::Identity;
use crate::refusal::{self, RefusalCounter};
use crate::request::Endpoint;
use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

/// What a mode supplies to the front door.
pub trait FrontDoor: Send + Sync + 'static {
    /// Refusals that need nothing read: draining, the guard refusing new
    /// work, a full queue.
    ///
    /// # Errors
    /// The refusal.
    fn precheck(&self) -> Result<(), GovernError>;

    /// Who the caller is (tenant and class), from its headers.
    ///
    /// # Errors
    /// An unknown or missing key, or a class the tenant may not use.
    fn identify(&self, headers: &HeaderMap) -> Result<Identity, GovernError>;

    /// Where refusals are counted by reason.
    fn refusals(&self) -> &dyn RefusalCounter;

    /// Reads, counts, places, sends and relays one identified request.
    fn serve<'a>(
        self: &'a Arc<Self>,
        endpoint: Endpoint,
        req: Request,
        arrived: Instant,
        who: &'a Identity,
    ) -> impl Future<Output = Result<Response, GovernError>> + Send + 'a;
}

/// A governed request through `door`.
pub async fn governed<D: FrontDoor>(
    State(door): State<Arc<D>>,
    endpoint: Endpoint,
    req: Request,
) -> Response {
    let arrived = Instant::now();
    if let Err(e) = door.precheck() {
        return refusal::refuse(door.refusals(), e);
    }
    let who = match door.identify(req.headers()) {
        Ok(w) => w,
        Err(e) => return refusal::refuse(door.refusals(), e),
    };
    let mut r = match door.serve(endpoint, req, arrived, &who).await {
        Ok(r) => r,
        Err(e) => refusal::refuse(door.refusals(), e),
    };
    refusal::charged_to(&mut r, &who);
    r
}

/// A router with every governed endpoint going through `D`'s front door.
pub fn governed_routes<D: FrontDoor>() -> Router<Arc<D>> {
    Endpoint::ALL.into_iter().fold(Router::new(), |router, e| {
        router.route(
            e.path(),
            post(move |d: State<Arc<D>>, r: Request| governed(d, e, r)),
        )
    })
}
