//! `envelope govern`: the flags are the governor crate's
//! [`envelope_governor::GovernArgs`] (its configuration lives there, with
//! its start-up, reload and drain); this only runs it.

pub use envelope_governor::GovernArgs;

pub fn run(args: GovernArgs) -> anyhow::Result<()> {
    Ok(envelope_governor::start::run(args)?)
}
