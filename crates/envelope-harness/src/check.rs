//! Before an http or launch target is swept, [`check_server`] sends it one
//! request alone to learn whether it honours what the load relies on
//! (`ignore_eos`, prompts as token ids); the sweep then measures what the
//! server does and the profile says so ([`ServerChecks`]).

use crate::driver::{HttpDriver, PromptFormat};
use crate::record::{Driver, LoadRequest, RequestRecord};
use crate::truth::judge;
use envelope_profile::{ServerChecks, TokenizerFile};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Prompt and output of the check request.
const CHECK_PROMPT: usize = 16;
const CHECK_OUTPUT: u32 = 24;

/// Sends one request alone to `driver`'s server: prompts as token ids (text
/// where the server refuses those, switching the driver to text), output
/// with `ignore_eos` (where the server stops early anyway, the driver stops
/// demanding the exact length). An error (wrong model name, bad URL, a
/// server that answers nothing whole) is a setup error, returned as is.
pub fn check_server(
    driver: &mut HttpDriver,
    tokenizer: Option<&Path>,
) -> Result<ServerChecks, String> {
    let vocab = driver.vocab_size().max(CHECK_PROMPT + 2) as u32;
    let req = LoadRequest {
        prompt_tokens: (0..CHECK_PROMPT as u32)
            .map(|i| 1 + (i * 97) % (vocab - 1))
            .collect(),
        prompt_text: None,
        output_tokens: CHECK_OUTPUT,
    };
    let mut notes = vec![];
    let mut token_prompts = driver.prompt_format() == PromptFormat::Tokens;
    let mut rec = send(driver, &req);
    if token_prompts {
        if let Some(refused) = token_ids_refused(&rec) {
            driver.set_prompt_format(PromptFormat::Text);
            let as_text = send(driver, &req);
            if as_text.error.is_none() {
                token_prompts = false;
                rec = as_text;
                notes.push(format!(
                    "prompts as token ids were refused ({refused}); sent as text, lengths approximate"
                ));
            } else if rec.error.is_some() {
                // Neither form is answered: the server's fault, not the ids'.
                driver.set_prompt_format(PromptFormat::Tokens);
                return Err(format!(
                    "{refused}; as text: {}",
                    as_text.error.unwrap_or_default()
                ));
            } else {
                // Ids were answered (with a count that disagrees); text was not.
                driver.set_prompt_format(PromptFormat::Tokens);
                notes.push(format!(
                    "{refused}; text prompts failed too, so ids are kept"
                ));
            }
        }
    }
    if let Some(e) = rec.error {
        return Err(e);
    }
    let finish = rec.finish_reason.clone().unwrap_or_default();
    let ignore_eos = !(finish == "stop" && rec.output_tokens < CHECK_OUTPUT);
    if !ignore_eos {
        notes.push(format!(
            "ignore_eos is not honoured: asked {CHECK_OUTPUT} tokens, the server stopped after {}; answers that stop by themselves count as complete and outputs are the server's lengths",
            rec.output_tokens
        ));
        driver.set_exact_output(false);
    }
    if let Some(e) = judge(CHECK_OUTPUT, &rec, ignore_eos) {
        return Err(format!(
            "the server's answer to one request alone is incomplete: {e}"
        ));
    }
    let served_models = served_models(driver);
    let text_bytes_per_token = match driver.count_prompt(ENGLISH) {
        Ok(n) if n > 0 => Some(ENGLISH.len() as f64 / n as f64),
        Ok(_) => None,
        Err(e) => {
            notes.push(format!(
                "the server did not count an English prompt ({e}); a governor without a tokenizer starts from its bound"
            ));
            None
        }
    };
    let tokenizer = match tokenizer_file(driver, tokenizer, &served_models) {
        Ok(t) => t,
        Err(e) => {
            notes.push(e);
            None
        }
    };
    // Once here, so the log and the report say it; the monitor then asks
    // at most every 30 s.
    if driver.metrics().is_none() {
        notes.extend(driver.metrics_absent());
    }
    let governed = rec.governed;
    if governed {
        notes.push("the target is governed (envelope govern): a 429 with Retry-After is a refusal, counted apart from failures; the safe point is the highest load whose admitted requests meet the SLOs with at most slo.max_shed_rate refused".into());
    }
    Ok(ServerChecks {
        ignore_eos,
        token_prompts,
        notes,
        governed,
        served_models,
        text_bytes_per_token,
        tokenizer,
    })
}

