//! `dist-run -n N [OPTIONS] [--] PROGRAM [ARGS...]`: N local ranks of any program, with the
//! torchrun environment, rank-prefixed output, forwarded signals and every rank's exit reported
//! (see `dist-run --help` and the library's docs).

use std::process::ExitCode;

use dist_run::{Error, Hosts, Launch, Link, hosts};

mod args;

use args::{Args, Parsed, USAGE};

fn main() -> ExitCode {
    let a = match args::parse(std::env::args_os().skip(1)) {
        Ok(Parsed::Run(a)) => *a,
        Ok(Parsed::Help) => {
            print!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Parsed::Version) => {
            println!("dist-run {}", env!("CARGO_PKG_VERSION"));
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("dist-run: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let code = launch(&a);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

/// Runs the launch the arguments describe; the exit status.
fn launch(a: &Args) -> i32 {
    let simulated: Option<Hosts> = match a.hosts {
        None => None,
        Some(count) => {
            let link = Link {
                delay: a.delay,
                rate: a.rate,
            };
            match Hosts::with_link(count, link) {
                Ok(h) => Some(h),
                Err(e) => {
                    let why = hosts::unavailable().unwrap_or(e);
                    eprintln!("dist-run: cannot make {count} simulated hosts: {why}");
                    return 1;
                }
            }
        }
    };
    let mut launch = Launch::new(&a.program, a.nproc);
    launch.args = a.args.clone();
    launch.master_addr = a.master_addr.clone();
    launch.master_port = a.master_port;
    launch.grace = a.grace;
    launch.timeout = a.timeout;
    launch.tolerate = a.tolerate;
    launch.replace = a.replace;
    launch.label = a.label.clone();
    let code = match dist_run::run(&launch, simulated.as_ref()) {
        Ok(report) => {
            for line in report.describe() {
                eprintln!("dist-run: {line}");
            }
            if report.passed() {
                for &r in &report.tolerated {
                    let e = &report.ranks[r];
                    let how = e
                        .status
                        .map_or("could not be waited for".into(), |s| s.to_string());
                    let who = report.who(r);
                    eprintln!(
                        "dist-run: {who} died ({how}), within --tolerate {}",
                        a.tolerate.max(a.replace)
                    );
                }
                for (k, of) in report.replaced.iter().enumerate() {
                    eprintln!("dist-run: replacement {} started for rank {of}", k + 1);
                }
            }
            report.exit_code()
        }
        Err(e) => {
            eprintln!("dist-run: {e}");
            match e {
                Error::Spawn { .. } => 127,
                _ => 1,
            }
        }
    };
    // Deletes the simulated hosts (and, if a signal came, exits with 128 + its number).
    drop(simulated);
    code
}
