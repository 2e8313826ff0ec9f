//! `envelope govern`: the flags are the governor crate's
//! [`envelope_governor::GovernArgs`] (its configuration lives there, with
//! its start-up, reload and drain); this picks the front end: the governor
//! over one upstream, or the model tiers' router (`--tiers`,
//! `envelope_router`).

pub use envelope_governor::GovernArgs;

pub fn run(args: GovernArgs) -> anyhow::Result<()> {
    let args = args.with_config()?;
    match args.tiers.clone() {
        Some(tiers) => Ok(envelope_router::run(args, tiers)?),
        None => Ok(envelope_governor::start::run(args)?),
    }
}
