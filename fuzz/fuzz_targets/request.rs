//! Request validation: any bytes, as either endpoint's body, either parse
//! or give a 4xx; a parsed request rewritten to any output limit is JSON
//! in which no output-length field exceeds that limit, the main field is
//! set, and `min_tokens` is under it.
#![no_main]

use envelope_governor::request::{parse, Endpoint, OUTPUT_FIELDS};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    for endpoint in [Endpoint::Completions, Endpoint::Chat] {
        let req = match parse(endpoint, data) {
            Ok(r) => r,
            Err(e) => {
                assert!(e.status().is_client_error(), "{e:?}");
                continue;
            }
        };
        assert!(req.n >= 1 && req.n <= envelope_governor::request::MAX_N);
        for applied in [1u64, 7, 4096] {
            let out = req.body_with_max_tokens(applied);
            let v: Value = serde_json::from_slice(&out).expect("the forwarded body is JSON");
            let obj = v.as_object().expect("an object");
            for f in OUTPUT_FIELDS {
                if let Some(x) = obj.get(*f).filter(|x| !x.is_null()) {
                    let n = x.as_i64().expect("an integer output field");
                    assert!(n >= 1 && n as u64 <= applied, "{f} = {n} > {applied}");
                }
            }
            assert!(obj
                .get(req.max_tokens_field)
                .and_then(Value::as_u64)
                .is_some());
            if let Some(m) = obj.get("min_tokens").and_then(Value::as_u64) {
                assert!(m <= applied);
            }
        }
    }
});
