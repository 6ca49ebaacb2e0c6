//! Structure of `docker-compose.yml` and `deploy/docker/Dockerfile`.
//!
//! No Docker engine runs these: they parse the files and check the rules the
//! compose stack relies on (healthchecks, ordered start-up, the scale rule for
//! the workers, configuration keys the services know, no secret in the file,
//! the images build the binaries the local stack runs, as a non-root user).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_norway::{Mapping, Value};

/// The worker's service name; it must scale with `--scale report-generator=N`.
const WORKER: &str = "report-generator";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

fn read(relative: &str) -> String {
    let path = repo_root().join(relative);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// docker-compose.yml with its anchors resolved and `<<` merge keys applied.
fn compose() -> Value {
    let mut value: Value =
        serde_norway::from_str(&read("docker-compose.yml")).expect("docker-compose.yml is YAML");
    value.apply_merge().expect("merge keys apply");
    value
}

fn services(compose: &Value) -> BTreeMap<String, Mapping> {
    compose
        .get("services")
        .and_then(Value::as_mapping)
        .expect("a services mapping")
        .iter()
        .map(|(name, service)| {
            let name = name.as_str().expect("service names are strings").to_owned();
            let service = service
                .as_mapping()
                .unwrap_or_else(|| panic!("service {name} is a mapping"))
                .clone();
            (name, service)
        })
        .collect()
}

fn scalar(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Null => String::new(),
        other => panic!("not a scalar: {other:?}"),
    }
}

/// A service's environment, in either compose form (mapping or `K=V` list).
fn environment(service: &Mapping) -> BTreeMap<String, String> {
    match service.get("environment") {
        None => BTreeMap::new(),
        Some(Value::Mapping(map)) => map.iter().map(|(k, v)| (scalar(k), scalar(v))).collect(),
        Some(Value::Sequence(list)) => list
            .iter()
            .map(|item| {
                let item = scalar(item);
                let (k, v) = item.split_once('=').unwrap_or((item.as_str(), ""));
                (k.to_owned(), v.to_owned())
            })
            .collect(),
        Some(other) => panic!("environment is neither a mapping nor a list: {other:?}"),
    }
}

/// `depends_on` as (service, condition); the short list form has no condition.
fn depends_on(service: &Mapping) -> Vec<(String, Option<String>)> {
    match service.get("depends_on") {
        None => Vec::new(),
        Some(Value::Sequence(list)) => list.iter().map(|s| (scalar(s), None)).collect(),
        Some(Value::Mapping(map)) => map
            .iter()
            .map(|(name, spec)| {
                let condition = spec.get("condition").map(scalar);
                (scalar(name), condition)
            })
            .collect(),
        Some(other) => panic!("depends_on is neither a list nor a mapping: {other:?}"),
    }
}

/// Services something waits for with `service_completed_successfully`: the
/// one-shot ones. Every other service runs for good.
fn one_shot_services(services: &BTreeMap<String, Mapping>) -> BTreeSet<String> {
    services
        .values()
        .flat_map(depends_on)
        .filter(|(_, condition)| condition.as_deref() == Some("service_completed_successfully"))
        .map(|(name, _)| name)
        .collect()
}

fn image(service: &Mapping) -> String {
    service.get("image").map(scalar).unwrap_or_default()
}

#[test]
fn compose_has_the_services_of_the_design() {
    let services = services(&compose());
    for name in ["kafka", "init", "producer-api", WORKER] {
        assert!(services.contains_key(name), "no service {name}");
    }
    assert!(
        image(&services["kafka"]).starts_with("apache/kafka:"),
        "kafka uses the official apache/kafka image"
    );
    let s3: Vec<_> = services
        .iter()
        .filter(|(_, s)| image(s).starts_with("versity/versitygw:"))
        .map(|(name, _)| name.clone())
        .collect();
    assert_eq!(s3.len(), 1, "one S3 server (versitygw), found {s3:?}");
    assert!(
        !services.values().any(|s| image(s).contains("minio")),
        "the S3 server is Apache-2.0 versitygw, not MinIO"
    );
    for (name, service) in &services {
        let image = image(service);
        assert!(
            image.is_empty() || !image.ends_with(":latest") && image.contains(':'),
            "{name}: image {image} is not pinned to a tag"
        );
    }
}

