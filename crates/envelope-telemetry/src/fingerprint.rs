//! What a measurement was taken on: node (GPUs or host), engine, model,
//! precision. Serialised with a fixed field order, so two profiles can be
//! compared field by field ([`Fingerprint::differences`]).

use crate::gpu::{GpuInfo, Nvml};
use crate::host;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

pub const FINGERPRINT_SCHEMA: u32 = 1;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuFingerprint {
    pub index: u32,
    pub name: Option<String>,
    /// First 16 hex digits of SHA-256 of the GPU UUID (identifies the card without publishing it).
    pub uuid_hash: Option<String>,
    pub memory_total_bytes: Option<u64>,
    pub compute_capability: Option<String>,
    pub power_limit_mw: Option<u32>,
    pub mig_enabled: Option<bool>,
    pub ecc_enabled: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HostFingerprint {
    pub cpu_model: Option<String>,
    pub logical_cores: usize,
    pub mem_total_bytes: Option<u64>,
    pub os: String,
    pub arch: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeFingerprint {
    /// `nvml` when the GPUs were read through NVML, else `host`.
    pub source: crate::Source,
    pub gpus: Vec<GpuFingerprint>,
    pub driver_version: Option<String>,
    pub cuda_version: Option<String>,
    pub nvml_unavailable: Option<String>,
    pub host: HostFingerprint,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineIdentity {
    pub name: String,
    pub version: String,
    /// Launch flags as given, in order.
    pub flags: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum ModelIdentity {
    File {
        name: String,
        size_bytes: u64,
        sha256: String,
    },
    Directory {
        name: String,
        size_bytes: u64,
        sha256: String,
    },
    Dummy {
        preset: String,
        seed: u64,
    },
    /// A model served by another engine, known by its id.
    Served {
        id: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fingerprint {
    pub schema: u32,
    pub node: NodeFingerprint,
    pub engine: EngineIdentity,
    pub model: ModelIdentity,
    pub precision: String,
    pub kv_dtype: String,
}

fn short_hash(s: &str) -> String {
    let d = Sha256::digest(s.as_bytes());
    d.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of a file's bytes, as lowercase hex.
pub fn file_sha256(path: &Path) -> std::io::Result<String> {
    let mut h = Sha256::new();
    hash_file(path, &mut h)?;
    Ok(hex(&h.finalize()))
}

fn hash_file(path: &Path, h: &mut Sha256) -> std::io::Result<u64> {
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            return Ok(n);
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
}

impl ModelIdentity {
    /// From a model argument: `dummy:<preset>[@seed]`, a file or a directory
    /// (hashed over its files in name order).
    pub fn from_spec(spec: &str) -> std::io::Result<ModelIdentity> {
        if let Some(rest) = spec.strip_prefix("dummy:") {
            let (preset, seed) = match rest.split_once('@') {
                Some((p, s)) => (p, s.parse().unwrap_or(0)),
                None => (rest, 0),
            };
            return Ok(ModelIdentity::Dummy {
                preset: preset.to_string(),
                seed,
            });
        }
        let path = Path::new(spec);
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| spec.to_string());
        let mut h = Sha256::new();
        if path.is_dir() {
            let mut files: Vec<_> = std::fs::read_dir(path)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect();
            files.sort();
            let mut size = 0;
            for f in files {
                h.update(
                    f.file_name()
                        .map(|n| n.to_string_lossy().into_owned())
                        .unwrap_or_default()
                        .as_bytes(),
                );
                size += hash_file(&f, &mut h)?;
            }
            Ok(ModelIdentity::Directory {
                name,
                size_bytes: size,
                sha256: hex(&h.finalize()),
            })
        } else {
            let size = hash_file(path, &mut h)?;
            Ok(ModelIdentity::File {
                name,
                size_bytes: size,
                sha256: hex(&h.finalize()),
            })
        }
    }
}

impl NodeFingerprint {
    /// Reads the node: NVML when it loads, the host always.
    pub fn read() -> NodeFingerprint {
        let nvml = Nvml::init();
        let host = host::sample(None);
        let hostfp = HostFingerprint {
            cpu_model: host::cpu_model(),
            logical_cores: host::logical_cores(),
            mem_total_bytes: host.mem_total_bytes,
            os: std::env::consts::OS.to_string(),
            arch: std::env::consts::ARCH.to_string(),
        };
        match nvml {
            Ok(n) => NodeFingerprint {
                source: crate::Source::Nvml,
                gpus: (0..n.device_count())
                    .map(|i| Self::gpu(n.info(i)))
                    .collect(),
                driver_version: n.driver_version(),
                cuda_version: n.cuda_driver_version(),
                nvml_unavailable: None,
                host: hostfp,
            },
            Err(e) => NodeFingerprint {
                source: crate::Source::Host,
                gpus: vec![],
                driver_version: None,
                cuda_version: None,
                nvml_unavailable: Some(e.0),
                host: hostfp,
            },
        }
    }

    fn gpu(i: GpuInfo) -> GpuFingerprint {
        GpuFingerprint {
            index: i.index,
            name: i.name,
            uuid_hash: i.uuid.as_deref().map(short_hash),
            memory_total_bytes: i.memory_total_bytes,
            compute_capability: i.compute_capability,
            power_limit_mw: i.power_limit_mw,
            mig_enabled: i.mig_enabled,
            ecc_enabled: i.ecc_enabled,
        }
    }
}

fn flatten(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, serde_json::Value)>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                flatten(
                    &if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    },
                    x,
                    out,
                )
            }
        }
        serde_json::Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                flatten(&format!("{prefix}[{i}]"), x, out)
            }
            if a.is_empty() {
                out.push((prefix.to_string(), v.clone()))
            }
        }
        _ => out.push((prefix.to_string(), v.clone())),
    }
}

