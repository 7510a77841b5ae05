//! Query strings: the filters of `GET /api/v1/jobs` and the queue of
//! `GET /api/v1/stats`. Unknown parameters are refused, so that a typo does
//! not silently widen a filter, and so is a second value for a parameter
//! that takes one (`queue=a&queue=`, an empty last value, would list every
//! queue).

use std::collections::{HashMap, HashSet};

use crate::domain::validate::ValidationError;
use crate::pb;

/// The `(name, value)` pairs of a query string, percent-decoded. A second
/// value for a parameter not in `repeatable` is refused: which of them
/// applied would be a guess.
fn pairs(
    query: Option<&str>,
    repeatable: &[&str],
) -> Result<Vec<(String, String)>, ValidationError> {
    let mut seen = HashSet::new();
    let mut pairs = Vec::new();
    for (name, value) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        if !repeatable.contains(&name.as_ref()) && !seen.insert(name.clone()) {
            return Err(ValidationError::new(
                name,
                "given twice; it takes one value",
            ));
        }
        pairs.push((name.into_owned(), value.into_owned()));
    }
    Ok(pairs)
}

/// A job state written as `FAILED`, `failed` or `JOB_STATE_FAILED`.
pub fn job_state(field: &str, text: &str) -> Result<pb::JobState, ValidationError> {
    let upper = text.trim().to_ascii_uppercase();
    let name = if upper.starts_with("JOB_STATE_") {
        upper
    } else {
        format!("JOB_STATE_{upper}")
    };
    match pb::JobState::from_str_name(&name) {
        Some(pb::JobState::Unspecified) | None => Err(ValidationError::new(
            field,
            format!(
                "unknown state {text:?} (queued, running, succeeded, failed, cancelled, expired)"
            ),
        )),
        Some(state) => Ok(state),
    }
}

/// `GET /api/v1/jobs?queue=&kind=&state=&error_class=&label=k=v&page_size=&page_token=`.
/// `state` and `label` may repeat; `state` may also list states with commas.
pub fn list(query: Option<&str>) -> Result<pb::ListJobsRequest, ValidationError> {
    let mut request = pb::ListJobsRequest::default();
    let mut labels = HashMap::new();
    for (name, value) in pairs(query, &["state", "label"])? {
        match name.as_str() {
            "queue" => request.queue = value,
            "kind" => request.kind = value,
            "error_class" => request.error_class = value,
            "page_token" => request.page_token = value,
            "view" => request.view = job_view(&value)? as i32,
            "page_size" => {
                let size = value
                    .parse()
                    .map_err(|_| ValidationError::new("page_size", "must be a whole number"))?;
                request.page_size = Some(size);
            }
            "state" => {
                for part in value.split(',').filter(|p| !p.trim().is_empty()) {
                    request.states.push(job_state("state", part)? as i32);
                }
            }
            "label" => {
                let (key, val) = value
                    .split_once('=')
                    .ok_or_else(|| ValidationError::new("label", "write it as key=value"))?;
                // As the CLI: a second value would silently replace the first.
                if labels.insert(key.to_owned(), val.to_owned()).is_some() {
                    return Err(ValidationError::new(
                        format!("label[{key}]"),
                        "given twice; a job has one value per label",
                    ));
                }
            }
            other => return Err(unknown(other)),
        }
    }
    request.labels = labels;
    Ok(request)
}

/// `view=basic` or `view=full` (or the enum's names, `JOB_VIEW_BASIC`).
fn job_view(value: &str) -> Result<pb::JobView, ValidationError> {
    let name = value.trim().to_ascii_lowercase();
    match name.strip_prefix("job_view_").unwrap_or(&name) {
        "basic" => Ok(pb::JobView::Basic),
        "full" => Ok(pb::JobView::Full),
        _ => Err(ValidationError::new("view", "must be basic or full")),
    }
}

/// `GET /api/v1/dead-set?queue=&kind=&error_class=&state=`: a replay
/// filter, the dead set (failed jobs) without `state`.
pub fn dead_set(query: Option<&str>) -> Result<pb::RetryFilter, ValidationError> {
    let mut filter = pb::RetryFilter::default();
    for (name, value) in pairs(query, &["state"])? {
        match name.as_str() {
            "queue" => filter.queue = value,
            "kind" => filter.kind = value,
            "error_class" => filter.error_class = value,
            "state" => {
                for part in value.split(',').filter(|p| !p.trim().is_empty()) {
                    filter.states.push(job_state("state", part)? as i32);
                }
            }
            other => return Err(unknown(other)),
        }
    }
    Ok(filter)
}

