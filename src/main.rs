//! The `netblk` command line: parses options, sets up logging, binds listeners and hands
//! over to `netblk::server::serve`.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use netblk::backend::{BackingSpec, CacheMode};
use netblk::config::{Config, ExportConfig};
use netblk::listen::ListenAddr;
use netblk::server::clients::Clients;
use netblk::server::control::{run_control, ExportDescription, ServerState};
use netblk::server::{
    serve_on, ClientOptions, ConnectionThreads, Export, ServerConfig, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_MERGE,
};
use netblk::size::parse_size;
use netblk::tcp::TcpSettings;
use netblk::wire::MAX_PAYLOAD;

/// A network block device in user space: exports files, block devices or memory over the
/// standard NBD protocol, so qemu, the kernel nbd driver, libnbd tools and fio use it as is.
#[derive(Parser)]
#[command(name = "netblk", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
    /// Export storage over NBD.
    ///
    /// Examples:
    ///   netblk serve memory:1G
    ///   netblk serve --listen 127.0.0.1:10809 --listen unix:/tmp/nbd.sock --size 10G disk.img
    ///   netblk serve --config exports.toml
    ///
    /// Then: qemu-img info nbd://127.0.0.1:10809, nbdinfo nbd://127.0.0.1:10809,
    /// fio --ioengine=nbd --uri=nbd://127.0.0.1:10809 ...
    #[command(verbatim_doc_comment)]
    Serve(Box<ServeArgs>),
    /// Show a replicated node's role, peers, out-of-sync amount and resync progress, or a
    /// server's exports and clients (one started with --control PATH).
    /// Example: netblk status --config r0.toml --node alpha --json
    /// Example: netblk status --control /run/netblk.ctl
    Status {
        #[command(flatten)]
        target: ControlTarget,
        /// Print the status as JSON.
        #[arg(long)]
        json: bool,
        /// Follow a running resync until it ends: a progress bar per peer in a terminal,
        /// a plain line per second otherwise.
        #[arg(long, conflicts_with = "json")]
        watch: bool,
    },
    /// Make a replicated node primary. Refused while a peer is primary, and for a node
    /// whose data may be older than a peer's unless --force (which starts a new data
    /// generation: a peer that wrote too is then in split brain).
    Promote {
        #[command(flatten)]
        target: ControlTarget,
        /// Promote even when this node's data may be older than a peer's (a new data
        /// generation starts).
        #[arg(long)]
        force: bool,
    },
    /// Make a replicated primary secondary (after a replicated flush).
    Demote {
        #[command(flatten)]
        target: ControlTarget,
    },
    /// Compare the checksum of every region with every peer; regions that differ are
    /// marked out of sync and resynced.
    Verify {
        #[command(flatten)]
        target: ControlTarget,
    },
    /// Record a secondary cut off from its primary as outdated, so it is not promoted
    /// without --force (what a fence_peer command runs on the peer it fences). Refused on
    /// a primary and on a node linked to its primary.
    Outdate {
        #[command(flatten)]
        target: ControlTarget,
    },
}

/// Which node or server a control command talks to.
#[derive(clap::Args)]
struct ControlTarget {
    /// The resource file. Example: --config r0.toml
    #[arg(long, value_name = "FILE", required_unless_present = "control")]
    config: Option<PathBuf>,
    /// The node, as named in the resource file. Example: --node alpha
    #[arg(long, value_name = "NAME", required_unless_present = "control")]
    node: Option<String>,
    /// The control socket of a node (instead of --config and --node) or of a server
    /// started with `netblk serve --control PATH`.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["config", "node"])]
    control: Option<PathBuf>,
}

#[derive(Parser)]
struct ServeArgs {
    /// What to export: a file or block device path, or memory:SIZE (sizes take K, M, G, T
    /// suffixes, powers of 1024). Example: memory:1G
    #[arg(value_name = "BACKING", required_unless_present = "config")]
    backing: Option<String>,

    /// Where to listen: HOST:PORT (IPv4 or [IPv6]) or unix:PATH. Repeat for several.
    /// Default 127.0.0.1:10809. Example: --listen [::1]:10809 --listen unix:/tmp/nbd.sock
    #[arg(long, value_name = "ADDR")]
    listen: Vec<String>,

