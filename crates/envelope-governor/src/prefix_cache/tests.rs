use super::*;
use crate::request::{ChatText, Prompts};

fn chat(messages: &[(&str, &str)]) -> Prompts {
    Prompts::Messages(ChatText {
        messages: messages
            .iter()
            .map(|(r, t)| (r.to_string(), t.to_string()))
            .collect(),
        media: Default::default(),
    })
}

/// A system prompt of `blocks` whole blocks (with its role and separators).
fn system(blocks: usize) -> String {
    // "system" + 0 + text + 0 = blocks * BLOCK_BYTES bytes.
    "s".repeat(blocks * BLOCK_BYTES - "system".len() - 2)
}

/// One poll of the server's metrics.
fn polled(
    pc: &PrefixCache,
    caching: Option<bool>,
    counters: Option<(f64, f64)>,
    kv_capacity_tokens: Option<f64>,
) {
    pc.polled(&ServerReport {
        caching,
        counters,
        kv_capacity_tokens,
        block_size: None,
    });
}

#[test]
fn two_prompts_share_their_common_blocks_and_no_more() {
    let h = foldhash::quality::RandomState::default();
    let a: Vec<u8> = (0..5 * BLOCK_BYTES).map(|i| (i % 251) as u8).collect();
    let mut b = a.clone();
    // They differ in the third block's last byte.
    b[3 * BLOCK_BYTES - 1] ^= 1;
    let (ba, bb) = (blocks(&h, &a), blocks(&h, &b));
    assert_eq!((ba.ids.len(), ba.bytes), (5, 5 * BLOCK_BYTES));
    assert_eq!(ba.ids[..2], bb.ids[..2]);
    // Chained: every block after the divergence differs too, though the
    // fourth and fifth blocks' bytes are equal.
    assert!((2..5).all(|i| ba.ids[i] != bb.ids[i]));
    let mut r = Record::new(100);
    r.insert(&ba.ids);
    assert_eq!(r.matched(&bb.ids), 2);
    assert_eq!(r.matched(&ba.ids), 5);
    // A partial block is no block.
    assert_eq!(blocks(&h, &a[..BLOCK_BYTES - 1]).ids.len(), 0);
}

#[test]
fn the_record_forgets_the_least_recently_used_first() {
    let mut r = Record::new(4);
    r.insert(&[1, 2, 3]);
    r.insert(&[4]);
    // 1 is used again: 2 is now the oldest.
    r.insert(&[1]);
    r.insert(&[5, 6]);
    assert_eq!(r.len(), 4);
    assert_eq!(r.matched(&[1]), 1);
    assert_eq!(r.matched(&[2]), 0);
    assert_eq!(r.matched(&[3]), 0);
    assert_eq!(r.matched(&[4, 5, 6]), 3);
    // Smaller: the oldest go.
    r.set_capacity(2);
    assert_eq!(r.matched(&[5, 6]), 2);
    assert_eq!(r.matched(&[1]) + r.matched(&[4]), 0);
    // Many uses of one block keep the order bounded.
    for _ in 0..1000 {
        r.insert(&[7]);
    }
    assert!(r.order.len() <= 4 * 2 + 64, "{}", r.order.len());
    assert_eq!(r.matched(&[7]), 1);
}

#[test]
fn cached_tokens_are_the_matched_share_never_the_whole_prompt() {
    assert_eq!(cached_tokens(100, 400, 200), 50);
    assert_eq!(cached_tokens(100, 400, 399), 99);
    assert_eq!(cached_tokens(100, 400, 400), 99);
    assert_eq!(cached_tokens(100, 400, 0), 0);
    assert_eq!(cached_tokens(0, 400, 400), 0);
    assert_eq!(cached_tokens(10, 0, 0), 0);
}

#[test]
fn trust_falls_at_once_and_rises_halfway() {
    let mut t = Trust::default();
    assert_eq!(t.value, 0.0);
    t.read(1.0);
    assert_eq!(t.value, 0.5);
    t.read(1.0);
    assert_eq!(t.value, 0.75);
    t.read(2.0); // more than estimated: no credit past the estimate
    assert_eq!(t.value, 0.875);
    t.read(0.1);
    assert_eq!(t.value, 0.1);
    t.read(f64::NAN);
    assert_eq!((t.value, t.readings), (0.0, 5));
}

