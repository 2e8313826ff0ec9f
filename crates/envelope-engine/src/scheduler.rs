//! Which sequences run in the next step, and how many of their tokens.
//! Plain bookkeeping over lengths and block ids, no tensors, so every rule
//! is unit-tested here. The continuous policy follows vLLM's: running
//! sequences first (oldest first), then admissions from the waiting queue
//! under `max_num_seqs` and `max_num_batched_tokens`; when blocks run out,
//! the newest running sequence is preempted by recompute.

use crate::kv_cache::{blocks_for, BlockAllocator};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};

pub type SeqId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BatchPolicy {
    /// Admit new sequences at every step (iteration-level batching).
    #[default]
    Continuous,
    /// Fixed batches: admit a batch only when the previous one has finished.
    Static,
}

impl std::str::FromStr for BatchPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "continuous" => Ok(BatchPolicy::Continuous),
            "static" => Ok(BatchPolicy::Static),
            _ => Err(format!("`{s}` is not one of continuous, static")),
        }
    }
}

impl std::fmt::Display for BatchPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BatchPolicy::Continuous => "continuous",
            BatchPolicy::Static => "static",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    pub policy: BatchPolicy,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Split long prompts across steps so decodes keep flowing.
    pub chunked_prefill: bool,
    /// Static batching: before a new batch forms, wait until no request has
    /// arrived for this long (or the batch is full), so requests sent
    /// together land in one batch instead of drifting into the next.
    #[serde(default = "default_batch_wait_ms")]
    pub static_batch_wait_ms: u64,
}

fn default_batch_wait_ms() -> u64 {
    5
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            policy: BatchPolicy::Continuous,
            max_num_seqs: 64,
            max_num_batched_tokens: 2048,
            chunked_prefill: true,
            static_batch_wait_ms: default_batch_wait_ms(),
        }
    }
}

#[derive(Debug, Clone)]
struct SeqEntry {
    /// Tokens the sequence has (prompt + generated).
    len: usize,
    /// Tokens whose K/V are in the cache.
    computed: usize,
    blocks: Vec<u32>,
}

/// One sequence's work in a step: tokens `start..start + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
    /// The chunk reaches the sequence's last token: sample after it.
    pub samples: bool,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    pub work: Vec<Scheduled>,
    pub preempted: Vec<SeqId>,
}

impl Plan {
    pub fn prefill_tokens(&self) -> usize {
        self.work
            .iter()
            .filter(|w| w.len > 1 || !w.samples)
            .map(|w| w.len)
            .sum()
    }
    pub fn num_tokens(&self) -> usize {
        self.work.iter().map(|w| w.len).sum()
    }
}