#[test]
fn compose_long_running_services_have_healthchecks_and_conditions() {
    let services = services(&compose());
    let one_shot = one_shot_services(&services);
    assert!(
        one_shot.contains("init"),
        "nothing waits for init to complete"
    );
    for (name, service) in &services {
        let restart = service.get("restart").map(scalar).unwrap_or_default();
        if one_shot.contains(name) {
            assert!(
                restart.is_empty() || restart == "no",
                "{name} is one-shot but restart is {restart}"
            );
            continue;
        }
        let test = service
            .get("healthcheck")
            .and_then(|h| h.get("test"))
            .unwrap_or_else(|| panic!("{name} runs for good and has no healthcheck test"));
        assert!(
            !matches!(test, Value::Sequence(s) if s.first().map(scalar).as_deref() == Some("NONE")),
            "{name}: healthcheck disabled"
        );
    }
    for (name, service) in &services {
        for (target, condition) in depends_on(service) {
            let target_service = services
                .get(&target)
                .unwrap_or_else(|| panic!("{name} depends on unknown service {target}"));
            match condition.as_deref() {
                Some("service_healthy") => assert!(
                    target_service.get("healthcheck").is_some(),
                    "{name} waits for {target} to be healthy, which has no healthcheck"
                ),
                Some("service_completed_successfully") => {}
                other => panic!(
                    "{name} depends on {target} with condition {other:?}; \
                     use service_healthy or service_completed_successfully"
                ),
            }
        }
    }
    for name in ["producer-api", WORKER] {
        let needs: BTreeMap<_, _> = depends_on(&services[name]).into_iter().collect();
        assert_eq!(
            needs.get("kafka").cloned().flatten().as_deref(),
            Some("service_healthy"),
            "{name} waits for a healthy kafka"
        );
        assert_eq!(
            needs.get("init").cloned().flatten().as_deref(),
            Some("service_completed_successfully"),
            "{name} waits for init"
        );
    }
}

#[test]
fn compose_worker_scales() {
    let services = services(&compose());
    for (name, service) in &services {
        assert!(
            service.get("container_name").is_none(),
            "{name} has a container_name; `--scale` needs generated names"
        );
    }
    let worker = &services[WORKER];
    assert!(
        worker.get("ports").is_none(),
        "{WORKER} publishes host ports; replicas would collide"
    );
    // The replica id is both the static group member id and the
    // transactional id: one value for every replica would fence them.
    assert!(
        !environment(worker).contains_key("QUIRE_WORKER__REPLICA_ID"),
        "{WORKER} sets one QUIRE_WORKER__REPLICA_ID for every replica"
    );
    assert!(
        worker.get("entrypoint").is_none(),
        "{WORKER} overrides the image's entrypoint, which sets the replica id"
    );
    let build = worker
        .get("build")
        .expect("the worker is built from the repository");
    assert_eq!(
        build.get("target").map(scalar).as_deref(),
        Some(WORKER),
        "the worker builds the {WORKER} target"
    );
    let stages = dockerfile_stages();
    let stage = stages
        .iter()
        .find(|s| s.name == WORKER)
        .expect("the Dockerfile has a report-generator stage");
    let entrypoint = stage
        .instruction("ENTRYPOINT")
        .expect("the worker stage has an ENTRYPOINT");
    assert!(
        entrypoint.contains("report-generator-entrypoint.sh"),
        "the worker image starts through its entrypoint script: {entrypoint}"
    );
    let script = read("deploy/docker/report-generator-entrypoint.sh");
    assert!(
        script.contains("QUIRE_WORKER__REPLICA_ID=$(uname -n)")
            && script.contains("export QUIRE_WORKER__REPLICA_ID")
            && script.contains("exec /usr/local/bin/report-generator \"$@\""),
        "the entrypoint derives the replica id from the hostname and execs the worker"
    );
}

/// Whether `path` (e.g. `kafka.topics.records`) is a leaf key of the defaults.
fn known_key(defaults: &toml::Table, path: &[String]) -> bool {
    // Pass-through librdkafka properties are free-form.
    if path.len() > 2 && path[0] == "kafka" && path[1] == "properties" {
        return true;
    }
    let mut table = defaults;
    for (i, part) in path.iter().enumerate() {
        match table.get(part) {
            Some(toml::Value::Table(inner)) if i + 1 < path.len() => table = inner,
            Some(toml::Value::Table(_)) | None => return false,
            Some(_) => return i + 1 == path.len(),
        }
    }
    false
}