/// An agent's second call: the shared system prompt (8 blocks) and a
/// question of its own.
fn agent_call(n: usize) -> Prompts {
    chat(&[
        ("system", &system(8)),
        ("user", &format!("question {n} {}", "q".repeat(200))),
    ])
}

#[test]
fn credit_follows_the_servers_counters_and_falls_with_them() {
    let pc = PrefixCache::new(1000);
    let tokens = [300u64];
    // Nothing sent yet: nothing estimated.
    let first = pc.estimate("a", &agent_call(0), &tokens);
    assert_eq!((&first.estimated, &first.credited), (&vec![0], &vec![0]));
    pc.sent(&first, 300);
    // The second call finds the system prompt's 8 blocks (of its 8 + 3
    // whole blocks and a part): estimated, but credited nothing before
    // the server said anything.
    let second = pc.estimate("a", &agent_call(1), &tokens);
    let bytes = second.blocks[0].bytes;
    let want = cached_tokens(300, bytes, 8 * BLOCK_BYTES);
    assert_eq!(second.estimated, vec![want]);
    assert!(want > 150, "{want} of 300");
    assert_eq!(second.credited, vec![0]);
    // The server's counters: the first poll is the baseline.
    polled(&pc, Some(true), Some((1000.0, 500.0)), None);
    pc.sent(&second, 300);
    // It found as much as was estimated: trust rises halfway each reading.
    let found = want as f64;
    polled(&pc, Some(true), Some((1600.0, 500.0 + found)), None);
    let (trust, rates) = pc.trust();
    assert_eq!(trust.value, 0.5);
    // Estimated: of the 600 prompt tokens sent over the window.
    let est_rate = want as f64 / 600.0;
    assert!(
        (rates.estimated.unwrap() - est_rate).abs() < 1e-9,
        "{rates:?}"
    );
    // Observed: hits over queries of the window (600 queried, `found` hit).
    assert!((rates.observed.unwrap() - found / 600.0).abs() < 1e-9);
    let third = pc.estimate("a", &agent_call(2), &tokens);
    assert_eq!(third.credited, vec![want / 2]);
    // Readings keep confirming: credit approaches the estimate.
    let mut totals = (1600.0, 500.0 + found);
    for _ in 0..4 {
        pc.sent(&third, 300);
        totals = (totals.0 + 300.0, totals.1 + found);
        polled(&pc, Some(true), Some(totals), None);
    }
    assert!(pc.trust().0.value > 0.9, "{:?}", pc.trust());
    // The cache is flushed: the server finds nothing of what was sent.
    // One poll and the credit is gone.
    pc.sent(&third, 300);
    pc.sent(&third, 300);
    totals.0 += 600.0;
    polled(&pc, Some(true), Some(totals), None);
    // The window still holds earlier hits; the reading is the window's.
    let after = pc.trust().0.value;
    assert!(after < 0.7, "{after}");
    for _ in 0..3 {
        pc.sent(&third, 300);
        totals.0 += 300.0;
        polled(&pc, Some(true), Some(totals), None);
    }
    assert_eq!(pc.trust().0.value, 0.0);
    assert_eq!(pc.estimate("a", &agent_call(3), &tokens).credited, vec![0]);
}

#[test]
fn a_server_that_keeps_no_prefix_or_says_nothing_is_never_credited() {
    let pc = PrefixCache::new(1000);
    let e = pc.estimate("a", &agent_call(0), &[300]);
    pc.sent(&e, 300);
    // Says nothing (no counters, no caching flag): no reading at all.
    for _ in 0..5 {
        polled(&pc, None, None, None);
    }
    assert_eq!(pc.trust().0.readings, 0);
    let e = pc.estimate("a", &agent_call(1), &[300]);
    assert!(e.estimated[0] > 0);
    assert_eq!(e.credited, vec![0]);
    // Counters that hit, then a server that says it keeps no prefix.
    polled(&pc, Some(true), Some((0.0, 0.0)), None);
    pc.sent(&e, 300);
    polled(&pc, Some(true), Some((300.0, e.estimated[0] as f64)), None);
    assert!(pc.trust().0.value > 0.0);
    polled(&pc, Some(false), Some((300.0, e.estimated[0] as f64)), None);
    assert_eq!(pc.trust().0.value, 0.0);
}