/// `GET /api/v1/stats?queue=`.
pub fn stats(query: Option<&str>) -> Result<pb::StatsRequest, ValidationError> {
    let mut request = pb::StatsRequest::default();
    for (name, value) in pairs(query, &[])? {
        match name.as_str() {
            "queue" => request.queue = value,
            other => return Err(unknown(other)),
        }
    }
    Ok(request)
}

/// `GET /api/v1/jobs/{id}/events?after_sequence=`: where a stream starts
/// when no `Last-Event-ID` says so.
pub fn after_sequence(query: Option<&str>) -> Result<Option<u64>, ValidationError> {
    let mut after = None;
    for (name, value) in pairs(query, &[])? {
        match name.as_str() {
            "after_sequence" => after = Some(sequence("after_sequence", &value)?),
            other => return Err(unknown(other)),
        }
    }
    Ok(after)
}

/// An event sequence number.
pub fn sequence(field: &str, text: &str) -> Result<u64, ValidationError> {
    text.trim()
        .parse()
        .map_err(|_| ValidationError::new(field, "must be an event sequence number"))
}

/// A route that takes no query: any parameter is refused, as an unknown
/// filter is, so that a typo in a URL is not silently ignored.
pub fn none(query: Option<&str>) -> Result<(), ValidationError> {
    match form_urlencoded::parse(query.unwrap_or_default().as_bytes()).next() {
        Some((name, _)) => Err(unknown(&name)),
        None => Ok(()),
    }
}

fn unknown(name: &str) -> ValidationError {
    ValidationError::new(name, "unknown query parameter")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_filters_parse() {
        let r = list(Some(
            "queue=q%201&state=failed,QUEUED&state=JOB_STATE_EXPIRED&label=team=ml&page_size=5&kind=k&error_class=e&page_token=t",
        ))
        .expect("valid");
        assert_eq!(r.queue, "q 1");
        assert_eq!(
            r.states,
            [
                pb::JobState::Failed,
                pb::JobState::Queued,
                pb::JobState::Expired
            ]
            .map(|s| s as i32)
        );
        assert_eq!(r.labels["team"], "ml");
        assert_eq!(r.page_size, Some(5));
        assert_eq!(
            (
                r.kind.as_str(),
                r.error_class.as_str(),
                r.page_token.as_str()
            ),
            ("k", "e", "t")
        );
        assert_eq!(list(None).expect("empty"), pb::ListJobsRequest::default());
        let view = |q: &str| list(Some(q)).map(|r| r.view);
        assert_eq!(view("view=basic"), Ok(pb::JobView::Basic as i32));
        assert_eq!(view("view=JOB_VIEW_FULL"), Ok(pb::JobView::Full as i32));
        assert!(view("view=short").is_err_and(|e| e.field == "view"));
    }

    #[test]
    fn bad_parameters_name_the_field() {
        assert_eq!(
            list(Some("state=done")).expect_err("bad state").field,
            "state"
        );
        assert_eq!(
            list(Some("state=unspecified")).expect_err("bad").field,
            "state"
        );
        assert_eq!(
            list(Some("page_size=x")).expect_err("bad").field,
            "page_size"
        );
        assert_eq!(list(Some("label=nokey")).expect_err("bad").field, "label");
        assert_eq!(
            list(Some("label=team=ml&label=team=ops"))
                .expect_err("twice")
                .field,
            "label[team]"
        );
        assert_eq!(list(Some("queu=x")).expect_err("typo").field, "queu");
        for query in [
            "queue=a&queue=b",
            "queue=a&queue=",
            "page_size=1&page_size=2",
        ] {
            assert!(list(Some(query)).is_err(), "{query}");
        }
        assert_eq!(
            dead_set(Some("queue=payments&queue="))
                .expect_err("twice")
                .field,
            "queue"
        );
        assert_eq!(
            stats(Some("queue=a&queue=b")).expect_err("twice").field,
            "queue"
        );
        assert!(
            list(Some("state=failed&state=expired")).is_ok(),
            "state repeats"
        );
        assert_eq!(stats(Some("q=x")).expect_err("typo").field, "q");
        assert_eq!(
            after_sequence(Some("after_sequence=3")).expect("ok"),
            Some(3)
        );
        assert!(after_sequence(Some("after_sequence=-1")).is_err());
        assert_eq!(
            after_sequence(Some("after_sequence=3&after_sequence=9"))
                .expect_err("twice")
                .field,
            "after_sequence"
        );
    }
}
