//! `hilore units`.

use clap::Args;
use hilore_runtime::{registered_units, ParamKind};
use std::process::ExitCode;

#[derive(Args)]
pub struct UnitsArgs {
    /// Print a JSON array of objects (`name`, `module`, `file`, `line`, `deterministic`,
    /// `params`, `cost`, `codecs`) instead of a table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: UnitsArgs) -> anyhow::Result<ExitCode> {
    // The models crate registers its units; `check` references the decoder, so the
    // linker keeps them (a test counts them).
    let units = registered_units();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&units)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<10} {:<26} {:<5} {:<28} cost",
        "unit", "module", "det", "inputs"
    );
    for u in &units {
        let inputs: Vec<String> = u
            .params
            .iter()
            .filter(|p| !matches!(p.kind, ParamKind::Module | ParamKind::Context))
            .map(|p| format!("{}: {}", p.name, p.ty.replace(' ', "")))
            .collect();
        println!(
            "{:<10} {:<26} {:<5} {:<28} {}",
            u.name,
            u.module,
            if u.deterministic { "yes" } else { "no" },
            inputs.join(", "),
            u.cost
        );
        println!("{:<10} at {}:{}", "", u.file, u.line);
    }
    println!("{} recovery units", units.len());
    Ok(ExitCode::SUCCESS)
}
