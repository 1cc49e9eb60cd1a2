//! One node of a replicated resource: opens its backing and metadata, binds the NBD and
//! replication listeners, and runs both until shutdown.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::watch;
use tracing::{info, warn};

use super::config::ResourceConfig;
use super::control::run_control;
use super::generation::JUST_CREATED;
use super::layer::{ReplicatedBackend, Shared};
use super::meta::{MetaError, Metadata};
use super::peer::run_replication;
use crate::server::{serve, ClientOptions, Export, Listener, ServerConfig};
use crate::tcp::TcpSettings;

/// A node with its listeners bound, ready to serve.
pub struct Node {
    pub shared: Arc<Shared>,
    replication: TcpListener,
    clients: Listener,
    control: UnixListener,
    control_path: PathBuf,
    client_options: ClientOptions,
    /// `--primary`: take the primary role once the peers have been heard from.
    take_primary: bool,
    /// `--metrics`: where to serve the node's metrics ([`crate::metrics`]).
    metrics: Option<TcpListener>,
}

impl Node {
    /// Binds node `name`'s listeners, then opens its backing and metadata. With `primary` the
    /// node takes the primary role in [`Node::serve`], once its peers have been heard from
    /// (see [`take_primary_role`]). `powercut` puts the fault-injection cache of
    /// `--fault-injection powercut` over the backing; the client listener uses
    /// `client_options` as a plain server does.
    ///
    /// The sockets come first: a start that cannot bind them (a taken port, a missing
    /// directory) must change nothing in the metadata, which opening does (hot extents of an
    /// unclean stop marked, the node marked in use). Until session 66 a failed start had
    /// written the metadata and even taken a generation, and the node was later refused by
    /// its peers as "unrelated data" (review).
    pub async fn bind(
        resource: ResourceConfig,
        name: &str,
        primary: bool,
        client_options: ClientOptions,
        powercut: bool,
        tcp: TcpSettings,
    ) -> anyhow::Result<Node> {
        let me = resource.node(name).map_err(anyhow::Error::msg)?.clone();
        let replication = tcp
            .bind(me.replication)
            .await
            .with_context(|| format!("binding replication address {}", me.replication))?;
        let clients = me.listen.bind(&tcp).await?;
        // The Unix socket files this start made, removed again if it fails after them.
        let remove_sockets = |control: bool| {
            if let crate::listen::ListenAddr::Unix(path) = &me.listen {
                let _ = std::fs::remove_file(path);
            }
            if control {
                let _ = std::fs::remove_file(&me.control);
            }
        };
        let control = match crate::control::bind(&me.control) {
            Ok(control) => control,
            Err(e) => {
                remove_sockets(false);
                return Err(anyhow::Error::new(e)
                    .context(format!("binding control socket {}", me.control.display())));
            }
        };
        let shared = match open_node(resource, name, &me, powercut, tcp).await {
            Ok(shared) => shared,
            Err(e) => {
                remove_sockets(true);
                return Err(e);
            }
        };
        Ok(Node {
            shared,
            replication,
            clients,
            control,
            control_path: me.control,
            client_options,
            take_primary: primary,
            metrics: None,
        })
    }

    /// Serves the node's metrics on `listener` once it runs ([`Node::serve`]).
    pub fn serve_metrics(&mut self, listener: TcpListener) {
        self.metrics = Some(listener);
    }

    /// The NBD listener, as the plain server prints it.
    pub fn client_listener(&self) -> String {
        self.clients.describe()
    }

