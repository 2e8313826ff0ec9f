//! What a sweep runs against, as its profile states it: the device the
//! engine target runs on (`target.device`, `auto` decided here) and the
//! fingerprint of the node, the engine and the model.

use crate::config::{BenchConfig, ConfigError, Target};
use envelope_telemetry::{EngineIdentity, Fingerprint, ModelIdentity, NodeFingerprint};

/// Decides `target.device` (the engine target only) into the placement
/// the harness gets: `auto` becomes the GPU when one is usable for every
/// point's precision, else the CPU.
pub fn resolve_device(cfg: &mut BenchConfig, file: &str) -> Result<(), ConfigError> {
    let err = |message: String| ConfigError {
        file: file.to_string(),
        message,
    };
    let Some(d) = cfg.device.clone() else {
        return Ok(());
    };
    if !matches!(cfg.target, Target::Engine) {
        return Err(err("target.device applies to the engine target only".into()));
    }
    let setting: envelope_engine::device::DeviceSetting =
        d.parse().map_err(|e| err(format!("target.device: {e}")))?;
    let needs: Vec<_> = cfg
        .points
        .iter()
        .filter_map(|p| p.engine.as_ref())
        .map(|e| (e.precision, Some(e.kv_dtype)))
        .collect();
    let placement = envelope_engine::device::resolve(setting, &needs)
        .map_err(|e| err(format!("target.device {d}: {e}")))?;
    cfg.device = Some(placement.to_string());
    Ok(())
}

/// The profile's fingerprint: this node, the engine (ours with `flags`,
/// the server's base URL, or the launch command's program) and the model
/// (a file or dummy preset hashed; a name another server serves kept as
/// its id).
pub fn fingerprint(
    cfg: &BenchConfig,
    file: &str,
    flags: Vec<String>,
) -> Result<Fingerprint, ConfigError> {
    let model = match &cfg.target {
        Target::Http { .. } => ModelIdentity::Served {
            id: cfg.model.clone(),
        },
        Target::Engine => ModelIdentity::from_spec(&cfg.model).map_err(|e| ConfigError {
            file: file.to_string(),
            message: format!("target.model {}: {e}", cfg.model),
        })?,
        Target::Launch { .. } => {
            ModelIdentity::from_spec(&cfg.model).unwrap_or_else(|_| ModelIdentity::Served {
                id: cfg.model.clone(),
            })
        }
    };
    let engine = match &cfg.target {
        Target::Engine => EngineIdentity {
            name: "envelope".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            flags,
        },
        Target::Http { base_url } => EngineIdentity {
            name: "http".into(),
            version: String::new(),
            flags: vec![base_url.clone()],
        },
        Target::Launch { command, .. } => EngineIdentity {
            name: command
                .split_whitespace()
                .next()
                .unwrap_or("launch")
                .rsplit('/')
                .next()
                .unwrap_or("launch")
                .to_string(),
            version: String::new(),
            flags: vec![command.clone()],
        },
    };
    let joined = |f: &dyn Fn(&crate::config::MatrixPoint) -> String| {
        cfg.points.iter().map(f).collect::<Vec<_>>().join(",")
    };
    Ok(Fingerprint {
        schema: envelope_telemetry::fingerprint::FINGERPRINT_SCHEMA,
        node: NodeFingerprint::read(),
        engine,
        model,
        precision: joined(&|p| p.precision.to_string()),
        kv_dtype: joined(&|p| p.kv_dtype.to_string()),
    })
}
