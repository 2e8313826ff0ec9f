//! The relayed stage: the upstream's body relayed to the client frame by
//! frame with the request's [`Held`] riding inside the body, so it is
//! settled and released when the body ends, fails, is cut, or the client
//! goes away (each an [`Ending`] of one [`Settlement`]).
//! Each body ends at the first of: the upstream's end, an upstream error,
//! a silence longer than the idle timeout, the request's lifetime, or the
//! drain timeout. An SSE stream then gets an OpenAI-shaped error event; a
//! non-streaming body is cut (the client sees a broken response, not a
//! short one that looks whole).
//!
//! The relay is a hand-written [`HttpBody`] rather than a stream adapter
//! boxed twice, and its timers are lazy: an answer whose bytes are there
//! when asked for never arms one, and a chunk moves the silence deadline
//! without touching the timer wheel (the one timer, armed for the earlier
//! deadline, may wake early and is then set again). The stream adapter
//! with two timers cost more (measured:
//! docs/measurements/2026-12-06-governor-code-figures.md).

use super::settle::{Ending, Held, Settlement};
use super::GovernedUpstream;
use crate::admission::{Governor, Permit};
use crate::client::Answer;
use axum::body::{Body, Bytes, HttpBody};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::Response;
use http_body::Frame;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::time::Sleep;

type Deadline = tokio::time::Instant;

/// What rides inside the response body stream.
struct Flow {
    inner: Body,
    /// The permit and budget hold, settled where the answer ends.
    held: Option<Held>,
    gov: Arc<Governor>,
    sse: bool,
    sent_at: Option<Instant>,
    first_chunk: Option<Instant>,
    last_chunk: Option<Instant>,
    /// A 2xx answer: its timings feed the latency guard.
    ok: bool,
    /// When the last chunk went to the client, and whether the client ever
    /// took long to ask for the next: chunks are timed as the client reads
    /// them, so a slow reader's timings say nothing of the upstream and
    /// must not move the latency guard for everyone.
    yielded_at: Option<Instant>,
    slow_reader: bool,
    idle: Duration,
    /// The end of the request's lifetime.
    end: Deadline,
    /// The upstream is silent past this (`idle` after the last chunk).
    silent_at: Deadline,
    /// Armed when the upstream first keeps the relay waiting, for the
    /// earlier of the two deadlines; set again when it wakes early.
    timer: Option<Pin<Box<Sleep>>>,
    cut: watch::Receiver<bool>,
    /// Resolves at the drain's cut; made when the relay first waits.
    cut_wait: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The last bytes seen, for the `usage` object at the end.
    tail: Tail,
    /// The tail's `usage`, read once when the answer ends (the tiers'
    /// report, the budgets' bill and the permit each want it).
    usage: Option<(Option<u64>, Option<u64>, Option<u64>)>,
    events: u64,
    done: bool,
    /// Told how the stream ended, once.
    on_end: Option<OnEnd>,
}

/// How a relayed stream ended, for whoever books it (model tiers).
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamEnd {
    /// The `usage` numbers at the end of the body, when it had them.
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// SSE data events seen (about one per token without `usage`).
    pub events: u64,
    /// It ended whole (not cut by an error, a timeout or the drain).
    pub whole: bool,
    /// When the first chunk of the body came.
    pub first_chunk: Option<Instant>,
}

pub type OnEnd = Box<dyn FnOnce(StreamEnd) + Send>;

const TAIL_BYTES: usize = 4096;

/// A client that takes longer than this to ask for the next chunk is
/// reading slowly (a fast one asks within microseconds).
const SLOW_READER_GAP: Duration = Duration::from_millis(50);

/// The last [`TAIL_BYTES`] of a body, or more. A body that comes in one
/// chunk (most whole answers) is kept as that chunk, not copied.
enum Tail {
    Empty,
    One(Bytes),
    Joined(Vec<u8>),
}

impl Tail {
    fn push(&mut self, b: &Bytes) {
        let before = match std::mem::replace(self, Tail::Empty) {
            // The last chunk alone is enough.
            _ if b.len() >= TAIL_BYTES => None,
            Tail::Empty => None,
            Tail::One(prev) => Some(prev.to_vec()),
            Tail::Joined(v) => Some(v),
        };
        *self = match before {
            // Kept as it is, unless its end would hold a large body alive.
            None if b.len() <= 4 * TAIL_BYTES => Tail::One(b.clone()),
            None => Tail::Joined(b[b.len() - TAIL_BYTES..].to_vec()),
            Some(mut v) => {
                v.extend_from_slice(b);
                if v.len() > TAIL_BYTES {
                    v.drain(..v.len() - TAIL_BYTES);
                }
                Tail::Joined(v)
            }
        };
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Tail::Empty => &[],
            Tail::One(b) => b,
            Tail::Joined(v) => v,
        }
    }

    /// The `usage` numbers at the end: prompt, completion and cached
    /// prompt tokens.
    fn usage(&self) -> (Option<u64>, Option<u64>, Option<u64>) {
        crate::answer_usage::numbers(self.bytes())
    }
}

