//! What a scenario measured, printed as a table row for people and one JSON
//! line for scripts (`scripts/bench.sh` reads the JSON lines), each with the
//! command line that produced it.

use std::io::{self, Write};

use serde_json::{Map, Value};

use super::stats::{Summary, millis};

/// One row of results: the scenario, its parameters and its figures.
#[derive(Debug, Clone)]
pub struct Report {
    scenario: &'static str,
    fields: Vec<(String, Value)>,
    rate: Option<f64>,
    latency: Option<Summary>,
}

fn round(x: f64, places: i32) -> f64 {
    let scale = 10f64.powi(places);
    (x * scale).round() / scale
}

impl Report {
    /// An empty report of `scenario`.
    pub fn new(scenario: &'static str) -> Report {
        Report {
            scenario,
            fields: Vec::new(),
            rate: None,
            latency: None,
        }
    }

    /// Adds a parameter or figure.
    pub fn field(mut self, key: &str, value: impl Into<Value>) -> Report {
        self.fields.push((key.to_owned(), value.into()));
        self
    }

    /// Adds a throughput; the first one is the row's jobs/s column.
    pub fn rate(mut self, key: &str, per_second: f64) -> Report {
        self.rate.get_or_insert(per_second);
        self.field(key, round(per_second, 1))
    }

    /// Adds `PREFIX_p50_ms`, `_p99_ms`, `_max_ms`, `_mean_ms` (null without
    /// samples); the first one is the row's latency columns.
    pub fn latency(mut self, prefix: &str, summary: Option<Summary>) -> Report {
        if self.latency.is_none() {
            self.latency = summary;
        }
        let ms = |f: fn(&Summary) -> std::time::Duration| {
            summary.map_or(Value::Null, |s| round(millis(f(&s)), 3).into())
        };
        self.field(&format!("{prefix}_p50_ms"), ms(|s| s.p50))
            .field(&format!("{prefix}_p99_ms"), ms(|s| s.p99))
            .field(&format!("{prefix}_max_ms"), ms(|s| s.max))
            .field(&format!("{prefix}_mean_ms"), ms(|s| s.mean))
    }

    /// Adds a figure in MiB from bytes.
    pub fn mib(self, key: &str, bytes: Option<u64>) -> Report {
        let value = bytes.map_or(Value::Null, |b| round(b as f64 / 1048576.0, 1).into());
        self.field(key, value)
    }
}

/// Where reports go: a table with a JSON line under each row, or only the
/// JSON lines.
pub struct Printer<W: Write> {
    out: W,
    json_only: bool,
    header_done: bool,
    /// Fields every report carries: backend, target, command.
    common: Vec<(&'static str, Value)>,
}

impl<W: Write> Printer<W> {
    /// Prints to `out`; every JSON line gets `backend`, `target` and `command`.
    pub fn new(out: W, json_only: bool, backend: &str, target: &str, command: &str) -> Printer<W> {
        Printer {
            out,
            json_only,
            header_done: false,
            common: vec![
                ("backend", backend.into()),
                ("target", target.into()),
                ("command", command.into()),
            ],
        }
    }

    /// Prints a free-text line (only in table mode).
    pub fn comment(&mut self, text: &str) -> io::Result<()> {
        if !self.json_only {
            writeln!(self.out, "# {text}")?;
            self.out.flush()?;
        }
        Ok(())
    }

    /// Prints one report.
    pub fn emit(&mut self, report: &Report) -> io::Result<()> {
        if !self.json_only {
            if !self.header_done {
                writeln!(
                    self.out,
                    "{:<12} {:>10} {:>9} {:>9} {:>9}  details",
                    "scenario", "jobs/s", "p50 ms", "p99 ms", "max ms"
                )?;
                self.header_done = true;
            }
            writeln!(self.out, "{}", table_row(report))?;
        }
        writeln!(self.out, "{}", self.json_line(report))?;
        self.out.flush()
    }

    fn json_line(&self, report: &Report) -> String {
        let mut map = Map::new();
        map.insert("scenario".into(), report.scenario.into());
        for (key, value) in &self.common {
            map.insert((*key).into(), value.clone());
        }
        for (key, value) in &report.fields {
            map.insert(key.clone(), value.clone());
        }
        Value::Object(map).to_string()
    }
}

/// The human row: headline columns, then every field as `key=value`.
fn table_row(report: &Report) -> String {
    let dash = || "-".to_owned();
    let rate = report.rate.map_or_else(dash, |r| format!("{r:.0}"));
    let lat = |f: fn(&Summary) -> std::time::Duration| {
        report
            .latency
            .map_or_else(dash, |s| format!("{:.2}", millis(f(&s))))
    };
    let details: Vec<String> = report
        .fields
        .iter()
        .map(|(k, v)| match v {
            Value::String(s) => format!("{k}={s:?}"),
            other => format!("{k}={other}"),
        })
        .collect();
    format!(
        "{:<12} {rate:>10} {:>9} {:>9} {:>9}  {}",
        report.scenario,
        lat(|s| s.p50),
        lat(|s| s.p99),
        lat(|s| s.max),
        details.join(" ")
    )
}

/// `args` as a shell command line that reproduces the run, with the token
/// and any password in a URL masked ([`crate::report::redacted_url`]).
pub fn command_line(args: &[String]) -> String {
    let mut words = Vec::with_capacity(args.len());
    let mut mask_next = false;
    for arg in args {
        let word = if mask_next {
            mask_next = false;
            "***".to_owned()
        } else if arg == "--token" {
            mask_next = true;
            arg.clone()
        } else if arg.starts_with("--token=") {
            "--token=***".to_owned()
        } else {
            crate::report::redacted_url(arg)
        };
        words.push(shell_quote(&word));
    }
    words.join(" ")
}

fn shell_quote(word: &str) -> String {
    let safe = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@%+".contains(c));
    if safe {
        word.to_owned()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn args(words: &[&str]) -> Vec<String> {
        words.iter().map(|w| (*w).to_owned()).collect()
    }

    #[test]
    fn command_line_masks_secrets_and_quotes() {
        let line = command_line(&args(&[
            "intray",
            "--token",
            "s3cret",
            "bench",
            "--database-url",
            "postgres://bench:pw@127.0.0.1:5432/intray_bench",
            "--note",
            "two words",
            "--token=other",
        ]));
        assert_eq!(
            line,
            "intray --token '***' bench --database-url 'postgres://bench:***@127.0.0.1:5432/intray_bench' \
             --note 'two words' '--token=***'"
        );
        assert!(!line.contains("s3cret") && !line.contains("pw@") && !line.contains("other"));
    }

    #[test]
    fn json_line_and_row_carry_every_field() {
        let summary = crate::bench::stats::summarize(vec![Duration::from_millis(2)]);
        let report = Report::new("submit")
            .field("producers", 16)
            .rate("jobs_per_s", 1234.56)
            .latency("latency", summary);
        let mut out = Vec::new();
        let mut printer = Printer::new(&mut out, false, "sqlite", "spawned", "intray bench");
        printer.emit(&report).expect("write to a vec");
        let text = String::from_utf8(out).expect("utf-8");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "header, row, json: {text}");
        assert!(lines[1].starts_with("submit") && lines[1].contains("1235"));
        let json: Value = serde_json::from_str(lines[2]).expect("json line");
        assert_eq!(json["scenario"], "submit");
        assert_eq!(json["backend"], "sqlite");
        assert_eq!(json["command"], "intray bench");
        assert_eq!(json["producers"], 16);
        assert_eq!(json["jobs_per_s"], 1234.6);
        assert_eq!(json["latency_p99_ms"], 2.0);
    }
}
