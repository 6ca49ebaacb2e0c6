//! An HTTPS endpoint in front of a started API, as a TLS-terminating proxy
//! in a real deployment: a certificate authority and a server certificate
//! for `127.0.0.1` and `localhost`, made for the run by rcgen, and a
//! rustls acceptor that forwards each connection's bytes to the API.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;

/// A TLS endpoint on a loopback port, served by a thread of its own (so a
/// test may block on a CLI run meanwhile); stops when dropped.
pub struct TlsProxy {
    /// `https://127.0.0.1:{port}`.
    pub base: String,
    /// The authority's certificate (PEM), for `--ca-cert`.
    pub ca_pem: PathBuf,
    /// Connections that completed a TLS handshake.
    pub handshakes: Arc<std::sync::atomic::AtomicUsize>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _directory: tempdir::Directory,
}

impl TlsProxy {
    /// Listens on a free loopback port and forwards to `target`.
    pub fn start(target: SocketAddr) -> TlsProxy {
        let directory = tempdir::Directory::new("quire-tls");
        let authority_key = rcgen::KeyPair::generate().expect("authority key");
        let mut authority_params =
            rcgen::CertificateParams::new(Vec::<String>::new()).expect("authority parameters");
        authority_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        authority_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "quire test authority");
        let authority = rcgen::CertifiedIssuer::self_signed(authority_params, authority_key)
            .expect("authority certificate");
        let server_key = rcgen::KeyPair::generate().expect("server key");
        let server_certificate =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .expect("server parameters")
                .signed_by(&server_key, &authority)
                .expect("server certificate");
        let ca_pem = directory.path().join("authority.pem");
        std::fs::write(&ca_pem, authority.pem()).expect("write the authority's certificate");

        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(
                vec![
                    CertificateDer::from(server_certificate.der().to_vec()),
                    authority.der().clone(),
                ],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server_key.serialize_der())),
            )
            .expect("server TLS configuration");
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener
            .set_nonblocking(true)
            .expect("non-blocking listener");
        let port = listener.local_addr().expect("address").port();
        let handshakes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&handshakes);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the proxy's runtime");
            runtime.block_on(async move {
                let listener = TcpListener::from_std(listener).expect("listener");
                let serve = async {
                    while let Ok((client, _)) = listener.accept().await {
                        let acceptor = acceptor.clone();
                        let counted = Arc::clone(&counted);
                        tokio::spawn(async move {
                            // A client that refuses the certificate ends here.
                            let Ok(mut client) = acceptor.accept(client).await else {
                                return;
                            };
                            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                            let Ok(mut api) = TcpStream::connect(target).await else {
                                return;
                            };
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut api).await;
                        });
                    }
                };
                tokio::select! {
                    () = serve => {}
                    _ = stopped => {}
                }
            });
        });
        TlsProxy {
            base: format!("https://127.0.0.1:{port}"),
            ca_pem,
            handshakes,
            stop: Some(stop),
            _directory: directory,
        }
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A temporary directory removed when dropped.
mod tempdir {
    use std::path::{Path, PathBuf};

    pub struct Directory(PathBuf);

    impl Directory {
        pub fn new(prefix: &str) -> Directory {
            let path = std::env::temp_dir().join(crate::unique(prefix));
            std::fs::create_dir_all(&path).expect("create a temporary directory");
            Directory(path)
        }

        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Directory {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}
