//! Text <-> token ids. Built from a GGUF file's metadata (the gpt2-style BPE
//! vocab and merges, with the pre-tokenizer llama.cpp picks for the file's
//! `tokenizer.ggml.pre`), from a `tokenizer.json`, or, for `dummy:` models
//! with no tokenizer given, a byte tokenizer (one id per byte). The engine
//! uses it to run models; the governor to count prompt tokens without a
//! round trip to the server ([`TextTokenizer::from_path`]).

// Without `gguf`, the BPE builders only the GGUF path uses go unused.
#![cfg_attr(not(feature = "gguf"), allow(dead_code, unused_imports))]
#[cfg(feature = "gguf")]
use candle_core::quantized::gguf_file;
use std::path::Path;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// Byte tokenizer ids start after <pad>, <s>, </s>.
const BYTE_OFFSET: u32 = 3;

enum Inner {
    Hf(Box<Tokenizer>),
    Bytes { vocab_size: usize },
}

pub struct TextTokenizer {
    inner: Inner,
    add_bos: bool,
    bos: Option<u32>,
    special: Vec<(u32, String)>,
}

/// A tokenizer that could not be built, or text it could not handle.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct TokenizerError(pub String);

pub type Result<T> = std::result::Result<T, TokenizerError>;

fn tok_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError(e.to_string())
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` value.
fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper> {
    let gpt2 = || PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true));
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        let s = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tok_err)?;
        Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Split(s),
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
        ])))
    };
    Ok(match pre {
        // Digits are split one by one before the GPT-2 regex.
        "smollm" | "starcoder" | "refact" | "codeshell" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                gpt2(),
            ]))
        }
        "llama-bpe" | "llama3" | "smaug-bpe" => split(LLAMA3_SPLIT)?,
        "qwen2" => split(QWEN2_SPLIT)?,
        "gpt2" | "default" | "" => gpt2(),
        other => {
            tracing::warn!(
                "tokenizer.ggml.pre `{other}` is not known; using the GPT-2 pre-tokenizer"
            );
            gpt2()
        }
    })
}

impl TextTokenizer {
    #[cfg(feature = "gguf")]
    pub fn from_gguf(path: &Path, content: &gguf_file::Content) -> Result<TextTokenizer> {
        let md = &content.metadata;
        let err = |m: String| TokenizerError(format!("{}: {m}", path.display()));
        let model = md
            .get("tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if model != "gpt2" {
            return Err(err(format!(
                "tokenizer.ggml.model `{model}` is not supported (gpt2-style BPE is); pass --tokenizer tokenizer.json"
            )));
        }
        let tokens: Vec<String> = md
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.to_vec().ok())
            .ok_or_else(|| err("tokenizer.ggml.tokens is missing".into()))?
            .iter()
            .map(|v| v.to_string().cloned().map_err(|e| err(e.to_string())))
            .collect::<Result<_>>()?;
        let merges: Vec<(String, String)> = md
            .get("tokenizer.ggml.merges")
            .and_then(|v| v.to_vec().ok())
            .ok_or_else(|| err("tokenizer.ggml.merges is missing".into()))?
            .iter()
            .map(|v| {
                let s = v.to_string().map_err(|e| err(e.to_string()))?;
                s.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| err(format!("merge `{s}` has no space")))
            })
            .collect::<Result<_>>()?;
        let types: Vec<i32> = md
            .get("tokenizer.ggml.token_type")
            .and_then(|v| v.to_vec().ok())
            .map(|v| v.iter().map(|t| t.to_i32().unwrap_or(1)).collect())
            .unwrap_or_default();
        let pre = md
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .ignore_merges(pre == "llama-bpe" || pre == "llama3")
            .build()
            .map_err(tok_err)?;
        let mut tk = Tokenizer::new(bpe);
        tk.with_pre_tokenizer(Some(pre_tokenizer_for(&pre)?));
        tk.with_decoder(Some(ByteLevelDecoder::default()));
        // Control (3) and user-defined (4) tokens are matched whole in text,
        // the way llama.cpp parses special tokens in a chat prompt.
        let special: Vec<(u32, String)> = types
            .iter()
            .enumerate()
            .filter(|(_, t)| **t == 3 || **t == 4)
            .map(|(i, _)| (i as u32, tokens[i].clone()))
            .collect();
        let added: Vec<AddedToken> = special
            .iter()
            .map(|(_, s)| AddedToken::from(s.clone(), true))
            .collect();
        tk.add_special_tokens(added).map_err(tok_err)?;
        let add_bos = md
            .get("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        let bos = md
            .get("tokenizer.ggml.bos_token_id")
            .and_then(|v| v.to_u32().ok());
        Ok(TextTokenizer {
            inner: Inner::Hf(Box::new(tk)),
            add_bos,
            bos,
            special,
        })
    }

    /// A `.gguf` file's vocabulary (only its metadata is read) or a
    /// `tokenizer.json`, by the file's extension.
    pub fn from_path(path: &Path) -> Result<TextTokenizer> {
        let gguf = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
        if !gguf {
            return TextTokenizer::from_file(path);
        }
        #[cfg(feature = "gguf")]
        {
            let mut f = std::fs::File::open(path)
                .map_err(|e| TokenizerError(format!("{}: {e}", path.display())))?;
            let content = gguf_file::Content::read(&mut f)
                .map_err(|e| TokenizerError(format!("{}: {e}", path.display())))?;
            TextTokenizer::from_gguf(path, &content)
        }
        #[cfg(not(feature = "gguf"))]
        Err(TokenizerError(format!(
            "{}: this build reads no .gguf files (the `gguf` feature); give a tokenizer.json",
            path.display()
        )))
    }

    /// A `tokenizer.json`; whether BOS is added is up to its post-processor.
    pub fn from_file(path: &Path) -> Result<TextTokenizer> {
        let tk = Tokenizer::from_file(path)
            .map_err(|e| TokenizerError(format!("{}: {e}", path.display())))?;
        let special = tk
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(i, t)| (i, t.content))
            .collect();
        Ok(TextTokenizer {
            inner: Inner::Hf(Box::new(tk)),
            add_bos: false,
            bos: None,
            special,
        })
    }

    /// One id per byte (id = byte + 3), for models without a vocabulary.
    pub fn bytes(vocab_size: usize) -> TextTokenizer {
        TextTokenizer {
            inner: Inner::Bytes { vocab_size },
            add_bos: false,
            bos: Some(1),
            special: vec![(0, "<pad>".into()), (1, "<s>".into()), (2, "</s>".into())],
        }
    }

    pub fn is_byte_fallback(&self) -> bool {
        matches!(self.inner, Inner::Bytes { .. })
    }

    pub fn save(&self, path: &Path) -> Result<()> {
        match &self.inner {
            Inner::Hf(t) => t.save(path, false).map_err(tok_err),
            Inner::Bytes { .. } => Err(TokenizerError(
                "the byte tokenizer has no tokenizer.json".into(),
            )),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        match &self.inner {
            Inner::Hf(t) => ids.extend(t.encode(text, false).map_err(tok_err)?.get_ids()),
            Inner::Bytes { vocab_size } => ids.extend(
                text.bytes()
                    .map(|b| (b as u32 + BYTE_OFFSET).min(*vocab_size as u32 - 1)),
            ),
        }
        Ok(ids)
    }

    /// Text of `ids`; special tokens left out when `skip_special`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        match &self.inner {
            Inner::Hf(t) => t.decode(ids, skip_special).map_err(tok_err),
            Inner::Bytes { .. } => {
                let bytes: Vec<u8> = ids
                    .iter()
                    .filter(|&&i| (BYTE_OFFSET..BYTE_OFFSET + 256).contains(&i))
                    .map(|&i| (i - BYTE_OFFSET) as u8)
                    .collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }

    /// The vocabulary entry of one id, as stored (e.g. `Ġworld`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.inner {
            Inner::Hf(t) => t.id_to_token(id),
            Inner::Bytes { .. } => self.decode(&[id], false).ok(),
        }
    }

    pub fn token_to_id(&self, s: &str) -> Option<u32> {
        match &self.inner {
            Inner::Hf(t) => t.token_to_id(s),
            Inner::Bytes { .. } => self.special.iter().find(|(_, t)| t == s).map(|(i, _)| *i),
        }
    }

    pub fn special_tokens(&self) -> &[(u32, String)] {
        &self.special
    }
}

/// Turns a growing list of ids into text deltas without splitting a
/// multi-byte character across tokens (the prefix/read offset scheme of
/// TGI and vLLM's detokenizer).
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// `ids` holds every output id so far, the newest last. Returns the
    /// new text, if any is complete yet.
    pub fn step(&mut self, tok: &TextTokenizer, ids: &[u32]) -> Result<String> {
        let prefix = tok.decode(&ids[self.prefix_offset..self.read_offset], true)?;
        let full = tok.decode(&ids[self.prefix_offset..], true)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(delta) = full.get(prefix.len()..) {
                self.prefix_offset = self.read_offset;
                self.read_offset = ids.len();
                return Ok(delta.to_string());
            }
        }
        Ok(String::new())
    }

    /// Whatever is still held back (a partial character at the end).
    pub fn flush(&mut self, tok: &TextTokenizer, ids: &[u32]) -> Result<String> {
        let prefix = tok.decode(&ids[self.prefix_offset..self.read_offset], true)?;
        let full = tok.decode(&ids[self.prefix_offset..], true)?;
        self.prefix_offset = ids.len();
        self.read_offset = ids.len();
        Ok(full.get(prefix.len()..).unwrap_or_default().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokenizer_round_trips() {
        let t = TextTokenizer::bytes(512);
        let ids = t.encode("héllo").unwrap();
        assert_eq!(ids.len(), 6);
        assert_eq!(t.decode(&ids, true).unwrap(), "héllo");
        let mut d = IncrementalDecoder::default();
        let mut out = String::new();
        for i in 1..=ids.len() {
            out.push_str(&d.step(&t, &ids[..i]).unwrap());
        }
        out.push_str(&d.flush(&t, &ids).unwrap());
        assert_eq!(out, "héllo");
    }
}