/// Why a stream ended early.
enum Stop {
    UpstreamError(String),
    UpstreamSilent,
    Lifetime,
    Drain,
}

impl Stop {
    fn code(&self) -> &'static str {
        match self {
            Stop::UpstreamError(_) => "upstream_stream_error",
            Stop::UpstreamSilent => "upstream_stream_timeout",
            Stop::Lifetime => "request_lifetime",
            Stop::Drain => "draining",
        }
    }
    fn upstream_fault(&self) -> bool {
        matches!(self, Stop::UpstreamError(_) | Stop::UpstreamSilent)
    }
    fn message(&self, f: &Flow) -> String {
        match self {
            Stop::UpstreamError(e) => format!("the upstream failed mid-stream: {e}"),
            Stop::UpstreamSilent => format!(
                "the upstream failed mid-stream: no data for {} ms",
                f.idle.as_millis()
            ),
            Stop::Lifetime => {
                "the request ran past its lifetime (max_request_ms) and was ended".into()
            }
            Stop::Drain => {
                "the governor is shutting down; the request was ended at the drain timeout".into()
            }
        }
    }
}

impl Flow {
    /// The request's timings for the latency guard: TTFT and mean gap
    /// between events of a stream (events, not chunks, so coalesced chunks
    /// do not hide gaps), or the whole time of a non-streaming answer.
    fn timings(&self) -> (Option<f64>, Option<f64>, Option<f64>) {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let Some(sent) = self.sent_at.filter(|_| !self.slow_reader) else {
            return (None, None, None);
        };
        if !self.sse {
            return (None, None, self.last_chunk.map(|t| ms(t - sent)));
        }
        let ttft = self.first_chunk.map(|t| ms(t - sent));
        // Events after the first, less the closing `[DONE]`.
        let gaps = self.events.saturating_sub(2);
        // Several sequences (n > 1, batched prompts) interleave their
        // events, so the gaps between them are not any one's ITL.
        let one_sequence = self
            .held
            .as_ref()
            .is_some_and(|h| h.permit.demand().seqs == 1);
        let itl = match (self.first_chunk, self.last_chunk) {
            (Some(a), Some(b)) if gaps > 0 && one_sequence => Some(ms(b - a) / gaps as f64),
            _ => None,
        };
        (ttft, itl, None)
    }

    /// The answer's `usage` numbers (prompt, completion, cached), found
    /// in its tail once: read only when the answer has ended.
    fn usage(&mut self) -> (Option<u64>, Option<u64>, Option<u64>) {
        *self.usage.get_or_insert_with(|| self.tail.usage())
    }

    /// How the answer ended and what it used.
    fn settlement(&mut self, ending: Ending) -> Settlement {
        let (prompt_tokens, completion_tokens, cached_tokens) = self.usage();
        let whole_ok = ending == Ending::Whole && self.ok;
        Settlement {
            ending,
            refused_by_upstream: !self.ok,
            prompt_tokens,
            completion_tokens,
            cached_tokens,
            events: self.sse.then_some(self.events),
            latency: whole_ok.then(|| self.timings()),
        }
    }

    /// Tells `on_end` how the stream ended and settles the request, once.
    fn finish(&mut self, ending: Ending) {
        if self.on_end.is_none() && self.held.is_none() {
            return;
        }
        let s = self.settlement(ending);
        if let Some(f) = self.on_end.take() {
            f(StreamEnd {
                prompt_tokens: s.prompt_tokens,
                completion_tokens: s.completion_tokens,
                events: self.events,
                whole: ending == Ending::Whole,
                first_chunk: self.first_chunk,
            });
        }
        if let Some(held) = self.held.take() {
            held.settle(&s);
        }
    }

    fn observe_chunk(&mut self, b: &Bytes, now: Instant) {
        if self.sse {
            match (self.last_chunk, self.sent_at) {
                (Some(t), _) => self
                    .gov
                    .metrics
                    .inter_chunk
                    .observe((now - t).as_secs_f64()),
                (None, Some(t)) => {
                    self.first_chunk = Some(now);
                    self.gov.metrics.ttft.observe((now - t).as_secs_f64())
                }
                _ => {}
            }
            self.events += b.windows(5).filter(|w| w == b"data:").count() as u64;
        }
        self.last_chunk = Some(now);
        self.tail.push(b);
    }