/// A passage of ordinary English (about 600 bytes) whose token count, as
/// the server reports it, gives the bytes per token a governor's estimate
/// starts from.
const ENGLISH: &str = "The river runs past the old mill and under the stone bridge, where \
children stop on their way home from school to watch the water. In spring the \
fields on both banks turn green, and farmers bring their horses down to drink. \
A small road follows the river to the next town, which has a market on \
Saturdays, a library, two bakeries and a station with trains to the city. \
Most people who live here have done so for many years; they know each other by \
name and meet in the square in the evening. Visitors come in summer to walk in \
the hills, to swim in the lake and to eat fresh bread with cheese and apples.";

/// The ids the server's `/v1/models` lists.
fn served_models(driver: &HttpDriver) -> Vec<String> {
    driver
        .get_json("/v1/models")
        .and_then(|v| {
            v.get("data").and_then(|d| d.as_array()).map(|a| {
                a.iter()
                    .filter_map(|m| m.get("id").and_then(|i| i.as_str()).map(str::to_string))
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// The tokenizer file: `configured`, else the model file the server
/// reports where that file is readable here: llama.cpp's `/props`
/// (`model_path`), or a `.gguf` path that `/v1/models` lists as an id (as
/// llama.cpp's servers and llama-cpp-python's do without an alias); with
/// its SHA-256.
fn tokenizer_file(
    driver: &HttpDriver,
    configured: Option<&Path>,
    served: &[String],
) -> Result<Option<TokenizerFile>, String> {
    let path = match configured {
        Some(p) => p.to_path_buf(),
        None => {
            let props = driver
                .get_json("/props")
                .and_then(|v| v.get("model_path")?.as_str().map(PathBuf::from));
            let listed = served.iter().map(PathBuf::from).filter(|p| {
                p.extension().is_some_and(|e| e == "gguf") || p.ends_with("tokenizer.json")
            });
            match props.into_iter().chain(listed).find(|p| p.is_file()) {
                Some(p) => p,
                None => return Ok(None),
            }
        }
    };
    let full = path
        .canonicalize()
        .map_err(|e| format!("target.tokenizer {}: {e}", path.display()))?;
    let sha256 = envelope_telemetry::fingerprint::file_sha256(&full)
        .map_err(|e| format!("target.tokenizer {}: {e}", full.display()))?;
    Ok(Some(TokenizerFile {
        path: full.display().to_string(),
        sha256,
    }))
}

/// Whether the answer to a prompt of [`CHECK_PROMPT`] token ids says the
/// server does not take token ids, and how: any 4xx or 5xx (a server that
/// validates `prompt` as text may answer 500; whether text is answered
/// instead decides), or a usage count that disagrees with the ids sent by
/// more than the special tokens a server may add.
fn token_ids_refused(rec: &RequestRecord) -> Option<String> {
    if let Some(e) = &rec.error {
        let reason = crate::truth::reason_of(e);
        return (reason.starts_with("http_4") || reason.starts_with("http_5")).then(|| e.clone());
    }
    let counted = rec.input_tokens;
    (counted != 0 && counted.abs_diff(CHECK_PROMPT as u32) > 2).then(|| {
        format!("a prompt of {CHECK_PROMPT} token ids was counted as {counted} by the server")
    })
}

fn send(driver: &HttpDriver, req: &LoadRequest) -> RequestRecord {
    let mut rec = RequestRecord {
        input_tokens: req.prompt_tokens.len() as u32,
        ..Default::default()
    };
    driver.send(req, Instant::now(), &mut rec);
    rec
}