pub struct Scheduler {
    pub config: SchedulerConfig,
    block_size: usize,
    alloc: BlockAllocator,
    seqs: HashMap<SeqId, SeqEntry>,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    preemptions_total: u64,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, block_size: usize, num_blocks: usize) -> Scheduler {
        Scheduler {
            config,
            block_size,
            alloc: BlockAllocator::new(num_blocks),
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions_total: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.alloc.total()
    }
    pub fn blocks_used(&self) -> usize {
        self.alloc.num_used()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn preemptions_total(&self) -> u64 {
        self.preemptions_total
    }
    /// Static batching is about to form a new batch that is not yet full.
    pub fn forming_static_batch(&self) -> bool {
        self.config.policy == BatchPolicy::Static
            && self.running.is_empty()
            && !self.waiting.is_empty()
            && self.waiting.len() < self.config.max_num_seqs
    }

    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }
    pub fn block_table(&self, id: SeqId) -> &[u32] {
        self.seqs
            .get(&id)
            .map(|s| s.blocks.as_slice())
            .unwrap_or(&[])
    }
    /// Whether a sequence that may grow to `max_len` tokens can ever fit.
    pub fn fits_ever(&self, max_len: usize) -> bool {
        blocks_for(max_len, self.block_size) <= self.alloc.total()
    }

    /// Queues a new sequence of `len` prompt tokens.
    pub fn add(&mut self, id: SeqId, len: usize) {
        self.seqs.insert(
            id,
            SeqEntry {
                len,
                computed: 0,
                blocks: Vec::new(),
            },
        );
        self.waiting.push_back(id);
    }

    /// Removes a sequence (finished or aborted) and frees its blocks at once.
    pub fn remove(&mut self, id: SeqId) {
        if let Some(mut s) = self.seqs.remove(&id) {
            self.alloc.release(&mut s.blocks);
        }
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
    }

    /// After a step: the scheduled tokens are now cached.
    pub fn advance(&mut self, id: SeqId, tokens: usize) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.computed += tokens;
            debug_assert!(s.computed <= s.len);
        }
    }

    /// A sampled token was appended to the sequence.
    pub fn append(&mut self, id: SeqId) {
        if let Some(s) = self.seqs.get_mut(&id) {
            s.len += 1;
        }
    }

    fn chunk_len(&self, need: usize, budget: usize) -> usize {
        // A sequence longer than the whole budget is chunked even with chunked
        // prefill off, or it could never run (e.g. recompute after preemption).
        if self.config.chunked_prefill || need > self.config.max_num_batched_tokens {
            need.min(budget)
        } else if need <= budget {
            need
        } else {
            0
        }
    }

    fn preempt(&mut self, id: SeqId) {
        let s = self.seqs.get_mut(&id).expect("running sequence is known");
        self.alloc.release(&mut s.blocks);
        s.computed = 0;
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        self.preemptions_total += 1;
    }

    pub fn schedule(&mut self) -> Plan {
        let mut plan = Plan::default();
        let mut budget = self.config.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let s = &self.seqs[&id];
            let n = self.chunk_len(s.len - s.computed, budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let need_blocks =
                blocks_for(s.computed + n, self.block_size).saturating_sub(s.blocks.len());
            let mut self_preempted = false;
            while self.alloc.num_free() < need_blocks {
                let victim = *self.running.last().expect("running is not empty");
                self.preempt(victim);
                plan.preempted.push(victim);
                if victim == id {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            let s = self.seqs.get_mut(&id).expect("known");
            s.blocks.extend(
                self.alloc
                    .allocate(need_blocks)
                    .expect("checked free blocks"),
            );
            plan.work.push(Scheduled {
                id,
                start: s.computed,
                len: n,
                samples: s.computed + n == s.len,
            });
            budget -= n;
            i += 1;
        }
        let may_admit = plan.preempted.is_empty()
            && match self.config.policy {
                BatchPolicy::Continuous => true,
                BatchPolicy::Static => self.running.is_empty(),
            };
        if may_admit {
            while let Some(&id) = self.waiting.front() {
                if self.running.len() >= self.config.max_num_seqs || budget == 0 {
                    break;
                }
                let s = &self.seqs[&id];
                let n = self.chunk_len(s.len - s.computed, budget);
                if n == 0 {
                    break;
                }
                let need_blocks = blocks_for(n, self.block_size);
                if self.alloc.num_free() < need_blocks {
                    break;
                }
                self.waiting.pop_front();
                let s = self.seqs.get_mut(&id).expect("known");
                s.blocks = self
                    .alloc
                    .allocate(need_blocks)
                    .expect("checked free blocks");
                plan.work.push(Scheduled {
                    id,
                    start: 0,
                    len: n,
                    samples: n == s.len,
                });
                self.running.push(id);
                budget -= n;
            }
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(policy: BatchPolicy, seqs: usize, tokens: usize, chunked: bool) -> SchedulerConfig {
        SchedulerConfig {
            policy,
            max_num_seqs: seqs,
            max_num_batched_tokens: tokens,
            chunked_prefill: chunked,
            static_batch_wait_ms: 5,
        }
    }

    /// Plays the engine's part: advance scheduled work, append sampled tokens.
    fn run_step(s: &mut Scheduler) -> Plan {
        let plan = s.schedule();
        for w in &plan.work {
            s.advance(w.id, w.len);
            if w.samples {
                s.append(w.id);
            }
        }
        plan
    }

    #[test]
    fn continuous_admits_up_to_max_num_seqs_and_decodes_one_token_each() {
        let mut s = Scheduler::new(cfg(BatchPolicy::Continuous, 2, 100, true), 4, 100);
        for id in 0..3 {
            s.add(id, 5);
        }
        let p = run_step(&mut s);
        assert_eq!(
            p.work.iter().map(|w| (w.id, w.len)).collect::<Vec<_>>(),
            vec![(0, 5), (1, 5)]
        );
        assert_eq!(s.num_running(), 2);
        assert_eq!(s.num_waiting(), 1);
        let p = run_step(&mut s);
        assert_eq!(
            p.work
                .iter()
                .map(|w| (w.id, w.start, w.len))
                .collect::<Vec<_>>(),
            vec![(0, 5, 1), (1, 5, 1)]
        );
        s.remove(0);
        let p = run_step(&mut s);
        assert_eq!(
            p.work.iter().map(|w| (w.id, w.len)).collect::<Vec<_>>(),
            vec![(1, 1), (2, 5)]
        );
    }

    #[test]
    fn chunked_prefill_respects_the_token_budget() {
        let mut s = Scheduler::new(cfg(BatchPolicy::Continuous, 8, 8, true), 4, 100);
        s.add(1, 20);
        let p = run_step(&mut s);
        assert_eq!(
            p.work,
            vec![Scheduled {
                id: 1,
                start: 0,
                len: 8,
                samples: false
            }]
        );
        s.add(2, 3);
        let p = run_step(&mut s);
        assert_eq!(
            p.work,
            vec![Scheduled {
                id: 1,
                start: 8,
                len: 8,
                samples: false
            }]
        );
        let p = run_step(&mut s);
        assert_eq!(
            p.work,
            vec![
                Scheduled {
                    id: 1,
                    start: 16,
                    len: 4,
                    samples: true
                },
                Scheduled {
                    id: 2,
                    start: 0,
                    len: 3,
                    samples: true
                }
            ]
        );
    }

    #[test]
    fn without_chunking_a_prompt_waits_for_a_whole_budget() {
        let mut s = Scheduler::new(cfg(BatchPolicy::Continuous, 8, 10, false), 4, 100);
        s.add(1, 6);
        s.add(2, 6);
        let p = run_step(&mut s);
        assert_eq!(
            p.work.len(),
            1,
            "the second prompt does not fit the remaining 4 tokens"
        );
        let p = run_step(&mut s);
        assert_eq!(
            p.work.iter().map(|w| (w.id, w.len)).collect::<Vec<_>>(),
            vec![(1, 1), (2, 6)]
        );
    }

    #[test]
    fn preempts_the_newest_when_blocks_run_out_and_recomputes_it() {
        // 4 blocks of 4 tokens; two sequences of 7 tokens take 2 blocks each.
        let mut s = Scheduler::new(cfg(BatchPolicy::Continuous, 8, 100, true), 4, 4);
        s.add(1, 7);
        s.add(2, 7);
        run_step(&mut s); // both prefilled, each now 8 tokens (7 computed)
        assert_eq!(s.blocks_used(), 4);
        run_step(&mut s); // token 8 fits in block 2 for both: 8 computed, len 9
        let p = run_step(&mut s); // each needs a third block: the newest (2) is preempted
        assert_eq!(p.preempted, vec![2]);
        assert_eq!(p.work.iter().map(|w| w.id).collect::<Vec<_>>(), vec![1]);
        assert_eq!(s.preemptions_total(), 1);
        assert_eq!(s.num_waiting(), 1);
        assert_eq!(s.block_table(2).len(), 0);
        s.remove(1);
        assert_eq!(s.blocks_used(), 0);
        let p = run_step(&mut s);
        // Recompute: all 9 tokens of sequence 2 as one prefill, then it samples.
        assert_eq!(
            p.work,
            vec![Scheduled {
                id: 2,
                start: 0,
                len: 9,
                samples: true
            }]
        );
    }

    #[test]
    fn a_lone_sequence_never_preempts_another() {
        let mut s = Scheduler::new(cfg(BatchPolicy::Continuous, 8, 100, true), 4, 3);
        s.add(1, 12); // 3 blocks, full
        run_step(&mut s);
        s.add(2, 2);
        let p = run_step(&mut s);
        // 1 needs a 4th block... there is none, and it is the only running
        // sequence: it preempts itself; the waiting one is not admitted.
        assert!(p.preempted.contains(&1));
        assert!(p.work.is_empty());
    }

    #[test]
    fn a_static_batch_is_forming_until_it_is_full_or_running() {
        let mut s = Scheduler::new(cfg(BatchPolicy::Static, 2, 100, true), 4, 100);
        assert!(!s.forming_static_batch(), "nothing waits");
        s.add(0, 3);
        assert!(s.forming_static_batch());
        s.add(1, 3);
        assert!(!s.forming_static_batch(), "full");
        run_step(&mut s);
        s.add(2, 3);
        assert!(!s.forming_static_batch(), "a batch runs");
        let mut c = Scheduler::new(cfg(BatchPolicy::Continuous, 2, 100, true), 4, 100);
        c.add(0, 3);
        assert!(!c.forming_static_batch());
    }

    #[test]
    fn static_batches_wait_for_the_batch_to_drain() {
        let mut s = Scheduler::new(cfg(BatchPolicy::Static, 2, 100, true), 4, 100);
        for id in 0..3 {
            s.add(id, 3);
        }
        let p = run_step(&mut s);
        assert_eq!(p.work.len(), 2);
        s.remove(0);
        let p = run_step(&mut s);
        assert_eq!(
            p.work.iter().map(|w| w.id).collect::<Vec<_>>(),
            vec![1],
            "no admission mid-batch"
        );
        s.remove(1);
        let p = run_step(&mut s);
        assert_eq!(p.work.iter().map(|w| w.id).collect::<Vec<_>>(), vec![2]);
    }

    #[test]
    fn removing_frees_blocks_of_waiting_and_running() {
        let mut s = Scheduler::new(cfg(BatchPolicy::Continuous, 1, 100, true), 4, 10);
        s.add(1, 9);
        s.add(2, 9);
        run_step(&mut s);
        assert_eq!(s.blocks_used(), 3);
        s.remove(2);
        s.remove(1);
        assert_eq!(s.blocks_used(), 0);
        assert!(!s.has_work());
    }
}
