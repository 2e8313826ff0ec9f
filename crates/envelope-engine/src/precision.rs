//! Weight precision and KV-cache dtype, the two load options a sweep varies.

use crate::error::{EngineError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The precision weights are held in after load.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Keep each tensor in the format the file stores it (GGUF quantised
    /// blocks stay quantised). Dummy weights are stored as bf16.
    #[default]
    AsStored,
    F32,
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    /// e4m3 layer matrices with a per-tensor scale, multiplied as fp8 (W8A8
    /// with dynamic per-tensor activation scales) on CUDA with compute
    /// capability 8.9 or newer; embedding and LM head stay bf16. On the CPU
    /// the same arithmetic is emulated (for quality gating, not speed).
    Fp8,
}

impl Precision {
    pub const ALL: [Precision; 7] = [
        Precision::AsStored,
        Precision::F32,
        Precision::F16,
        Precision::Bf16,
        Precision::Q8_0,
        Precision::Q4_0,
        Precision::Fp8,
    ];

    pub fn as_str(&self) -> &'static str {
        match self {
            Precision::AsStored => "as-stored",
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
            Precision::Q8_0 => "q8_0",
            Precision::Q4_0 => "q4_0",
            Precision::Fp8 => "fp8",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Precision {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self> {
        Precision::ALL
            .into_iter()
            .find(|p| {
                p.as_str() == s.to_ascii_lowercase()
                    || (s == "as_stored" && *p == Precision::AsStored)
            })
            .ok_or_else(|| EngineError::InvalidSetting {
                field: "precision",
                message: format!("`{s}` is not one of as-stored, f32, f16, bf16, q8_0, q4_0, fp8"),
            })
    }
}

/// Element type of the paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    #[default]
    F32,
    F16,
    Bf16,
}

impl KvDtype {
    pub fn elem_bytes(&self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }
    pub fn as_str(&self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for KvDtype {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            "bf16" => Ok(KvDtype::Bf16),
            _ => Err(EngineError::InvalidSetting {
                field: "kv_dtype",
                message: format!("`{s}` is not one of f32, f16, bf16"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn parse_round_trips() {
        for p in Precision::ALL {
            assert_eq!(p.as_str().parse::<Precision>().unwrap(), p);
        }
        assert!("q5_k".parse::<Precision>().is_err());
        assert_eq!("BF16".parse::<KvDtype>().unwrap(), KvDtype::Bf16);
        assert!("int8".parse::<KvDtype>().is_err());
    }
}
