//! Chat templates (Jinja, as shipped in GGUF metadata or
//! `tokenizer_config.json`) rendered with minijinja and its Python-compat
//! methods, so templates written for transformers work unchanged.

use crate::error::{EngineError, Result};
use minijinja::{context, Environment, ErrorKind};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// ChatML, used when a model ships no template.
pub const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

pub struct ChatTemplate {
    env: Environment<'static>,
    pub bos_token: String,
    pub eos_token: String,
    pub source: String,
}

impl ChatTemplate {
    pub fn new(template: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_template_owned("chat", template.to_string())
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            source: template.to_string(),
        })
    }

    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| EngineError::ChatTemplate(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders() {
        let t = ChatTemplate::new(CHATML, "<s>", "</s>").unwrap();
        let s = t
            .render(
                &[ChatMessage {
                    role: "user".into(),
                    content: "Hi".into(),
                }],
                true,
            )
            .unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn python_methods_and_exceptions_work() {
        let t = ChatTemplate::new(
            "{% if messages[0]['role'] == 'bad' %}{{ raise_exception('no') }}{% endif %}{{ messages[0]['content'].strip() }}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            t.render(
                &[ChatMessage {
                    role: "user".into(),
                    content: "  x ".into()
                }],
                false
            )
            .unwrap(),
            "x"
        );
        assert!(t
            .render(
                &[ChatMessage {
                    role: "bad".into(),
                    content: "".into()
                }],
                false
            )
            .is_err());
    }
}