    /// Export name clients ask for (the default export is ""). Example: --name disk0
    #[arg(long, default_value = "")]
    name: String,

    /// Description shown by nbdinfo and NBD_OPT_LIST. Example: --description "scratch disk"
    #[arg(long, default_value = "")]
    description: String,

    /// Refuse writes, trims and zeroing with EPERM, and open the backing read-only.
    #[arg(long)]
    read_only: bool,

    /// Size of the export: creates a sparse file of this size when the file does not exist;
    /// an existing file must already have it (it is never truncated). Example: --size 10G
    #[arg(long, value_name = "SIZE")]
    size: Option<String>,

    /// How a file or block device is read and written: "none" bypasses the page cache with
    /// O_DIRECT (the default for block devices), "writeback" goes through it (the default
    /// for regular files). FLUSH and FUA are honoured in both. With "none" the server keeps
    /// 64 MiB of I/O buffers registered with io_uring, locked in memory (where RLIMIT_MEMLOCK
    /// is too small for that, it runs without them). Example: --cache none
    #[arg(long, value_name = "MODE", value_parser = clap::builder::ValueParser::new(str::parse::<CacheMode>))]
    cache: Option<CacheMode>,

    /// A TOML file describing several exports (and listeners); see README.md.
    /// Example: --config /etc/netblk/exports.toml
    #[arg(long, value_name = "FILE", conflicts_with_all = ["backing", "name", "description", "read_only", "size", "cache"])]
    config: Option<PathBuf>,

    /// Disconnect clients that have not finished the handshake after this long.
    /// Example: --handshake-timeout 30s
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    handshake_timeout: Option<Duration>,

    /// For crash testing only: put a volatile write cache in front of every export
    /// ("powercut": unflushed, non-FUA writes live in memory until FLUSH, so SIGKILL acts as
    /// a power cut). Never use it for data you want to keep.
    #[arg(long, value_name = "KIND", value_parser = ["powercut"])]
    fault_injection: Option<String>,

    /// Merge adjacent reads that arrive together into one backend read of up to this size
    /// (0 turns merging off). Default 256K. Example: --max-merge 1M
    #[arg(long, value_name = "SIZE")]
    max_merge: Option<String>,

    /// Clients served at once, counting those still negotiating; one more is closed as
    /// soon as it connects (and logged). With the byte budget all connections share, this
    /// bounds the memory clients can make the server hold: 1 GiB plus 32 MiB per
    /// connection. Default 128. Example: --max-connections 512
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: Option<u32>,

    /// With a resource file (--config with a [resource] table): which node this is.
    /// Example: --config r0.toml --node alpha
    #[arg(long, value_name = "NAME", requires = "config")]
    node: Option<String>,

    /// With a resource file: start as the primary (refused if this node's data may be
    /// older than a peer's).
    #[arg(long, requires = "node")]
    primary: bool,

    /// TCP congestion control for every connection, clients and replication peers: a name
    /// from net.ipv4.tcp_available_congestion_control, or "system" for the kernel's default.
    /// Default cubic (why: ARCHITECTURE.md, data path). Example: --tcp-congestion bbr
    #[arg(long, value_name = "NAME")]
    tcp_congestion: Option<String>,

    /// Receive buffer of every TCP connection, clients and replication peers (sizes take K,
    /// M, G suffixes); 0 leaves it to the kernel's autotuning. Past net.core.rmem_max only
    /// with CAP_NET_ADMIN. Default 16M (why: ARCHITECTURE.md, data path).
    /// Example: --tcp-receive-buffer 64M
    #[arg(long, value_name = "SIZE")]
    tcp_receive_buffer: Option<String>,

    /// A control socket (a Unix socket path) for `netblk status --control PATH`: the
    /// exports, whether FLUSH still works on each, and the connected clients. A replicated
    /// node's control socket is named in its resource file instead.
    /// Example: --control /run/netblk.ctl
    #[arg(long, value_name = "PATH", conflicts_with = "node")]
    control: Option<PathBuf>,

    /// Serve metrics for Prometheus at http://HOST:PORT/metrics: requests and bytes per
    /// export, clients, I/O errors, whether FLUSH still works, and a replicated node's role,
    /// disk state, peers and resync progress. Plain HTTP with no authentication: bind it to
    /// a local or management address. Example: --metrics 127.0.0.1:9810
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<String>,