#[test]
fn compose_sets_only_configuration_keys_the_services_know() {
    let defaults: toml::Table = read("shared/config/src/defaults.toml")
        .parse()
        .expect("defaults.toml is TOML");
    let services = services(&compose());
    let mut checked = 0;
    for (name, service) in &services {
        for (variable, value) in environment(service) {
            // Only QUIRE_<SECTION>__<KEY> names are configuration.
            let Some(rest) = variable.strip_prefix("QUIRE_") else {
                continue;
            };
            if !variable.contains("__") {
                continue;
            }
            let path: Vec<String> = rest.split("__").map(str::to_lowercase).collect();
            assert!(
                known_key(&defaults, &path),
                "{name}: {variable} is not a configuration key ({} is not in defaults.toml)",
                path.join(".")
            );
            assert!(!value.is_empty(), "{name}: {variable} is empty");
            checked += 1;
        }
    }
    assert!(
        checked >= 10,
        "only {checked} configuration variables found"
    );

    // Both services find the broker, the S3 server and the topics that init created.
    let init = environment(&services["init"]);
    for name in ["producer-api", WORKER] {
        let env = environment(&services[name]);
        assert_eq!(
            env.get("QUIRE_KAFKA__BOOTSTRAP_SERVERS")
                .map(String::as_str),
            Some("kafka:9092")
        );
        assert!(
            env.get("QUIRE_S3__ENDPOINT")
                .is_some_and(|e| e.starts_with("http://")),
            "{name} has an S3 endpoint"
        );
        for topic in ["RECORDS", "WATERMARKS", "REPORT_EVENTS", "DEAD_LETTERS"] {
            let key = format!("QUIRE_KAFKA__TOPICS__{topic}");
            assert_eq!(
                env.get(&key),
                init.get(&key),
                "{name} and init agree on {key}"
            );
        }
    }
    let api = environment(&services["producer-api"]);
    let listen = api
        .get("QUIRE_API__LISTEN")
        .expect("the API's listen address");
    assert!(
        listen.starts_with("0.0.0.0:"),
        "the API listens on every interface in its container: {listen}"
    );
    let port = listen.rsplit(':').next().unwrap();
    let published = services["producer-api"]
        .get("ports")
        .and_then(Value::as_sequence)
        .expect("the API publishes its port");
    assert!(
        published
            .iter()
            .any(|p| scalar(p).ends_with(&format!(":{port}"))),
        "the API publishes container port {port}: {published:?}"
    );
    // Whatever a service publishes is on the host's loopback by default.
    for (name, service) in &services {
        for mapping in service
            .get("ports")
            .and_then(Value::as_sequence)
            .into_iter()
            .flatten()
        {
            let mapping = scalar(mapping);
            assert!(
                mapping.starts_with("127.0.0.1:")
                    || mapping.starts_with("${QUIRE_API_BIND:-127.0.0.1}:"),
                "{name} publishes {mapping} beyond the host's loopback"
            );
        }
    }
}

#[test]
fn compose_worker_serves_metrics_and_its_healthcheck_asks_healthz() {
    let services = services(&compose());
    let worker = &services[WORKER];
    let env = environment(worker);
    let listen = env
        .get("QUIRE_WORKER__METRICS_LISTEN")
        .expect("the worker's metrics address is set");
    assert!(
        listen.starts_with("0.0.0.0:"),
        "the worker serves its metrics on every interface in its container: {listen}"
    );
    let port = listen.rsplit(':').next().unwrap();
    assert!(
        port.parse::<u16>().is_ok_and(|port| port != 0),
        "a fixed metrics port, for the healthcheck and Prometheus: {listen}"
    );
    let test: Vec<String> = worker
        .get("healthcheck")
        .and_then(|healthcheck| healthcheck.get("test"))
        .and_then(Value::as_sequence)
        .expect("the worker has a healthcheck test")
        .iter()
        .map(scalar)
        .collect();
    let command = test.join(" ");
    // The runtime image has bash but no curl or wget.
    assert_eq!(test.first().map(String::as_str), Some("CMD"), "{command}");
    assert_eq!(test.get(1).map(String::as_str), Some("bash"), "{command}");
    assert!(
        command.contains(&format!("/dev/tcp/127.0.0.1/{port}"))
            && command.contains("GET /healthz HTTP/1.1")
            && command.contains(" 200 "),
        "the healthcheck GETs /healthz on the metrics port {port}: {command}"
    );
}