    /// Waits on the drain's cut and the two deadlines while the upstream
    /// has nothing: ready with why the relay must stop.
    fn poll_stop(&mut self, cx: &mut Context<'_>) -> Poll<Stop> {
        let cut = self.cut_wait.get_or_insert_with(|| {
            let mut cut = self.cut.clone();
            Box::pin(async move {
                // A closed channel (the governor gone) cuts nothing.
                if cut.wait_for(|c| *c).await.is_err() {
                    std::future::pending::<()>().await;
                }
            })
        });
        if cut.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Stop::Drain);
        }
        loop {
            let due = self.silent_at.min(self.end);
            let timer = self
                .timer
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
            if timer.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            let now = Deadline::now();
            if now >= self.end {
                return Poll::Ready(Stop::Lifetime);
            }
            if now >= self.silent_at {
                return Poll::Ready(Stop::UpstreamSilent);
            }
            // Early: a chunk moved the silence deadline since it was set.
            timer.as_mut().reset(due);
        }
    }

    /// Ends the relay early: books it, logs it, releases the permit, and
    /// returns the last frame (an SSE error event) or the error that cuts
    /// a whole body.
    fn stop(&mut self, stop: Stop) -> Result<Frame<Bytes>, std::io::Error> {
        self.done = true;
        let message = stop.message(self);
        if stop.upstream_fault() {
            self.gov.upstream_failed(stop.code());
            tracing::warn!(
                kind = stop.code(),
                "upstream failed mid-response: {message}"
            );
        } else {
            tracing::info!(kind = stop.code(), "response ended: {message}");
        }
        // Settled and released now, not when the client finally drops the
        // body.
        self.finish(Ending::Cut);
        if self.sse {
            let body = serde_json::json!({"error": {"message": message,
                "type": "server_error", "param": null, "code": stop.code()}});
            Ok(Frame::data(Bytes::from(format!("data: {body}\n\n"))))
        } else {
            Err(std::io::Error::other(message))
        }
    }
}

impl HttpBody for Flow {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        let f = self.get_mut();
        if f.done {
            return Poll::Ready(None);
        }
        // The client asks for the next frame: how long after the last?
        if let Some(t) = f.yielded_at.take() {
            if t.elapsed() > SLOW_READER_GAP {
                f.slow_reader = true;
            }
        }
        if *f.cut.borrow() {
            return Poll::Ready(Some(f.stop(Stop::Drain)));
        }
        let stop = loop {
            break match Pin::new(&mut f.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(b) => {
                        let now = Instant::now();
                        // The lifetime holds while data flows too (the
                        // timer is only polled when the upstream waits).
                        if Deadline::from_std(now) >= f.end {
                            break Stop::Lifetime;
                        }
                        f.observe_chunk(&b, now);
                        f.yielded_at = Some(now);
                        f.silent_at = Deadline::from_std(now) + f.idle;
                        // The last bytes of a body of known length: hyper
                        // ends the answer on them and drops the body
                        // without asking again, so it is settled now.
                        if f.inner.is_end_stream() {
                            f.done = true;
                            f.finish(Ending::Whole);
                        }
                        return Poll::Ready(Some(Ok(Frame::data(b))));
                    }
                    // Trailers are not relayed.
                    Err(_) => continue,
                },
                Poll::Ready(None) => {
                    f.done = true;
                    f.finish(Ending::Whole);
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => Stop::UpstreamError(e.to_string()),
                Poll::Pending => match f.poll_stop(cx) {
                    Poll::Ready(stop) => stop,
                    Poll::Pending => return Poll::Pending,
                },
            };
        };
        Poll::Ready(Some(f.stop(stop)))
    }

    /// Whole, settled, or cut (a stream's error event is its last frame).
    fn is_end_stream(&self) -> bool {
        self.done
    }
}

impl Drop for Flow {
    /// A client that went away: the stream did not end whole.
    fn drop(&mut self) {
        self.finish(Ending::Cut);
    }
}

