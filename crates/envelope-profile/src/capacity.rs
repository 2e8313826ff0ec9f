//! KV-cache capacity arithmetic, with units in the names.

/// Sequences of `input_tokens + output_tokens` that fit in a paged pool of
/// `num_blocks` blocks of `block_size` tokens (each sequence rounds up to
/// whole blocks).
pub fn max_sequences_in_pool(
    num_blocks: usize,
    block_size: usize,
    input_tokens: usize,
    output_tokens: usize,
) -> usize {
    let per_seq_blocks = (input_tokens + output_tokens).div_ceil(block_size.max(1));
    if per_seq_blocks == 0 {
        return 0;
    }
    num_blocks / per_seq_blocks
}

/// The figure engines log (vLLM's "maximum concurrency", trtllm-bench's
/// formula): floor(KV capacity tokens / (input + output)).
pub fn max_sequences_by_tokens(
    kv_capacity_tokens: usize,
    input_tokens: usize,
    output_tokens: usize,
) -> usize {
    let per_seq = input_tokens + output_tokens;
    if per_seq == 0 {
        return 0;
    }
    kv_capacity_tokens / per_seq
}

/// A feasible maximum reduced by a headroom fraction, never below 1 when
/// anything was feasible: floor(feasible x (1 - headroom)).
pub fn with_headroom(feasible: u32, headroom: f64) -> u32 {
    if feasible == 0 {
        return 0;
    }
    ((feasible as f64 * (1.0 - clamp_headroom(headroom))).floor() as u32).max(1)
}

/// The headroom as applied: within [0, 0.95].
pub fn clamp_headroom(headroom: f64) -> f64 {
    headroom.clamp(0.0, 0.95)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_and_token_formulas_agree_on_whole_blocks() {
        // 100 blocks x 16 tokens, 128 + 128 tokens per sequence = 16 blocks each.
        assert_eq!(max_sequences_in_pool(100, 16, 128, 128), 6);
        assert_eq!(max_sequences_by_tokens(1600, 128, 128), 6);
        // 100 + 30 tokens round up to 9 blocks: block rounding costs capacity.
        assert_eq!(max_sequences_in_pool(100, 16, 100, 30), 11);
        assert_eq!(max_sequences_by_tokens(1600, 100, 30), 12);
        assert_eq!(max_sequences_in_pool(10, 16, 0, 0), 0);
    }

    #[test]
    fn headroom() {
        assert_eq!(with_headroom(10, 0.1), 9);
        assert_eq!(with_headroom(10, 0.25), 7);
        assert_eq!(with_headroom(1, 0.5), 1);
        assert_eq!(with_headroom(0, 0.1), 0);
        assert_eq!(with_headroom(7, 0.0), 7);
    }
}