#[test]
fn compose_init_creates_the_topics_and_the_bucket() {
    let services = services(&compose());
    let script: String = BTreeSet::from(["init".to_owned()])
        .into_iter()
        .chain(one_shot_services(&services))
        .map(|name| serde_norway::to_string(&services[&name]).unwrap())
        .collect();
    for needle in [
        "kafka-topics.sh",
        "--if-not-exists",
        "cleanup.policy=compact",
        "segment.ms=600000",
        "segment.bytes=1048576",
        "min.cleanable.dirty.ratio=0.1",
        "min.compaction.lag.ms=0",
        "max.compaction.lag.ms=600000",
        "retention.ms=604800000",
        "--partitions 3",
        "QUIRE_KAFKA__PARTITIONS: ${PARTITIONS:-12}",
        "--partitions \"$$QUIRE_KAFKA__PARTITIONS\"",
        "--aws-sigv4",
        "BucketAlreadyOwnedByYou",
    ] {
        assert!(
            script.contains(needle),
            "the init services do not mention {needle}"
        );
    }
}

#[test]
fn compose_holds_no_secret() {
    let compose_text = read("docker-compose.yml");
    let services = services(&compose());
    let secret_names = ["SECRET", "ACCESS_KEY", "PASSWORD", "TOKEN"];
    let mut secrets = 0;
    for (name, service) in &services {
        for (variable, value) in environment(service) {
            let upper = variable.to_uppercase();
            if !secret_names.iter().any(|s| upper.contains(s)) {
                continue;
            }
            secrets += 1;
            assert!(
                value.starts_with("${") && value.ends_with('}') && value.contains(":?"),
                "{name}: {variable} must be a required ${{VAR:?message}} reference, not {value:?}"
            );
        }
    }
    assert!(
        secrets >= 4,
        "the S3 keys reach the server and the services"
    );
    // Nothing that looks like an AWS key id.
    assert!(
        !compose_text
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|w| w.len() == 20 && (w.starts_with("AKIA") || w.starts_with("ASIA"))),
        "docker-compose.yml contains something like an AWS access key id"
    );
    let example = read(".env.example");
    for line in example.lines().filter(|l| !l.trim_start().starts_with('#')) {
        if let Some((variable, value)) = line.split_once('=')
            && secret_names.iter().any(|s| variable.contains(s))
        {
            assert!(
                value.starts_with("change-me"),
                ".env.example: {variable} must be a placeholder"
            );
        }
    }
}

/// One `FROM ... AS name` stage of the Dockerfile with its instructions
/// (continuation lines joined).
struct Stage {
    name: String,
    from: String,
    instructions: Vec<(String, String)>,
}

impl Stage {
    fn instruction(&self, keyword: &str) -> Option<&str> {
        self.instructions
            .iter()
            .rev()
            .find(|(k, _)| k == keyword)
            .map(|(_, v)| v.as_str())
    }
}

fn dockerfile_stages() -> Vec<Stage> {
    let text = read("deploy/docker/Dockerfile");
    let mut logical = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with('#') || trimmed.is_empty() && current.is_empty() {
            continue;
        }
        if let Some(head) = trimmed.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
        } else {
            current.push_str(trimmed);
            logical.push(std::mem::take(&mut current));
        }
    }
    let mut stages: Vec<Stage> = Vec::new();
    for line in logical {
        let (keyword, rest) = line.split_once(char::is_whitespace).unwrap_or((&line, ""));
        let keyword = keyword.to_uppercase();
        if keyword == "FROM" {
            let words: Vec<&str> = rest.split_whitespace().collect();
            let name = match words.as_slice() {
                [_, as_, name] if as_.eq_ignore_ascii_case("as") => (*name).to_owned(),
                _ => String::new(),
            };
            stages.push(Stage {
                name,
                from: words.first().copied().unwrap_or_default().to_owned(),
                instructions: Vec::new(),
            });
        } else if let Some(stage) = stages.last_mut() {
            stage.instructions.push((keyword, rest.trim().to_owned()));
        }
    }
    stages
}