impl Fingerprint {
    /// Fields whose values differ: `(path, ours, theirs)`; a field missing on
    /// one side shows as `null`.
    pub fn differences(
        &self,
        other: &Fingerprint,
    ) -> Vec<(String, serde_json::Value, serde_json::Value)> {
        let (mut a, mut b) = (vec![], vec![]);
        flatten("", &serde_json::to_value(self).unwrap_or_default(), &mut a);
        flatten("", &serde_json::to_value(other).unwrap_or_default(), &mut b);
        let bm: std::collections::BTreeMap<_, _> = b.into_iter().collect();
        let am: std::collections::BTreeMap<_, _> = a.into_iter().collect();
        let keys: std::collections::BTreeSet<&String> = am.keys().chain(bm.keys()).collect();
        keys.into_iter()
            .filter_map(|k| {
                let (x, y) = (
                    am.get(k).cloned().unwrap_or_default(),
                    bm.get(k).cloned().unwrap_or_default(),
                );
                (x != y).then(|| (k.clone(), x, y))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(model: ModelIdentity, precision: &str) -> Fingerprint {
        Fingerprint {
            schema: FINGERPRINT_SCHEMA,
            node: NodeFingerprint::read(),
            engine: EngineIdentity {
                name: "envelope".into(),
                version: "0.1.0".into(),
                flags: vec!["--x".into()],
            },
            model,
            precision: precision.into(),
            kv_dtype: "f32".into(),
        }
    }

    #[test]
    fn model_identity_hashes_files_and_parses_dummy() {
        let dir = std::env::temp_dir().join(format!("envelope-fp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("m.gguf");
        std::fs::write(&f, b"abc").unwrap();
        match ModelIdentity::from_spec(f.to_str().unwrap()).unwrap() {
            ModelIdentity::File {
                name,
                size_bytes,
                sha256,
            } => {
                assert_eq!(name, "m.gguf");
                assert_eq!(size_bytes, 3);
                assert_eq!(
                    sha256,
                    "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            ModelIdentity::from_spec(dir.to_str().unwrap()).unwrap(),
            ModelIdentity::Directory { size_bytes: 3, .. }
        ));
        assert_eq!(
            ModelIdentity::from_spec("dummy:tiny@7").unwrap(),
            ModelIdentity::Dummy {
                preset: "tiny".into(),
                seed: 7
            }
        );
        assert!(ModelIdentity::from_spec("/no/such/file").is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn serialisation_is_stable_and_differences_are_field_by_field() {
        let a = fp(
            ModelIdentity::Dummy {
                preset: "tiny".into(),
                seed: 0,
            },
            "f16",
        );
        let b = fp(
            ModelIdentity::Dummy {
                preset: "tiny".into(),
                seed: 0,
            },
            "q8_0",
        );
        assert_eq!(
            serde_json::to_string(&a).unwrap(),
            serde_json::to_string(&a.clone()).unwrap()
        );
        let back: Fingerprint = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        assert_eq!(back, a);
        let d = a.differences(&b);
        assert_eq!(d.len(), 1, "{d:?}");
        assert_eq!(d[0].0, "precision");
        assert!(a.differences(&a).is_empty());
        let c = fp(
            ModelIdentity::Dummy {
                preset: "tiny".into(),
                seed: 1,
            },
            "f16",
        );
        assert_eq!(a.differences(&c)[0].0, "model.seed");
    }

    #[test]
    fn without_a_driver_the_node_is_read_from_the_host() {
        let n = NodeFingerprint::read();
        assert!(n.host.logical_cores >= 1);
        match n.source {
            crate::Source::Host => {
                assert!(n.gpus.is_empty());
                assert!(n.nvml_unavailable.is_some());
            }
            crate::Source::Nvml => assert!(n.nvml_unavailable.is_none()),
        }
    }
}
