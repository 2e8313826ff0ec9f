//! A request shape of the sweep, cold or warm.

/// One request shape of the sweep: `INPUTxOUTPUT`, cold, or
/// `INPUTxOUTPUT@P%`, warm: the first P% of every prompt is a prefix the
/// probe's requests share (sent once before the probe, so that a server
/// with a prefix cache holds it), the rest is the request's own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Bucket {
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Percent of the prompt that is the shared prefix; 0: cold.
    pub cached_percent: u8,
}

/// The most of a warm bucket's prompt that may be shared: every request
/// keeps some tokens of its own, so that no two are the same prompt.
pub const MAX_CACHED_PERCENT: u8 = 95;

impl Bucket {
    pub fn cold(input_tokens: u32, output_tokens: u32) -> Bucket {
        Bucket {
            input_tokens,
            output_tokens,
            cached_percent: 0,
        }
    }

    /// Prompt tokens of the shared prefix (0 for a cold bucket).
    pub fn prefix_tokens(&self) -> u32 {
        (u64::from(self.input_tokens) * u64::from(self.cached_percent) / 100) as u32
    }

    /// The share of the prompt meant to be cached, `None` for a cold bucket.
    pub fn cached_share(&self) -> Option<f64> {
        (self.cached_percent > 0).then(|| f64::from(self.cached_percent) / 100.0)
    }

    /// `1024x32`, or `1024x32@85%` for a warm bucket: its name in
    /// progress lines, CSVs and reports.
    pub fn label(&self) -> String {
        match self.cached_percent {
            0 => format!("{}x{}", self.input_tokens, self.output_tokens),
            p => format!("{}x{}@{p}%", self.input_tokens, self.output_tokens),
        }
    }

    /// Reads `INPUTxOUTPUT` or `INPUTxOUTPUT@P%`.
    pub fn parse(text: &str) -> Result<Bucket, String> {
        let (shape, warm) = match text.split_once('@') {
            Some((shape, warm)) => (shape, Some(warm.trim())),
            None => (text, None),
        };
        let (i, o) = shape
            .split_once('x')
            .ok_or_else(|| format!("`{text}` is not INPUTxOUTPUT or INPUTxOUTPUT@P%"))?;
        let (i, o) = match (i.trim().parse::<u32>(), o.trim().parse::<u32>()) {
            (Ok(i), Ok(o)) if i > 0 && o > 0 => (i, o),
            _ => return Err(format!("`{text}` needs two positive token counts")),
        };
        let cached_percent = match warm {
            None => 0,
            Some(w) => match w.strip_suffix('%').map(|p| p.trim().parse::<u8>()) {
                Some(Ok(p)) if (1..=MAX_CACHED_PERCENT).contains(&p) => p,
                _ => {
                    return Err(format!(
                        "`{text}`: the cached share after `@` must be a whole percent from 1% to {MAX_CACHED_PERCENT}%"
                    ))
                }
            },
        };
        let b = Bucket {
            input_tokens: i,
            output_tokens: o,
            cached_percent,
        };
        if cached_percent > 0 && b.prefix_tokens() == 0 {
            return Err(format!(
                "`{text}`: {cached_percent}% of {i} tokens is no token"
            ));
        }
        Ok(b)
    }
}