/// The default of `ARG name=default` in the Dockerfile.
fn dockerfile_arg_default(name: &str) -> String {
    let prefix = format!("ARG {name}=");
    read("deploy/docker/Dockerfile")
        .lines()
        .find_map(|l| l.trim().strip_prefix(&prefix).map(str::to_owned))
        .unwrap_or_else(|| panic!("no ARG {name}=... in the Dockerfile"))
}

/// The `-p` packages of the first `cargo build` in `text`.
fn cargo_build_packages(text: &str) -> BTreeSet<String> {
    let start = text.find("cargo build").expect("a cargo build command");
    let words: Vec<&str> = text[start..]
        .split(['\n', '&', ';'])
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    assert!(
        words.contains(&"--release"),
        "cargo build without --release"
    );
    words
        .windows(2)
        .filter(|w| w[0] == "-p" || w[0] == "--package")
        .map(|w| w[1].to_owned())
        .collect()
}

#[test]
fn dockerfile_builds_the_local_stack_binaries_and_runs_them_unprivileged() {
    let stages = dockerfile_stages();
    let builder_run: String = stages
        .iter()
        .flat_map(|s| &s.instructions)
        .filter(|(k, _)| k == "RUN")
        .map(|(_, v)| format!("{v}\n"))
        .collect();
    let built = cargo_build_packages(&builder_run);
    let local = cargo_build_packages(&read("deploy/local/services"));
    assert_eq!(
        built, local,
        "the image builds other packages than deploy/local/services"
    );
    assert_eq!(
        built,
        BTreeSet::from(["producer-api".to_owned(), WORKER.to_owned()])
    );

    let services = services(&compose());
    for name in ["producer-api", WORKER] {
        let build = services[name]
            .get("build")
            .expect("built from the repository");
        let dockerfile = build.get("dockerfile").map(scalar).unwrap_or_default();
        assert_eq!(
            dockerfile, "deploy/docker/Dockerfile",
            "{name}'s Dockerfile"
        );
        assert_eq!(build.get("context").map(scalar).as_deref(), Some("."));
        let target = build.get("target").map(scalar).expect("a build target");
        let stage = stages
            .iter()
            .find(|s| s.name == target)
            .unwrap_or_else(|| panic!("no Dockerfile stage {target}"));
        let user = stage
            .instruction("USER")
            .unwrap_or_else(|| panic!("stage {target} sets no USER"));
        let user_name = user.split(':').next().unwrap();
        assert!(
            user_name != "root" && user_name != "0",
            "stage {target} runs as root"
        );
        // The runtime is a slim image, reached through the stage chain.
        let mut from = stage.from.clone();
        while let Some(parent) = stages.iter().find(|s| s.name == from) {
            from = parent.from.clone();
        }
        let base = if from.contains("RUNTIME_IMAGE") {
            dockerfile_arg_default("RUNTIME_IMAGE")
        } else {
            from
        };
        assert_eq!(base, "debian:bookworm-slim", "stage {target}'s base image");
        let copies_binary = stage
            .instructions
            .iter()
            .any(|(k, v)| k == "COPY" && v.contains("--from=binaries") && v.contains(name));
        assert!(
            copies_binary,
            "stage {target} copies the {name} binary from the binaries stage"
        );
    }
    // The binaries come from the builder unless the build says otherwise.
    let binaries = stages
        .iter()
        .find(|s| s.name == "binaries")
        .expect("a binaries stage");
    assert_eq!(binaries.from, "${BINARIES}");
    assert_eq!(dockerfile_arg_default("BINARIES"), "builder");
    // A `# syntax=` line makes BuildKit pull a frontend image from a
    // registry: the build then fails wherever none is reachable.
    assert!(
        !read("deploy/docker/Dockerfile")
            .lines()
            .any(|line| line.trim_start().starts_with("# syntax=")),
        "the Dockerfile names a frontend image to pull"
    );
}