    /// Worker threads that serve connections (default: one per CPU). Example: --threads 2
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    threads: Option<u16>,
}

const DEFAULT_LISTEN: &str = "127.0.0.1:10809";
const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NETBLK_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .init();
    let result = match cli.command {
        Commands::Serve(args) => run_serve(*args),
        Commands::Status {
            target,
            watch: true,
            ..
        } => watch_resync(&target),
        Commands::Status { target, json, .. } => run_control_command(&target, "status", json),
        Commands::Promote { target, force } => {
            let request = if force { "promote --force" } else { "promote" };
            run_control_command(&target, request, false)
        }
        Commands::Demote { target } => run_control_command(&target, "demote", false),
        Commands::Verify { target } => run_control_command(&target, "verify", false),
        Commands::Outdate { target } => run_control_command(&target, "outdate", false),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // The reader of the output left (`netblk status --watch | head -1`): what was asked
        // was done, and there is nobody to tell (it used to panic, or print "Broken pipe"
        // after a promote that had succeeded).
        // Only a bare I/O error: that is a write to stdout (a control socket's errors come
        // wrapped in `ControlError`).
        Err(e)
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe) =>
        {
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("netblk: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_serve(args: ServeArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.config {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        if netblk::replication::config::is_resource_file(&text) {
            if args.control.is_some() {
                bail!("--control does not apply to a resource file: each node's control socket is in it");
            }
            return run_replicated(&args, path);
        }
        if args.node.is_some() {
            // Say why it is not one: a syntax error reads better than "no table".
            if let Err(e) = text.parse::<toml::Table>() {
                bail!("{}: {e}", path.display());
            }
            bail!("--node needs a resource file (one with a [resource] table)");
        }
    } else if args.node.is_some() || args.primary {
        // Serving a replicated backing without its resource file would change it
        // behind the peers' backs: no bitmap, no generation.
        bail!("--node and --primary need --config with the resource file");
    }
    let (exports, mut listen, timeout, congestion) = match &args.config {
        Some(path) => {
            let config = Config::load(path)?;
            (
                config.exports,
                config.listen,
                config.handshake_timeout,
                config.tcp_congestion,
            )
        }
        None => {
            let backing = args
                .backing
                .as_deref()
                .expect("clap requires BACKING without --config");
            let backing = BackingSpec::parse(backing).map_err(anyhow::Error::msg)?;
            let size = args
                .size
                .as_deref()
                .map(parse_size)
                .transpose()
                .map_err(anyhow::Error::msg)?;
            let export = ExportConfig {
                name: args.name.clone(),
                backing,
                description: args.description.clone(),
                read_only: args.read_only,
                size,
                cache: args.cache,
            };
            export.check().map_err(|(field, why)| {
                let option = match field {
                    "backing" => "BACKING",
                    "name" => "--name",
                    "description" => "--description",
                    "cache" => "--cache",
                    _ => "--size",
                };
                anyhow::anyhow!("{option}: {why}")
            })?;
            (vec![export], Vec::new(), None, None)
        }
    };
    let tcp = TcpSettings::choose(args.tcp_congestion.as_deref().or(congestion.as_deref()))?;
    let tcp = receive_buffer(tcp, &args)?;
    if !args.listen.is_empty() {
        listen = args.listen.clone();
    }
    if listen.is_empty() {
        listen.push(DEFAULT_LISTEN.to_string());
    }
    let addrs = listen
        .iter()
        .map(|l| ListenAddr::parse(l).map_err(|e| anyhow::anyhow!("--listen {e}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    if let Some(twice) = addrs
        .iter()
        .enumerate()
        .find_map(|(i, addr)| addrs[..i].contains(addr).then_some(&listen[i]))
    {
        bail!("listen address {twice} is given twice");
    }
    // Checked before any export is opened, which may create its file.
    let client_options = client_options(&args, timeout)?;
    // Unix sockets this start binds, removed again if it fails after them. (A backing
    // file it created stays: whole and of the size asked, the next start takes it; and
    // "created by this start" cannot be told from a file another start created at once.)
    let mut leftovers = Leftovers::default();
    let mut opened = Vec::new();
    let mut described = Vec::new();
    for export in exports {
        let backend = export
            .backing
            .open(export.size, export.read_only, export.cache)
            .with_context(|| format!("export {:?}", export.name))?;
        let backend: Arc<dyn netblk::backend::Backend> = match args.fault_injection.as_deref() {
            Some("powercut") => {
                tracing::warn!(export = %export.name, "fault injection: unflushed writes are kept in memory only");
                Arc::new(netblk::backend::powercut::PowerCut::new(backend))
            }
            _ => backend,
        };
        let (backing, on_disk) = match &export.backing {
            BackingSpec::Memory { size } => (format!("memory:{size}"), false),
            BackingSpec::Path(path) => (path.display().to_string(), true),
        };
        let opened_export = Arc::new(Export::new(export.name, export.description, backend));
        described.push(ExportDescription {
            export: Arc::clone(&opened_export),
            backing,
            on_disk,
        });
        opened.push(opened_export);
    }
    let connection_threads = match args.threads {
        Some(threads) => usize::from(threads),
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    // Connections run on threads of their own (`server::ConnectionThreads`), except those
    // to direct-I/O exports; this runtime accepts and negotiates, serves those, and runs
    // the shared tasks (signals, the io_uring reaper).
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(connection_threads)
        .enable_all()
        .build()
        .context("starting tokio")?;
    runtime.block_on(async move {
        // Handlers go in before "listening on" is printed, so a signal sent as soon as the
        // server reports ready is never taken with the default (fatal) action; the
        // connection threads start before it too.
        let shutdown = shutdown_signal()?;
        let threads = ConnectionThreads::start(connection_threads)?;
        let mut listeners = Vec::new();
        for addr in &addrs {
            let listener = addr.bind(&tcp).await?;
            if let ListenAddr::Unix(path) = addr {
                leftovers.0.push(path.clone());
            }
            listeners.push(listener);
        }
        // Bound before the server reports ready, so a status asked for at once is answered.
        let control = match &args.control {
            Some(path) => Some((
                netblk::control::bind(path)
                    .with_context(|| format!("binding control socket {}", path.display()))?,
                path.clone(),
            )),
            None => None,
        };
        if let Some((_, path)) = &control {
            leftovers.0.push(path.clone());
        }
        let metrics = match &args.metrics {
            Some(addr) => Some(netblk::metrics::bind(addr).await?),
            None => None,
        };
        let mut stdout = std::io::stdout().lock();
        if let Some(metrics) = &metrics {
            writeln!(
                stdout,
                "metrics on http://{}/metrics",
                metrics.local_addr()?
            )?;
        }
        for listener in &listeners {
            writeln!(stdout, "listening on {}", listener.describe())?;
        }
        stdout.flush()?;
        drop(stdout);
        // Started: from here the server and the control task remove their own sockets.
        leftovers.0.clear();
        let clients: Arc<Clients> = Default::default();
        let (stop_control, control_stopped) = tokio::sync::watch::channel(false);
        let state = Arc::new(ServerState {
            exports: described,
            clients: Arc::clone(&clients),
            started: std::time::Instant::now(),
        });
        let metrics = metrics.map(|listener| {
            let state = Arc::clone(&state);
            tokio::spawn(netblk::metrics::serve(
                listener,
                control_stopped.clone(),
                move || {
                    let text = netblk::metrics::render_server(&state.status());
                    std::future::ready(text)
                },
            ))
        });
        let control = control.map(|(listener, path)| {
            tokio::spawn(run_control(state, listener, path, control_stopped))
        });
        let config = ServerConfig {
            exports: opened,
            handshake_timeout: client_options.handshake_timeout,
            max_merge: client_options.max_merge,
            max_connections: client_options.max_connections,
            tcp,
            clients,
        };
        let served = serve_on(listeners, config, shutdown, Some(threads)).await;
        let _ = stop_control.send(true);
        if let Some(control) = control {
            // It removes its socket file as it ends.
            let _ = control.await;
        }
        if let Some(metrics) = metrics {
            let _ = metrics.await;
        }
        served
    })
}

/// Unix socket files this start bound, removed when dropped: a start that failed after
/// binding them. Cleared once the server runs (it removes them as it stops).
#[derive(Default)]
struct Leftovers(Vec<std::path::PathBuf>);

impl Drop for Leftovers {
    fn drop(&mut self) {
        for path in &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// `tcp` with the receive buffer `--tcp-receive-buffer` asks for, if it does.
fn receive_buffer(tcp: TcpSettings, args: &ServeArgs) -> anyhow::Result<TcpSettings> {
    let Some(text) = &args.tcp_receive_buffer else {
        return Ok(tcp);
    };
    let bytes = parse_size(text).map_err(|e| anyhow::anyhow!("--tcp-receive-buffer {e}"))?;
    let bytes = usize::try_from(bytes)
        .ok()
        .filter(|&b| b <= i32::MAX as usize)
        .ok_or_else(|| anyhow::anyhow!("--tcp-receive-buffer {text}: at most 2G"))?;
    Ok(tcp.with_receive_buffer(bytes))
}

/// The options for NBD clients, checked: `--handshake-timeout` (else the config file's,
/// `from_config`), `--max-merge`, `--max-connections`, each else its default.
fn client_options(
    args: &ServeArgs,
    from_config: Option<Duration>,
) -> anyhow::Result<ClientOptions> {
    Ok(ClientOptions {
        handshake_timeout: handshake_timeout(args, from_config)?,
        max_merge: max_merge(args)?,
        max_connections: args
            .max_connections
            .map_or(DEFAULT_MAX_CONNECTIONS, |n| n as usize),
    })
}

/// `--max-merge`, checked, or its default.
fn max_merge(args: &ServeArgs) -> anyhow::Result<u32> {
    let Some(text) = &args.max_merge else {
        return Ok(DEFAULT_MAX_MERGE);
    };
    let size = parse_size(text).map_err(|e| anyhow::anyhow!("--max-merge {e}"))?;
    u32::try_from(size)
        .ok()
        .filter(|&s| s <= MAX_PAYLOAD)
        .ok_or_else(|| anyhow::anyhow!("--max-merge {text}: at most 32M"))
}

/// `--handshake-timeout`, else the config file's, else the default; above zero.
fn handshake_timeout(args: &ServeArgs, from_config: Option<Duration>) -> anyhow::Result<Duration> {
    let timeout = args
        .handshake_timeout
        .or(from_config)
        .unwrap_or(DEFAULT_HANDSHAKE_TIMEOUT);
    if timeout.is_zero() {
        bail!("--handshake-timeout must be above zero");
    }
    Ok(timeout)
}

/// `netblk serve --config RESOURCE.toml --node NAME`: one node of a replicated export.
fn run_replicated(args: &ServeArgs, path: &std::path::Path) -> anyhow::Result<()> {
    use netblk::replication::{config::ResourceConfig, node::Node};
    let resource = ResourceConfig::load(path)?;
    let Some(name) = args.node.clone() else {
        bail!(
            "{} is a resource file: say which node this is with --node NAME",
            path.display()
        );
    };
    if !args.listen.is_empty() {
        bail!("--listen does not apply to a resource file: each node's listen address is in it");
    }
    let client_options = client_options(args, None)?;
    let tcp = receive_buffer(TcpSettings::choose(args.tcp_congestion.as_deref())?, args)?;
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = args.threads {
        runtime.worker_threads(usize::from(threads));
    }
    let runtime = runtime.enable_all().build().context("starting tokio")?;
    let primary = args.primary;
    runtime.block_on(async move {
        let shutdown = shutdown_signal()?;
        let powercut = args.fault_injection.as_deref() == Some("powercut");
        // Bound before the node, which opens (and marks) its metadata: a taken port must
        // change nothing there.
        let metrics = match &args.metrics {
            Some(addr) => Some(netblk::metrics::bind(addr).await?),
            None => None,
        };
        let mut node = Node::bind(resource, &name, primary, client_options, powercut, tcp).await?;
        let mut stdout = std::io::stdout().lock();
        if let Some(listener) = metrics {
            writeln!(
                stdout,
                "metrics on http://{}/metrics",
                listener.local_addr()?
            )?;
            node.serve_metrics(listener);
        }
        writeln!(stdout, "listening on {}", node.client_listener())?;
        writeln!(stdout, "replicating on {}", node.replication_listener())?;
        stdout.flush()?;
        drop(stdout);
        node.serve(shutdown).await
    })
}

/// Sends one request to a node's control socket and prints the answer.
/// The control socket a command names (directly, or through the resource file).
fn control_path(target: &ControlTarget) -> anyhow::Result<std::path::PathBuf> {
    use netblk::replication::config::ResourceConfig;
    Ok(match (&target.control, &target.config, &target.node) {
        (Some(path), _, _) => path.clone(),
        (None, Some(config), Some(node)) => {
            let text = netblk::config::ConfigError::read_text(config)?;
            // Valid TOML without [resource] (a plain server's config); other text gets
            // the parser's own error below.
            let plain = toml::from_str::<toml::Table>(&text).is_ok()
                && !netblk::replication::config::is_resource_file(&text);
            if plain {
                bail!(
                    "{} is not a resource file (no [resource] table): for a plain server, \
                     give its --control PATH",
                    config.display()
                );
            }
            let resource = ResourceConfig::parse(&text, &config.display().to_string())?;
            let path = resource
                .node(node)
                .map_err(anyhow::Error::msg)?
                .control
                .clone();
            // The socket must be this node's: two nodes on one host given one control
            // path (one refused at its start) sent `promote --node beta` to alpha, which
            // took it (re-review, session 69).
            let reply = netblk::control::request(&path, "status")?;
            // No status (busy, or a plain server): which node answers is not known, so
            // nothing is sent to it (re-review: a busy first answer waved a promote on).
            let Some(status) = reply.status else {
                bail!(
                    "cannot check which node {} answers for: {}",
                    path.display(),
                    if reply.ok {
                        "not a replicated node"
                    } else {
                        &reply.message
                    }
                );
            };
            if status.node != *node || status.resource != resource.name {
                bail!(
                    "{} answers for node {} of resource {}, not node {node} of {}: \
                     give each node its own control path",
                    path.display(),
                    status.node,
                    status.resource,
                    resource.name
                );
            }
            path
        }
        _ => bail!("give --config FILE --node NAME, or --control PATH"),
    })
}

/// `netblk status --watch`: resync progress until no peer is resyncing, as progress bars
/// (bytes, rate, ETA) in a terminal and as one plain line per second otherwise.
fn watch_resync(target: &ControlTarget) -> anyhow::Result<()> {
    use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
    use netblk::replication::control;
    use std::collections::HashMap;
    let path = control_path(target)?;
    let terminal = std::io::stdout().is_terminal();
    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template(
        "{prefix:>8} [{bar:40}] {bytes}/{total_bytes} {msg} ETA {eta}",
    )?
    .progress_chars("=> ");
    // This node is the peer's resync target: it does not know the pass's total.
    let target_style = ProgressStyle::with_template("{prefix:>8} {spinner} {msg}")?;
    let resync_from = |peer: &control::PeerStatus| {
        format!(
            "resync to this node: {} bytes compared ({} received) at {:.1} MiB/s",
            peer.resync_done_bytes,
            peer.resync_sent_bytes,
            control::mib(peer.resync_rate_bytes_per_sec)
        )
    };
    let mut shown: HashMap<String, ProgressBar> = HashMap::new();
    loop {
        let reply = netblk::control::request(&path, "status")?;
        if let Some(server) = &reply.server {
            // A plain server: nothing resyncs there.
            write!(
                std::io::stdout(),
                "{}",
                netblk::control::render_server(server)
            )?;
            return Ok(());
        }
        let Some(status) = reply.status else {
            bail!("status: {}", reply.message);
        };
        let running: Vec<_> = status.peers.iter().filter(|p| p.resyncing()).collect();
        if terminal {
            for peer in &running {
                let bar = shown.entry(peer.name.clone()).or_insert_with(|| {
                    let bar = bars.add(ProgressBar::new(peer.resync_total_bytes));
                    bar.set_style(if peer.link == "target" {
                        target_style.clone()
                    } else {
                        style.clone()
                    });
                    bar.set_prefix(peer.name.clone());
                    bar
                });
                if peer.link == "target" {
                    bar.set_message(resync_from(peer));
                    bar.tick();
                    continue;
                }
                bar.set_length(peer.resync_total_bytes);
                bar.set_position(peer.resync_done_bytes);
                // The server's rates, both: the bar's own would be bytes compared per
                // second only, while `resync_rate` limits bytes sent (re-review, session 67).
                bar.set_message(format!(
                    "compared {:.1} MiB/s, sent {:.1} MiB/s",
                    control::mib(peer.resync_rate_bytes_per_sec),
                    control::mib(peer.resync_sent_rate_bytes_per_sec)
                ));
            }
            for (name, bar) in &shown {
                if !running.iter().any(|p| &p.name == name) {
                    bar.finish();
                }
            }
        } else {
            for peer in running.iter().filter(|p| p.link == "target") {
                writeln!(std::io::stdout(), "{}: {}", peer.name, resync_from(peer))?;
            }
            for peer in running.iter().filter(|p| p.link != "target") {
                writeln!(
                    std::io::stdout(),
                    "{}: resync {}/{} bytes compared at {:.1} MiB/s, sent at {:.1} MiB/s, ETA {}",
                    peer.name,
                    peer.resync_done_bytes,
                    peer.resync_total_bytes,
                    control::mib(peer.resync_rate_bytes_per_sec),
                    control::mib(peer.resync_sent_rate_bytes_per_sec),
                    peer.resync_eta_seconds
                        .map_or("unknown".into(), |s| format!("{s} s"))
                )?;
            }
        }
        if running.is_empty() {
            if !terminal || shown.is_empty() {
                write!(std::io::stdout(), "{}", control::render(&status))?;
            }
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(if terminal {
            200
        } else {
            1000
        }));
    }
}

fn run_control_command(target: &ControlTarget, request: &str, json: bool) -> anyhow::Result<()> {
    let path = control_path(target)?;
    let reply = netblk::control::request(&path, request)?;
    let json_text = if json {
        Some(serde_json::to_string_pretty(&reply)?)
    } else {
        None
    };
    let printed = (|| -> std::io::Result<()> {
        let mut stdout = std::io::stdout().lock();
        if let Some(text) = &json_text {
            writeln!(stdout, "{text}")?;
        } else {
            // A refusal's reason goes to stderr once, below (it printed on both).
            if reply.ok && !reply.message.is_empty() {
                writeln!(stdout, "{}", reply.message)?;
            }
            if let Some(status) = &reply.status {
                write!(stdout, "{}", netblk::replication::control::render(status))?;
            }
            if let Some(server) = &reply.server {
                write!(stdout, "{}", netblk::control::render_server(server))?;
            }
        }
        Ok(())
    })();
    // A refusal is the command's outcome whether or not its text could be printed: a
    // reader that left early (`| grep -q`) must not turn it into success (re-review,
    // session 66).
    if !reply.ok {
        bail!("{request}: {}", reply.message);
    }
    printed?;
    Ok(())
}

/// The next SIGHUP, or never when it is ignored.
async fn hangup(hup: &mut Option<tokio::signal::unix::Signal>) {
    match hup {
        Some(signal) => {
            signal.recv().await;
        }
        None => std::future::pending().await,
    }
}

/// Whether this process started with SIGHUP ignored (`nohup`), from the `SigIgn` mask of
/// /proc/self/status (bit 0 is signal 1, SIGHUP).
fn sighup_ignored() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let mask = status.lines().find_map(|l| l.strip_prefix("SigIgn:"))?;
            u64::from_str_radix(mask.trim(), 16).ok()
        })
        .is_some_and(|mask| mask & 1 != 0)
}

/// A future that completes on SIGINT, SIGTERM or SIGHUP; the handlers are installed at
/// once. SIGHUP (the terminal that started the server closed) stops it as SIGTERM does:
/// by default it killed the process without the final flush and left its sockets behind
/// (review, session 66).
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    // Under `nohup` SIGHUP is ignored, and must stay so: a handler would replace the
    // inherited SIG_IGN, and the server would stop when its login session ended
    // (re-review, session 66).
    let mut hup = if sighup_ignored() {
        None
    } else {
        Some(signal(SignalKind::hangup()).context("installing the SIGHUP handler")?)
    };
    Ok(async move {
        tokio::select! {
            _ = int.recv() => tracing::info!("SIGINT received: finishing requests in flight (signal again to exit now)"),
            _ = term.recv() => tracing::info!("SIGTERM received: finishing requests in flight (signal again to exit now)"),
            () = hangup(&mut hup) => tracing::info!("SIGHUP received: finishing requests in flight (signal again to exit now)"),
        }
        // A second signal during the drain means "now": leave without waiting.
        tokio::spawn(async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
                () = hangup(&mut hup) => {}
            }
            tracing::warn!("second signal: exiting without waiting for requests in flight");
            std::process::exit(130);
        });
    })
}
