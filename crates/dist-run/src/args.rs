//! `dist-run`'s command line: options up to the program (or up to `--`), then the program and
//! its arguments, passed on untouched.

use std::ffi::OsString;
use std::time::Duration;

/// The usage text.
pub(crate) const USAGE: &str = "\
usage: dist-run -n N [OPTIONS] [--] PROGRAM [ARGS...]

Starts N ranks of PROGRAM on this machine, each with RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun sets them), every output line
prefixed with its rank ([r3]). SIGINT, SIGTERM and SIGHUP are sent on to every rank. When a rank
fails, the others have the grace period to report their own errors, then are killed; every
rank's exit is printed, and dist-run exits with the first failed rank's status.

options:
  -n, --nproc N         ranks to start (required)
      --master-addr A   rank 0's address (default 127.0.0.1)
      --master-port P   rank 0's port (default: a free one, outside the ephemeral range)
      --grace SECS      after the first failure or signal, how long the others may run before
                        they are killed (default 10)
      --timeout SECS    kill every rank after this long (default: no limit)
      --tolerate K      up to K ranks may die (a signal ends them) without ending the job (an
                        elastic job, whose survivors recover): no grace period starts for them,
                        and the job passes when every other rank exits 0; a rank that exits
                        with a non-zero status still fails the job (default 0)
      --replace N       start up to N replacements for ranks that die within the allowance
                        (which is then at least N): the same command with the same RANK and
                        DIST_JOIN=1, so that it joins the running job (dist-tcp's
                        TcpBackend::join); its lines are prefixed [r3+1] (default 0)
      --hosts H         spread the ranks over H simulated hosts (network namespaces on this
                        machine, in blocks; needs root and iproute2)
      --delay-ms MS     with --hosts: add MS milliseconds to every frame between hosts
      --rate R          with --hosts: cap what each host sends at R (1gbit, 100mbit, 500kbit;
                        tc's token bucket filter on its link; needs tc)
      --label TEXT      put TEXT before the rank in every prefix ([TEXTr3])
  -h, --help            print this text
  -V, --version         print the version

exit status: 0 when every rank exits 0 (but the --tolerate failures); the first failed rank's exit status (128 + its signal
if a signal ended it); 128 + the signal when dist-run was interrupted; 124 after --timeout;
2 for a usage error; 127 when the program cannot be started; 1 for any other launch error.
";

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Args {
    pub(crate) nproc: usize,
    pub(crate) master_addr: Option<String>,
    pub(crate) master_port: Option<u16>,
    pub(crate) grace: Duration,
    pub(crate) timeout: Option<Duration>,
    pub(crate) tolerate: usize,
    pub(crate) replace: usize,
    pub(crate) hosts: Option<usize>,
    pub(crate) delay: Option<Duration>,
    pub(crate) rate: Option<dist_run::rate::Rate>,
    pub(crate) label: String,
    pub(crate) program: OsString,
    pub(crate) args: Vec<OsString>,
}

/// What the command line asks for instead of a launch.
#[derive(Debug, PartialEq)]
pub(crate) enum Parsed {
    Run(Box<Args>),
    Help,
    Version,
}

fn seconds(opt: &str, v: &str) -> Result<Duration, String> {
    v.parse::<f64>()
        .ok()
        .filter(|s| s.is_finite() && *s >= 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| format!("{opt}: {v:?} is not a number of seconds"))
}

fn number<T: std::str::FromStr>(opt: &str, v: &str, what: &str) -> Result<T, String> {
    v.parse().map_err(|_| format!("{opt}: {v:?} is not {what}"))
}