    /// The replication listener.
    pub fn replication_listener(&self) -> String {
        self.replication
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| "?".into())
    }

    /// Serves NBD clients and peers until `shutdown` completes, then flushes and closes
    /// the metadata cleanly.
    pub async fn serve(self, shutdown: impl std::future::Future) -> anyhow::Result<()> {
        let mut shutdown = std::pin::pin!(shutdown);
        let (stop_tx, stop_rx) = watch::channel(false);
        let replication = tokio::spawn(run_replication(
            Arc::clone(&self.shared),
            self.replication,
            stop_rx.clone(),
        ));
        let control = tokio::spawn(run_control(
            Arc::clone(&self.shared),
            self.control,
            self.control_path,
            stop_rx.clone(),
        ));
        let export = Arc::new(Export::new(
            String::new(),
            format!(
                "replicated resource {} on node {}",
                self.shared.resource.name, self.shared.node
            ),
            Arc::new(ReplicatedBackend {
                shared: Arc::clone(&self.shared),
            }),
        ));
        let clients: Arc<crate::server::clients::Clients> = Default::default();
        let metrics = self.metrics.map(|listener| {
            let state = Arc::new(crate::server::control::ServerState {
                exports: vec![crate::server::control::ExportDescription {
                    export: Arc::clone(&export),
                    backing: format!("replicated resource {}", self.shared.resource.name),
                    on_disk: false,
                }],
                clients: Arc::clone(&clients),
                started: std::time::Instant::now(),
            });
            let shared = Arc::clone(&self.shared);
            tokio::spawn(crate::metrics::serve(
                listener,
                stop_rx.clone(),
                move || {
                    let text = crate::metrics::render_node(&state.status(), &shared.status());
                    std::future::ready(text)
                },
            ))
        });
        // Before any client is served: a client's write on a node that became primary
        // beside another would start a split brain. After the metrics are up: a scrape
        // during the wait hung until it ended, up to a peer timeout (review, session 69).
        // A stop signal during the wait ends it without taking the role (re-review, session
        // 66: the wait ignored SIGTERM and even a second SIGINT, then promoted and stopped).
        let mut stopped_early = false;
        if self.take_primary {
            tokio::select! {
                () = take_primary_role(&self.shared) => {}
                _ = &mut shutdown => {
                    info!("stopping before the primary role was taken");
                    stopped_early = true;
                }
            }
        }
        let config = ServerConfig {
            exports: vec![export],
            handshake_timeout: self.client_options.handshake_timeout,
            max_merge: self.client_options.max_merge,
            max_connections: self.client_options.max_connections,
            tcp: self.shared.tcp.clone(),
            clients,
        };
        let result = if stopped_early {
            serve(vec![self.clients], config, std::future::ready(())).await
        } else {
            serve(vec![self.clients], config, shutdown).await
        };
        // The final flush above reached every connected peer: nothing is missing there.
        self.shared.stop();
        let _ = stop_tx.send(true);
        let _ = replication.await;
        let _ = control.await;
        if let Some(metrics) = metrics {
            let _ = metrics.await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        // A secondary applied its primary's writes until the link ended, after the last
        // barrier it took: made durable here before the metadata says the stop was clean
        // (review, session 67: only the metadata was synced at a secondary's stop).
        let local_flush = if self.shared.is_detached() {
            Ok(())
        } else {
            self.shared.local.flush().await
        };
        let result = match (result, local_flush) {
            (Ok(()), Err(e)) => Err(anyhow::anyhow!("final flush of the local disk: {e}")),
            (result, _) => result,
        };
        if result.is_ok() {
            self.shared.close();
            info!("metadata closed cleanly");
        } else {
            // Writes since the last flush that succeeded may not be on this node's disk:
            // left marked in use, the metadata has the next start mark every extent in the
            // activity log out of sync, so a resync covers them.
            warn!("the final flush failed: metadata left marked in use, the next start resyncs the logged extents");
        }
        result
    }
}

/// Opens the node's backing and metadata (which a second process cannot hold: it is
/// locked) and builds its shared state.
async fn open_node(
    resource: ResourceConfig,
    name: &str,
    me: &super::config::NodeConfig,
    powercut: bool,
    tcp: TcpSettings,
) -> anyhow::Result<Arc<Shared>> {
    // A memory backing starts empty; a file that is missing now is created empty below
    // (`create_new`: nobody else's file).
    let blank_backing = match &me.backing {
        crate::backend::BackingSpec::Memory { .. } => true,
        crate::backend::BackingSpec::Path(path) => !path.exists(),
    };
    // The size a blank backing will have (none: opening it fails with the reason).
    let blank_size = match &me.backing {
        _ if !blank_backing => None,
        crate::backend::BackingSpec::Memory { size } => {
            Some(*size).filter(|size| resource.size.map_or(true, |wanted| wanted == *size))
        }
        crate::backend::BackingSpec::Path(_) => resource.size,
    };
    let (path, node, resource_name) =
        (me.metadata.clone(), name.to_string(), resource.name.clone());
    let peers: Vec<String> = resource.peers_of(name).map(|n| n.name.clone()).collect();
    let open_metadata = move |size: u64| {
        let (path, node, resource_name, peers) = (
            path.clone(),
            node.clone(),
            resource_name.clone(),
            peers.clone(),
        );
        tokio::task::spawn_blocking(move || {
            let mut meta = Metadata::open_or_create(
                &path,
                &node,
                &resource_name,
                &peers,
                size,
                blank_backing,
            )?;
            let held_data = meta.superblock().generations.current != JUST_CREATED;
            if blank_backing && held_data {
                meta.forget_data()?;
            }
            Ok::<_, MetaError>((meta, blank_backing && held_data))
        })
    };
    // Over a blank backing the metadata comes first: that the data is gone is on disk
    // before the new file is, so no crash or failed start in between leaves an empty
    // file under metadata that still claims the data (re-review, session 70).
    let early = match blank_size {
        Some(size) => Some(open_metadata(size).await.context("metadata task")??),
        None => None,
    };
    let backend = me
        .backing
        .open(resource.size, false, me.cache)
        .with_context(|| format!("node {name:?} backing"))?;
    // Crash tests only: unflushed writes stay in memory, so SIGKILL loses them.
    let backend: Arc<dyn crate::backend::Backend> = if powercut {
        Arc::new(crate::backend::powercut::PowerCut::new(backend))
    } else {
        backend
    };
    let (meta, forgotten) = match early {
        Some(opened) => opened,
        None => open_metadata(backend.size())
            .await
            .context("metadata task")??,
    };
    if forgotten {
        warn!(
            "the backing is new (empty) but the metadata says this node held data: it now \
             counts as a new node without data (inconsistent), resynced in full from a peer"
        );
    }
    // Another disk or image at the backing's path holds data of unknown age.
    let backing_path = match &me.backing {
        crate::backend::BackingSpec::Path(path) => Some(path.clone()),
        crate::backend::BackingSpec::Memory { .. } => None,
    };
    let (meta, replaced) = tokio::task::spawn_blocking(move || {
        let mut meta = meta;
        let replaced = meta.check_backing(backing_path.as_deref())?;
        Ok::<_, MetaError>((meta, replaced))
    })
    .await
    .context("metadata task")??;
    if let (Some(why), false) = (replaced, forgotten) {
        warn!(
            "the backing is not the one this node's metadata describes ({why}): a disk \
             replaced, or an image created anew, rewritten or restored, at the same path \
             holds data of unknown age. The node now counts as a new node without data \
             (inconsistent), resynced in full from a peer; `netblk promote --force` keeps \
             this data instead"
        );
    }
    if meta.recovered_extents() > 0 {
        warn!(
            "the last shutdown was not clean: {} hot extents marked out of sync",
            meta.recovered_extents()
        );
    }
    Ok(Shared::new(backend, resource, name, meta, tcp)?)
}