#[test]
fn a_restarted_servers_counters_count_from_zero() {
    let pc = PrefixCache::new(1000);
    let e = pc.estimate("a", &agent_call(0), &[300]);
    pc.sent(&e, 300);
    let e = pc.estimate("a", &agent_call(1), &[300]);
    let est = e.estimated[0] as f64;
    polled(&pc, Some(true), Some((10_000.0, 8_000.0)), None);
    pc.sent(&e, 300);
    polled(&pc, Some(true), Some((10_300.0, 8_000.0 + est)), None);
    assert_eq!(pc.trust().0.value, 0.5);
    // Restarted: its counters are small again, and it hit nothing.
    pc.sent(&e, 300);
    polled(&pc, Some(true), Some((300.0, 0.0)), None);
    assert_eq!(pc.trust().0.value, 0.0, "{:?}", pc.trust());
}

#[test]
fn answers_that_report_cached_tokens_set_each_tenants_trust() {
    let pc = PrefixCache::new(1000);
    for t in ["a", "b"] {
        let e = pc.estimate(t, &agent_call(0), &[400]);
        pc.sent(&e, 400);
    }
    let e = pc.estimate("a", &agent_call(1), &[400]);
    let est = e.estimated[0];
    assert!(est >= READING_TOKENS, "{est}");
    // a's answers: the server found what was estimated; b's: nothing (say
    // b's calls went to a replica that lost its cache).
    for _ in 0..4 {
        pc.answered("a", est, est, 400);
    }
    assert_eq!(pc.tenant_trust("a").unwrap().value, 0.9375);
    assert!(pc.tenant_trust("b").is_none());
    pc.answered("b", est, 0, 400);
    assert_eq!(pc.tenant_trust("b").unwrap().value, 0.0);
    // The upstream's trust fell with b's answer; a is credited at most it.
    assert_eq!(pc.trust().0.value, 0.0);
    assert_eq!(pc.estimate("a", &agent_call(2), &[400]).credited, vec![0]);
    for _ in 0..6 {
        pc.answered("a", est, est, 400);
    }
    let a = pc.estimate("a", &agent_call(3), &[400]).credited[0];
    assert!(a as f64 > 0.9 * est as f64, "{a} of {est}");
    // b's own trust still holds it at 0, whatever the upstream's.
    assert_eq!(pc.estimate("b", &agent_call(4), &[400]).credited, vec![0]);
    // A short answer alone is no reading.
    let before = pc.tenant_trust("a").unwrap().readings;
    pc.answered("a", 10, 0, 20);
    assert_eq!(pc.tenant_trust("a").unwrap().readings, before);
}

#[test]
fn the_record_is_sized_to_the_servers_cache() {
    let pc = PrefixCache::new(1_000_000);
    for n in 0..50 {
        let e = pc.estimate(
            "a",
            &chat(&[("user", &format!("{n} {}", "x".repeat(640)))]),
            &[200],
        );
        pc.sent(&e, 200);
    }
    assert_eq!(pc.recorded_blocks(), 500);
    // vLLM says its cache holds 1,024 tokens: 64 blocks of 64 bytes.
    polled(&pc, Some(true), Some((0.0, 0.0)), Some(1024.0));
    assert_eq!(pc.recorded_blocks(), Record::blocks_for_tokens(1024));
    assert_eq!(Record::blocks_for_tokens(1024), 64);
}

#[test]
fn a_prefix_is_estimated_in_the_servers_whole_blocks() {
    let pc = PrefixCache::new(1000);
    let e = pc.estimate("a", &agent_call(0), &[300]);
    pc.sent(&e, 300);
    let unblocked = pc.estimate("a", &agent_call(1), &[300]).estimated[0];
    // vLLM's CPU build keeps 128 tokens a block.
    pc.polled(&ServerReport {
        block_size: Some(128.0),
        ..Default::default()
    });
    let blocked = pc.estimate("a", &agent_call(1), &[300]).estimated[0];
    assert_eq!(blocked, unblocked - unblocked % 128, "{unblocked}");
    assert!(blocked > 0 && blocked < unblocked, "{blocked} {unblocked}");
    // A prompt whose cached share is under one block: nothing.
    assert_eq!(pc.estimate("a", &agent_call(2), &[150]).estimated, vec![0]);
}
