//! The SSE relay: any upstream bytes, in any chunking, with or without a
//! failure at the end, reach the client unchanged (then, after a failure,
//! one OpenAI-shaped error event for a stream), and the reservation is
//! released whatever the bytes said (usage objects included).
#![no_main]

use bytes::Bytes;
use envelope_governor::{
    relay, Answer, Ask, GovernedUpstream, Governor, SettingsDraft, TokenCounter,
};
use futures::StreamExt;
use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

struct World {
    rt: tokio::runtime::Runtime,
    state: GovernedUpstream,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let limits = envelope_profile::Limits {
            max_context_tokens: 1 << 20,
            max_output_tokens: 1 << 16,
            max_concurrent_seqs: 64,
            max_kv_tokens_in_flight: 1 << 30,
            buckets: vec![],
        };
        let settings = SettingsDraft::new(limits, "fuzz")
            .check()
            .expect("valid settings");
        let gov = Governor::new(settings);
        let state = GovernedUpstream::new(
            gov,
            "http://127.0.0.1:9",
            TokenCounter::Estimate {
                bytes_per_token: 1.0,
            },
        );
        World { rt, state }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let sse = flags & 1 == 1;
    let fail = flags & 2 == 2;
    let chunks: Vec<Bytes> = rest
        .split(|b| *b == 0xff)
        .map(Bytes::copy_from_slice)
        .collect();
    let sent: Vec<u8> = chunks.concat();
    let w = world();
    w.rt.block_on(async {
        let gov: Arc<Governor> = w.state.gov.clone();
        let permit = gov
            .admit(Ask {
                tenant: "fuzz".into(),
                class: envelope_governor::Class::Interactive,
                deadline: Instant::now() + Duration::from_secs(60),
                demand: envelope_governor::Demand {
                    seqs: 1,
                    kv_tokens: 100,
                    capacity: 1,
                },
                charges: vec![],
                expected_ttft_ms: None,
                ttft_objective_ms: None,
            })
            .await
            .expect("an idle governor admits");
        let mut items: Vec<Result<Bytes, std::io::Error>> = chunks.into_iter().map(Ok).collect();
        if fail {
            items.push(Err(std::io::Error::other("upstream died")));
        }
        let body = axum::body::Body::from_stream(futures::stream::iter(items));
        let ct = if sse {
            "text/event-stream"
        } else {
            "application/json"
        };
        let upstream = http::Response::builder()
            .status(200)
            .header("content-type", ct)
            .body(body)
            .unwrap();
        let resp = relay(&w.state, Answer::from(upstream), Some(permit));
        let mut out = Vec::new();
        let mut errored = false;
        let mut stream = resp.into_body().into_data_stream();
        while let Some(item) = stream.next().await {
            match item {
                Ok(b) => out.extend_from_slice(&b),
                Err(_) => {
                    errored = true;
                    break;
                }
            }
        }
        drop(stream);
        assert!(out.starts_with(&sent), "bytes were changed on the way");
        let tail = &out[sent.len()..];
        match (fail, sse) {
            (false, _) => assert!(tail.is_empty() && !errored),
            (true, true) => {
                let t = std::str::from_utf8(tail).expect("the error event is UTF-8");
                let json = t
                    .strip_prefix("data: ")
                    .and_then(|t| t.strip_suffix("\n\n"));
                let v: serde_json::Value =
                    serde_json::from_str(json.expect("one SSE event")).expect("JSON");
                assert_eq!(v["error"]["code"], "upstream_stream_error");
            }
            (true, false) => assert!(errored && tail.is_empty()),
        }
        assert_eq!(
            gov.requests_in_flight(),
            0,
            "the reservation was not released"
        );
    });
});
