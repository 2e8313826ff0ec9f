//! Before an http or launch target is swept, [`check_server`] sends it one
//! request alone to learn whether it honours what the load relies on
//! (`ignore_eos`, prompts as token ids); the sweep then measures what the
//! server does and the profile says so ([`ServerChecks`]).

use crate::driver::{HttpDriver, PromptFormat};
use crate::record::{Driver, LoadRequest, RequestRecord};
use crate::truth::judge;
use envelope_profile::ServerChecks;
use std::time::Instant;

/// Prompt and output of the check request.
const CHECK_PROMPT: usize = 16;
const CHECK_OUTPUT: u32 = 24;

/// Sends one request alone to `driver`'s server: prompts as token ids (text
/// where the server refuses those, switching the driver to text), output
/// with `ignore_eos` (where the server stops early anyway, the driver stops
/// demanding the exact length). An error (wrong model name, bad URL, a
/// server that answers nothing whole) is a setup error, returned as is.
pub fn check_server(driver: &mut HttpDriver) -> Result<ServerChecks, String> {
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
    if token_prompts
        && rec
            .error
            .as_deref()
            .is_some_and(|e| e.starts_with("http_4"))
    {
        let refused = rec.error.clone().unwrap_or_default();
        driver.set_prompt_format(PromptFormat::Text);
        rec = send(driver, &req);
        if rec.error.is_none() {
            token_prompts = false;
            notes.push(format!(
                "prompts as token ids were refused ({refused}); sent as text, lengths approximate"
            ));
        } else {
            driver.set_prompt_format(PromptFormat::Tokens);
            return Err(refused);
        }
    }
    if let Some(e) = rec.error {
        return Err(e);
    }
    if token_prompts && rec.input_tokens != 0 && rec.input_tokens.abs_diff(CHECK_PROMPT as u32) > 1
    {
        notes.push(format!(
            "a prompt of {CHECK_PROMPT} token ids was counted as {} by the server",
            rec.input_tokens
        ));
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
    Ok(ServerChecks {
        ignore_eos,
        token_prompts,
        notes,
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