/// The streaming relay on its own (the fuzz target drives it with arbitrary
/// upstream bytes): the upstream's answer back to the client, chunk by
/// chunk, with `permit` released at its end.
pub fn relay(s: &GovernedUpstream, resp: Answer, permit: Option<Permit>) -> Response {
    let now = Instant::now();
    let held = permit.map(|permit| Held {
        permit,
        budget: None,
        estimated_cached: 0,
        prompt_tokens: 0,
    });
    let end = now + Duration::from_millis(s.gov.settings().timeouts.max_request_ms);
    stream_back_with(s, resp, held, Some(now), end, [], None)
}

/// Takes the hop-by-hop headers out of an answer's, `content-length` too
/// for a stream. Found first (a map cannot lose entries while it is
/// walked), a few at a time on the stack: an answer has one or two.
fn drop_hop_by_hop(headers: &mut HeaderMap, sse: bool) {
    loop {
        let mut hop: [Option<HeaderName>; 4] = Default::default();
        let found = headers
            .keys()
            .filter(|k| {
                super::headers::HOP_BY_HOP.contains(&k.as_str()) && (sse || *k != CONTENT_LENGTH)
            })
            .zip(hop.iter_mut())
            .map(|(k, slot)| *slot = Some(k.clone()))
            .count();
        for k in hop.into_iter().flatten() {
            headers.remove(k);
        }
        if found < 4 {
            return;
        }
    }
}

/// The upstream's answer, streamed back with `extra` headers, telling
/// `on_end` how the stream ended.
pub fn stream_back_with(
    s: &GovernedUpstream,
    resp: Answer,
    held: Option<Held>,
    sent_at: Option<Instant>,
    end: Instant,
    extra: impl IntoIterator<Item = (HeaderName, HeaderValue)>,
    on_end: Option<OnEnd>,
) -> Response {
    let (status, mut headers, body) = resp.into_parts();
    let sse = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    // The upstream's headers go back less the hop-by-hop ones, edited in
    // place (a copy re-hashed every name). A whole body keeps the
    // upstream's length (the relay never changes its bytes; one cut short
    // then reads as broken, not whole). A stream does not: a cut one ends
    // with an error event of its own.
    drop_hop_by_hop(&mut headers, sse);
    // Room for the extras and the tenant and class headers added after,
    // made once (growing the map as they come rehashed it).
    let extra = extra.into_iter();
    headers.reserve(extra.size_hint().0 + 2);
    for (k, v) in extra {
        headers.insert(k, v);
    }
    let idle = Duration::from_millis(s.gov.settings().timeouts.upstream_idle_timeout_ms);
    let flow = Flow {
        inner: body,
        held,
        gov: s.gov.clone(),
        sse,
        sent_at,
        first_chunk: None,
        last_chunk: None,
        ok: status.is_success(),
        yielded_at: None,
        slow_reader: false,
        idle,
        end: end.into(),
        silent_at: Deadline::now() + idle,
        timer: None,
        cut: s.gov.cut_signal(),
        cut_wait: None,
        tail: Tail::Empty,
        usage: None,
        events: 0,
        done: false,
        on_end,
    };
    let mut r = Response::new(Body::new(flow));
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tail_keeps_the_last_bytes_however_they_came() {
        let body = format!(
            "{}\"usage\":{{\"prompt_tokens\":12,\"completion_tokens\":34}}}}",
            "x".repeat(5 * TAIL_BYTES)
        );
        for size in [
            1,
            7,
            100,
            TAIL_BYTES - 1,
            TAIL_BYTES,
            body.len(),
            5 * TAIL_BYTES,
        ] {
            let mut t = Tail::Empty;
            for piece in body.as_bytes().chunks(size) {
                t.push(&Bytes::copy_from_slice(piece));
            }
            let kept = t.bytes();
            assert!(kept.len() >= TAIL_BYTES.min(body.len()), "{size}");
            assert!(body.as_bytes().ends_with(kept), "{size}");
            assert_eq!(t.usage(), (Some(12), Some(34), None), "{size}");
        }
    }

    #[test]
    fn every_hop_by_hop_header_leaves_an_answer() {
        let mut h = HeaderMap::new();
        for name in super::super::headers::HOP_BY_HOP {
            h.insert(*name, axum::http::HeaderValue::from_static("x"));
        }
        h.insert("content-type", axum::http::HeaderValue::from_static("a/b"));
        let whole = {
            let mut h = h.clone();
            drop_hop_by_hop(&mut h, false);
            h
        };
        // More than one round of four: all gone but the body's length.
        let mut left: Vec<&str> = whole.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["content-length", "content-type"]);
        drop_hop_by_hop(&mut h, true);
        assert_eq!(
            h.keys().map(HeaderName::as_str).collect::<Vec<_>>(),
            ["content-type"]
        );
    }
}