/// `--primary`: takes the primary role once every peer is connected, or after the
/// resource's `peer_timeout` for those that are not, with the checks of `netblk promote`.
/// Promoting before any hello (as until session 66) let a node that restarted with
/// `--primary` beside a live primary take the role too and accept a client's write: a
/// split brain the checks would have refused (review). Refused, the node stays up as a
/// secondary (it may be resynced meanwhile) and says why. An operator's `promote` or
/// `demote` during the wait decides instead: a demote was overridden by the promotion at
/// the end of the wait (review, session 66).
async fn take_primary_role(shared: &Shared) {
    let deadline = tokio::time::Instant::now() + shared.resource.peer_timeout;
    let all_connected = || shared.peers.iter().all(super::layer::PeerSlot::linked);
    // A new node waits for its peers as long as it takes: the first primary is chosen
    // with every node present (`Shared::promote_checked`), so the timeout would only
    // have it refused (and a peer starting a second late would find no primary).
    let new_node = shared.local_state().1.current == JUST_CREATED;
    if !all_connected() {
        if new_node {
            info!(
                "--primary: waiting for every peer before taking the first primary role \
                 (a new node waits as long as it takes; `netblk promote --force` takes the \
                 role alone)"
            );
        } else {
            info!(
                "--primary: waiting up to {:?} for the peers before taking the primary role",
                shared.resource.peer_timeout
            );
        }
    }
    while !all_connected()
        && !shared.role_commanded()
        && (new_node || tokio::time::Instant::now() < deadline)
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    match shared.promote_unless_commanded() {
        // Links made with this node as a secondary are redone with the new role.
        Ok(true) => shared.announce_primary_and_reconnect(),
        Ok(false) if shared.role_commanded() => {
            info!("--primary: an operator's promote or demote came first; it decides the role");
        }
        Ok(false) => {}
        Err(e) => tracing::error!(
            "--primary refused: {e}; this node stays secondary (`netblk promote` takes the \
             role later)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_node_binds_its_listeners_with_its_own_tcp_settings() {
        // The replication listener and a TCP client listener both carry the node's settings,
        // so peer links and clients start under the chosen algorithm (see crate::tcp).
        let dir = tempfile::tempdir().unwrap();
        // A resource names fixed replication ports: take a free one.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let text = format!(
            "[resource]\nname = \"r\"\nsize = \"8M\"\n\
             [[node]]\nname = \"alpha\"\nreplication = \"127.0.0.1:{port}\"\nlisten = \"127.0.0.1:0\"\n\
             backing = \"memory:8M\"\nmetadata = \"{dir}/alpha.meta\"\n\
             [[node]]\nname = \"beta\"\nreplication = \"127.0.0.1:9\"\nlisten = \"127.0.0.1:0\"\n\
             backing = \"memory:8M\"\nmetadata = \"{dir}/beta.meta\"\n",
            dir = dir.path().display()
        );
        let resource = ResourceConfig::parse(&text, "test").unwrap();
        let tcp = TcpSettings::choose(Some("reno")).unwrap();
        let node = Node::bind(
            resource,
            "alpha",
            false,
            ClientOptions {
                handshake_timeout: Duration::from_secs(5),
                max_merge: crate::server::DEFAULT_MAX_MERGE,
                max_connections: crate::server::DEFAULT_MAX_CONNECTIONS,
            },
            false,
            tcp,
        )
        .await
        .unwrap();
        use crate::tcp::test_support::algorithm;
        assert_eq!(algorithm(&node.replication), "reno");
        let crate::server::Listener::Tcp(clients) = &node.clients else {
            panic!("a TCP client listener was asked for");
        };
        assert_eq!(algorithm(clients), "reno");
        assert_eq!(node.shared.tcp.congestion(), Some("reno"));
        node.shared.close();
    }
}
