//! Roles, and the one table saying which role each gRPC method needs.

use std::fmt;

/// What a token may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Submits and follows its tenant's jobs.
    Producer,
    /// Leases and completes its tenant's jobs.
    Worker,
    /// Everything, for any tenant (named by `x-intray-tenant`).
    Admin,
    /// Scrapes `GET /metrics` (every tenant's counts) and nothing else: the
    /// credential a Prometheus server holds.
    Metrics,
}

impl Role {
    /// Every role, in the order they are printed.
    pub const ALL: [Role; 4] = [Role::Producer, Role::Worker, Role::Admin, Role::Metrics];

    /// The name used in the token file.
    pub fn name(self) -> &'static str {
        match self {
            Role::Producer => "producer",
            Role::Worker => "worker",
            Role::Admin => "admin",
            Role::Metrics => "metrics",
        }
    }

    /// Parses a name of the token file.
    pub fn parse(name: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.name() == name)
    }

    fn bit(self) -> u8 {
        match self {
            Role::Producer => 1,
            Role::Worker => 2,
            Role::Admin => 4,
            Role::Metrics => 8,
        }
    }
}

/// A set of roles.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Roles(u8);

impl Roles {
    /// No role at all.
    pub const NONE: Roles = Roles(0);

    /// Every role: what an open (unauthenticated) server grants.
    pub fn all() -> Roles {
        Role::ALL.into_iter().collect()
    }

    /// Whether `role` is in the set.
    pub fn contains(self, role: Role) -> bool {
        self.0 & role.bit() != 0
    }

    /// The set with `role` added.
    pub fn with(self, role: Role) -> Roles {
        Roles(self.0 | role.bit())
    }

    /// Whether these roles may call a method needing `access`. Admin may call
    /// everything.
    pub fn allow(self, access: Access) -> bool {
        match access {
            Access::Public => true,
            Access::Role(role) => self.contains(role) || self.contains(Role::Admin),
        }
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl FromIterator<Role> for Roles {
    fn from_iter<I: IntoIterator<Item = Role>>(iter: I) -> Roles {
        iter.into_iter().fold(Roles::NONE, Roles::with)
    }
}

impl fmt::Display for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Role::ALL
            .into_iter()
            .filter(|r| self.contains(*r))
            .map(Role::name)
            .collect();
        if names.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&names.join(","))
        }
    }
}

impl fmt::Debug for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Roles({self})")
    }
}

/// What a gRPC method needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// No token at all: health checks (Kubernetes probes send none) and
    /// reflection (it describes the schema, no data).
    Public,
    /// A token with this role, or admin.
    Role(Role),
}

/// The path [`access_for`] knows the HTTP port's `GET /metrics` by.
pub const METRICS_SCRAPE: &str = "GET /metrics";

/// The table: gRPC method path -> what it needs. A method not listed here
/// (a future RPC someone forgot to add) needs admin, so that forgetting
/// fails closed.
pub fn access_for(path: &str) -> Access {
    const PRODUCER: &[&str] = &[
        "/intray.v1.JobService/Submit",
        "/intray.v1.JobService/SubmitBatch",
        "/intray.v1.JobService/Get",
        "/intray.v1.JobService/Cancel",
        "/intray.v1.JobService/WatchJob",
        "/intray.v1.JobService/List",
        "/intray.v1.JobService/Stats",
    ];
    const WORKER: &[&str] = &[
        "/intray.v1.WorkerService/Lease",
        "/intray.v1.WorkerService/Heartbeat",
        "/intray.v1.WorkerService/Complete",
        "/intray.v1.WorkerService/CompleteBatch",
        "/intray.v1.WorkerService/CompleteAndLease",
    ];
    const PUBLIC_SERVICES: &[&str] = &[
        "/grpc.health.v1.Health/",
        "/grpc.reflection.v1.ServerReflection/",
        "/grpc.reflection.v1alpha.ServerReflection/",
    ];
    if PRODUCER.contains(&path) {
        Access::Role(Role::Producer)
    } else if path == METRICS_SCRAPE {
        Access::Role(Role::Metrics)
    } else if WORKER.contains(&path) {
        Access::Role(Role::Worker)
    } else if PUBLIC_SERVICES.iter().any(|p| path.starts_with(p)) {
        Access::Public
    } else {
        // Admin: JobService/Retry, PauseQueue and ResumeQueue (operators'
        // acts), and anything not listed above.
        Access::Role(Role::Admin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_matches_the_roles_of_the_issue() {
        let producer: Roles = [Role::Producer].into_iter().collect();
        let worker: Roles = [Role::Worker].into_iter().collect();
        let admin: Roles = [Role::Admin].into_iter().collect();
        let submit = access_for("/intray.v1.JobService/Submit");
        let lease = access_for("/intray.v1.WorkerService/Lease");
        let retry = access_for("/intray.v1.JobService/Retry");
        for admin_only in ["PauseQueue", "ResumeQueue"] {
            let access = access_for(&format!("/intray.v1.JobService/{admin_only}"));
            assert_eq!(access, Access::Role(Role::Admin), "{admin_only}");
        }
        assert!(producer.allow(submit) && !producer.allow(lease) && !producer.allow(retry));
        assert!(worker.allow(lease) && !worker.allow(submit) && !worker.allow(retry));
        let metrics: Roles = [Role::Metrics].into_iter().collect();
        let scrape = access_for(METRICS_SCRAPE);
        assert!(metrics.allow(scrape) && admin.allow(scrape) && !producer.allow(scrape));
        assert!(!metrics.allow(submit) && !metrics.allow(lease) && !metrics.allow(retry));
        let chained = access_for("/intray.v1.WorkerService/CompleteAndLease");
        assert!(worker.allow(chained) && !producer.allow(chained));
        assert!(admin.allow(submit) && admin.allow(lease) && admin.allow(retry));
        assert_eq!(access_for("/grpc.health.v1.Health/Check"), Access::Public);
        assert_eq!(access_for("/grpc.health.v1.Health/Watch"), Access::Public);
        assert_eq!(
            access_for("/intray.v1.JobService/SomethingNew"),
            Access::Role(Role::Admin),
            "unknown methods fail closed"
        );
        assert_eq!(
            access_for("/grpc.health.v1.HealthX/Check"),
            Access::Role(Role::Admin),
            "prefix match is on whole service names"
        );
    }

    #[test]
    fn roles_print_and_parse() {
        let both: Roles = [Role::Worker, Role::Producer].into_iter().collect();
        assert_eq!(both.to_string(), "producer,worker");
        assert_eq!(Roles::NONE.to_string(), "none");
        assert_eq!(Role::parse("admin"), Some(Role::Admin));
        assert_eq!(Role::parse("Admin"), None);
    }
}