/// Parses the arguments after the program's name.
pub(crate) fn parse(args: impl IntoIterator<Item = OsString>) -> Result<Parsed, String> {
    let mut it = args.into_iter();
    let mut nproc = None;
    let mut a = Args {
        nproc: 0,
        master_addr: None,
        master_port: None,
        grace: Duration::from_secs(10),
        timeout: None,
        tolerate: 0,
        replace: 0,
        hosts: None,
        delay: None,
        rate: None,
        label: String::new(),
        program: OsString::new(),
        args: Vec::new(),
    };
    let program = loop {
        let Some(arg) = it.next() else {
            return Err("no program given".into());
        };
        if arg == "--" {
            break it.next().ok_or("no program after --")?;
        }
        let Some(text) = arg.to_str().filter(|t| t.starts_with('-') && *t != "-") else {
            break arg;
        };
        // `--opt=value`, `--opt value`, `-nN` and `-n N`.
        let (opt, inline) = match text.split_once('=') {
            Some((o, v)) if o.starts_with("--") => (o.to_string(), Some(v.to_string())),
            _ if text.starts_with("-n") && text.len() > 2 && !text.starts_with("--") => {
                ("-n".to_string(), Some(text[2..].to_string()))
            }
            _ => (text.to_string(), None),
        };
        match opt.as_str() {
            "-h" | "--help" => return Ok(Parsed::Help),
            "-V" | "--version" => return Ok(Parsed::Version),
            "-n" | "--nproc" | "--master-addr" | "--master-port" | "--grace" | "--timeout"
            | "--tolerate" | "--replace" | "--hosts" | "--delay-ms" | "--rate" | "--label" => {}
            _ => return Err(format!("unknown option {opt}")),
        }
        let value = match inline {
            Some(v) => v,
            None => it
                .next()
                .ok_or_else(|| format!("{opt} needs a value"))?
                .into_string()
                .map_err(|v| format!("{opt}: {v:?} is not UTF-8"))?,
        };
        match opt.as_str() {
            "-n" | "--nproc" => nproc = Some(number(&opt, &value, "a number of ranks")?),
            "--master-addr" => a.master_addr = Some(value),
            "--master-port" => a.master_port = Some(number(&opt, &value, "a port number")?),
            "--grace" => a.grace = seconds(&opt, &value)?,
            "--timeout" => a.timeout = Some(seconds(&opt, &value)?),
            "--tolerate" => a.tolerate = number(&opt, &value, "a number of ranks")?,
            "--replace" => a.replace = number(&opt, &value, "a number of replacements")?,
            "--hosts" => a.hosts = Some(number(&opt, &value, "a number of hosts")?),
            "--delay-ms" => {
                a.delay = Some(seconds(&opt, &value)? / 1000);
            }
            "--rate" => a.rate = Some(value.parse().map_err(|e| format!("{opt}: {e}"))?),
            "--label" => a.label = value,
            other => return Err(format!("unknown option {other}")),
        }
    };
    a.nproc = match nproc {
        Some(0) => return Err("-n: at least one rank".into()),
        Some(n) => n,
        None => return Err("-n N is required (the number of ranks)".into()),
    };
    if a.delay.is_some() && a.hosts.is_none() {
        return Err("--delay-ms needs --hosts".into());
    }
    if a.tolerate >= a.nproc {
        return Err(format!(
            "--tolerate {}: fewer than the {} ranks (one must survive)",
            a.tolerate, a.nproc
        ));
    }
    if a.rate.is_some() && a.hosts.is_none() {
        return Err("--rate needs --hosts".into());
    }
    if a.hosts.is_some() && a.master_addr.is_some() {
        return Err(
            "--master-addr and --hosts: on simulated hosts, rank 0 is at host 0's address".into(),
        );
    }
    a.program = program;
    a.args = it.collect();
    Ok(Parsed::Run(Box::new(a)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(args: &[&str]) -> Result<Parsed, String> {
        parse(args.iter().map(OsString::from))
    }

    fn run(args: &[&str]) -> Args {
        match p(args) {
            Ok(Parsed::Run(a)) => *a,
            other => panic!("{args:?}: {other:?}"),
        }
    }

    #[test]
    fn options_stop_at_the_program_or_at_double_dash() {
        let a = run(&["-n", "4", "prog", "-n", "9", "--grace", "x"]);
        assert_eq!((a.nproc, a.program.to_str()), (4, Some("prog")));
        assert_eq!(a.args, ["-n", "9", "--grace", "x"]);
        let a = run(&["-n4", "--grace=2.5", "--timeout", "60", "--", "-weird", "a"]);
        assert_eq!(a.nproc, 4);
        assert_eq!(a.grace, Duration::from_millis(2500));
        assert_eq!(a.timeout, Some(Duration::from_secs(60)));
        assert_eq!(a.tolerate, 0);
        assert_eq!(run(&["-n", "4", "--tolerate", "1", "p"]).tolerate, 1);
        assert_eq!(a.replace, 0);
        assert_eq!(run(&["-n", "4", "--replace", "2", "p"]).replace, 2);
        assert_eq!((a.program.to_str(), a.args.len()), (Some("-weird"), 1));
        let a = run(&[
            "--nproc=2",
            "--hosts",
            "2",
            "--delay-ms",
            "20",
            "--label",
            "x ",
            "p",
        ]);
        assert_eq!(
            (a.hosts, a.delay),
            (Some(2), Some(Duration::from_millis(20)))
        );
        assert_eq!(a.label, "x ");
        assert_eq!(a.rate, None);
        let a = run(&["-n", "4", "--hosts=2", "--rate", "1gbit", "p"]);
        assert_eq!(a.rate.map(|r| r.bits_per_second()), Some(1_000_000_000));
        assert_eq!(a.delay, None);
        let a = run(&[
            "-n4",
            "--hosts",
            "4",
            "--rate=100mbit",
            "--delay-ms",
            "0.1",
            "p",
        ]);
        assert_eq!(a.rate.map(|r| r.bits_per_second()), Some(100_000_000));
        assert_eq!(a.delay, Some(Duration::from_micros(100)));
        let a = run(&[
            "-n",
            "1",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "29600",
            "p",
        ]);
        assert_eq!(
            (a.master_addr.as_deref(), a.master_port),
            (Some("10.0.0.1"), Some(29600))
        );
    }

    #[test]
    fn bad_command_lines_say_what_is_wrong() {
        for (args, says) in [
            (&["prog"][..], "-n N is required"),
            (&["-n", "0", "p"], "at least one rank"),
            (&["-n", "two", "p"], "not a number of ranks"),
            (&["-n", "2"], "no program"),
            (&["-n", "2", "--"], "no program after --"),
            (&["-n"], "needs a value"),
            (&["-n", "2", "--bogus", "1", "p"], "unknown option --bogus"),
            (&["--bogus"], "unknown option --bogus"),
            (
                &["-n", "2", "--master-port", "70000", "p"],
                "not a port number",
            ),
            (
                &["-n", "2", "--grace", "-1", "p"],
                "not a number of seconds",
            ),
            (&["-n", "2", "--delay-ms", "5", "p"], "needs --hosts"),
            (&["-n", "2", "--tolerate", "2", "p"], "one must survive"),
            (
                &["-n", "2", "--replace", "x", "p"],
                "not a number of replacements",
            ),
            (
                &["-n", "2", "--tolerate", "x", "p"],
                "not a number of ranks",
            ),
            (&["-n", "2", "--rate", "1gbit", "p"], "--rate needs --hosts"),
            (
                &["-n", "2", "--hosts", "2", "--rate", "1gbps", "p"],
                "--rate: \"1gbps\" is not a rate",
            ),
            (
                &["-n", "2", "--hosts", "2", "--rate"],
                "--rate needs a value",
            ),
        ] {
            let e = p(args).unwrap_err();
            assert!(e.contains(says), "{args:?}: {e}");
        }
        assert_eq!(p(&["-h"]), Ok(Parsed::Help));
        assert_eq!(p(&["-n", "2", "--version"]), Ok(Parsed::Version));
    }
}
